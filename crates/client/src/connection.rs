//! [`Connection`]: an imported device's URB channel in userspace.
//!
//! Every connection is a [`relay`] task driving the device's
//! [`ClientSession`](usbwire_proto::client_session::ClientSession), which
//! keeps to the connection's [`Budget`]. Callers put their commands, each with
//! its waiter, straight into the session, under the lock they share with the
//! relay (`waiters`), while the budget has room, and wait for room past it;
//! the relay writes what they encoded, reads the replies and gives each
//! straight to its waiter. A plain
//! connection is a relay without a resume token: when its link drops, what is
//! pending fails as disconnected. A resumable one
//! ([`Connection::import_resumable`]) reconnects and resumes instead, so
//! callers see a delay, not an error, until the relay gives up.
//! [`Connection::ended`] says how it ended: closed by its users, lost, or
//! ended by the server because the device re-enumerated (what a usbredir
//! bridge that follows the device acts on).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};
use tracing::{debug, warn, Instrument};
use usbwire_proto::op::{BusId, DeviceRecord};
use usbwire_proto::urb::{CmdUnlink, RetSubmit};
use usbwire_proto::Budget;
use usbwire_transport::PeerStream;

use crate::accelerators::Accelerators;
use crate::relay::{self, RelayError, RelayState, Upstream};
use crate::transfer::build_submit;
use crate::waiters::{ApiFront, Handle, Request, Shared, Waiter};
use crate::{ClientError, Imported, Security, StorageCounters, Transfer, TransferError, TransferQueue, TransformSpec};

/// How long a resumable connection keeps trying to reach its server before
/// it gives the session up (as `usbwire attach` does). A server that no
/// longer holds the session refuses at once; this bounds an unreachable one.
pub const RESUME_GIVE_UP: Duration = Duration::from_secs(120);

/// How a connection's relay ended (see [`Connection::ended`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectionEnd {
    /// Its users closed it (or dropped it and every queue).
    Closed,
    /// The server ended the session because the device re-enumerated at the
    /// same bus id (END `REENUMERATED`, `docs/protocol.md` §5.3): the replies
    /// before it were delivered; import the bus id again to follow it.
    Reenumerated,
    /// The link or the session was lost (a stock server closing on an
    /// unplug or a re-enumeration looks like this), with the relay's reason.
    Lost(String),
}

/// The URB channel of an imported device.
pub struct Connection {
    devid: u32,
    /// Held until the connection is dropped or closed.
    handle: Handle,
    shared: std::sync::Arc<Shared>,
    /// The relay ends by itself once every handle is gone (close, or the
    /// connection and its queues dropped) and it has sent what they handed
    /// over, or when the session is lost.
    relay: tokio::task::JoinHandle<()>,
    /// The relay's state, when the session is resumable.
    states: Option<watch::Receiver<RelayState>>,
    /// How the relay ended, once it has.
    end: watch::Receiver<Option<ConnectionEnd>>,
}

impl Connection {
    /// Starts the relay on an imported device's socket (no resume).
    pub fn new(stream: PeerStream, device: &DeviceRecord) -> Self {
        // The address only names the server in logs and errors.
        let addr = stream.peer_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let upstream = Upstream {
            addr,
            security: Security::Plain,
            transforms: Vec::new(),
            resume: None,
            give_up_after: Duration::ZERO,
            storage: false,
            descriptors: None,
        };
        let span = tracing::debug_span!(target: "usbwire::client", "connection", %addr, devid = device.devid());
        Self::start(stream, device.devid(), upstream, span)
    }

