//! `usbwire redir`: a remote device offered to a QEMU guest through usbredir
//! (the bridge itself is `usbwire_client::redir`).

use anyhow::anyhow;
use usbwire_client::redir::{self, GuestSide, Source, WantedDevice};
use usbwire_proto::op::BusId;

use crate::args::RedirArgs;
use crate::exit::Failure;

pub(crate) async fn run(args: RedirArgs) -> Result<(), Failure> {
    let busid = BusId::new(&args.device.busid)
        .ok_or_else(|| Failure::usage(anyhow!("invalid bus id {:?}", args.device.busid)))?;
    let addr = super::list::resolve(&args.device.remote, args.device.tcp_port).await?;
    let security = super::client_security(&args.device.security)?;
    let guest = match (&args.listen, &args.connect) {
        (Some(listen), _) => GuestSide::Listen(guest_address(listen, "--listen").await?),
        (None, Some(connect)) => GuestSide::Connect(guest_address(connect, "--connect").await?),
        (None, None) => return Err(Failure::usage(anyhow!("give --listen ADDR:PORT or --connect ADDR:PORT"))),
    };
    let source = Source { addr, device: WantedDevice::BusId(busid), security, transforms: Vec::new() };
    tokio::select! {
        outcome = redir::run(source, guest) => outcome.map_err(|e| Failure::unavailable(e.into())),
        _ = super::shutdown_signal() => Ok(()),
    }
}

/// HOST:PORT (a name or an address) for the guest side.
async fn guest_address(text: &str, flag: &str) -> Result<std::net::SocketAddr, Failure> {
    let mut addrs = tokio::net::lookup_host(text)
        .await
        .map_err(|e| Failure::usage(anyhow!("{flag} {text}: not a HOST:PORT this machine can resolve ({e})")))?;
    addrs.next().ok_or_else(|| Failure::usage(anyhow!("{flag} {text}: the name has no address")))
}
