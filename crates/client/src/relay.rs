//! The relay: one task that drives a [`ClientSession`] between whoever
//! submits URBs (its [`Front`]) and the server, so the URB channel can be
//! encrypted, transformed and — when the server granted resume — outlive its
//! connection. Two fronts: vhci-hcd speaking plain USB/IP on one end of a
//! socket pair (`kernel_relay`), and every userspace [`Connection`](crate::Connection)
//! (the library, the usbredir bridge, the bench), whose callers encode their
//! commands into the session themselves, under the lock they share with the
//! relay (`waiters`).
//!
//! Each turn the relay holds the session once (`Front::hold`): the bytes it
//! read are decoded and each reply handed to the front, and the bytes the
//! session queued (the kernel's commands it took, or the callers') move to the
//! relay's own outbox. It reads and writes the server without holding it, so
//! a caller never waits on the relay's I/O. While connected, the session keeps
//! each command (whole when resumable) until its reply. When the connection
//! drops, the front is still served: its new URBs
//! wait in the session, and the relay reconnects (at once, then backing off)
//! and resumes; both sides then send what the other is missing, and the
//! front sees a delay. Without resume, or when the server no longer holds the
//! session, the relay ends with [`RelayError::SessionLost`] and the caller
//! detaches.

use std::future::Future as _;
use std::io;
use std::net::SocketAddr;
use std::ops::{ControlFlow, DerefMut};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::sync::watch;
use tracing::{info, warn};
use usbwire_proto::client_session::{ClientSession, ClientSessionError};
use usbwire_proto::resume::{Grant, Token};
use usbwire_proto::{Budget, Limits, Outbox};
use usbwire_transport::PeerStream;

use crate::relay_wire::{poll_read_wire, poll_write_all, poll_write_wire, Wire};
use usbwire_proto::retry::Retry;

use crate::{resume_session, ClientError, Security, TransformSpec};

/// Where the session lives and how to take it over again.
#[derive(Clone)]
pub struct Upstream {
    pub addr: SocketAddr,
    pub security: Security,
    pub transforms: Vec<TransformSpec>,
    /// The session token (and whether the server pings), when it granted resume.
    pub resume: Option<Grant>,
    /// How long to keep trying to resume before giving up.
    pub give_up_after: Duration,
}

/// What the relay is doing, for `usbwire port`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayState {
    Connected,
    /// The connection dropped at `since`; reconnecting.
    Resuming {
        since: Instant,
    },
}

/// Why a relay stopped, other than the kernel letting go (detach).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The connection dropped and the session could not be resumed (no
    /// resume on this server, the grace period ran out, or it stayed
    /// unreachable): attach the device again.
    #[error("connection to {addr} lost and the session could not be resumed: {reason}")]
    SessionLost { addr: SocketAddr, reason: String },
    /// The server sent something that is not valid USB/IP.
    #[error("server broke the protocol: {0}")]
    Server(#[from] ClientSessionError),
    /// The kernel's side of the socket pair failed or sent garbage.
    #[error("kernel side: {0}")]
    Kernel(String),
    /// The server ended the session because the device re-enumerated at the
    /// same bus id (`docs/protocol.md` §5.3, END): the replies before it
    /// reached the front; import the bus id again to follow the device.
    #[error("the device on {addr} re-enumerated at the same bus id")]
    Reenumerated { addr: SocketAddr },
}

/// How one stretch of the driver loop ended.
enum Stop {
    /// The front let go (the kernel closed its socket: the port was detached).
    Detached,
    LinkLost(io::Error),
    /// The server ended the session (it is shutting down).
    ServerEnded,
    /// The server ended the session: the device re-enumerated.
    Reenumerated,
}

/// What one poll of a [`Front`] did.
pub(crate) enum Step {
    Progressed,
    /// Nothing to do; the front wakes the task when there is.
    Idle,
    /// The front let go: end the session.
    Detached,
}

/// What [`Held::take_replies`] did.
pub(crate) struct Replies {
    /// The session's verdict on the server's bytes.
    pub(crate) handled: Result<(), ClientSessionError>,
    /// Whether handing the replies over woke a task of this runtime, which
    /// then gets to run before the relay reads on.
    pub(crate) woke: bool,
}

