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
    let busid = BusId::new(&args.device.busid)
        .ok_or_else(|| Failure::usage(anyhow!("invalid bus id {:?}", args.device.busid)))?;
    // Check vhci before asking the server, so a missing module costs nothing remote.
    vhci::ports().map_err(vhci_failure)?;
    let addr = super::list::resolve(&args.device.remote, args.device.tcp_port).await?;
    let transforms = super::bench::transforms(args.compress.as_deref(), args.jitter_buffer);
    if args.device.security.tls || !transforms.is_empty() {
        return attach_through_relay(&args, busid, &transforms).await;
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

/// `attach --tls`: vhci-hcd speaks plain USB/IP on whatever socket it is
/// given, so it gets one end of a Unix socket pair and this process relays
/// between the other end and the TLS connection. The relay lives as long as
/// the attachment: `usbwire detach` (or the device going away) ends both, and
/// SIGINT/SIGTERM detach the port before exiting.
async fn attach_through_relay(
    args: &AttachArgs,
    busid: BusId,
    transforms: &[usbwire_client::TransformSpec],
) -> Result<(), Failure> {
    vhci::ports().map_err(vhci_failure)?;
    let security = super::client_security(&args.device.security)?;
    let addr = super::list::resolve(&args.device.remote, args.device.tcp_port).await?;
    let shutdown = super::shutdown_signal();
    let (stream, device) = usbwire_client::import_with(addr, &busid, &security, transforms).await?;
    let (kernel_end, our_end) = std::os::unix::net::UnixStream::pair().map_err(|e| Failure::io(e.into()))?;
    let record =
        vhci::Record { host: addr.ip().to_string(), service: addr.port().to_string(), busid: busid.to_string() };
    let port = vhci::attach(&kernel_end, device.devid(), device.speed, &record).map_err(vhci_failure)?;
    drop(kernel_end);
    our_end.set_nonblocking(true).map_err(|e| Failure::io(e.into()))?;
    let kernel = tokio::net::UnixStream::from_std(our_end).map_err(|e| Failure::io(e.into()))?;
    println!(
        "attached {busid} from {addr} to port {port} ({} speed){}{}; relaying until `usbwire detach -p {port}`",
        device.speed.for_vhci().name(),
        if stream.is_tls() { " over TLS" } else { "" },
        if transforms.is_empty() {
            String::new()
        } else {
            format!(" with {}", usbwire_client::TransformSpec::list_text(transforms))
        }
    );
    tokio::select! {
        result = relay(stream, kernel) => {
            let _ = std::fs::remove_file(vhci::record_path(port));
            match result {
                Ok(()) => println!("port {port} detached; relay stopped"),
                Err(error) => {
                    let _ = vhci::detach(port);
                    return Err(Failure::unavailable(anyhow!("relay for port {port} ended: {error}")));
                }
            }
        }
        () = shutdown => {
            let _ = vhci::detach(port);
            println!("port {port} detached on signal");
        }
    }
    Ok(())
}

/// Copies both ways until either side closes, flushing TLS after every write.
pub(crate) async fn relay(
    remote: usbwire_transport::PeerStream,
    kernel: tokio::net::UnixStream,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut remote_read, mut remote_write) = tokio::io::split(remote);
    let (mut kernel_read, mut kernel_write) = kernel.into_split();
    let upstream = async {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = kernel_read.read(&mut buf).await?;
            if n == 0 {
                return Ok::<(), std::io::Error>(());
            }
            remote_write.write_all(&buf[..n]).await?;
            remote_write.flush().await?;
        }
    };
    let downstream = async {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = remote_read.read(&mut buf).await?;
            if n == 0 {
                return Ok::<(), std::io::Error>(());
            }
            kernel_write.write_all(&buf[..n]).await?;
        }
    };
    // Whichever side ends first ends the attachment.
    tokio::select! {
        result = upstream => result,
        result = downstream => result,
    }
}