    /// Imports `busid` offering resume ([`crate::import_resumable`]). When the
    /// server grants it, the connection survives drops of its link: the relay
    /// reconnects and resumes the session (see [`relay`]), and transfers in
    /// flight or submitted meanwhile complete late instead of failing. Only
    /// when the session is lost (the server's grace period ran out, it
    /// restarted, or it stayed unreachable for [`RESUME_GIVE_UP`]) do they
    /// fail with [`TransferError::Disconnected`], as after a plain drop.
    /// Without resume (a stock server, `--resume-grace 0`) this is
    /// [`crate::import_with`] and [`Connection::new`].
    pub async fn import_resumable(
        addr: SocketAddr,
        busid: &BusId,
        security: &Security,
        transforms: &[TransformSpec],
    ) -> Result<(Self, DeviceRecord), ClientError> {
        let imported = crate::import_resumable(addr, busid, security, transforms).await?;
        Ok(Self::from_imported(imported, addr, security, transforms))
    }

    /// The connection of a device imported from `addr` (with `security` and
    /// `transforms`, which a resumable session reconnects with): resumable
    /// when the server granted resume, as [`Connection::import_resumable`].
    pub fn from_imported(
        imported: Imported,
        addr: SocketAddr,
        security: &Security,
        transforms: &[TransformSpec],
    ) -> (Self, DeviceRecord) {
        let device = imported.device;
        if imported.resume.is_none() {
            return (Self::new(imported.stream, &device), device);
        }
        let upstream = Upstream {
            addr,
            security: security.clone(),
            transforms: transforms.to_vec(),
            resume: imported.resume,
            give_up_after: RESUME_GIVE_UP,
            storage: imported.storage,
            descriptors: imported.descriptors,
        };
        let busid = &device.busid;
        let span = tracing::info_span!(target: "usbwire::client", "resumable", %addr, %busid, devid = device.devid());
        (Self::start(imported.stream, device.devid(), upstream, span), device)
    }

    fn start(stream: PeerStream, devid: u32, upstream: Upstream, span: tracing::Span) -> Self {
        let accelerators = Accelerators::new(devid, &upstream);
        let (shared, handle) = Shared::new(relay::new_session(devid, &upstream, Budget::default()), accelerators);
        let resumable = upstream.resume.is_some();
        let (state, states) = match resumable {
            true => {
                let (state, states) = watch::channel(RelayState::Connected);
                (Some(state), Some(states))
            }
            false => (None, None),
        };
        let mut front = ApiFront::new(shared.clone());
        let (ending, end) = watch::channel(None);
        let relay = tokio::spawn(
            async move {
                let result = relay::drive(&mut front, stream, upstream, state).await;
                front.log_acceleration();
                // Closes the connection: what is pending fails as disconnected.
                drop(front);
                let ended = match result {
                    Ok(()) => {
                        debug!("connection closed; relay ended");
                        ConnectionEnd::Closed
                    }
                    // What was pending failed as disconnected (the front closed the connection).
                    Err(RelayError::Reenumerated { addr }) => {
                        debug!(%addr, "the device re-enumerated; the server ended the session");
                        ConnectionEnd::Reenumerated
                    }
                    Err(error @ RelayError::Server(_)) => {
                        warn!(%error, "the server sent a malformed reply; connection closed");
                        ConnectionEnd::Lost(error.to_string())
                    }
                    Err(error) if resumable => {
                        warn!(%error, "relay ended");
                        ConnectionEnd::Lost(error.to_string())
                    }
                    Err(error) => {
                        debug!(%error, "urb channel closed");
                        ConnectionEnd::Lost(error.to_string())
                    }
                };
                ending.send_replace(Some(ended));
            }
            .instrument(span),
        );
        Self { devid, handle, shared, relay, states, end }
    }

