//! A ready-completion queue with a waker: the usual inside of `poll_complete`.

use std::collections::VecDeque;
use std::task::{Context, Poll, Waker};

use crate::Completion;

/// Completions that are finished but not yet collected by the server.
///
/// A device pushes into it from `submit` (or when an external event finishes
/// a pending URB) and pops from it in `poll_complete`; pushing wakes the task
/// that last polled.
#[derive(Debug, Default)]
pub struct CompletionQueue {
    ready: VecDeque<Completion>,
    waker: Option<Waker>,
}

impl CompletionQueue {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, completion: Completion) {
        self.ready.push_back(completion);
        if let Some(waker) = self.waker.take() {
            waker.wake();
        }
    }

    /// The oldest ready completion, or `Pending` with the task's waker registered.
    pub fn poll_pop(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        match self.ready.pop_front() {
            Some(completion) => Poll::Ready(completion),
            None => {
                self.register(cx);
                Poll::Pending
            }
        }
    }

    /// Registers the task's waker without popping (for devices that wait on
    /// several sources).
    pub fn register(&mut self, cx: &mut Context<'_>) {
        match &mut self.waker {
            // The same task polls every time: keep its waker, no clone.
            Some(waker) if waker.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
    }

    /// Wakes the last poller, e.g. after an external event made progress possible.
    pub fn wake(&mut self) {
        if let Some(waker) = self.waker.take() {
            waker.wake();
        }
    }

    pub fn is_empty(&self) -> bool {
        self.ready.is_empty()
    }

    pub fn len(&self) -> usize {
        self.ready.len()
    }

    pub fn clear(&mut self) {
        self.ready.clear();
    }
}
