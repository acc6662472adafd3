//! The session a userspace connection's callers and its relay share, and
//! what the callers wait on.
//!
//! [`Shared`] is where a [`Connection`](crate::Connection), its
//! [`TransferQueue`](crate::TransferQueue)s and the relay task meet: it holds
//! the connection's [`ClientSession`] behind the one lock they all take. A
//! caller's command goes straight into the session under that lock
//! ([`Shared::send`]; each submit with its [`Waiter`]): the session makes it
//! outstanding and encodes it into its outbox, and the relay is woken to
//! write the new bytes. The relay, through [`ApiFront`], takes the lock only
//! between its reads and writes: it takes the outbox's bytes to write them
//! without the lock, and has the session decode what it read, each reply going
//! to its waiter as it is decoded ([`Callers`] is the relay's front): a reply
//! future, or a queue's [`Inbox`] (a read's replies for one queue go over
//! together, see [`Deliveries`]). When the server agreed to the
//! accelerators (`accelerators`), a caller's command goes through them on
//! its way into the session, and every reply comes back to its waiter by
//! seqnum ([`Routed`]). Not for the relay's loop or its I/O (`relay`), nor
//! for how a queue batches its URBs (`queue`).
//!
//! Everything here is bounded by the connection's [`Budget`], the session's:
//! a command goes in while the session has room for it
//! ([`ClientSession::has_room`]: URBs (submits and unlinks) and bytes
//! (`transfer_buffer_length`) outstanding under its in-flight limits, its
//! outbox under its queued bytes); past that, callers wait for replies to make
//! room (a [`TransferQueue`](crate::TransferQueue) keeps what it could not
//! hand over). So the session's table and its outbox stay within the budget
//! however fast callers submit and however slowly the server reads. Only a
//! dropped queue's commands are accepted past it: they wait here
//! ([`State::overflow`]) and go into the session as replies make room.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::oneshot;
use tracing::debug;
use usbwire_proto::client_session::{ClientSession, ClientSessionError, Event};
use usbwire_proto::urb::{ClientMessage, CmdSubmit, CmdUnlink, RetSubmit};
use usbwire_proto::Status;

use crate::accelerators::{Accelerators, Routed};
use crate::inbox::{Deliveries, Inbox};
use crate::relay::{Front, Hold, RelayError, Step};
use crate::storage::StorageCounters;
use crate::TransferError;

/// A command on its way to the session.
pub(crate) enum Request {
    Submit(CmdSubmit, Waiter),
    Unlink(CmdUnlink),
}

impl Request {
    /// What it takes of the budget's in-flight bytes until answered.
    fn bytes(&self) -> usize {
        match self {
            Self::Submit(submit, _) => submit.transfer_buffer_length as usize,
            Self::Unlink(_) => 0,
        }
    }
}

/// Who gets a URB's reply.
pub(crate) enum Waiter {
    /// The future [`Connection::submit`](crate::Connection::submit) returned.
    Future(oneshot::Sender<RetSubmit>),
    /// A [`TransferQueue`](crate::TransferQueue), by id: the reply joins its
    /// inbox's ready list. (By id, so queueing a URB takes no `Arc` clone.)
    Queue(u64),
    /// The session's tag for what went through the accelerators: the
    /// caller's own waiter is with [`Routed`], and so is the reply.
    Routed,
}

impl Waiter {
    /// Hands the reply over; a queue's replies gather in `batch`. Returns
    /// whether a reply future was answered (which wakes its task).
    #[inline]
    fn deliver(self, ret: RetSubmit, batch: &mut Deliveries, queues: &[(u64, Arc<Inbox>)]) -> bool {
        match self {
            Self::Future(tx) => {
                answer(tx, ret);
                true
            }
            Self::Queue(id) => {
                batch.add(id, ret, queues);
                false
            }
            Self::Routed => false,
        }
    }
}

/// Answers a reply future (out of line: a queue's replies, the many, take the short path).
#[inline(never)]
fn answer(tx: oneshot::Sender<RetSubmit>, ret: RetSubmit) {
    let _ = tx.send(ret);
}

/// The connection's side of the hand-over, shared by its handles and the relay.
pub(crate) struct Shared {
    /// `None` once the connection is gone.
    state: Mutex<Option<State>>,
    next_seqnum: AtomicU32,
    /// Set with `state` becoming `None`, readable without the lock.
    closed: AtomicBool,
}

