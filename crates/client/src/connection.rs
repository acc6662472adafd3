//! [`Connection`]: an imported device's URB channel in userspace.
//!
//! A plain connection has two tasks on the server's socket: a writer that
//! sends CMD_SUBMIT/CMD_UNLINK in batches (vectored writes) and a reader that
//! matches RET_SUBMIT/RET_UNLINK to their waiters by seqnum, in any order.
//!
//! A resumable connection ([`Connection::import_resumable`]) hands its
//! commands, each with its waiter, to the [`relay`] task instead, whose
//! [`ClientSession`](usbwire_proto::client_session::ClientSession) keeps them
//! until answered and resumes the session when the link drops, so callers
//! see a delay, not an error. When the relay gives up, what is pending fails
//! as disconnected.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, warn, Instrument};
use usbwire_proto::client_session::{ClientSession, Event};
use usbwire_proto::op::{BusId, DeviceRecord};
use usbwire_proto::urb::{self, CmdSubmit, CmdUnlink, RetSubmit, ServerMessage, SubmittedShape, TransferFlags};
use usbwire_proto::{Direction, Limits, RecvBuffer, SeqnumMap, Status};
use usbwire_transport::PeerStream;

use crate::relay::{self, RelayError, RelayState, Step, Upstream};
use crate::{queue, ClientError, Security, Transfer, TransferError, TransferQueue, TransformSpec};

/// OUT payloads up to this size are copied next to their header (one write).
const SMALL_PAYLOAD: usize = 16 * 1024;
/// How long a resumable connection keeps trying to reach its server before
/// it gives the session up (as `usbwire attach` does). A server that no
/// longer holds the session refuses at once; this bounds an unreachable one.
pub const RESUME_GIVE_UP: Duration = Duration::from_secs(120);

#[derive(Default)]
pub(crate) struct Waiters {
    pub(crate) submits: SeqnumMap<(SubmittedShape, Waiter)>,
    /// CMD_UNLINK seqnum -> the seqnum it cancels.
    pub(crate) unlinks: SeqnumMap<u32>,
    /// The inboxes of live [`TransferQueue`]s, by queue id. A queued URB's
    /// waiter names its queue by id, so queueing one takes no `Arc` clone.
    pub(crate) queues: Vec<(u64, Arc<queue::Inbox>)>,
    pub(crate) next_queue: u64,
}

impl Waiters {
    pub(crate) fn register_queue(&mut self, inbox: Arc<queue::Inbox>) -> u64 {
        let id = self.next_queue;
        self.next_queue += 1;
        self.queues.push((id, inbox));
        id
    }

    /// A dropped queue's URBs still complete; their replies are then dropped.
    pub(crate) fn unregister_queue(&mut self, id: u64) {
        self.queues.retain(|(queue, _)| *queue != id);
    }

    pub(crate) fn inbox(&self, id: u64) -> Option<&Arc<queue::Inbox>> {
        self.queues.iter().find(|(queue, _)| *queue == id).map(|(_, inbox)| inbox)
    }
}

/// Who gets a URB's reply.
pub(crate) enum Waiter {
    /// The future [`Connection::submit`] returned.
    Reply(oneshot::Sender<RetSubmit>),
    /// A [`TransferQueue`], by id: the reply joins its inbox's ready list.
    Queue(u64),
}

impl Waiter {
    /// Hands the reply over. A queue's replies gather in `batch` and reach
    /// its inbox together (see [`Deliveries`]).
    pub(crate) fn deliver(self, ret: RetSubmit, batch: &mut Deliveries, waiters: &Waiters) {
        match self {
            Self::Reply(tx) => {
                let _ = tx.send(ret);
            }
            Self::Queue(id) => batch.add(id, ret, waiters),
        }
    }
}

