//! Why a server could not start ([`ServerError`]): each variant says what to
//! do about it. Errors of a running connection are logged where they happen
//! and never reach here.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::private_dir::PrivateDirError;

/// Errors that stop the server from starting.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The listen address is taken or not ours; pick another with `--listen`.
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    /// The control socket could not be created; pass `--control PATH` to put it elsewhere.
    #[error("cannot create control socket {path}: {source}")]
    Control { path: PathBuf, source: std::io::Error },
    /// The control socket's directory is not one only we can change (another
    /// user's, writable by others, a symlink); the message says what to do.
    #[error("control socket {path}: {reason}")]
    ControlDir { path: PathBuf, reason: PrivateDirError },
    /// The capture directory is not one only we can change (another user's,
    /// writable by others, a symlink); the message says what to do.
    #[error("capture directory: {0}")]
    CaptureDir(PrivateDirError),
    /// A device process socket (`--virtual external=unix:PATH`) could not be
    /// made: its directory is not one only we can change, or a server uses it.
    #[error("device process socket {}: {reason}", .path.display())]
    External { path: PathBuf, reason: crate::private_dir::SocketError },
    /// The metrics or status page address is taken or not ours; pick another with `--metrics` / `--http`.
    #[error("cannot serve HTTP (metrics or status page) on {addr}: {source}")]
    Metrics { addr: SocketAddr, source: std::io::Error },
    /// The threads connections run on could not be started (out of threads or
    /// memory: see `ulimit -u` and the system's thread limit).
    #[error("cannot start the connection threads: {0}")]
    Threads(std::io::Error),
}
