//! [`TransferQueue`]: many URBs in flight from one task, completions collected
//! in batches (the shape of nusb's `Queue`: `submit`, `next_complete`).
//!
//! Why it exists beside [`Connection::submit`](crate::Connection::submit):
//! a future per URB costs a oneshot channel, a wake-up per reply and, on a
//! multi-threaded runtime, often a cross-thread wake. A queue packs the
//! headers of everything submitted since it last waited into one message for
//! the writer task, and the reader appends replies to the queue's ready list
//! and wakes it once per socket read, however many replies that read held.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use usbwire_proto::urb::{RetSubmit, SubmittedShape};

use crate::connection::{build_submit, encode_submit, Frame, Outgoing, Request, Shared, Waiter};
use crate::{Transfer, TransferError};

/// Replies that arrived for one queue and are not collected yet.
#[derive(Default)]
pub(crate) struct Inbox {
    state: Mutex<InboxState>,
}

#[derive(Default)]
struct InboxState {
    ready: VecDeque<RetSubmit>,
    /// The task waiting in `next_complete`, if any.
    waker: Option<Waker>,
    /// The connection ended; nothing more will arrive.
    disconnected: bool,
}

impl Inbox {
    fn state(&self) -> MutexGuard<'_, InboxState> {
        usbwire_proto::sync::lock(&self.state)
    }

    /// Adds the replies of one read (in order) under one lock; the waiting
    /// task's waker goes to `wake` (the reader wakes it after the whole read
    /// is dispatched).
    pub(crate) fn push_all(&self, replies: &mut Vec<RetSubmit>, wake: &mut Vec<Waker>) {
        let mut state = self.state();
        state.ready.extend(replies.drain(..));
        if let Some(waker) = state.waker.take() {
            wake.push(waker);
        }
    }

    #[cfg(test)]
    pub(crate) fn ready_seqnums(&self) -> Vec<u32> {
        self.state().ready.iter().map(|ret| ret.seqnum).collect()
    }

    pub(crate) fn disconnect(&self) {
        let waker = {
            let mut state = self.state();
            state.disconnected = true;
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// URBs submitted and collected by one task ([`Connection::queue`](crate::Connection::queue)).
///
/// [`submit`](Self::submit) does not wait and does not write: the URBs go out
/// together, in submission order, when the queue next waits for a completion
/// ([`next_complete`](Self::next_complete)) or is dropped. Completions come
/// back in the order the server sends them (per endpoint that is submission
/// order). Other users of the same [`Connection`](crate::Connection) are not
/// affected; [`Connection::unlink`](crate::Connection::unlink) cancels a
/// queued URB by the seqnum `submit` returned, and its completion then
/// arrives here.
pub struct TransferQueue {
    devid: u32,
    shared: Arc<Shared>,
    outgoing: Outgoing,
    inbox: Arc<Inbox>,
    /// This queue's id in the waiter map (see `Waiters::register_queue`).
    id: u64,
    /// Submitted and not yet collected.
    pending: usize,
    /// Replies taken from the inbox in one swap, handed out without its lock.
    ready: VecDeque<RetSubmit>,
    /// Seqnums and reply shapes of URBs not handed to the writer yet; they
    /// join the waiter map together, under one lock, just before they are sent.
    unsent_waiters: Vec<(u32, SubmittedShape)>,
    /// Headers (and small payloads) of URBs not handed to the writer yet.
    unsent_head: BytesMut,
    /// Whole frames not handed to the writer yet (each ends with a large OUT payload).
    unsent: Vec<Frame>,
    /// A resumable connection's commands not handed to its relay yet.
    unsent_requests: Vec<Request>,
}

impl TransferQueue {
    pub(crate) fn new(devid: u32, shared: Arc<Shared>, outgoing: Outgoing) -> Self {
        let inbox = Arc::<Inbox>::default();
        let registered = shared.waiters().as_mut().map(|waiters| waiters.register_queue(inbox.clone()));
        let id = registered.unwrap_or_else(|| {
            // Already closed: submits fail, and nothing will arrive.
            inbox.disconnect();
            0
        });
        Self {
            devid,
            shared,
            outgoing,
            inbox,
            id,
            pending: 0,
            ready: VecDeque::new(),
            unsent_waiters: Vec::new(),
            unsent_head: BytesMut::new(),
            unsent: Vec::new(),
            unsent_requests: Vec::new(),
        }
    }

    /// Queues a transfer and returns its seqnum. It is sent when the queue
    /// next waits for a completion.
    pub fn submit(&mut self, transfer: Transfer) -> Result<u32, TransferError> {
        if self.shared.closed.load(Ordering::Relaxed) {
            return Err(TransferError::Disconnected);
        }
        let seqnum = self.shared.next_seqnum.fetch_add(1, Ordering::Relaxed);
        let (submit, shape) = build_submit(self.devid, seqnum, transfer);
        match self.outgoing {
            Outgoing::Frames(_) => {
                let payload = encode_submit(submit, &mut self.unsent_head);
                self.unsent_waiters.push((seqnum, shape));
                if !payload.is_empty() {
                    self.unsent.push(Frame { head: self.unsent_head.split().freeze(), payload });
                }
            }
            Outgoing::Session(_) => self.unsent_requests.push(Request::Submit(submit, Waiter::Queue(self.id))),
        }
        self.pending += 1;
        Ok(seqnum)
    }

    /// URBs submitted and not yet returned by `next_complete`.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Sends what was submitted, then waits for the next completion. `None`
    /// when nothing is pending. After the connection is lost it returns
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
        if self.send_unsent().is_err() {
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
        if self.pending == 0 {
            return None;
        }
        self.pending = 0;
        Some(Err(TransferError::Disconnected))
    }

    /// Hands everything submitted to the writer task (or the relay), in order.
    fn send_unsent(&mut self) -> Result<(), TransferError> {
        let frames = match &self.outgoing {
            Outgoing::Frames(frames) => frames,
            Outgoing::Session(requests) => {
                if self.unsent_requests.is_empty() {
                    return Ok(());
                }
                let batch = std::mem::take(&mut self.unsent_requests);
                return requests.send(batch).map_err(|_| TransferError::Disconnected);
            }
        };
        if !self.unsent_waiters.is_empty() {
            let mut guard = self.shared.waiters();
            let Some(waiters) = guard.as_mut() else {
                self.unsent_waiters.clear();
                self.unsent.clear();
                self.unsent_head.clear();
                return Err(TransferError::Disconnected);
            };
            for (seqnum, shape) in self.unsent_waiters.drain(..) {
                waiters.submits.insert(seqnum, (shape, Waiter::Queue(self.id)));
            }
        }
        if !self.unsent_head.is_empty() {
            let head = self.unsent_head.split().freeze();
            self.unsent.push(Frame { head, payload: Bytes::new() });
        }
        for frame in self.unsent.drain(..) {
            frames.send(frame).map_err(|_| TransferError::Disconnected)?;
        }
        Ok(())
    }
}

impl Drop for TransferQueue {
    /// Submitted URBs still go out; their completions are dropped on arrival.
    fn drop(&mut self) {
        let _ = self.send_unsent();
        if let Some(waiters) = self.shared.waiters().as_mut() {
            waiters.unregister_queue(self.id);
        }
    }
}
