//! Device processes (`--virtual external=unix:PATH`): the Unix socket each
//! connects to, and its device's coming and going in the export list.
//!
//! The socket is made like the control socket (mode 0600 in a directory only
//! the server's user can change, a planted link never followed: see
//! [`crate::private_dir::bind_socket`]) and only the server's user and root
//! may connect (`SO_PEERCRED`). One device process at a time: while one is
//! connected, another is refused with the reason. Its device is exported
//! under a bus id set aside when the server starts, so it comes back under
//! the same one: listed once the process has said hello and its descriptors
//! are read, withdrawn (as unplugged) when it disconnects, breaks the
//! protocol or leaves a request unanswered.
//!
//! Not for the protocol itself: that is `usbwire-external`.

use std::path::PathBuf;

use bytes::BytesMut;
use tokio::io::AsyncWriteExt as _;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tracing::{info, warn, Instrument as _};
use usbwire_external::{attach, Message, Options};
use usbwire_proto::op::BusId;

use crate::error::ServerError;
use crate::registry::{Registry, VIRTUAL_BUS};

/// What `kind` an external device is listed as.
pub const EXTERNAL_KIND: &str = "external";

/// A device process socket, before it is bound.
#[derive(Clone, Debug)]
pub(crate) struct ExternalExport {
    pub(crate) path: PathBuf,
    pub(crate) busid: BusId,
    pub(crate) devnum: u32,
    pub(crate) options: Options,
}

/// A bound device process socket.
pub(crate) struct ExternalSocket {
    listener: UnixListener,
    export: ExternalExport,
}

impl ExternalSocket {
    pub(crate) fn bind(export: ExternalExport) -> Result<Self, ServerError> {
        let path = export.path.clone();
        let failed = |source| ServerError::External { path: path.clone(), reason: source };
        let listener = crate::private_dir::bind_socket(&path, None).map_err(failed)?;
        let io = |source| failed(crate::private_dir::SocketError::Io { path: path.clone(), source });
        listener.set_nonblocking(true).map_err(io)?;
        let listener = UnixListener::from_std(listener).map_err(io)?;
        info!(path = %path.display(), busid = %export.busid, "waiting for a device process");
        Ok(Self { listener, export })
    }

    /// Accepts device processes until the server stops.
    pub(crate) async fn serve(self, registry: Registry, mut stop: watch::Receiver<bool>) {
        let mut current: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            let running = async {
                match current.as_mut() {
                    Some(task) => drop(task.await),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = crate::shutdown::stopped(&mut stop) => break,
                () = running => current = None,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        if let Err(reason) = crate::private_dir::check_peer(&stream, "external device") {
                            tokio::spawn(refuse(stream, reason));
                        } else if current.is_some() {
                            let reason = format!(
                                "a device process is already connected at {}; stop it first, or serve this \
                                 device on another socket (--virtual external=unix:PATH)",
                                self.export.path.display()
                            );
                            tokio::spawn(refuse(stream, reason));
                        } else {
                            let span = tracing::info_span!("external", busid = %self.export.busid);
                            current = Some(tokio::spawn(run(stream, self.export.clone(), registry.clone()).instrument(span)));
                        }
                    }
                    Err(error) => {
                        warn!(%error, "device process socket accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                }
            }
        }
        if let Some(task) = current {
            task.abort();
        }
        registry.unplugged(self.export.busid.as_str());
        let _ = std::fs::remove_file(&self.export.path);
    }
}

/// One device process: attached, exported, and withdrawn when it is gone.
async fn run(stream: UnixStream, export: ExternalExport, registry: Registry) {
    let (device, attached) = match attach(stream, &export.options).await {
        Ok(attached) => attached,
        Err(error) => {
            warn!(%error, "device process not attached");
            return;
        }
    };
    let path = sys_path(&export.busid);
    let numbers = (VIRTUAL_BUS, export.devnum);
    if registry.add_named(EXTERNAL_KIND, export.busid.clone(), numbers, path, Box::new(device)).is_err() {
        warn!("bus id still taken by the device process before; this one is not exported");
        return;
    }
    let why = attached.ended().await;
    registry.unplugged(export.busid.as_str());
    info!(%why, "device process gone; export withdrawn until it connects again");
}

fn sys_path(busid: &BusId) -> String {
    format!("/sys/devices/usbwire/{EXTERNAL_KIND}/{busid}")
}

/// Tells a refused device process why, and closes.
async fn refuse(mut stream: UnixStream, reason: String) {
    let mut frame = BytesMut::new();
    Message::Refuse { reason }.encode(&mut frame);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), stream.write_all(&frame)).await;
    let _ = stream.shutdown().await;
}