/// Replies of one read on their way to their queues' inboxes: consecutive
/// replies for the same queue are handed over under one lock, and each queue
/// is woken once, after the read is dispatched.
#[derive(Default)]
pub(crate) struct Deliveries {
    /// The queue the replies in `replies` are for, and its inbox (`None`: the
    /// queue was dropped, and so are its replies).
    pub(crate) queue: Option<(u64, Option<Arc<queue::Inbox>>)>,
    pub(crate) replies: Vec<RetSubmit>,
    /// Wakers of queues that were waiting, to wake once the read is handed over.
    pub(crate) wake: Vec<Waker>,
}

impl Deliveries {
    pub(crate) fn add(&mut self, id: u64, ret: RetSubmit, waiters: &Waiters) {
        if self.queue.as_ref().map(|(current, _)| *current) != Some(id) {
            self.hand_over();
            self.queue = Some((id, waiters.inbox(id).cloned()));
        }
        self.replies.push(ret);
    }

    /// Moves the gathered replies into their inbox.
    pub(crate) fn hand_over(&mut self) {
        match self.queue.take() {
            Some((_, Some(inbox))) => inbox.push_all(&mut self.replies, &mut self.wake),
            _ => self.replies.clear(),
        }
    }
}

pub(crate) struct Shared {
    /// `None` once the connection is gone.
    pub(crate) waiters: Mutex<Option<Waiters>>,
    pub(crate) next_seqnum: AtomicU32,
    /// Set with `waiters` becoming `None`, readable without the lock.
    pub(crate) closed: AtomicBool,
}

impl Default for Shared {
    fn default() -> Self {
        Self {
            waiters: Mutex::new(Some(Waiters::default())),
            next_seqnum: AtomicU32::new(1),
            closed: AtomicBool::new(false),
        }
    }
}

impl Shared {
    pub(crate) fn waiters(&self) -> std::sync::MutexGuard<'_, Option<Waiters>> {
        usbwire_proto::sync::lock(&self.waiters)
    }

    /// The connection is gone: every URB still waiting fails as disconnected
    /// (dropped reply senders; queues are told).
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let Some(waiters) = self.waiters().take() else { return };
        for (_, inbox) in &waiters.queues {
            inbox.disconnect();
        }
    }
}

/// The URB channel of an imported device.
pub struct Connection {
    devid: u32,
    shared: Arc<Shared>,
    outgoing: Outgoing,
    tasks: Tasks,
}

/// Where a connection's commands go, in the order they go on the wire.
#[derive(Clone)]
pub(crate) enum Outgoing {
    /// Encoded, to the writer task; the reader task matches the replies.
    Frames(mpsc::UnboundedSender<Frame>),
    /// With their waiters, to the relay's session (a resumable connection).
    Session(mpsc::UnboundedSender<Vec<Request>>),
}

/// A command for a resumable connection's relay.
pub(crate) enum Request {
    Submit(CmdSubmit, Waiter),
    Unlink(CmdUnlink),
}

enum Tasks {
    Direct {
        reader: tokio::task::JoinHandle<()>,
        /// `None` once [`Connection::close`] has waited for it.
        writer: Option<tokio::task::JoinHandle<()>>,
    },
    /// The relay ends by itself once every sender of its commands is gone
    /// (close, or the connection and its queues dropped), or when the
    /// session is lost.
    Relayed { task: tokio::task::JoinHandle<()>, states: watch::Receiver<RelayState> },
}

/// One message for the writer task: the header (with a small payload and any
/// isochronous descriptors packed behind it) and a large OUT payload, uncopied.
pub(crate) struct Frame {
    pub(crate) head: Bytes,
    pub(crate) payload: Bytes,
}

/// Messages the writer gathers into one batch.
const MAX_SLICES: usize = 512;
/// Bytes the writer gathers before it writes, so one batch does not hold many large payloads.
const MAX_BATCH_BYTES: usize = 4 << 20;