/// The side of the relay that submits URBs and takes their replies.
pub(crate) trait Front {
    /// What the session carries with each URB for its reply.
    type Tag;
    /// The session, held for one step of the relay.
    type Held<'a>: Held<Self::Tag>
    where
        Self: 'a;
    /// Holds the session (a userspace front's is behind the lock its callers
    /// submit under; the relay does no I/O while it holds it).
    fn hold(&mut self) -> Self::Held<'_>;
    /// The front's own I/O for commands: the kernel's are read and given to
    /// the session while it [wants them](ClientSession::wants_commands). A
    /// userspace front's callers give theirs to the session themselves.
    fn poll_commands(&mut self, _cx: &mut Context<'_>) -> Result<Step, RelayError> {
        Ok(Step::Idle)
    }
    /// Whether to read more replies from the server (the front keeps up).
    fn takes_replies(&self) -> bool;
    /// Writes replies taken but not yet out to the front.
    fn poll_flush(&mut self, _cx: &mut Context<'_>) -> Step {
        Step::Idle
    }
    /// The relay is ending; called before the session (and with it every
    /// pending URB's tag) is dropped.
    fn ended(&mut self) {}
    /// Whether replies taken are still waiting to be written out to the front.
    fn unflushed(&self) -> bool {
        false
    }
}

/// A [`Front`]'s session, held, with the front's side of the replies.
pub(crate) trait Held<T>: DerefMut<Target = ClientSession<T>> {
    /// Has the session decode what the server sent
    /// ([`ClientSession::handle_input_with`]) and takes each reply as it is
    /// decoded, those before an error too.
    fn take_replies(&mut self) -> Replies;
    /// Moves what the session queued to the end of `wire`, the relay's own
    /// outbox ([`Outbox::hand_over`]); returns whether anything moved.
    fn take_outbox(&mut self, wire: &mut Outbox) -> bool {
        self.outbox().hand_over(wire)
    }
    /// Whether the front let go (end the session), or a command it gave the
    /// session was refused; otherwise `cx` is woken when the session has new
    /// commands to write.
    fn watch(&mut self, _cx: &mut Context<'_>) -> Result<Step, RelayError> {
        Ok(Step::Idle)
    }
}

/// A new session for the device `devid` of `upstream`, resumable (with
/// keep-alive, and the server's table's size) as the server granted,
/// keeping to `budget`.
pub(crate) fn new_session<T>(devid: u32, upstream: &Upstream, budget: Budget) -> ClientSession<T> {
    let mut session = ClientSession::new(devid, BytesMut::new(), Limits::default(), budget);
    if let Some(grant) = &upstream.resume {
        session = session.resumable();
        if grant.keepalive {
            session = session.keepalive(Instant::now());
        }
        if let Some((urbs, bytes)) = grant.in_flight {
            session = session.server_takes(urbs, bytes);
        }
    }
    session
}

/// Drives `front`'s session with the server until the front lets go (`Ok`)
/// or the session is lost.
pub(crate) async fn drive<F: Front>(
    mut front: F,
    stream: PeerStream,
    upstream: Upstream,
    state: Option<watch::Sender<RelayState>>,
) -> Result<(), RelayError> {
    let result = drive_session(&mut front, stream, upstream, state).await;
    front.ended();
    result
}