struct State {
    /// The protocol state: outstanding seqnums with their waiters, the
    /// budget, resume's bookkeeping, and the outbox the relay writes from.
    session: ClientSession<Waiter>,
    callers: Callers,
}

/// Everything but the session that the callers and the relay share under the
/// lock: the relay's [`Front`] for a userspace connection.
pub(crate) struct Callers {
    /// Commands of dropped queues that did not fit the budget: they go into
    /// the session, in order and before any other, as replies make room.
    overflow: VecDeque<Request>,
    /// A command the session refused (its seqnum is outstanding): the relay
    /// ends the connection with it.
    failed: Option<ClientSessionError>,
    /// The relay, when it waits for commands.
    relay: Option<Waker>,
    /// Callers waiting for room in the budget.
    room: Vec<Waker>,
    /// The inboxes of live queues, by queue id.
    queues: Vec<(u64, Arc<Inbox>)>,
    next_queue: u64,
    /// Live [`Handle`]s: at none, the relay ends the session.
    handles: usize,
    /// The relay's: the replies of one read on their way to their waiters
    /// (reused from read to read, so handing replies over allocates nothing).
    deliveries: Deliveries,
    /// Replies were delivered since the relay last took commands: room again.
    answered: bool,
    /// A reply future was answered since the last flush (its task is woken).
    answered_futures: bool,
    /// The session's outbox's written count when the relay last took
    /// commands: more means its bytes were taken, which makes room too.
    taken: u64,
    /// The accelerators the server agreed to, and the waiters of what went
    /// through them.
    routed: Option<Box<Routed<Waiter>>>,
}

impl Callers {
    /// Gives `request` to `session` (outstanding, and encoded into its
    /// outbox while connected); a refusal ends the connection.
    #[inline(always)]
    fn submit(&mut self, session: &mut ClientSession<Waiter>, request: Request) {
        let submitted = match (&mut self.routed, request) {
            (None, Request::Submit(submit, waiter)) => session.submit(submit, waiter),
            (None, Request::Unlink(unlink)) => session.unlink(unlink),
            (Some(routed), request) => {
                let (message, waiter) = match request {
                    Request::Submit(submit, waiter) => (ClientMessage::Submit(submit), Some(waiter)),
                    Request::Unlink(unlink) => (ClientMessage::Unlink(unlink), None),
                };
                let (deliveries, queues, futures) = (&mut self.deliveries, &self.queues, &mut self.answered_futures);
                routed.caller_sent(
                    message,
                    waiter,
                    Instant::now(),
                    &mut |message| to_session(session, message),
                    &mut |waiter, ret| *futures |= waiter.deliver(ret, deliveries, queues),
                )
            }
        };
        if let Err(error) = submitted {
            self.failed.get_or_insert(error);
        }
    }

    /// Moves what waits in `overflow` into the session while it has room;
    /// returns whether any moved.
    fn admit_overflow(&mut self, session: &mut ClientSession<Waiter>) -> bool {
        let mut admitted = false;
        while self.overflow.front().is_some_and(|request| session.has_room(request.bytes())) {
            let Some(request) = self.overflow.pop_front() else { break };
            self.submit(session, request);
            admitted = true;
        }
        admitted
    }
}

impl Shared {
    /// A connection whose commands go into `session` (which keeps them to
    /// its budget), with its first handle.
    /// `accelerators`, when the server agreed to any, sit between the
    /// callers and the session.
    pub(crate) fn new(session: ClientSession<Waiter>, accelerators: Option<Accelerators>) -> (Arc<Self>, Handle) {
        let callers = Callers {
            overflow: VecDeque::new(),
            failed: None,
            relay: None,
            room: Vec::new(),
            queues: Vec::new(),
            next_queue: 0,
            handles: 1,
            deliveries: Deliveries::default(),
            answered: false,
            answered_futures: false,
            taken: 0,
            routed: accelerators.map(|accelerators| Box::new(Routed::new(accelerators))),
        };
        let state = State { session, callers };
        let shared = Arc::new(Self {
            state: Mutex::new(Some(state)),
            next_seqnum: AtomicU32::new(1),
            closed: AtomicBool::new(false),
        });
        (shared.clone(), Handle(shared))
    }