impl Connection {
    /// Starts the reply reader on an imported device's socket.
    pub fn new(stream: PeerStream, device: &DeviceRecord) -> Self {
        // Plain TCP splits without a lock between the halves; TLS needs tokio's split.
        let (mut read_half, write_half): (
            Box<dyn tokio::io::AsyncRead + Send + Unpin>,
            Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
        ) = match stream {
            PeerStream::Plain(tcp) => {
                let (r, w) = tcp.into_split();
                (Box::new(r), Box::new(w))
            }
            tls => {
                let (r, w) = tokio::io::split(tls);
                (Box::new(r), Box::new(w))
            }
        };
        let shared = Arc::new(Shared::default());
        let reader_shared = shared.clone();
        let reader = tokio::spawn(async move {
            let mut buf = RecvBuffer::with_capacity(256 * 1024);
            let limits = Limits::default();
            let mut deliveries = Deliveries::default();
            let outcome: Result<(), ClientError> = async {
                loop {
                    let decoded = dispatch_buffered(&reader_shared, &mut buf, &limits, &mut deliveries);
                    deliveries.hand_over();
                    decoded?;
                    // Wake after the locks are released, each waiting queue once per read,
                    // then let it run: while replies keep coming this loop would otherwise
                    // read on until its budget runs out, and on a single-threaded runtime
                    // the queue could not submit more URBs to keep the server busy.
                    if !deliveries.wake.is_empty() {
                        deliveries.wake.drain(..).for_each(Waker::wake);
                        yield_to_ready_tasks().await;
                    }
                    buf.reserve(next_read_room(&buf, &limits));
                    if read_half.read_buf(&mut *buf).await? == 0 {
                        return Ok(());
                    }
                }
            }
            .await;
            match outcome {
                // The reason every pending URB fails with `Disconnected`: worth seeing without -v.
                Err(error @ ClientError::Protocol(_)) => {
                    tracing::warn!(%error, "the server sent a malformed reply; connection closed")
                }
                Err(error) => debug!(%error, "urb channel closed"),
                Ok(()) => {}
            }
            reader_shared.close();
        });
        let (outgoing, frames) = mpsc::unbounded_channel();
        let writer = Some(tokio::spawn(write_frames(write_half, frames, shared.clone())));
        Self {
            devid: device.devid(),
            shared,
            outgoing: Outgoing::Frames(outgoing),
            tasks: Tasks::Direct { reader, writer },
        }
    }

