//! The URB phase of one imported device: drives a [`ServerSession`] (the
//! in-flight table, unlink rules and memory budget, sans I/O) with the
//! client's socket and the device.
//!
//! A single hand-written poll loop reads commands while the session wants
//! them, hands its device calls to the device, collects completions in
//! whatever order the device finishes them (while the session wants them),
//! and writes replies with vectored writes — so a long-pending interrupt IN
//! never holds up ep0 or a bulk stream, and nothing is shared with other
//! connections.
//!
//! A resumable session outlives its connection: when the link drops, the device keeps running,
//! its completions are held, and the session parks ([`crate::resumable`]) for the grace period,
//! whose clock is the sans-I/O [`Grace`] (`cores/park.rs`). A client that comes back with the
//! session's token gets `OP_REP_RESUME` and the replies it missed, and the loop goes on.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio_util::io::poll_read_buf;
use tracing::{info, warn};
use usbwire_device::{Device, TransferType, Urb};
use usbwire_proto::op::{self, DeviceRecord, OpStatus};
use usbwire_proto::resume::{EndReason, Token};
use usbwire_proto::server_session::{DeviceCall, ServerSession, SessionError};
use usbwire_transport::{poll_write_outbox, PeerStream};

mod goodbye;

use crate::capture::{Capture, CaptureConfig};
use crate::cores::park::{Grace, ParkEvent};
use crate::meter::UrbMeter;
use crate::peer::Peer;
use crate::registry::{Holder, Lease};
use crate::resumable::{Handover, Parked, Parking};
use crate::state::ServerState;
use goodbye::{linger, say_goodbye};

/// How long an unplugged device has to answer the URBs it had in flight
/// (-ESHUTDOWN) once its export is withdrawn; the channel then ends anyway.
const UNPLUG_ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// How a URB channel ended without a protocol error.
#[derive(Debug)]
pub(crate) enum End {
    ClientClosed,
    /// A resumable client said it is done (detached): nothing to hold for it.
    ClientEnded,
    Shutdown,
    /// The device was unplugged; every URB in flight has been answered.
    DeviceGone,
    /// The export was withdrawn (`usbwire unbind`, unplugged) while imported.
    Withdrawn,
    /// The device re-enumerated (`Device::enumeration` changed) at `seen_at`:
    /// the replies collected before were delivered, a resumable client was
    /// told why (END, [`EndReason::REENUMERATED`]), and the same bus id is
    /// exported again as the new device.
    Reenumerated {
        seen_at: Instant,
    },
}

/// Why a URB channel was closed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ChannelError {
    #[error(transparent)]
    Protocol(#[from] SessionError),
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
}

/// What a resumable import needs to park when its connection drops.
pub(crate) struct Resumable {
    pub(crate) token: Token,
    /// The client asked for keep-alives ([`usbwire_proto::liveness`]).
    pub(crate) keepalive: bool,
    pub(crate) client: crate::resumable::Owner,
    pub(crate) parked: Parked,
    pub(crate) grace: Duration,
}

/// What the client's offer agreed to for this import's URB phase.
pub(crate) struct Agreed {
    /// `Some` when the session outlives its connection.
    pub(crate) resumable: Option<Resumable>,
    /// The storage extension: flagged stages run one at a time ([`ServerSession::storage`]).
    pub(crate) storage: bool,
    /// The descriptor snapshot taken at import, which every capture file starts with.
    pub(crate) descriptors: Option<usbwire_proto::descriptors::Snapshot>,
}