    /// Resolves once the relay has ended, with how (at once if it has). The
    /// future holds nothing of the connection, so it can outlive it.
    pub fn ended(&self) -> impl std::future::Future<Output = ConnectionEnd> + Send + 'static {
        let mut end = self.end.clone();
        async move {
            match end.wait_for(Option::is_some).await {
                Ok(ended) => ended.clone().unwrap_or(ConnectionEnd::Closed),
                // The relay task went without a word (the runtime is shutting down).
                Err(_) => ConnectionEnd::Lost("the connection's relay task stopped".into()),
            }
        }
    }

    /// What the storage accelerator did: `None` unless it runs (the server
    /// agreed to the storage extension with resume, `docs/protocol.md` §5.7).
    /// A device's Bulk-Only commands run through it as through `usbwire
    /// attach`'s relay, one at a time as usb-storage runs them.
    pub fn storage_counters(&self) -> Option<StorageCounters> {
        self.shared.storage_counters()
    }

    /// Whether the server granted resume (see [`Connection::import_resumable`]).
    pub fn is_resumable(&self) -> bool {
        self.states.is_some()
    }

    /// The relay's state (connected, or resuming since when) and its changes;
    /// `None` when the connection is not resumable.
    pub fn relay_states(&self) -> Option<watch::Receiver<RelayState>> {
        self.states.clone()
    }

    /// Ends the connection cleanly and waits (up to a second) until it has: what was
    /// submitted is written, then the stream is shut down (over TLS with close_notify,
    /// so the server logs a client that left, not a cut connection). Dropping a
    /// `Connection` does the same in the background; a short-lived process that exits
    /// right after should close instead. Transfer queues still alive keep it open.
    pub async fn close(self) {
        let deadline = Instant::now() + Duration::from_secs(1);
        let Self { handle, relay, .. } = self;
        // The last handle gone, the relay sends what it was handed and ends.
        drop(handle);
        let _ = tokio::time::timeout_at(deadline.into(), relay).await;
    }

    /// Submits a transfer, waiting while the connection's budget of URBs and
    /// bytes in flight is full; returns its seqnum and a future for the reply.
    pub async fn submit(
        &self,
        transfer: Transfer,
    ) -> Result<(u32, impl std::future::Future<Output = Result<RetSubmit, TransferError>>), TransferError> {
        if self.shared.is_closed() {
            return Err(TransferError::Disconnected);
        }
        let seqnum = self.shared.next_seqnum();
        let submit = build_submit(self.devid, seqnum, transfer);
        let (tx, rx) = oneshot::channel();
        self.shared.send_one(Request::Submit(submit, Waiter::Future(tx))).await?;
        Ok((seqnum, async move { rx.await.map_err(|_| TransferError::Disconnected) }))
    }

    /// A queue for URBs submitted and collected by one task: completions come
    /// back in batches, without a future per URB (see [`TransferQueue`]).
    pub fn queue(&self) -> TransferQueue {
        TransferQueue::new(self.devid, self.handle.clone())
    }

    /// Submits and waits for the reply (whatever its status).
    pub async fn transfer(&self, transfer: Transfer) -> Result<RetSubmit, TransferError> {
        let (_, reply) = self.submit(transfer).await?;
        reply.await
    }

    /// Submits, waits, and turns a failure status into a typed [`TransferError`].
    pub async fn transfer_checked(&self, transfer: Transfer) -> Result<RetSubmit, TransferError> {
        let ret = self.transfer(transfer).await?;
        match TransferError::from_status(ret.status) {
            Some(error) => Err(error),
            None => Ok(ret),
        }
    }

    /// Asks the server to cancel the URB `seqnum`. Its reply (if any) still
    /// resolves the submit future; a URB cancelled without a RET_SUBMIT
    /// resolves with [`Status::ECONNRESET`](usbwire_proto::Status::ECONNRESET).
    pub async fn unlink(&self, target: u32) -> Result<(), TransferError> {
        let unlink = CmdUnlink { seqnum: self.shared.next_seqnum(), devid: self.devid, unlink_seqnum: target };
        self.shared.send_one(Request::Unlink(unlink)).await
    }

    /// Whether the connection is gone (closed by the server, failed, or its
    /// session lost): nothing submitted now will complete.
    pub fn is_closed(&self) -> bool {
        // The flag is set before pending transfers fail, so they never see it unset.
        self.shared.is_closed() || self.relay.is_finished()
    }
}