async fn drive_session<F: Front>(
    front: &mut F,
    stream: PeerStream,
    upstream: Upstream,
    state: Option<watch::Sender<RelayState>>,
) -> Result<(), RelayError> {
    let mut server = stream;
    // Keep-alive's clock (sessions that negotiated it): reset to each deadline the session names.
    let mut timer = Box::pin(tokio::time::sleep(Duration::ZERO));
    let mut wire = Wire::default();
    loop {
        let mut link = Link { stream: &mut server, timer: &mut timer, acknowledges: upstream.resume.is_some() };
        let lost = match std::future::poll_fn(|cx| poll_drive(front, cx, Some(&mut link), &mut wire)).await? {
            Stop::Detached => {
                end_session(&mut server, front, &mut wire).await;
                return Ok(());
            }
            Stop::LinkLost(error) => error,
            Stop::ServerEnded => {
                return Err(RelayError::SessionLost {
                    addr: upstream.addr,
                    reason: "the server ended the session (it is shutting down)".into(),
                })
            }
            Stop::Reenumerated => {
                // The replies before the end (a DFU_DETACH's) reach the front first.
                flush_front(front).await;
                return Err(RelayError::Reenumerated { addr: upstream.addr });
            }
        };
        let Some(Grant { token, .. }) = upstream.resume else {
            return Err(RelayError::SessionLost { addr: upstream.addr, reason: format!("{lost} (no resume)") });
        };
        // What was read and not decoded, or taken and not written, goes with the connection.
        wire = Wire::default();
        let (outstanding, replies_received, devid) = {
            let mut session = front.hold();
            session.disconnected();
            (session.outstanding(), session.replies_received(), session.devid())
        };
        let since = Instant::now();
        warn!(addr = %upstream.addr, error = %lost, outstanding, "connection lost; resuming");
        if let Some(state) = &state {
            let _ = state.send(RelayState::Resuming { since });
        }
        // The front is served (its commands wait in the session) while reconnecting.
        let resumed = tokio::select! {
            stop = std::future::poll_fn(|cx| poll_drive(front, cx, None, &mut wire)) => match stop? {
                Stop::Detached => {
                    end_while_away(&upstream, &token, replies_received, devid).await;
                    return Ok(());
                }
                Stop::LinkLost(_) | Stop::ServerEnded | Stop::Reenumerated => unreachable_while_disconnected(),
            },
            resumed = reconnect(&upstream, &token, replies_received) => resumed,
        };
        let (stream, commands_received) = resumed?;
        let resent = front.hold().resumed(commands_received, BytesMut::new())?;
        info!(
            addr = %upstream.addr,
            outage_ms = since.elapsed().as_millis() as u64,
            commands_resent = resent,
            "resumed"
        );
        if let Some(state) = &state {
            let _ = state.send(RelayState::Connected);
        }
        server = stream;
    }
}

/// The connection to the server while there is one, with the keep-alive timer.
struct Link<'a> {
    stream: &'a mut PeerStream,
    timer: &'a mut Pin<Box<tokio::time::Sleep>>,
    /// The session acknowledges what it received (it is resumable).
    acknowledges: bool,
}