    /// Imports `busid` offering resume ([`crate::import_resumable`]). When the
    /// server grants it, the connection survives drops of its link: a relay
    /// task reconnects and resumes the session (see [`relay`]), and transfers
    /// in flight or submitted meanwhile complete late instead of failing.
    /// Only when the session is lost (the server's grace period ran out, it
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
        let device = imported.device;
        if imported.resume.is_none() {
            return Ok((Self::new(imported.stream, &device), device));
        }
        let upstream = Upstream {
            addr,
            security: security.clone(),
            transforms: transforms.to_vec(),
            resume: imported.resume,
            give_up_after: RESUME_GIVE_UP,
        };
        let shared = Arc::new(Shared::default());
        let (outgoing, requests) = mpsc::unbounded_channel();
        let (state, states) = watch::channel(RelayState::Connected);
        let devid = device.devid();
        let span = tracing::info_span!(target: "usbwire::client", "resumable", %addr, %busid, devid);
        let front = SessionFront { requests, waiting: VecDeque::new(), shared: shared.clone() };
        let task = tokio::spawn(
            async move {
                match relay::drive(front, imported.stream, devid, upstream, Some(state)).await {
                    Ok(()) => debug!("connection closed; relay ended"),
                    // What is pending fails as disconnected (see SessionFront::ended).
                    Err(error) => warn!(%error, "relay ended"),
                }
            }
            .instrument(span),
        );
        let tasks = Tasks::Relayed { task, states };
        Ok((Self { devid, shared, outgoing: Outgoing::Session(outgoing), tasks }, device))
    }

    /// Whether the server granted resume (see [`Connection::import_resumable`]).
    pub fn is_resumable(&self) -> bool {
        matches!(self.tasks, Tasks::Relayed { .. })
    }

    /// The relay's state (connected, or resuming since when) and its changes;
    /// `None` when the connection is not resumable.
    pub fn relay_states(&self) -> Option<watch::Receiver<RelayState>> {
        match &self.tasks {
            Tasks::Relayed { states, .. } => Some(states.clone()),
            Tasks::Direct { .. } => None,
        }
    }

    /// Ends the connection cleanly and waits (up to a second) until it has: what was
    /// submitted is written, then the stream is shut down (over TLS with close_notify,
    /// so the server logs a client that left, not a cut connection). Dropping a
    /// `Connection` does the same in the background; a short-lived process that exits
    /// right after should close instead. Transfer queues still alive keep it open.
    pub async fn close(mut self) {
        let deadline = Instant::now() + Duration::from_secs(1);
        // Dropping our sender lets the writer (or the relay) finish what is queued and end.
        self.outgoing = Outgoing::Frames(mpsc::unbounded_channel().0);
        let task = match &mut self.tasks {
            Tasks::Direct { writer, .. } => writer.take(),
            Tasks::Relayed { task, .. } => Some(std::mem::replace(task, tokio::spawn(async {}))),
        };
        if let Some(task) = task {
            let _ = tokio::time::timeout_at(deadline.into(), task).await;
        }
    }

    /// Submits a transfer; returns its seqnum and a future for the reply.
    pub async fn submit(
        &self,
        transfer: Transfer,
    ) -> Result<(u32, impl std::future::Future<Output = Result<RetSubmit, TransferError>>), TransferError> {
        let seqnum = self.shared.next_seqnum.fetch_add(1, Ordering::Relaxed);
        let (submit, shape) = build_submit(self.devid, seqnum, transfer);
        let (tx, rx) = oneshot::channel();
        let sent = match &self.outgoing {
            Outgoing::Frames(frames) => {
                let mut head = BytesMut::new();
                let payload = encode_submit(submit, &mut head);
                self.shared
                    .waiters()
                    .as_mut()
                    .ok_or(TransferError::Disconnected)?
                    .submits
                    .insert(seqnum, (shape, Waiter::Reply(tx)));
                frames.send(Frame { head: head.freeze(), payload }).is_ok()
            }
            Outgoing::Session(requests) => {
                !self.shared.closed.load(Ordering::Relaxed)
                    && requests.send(vec![Request::Submit(submit, Waiter::Reply(tx))]).is_ok()
            }
        };
        if !sent {
            return Err(TransferError::Disconnected);
        }
        Ok((seqnum, async move { rx.await.map_err(|_| TransferError::Disconnected) }))
    }

    /// A queue for URBs submitted and collected by one task: completions come
    /// back in batches, without a future per URB (see [`TransferQueue`]).
    pub fn queue(&self) -> TransferQueue {
        TransferQueue::new(self.devid, self.shared.clone(), self.outgoing.clone())
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
    /// resolves with [`Status::ECONNRESET`].
    pub async fn unlink(&self, target: u32) -> Result<(), TransferError> {
        let seqnum = self.shared.next_seqnum.fetch_add(1, Ordering::Relaxed);
        let unlink = CmdUnlink { seqnum, devid: self.devid, unlink_seqnum: target };
        let sent = match &self.outgoing {
            Outgoing::Frames(frames) => {
                if let Some(w) = self.shared.waiters().as_mut() {
                    w.unlinks.insert(seqnum, target);
                }
                let head = Bytes::copy_from_slice(&unlink.header());
                frames.send(Frame { head, payload: Bytes::new() }).is_ok()
            }
            Outgoing::Session(requests) => requests.send(vec![Request::Unlink(unlink)]).is_ok(),
        };
        sent.then_some(()).ok_or(TransferError::Disconnected)
    }

    /// Whether the connection is gone (closed by the server, failed, or its
    /// session lost): nothing submitted now will complete.
    pub fn is_closed(&self) -> bool {
        // The flag is set before pending transfers fail, so they never see it unset.
        self.shared.closed.load(Ordering::Relaxed)
            || match &self.tasks {
                Tasks::Direct { reader, .. } => reader.is_finished(),
                Tasks::Relayed { task, .. } => task.is_finished(),
            }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // A relay ends by itself: it still delivers what was queued, then ends the session.
        if let Tasks::Direct { reader, .. } = &self.tasks {
            reader.abort();
        }
    }
}

