//! [`TransferQueue`]: many URBs in flight from one task, completions collected
//! in batches (the shape of nusb's `Queue`: `submit`, `next_complete`).
//!
//! Why it exists beside [`Connection::submit`](crate::Connection::submit):
//! a future per URB costs a oneshot channel, a wake-up per reply and, on a
//! multi-threaded runtime, often a cross-thread wake. A queue encodes
//! everything submitted since it last waited into the session at once (one
//! lock, one wake of the relay), and the relay appends replies to the queue's
//! inbox and wakes it once per socket read, however many replies that read
//! held.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll};

use usbwire_proto::urb::{CmdUnlink, RetSubmit};

use crate::inbox::Inbox;
use crate::transfer::build_submit;
use crate::waiters::{Handle, Request, Waiter};
use crate::{Transfer, TransferError};

/// URBs submitted and collected by one task ([`Connection::queue`](crate::Connection::queue)).
///
/// [`submit`](Self::submit) does not wait and does not write: the URBs go out
/// together, in submission order, when the queue next waits for a completion
/// ([`next_complete`](Self::next_complete)) or is dropped. Completions come
/// back in the order the server sends them (per endpoint that is submission
/// order). Other users of the same [`Connection`](crate::Connection) are not
/// affected; [`unlink`](Self::unlink) (or
/// [`Connection::unlink`](crate::Connection::unlink)) cancels a queued URB by
/// the seqnum `submit` returned, and its completion then arrives here.
///
/// The connection takes URBs while those in flight on it (from every queue
/// and future) are within its budget; the rest wait here, unsent, until
/// replies make room. A caller that must not hold more than the budget checks
/// [`pending`](Self::pending) before it submits more.
pub struct TransferQueue {
    devid: u32,
    handle: Handle,
    inbox: Arc<Inbox>,
    /// This queue's id among the connection's queues.
    id: u64,
    /// Submitted and not yet collected.
    pending: usize,
    /// Replies taken from the inbox in one swap, handed out without its lock.
    ready: VecDeque<RetSubmit>,
    /// Commands not handed to the connection yet, in order.
    unsent: VecDeque<Request>,
}

impl TransferQueue {
    pub(crate) fn new(devid: u32, handle: Handle) -> Self {
        let inbox = Arc::<Inbox>::default();
        let id = handle.shared().register_queue(inbox.clone()).unwrap_or_else(|| {
            // Already closed: submits fail, and nothing will arrive.
            inbox.disconnect();
            0
        });
        Self { devid, handle, inbox, id, pending: 0, ready: VecDeque::new(), unsent: VecDeque::new() }
    }

    /// Queues a transfer and returns its seqnum. It is sent when the queue
    /// next waits for a completion.
    pub fn submit(&mut self, transfer: Transfer) -> Result<u32, TransferError> {
        let shared = self.handle.shared();
        if shared.is_closed() {
            return Err(TransferError::Disconnected);
        }
        let seqnum = shared.next_seqnum();
        let submit = build_submit(self.devid, seqnum, transfer);
        self.unsent.push_back(Request::Submit(submit, Waiter::Queue(self.id)));
        self.pending += 1;
        Ok(seqnum)
    }

    /// Queues a `CMD_UNLINK` for the URB `target` (a seqnum [`submit`](Self::submit)
    /// returned), sent with the queue's next URBs. The URB's completion still
    /// arrives here: with its data if it had finished, otherwise with
    /// [`Status::ECONNRESET`](usbwire_proto::Status::ECONNRESET).
    pub fn unlink(&mut self, target: u32) -> Result<(), TransferError> {
        let shared = self.handle.shared();
        if shared.is_closed() {
            return Err(TransferError::Disconnected);
        }
        let unlink = CmdUnlink { seqnum: shared.next_seqnum(), devid: self.devid, unlink_seqnum: target };
        self.unsent.push_back(Request::Unlink(unlink));
        Ok(())
    }

    /// URBs submitted and not yet returned by `next_complete`.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Sends what was submitted, then waits for the next completion. `None`
    /// when nothing is pending. After the connection is lost it hands out
    /// the replies that arrived before, then returns
    /// [`TransferError::Disconnected`] once for all URBs still pending.
    pub async fn next_complete(&mut self) -> Option<Result<RetSubmit, TransferError>> {
        poll_fn(|cx| self.poll_next_complete(cx)).await
    }

    /// A completion that has already arrived, without sending or waiting:
    /// for draining a batch after [`next_complete`](Self::next_complete).
    pub fn try_next_complete(&mut self) -> Option<RetSubmit> {
        if self.ready.is_empty() {
            std::mem::swap(&mut self.ready, &mut self.inbox.state().ready);
        }
        let ret = self.ready.pop_front()?;
        self.pending -= 1;
        Some(ret)
    }

    /// The poll form of [`next_complete`](Self::next_complete).
    pub fn poll_next_complete(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<RetSubmit, TransferError>>> {
        if self.handle.shared().send(&mut self.unsent, Some(cx), false).is_err() {
            // Replies that arrived before the end (a DFU_DETACH's, before the
            // device re-enumerated) are still handed out, then the loss.
            if let Some(ret) = self.try_next_complete() {
                return Poll::Ready(Some(Ok(ret)));
            }
            return Poll::Ready(self.lose_pending());
        }
        if self.pending == 0 {
            return Poll::Ready(None);
        }
        if let Some(ret) = self.ready.pop_front() {
            self.pending -= 1;
            return Poll::Ready(Some(Ok(ret)));
        }
        let mut state = self.inbox.state();
        std::mem::swap(&mut self.ready, &mut state.ready);
        if let Some(ret) = self.ready.pop_front() {
            self.pending -= 1;
            return Poll::Ready(Some(Ok(ret)));
        }
        if state.disconnected {
            drop(state);
            return Poll::Ready(self.lose_pending());
        }
        match &mut state.waker {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    fn lose_pending(&mut self) -> Option<Result<RetSubmit, TransferError>> {
        self.unsent.clear();
        if self.pending == 0 {
            return None;
        }
        self.pending = 0;
        Some(Err(TransferError::Disconnected))
    }
}

impl Drop for TransferQueue {
    /// Submitted URBs still go out, past the budget if they must (they were
    /// accepted; what the session has no room for waits in the connection
    /// until replies make room, so the session still keeps to its budget);
    /// their completions are dropped on arrival.
    fn drop(&mut self) {
        let shared = self.handle.shared();
        let _ = shared.send(&mut self.unsent, None, true);
        shared.unregister_queue(self.id);
    }
}
