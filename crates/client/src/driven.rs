//! [`DrivenConnection`]: a userspace connection whose relay is driven by
//! calls instead of a task, with the server's bytes passed in and out by the
//! caller (no socket, no clock).
//!
//! It is the same machinery a [`Connection`](crate::Connection) runs: its
//! [`TransferQueue`]s encode their commands into the same [`ClientSession`],
//! shared behind the same lock and held to the same budget, and the relay's
//! front ([`Callers`](crate::waiters::Callers), held through [`ApiFront`]) takes the session's bytes
//! for the server and gives each reply to its waiter. Only the relay's loop
//! (`relay::poll_drive`: reading, writing, timers, reconnecting) is the
//! caller's, one step per call. For
//! deterministic tests and fuzzing of what runs on a connection (the usbredir
//! bridge's [`BridgeCore`](crate::redir::BridgeCore)); not for moving URBs to
//! a real server, which [`Connection`](crate::Connection) does.

use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Instant;

use usbwire_proto::client_session::{ClientSession, ClientSessionError, READ_CHUNK};
use usbwire_proto::{Budget, Limits, Outbox, RecvBuffer};

use crate::relay::{Front, Hold, RelayError, Step};
use crate::waiters::{ApiFront, Handle, Shared, Waiter};
use crate::TransferQueue;

/// A connection's queues, session and hand-over, stepped by the caller.
pub struct DrivenConnection {
    devid: u32,
    /// Held until [`end`](Self::end): the relay side ends once every handle is gone.
    handle: Option<Handle>,
    shared: Arc<Shared>,
    front: ApiFront,
    budget: Budget,
    /// The server's bytes not decoded yet, as the relay reads them.
    input: RecvBuffer,
    /// The session's bytes taken for the server, as the relay takes them to write.
    wire: Outbox,
}

impl DrivenConnection {
    /// A connection to the imported device `devid`, keeping to `budget` as a
    /// [`Connection`](crate::Connection) keeps to its own.
    pub fn new(devid: u32, budget: Budget) -> Self {
        Self::with_session(devid, budget.clone(), ClientSession::new(devid, Limits::default(), budget))
    }

    fn with_session(devid: u32, budget: Budget, session: ClientSession<Waiter>) -> Self {
        let (shared, handle) = Shared::new(session, None);
        let front = ApiFront::new(shared.clone());
        let input = RecvBuffer::with_capacity(READ_CHUNK);
        Self { devid, handle: Some(handle), shared, front, budget, input, wire: Outbox::default() }
    }

    /// As a server that granted resume with keep-alive: acknowledgements and
    /// pings go out, and silence is declared after `usbwire_proto::liveness`'s
    /// bounds, counted from `now`. (A new connection: make its queues after.)
    pub fn resumable_with_keepalive(self, now: Instant) -> Self {
        let session = ClientSession::new(self.devid, Limits::default(), self.budget.clone());
        Self::with_session(self.devid, self.budget.clone(), session.resumable().keepalive(now))
    }

    /// A queue for URBs, as [`Connection::queue`](crate::Connection::queue).
    pub fn queue(&self) -> TransferQueue {
        match &self.handle {
            Some(handle) => TransferQueue::new(self.devid, handle.clone()),
            None => {
                // Ended: a queue that fails every submit, as one of a closed connection does.
                let session = ClientSession::new(self.devid, Limits::default(), self.budget.clone());
                let (shared, handle) = Shared::new(session, None);
                shared.close();
                TransferQueue::new(self.devid, handle)
            }
        }
    }

    /// Takes the commands the callers gave the session since the last step
    /// (their bytes, for [`to_server`](Self::to_server)): the relay's
    /// "session -> server" step. Returns whether any moved; an error (a
    /// command the session refused) ends the connection as it ends a relay
    /// (call [`end`](Self::end)).
    pub fn take_commands(&mut self) -> Result<bool, RelayError> {
        if self.is_closed() {
            return Ok(false);
        }
        let wire = &mut self.wire;
        self.front.hold(|session, callers| {
            let mut moved = session.outbox().hand_over(wire);
            if let Step::Progressed = callers.poll_commands(&mut Context::from_waker(Waker::noop()), session)? {
                moved |= session.outbox().hand_over(wire);
            }
            Ok(moved)
        })
    }

    /// The bytes for the server, those the callers gave the session since
    /// the last step included: take them from the front
    /// ([`Outbox::slices`], [`Outbox::advance`]).
    pub fn to_server(&mut self) -> &mut Outbox {
        if !self.is_closed() {
            let wire = &mut self.wire;
            self.front.hold(|session, _| session.outbox().hand_over(wire));
        }
        &mut self.wire
    }

    /// The server's bytes in (the relay's "server -> session -> front" step):
    /// replies decoded and handed to their waiters, those before an error too;
    /// then what a dropped queue left goes in as they made room. An error
    /// (the server's, or a command the session refused) ends the connection
    /// (call [`end`](Self::end)). Nothing once the connection ended.
    pub fn handle_server(&mut self, bytes: &[u8]) -> Result<(), ClientSessionError> {
        if self.is_closed() {
            return Ok(());
        }
        self.input.extend_from_slice(bytes);
        let input = &mut self.input;
        self.front.hold(|session, callers| {
            let handled = session.handle_input(input, |event| callers.deliver(event));
            let mut cx = Context::from_waker(Waker::noop());
            let refused = callers.poll_commands(&mut cx, session);
            callers.poll_flush(&mut cx);
            handled?;
            match refused {
                Err(RelayError::Server(error)) => Err(error),
                _ => Ok(()),
            }
        })
    }

    /// Queues the acknowledgement of the replies received, as an idle relay
    /// does (resumable sessions). Returns whether it queued one.
    pub fn acknowledge(&mut self) -> bool {
        self.shared.with_session(|session| session.acknowledge()).unwrap_or(false)
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next, if ever
    /// (never once the connection ended).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.shared.with_session(|session| session.poll_timeout()).flatten()
    }

    /// Runs the keep-alive timer at `now` (see [`ClientSession::handle_timeout`];
    /// the caller always listens). `Silent` means the link is dead: call
    /// [`end`](Self::end).
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), ClientSessionError> {
        self.shared.with_session(|session| session.handle_timeout(now, true)).unwrap_or(Ok(()))
    }

    /// The link is gone and the session with it, as when a relay ends: the
    /// connection is closed, its queues' pending URBs fail as disconnected.
    pub fn end(&mut self) {
        self.handle = None;
        self.shared.close();
        self.wire.clear();
        self.input.clear();
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
        self.shared.with_session(|session| session.outstanding()).unwrap_or(0)
    }

    /// The budget it keeps to.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }
}
