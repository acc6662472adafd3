//! What a userspace connection's callers wait on, and the bounded hand-over of
//! their commands to the relay that drives the session.
//!
//! [`Shared`] is where a [`Connection`](crate::Connection), its
//! [`TransferQueue`](crate::TransferQueue)s and the relay task meet. Callers
//! hand commands in ([`Shared::send`]; each submit with its [`Waiter`]); the
//! relay, through [`ApiFront`], takes them into its
//! [`ClientSession`] as the session wants them and gives each reply to its
//! waiter: a reply future, or a queue's [`Inbox`] (a read's replies for one
//! queue go over together, see [`Deliveries`]).
//!
//! Everything here is bounded by the connection's [`Budget`], the one the
//! session and the server use: a command is accepted while the URBs (submits
//! and unlinks) and the bytes (`transfer_buffer_length`) accepted and not yet
//! answered are under its in-flight limits; past them, callers wait for room
//! (a [`TransferQueue`](crate::TransferQueue) keeps what it could not hand
//! over). So the commands waiting here, the session's table and its outbox
//! stay within the budget however fast callers submit and however slowly the
//! server reads.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use tokio::sync::oneshot;
use tracing::debug;
use usbwire_proto::client_session::{ClientSession, Event};
use usbwire_proto::urb::{CmdSubmit, CmdUnlink, RetSubmit};
use usbwire_proto::{Budget, Status};

use crate::relay::{Front, RelayError, Replies, Step};
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

/// Who gets a URB's reply, and what the URB holds of the budget until then.
pub(crate) struct Waiter {
    to: ReplyTo,
    /// The URB's `transfer_buffer_length`.
    bytes: u32,
}

enum ReplyTo {
    /// The future [`Connection::submit`](crate::Connection::submit) returned.
    Future(oneshot::Sender<RetSubmit>),
    /// A [`TransferQueue`](crate::TransferQueue), by id: the reply joins its
    /// inbox's ready list. (By id, so queueing a URB takes no `Arc` clone.)
    Queue(u64),
}

impl Waiter {
    pub(crate) fn future(reply: oneshot::Sender<RetSubmit>, submit: &CmdSubmit) -> Self {
        Self { to: ReplyTo::Future(reply), bytes: submit.transfer_buffer_length }
    }

    pub(crate) fn queue(id: u64, submit: &CmdSubmit) -> Self {
        Self { to: ReplyTo::Queue(id), bytes: submit.transfer_buffer_length }
    }

    /// Hands the reply over; a queue's replies gather in `batch`. Returns
    /// whether a reply future was answered (which wakes its task).
    fn deliver(self, ret: RetSubmit, batch: &mut Deliveries, state: &State) -> bool {
        match self.to {
            ReplyTo::Future(tx) => {
                let _ = tx.send(ret);
                true
            }
            ReplyTo::Queue(id) => {
                batch.add(id, ret, state);
                false
            }
        }
    }
}

/// The connection's side of the hand-over, shared by its handles and the relay.
pub(crate) struct Shared {
    /// `None` once the connection is gone.
    state: Mutex<Option<State>>,
    next_seqnum: AtomicU32,
    /// Set with `state` becoming `None`, readable without the lock.
    closed: AtomicBool,
    budget: Budget,
}

struct State {
    /// Accepted, not yet taken by the relay, in the order they go on the wire.
    requests: VecDeque<Request>,
    /// Commands accepted and not answered yet, and their bytes.
    in_flight: usize,
    in_flight_bytes: usize,
    /// The relay, when it waits for commands.
    relay: Option<Waker>,
    /// Callers waiting for room in the budget.
    room: Vec<Waker>,
    /// The inboxes of live queues, by queue id.
    queues: Vec<(u64, Arc<Inbox>)>,
    next_queue: u64,
    /// Live [`Handle`]s: at none, the relay ends the session once it took every command.
    handles: usize,
}