pub(crate) async fn run(
    stream: PeerStream,
    leftover: BytesMut,
    lease: &mut Lease,
    state: &ServerState,
    mut stop: watch::Receiver<bool>,
    agreed: Agreed,
    peer: std::net::SocketAddr,
) -> Result<End, ChannelError> {
    let Agreed { resumable, storage, descriptors } = agreed;
    let record = lease.record().clone();
    let mut capture_setting = state.capture.watch();
    // Captured from the start if the server captures now; `usbwire capture` switches it later.
    let start_capture = |setting: &CaptureConfig| {
        Capture::start(setting, &record, descriptors.as_ref(), peer)
            .inspect_err(|error| warn!(%error, dir = %setting.dir.display(), "cannot capture this import"))
            .ok()
    };
    let mut capture = capture_setting.borrow_and_update().as_ref().and_then(start_capture);
    let mut session = new_session(lease.record(), leftover, state, resumable.as_ref(), storage);
    // Registered for the session's whole life: a client may come back on a new
    // connection before this side has seen the old one drop.
    let mut parking =
        resumable.as_ref().map(|resumable| resumable.parked.park(resumable.token, resumable.client.clone()));
    let holder = lease.holder();
    let mut meter = UrbMeter::new(lease.meter());
    let device = lease.device();
    let enumeration = device.enumeration();
    let mut stream = stream;
    let mut unflushed = false;
    // A resumed connection's admission place lives as long as it carries the session.
    let mut _resumed_peer: Option<Peer> = None;
    loop {
        let mut channel =
            Channel { stream, unflushed, session: &mut session, meter: &mut meter, capture: &mut capture, enumeration };
        let mut early_arrival = None;
        let keepalive = channel.session.poll_timeout();
        let outcome = tokio::select! {
            result = std::future::poll_fn(|cx| channel.poll_drive(cx, device)) => result,
            () = sleep_until(keepalive) => {
                // Keep-alive: a ping when quiet; a client gone silent is a lost connection.
                match channel.session.handle_timeout(Instant::now()) {
                    Ok(()) => {
                        (stream, unflushed) = (channel.stream, channel.unflushed);
                        continue;
                    }
                    Err(SessionError::Silent(silent)) => Err(ChannelError::Io(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("nothing heard from the client for {:.1} s", silent.as_secs_f64()),
                    ))),
                    Err(error) => Err(error.into()),
                }
            }
            () = crate::shutdown::stopped(&mut stop) => {
                if resumable.is_some() {
                    linger(say_goodbye(channel.session, channel.stream, EndReason::DONE).await).await;
                }
                return Ok(End::Shutdown);
            }
            arrival = next_arrival(&mut parking) => {
                info!(peer = %arrival.peer.addr, "client came back on a new connection; dropping the old one");
                early_arrival = Some(arrival);
                Ok(End::ClientClosed)
            }
            () = holder.withdrawn() => channel.withdrawn(device, &holder).await,
            Ok(()) = capture_setting.changed() => {
                // Capture switched on or off (`usbwire capture`): the same connection goes on.
                (stream, unflushed) = (channel.stream, channel.unflushed);
                let wanted = capture_setting.borrow_and_update().clone();
                capture = switch_capture(capture, wanted, start_capture);
                continue;
            }
        };
        let outcome = followed(outcome, &holder);
        if let Ok(End::Reenumerated { .. }) = &outcome {
            // The replies already collected (the request that made the device switch)
            // reach the client; a resumable one learns why it ends. The bus id is free at once.
            tokio::spawn(linger(say_goodbye(channel.session, channel.stream, EndReason::REENUMERATED).await));
            return outcome;
        }
        let (Some(resumable), Some(parking)) = (&resumable, &mut parking) else { return outcome };
        match outcome {
            Ok(End::ClientClosed) => info!("connection lost"),
            Err(ChannelError::Io(error)) => info!(%error, "connection lost"),
            other => return other,
        }
        session.disconnected();
        holder.set_resuming(Some(std::time::SystemTime::now()));
        let taps = Taps { meter: &mut meter, capture: &mut capture, enumeration };
        let parked = park(&mut session, device, taps, resumable, parking, early_arrival, &holder, &mut stop).await;
        holder.set_resuming(None);
        match parked {
            ParkOutcome::Resumed(new_stream, peer) => {
                stream = new_stream;
                _resumed_peer = Some(peer);
            }
            ParkOutcome::Ended(end) => return Ok(end),
        }
    }
}

/// The session core for one import: resumable (and with keep-alives), and
/// running mass-storage stages in order, when the client asked.
fn new_session(
    record: &DeviceRecord,
    leftover: BytesMut,
    state: &ServerState,
    resumable: Option<&Resumable>,
    storage: bool,
) -> ServerSession {
    let mut session =
        ServerSession::new(record.devid(), leftover, state.config.limits.clone(), state.config.budget.clone());
    if storage {
        session = session.storage();
    }
    if let Some(resumable) = resumable {
        session = session.resumable();
        if resumable.keepalive {
            session = session.keepalive(Instant::now());
        }
    }
    session
}