/// A userspace connection as the relay's front: commands arrive with their
/// waiters over a channel, replies go straight to the waiters.
struct SessionFront {
    requests: mpsc::UnboundedReceiver<Vec<Request>>,
    /// Commands received that the session's budget did not take yet.
    waiting: VecDeque<Request>,
    shared: Arc<Shared>,
}

impl SessionFront {
    fn submit_waiting(&mut self, session: &mut ClientSession<Waiter>) -> Result<bool, RelayError> {
        let mut took = false;
        while session.wants_commands() {
            let Some(request) = self.waiting.pop_front() else { break };
            match request {
                Request::Submit(submit, waiter) => session.submit(submit, waiter)?,
                Request::Unlink(unlink) => session.unlink(unlink)?,
            }
            took = true;
        }
        Ok(took)
    }
}

impl relay::Front for SessionFront {
    type Tag = Waiter;

    fn poll_commands(
        &mut self,
        cx: &mut std::task::Context<'_>,
        session: &mut ClientSession<Waiter>,
    ) -> Result<Step, RelayError> {
        let mut took = self.submit_waiting(session)?;
        while self.waiting.is_empty() && session.wants_commands() {
            match self.requests.poll_recv(cx) {
                std::task::Poll::Ready(Some(batch)) => {
                    self.waiting.extend(batch);
                    took |= self.submit_waiting(session)?;
                }
                // Every sender is gone (the connection and its queues): end, once
                // nothing is left to hand over.
                std::task::Poll::Ready(None) => return Ok(Step::Detached),
                std::task::Poll::Pending => break,
            }
        }
        Ok(if took { Step::Progressed } else { Step::Idle })
    }

    fn takes_replies(&self) -> bool {
        true
    }

    fn take_replies(&mut self, session: &mut ClientSession<Waiter>) -> bool {
        let mut deliveries = Deliveries::default();
        // Reply futures wake their tasks when sent to; a queue only when it was waiting.
        let mut answered_futures = false;
        {
            let guard = self.shared.waiters();
            let Some(waiters) = guard.as_ref() else {
                while session.poll_event().is_some() {}
                return false;
            };
            while let Some(event) = session.poll_event() {
                match event {
                    Event::Completed { reply, tag } => {
                        answered_futures |= matches!(tag, Waiter::Reply(_));
                        tag.deliver(reply, &mut deliveries, waiters);
                    }
                    Event::Unlinked { reply, cancelled, .. } => {
                        debug!(seqnum = reply.seqnum, status = ?reply.status, "unlink answered");
                        if let Some((target, waiter)) = cancelled {
                            answered_futures |= matches!(waiter, Waiter::Reply(_));
                            waiter.deliver(empty_reply(target, reply.status), &mut deliveries, waiters);
                        }
                    }
                }
            }
            deliveries.hand_over();
        }
        let woke = !deliveries.wake.is_empty();
        deliveries.wake.drain(..).for_each(Waker::wake);
        woke || answered_futures
    }

    fn poll_flush(&mut self, _cx: &mut std::task::Context<'_>) -> Step {
        Step::Idle
    }

    /// Marks the connection closed before its pending transfers fail, so
    /// they never see it open.
    fn ended(&mut self) {
        self.shared.close();
    }
}

/// Lets the tasks that are ready run before this one continues: the task goes
/// to the back of the run queue. Unlike `tokio::task::yield_now`, whose wake
/// is deferred until the runtime has polled the I/O driver, this costs no
/// extra `epoll_wait` per read (the driver is still polled regularly, every
/// few dozen tasks, by the runtime itself).
async fn yield_to_ready_tasks() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            return std::task::Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await;
}