impl State {
    fn inbox(&self, id: u64) -> Option<&Arc<Inbox>> {
        self.queues.iter().find(|(queue, _)| *queue == id).map(|(_, inbox)| inbox)
    }

    fn has_room(&self, budget: &Budget, bytes: usize) -> bool {
        self.in_flight < budget.in_flight_urbs && budget.admits(self.in_flight_bytes, bytes)
    }

    /// An accepted command was answered.
    fn release(&mut self, bytes: u32) {
        self.in_flight -= 1;
        self.in_flight_bytes -= bytes as usize;
    }
}

impl Shared {
    /// A connection whose commands are held to `budget`, with its first handle.
    pub(crate) fn new(budget: Budget) -> (Arc<Self>, Handle) {
        let state = State {
            requests: VecDeque::new(),
            in_flight: 0,
            in_flight_bytes: 0,
            relay: None,
            room: Vec::new(),
            queues: Vec::new(),
            next_queue: 0,
            handles: 1,
        };
        let shared = Arc::new(Self {
            state: Mutex::new(Some(state)),
            next_seqnum: AtomicU32::new(1),
            closed: AtomicBool::new(false),
            budget,
        });
        (shared.clone(), Handle(shared))
    }

    fn state(&self) -> MutexGuard<'_, Option<State>> {
        usbwire_proto::sync::lock(&self.state)
    }

    pub(crate) fn next_seqnum(&self) -> u32 {
        self.next_seqnum.fetch_add(1, Ordering::Relaxed)
    }

    /// Commands accepted and not answered yet, and their bytes (none once closed).
    pub(crate) fn accepted(&self) -> (usize, usize) {
        self.state().as_ref().map_or((0, 0), |state| (state.in_flight, state.in_flight_bytes))
    }

    /// Whether the connection is gone: nothing sent now will be answered.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Hands `requests` to the relay, in order, while the budget has room;
    /// what does not fit stays in `requests`, and `cx` (if any) is woken when
    /// there is room. `force` takes them all regardless (a queue being
    /// dropped: what it accepted goes out). Fails when the connection is gone;
    /// the requests are dropped then, so their waiters fail as disconnected.
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
        let Some(state) = guard.as_mut() else {
            requests.clear();
            return Err(TransferError::Disconnected);
        };
        let before = state.requests.len();
        let mut fits = 0;
        for request in requests.iter() {
            let bytes = request.bytes();
            if !force && !state.has_room(&self.budget, bytes) {
                break;
            }
            state.in_flight += 1;
            state.in_flight_bytes += bytes;
            fits += 1;
        }
        if fits == requests.len() && state.requests.is_empty() {
            // The usual case: the whole batch changes hands without moving a command.
            std::mem::swap(&mut state.requests, requests);
        } else {
            state.requests.extend(requests.drain(..fits));
        }
        if let (false, Some(cx)) = (requests.is_empty(), cx) {
            if !state.room.iter().any(|waker| waker.will_wake(cx.waker())) {
                state.room.push(cx.waker().clone());
            }
        }
        let relay = (state.requests.len() != before).then(|| state.relay.take()).flatten();
        drop(guard);
        if let Some(relay) = relay {
            relay.wake();
        }
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
        let state = guard.as_mut()?;
        let id = state.next_queue;
        state.next_queue += 1;
        state.queues.push((id, inbox));
        Some(id)
    }

    /// A dropped queue's URBs still complete; their replies are then dropped.
    pub(crate) fn unregister_queue(&self, id: u64) {
        if let Some(state) = self.state().as_mut() {
            state.queues.retain(|(queue, _)| *queue != id);
        }
    }

    /// The connection is gone: every URB still waiting fails as disconnected
    /// (dropped reply senders; queues are told), and callers waiting for room
    /// are woken to find out.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let Some(state) = self.state().take() else { return };
        for (_, inbox) in &state.queues {
            inbox.disconnect();
        }
        state.room.into_iter().for_each(Waker::wake);
    }
}

