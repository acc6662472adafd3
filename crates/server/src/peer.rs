//! The other end of a session, as the files that serve it see it: its
//! address, its place in the admission budgets, and a probe that tells a
//! later importer whether it has hung up.
//!
//! It sits below the registry (which keeps a holder's probe), the parked
//! sessions (which take a resuming connection's peer) and the OP phase that
//! makes it. It is not for reading or writing the connection.

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use crate::admission::Ticket;

/// The other end of a session: its address, its place in the admission
/// budgets, and a probe a later importer uses to see whether it hung up.
pub(crate) struct Peer {
    pub(crate) addr: SocketAddr,
    pub(crate) ticket: Ticket,
    pub(crate) probe: PeerProbe,
}

/// Tells whether the peer of a connection has hung up, without reading from it.
///
/// Holds a duplicate of the connection's socket descriptor, so the number it
/// checks can never be reused by another socket while the probe lives. That
/// also keeps the socket open until the probe is dropped, which the registry
/// does as soon as the lease ends.
pub(crate) struct PeerProbe(Option<OwnedFd>);

impl PeerProbe {
    /// A probe on `socket` (a duplicate of its descriptor); without one when
    /// the descriptor cannot be duplicated (then the peer always counts as present).
    pub(crate) fn of(socket: &impl AsFd) -> Self {
        Self(socket.as_fd().try_clone_to_owned().ok())
    }

    /// For connections with no socket (in-process sessions): always present.
    pub(crate) fn none() -> Self {
        Self(None)
    }

    /// Whether the peer has closed or reset the connection. Data still queued
    /// for reading does not hide it (`POLLRDHUP`).
    pub(crate) fn peer_gone(&self) -> bool {
        let Some(fd) = &self.0 else { return false };
        let mut poll = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: one valid pollfd, and a zero timeout; the descriptor is owned by `self`.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        ready == 1 && poll.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}