/// Decodes every whole message in `buf` and hands each reply to its waiter,
/// under one lock of the waiter map for the lot; queues' replies gather in
/// `deliveries` for the caller to hand over once the map's lock is released.
fn dispatch_buffered(
    shared: &Shared,
    buf: &mut BytesMut,
    limits: &Limits,
    deliveries: &mut Deliveries,
) -> Result<(), ClientError> {
    let mut guard = shared.waiters();
    loop {
        let decoded = {
            let waiters = guard.as_ref();
            urb::decode_return(buf, limits, |seq| waiters.and_then(|w| w.submits.get(seq)).map(|(shape, _)| *shape))?
        };
        let Some(waiters) = guard.as_mut() else {
            // Closed by the writer: nobody is waiting any more.
            return Ok(());
        };
        match decoded {
            Some(ServerMessage::Submit(ret)) => {
                if let Some((_, waiter)) = waiters.submits.remove(ret.seqnum) {
                    waiter.deliver(ret, deliveries, waiters);
                }
            }
            Some(ServerMessage::Unlink(ret)) => {
                debug!(seqnum = ret.seqnum, status = ?ret.status, "unlink answered");
                // Cancelled without a RET_SUBMIT (the kernel stub's way): the
                // RET_UNLINK is the URB's only answer, as vhci treats it.
                let cancelled = waiters
                    .unlinks
                    .remove(ret.seqnum)
                    .and_then(|target| waiters.submits.remove(target).map(|(_, waiter)| (target, waiter)));
                if let Some((target, waiter)) = cancelled {
                    waiter.deliver(empty_reply(target, ret.status), deliveries, waiters);
                }
            }
            None => return Ok(()),
        }
    }
}

