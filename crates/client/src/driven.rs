//! [`DrivenConnection`]: a userspace connection whose relay is driven by
//! calls instead of a task, with the server's bytes passed in and out by the
//! caller (no socket, no clock).
//!
//! It is the same machinery a [`Connection`](crate::Connection) runs: its
//! [`TransferQueue`]s hand commands to the same budgeted hand-over, the
//! relay's [`ApiFront`] moves them into the same [`ClientSession`] and gives
//! each reply to its waiter. Only the relay's loop (`relay::poll_drive`:
//! reading, writing, timers, reconnecting) is the caller's, one step per
//! call. For deterministic tests and fuzzing of what runs on a connection
//! (the usbredir bridge's [`BridgeCore`](crate::redir::BridgeCore)); not for
//! moving URBs to a real server, which [`Connection`](crate::Connection) does.

use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Instant;

use bytes::BytesMut;
use usbwire_proto::client_session::{ClientSession, ClientSessionError};
use usbwire_proto::{Budget, Limits, Outbox};

use crate::relay::{Front, RelayError, Step};
use crate::waiters::{ApiFront, Handle, Shared, Waiter};
use crate::TransferQueue;

/// A connection's queues, hand-over and session, stepped by the caller.
pub struct DrivenConnection {
    devid: u32,
    /// Held until [`end`](Self::end): the relay side ends once every handle is gone.
    handle: Option<Handle>,
    shared: Arc<Shared>,
    front: ApiFront,
    session: ClientSession<Waiter>,
    budget: Budget,
}

impl DrivenConnection {
    /// A connection to the imported device `devid`, keeping to `budget` as a
    /// [`Connection`](crate::Connection) keeps to its own.
    pub fn new(devid: u32, budget: Budget) -> Self {
        let (shared, handle) = Shared::new(budget.clone());
        let front = ApiFront::new(shared.clone());
        let session = ClientSession::new(devid, BytesMut::new(), Limits::default(), budget.clone());
        Self { devid, handle: Some(handle), shared, front, session, budget }
    }

    /// As a server that granted resume with keep-alive: acknowledgements and
    /// pings go out, and silence is declared after `usbwire_proto::liveness`'s
    /// bounds, counted from `now`.
    pub fn resumable_with_keepalive(mut self, now: Instant) -> Self {
        self.session = self.session.resumable().keepalive(now);
        self
    }

    /// A queue for URBs, as [`Connection::queue`](crate::Connection::queue).
    pub fn queue(&self) -> TransferQueue {
        match &self.handle {
            Some(handle) => TransferQueue::new(self.devid, handle.clone()),
            None => {
                // Ended: a queue that fails every submit, as one of a closed connection does.
                let (shared, handle) = Shared::new(self.budget.clone());
                shared.close();
                TransferQueue::new(self.devid, handle)
            }
        }
    }

    /// Moves the callers' commands into the session while it wants them (the
    /// relay's "front -> session" step). Returns whether any moved; an error
    /// ends the connection as it ends a relay (call [`end`](Self::end)).
    pub fn take_commands(&mut self) -> Result<bool, RelayError> {
        if !self.session.wants_commands() {
            return Ok(false);
        }
        let mut cx = Context::from_waker(Waker::noop());
        Ok(matches!(self.front.poll_commands(&mut cx, &mut self.session)?, Step::Progressed))
    }

    /// The bytes for the server: take them from the front
    /// ([`Outbox::slices`], [`Outbox::advance`]).
    pub fn to_server(&mut self) -> &mut Outbox {
        self.session.outbox()
    }

    /// The server's bytes in (the relay's "server -> session -> front" step):
    /// replies decoded and handed to their waiters, those before an error too.
    pub fn handle_server(&mut self, bytes: &[u8]) -> Result<(), ClientSessionError> {
        self.session.input().extend_from_slice(bytes);
        self.front.take_replies(&mut self.session).handled
    }

    /// Queues the acknowledgement of the replies received, as an idle relay
    /// does (resumable sessions). Returns whether it queued one.
    pub fn acknowledge(&mut self) -> bool {
        self.session.acknowledge()
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.session.poll_timeout()
    }

    /// Runs the keep-alive timer at `now` (see [`ClientSession::handle_timeout`];
    /// the caller always listens). `Silent` means the link is dead: call
    /// [`end`](Self::end).
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), ClientSessionError> {
        self.session.handle_timeout(now, true)
    }

    /// The link is gone and the session with it, as when a relay ends: the
    /// connection is closed, its queues' pending URBs fail as disconnected.
    pub fn end(&mut self) {
        self.handle = None;
        self.front.ended();
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.shared.is_closed()
    }

    /// Commands accepted from the callers and not answered, and their bytes:
    /// what the budget's in-flight limits hold on this side of the session.
    pub fn accepted(&self) -> (usize, usize) {
        self.shared.accepted()
    }

    /// Seqnums outstanding in the session (sent, or waiting to be).
    pub fn outstanding(&self) -> usize {
        self.session.outstanding()
    }

    /// The budget it keeps to.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }
}
