//! `usbwire attach / port / detach`: the kernel's vhci-hcd as the client,
//! with our OP phase in front (works with usbipd and usbipd-win servers too).

use anyhow::anyhow;
use serde_json::json;
use usbwire_client::vhci::{self, VhciError};
use usbwire_proto::op::BusId;

use crate::args::{AttachArgs, DetachArgs, PortArgs};
use crate::exit::Failure;

fn vhci_failure(error: VhciError) -> Failure {
    match error {
        VhciError::NotLoaded | VhciError::NoFreePort { .. } | VhciError::PortNotInUse(_) => {
            Failure::unavailable(error.into())
        }
        _ => Failure::io(error.into()),
    }
}

pub(crate) async fn attach(args: AttachArgs) -> Result<(), Failure> {
    let busid = BusId::new(&args.busid).ok_or_else(|| Failure::usage(anyhow!("invalid bus id {:?}", args.busid)))?;
    // Check vhci before asking the server, so a missing module costs nothing remote.
    vhci::ports().map_err(vhci_failure)?;
    let addr = super::list::resolve(&args.remote, args.tcp_port).await?;
    if args.security.tls {
        // vhci-hcd speaks plain USB/IP on the socket it is given; TLS needs a relay
        // process between the two, which is not built yet.
        return Err(Failure::usage(anyhow!(
            "kernel attach over TLS needs the local relay, which this version does not have yet; attach without --tls on a trusted network, or use the userspace client"
        )));
    }
    let (stream, device) = usbwire_client::import(addr, &busid, &usbwire_client::Security::Plain).await?;
    let usbwire_transport::PeerStream::Plain(tcp) = stream else {
        return Err(Failure::software(anyhow!("a plain import returned a TLS stream")));
    };
    let socket = tcp.into_std().map_err(|e| Failure::io(e.into()))?;
    let record =
        vhci::Record { host: addr.ip().to_string(), service: addr.port().to_string(), busid: busid.to_string() };
    let port = vhci::attach(&socket, device.devid(), device.speed, &record).map_err(vhci_failure)?;
    // The kernel holds its own reference to the socket now.
    drop(socket);
    println!("attached {busid} from {addr} to port {port} ({} speed)", device.speed.for_vhci().name());
    Ok(())
}

pub(crate) fn port(args: PortArgs) -> Result<(), Failure> {
    let ports = vhci::ports().map_err(vhci_failure)?;
    let used: Vec<_> = ports.iter().filter(|p| !p.is_free()).collect();
    if args.json {
        let list: Vec<_> = used
            .iter()
            .map(|p| {
                let record = vhci::read_record(p.port);
                json!({
                    "port": p.port,
                    "hub": p.hub,
                    "status": p.status,
                    "speed": p.speed.name(),
                    "devid": format!("{:08x}", p.devid),
                    "local_busid": p.local_busid,
                    "remote_host": record.as_ref().map(|r| r.host.clone()),
                    "remote_port": record.as_ref().map(|r| r.service.clone()),
                    "remote_busid": record.as_ref().map(|r| r.busid.clone()),
                })
            })
            .collect();
        println!("{}", json!({ "ports": list }));
        return Ok(());
    }
    println!("Imported USB devices\n====================");
    for p in used {
        println!(
            "Port {:02}: <{}> at {} speed",
            p.port,
            if p.status == 6 { "Port in Use" } else { "Port Initializing" },
            p.speed.name()
        );
        match vhci::read_record(p.port) {
            Some(r) => println!("       -> usbip://{}:{}/{}", r.host, r.service, r.busid),
            None => println!("       -> (no record of the remote device)"),
        }
        println!("       local bus id {}", p.local_busid);
    }
    Ok(())
}

pub(crate) fn detach(args: DetachArgs) -> Result<(), Failure> {
    vhci::detach(args.port).map_err(vhci_failure)?;
    println!("port {} detached", args.port);
    Ok(())
}