/// A real device gone from a port a bind rule names may come back there (a
/// bootloader, a replacement) and be exported again: for the importer that
/// is a re-enumeration, not an end.
fn followed(outcome: Result<End, ChannelError>, holder: &Holder) -> Result<End, ChannelError> {
    match outcome {
        Ok(End::DeviceGone) if holder.left_a_followed_port(true) => Ok(End::Reenumerated { seen_at: Instant::now() }),
        Ok(End::Withdrawn) if holder.left_a_followed_port(false) => Ok(End::Reenumerated { seen_at: Instant::now() }),
        other => other,
    }
}

/// The capture a channel runs once the server's setting is `wanted`: a
/// running one goes on, a new one starts, or the running one stops.
fn switch_capture(
    capture: Option<Capture>,
    wanted: Option<CaptureConfig>,
    start: impl Fn(&CaptureConfig) -> Option<Capture>,
) -> Option<Capture> {
    match wanted {
        Some(setting) if capture.is_none() => start(&setting),
        Some(_) => capture,
        None => {
            if capture.is_some() {
                info!("capture of this import stopped");
            }
            None
        }
    }
}

enum ParkOutcome {
    /// The new connection, and its place in the admission budgets.
    Resumed(PeerStream, Peer),
    Ended(End),
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)).await,
        None => std::future::pending().await,
    }
}

