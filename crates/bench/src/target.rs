//! The usbwire side of a link measurement: the device to measure, imported
//! ([`open`]), and the in-process server with a loopback device that
//! `usbwire bench --local`, `usbwire demo` and the client's `urb_path_count`
//! example measure when no server is named ([`local_loopback`]), or the one
//! with a virtual disk that `usbwire bench --storage` measures ([`local_disk`]).
//! Not for the measuring itself ([`measure`](crate::measure),
//! [`matrix`](crate::matrix), [`storage_rate`](crate::storage_rate)).

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::oneshot;
use usbwire_client::{Connection, Security, TransformSpec};
use usbwire_device::Speed;
use usbwire_proto::op::BusId;
use usbwire_server::{Server, ServerConfig};
use usbwire_transport::transform::TransformStats;

use crate::BenchError;

/// Imports the device to measure, resumably when `resume` (then the wire
/// counters of the transforms are inside the relay, out of reach).
pub async fn open(
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
    transforms: &[TransformSpec],
    resume: bool,
) -> Result<(Connection, Option<Arc<TransformStats>>), BenchError> {
    if resume {
        let (conn, _) = Connection::import_resumable(addr, busid, security, transforms).await?;
        if !conn.is_resumable() {
            return Err(BenchError::Unavailable(format!(
                "{addr} did not grant resume (not usbwire, or --resume-grace 0)"
            )));
        }
        return Ok((conn, None));
    }
    let (stream, record) = usbwire_client::import_with(addr, busid, security, transforms).await?;
    let wire = stream.transform_stats();
    Ok((Connection::new(stream, &record), wire))
}

/// An in-process server with one loopback device on 127.0.0.1, on a thread of
/// its own like the ceiling's ideal server (see [`crate::server_thread`]).
/// Blocks until it listens.
pub fn local_loopback() -> Result<(SocketAddr, BusId), BenchError> {
    let (busid_tx, busid_rx) = std::sync::mpsc::channel();
    let addr = crate::server_thread("usbwire-server", move || async move {
        let config = ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            control_path: None,
            ..ServerConfig::default()
        };
        let mut server = Server::new(config);
        let _ = busid_tx.send(server.export("loopback", Box::new(usbwire_gadgets::loopback(Speed::HIGH))));
        let bound = server.bind().await.map_err(std::io::Error::other)?;
        let addr = bound.local_addr();
        tokio::spawn(bound.run(std::future::pending()));
        Ok(addr)
    })
    .map_err(BenchError::Loopback)?;
    let busid = busid_rx.recv().map_err(|e| BenchError::Internal(e.into()))?;
    Ok((addr, busid))
}

/// An in-process server exporting one virtual disk, its image in a private
/// temporary directory ([`local_disk`]). Dropping it stops the server and
/// removes the directory and the image.
#[derive(Debug)]
pub struct LocalDisk {
    pub addr: SocketAddr,
    pub busid: BusId,
    /// Dropped first: the server lets go of the image before its directory goes.
    _stop: oneshot::Sender<()>,
    _dir: tempfile::TempDir,
}

/// An in-process server on 127.0.0.1 with a mass-storage device backed by a
/// new sparse image of `size` bytes (a multiple of 512) in a private
/// temporary directory (0700, removed when the [`LocalDisk`] is dropped), on
/// a thread of its own like [`local_loopback`]'s. Blocks until it listens.
pub fn local_disk(size: u64) -> Result<LocalDisk, BenchError> {
    let dir = tempfile::Builder::new().prefix("usbwire-bench-").tempdir().map_err(|e| {
        BenchError::Io(std::io::Error::new(e.kind(), format!("a temporary directory for the disk image: {e}")))
    })?;
    let options =
        usbwire_gadgets::DiskOptions { size: Some(size), read_only: false, speed: Speed::HIGH, bad_blocks: None };
    let disk = usbwire_gadgets::MassStorage::open_no_follow(&dir.path().join("disk.img"), &options)
        .map_err(|e| BenchError::Unavailable(format!("the virtual disk: {e}")))?;
    let (busid_tx, busid_rx) = std::sync::mpsc::channel();
    let (stop, stopped) = oneshot::channel::<()>();
    let addr = crate::server_thread("usbwire-server", move || async move {
        let config = ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            control_path: None,
            ..ServerConfig::default()
        };
        let mut server = Server::new(config);
        let _ = busid_tx.send(server.export("disk", Box::new(disk)));
        let bound = server.bind().await.map_err(std::io::Error::other)?;
        let addr = bound.local_addr();
        tokio::spawn(bound.run(async move {
            let _ = stopped.await;
        }));
        Ok(addr)
    })
    .map_err(BenchError::Loopback)?;
    let busid = busid_rx.recv().map_err(|e| BenchError::Internal(e.into()))?;
    Ok(LocalDisk { addr, busid, _stop: stop, _dir: dir })
}