    fn state(&self) -> MutexGuard<'_, Option<State>> {
        usbwire_device::sync::lock(&self.state)
    }

    /// Runs `f` on the session, held; `None` once the connection is gone.
    pub(crate) fn with_session<R>(&self, f: impl FnOnce(&mut ClientSession<Waiter>) -> R) -> Option<R> {
        self.state().as_mut().map(|state| f(&mut state.session))
    }

    pub(crate) fn next_seqnum(&self) -> u32 {
        self.next_seqnum.fetch_add(1, Ordering::Relaxed)
    }

    /// Commands accepted and not answered yet, and their bytes (none once closed).
    pub(crate) fn accepted(&self) -> (usize, usize) {
        self.state().as_ref().map_or((0, 0), |state| {
            let (urbs, bytes) = state.session.in_flight();
            let waiting: usize = state.callers.overflow.iter().map(Request::bytes).sum();
            (urbs + state.callers.overflow.len(), bytes + waiting)
        })
    }

    /// What the storage accelerator did, when it runs.
    pub(crate) fn storage_counters(&self) -> Option<StorageCounters> {
        let guard = self.state();
        guard.as_ref()?.callers.routed.as_ref()?.accelerators().storage_counters()
    }

    /// Logs what the accelerators did (as the connection ends).
    pub(crate) fn log_acceleration(&self) {
        if let Some(routed) = self.state().as_ref().and_then(|state| state.callers.routed.as_ref()) {
            routed.accelerators().log_summary();
        }
    }

    /// Whether the connection is gone: nothing sent now will be answered.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Gives `requests` to the session, in order, while it has room: each is
    /// encoded into its outbox, and the relay woken to write them. What does
    /// not fit stays in `requests`, and `cx` (if any) is woken when there is
    /// room. `force` accepts them all regardless (a queue being dropped: what
    /// it accepted goes out), the rest to go in as replies make room. Fails
    /// when the connection is gone; the requests are dropped then, so their
    /// waiters fail as disconnected.
    pub(crate) fn send(
        &self,
        requests: &mut VecDeque<Request>,
        cx: Option<&Context<'_>>,
        force: bool,
    ) -> Result<(), TransferError> {
        if requests.is_empty() {
            return if self.is_closed() { Err(TransferError::Disconnected) } else { Ok(()) };
        }
        let mut guard = self.state();
        let Some(State { session, callers }) = guard.as_mut() else {
            requests.clear();
            return Err(TransferError::Disconnected);
        };
        let mut took = false;
        if callers.overflow.is_empty() {
            while let Some(request) = requests.pop_front() {
                if !session.has_room(request.bytes()) {
                    requests.push_front(request);
                    break;
                }
                callers.submit(session, request);
                took = true;
            }
        }
        if force {
            callers.overflow.append(requests);
        }
        // Replies the accelerators answered at once.
        let mut wake = Vec::new();
        if took && callers.routed.is_some() {
            callers.deliveries.hand_over();
            wake.append(&mut callers.deliveries.wake);
        }
        if let (false, Some(cx)) = (requests.is_empty(), cx) {
            if !callers.room.iter().any(|waker| waker.will_wake(cx.waker())) {
                callers.room.push(cx.waker().clone());
            }
        }
        let relay = (took || callers.failed.is_some()).then(|| callers.relay.take()).flatten();
        drop(guard);
        if let Some(relay) = relay {
            relay.wake();
        }
        wake.into_iter().for_each(Waker::wake);
        Ok(())
    }

    /// Sends one request, waiting for room.
    pub(crate) async fn send_one(&self, request: Request) -> Result<(), TransferError> {
        let mut requests = VecDeque::from([request]);
        std::future::poll_fn(|cx| {
            self.send(&mut requests, Some(cx), false)?;
            if requests.is_empty() {
                Poll::Ready(Ok(()))
            } else {
                Poll::Pending
            }
        })
        .await
    }

    /// A new queue's inbox, registered for its replies; `None` if the connection is gone.
    pub(crate) fn register_queue(&self, inbox: Arc<Inbox>) -> Option<u64> {
        let mut guard = self.state();
        let callers = &mut guard.as_mut()?.callers;
        let id = callers.next_queue;
        callers.next_queue += 1;
        callers.queues.push((id, inbox));
        Some(id)
    }

    /// A dropped queue's URBs still complete; their replies are then dropped.
    pub(crate) fn unregister_queue(&self, id: u64) {
        if let Some(state) = self.state().as_mut() {
            state.callers.queues.retain(|(queue, _)| *queue != id);
        }
    }

    /// The connection is gone: the session goes, and with it every URB still
    /// waiting, which fails as disconnected (dropped reply senders; queues are
    /// told); callers waiting for room are woken to find out.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let Some(state) = self.state().take() else { return };
        for (_, inbox) in &state.callers.queues {
            inbox.disconnect();
        }
        state.callers.room.into_iter().for_each(Waker::wake);
    }
}