/// A RET_SUBMIT without data: what a URB cancelled by its RET_UNLINK gets.
pub(crate) fn empty_reply(seqnum: u32, status: Status) -> RetSubmit {
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

/// The `CMD_SUBMIT` for `transfer`, and what its reply will look like.
pub(crate) fn build_submit(devid: u32, seqnum: u32, transfer: Transfer) -> (CmdSubmit, SubmittedShape) {
    let length = match transfer.direction {
        Direction::Out => transfer.data.len() as u32,
        Direction::In => transfer.length,
    };
    let number_of_packets = transfer.iso_packets.as_ref().map_or(0, |p| p.len() as i32);
    let shape = SubmittedShape {
        direction: transfer.direction,
        transfer_buffer_length: length,
        iso_packets: transfer.iso_packets.as_ref().map(|p| p.len() as i32),
    };
    let submit = CmdSubmit {
        seqnum,
        devid,
        direction: transfer.direction,
        ep: transfer.endpoint,
        transfer_flags: TransferFlags(transfer.flags),
        transfer_buffer_length: length,
        start_frame: 0,
        number_of_packets,
        interval: transfer.interval,
        setup: transfer.setup,
        data: transfer.data,
        iso_packets: transfer.iso_packets.unwrap_or_default(),
    };
    (submit, shape)
}

/// Encodes `submit` onto `head`. Small messages are packed into `head`; a
/// large OUT payload is returned to go out beside it in the same vectored
/// write, uncopied. Isochronous descriptors follow the payload, so they force
/// the copy.
pub(crate) fn encode_submit(submit: CmdSubmit, head: &mut BytesMut) -> Bytes {
    let iso_len = submit.iso_packets.len() * urb::ISO_DESCRIPTOR_LEN;
    let out_len = if submit.direction == Direction::Out { submit.data.len() } else { 0 };
    let large = out_len > SMALL_PAYLOAD && iso_len == 0;
    head.reserve(urb::HEADER_LEN + if large { 0 } else { out_len } + iso_len);
    head.extend_from_slice(&submit.header());
    if out_len > 0 && !large {
        head.extend_from_slice(&submit.data);
    }
    for packet in &submit.iso_packets {
        head.extend_from_slice(&packet.offset.to_be_bytes());
        head.extend_from_slice(&packet.length.to_be_bytes());
        head.extend_from_slice(&[0; 8]);
    }
    if large {
        submit.data
    } else {
        Bytes::new()
    }
}

/// Room to reserve before the next read: the rest of a RET_SUBMIT whose
/// header is already buffered (bounded by the limits), so a large IN payload
/// lands in one allocation instead of growing the buffer (and copying it) read
/// by read; at least 64 KiB otherwise.
fn next_read_room(buf: &[u8], limits: &Limits) -> usize {
    const MIN_READ: usize = 64 * 1024;
    if buf.len() < urb::HEADER_LEN {
        return MIN_READ;
    }
    let field = |at: usize| u32::from_be_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
    if urb::Command(field(0)) != urb::Command::RET_SUBMIT {
        return MIN_READ;
    }
    let payload = field(0x18).min(limits.max_transfer_length) as usize;
    (urb::HEADER_LEN + payload).saturating_sub(buf.len()).max(MIN_READ)
}

/// The writer task: takes every message queued since its last write and sends
/// them with as few `writev` calls as the socket allows, so URBs submitted
/// while it was writing share one system call (and, with TCP_NODELAY, as few
/// segments as their bytes need). Submitters never wait for the socket.
///
/// Ends when the [`Connection`] is dropped (after writing what was queued) or
/// the socket fails; then every URB still waiting fails as disconnected.
async fn write_frames(
    mut writer: Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
    mut frames: mpsc::UnboundedReceiver<Frame>,
    shared: Arc<Shared>,
) {
    let mut batch: Vec<Bytes> = Vec::new();
    while let Some(first) = frames.recv().await {
        let mut bytes = 0;
        let mut next = Some(first);
        while let Some(frame) = next.take() {
            bytes += frame.head.len() + frame.payload.len();
            batch.push(frame.head);
            if !frame.payload.is_empty() {
                batch.push(frame.payload);
            }
            if batch.len() < MAX_SLICES && bytes < MAX_BATCH_BYTES {
                next = frames.try_recv().ok();
            }
        }
        let sent = async {
            usbwire_transport::write_all_parts(&mut *writer, &batch).await?;
            writer.flush().await
        }
        .await;
        batch.clear();
        if let Err(error) = sent {
            debug!(%error, "urb channel write failed");
            shared.close();
            return;
        }
    }
    // The connection was dropped: end the stream cleanly (TLS: close_notify, so the
    // server can tell a client that left from a connection cut short).
    let _ = writer.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_reach_registered_queues_in_order_and_dropped_queues_lose_theirs() {
        let mut waiters = Waiters::default();
        let (a, b) = (Arc::<queue::Inbox>::default(), Arc::<queue::Inbox>::default());
        let (id_a, id_b) = (waiters.register_queue(a.clone()), waiters.register_queue(b.clone()));
        assert_ne!(id_a, id_b);
        let mut deliveries = Deliveries::default();
        for (id, seqnum) in [(id_a, 1), (id_a, 2), (id_b, 3), (id_a, 4)] {
            deliveries.add(id, empty_reply(seqnum, Status::OK), &waiters);
        }
        deliveries.hand_over();
        assert_eq!(a.ready_seqnums(), vec![1, 2, 4]);
        assert_eq!(b.ready_seqnums(), vec![3]);

        waiters.unregister_queue(id_b);
        assert!(waiters.inbox(id_b).is_none() && waiters.inbox(id_a).is_some());
        deliveries.add(id_b, empty_reply(5, Status::OK), &waiters);
        deliveries.hand_over();
        assert_eq!(b.ready_seqnums(), vec![3], "a dropped queue gets nothing more");
        assert!(deliveries.replies.is_empty());
    }
}