/// A caller's hold on a connection (the [`Connection`](crate::Connection)
/// and each of its queues): the relay ends the session once every handle is
/// dropped and it has taken what they sent.
pub(crate) struct Handle(Arc<Shared>);

impl Handle {
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.0
    }
}

impl Clone for Handle {
    fn clone(&self) -> Self {
        if let Some(state) = self.0.state().as_mut() {
            state.handles += 1;
        }
        Self(self.0.clone())
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let relay = match self.0.state().as_mut() {
            Some(state) => {
                state.handles -= 1;
                if state.handles == 0 {
                    state.relay.take()
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
        usbwire_proto::sync::lock(&self.state)
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
struct Deliveries {
    /// The queue the replies in `replies` are for, and its inbox (`None`: the
    /// queue was dropped, and so are its replies).
    queue: Option<(u64, Option<Arc<Inbox>>)>,
    replies: VecDeque<RetSubmit>,
    /// Wakers of queues that were waiting, to wake once the read is handed over.
    wake: Vec<Waker>,
}

impl Deliveries {
    fn add(&mut self, id: u64, ret: RetSubmit, state: &State) {
        if self.queue.as_ref().map(|(current, _)| *current) != Some(id) {
            self.hand_over();
            self.queue = Some((id, state.inbox(id).cloned()));
        }
        self.replies.push_back(ret);
    }

    /// Moves the gathered replies into their inbox.
    fn hand_over(&mut self) {
        match self.queue.take() {
            Some((_, Some(inbox))) => inbox.push_all(&mut self.replies, &mut self.wake),
            _ => self.replies.clear(),
        }
    }
}

/// The relay's view of a userspace connection: commands come from [`Shared`]
/// as the session wants them, replies go straight to their waiters.
pub(crate) struct ApiFront {
    shared: Arc<Shared>,
    /// Reused from read to read, so handing replies over allocates nothing.
    deliveries: Deliveries,
}

impl ApiFront {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Self { shared, deliveries: Deliveries::default() }
    }
}

impl Front for ApiFront {
    type Tag = Waiter;

    fn poll_commands(&mut self, cx: &mut Context<'_>, session: &mut ClientSession<Waiter>) -> Result<Step, RelayError> {
        let mut guard = self.shared.state();
        // Closed: only the relay closes, as it ends.
        let Some(state) = guard.as_mut() else { return Ok(Step::Detached) };
        let mut took = false;
        while session.wants_commands() {
            let Some(request) = state.requests.pop_front() else { break };
            match request {
                Request::Submit(submit, waiter) => session.submit(submit, waiter)?,
                Request::Unlink(unlink) => session.unlink(unlink)?,
            }
            took = true;
        }
        if state.requests.is_empty() {
            // Every handle is gone (the connection and its queues): end, now that
            // nothing is left to hand over.
            if state.handles == 0 {
                return Ok(Step::Detached);
            }
            match &mut state.relay {
                Some(waker) if waker.will_wake(cx.waker()) => {}
                slot => *slot = Some(cx.waker().clone()),
            }
        }
        Ok(if took { Step::Progressed } else { Step::Idle })
    }

    fn takes_replies(&self) -> bool {
        true
    }

    fn take_replies(&mut self, session: &mut ClientSession<Waiter>) -> Replies {
        let deliveries = &mut self.deliveries;
        // Reply futures wake their tasks when sent to; a queue only when it was waiting.
        let mut answered_futures = false;
        let (handled, room) = {
            let mut guard = self.shared.state();
            let Some(state) = guard.as_mut() else {
                // Closed: nobody waits for the replies any more.
                return Replies { handled: session.handle_input_with(drop), woke: false };
            };
            let mut released = false;
            let handled = session.handle_input_with(|event| {
                released = true;
                match event {
                    Event::Completed { reply, tag } => {
                        state.release(tag.bytes);
                        answered_futures |= tag.deliver(reply, deliveries, state);
                    }
                    Event::Unlinked { reply, cancelled, .. } => {
                        debug!(seqnum = reply.seqnum, status = ?reply.status, "unlink answered");
                        state.release(0);
                        // Cancelled without a RET_SUBMIT (the kernel stub's way): the
                        // RET_UNLINK is the URB's only answer, as vhci treats it.
                        if let Some((target, waiter)) = cancelled {
                            state.release(waiter.bytes);
                            answered_futures |= waiter.deliver(empty_reply(target, reply.status), deliveries, state);
                        }
                    }
                }
            });
            deliveries.hand_over();
            (handled, if released { std::mem::take(&mut state.room) } else { Vec::new() })
        };
        let woke = !deliveries.wake.is_empty() || !room.is_empty();
        deliveries.wake.drain(..).for_each(Waker::wake);
        room.into_iter().for_each(Waker::wake);
        Replies { handled, woke: woke || answered_futures }
    }

    /// Replies went to their waiters as they were taken; what is left is to
    /// see whether the callers let go. Every handle gone, the session ends
    /// even when it is too full to take the last commands handed over (a
    /// server that answers nothing more must not keep the relay): those are
    /// dropped, and their waiters, if anyone still holds one, fail.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Step {
        let mut guard = self.shared.state();
        let Some(state) = guard.as_mut() else { return Step::Detached };
        if state.handles == 0 {
            return Step::Detached;
        }
        match &mut state.relay {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        Step::Idle
    }

    /// Marks the connection closed before its pending transfers fail, so
    /// they never see it open.
    fn ended(&mut self) {
        self.shared.close();
    }
}

/// A RET_SUBMIT without data: what a URB cancelled by its RET_UNLINK gets.
fn empty_reply(seqnum: u32, status: Status) -> RetSubmit {
    RetSubmit {
        seqnum,
        status,
        actual_length: 0,
        start_frame: 0,
        number_of_packets: 0,
        error_count: 0,
        data: Bytes::new(),
        iso_packets: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;
    use usbwire_proto::urb::TransferFlags;
    use usbwire_proto::{Direction, Limits};

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
        let submit = bulk_out(shared, length);
        let waiter = Waiter::queue(id, &submit);
        Request::Submit(submit, waiter)
    }

    /// The server's answers to `seqnums`, in order, read into the session
    /// and handed over by the front.
    fn answer_all(front: &mut ApiFront, session: &mut ClientSession<Waiter>, seqnums: &[u32]) {
        let mut bytes = BytesMut::new();
        for &seqnum in seqnums {
            let reply = empty_reply(seqnum, Status::OK);
            reply.encode(&mut bytes);
        }
        session.input().extend_from_slice(&bytes);
        front.take_replies(session).handled.unwrap();
    }

    #[test]
    fn replies_reach_registered_queues_in_order_and_dropped_queues_lose_theirs() {
        let (shared, _handle) = Shared::new(Budget::default());
        let (a, b) = (Arc::<Inbox>::default(), Arc::<Inbox>::default());
        let (id_a, id_b) = (shared.register_queue(a.clone()).unwrap(), shared.register_queue(b.clone()).unwrap());
        assert_ne!(id_a, id_b);
        let guard = shared.state();
        let state = guard.as_ref().unwrap();
        let mut deliveries = Deliveries::default();
        for (id, seqnum) in [(id_a, 1), (id_a, 2), (id_b, 3), (id_a, 4)] {
            deliveries.add(id, empty_reply(seqnum, Status::OK), state);
        }
        deliveries.hand_over();
        let seqnums = |inbox: &Inbox| inbox.state().ready.iter().map(|ret| ret.seqnum).collect::<Vec<_>>();
        assert_eq!(seqnums(&a), vec![1, 2, 4]);
        assert_eq!(seqnums(&b), vec![3]);
        drop(guard);

        shared.unregister_queue(id_b);
        let guard = shared.state();
        let state = guard.as_ref().unwrap();
        assert!(state.inbox(id_b).is_none() && state.inbox(id_a).is_some());
        deliveries.add(id_b, empty_reply(5, Status::OK), state);
        deliveries.hand_over();
        assert_eq!(seqnums(&b), vec![3], "a dropped queue gets nothing more");
        assert!(deliveries.replies.is_empty());
    }

    #[test]
    fn commands_past_the_budget_wait_until_replies_make_room() {
        let budget = Budget { in_flight_urbs: 3, in_flight_bytes: 1 << 20, ..Budget::default() };
        let (shared, _handle) = Shared::new(budget.clone());
        let inbox = Arc::<Inbox>::default();
        let id = shared.register_queue(inbox.clone()).unwrap();
        // Three small URBs fit the URB count; then 1 MiB more does not fit the bytes.
        let mut requests: VecDeque<Request> = [512, 512, 512, 512].iter().map(|&n| queued(&shared, id, n)).collect();
        shared.send(&mut requests, None, false).unwrap();
        assert_eq!(requests.len(), 1, "three accepted, one waits");

        let mut session = ClientSession::new(1, BytesMut::new(), Limits::default(), budget.clone());
        let mut front = ApiFront::new(shared.clone());
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(front.poll_commands(&mut cx, &mut session).unwrap(), Step::Progressed));
        assert_eq!(session.outstanding(), 3);

        answer_all(&mut front, &mut session, &[1, 2]);
        assert_eq!(inbox.state().ready.len(), 2);
        shared.send(&mut requests, None, false).unwrap();
        assert!(requests.is_empty(), "two answered: room again");

        let mut big: VecDeque<Request> = [queued(&shared, id, 1 << 20)].into();
        shared.send(&mut big, None, false).unwrap();
        assert_eq!(big.len(), 1, "1 MiB more would pass the bytes in flight");
        assert!(front.poll_commands(&mut cx, &mut session).is_ok());
        answer_all(&mut front, &mut session, &[3, 4]);
        shared.send(&mut big, None, false).unwrap();
        assert!(big.is_empty(), "with nothing in flight any URB gets through");
    }

    #[test]
    fn the_relay_lets_go_once_every_handle_is_gone_and_their_commands_are_taken() {
        let (shared, handle) = Shared::new(Budget::default());
        let second = handle.clone();
        let mut requests: VecDeque<Request> = [queued(&shared, 0, 8)].into();
        shared.send(&mut requests, None, false).unwrap();
        drop(handle);
        drop(second);
        let mut session = ClientSession::new(1, BytesMut::new(), Limits::default(), Budget::default());
        let mut front = ApiFront::new(shared.clone());
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(front.poll_commands(&mut cx, &mut session).unwrap(), Step::Detached));
        assert_eq!(session.outstanding(), 1, "what was sent before the handles went is taken first");
        front.ended();
        assert!(shared.is_closed());
        let mut late: VecDeque<Request> = [queued(&shared, 0, 8)].into();
        assert!(matches!(shared.send(&mut late, None, false), Err(TransferError::Disconnected)));
    }

    #[test]
    fn the_relay_lets_go_of_a_full_session_once_every_handle_is_gone() {
        let budget = Budget { in_flight_urbs: 1, ..Budget::default() };
        let (shared, handle) = Shared::new(budget.clone());
        let mut session = ClientSession::new(1, BytesMut::new(), Limits::default(), budget);
        let mut front = ApiFront::new(shared.clone());
        let mut cx = Context::from_waker(Waker::noop());
        // A dropped queue hands over what it holds past the budget.
        let mut requests: VecDeque<Request> = [queued(&shared, 0, 8), queued(&shared, 0, 8)].into();
        shared.send(&mut requests, None, true).unwrap();
        assert!(matches!(front.poll_commands(&mut cx, &mut session).unwrap(), Step::Progressed));
        assert!(!session.wants_commands(), "the session is full; the second command waits");
        assert!(matches!(front.poll_flush(&mut cx), Step::Idle), "held: keep serving");
        drop(handle);
        assert!(
            matches!(front.poll_flush(&mut cx), Step::Detached),
            "nobody holds the connection: a server that never answers does not keep the relay"
        );
    }
}