/// A caller's hold on a connection (the [`Connection`](crate::Connection)
/// and each of its queues): the relay ends the session once every handle is
/// dropped.
pub(crate) struct Handle(Arc<Shared>);

impl Handle {
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.0
    }
}

impl Clone for Handle {
    fn clone(&self) -> Self {
        if let Some(state) = self.0.state().as_mut() {
            state.callers.handles += 1;
        }
        Self(self.0.clone())
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let relay = match self.0.state().as_mut() {
            Some(State { callers, .. }) => {
                callers.handles -= 1;
                if callers.handles == 0 {
                    callers.relay.take()
                } else {
                    None
                }
            }
            None => None,
        };
        if let Some(relay) = relay {
            relay.wake();
        }
    }
}

/// The relay's hold on a userspace connection: callers put their commands
/// into the session themselves; the relay takes the lock once a turn to take
/// the bytes to write and to hand replies straight to their waiters
/// ([`Callers`]). Dropped as the relay ends, it closes the connection.
pub(crate) struct ApiFront {
    shared: Arc<Shared>,
    /// Tasks to wake once the lock is released.
    wake: Vec<Waker>,
}

impl ApiFront {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self { shared, wake: Vec::new() }
    }

    /// Logs what the accelerators did, before the connection closes.
    pub(crate) fn log_acceleration(&self) {
        self.shared.log_acceleration();
    }
}

impl Hold for ApiFront {
    type Front = Callers;

    /// Holds the lock for `turn`, then wakes the tasks the replies were for
    /// (and callers waiting for room), so they do not wake into a held lock.
    fn hold<R>(&mut self, turn: impl FnOnce(&mut ClientSession<Waiter>, &mut Callers) -> R) -> R {
        let mut guard = self.shared.state();
        let Some(State { session, callers }) = guard.as_mut() else {
            unreachable!("only the relay closes the connection, as it ends")
        };
        let result = turn(session, callers);
        if !callers.deliveries.wake.is_empty() {
            std::mem::swap(&mut callers.deliveries.wake, &mut self.wake);
        }
        drop(guard);
        if !self.wake.is_empty() {
            self.wake.drain(..).for_each(Waker::wake);
        }
        result
    }
}

impl Drop for ApiFront {
    /// Marks the connection closed before its pending transfers fail, so
    /// they never see it open.
    fn drop(&mut self) {
        self.shared.close();
    }
}

impl Front for Callers {
    type Tag = Waiter;