/// The next connection handed over to a resumable session (never, for others).
async fn next_arrival(parking: &mut Option<Parking>) -> Handover {
    match parking {
        Some(parking) => match parking.arrival().await {
            Some(arrival) => arrival,
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// Holds a session whose connection dropped: the device runs on and its
/// completions are held, until the client resumes or the grace period ends
/// (its clock is the sans-I/O [`Grace`]; this loop sleeps until it is due).
#[allow(clippy::too_many_arguments)] // the parked session's whole world; a struct would only rename it
async fn park(
    session: &mut ServerSession,
    device: &mut dyn Device,
    mut taps: Taps<'_>,
    resumable: &Resumable,
    parking: &mut Parking,
    mut arrival: Option<Handover>,
    holder: &Holder,
    stop: &mut watch::Receiver<bool>,
) -> ParkOutcome {
    let mut grace = Grace::start(Instant::now(), resumable.grace);
    if arrival.is_none() {
        info!(grace_secs = resumable.grace.as_secs(), "holding the session for the client to resume");
    }
    loop {
        let mut handover = match arrival.take() {
            Some(handover) => handover,
            None => tokio::select! {
                handover = parking.arrival() => match handover {
                    Some(handover) => handover,
                    None => return ParkOutcome::Ended(End::ClientClosed),
                },
                () = sleep_until(grace.poll_timeout()) => {
                    grace.handle_timeout(Instant::now());
                    if let Some(ParkEvent::Expired { grace: period }) = grace.poll_event() {
                        info!(grace_secs = period.as_secs(), "not resumed within the grace period; releasing the device");
                        return ParkOutcome::Ended(End::ClientClosed);
                    }
                    continue;
                }
                end = std::future::poll_fn(|cx| hold_completions(cx, session, device, &mut taps)) => {
                    match end {
                        End::Reenumerated { .. } => info!("device re-enumerated while the client was away"),
                        _ => info!("device unplugged while the client was away"),
                    }
                    return ParkOutcome::Ended(end);
                }
                () = crate::shutdown::stopped(stop) => return ParkOutcome::Ended(End::Shutdown),
                () = holder.withdrawn() => return ParkOutcome::Ended(End::Withdrawn),
                () = holder.abandoned() => {
                    info!("the client imported the device afresh; releasing its parked session");
                    return ParkOutcome::Ended(End::ClientClosed);
                }
            },
        };
        let mut reply = BytesMut::new();
        if let Err(refused) = grace.resume(Instant::now()) {
            // Came back as the grace period ended: too late, as for a resume after it.
            info!(peer = %handover.peer.addr, reason = %refused, "resume refused; releasing the device");
            op::encode_resume_reply(Err(OpStatus::NODEV), &mut reply);
            let _ = async {
                handover.stream.write_all(&reply).await?;
                handover.stream.flush().await
            }
            .await;
            return ParkOutcome::Ended(End::ClientClosed);
        }
        let held = session.replies().map_or(0, |(_, held)| held);
        let resumed = session.resume(handover.replies_received, std::mem::take(&mut handover.leftover));
        op::encode_resume_reply(resumed.as_ref().copied().map_err(|_| OpStatus::NA), &mut reply);
        let delivered = async {
            handover.stream.write_all(&reply).await?;
            handover.stream.flush().await
        }
        .await;
        match (resumed, delivered) {
            (Ok(commands), Ok(())) => {
                grace.answered(Instant::now());
                // Answered after an accepted resume: the event is `Resumed`.
                let outage = match grace.poll_event() {
                    Some(ParkEvent::Resumed { outage }) => outage,
                    _ => Duration::ZERO,
                };
                let replayed = session.replies().map_or(0, |(_, held)| held);
                info!(
                    peer = %handover.peer.addr,
                    outage_ms = outage.as_millis() as u64,
                    replies_replayed = replayed,
                    replies_held = held,
                    commands_received = commands,
                    "resumed"
                );
                taps.meter.device().resumed();
                return ParkOutcome::Resumed(handover.stream, handover.peer);
            }
            (Err(error), _) => {
                warn!(%error, "resume refused: the client's count does not match this session; releasing");
                return ParkOutcome::Ended(End::ClientClosed);
            }
            (Ok(_), Err(error)) => {
                info!(%error, "resumed connection lost before the answer; still holding");
                grace.answer_lost();
                session.disconnected();
            }
        }
    }
}

/// Collects completions while the client is away (within the budget).
/// Ready only when the device is gone and nothing is in flight, or when it
/// re-enumerated (what it had in flight is abandoned).
fn hold_completions(
    cx: &mut Context<'_>,
    session: &mut ServerSession,
    device: &mut dyn Device,
    taps: &mut Taps<'_>,
) -> Poll<End> {
    while session.wants_completions() {
        match device.poll_complete(cx) {
            Poll::Ready(done) => {
                taps.completed(&done);
                session.complete(done.into_ret_submit());
            }
            Poll::Pending => break,
        }
    }
    if device.enumeration() != taps.enumeration {
        return Poll::Ready(End::Reenumerated { seen_at: Instant::now() });
    }
    if device.is_gone() && session.is_idle() {
        return Poll::Ready(End::DeviceGone);
    }
    Poll::Pending
}

struct Channel<'a> {
    stream: PeerStream,
    /// Written since the last flush (TLS buffers records until flushed).
    unflushed: bool,
    session: &'a mut ServerSession,
    meter: &'a mut UrbMeter,
    capture: &'a mut Option<Capture>,
    /// The device's enumeration when it was imported: another one ends the import.
    enumeration: u32,
}

/// What watches the URBs going by: the counters, and the capture if any
/// (and, for a parked session, which enumeration of the device it holds).
struct Taps<'a> {
    meter: &'a mut UrbMeter,
    capture: &'a mut Option<Capture>,
    enumeration: u32,
}

impl Taps<'_> {
    fn submitted(&mut self, urb: &Urb, transfer: TransferType) {
        self.meter.submitted(urb.seqnum, urb.direction, transfer);
        if let Some(capture) = self.capture {
            capture.submitted(urb, transfer);
        }
    }

    fn completed(&mut self, done: &usbwire_device::Completion) {
        self.meter.completed(done.seqnum, done.status, done.actual_length);
        if let Some(capture) = self.capture {
            capture.completed(done);
        }
    }
}

