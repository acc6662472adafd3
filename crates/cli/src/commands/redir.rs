//! `usbwire redir`: a remote device offered to a QEMU guest through usbredir
//! (the bridge itself is `usbwire_client::redir`). A bus id the server does
//! not export is refused before anything listens, and the guest socket is
//! removed when the bridge ends (SIGINT and SIGTERM included).

use anyhow::anyhow;
use usbwire_client::redir::{self, GuestSide, Source, WantedDevice};
use usbwire_proto::display::escape;
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
    check_exported(addr, &security, &busid, &args.device.remote).await?;
    // A bus id names a port: the bridge follows whatever comes back there (a DFU board's bootloader).
    let source =
        Source { addr, device: WantedDevice::BusId(busid), security, transforms: Vec::new(), follow: !args.no_follow };
    // The guest socket goes when we do, on SIGINT and SIGTERM too (dropped at the end of this fn):
    // the signals are ours from before the socket is made and the status line says so.
    let shutdown = super::common::process::shutdown_signal();
    let mut socket: Option<RemovedOnExit> = None;
    let bridge = match (&args.listen, &args.connect) {
        (Some(listen), _) => match listen.parse::<RedirListen>().map_err(Failure::usage)? {
            RedirListen::Unix(path) => {
                let group = match &args.group {
                    Some(group) => Some(crate::config::group_id(group).map_err(Failure::config)?),
                    None => None,
                };
                let listener = super::common::local_server::bind_unix_guest_socket(&path, group, "--listen")?;
                socket = Some(RemovedOnExit::new(path.clone()));
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
    let outcome = tokio::select! {
        outcome = bridge => outcome.map_err(|e| Failure::unavailable(e.into())),
        () = shutdown => Ok(()),
    };
    drop(socket);
    outcome
}

/// Refuses a bus id the server does not export, before any socket is made:
/// exit 65 (data: the bus id names nothing there), not 69 (unavailable),
/// which is for a device that is there but taken, or a server that does not
/// answer. A usbwire server's device state lists every device this client
/// may see, in use or not, and those withdrawn lately (a followed port may
/// bring them back). A stock usbipd lists only free devices, and a server
/// that does not answer now may later: both are said, and the bridge waits
/// for its guests as before.
async fn check_exported(
    addr: std::net::SocketAddr,
    security: &usbwire_client::Security,
    busid: &BusId,
    remote: &str,
) -> Result<(), Failure> {
    use usbwire_client::ClientError;
    let wanted = busid.as_str();
    match usbwire_client::server_state(addr, security).await {
        Ok(Some(document)) if document.tls_required => {
            Err(Failure::unavailable(anyhow!("{remote}: {}", usbwire_client::refusal::TLS_REQUIRED)))
        }
        Ok(Some(document)) => {
            if document.devices.iter().any(|d| d.busid == wanted)
                || document.withdrawn.iter().any(|w| w.busid == wanted)
            {
                return Ok(());
            }
            let exported: Vec<String> = document.devices.iter().map(|d| escape(&d.busid).to_string()).collect();
            let exported = if exported.is_empty() { "none".to_owned() } else { exported.join(", ") };
            Err(Failure::data(anyhow!(
                "{remote} exports no device {wanted} (it exports: {exported}; `usbwire list -r {remote}` shows them)"
            )))
        }
        Ok(None) => match usbwire_client::list_devices(addr, security).await {
            Ok(devices) if devices.iter().any(|d| d.busid.as_str() == wanted) => Ok(()),
            Ok(_) => {
                tracing::warn!(
                    "{remote} lists no free device {wanted} now (it does not say which are in use): guests get it \
                     once it is exported and free"
                );
                Ok(())
            }
            Err(error) => Err(error.into()),
        },
        Err(error @ (ClientError::Connect { .. } | ClientError::Timeout { .. })) => {
            tracing::warn!(%error, "the server does not answer now; guests get {wanted} once it does");
            Ok(())
        }
        Err(error) => Err(error.into()),
    }
}

/// A Unix socket this process made, removed when dropped unless something
/// else has replaced it since (another bridge started on the same path).
struct RemovedOnExit {
    path: std::path::PathBuf,
    made: Option<(u64, u64)>,
}

impl RemovedOnExit {
    fn new(path: std::path::PathBuf) -> Self {
        let made = identity(&path);
        Self { path, made }
    }
}

impl Drop for RemovedOnExit {
    fn drop(&mut self) {
        if self.made.is_some() && identity(&self.path) == self.made {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The device and inode of what is at `path` (not following a link).
fn identity(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(path).ok().map(|meta| (meta.dev(), meta.ino()))
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