    /// Callers give their commands to the session themselves; here, what a
    /// dropped queue left goes in as there is room, and callers waiting for
    /// room are told once replies or the relay's taking the outbox made some.
    /// A command the session refused ends the connection; once every handle
    /// is gone (the connection and its queues) the session ends, even when it
    /// is too full to take the last commands a dropped queue handed over (a
    /// server that answers nothing more must not keep the relay): those are
    /// dropped, and their waiters, if anyone still holds one, fail.
    fn poll_commands(&mut self, cx: &mut Context<'_>, session: &mut ClientSession<Waiter>) -> Result<Step, RelayError> {
        let taken = session.outbox().written();
        let room = std::mem::take(&mut self.answered) || taken != self.taken;
        self.taken = taken;
        let mut admitted = room && !self.overflow.is_empty() && self.admit_overflow(session);
        if let (true, Some(routed)) = (room, &mut self.routed) {
            // The callers' commands that waited for reads ahead now back.
            let (deliveries, queues, futures) = (&mut self.deliveries, &self.queues, &mut self.answered_futures);
            let released =
                routed.release(Instant::now(), &mut |message| to_session(session, message), &mut |waiter, ret| {
                    *futures |= waiter.deliver(ret, deliveries, queues)
                });
            match released {
                Ok(released) => admitted |= released,
                Err(error) => return Err(error.into()),
            }
        }
        if room && !self.room.is_empty() {
            // Woken as the lock is released (see `ApiFront::hold`).
            self.deliveries.wake.append(&mut self.room);
        }
        if let Some(error) = self.failed.take() {
            return Err(error.into());
        }
        if self.handles == 0 {
            return Ok(Step::Detached);
        }
        match &mut self.relay {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        Ok(if admitted { Step::Progressed } else { Step::Idle })
    }

    #[inline(always)]
    fn deliver(&mut self, event: Event<Waiter>) {
        self.answered = true;
        if let Some(routed) = &mut self.routed {
            let (deliveries, queues, futures) = (&mut self.deliveries, &self.queues, &mut self.answered_futures);
            return routed.server_sent(event, &mut |waiter, ret| *futures |= waiter.deliver(ret, deliveries, queues));
        }
        match event {
            // The many: a queue's reply joins the others of this read (kept short, so inlined).
            Event::Completed { reply, tag: Waiter::Queue(id) } => self.deliveries.add(id, reply, &self.queues),
            // Reply futures wake their tasks when sent to; a queue only when it was waiting.
            other => self.answered_futures |= deliver_other(other, &mut self.deliveries, &self.queues),
        }
    }

    /// Hands the read's replies to their queues; the tasks waiting for them
    /// are woken as the lock is released.
    fn poll_flush(&mut self, _cx: &mut Context<'_>) -> Step {
        self.deliveries.hand_over();
        if std::mem::take(&mut self.answered_futures) || !self.deliveries.wake.is_empty() {
            Step::Woke
        } else {
            Step::Idle
        }
    }
}

/// Hands over a reply other than a queue's: a reply future's, or an unlink's answer.
#[inline(never)]
fn deliver_other(event: Event<Waiter>, deliveries: &mut Deliveries, queues: &[(u64, Arc<Inbox>)]) -> bool {
    match event {
        Event::Completed { reply, tag } => tag.deliver(reply, deliveries, queues),
        Event::Unlinked { reply, cancelled, .. } => {
            debug!(seqnum = reply.seqnum, status = ?reply.status, "unlink answered");
            // Cancelled without a RET_SUBMIT (the kernel stub's way): the
            // RET_UNLINK is the URB's only answer, as vhci treats it.
            match cancelled {
                Some((target, waiter)) => waiter.deliver(empty_reply(target, reply.status), deliveries, queues),
                None => false,
            }
        }
    }
}

/// A command the accelerators send on, into the session (its reply comes back through them).
fn to_session(session: &mut ClientSession<Waiter>, message: ClientMessage) -> Result<(), ClientSessionError> {
    match message {
        ClientMessage::Submit(submit) => session.submit(submit, Waiter::Routed),
        ClientMessage::Unlink(unlink) => session.unlink(unlink),
    }
}

/// A RET_SUBMIT without data: what a URB cancelled by its RET_UNLINK gets.
fn empty_reply(seqnum: u32, status: Status) -> RetSubmit {
    RetSubmit::new(seqnum, status, Bytes::new())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    use usbwire_proto::client_session::READ_CHUNK;
    use usbwire_proto::urb::TransferFlags;
    use usbwire_proto::{Budget, Direction, Limits, RecvBuffer};

    use super::*;

    fn bulk_out(shared: &Shared, length: usize) -> CmdSubmit {
        CmdSubmit {
            seqnum: shared.next_seqnum(),
            devid: 1,
            direction: Direction::Out,
            ep: 2,
            transfer_flags: TransferFlags::default(),
            transfer_buffer_length: length as u32,
            start_frame: 0,
            number_of_packets: 0,
            interval: 0,
            setup: [0; 8],
            data: Bytes::from(vec![0; length]),
            iso_packets: vec![],
        }
    }

    fn queued(shared: &Shared, id: u64, length: usize) -> Request {
        Request::Submit(bulk_out(shared, length), Waiter::Queue(id))
    }

    fn connection(budget: Budget) -> (Arc<Shared>, Handle, ApiFront) {
        let (shared, handle) = Shared::new(ClientSession::new(1, Limits::default(), budget), None);
        let front = ApiFront::new(shared.clone());
        (shared, handle, front)
    }

    /// The server's answers to `seqnums`, in order, decoded by the session
    /// and handed over by the front, as in a turn of the relay.
    fn answer_all(front: &mut ApiFront, seqnums: &[u32]) {
        let mut input = RecvBuffer::with_capacity(READ_CHUNK);
        for &seqnum in seqnums {
            let reply = empty_reply(seqnum, Status::OK);
            reply.encode(&mut input);
        }
        front.hold(|session, callers| {
            session.handle_input(&mut input, |event| callers.deliver(event)).unwrap();
            callers.poll_commands(&mut Context::from_waker(Waker::noop()), session).unwrap();
            callers.poll_flush(&mut Context::from_waker(Waker::noop()));
        });
    }

    /// The relay's look at the callers' side: whether they let go.
    fn poll_commands(front: &mut ApiFront, cx: &mut Context<'_>) -> Step {
        front.hold(|session, callers| callers.poll_commands(cx, session)).unwrap()
    }

    /// Counts its wake-ups.
    #[derive(Default)]
    struct Counter(AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn replies_reach_registered_queues_in_order_and_dropped_queues_lose_theirs() {
        let (shared, _handle, _front) = connection(Budget::default());
        let (a, b) = (Arc::<Inbox>::default(), Arc::<Inbox>::default());
        let (id_a, id_b) = (shared.register_queue(a.clone()).unwrap(), shared.register_queue(b.clone()).unwrap());
        assert_ne!(id_a, id_b);
        let queues = vec![(id_a, a.clone()), (id_b, b.clone())];
        let mut deliveries = Deliveries::default();
        for (id, seqnum) in [(id_a, 1), (id_a, 2), (id_b, 3), (id_a, 4)] {
            deliveries.add(id, empty_reply(seqnum, Status::OK), &queues);
        }
        deliveries.hand_over();
        let seqnums = |inbox: &Inbox| inbox.state().ready.iter().map(|ret| ret.seqnum).collect::<Vec<_>>();
        assert_eq!(seqnums(&a), vec![1, 2, 4]);
        assert_eq!(seqnums(&b), vec![3]);

        // Through the connection: a dropped queue gets nothing more.
        shared.unregister_queue(id_b);
        let mut front = ApiFront::new(shared.clone());
        let mut requests: VecDeque<Request> = [queued(&shared, id_b, 8), queued(&shared, id_a, 8)].into();
        shared.send(&mut requests, None, false).unwrap();
        // Seqnums 1 (for b) and 2 (for a).
        answer_all(&mut front, &[1, 2]);
        assert_eq!(seqnums(&b), vec![3], "a dropped queue gets nothing more");
        assert_eq!(seqnums(&a), vec![1, 2, 4, 2]);
        assert!(shared.state().as_ref().unwrap().callers.deliveries.replies.is_empty());
    }

    #[test]
    fn a_callers_commands_are_encoded_at_once_and_wake_the_relay() {
        let (shared, _handle, mut front) = connection(Budget::default());
        let relay = Arc::new(Counter::default());
        let waker = Waker::from(relay.clone());
        assert!(matches!(poll_commands(&mut front, &mut Context::from_waker(&waker)), Step::Idle));
        let mut requests: VecDeque<Request> = [queued(&shared, 0, 512), queued(&shared, 0, 0)].into();
        shared.send(&mut requests, None, false).unwrap();
        assert!(requests.is_empty());
        assert_eq!(relay.0.load(Ordering::Relaxed), 1, "one wake for the batch");
        front.hold(|session, _| {
            assert_eq!(session.outbox().queued(), 2 * 48 + 512, "both encoded, the OUT data behind its header");
            assert_eq!(session.outstanding(), 2);
        });
        assert_eq!(shared.accepted(), (2, 512));
    }

    #[test]
    fn commands_past_the_budget_wait_until_replies_make_room() {
        let budget = Budget { in_flight_urbs: 3, in_flight_bytes: 1 << 20, ..Budget::default() };
        let (shared, _handle, mut front) = connection(budget);
        let inbox = Arc::<Inbox>::default();
        let id = shared.register_queue(inbox.clone()).unwrap();
        // Three small URBs fit the URB count; then 1 MiB more does not fit the bytes.
        let mut requests: VecDeque<Request> = [512, 512, 512, 512].iter().map(|&n| queued(&shared, id, n)).collect();
        let caller = Arc::new(Counter::default());
        let waker = Waker::from(caller.clone());
        shared.send(&mut requests, Some(&Context::from_waker(&waker)), false).unwrap();
        assert_eq!(requests.len(), 1, "three accepted, one waits");
        assert_eq!(shared.with_session(|session| session.outstanding()), Some(3));

        answer_all(&mut front, &[1, 2]);
        assert_eq!(inbox.state().ready.len(), 2);
        assert_eq!(caller.0.load(Ordering::Relaxed), 1, "the caller waiting for room is woken");
        shared.send(&mut requests, None, false).unwrap();
        assert!(requests.is_empty(), "two answered: room again");

        let mut big: VecDeque<Request> = [queued(&shared, id, 1 << 20)].into();
        shared.send(&mut big, None, false).unwrap();
        assert_eq!(big.len(), 1, "1 MiB more would pass the bytes in flight");
        answer_all(&mut front, &[3, 4]);
        shared.send(&mut big, None, false).unwrap();
        assert!(big.is_empty(), "with nothing in flight any URB gets through");
    }

    #[test]
    fn a_dropped_queues_commands_past_the_budget_go_in_as_replies_make_room() {
        let budget = Budget { in_flight_urbs: 1, ..Budget::default() };
        let (shared, _handle, mut front) = connection(budget);
        let mut requests: VecDeque<Request> = [queued(&shared, 0, 8), queued(&shared, 0, 8)].into();
        shared.send(&mut requests, None, true).unwrap();
        assert!(requests.is_empty(), "all accepted");
        assert_eq!(shared.accepted(), (2, 16));
        assert_eq!(shared.with_session(|session| session.outstanding()), Some(1), "the session keeps to its budget");
        // Another caller's command waits behind them, not accepted.
        let mut later: VecDeque<Request> = [queued(&shared, 0, 8)].into();
        answer_all(&mut front, &[1]);
        assert_eq!(shared.with_session(|session| session.outstanding()), Some(1), "the second went in");
        shared.send(&mut later, None, false).unwrap();
        assert_eq!(later.len(), 1, "no room yet");
        answer_all(&mut front, &[2]);
        shared.send(&mut later, None, false).unwrap();
        assert!(later.is_empty());
        let written: Vec<u8> =
            front.hold(|session, _| session.outbox().slices(64).iter().flat_map(|slice| slice.to_vec()).collect());
        let seqnums: Vec<u32> =
            written.chunks(48 + 8).map(|command| u32::from_be_bytes(command[4..8].try_into().unwrap())).collect();
        assert_eq!(seqnums, [1, 2, 3], "in order");
    }

    #[test]
    fn the_relay_lets_go_once_every_handle_is_gone() {
        let (shared, handle, mut front) = connection(Budget::default());
        let second = handle.clone();
        let mut requests: VecDeque<Request> = [queued(&shared, 0, 8)].into();
        shared.send(&mut requests, None, false).unwrap();
        let mut cx = Context::from_waker(Waker::noop());
        drop(handle);
        assert!(matches!(poll_commands(&mut front, &mut cx), Step::Idle), "a queue still holds it");
        drop(second);
        assert!(matches!(poll_commands(&mut front, &mut cx), Step::Detached));
        let outstanding = front.hold(|session, _| session.outstanding());
        assert_eq!(outstanding, 1, "what was sent before the handles went is in the session");
        drop(front);
        assert!(shared.is_closed());
        let mut late: VecDeque<Request> = [queued(&shared, 0, 8)].into();
        assert!(matches!(shared.send(&mut late, None, false), Err(TransferError::Disconnected)));
    }

    #[test]
    fn the_relay_lets_go_of_a_full_session_once_every_handle_is_gone() {
        let budget = Budget { in_flight_urbs: 1, ..Budget::default() };
        let (shared, handle, mut front) = connection(budget);
        let mut cx = Context::from_waker(Waker::noop());
        // A dropped queue hands over what it holds past the budget.
        let mut requests: VecDeque<Request> = [queued(&shared, 0, 8), queued(&shared, 0, 8)].into();
        shared.send(&mut requests, None, true).unwrap();
        assert!(!front.hold(|session, _| session.has_room(8)), "the session is full; the second command waits");
        assert!(matches!(poll_commands(&mut front, &mut cx), Step::Idle), "held: keep serving");
        drop(handle);
        assert!(
            matches!(poll_commands(&mut front, &mut cx), Step::Detached),
            "nobody holds the connection: a server that never answers does not keep the relay"
        );
    }
}
