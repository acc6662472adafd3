//! Where a [`TransferQueue`](crate::TransferQueue)'s replies wait to be
//! collected ([`Inbox`]), and how the replies of one read reach their
//! queues' inboxes ([`Deliveries`]). Not the session or its lock (`waiters`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use usbwire_proto::urb::RetSubmit;

/// Replies that arrived for one queue and are not collected yet.
#[derive(Default)]
pub(crate) struct Inbox {
    state: Mutex<InboxState>,
}

#[derive(Default)]
pub(crate) struct InboxState {
    pub(crate) ready: VecDeque<RetSubmit>,
    /// The task waiting in `next_complete`, if any.
    pub(crate) waker: Option<Waker>,
    /// The connection ended; nothing more will arrive.
    pub(crate) disconnected: bool,
}

impl Inbox {
    pub(crate) fn state(&self) -> MutexGuard<'_, InboxState> {
        usbwire_device::sync::lock(&self.state)
    }

    /// Adds the replies of one read (in order) under one lock, leaving
    /// `replies` empty; the waiting task's waker goes to `wake` (the relay
    /// wakes it after the whole read is handed over).
    fn push_all(&self, replies: &mut VecDeque<RetSubmit>, wake: &mut Vec<Waker>) {
        let mut state = self.state();
        if state.ready.is_empty() {
            // The usual case (the queue took what came before): the lists
            // change hands without moving a reply.
            std::mem::swap(&mut state.ready, replies);
        } else {
            state.ready.extend(replies.drain(..));
        }
        if let Some(waker) = state.waker.take() {
            wake.push(waker);
        }
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

/// Replies of one read on their way to their queues' inboxes: consecutive
/// replies for the same queue are handed over under one lock, and each queue
/// is woken once, after the read is handed over.
#[derive(Default)]
pub(crate) struct Deliveries {
    /// The queue the replies in `replies` are for, and its inbox (`None`: the
    /// queue was dropped, and so are its replies).
    queue: Option<(u64, Option<Arc<Inbox>>)>,
    pub(crate) replies: VecDeque<RetSubmit>,
    /// Wakers of queues that were waiting, to wake once the read is handed over.
    pub(crate) wake: Vec<Waker>,
}

impl Deliveries {
    #[inline(always)]
    pub(crate) fn add(&mut self, id: u64, ret: RetSubmit, queues: &[(u64, Arc<Inbox>)]) {
        if !matches!(self.queue, Some((current, _)) if current == id) {
            self.switch_to(id, queues);
        }
        self.replies.push_back(ret);
    }

    /// Hands the replies gathered over and gathers for queue `id` next.
    #[inline(never)]
    fn switch_to(&mut self, id: u64, queues: &[(u64, Arc<Inbox>)]) {
        self.hand_over();
        let inbox = queues.iter().find(|(queue, _)| *queue == id).map(|(_, inbox)| inbox.clone());
        self.queue = Some((id, inbox));
    }

    /// Moves the gathered replies into their inbox.
    pub(crate) fn hand_over(&mut self) {
        match self.queue.take() {
            Some((_, Some(inbox))) => inbox.push_all(&mut self.replies, &mut self.wake),
            _ => self.replies.clear(),
        }
    }
}
