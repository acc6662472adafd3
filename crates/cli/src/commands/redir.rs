//! `usbwire redir`: a remote device offered to a QEMU guest through usbredir
//! (the bridge itself is `usbwire_client::redir`).

use anyhow::anyhow;
use usbwire_client::redir::{self, GuestSide, Source, WantedDevice};
use usbwire_proto::op::BusId;

use super::common::stdout::status_line;
use crate::args::RedirArgs;
use crate::config::RedirListen;
use crate::exit::Failure;

pub(crate) async fn run(args: RedirArgs) -> Result<(), Failure> {
    let busid = BusId::new(&args.device.busid)
        .ok_or_else(|| Failure::usage(anyhow!("invalid bus id {:?}", args.device.busid)))?;
    let addr = super::common::peer::resolve(&args.device.remote, args.device.tcp_port).await?;
    let security = super::common::peer::client_security(&args.device.security)?;
    // A bus id names a port: the bridge follows whatever comes back there (a DFU board's bootloader).
    let source =
        Source { addr, device: WantedDevice::BusId(busid), security, transforms: Vec::new(), follow: !args.no_follow };
    let bridge = match (&args.listen, &args.connect) {
        (Some(listen), _) => match listen.parse::<RedirListen>().map_err(Failure::usage)? {
            RedirListen::Unix(path) => {
                let group = match &args.group {
                    Some(group) => Some(crate::config::group_id(group).map_err(Failure::config)?),
                    None => None,
                };
                let listener = super::common::local_server::bind_unix_guest_socket(&path, group, "--listen")?;
                status_line!("usbredir for {} on unix:{}", args.device.busid, path.display());
                boxed(redir::serve_listener(source, listener))
            }
            RedirListen::Tcp(_) if args.group.is_some() => {
                return Err(Failure::config(anyhow!("--group is for --listen unix:PATH, not a TCP port")));
            }
            RedirListen::Tcp(_) if !args.redir_tcp_unauthenticated => {
                return Err(Failure::config(anyhow!(
                    "--listen {listen}: usbredir has no authentication, so anyone who reaches a TCP port gets \
                     the device (and reads what it carries). Use a Unix socket, --listen unix:PATH (QEMU: \
                     -chardev socket,path=PATH), which only this user (or --group) may open; or, if every \
                     process that can reach {listen} may have the device, add --redir-tcp-unauthenticated"
                )));
            }
            RedirListen::Tcp(_) => {
                boxed(redir::run(source, GuestSide::Listen(guest_address(listen, "--listen").await?)))
            }
        },
        (None, Some(connect)) => {
            boxed(redir::run(source, GuestSide::Connect(guest_address(connect, "--connect").await?)))
        }
        (None, None) => return Err(Failure::usage(anyhow!("give --listen unix:PATH or --connect ADDR:PORT"))),
    };
    tokio::select! {
        outcome = bridge => outcome.map_err(|e| Failure::unavailable(e.into())),
        _ = super::common::process::shutdown_signal() => Ok(()),
    }
}

/// The bridge, boxed so the listening and the connecting kind are one type.
fn boxed<'a>(
    bridge: impl std::future::Future<Output = Result<(), redir::BridgeError>> + Send + 'a,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), redir::BridgeError>> + Send + 'a>> {
    Box::pin(bridge)
}

/// HOST:PORT (a name or an address) for the guest side.
async fn guest_address(text: &str, flag: &str) -> Result<std::net::SocketAddr, Failure> {
    let mut addrs = tokio::net::lookup_host(text)
        .await
        .map_err(|e| Failure::usage(anyhow!("{flag} {text}: not a HOST:PORT this machine can resolve ({e})")))?;
    addrs.next().ok_or_else(|| Failure::usage(anyhow!("{flag} {text}: the name has no address")))
}