impl Channel<'_> {
    fn taps(&mut self) -> Taps<'_> {
        Taps { meter: self.meter, capture: self.capture, enumeration: self.enumeration }
    }

    /// The export was withdrawn. If because the device was unplugged, which
    /// the server may learn before the device does, the device is given
    /// [`UNPLUG_ANSWER_TIMEOUT`] to answer what it had in flight (-ESHUTDOWN)
    /// and those replies reach the client before the channel ends.
    async fn withdrawn(&mut self, device: &mut dyn Device, holder: &Holder) -> Result<End, ChannelError> {
        if !holder.was_unplugged() || (self.session.is_idle() && !self.unflushed) {
            return Ok(End::Withdrawn);
        }
        match tokio::time::timeout(UNPLUG_ANSWER_TIMEOUT, std::future::poll_fn(|cx| self.poll_drive(cx, device))).await
        {
            Ok(Ok(End::DeviceGone)) => Ok(End::Withdrawn),
            Ok(other) => other,
            Err(_) => {
                warn!(
                    "the unplugged device did not answer its URBs within {UNPLUG_ANSWER_TIMEOUT:?}; closing the \
                     connection without them"
                );
                Ok(End::Withdrawn)
            }
        }
    }

    fn poll_drive(&mut self, cx: &mut Context<'_>, device: &mut dyn Device) -> Poll<Result<End, ChannelError>> {
        loop {
            let mut progressed = false;
            // A device that re-enumerated takes nothing more of this import.
            if let Some(end) = self.reenumerated(device) {
                return Poll::Ready(Ok(end));
            }

            // Commands: decode what is buffered, then read more while the session wants it.
            progressed |= self.handle_buffered(device)?;
            if self.session.client_ended() {
                return Poll::Ready(Ok(End::ClientEnded));
            }
            self.meter.held(self.session.input_held_by(), self.session.completions_held_by());
            if self.session.wants_input() {
                let inbuf = self.session.input(|d, ep| is_iso(device, d, ep))?;
                match poll_read_buf(Pin::new(&mut self.stream), cx, inbuf) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Ok(End::ClientClosed)),
                    Poll::Ready(Ok(_)) => {
                        progressed = true;
                        self.handle_buffered(device)?;
                        if self.session.client_ended() {
                            return Poll::Ready(Ok(End::ClientEnded));
                        }
                    }
                    Poll::Ready(Err(error)) if is_disconnect(&error) => return Poll::Ready(Ok(End::ClientClosed)),
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error.into())),
                    Poll::Pending => {}
                }
            }

            // Completions, in the order the device finishes them.
            while self.session.wants_completions() {
                match device.poll_complete(cx) {
                    Poll::Ready(done) => {
                        self.taps().completed(&done);
                        self.session.complete(done.into_ret_submit());
                        progressed = true;
                    }
                    Poll::Pending => break,
                }
            }

            if let Some(end) = self.reenumerated(device) {
                return Poll::Ready(Ok(end));
            }

            // Replies.
            if !self.session.outbox().is_empty() {
                match poll_write_outbox(self.session.outbox(), cx, &mut self.stream) {
                    Poll::Ready(Err(error)) if is_disconnect(&error) => return Poll::Ready(Ok(End::ClientClosed)),
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error.into())),
                    Poll::Ready(Ok(wrote)) => {
                        progressed |= wrote;
                        self.unflushed |= wrote;
                    }
                    Poll::Pending => {}
                }
            }
            if self.unflushed && self.session.outbox().is_empty() {
                match Pin::new(&mut self.stream).poll_flush(cx) {
                    Poll::Ready(Ok(())) => self.unflushed = false,
                    Poll::Ready(Err(error)) if is_disconnect(&error) => return Poll::Ready(Ok(End::ClientClosed)),
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error.into())),
                    Poll::Pending => {}
                }
            }

            if device.is_gone() && self.session.is_idle() && !self.unflushed {
                return Poll::Ready(Ok(End::DeviceGone));
            }
            if !progressed {
                return Poll::Pending;
            }
        }
    }

    /// [`End::Reenumerated`] once the device is not the one imported any more.
    fn reenumerated(&self, device: &dyn Device) -> Option<End> {
        (device.enumeration() != self.enumeration).then(|| End::Reenumerated { seen_at: Instant::now() })
    }

    /// Lets the session take buffered commands and carries out what they ask of the device.
    fn handle_buffered(&mut self, device: &mut dyn Device) -> Result<bool, ChannelError> {
        let handled = self.session.handle_input(|d, ep| is_iso(device, d, ep))?;
        while let Some(call) = self.session.poll_device_call() {
            match call {
                DeviceCall::Submit(submit) => {
                    let urb = Urb::from_submit(submit);
                    let transfer = device.endpoint_type(urb.direction, urb.endpoint).unwrap_or(if urb.endpoint == 0 {
                        TransferType::Control
                    } else {
                        TransferType::Bulk
                    });
                    self.taps().submitted(&urb, transfer);
                    device.submit(urb);
                }
                DeviceCall::Cancel { seqnum } => device.cancel(seqnum),
            }
        }
        Ok(handled)
    }
}

fn is_iso(device: &dyn Device, direction: usbwire_proto::Direction, ep: u8) -> bool {
    device.endpoint_type(direction, ep) == Some(TransferType::Isochronous)
}

fn is_disconnect(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionAborted
    )
}