/// One turn of the relay, until nothing is left to do at once: the front's
/// commands into the session; the server read into the buffer the session
/// lent; then, holding the session once, what was read decoded and handed to
/// the front, and what the session queued taken to write; then, not holding
/// it, the server written, and the front's replies written out. Reads and
/// writes go on until they would block (so they wake the task when they can
/// go on); another turn follows at once only for bytes read, or what the
/// front moved. `link` is `None` while reconnecting.
fn poll_drive<F: Front>(
    front: &mut F,
    cx: &mut Context<'_>,
    mut link: Option<&mut Link<'_>>,
    wire: &mut Wire,
) -> Poll<Result<Stop, RelayError>> {
    loop {
        let mut again = false;

        // Front -> session (the kernel's commands).
        match front.poll_commands(cx)? {
            Step::Progressed => again = true,
            Step::Idle => {}
            Step::Detached => return Poll::Ready(Ok(Stop::Detached)),
        }

        // Server -> the buffer the session lent (the last turn).
        let mut read_again = wire.input.is_none();
        if let (Some(link), false) = (link.as_deref_mut(), read_again) {
            if let Some(lost) = poll_read_wire(wire, cx, link.stream) {
                return Poll::Ready(Ok(Stop::LinkLost(lost)));
            }
        }

        let listening = front.takes_replies();
        let held = match hold_once(front, cx, link.as_deref_mut(), wire, listening)? {
            ControlFlow::Continue(held) => held,
            ControlFlow::Break(stop) => return Poll::Ready(Ok(stop)),
        };
        read_again |= held.read_again;
        let woke = held.woke;
        let left_queued = held.left_queued;

        if let Some(link) = link.as_deref_mut() {
            // Server -> the buffer just lent, when it was not lent before or the
            // last read brought bytes: until the socket would block.
            if read_again && wire.input.is_some() {
                if let Some(lost) = poll_read_wire(wire, cx, &mut *link.stream) {
                    return Poll::Ready(Ok(Stop::LinkLost(lost)));
                }
                again |= wire.fresh;
            }
            // Wire -> server.
            if let Err(error) = poll_write_wire(wire, cx, link.stream) {
                return Poll::Ready(Ok(Stop::LinkLost(error)));
            }
            // Written out now: take what the session queued meanwhile (its
            // callers' wake-up was this turn).
            again |= left_queued && wire.out.is_empty();
        }

        // Replies -> front.
        match front.poll_flush(cx) {
            Step::Progressed => again = true,
            Step::Idle => {}
            Step::Detached => return Poll::Ready(Ok(Stop::Detached)),
        }

        if again {
            // Let the tasks the replies woke run first (on a single-threaded
            // runtime they could not submit more URBs to keep the server busy
            // while replies keep coming), then carry on: the same as a yield,
            // without its extra poll of the I/O driver. With nothing more to
            // do at once, returning lets them run anyway: what they submit
            // wakes the relay, as the server's bytes do.
            if woke {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            continue;
        }
        // Idle: acknowledge what the server sent (busy, the acknowledgement
        // rides with the next command instead of costing a write of its own).
        if !link.as_ref().is_some_and(|link| link.acknowledges) || !front.hold().acknowledge() {
            return Poll::Pending;
        }
    }
}

/// What holding the session once in [`poll_drive`] did.
struct HeldTurn {
    /// Bytes read were decoded: there may be more to read.
    read_again: bool,
    /// Handing the replies over woke a task of this runtime.
    woke: bool,
    /// The wire still held bytes, so what the session queued since was left there.
    left_queued: bool,
}

/// The part of a turn that holds the session (once): keep-alive, what was
/// read decoded and handed to the front, what the session queued taken to
/// the wire, the read buffer lent again, and the front watched.
fn hold_once<F: Front>(
    front: &mut F,
    cx: &mut Context<'_>,
    mut link: Option<&mut Link<'_>>,
    wire: &mut Wire,
    listening: bool,
) -> Result<ControlFlow<Stop, HeldTurn>, RelayError> {
    let mut turn = HeldTurn { read_again: false, woke: false, left_queued: false };
    let mut session = front.hold();
    // Keep-alive: a ping when quiet, and a link gone silent is lost.
    if let Some(link) = link.as_deref_mut() {
        if let Some(silent) = poll_keepalive(cx, link, &mut *session, listening)? {
            let reason = format!("nothing heard from the server for {:.1} s", silent.as_secs_f64());
            return Ok(ControlFlow::Break(Stop::LinkLost(io::Error::new(io::ErrorKind::TimedOut, reason))));
        }
    }
    // Session -> front: what was read, decoded.
    if let Some(input) = wire.input.take() {
        session.return_input(input);
    }
    if std::mem::take(&mut wire.fresh) {
        // There may be more.
        turn.read_again = true;
        // Replies before an error (or the server's end) still reach the front.
        let replies = session.take_replies();
        turn.woke = replies.woke;
        match replies.handled {
            Ok(()) => {}
            Err(ClientSessionError::ServerEnded) => return Ok(ControlFlow::Break(Stop::ServerEnded)),
            Err(ClientSessionError::Reenumerated) => return Ok(ControlFlow::Break(Stop::Reenumerated)),
            Err(error) => return Err(error.into()),
        }
    }
    if link.is_some() {
        // Session -> wire: what it queued since, once the last of it is written.
        if !wire.out.is_empty() {
            turn.left_queued = true;
        } else if session.take_outbox(&mut wire.out) {
            wire.flushed = false;
        }
        if listening {
            wire.input = Some(session.lend_input());
        }
    }
    match session.watch(cx)? {
        Step::Detached => Ok(ControlFlow::Break(Stop::Detached)),
        Step::Progressed | Step::Idle => Ok(ControlFlow::Continue(turn)),
    }
}

/// Runs the session's keep-alive timer: queues a ping when one is due, and
/// returns how long the server has been silent once that is too long. Leaves
/// the timer armed for the session's next deadline.
fn poll_keepalive<T>(
    cx: &mut Context<'_>,
    link: &mut Link<'_>,
    session: &mut ClientSession<T>,
    listening: bool,
) -> Result<Option<Duration>, RelayError> {
    while let Some(deadline) = session.poll_timeout() {
        let deadline = tokio::time::Instant::from_std(deadline);
        if link.timer.deadline() != deadline {
            link.timer.as_mut().reset(deadline);
        }
        if link.timer.as_mut().poll(cx).is_pending() {
            break;
        }
        match session.handle_timeout(Instant::now(), listening) {
            Ok(()) => {}
            Err(ClientSessionError::Silent(silent)) => return Ok(Some(silent)),
            Err(error) => return Err(error.into()),
        }
    }
    Ok(None)
}

/// The front let go: tell a resumable server it may release the device now
/// (after whatever commands are still queued), rather than hold it for a resume.
async fn end_session<F: Front>(server: &mut PeerStream, front: &mut F, wire: &mut Wire) {
    {
        let mut session = front.hold();
        session.end();
        session.outbox().hand_over(&mut wire.out);
    }
    let out = &mut wire.out;
    let flushed = tokio::time::timeout(END_TIMEOUT, async {
        std::future::poll_fn(|cx| loop {
            match poll_write_all(out, cx, &mut *server) {
                Poll::Ready(Ok(_)) if out.is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            }
        })
        .await?;
        tokio::io::AsyncWriteExt::shutdown(server).await
    })
    .await;
    if !matches!(flushed, Ok(Ok(()))) {
        tracing::debug!("could not say goodbye to the server; it holds the session until its grace period ends");
    }
}

/// The kernel let go while the connection was down: take the session back
/// once more, briefly, only to end it (the kernel has given its URBs up, so
/// nothing is sent again), so the server does not hold the device for nothing.
async fn end_while_away(upstream: &Upstream, token: &Token, replies_received: u64, devid: u32) {
    let ended = tokio::time::timeout(END_TIMEOUT, async {
        let (mut stream, _) =
            resume_session(upstream.addr, &upstream.security, &upstream.transforms, token, replies_received).await?;
        tokio::io::AsyncWriteExt::write_all(&mut stream, &usbwire_proto::resume::end_header(devid)).await?;
        tokio::io::AsyncWriteExt::shutdown(&mut stream).await?;
        Ok::<(), ClientError>(())
    })
    .await;
    if !matches!(ended, Ok(Ok(()))) {
        tracing::debug!("detached while the server was unreachable; it holds the session until its grace period ends");
    }
}

/// Writes what the front still holds for it, for at most [`END_TIMEOUT`].
async fn flush_front<F: Front>(front: &mut F) {
    let flushed = tokio::time::timeout(
        END_TIMEOUT,
        std::future::poll_fn(|cx| loop {
            if !front.unflushed() {
                return Poll::Ready(());
            }
            match front.poll_flush(cx) {
                Step::Progressed => {}
                Step::Detached => return Poll::Ready(()),
                Step::Idle => return Poll::Pending,
            }
        }),
    )
    .await;
    if flushed.is_err() {
        tracing::debug!("the last replies did not reach the front in time");
    }
}

/// How long a detaching relay tries to deliver its last commands and the end.
const END_TIMEOUT: Duration = Duration::from_secs(2);

/// Without a server the driver only ends when the kernel closes.
fn unreachable_while_disconnected() -> ! {
    unreachable!("the relay's driver reports a lost link only while connected")
}

/// Tries to resume until it works, the server refuses, or time runs out.
async fn reconnect(upstream: &Upstream, token: &Token, replies_received: u64) -> Result<(PeerStream, u64), RelayError> {
    let started = Instant::now();
    let mut backoff = Retry::SOON.backoff();
    loop {
        tokio::time::sleep(backoff.next_delay()).await;
        match resume_session(upstream.addr, &upstream.security, &upstream.transforms, token, replies_received).await {
            Ok(resumed) => return Ok(resumed),
            Err(
                error @ (ClientError::ResumeRefused { .. }
                | ClientError::ServerKeyChanged { .. }
                | ClientError::NotTheRegisteredKey { .. }),
            ) => {
                return Err(RelayError::SessionLost { addr: upstream.addr, reason: error.to_string() });
            }
            Err(error) if started.elapsed() >= upstream.give_up_after => {
                return Err(RelayError::SessionLost {
                    addr: upstream.addr,
                    reason: format!("still unreachable after {:?}: {error}", upstream.give_up_after),
                });
            }
            Err(error) => tracing::debug!(%error, "resume attempt failed; retrying"),
        }
    }
}
