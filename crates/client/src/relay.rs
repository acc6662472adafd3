//! The relay: one task that drives a [`ClientSession`] between whoever
//! submits URBs (its [`Front`]) and the server, so the URB channel can be
//! encrypted, transformed and — when the server granted resume — outlive its
//! connection. Two fronts: vhci-hcd speaking plain USB/IP on one end of a
//! socket pair (`kernel_relay`), and every userspace [`Connection`](crate::Connection)
//! (the library, the usbredir bridge, the bench), whose callers encode their
//! commands into the session themselves, under the lock they share with the
//! relay (`waiters`).
//!
//! It owns the loop, the connection to the server (`relay_wire`'s [`Link`]:
//! the stream, the read buffer, the bytes being written, the keep-alive
//! timer), reconnecting and resuming. Each turn it reads the server into its
//! own buffer, then holds the session once ([`Hold`]): the session decodes
//! what was read and hands each reply to the front ([`Front::deliver`]), the
//! front gives it its commands ([`Front::poll_commands`]), what the session
//! queued moves to the link's outbox, and the front hands the replies on
//! ([`Front::poll_flush`]). It reads and writes the server without holding
//! the session, so a caller never waits on the relay's I/O. It is not for
//! USB/IP itself (the session's) nor for what a front does with a reply.
//!
//! While connected, the session keeps each command (whole when resumable)
//! until its reply. When the connection drops, the front is still served:
//! its new URBs wait in the session, and the relay reconnects (at once, then
//! backing off) and resumes; both sides then send what the other is missing,
//! and the front sees a delay. Without resume, or when the server no longer
//! holds the session, the relay ends with [`RelayError::SessionLost`] and the
//! caller detaches.

use std::future::Future as _;
use std::io;
use std::net::SocketAddr;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::{info, warn};
use usbwire_proto::client_session::{ClientSession, ClientSessionError, Event};
use usbwire_proto::descriptors::Snapshot;
use usbwire_proto::resume::{Grant, Token};
use usbwire_proto::retry::Retry;
use usbwire_proto::{Budget, Limits};
use usbwire_transport::PeerStream;

use crate::relay_wire::{poll_write_all, Link};
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
    /// Accelerate the device's mass storage (`crate::storage`): the server
    /// agreed to the storage extension and the user did not turn it off.
    pub storage: bool,
    /// The device's descriptors, taken by the server at import (§5.8): the
    /// kernel's enumeration is answered from them (`crate::enumeration`).
    /// `None` when the server sent none or the user turned acceleration off.
    pub descriptors: Option<Snapshot>,
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

/// How the relay's loop stopped, short of an error.
enum Stop {
    /// The front let go (the kernel closed its socket: the port was detached).
    Detached,
    LinkLost(io::Error),
}

/// What one call of a [`Front`] did.
pub(crate) enum Step {
    /// Moved something: the relay goes on at once.
    Progressed,
    /// Handed replies to tasks of this runtime: when the relay goes on at
    /// once, they run first.
    Woke,
    /// Nothing to do; the front wakes the task when there is.
    Idle,
    /// The front let go: end the session.
    Detached,
}

/// The side of the relay that submits URBs and takes their replies. Each
/// turn the relay calls all three with the session held ([`Hold`]).
pub(crate) trait Front {
    /// What the session carries with each URB for its reply.
    type Tag;
    /// Gives the session the front's new commands while it
    /// [wants them](ClientSession::wants_commands): the kernel's, read from its
    /// socket (a userspace front's callers give theirs to the session
    /// themselves). Says whether the front let go; otherwise `cx` is woken when
    /// there are more.
    fn poll_commands(
        &mut self,
        cx: &mut Context<'_>,
        session: &mut ClientSession<Self::Tag>,
    ) -> Result<Step, RelayError>;
    /// A reply, as the session decodes it.
    fn deliver(&mut self, event: Event<Self::Tag>);
    /// Hands the replies delivered on: writes them out to the kernel, or
    /// wakes the tasks waiting for them.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Step;
    /// Whether to read more replies from the server (the front keeps up).
    fn takes_replies(&self) -> bool {
        true
    }
}

/// Where a relay finds its session and its front: its own (the kernel's), or
/// under the lock a userspace connection's callers submit under.
pub(crate) trait Hold {
    type Front: Front;
    /// Runs `turn` with the session and the front held; the relay does no I/O
    /// with the server meanwhile.
    fn hold<R>(
        &mut self,
        turn: impl FnOnce(&mut ClientSession<<Self::Front as Front>::Tag>, &mut Self::Front) -> R,
    ) -> R;
}

/// A session the relay owns, beside its front (the kernel's relay).
impl<F: Front> Hold for (ClientSession<F::Tag>, F) {
    type Front = F;

    fn hold<R>(&mut self, turn: impl FnOnce(&mut ClientSession<F::Tag>, &mut F) -> R) -> R {
        turn(&mut self.0, &mut self.1)
    }
}

/// A new session for the device `devid` of `upstream`, resumable (with
/// keep-alive, and the server's table's size) as the server granted,
/// keeping to `budget`.
pub(crate) fn new_session<T>(devid: u32, upstream: &Upstream, budget: Budget) -> ClientSession<T> {
    let mut session = ClientSession::new(devid, Limits::default(), budget);
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

/// Drives the session `held` holds with the server until its front lets go
/// (`Ok`) or the session is lost.
pub(crate) async fn drive<H: Hold>(
    held: &mut H,
    stream: PeerStream,
    upstream: Upstream,
    state: Option<watch::Sender<RelayState>>,
) -> Result<(), RelayError> {
    let mut link = Link::new(stream, upstream.resume.is_some());
    loop {
        let lost = match std::future::poll_fn(|cx| poll_drive(held, cx, Some(&mut link))).await {
            Ok(Stop::Detached) => {
                end_session(&mut link, held).await;
                return Ok(());
            }
            Ok(Stop::LinkLost(error)) => error,
            Err(RelayError::Server(ClientSessionError::ServerEnded)) => {
                return Err(RelayError::SessionLost {
                    addr: upstream.addr,
                    reason: "the server ended the session (it is shutting down)".into(),
                })
            }
            Err(RelayError::Server(ClientSessionError::Reenumerated)) => {
                return Err(RelayError::Reenumerated { addr: upstream.addr })
            }
            Err(error) => return Err(error),
        };
        let Some(Grant { token, .. }) = upstream.resume else {
            return Err(RelayError::SessionLost { addr: upstream.addr, reason: format!("{lost} (no resume)") });
        };
        // What was read and not decoded, or taken and not written, goes with the connection.
        let (outstanding, replies_received, devid) = held.hold(|session, _| {
            session.disconnected();
            (session.outstanding(), session.replies_received(), session.devid())
        });
        let since = Instant::now();
        warn!(addr = %upstream.addr, error = %lost, outstanding, "connection lost; resuming");
        if let Some(state) = &state {
            let _ = state.send(RelayState::Resuming { since });
        }
        // The front is served (its commands wait in the session) while reconnecting.
        let resumed = tokio::select! {
            stop = std::future::poll_fn(|cx| poll_drive(held, cx, None)) => match stop? {
                Stop::Detached => {
                    end_while_away(&upstream, &token, replies_received, devid).await;
                    return Ok(());
                }
                Stop::LinkLost(_) => unreachable_while_disconnected(),
            },
            resumed = reconnect(&upstream, &token, replies_received) => resumed,
        };
        let (stream, commands_received) = resumed?;
        let resent = held.hold(|session, _| session.resumed(commands_received))?;
        info!(
            addr = %upstream.addr,
            outage_ms = since.elapsed().as_millis() as u64,
            commands_resent = resent,
            "resumed"
        );
        if let Some(state) = &state {
            let _ = state.send(RelayState::Connected);
        }
        link = Link::new(stream, upstream.resume.is_some());
    }
}

/// One turn of the relay, until nothing is left to do at once: the server
/// read into the relay's own buffer; then, holding the session once, what was
/// read decoded and each reply delivered to the front, the front's commands
/// taken, what the session queued taken to write, and the replies flushed to
/// the front; then, not holding it, the server read again (a decode makes room
/// for the next reply) and written. Reads and writes go on until they would
/// block (so they wake the task when they can go on); another turn follows at
/// once only for bytes read, or what the front moved. `link` is `None` while
/// reconnecting.
fn poll_drive<H: Hold>(
    held: &mut H,
    cx: &mut Context<'_>,
    mut link: Option<&mut Link>,
) -> Poll<Result<Stop, RelayError>> {
    loop {
        // Server -> the relay's read buffer.
        if let Some(link) = link.as_deref_mut() {
            if let Err(lost) = link.poll_read(cx) {
                return Poll::Ready(Ok(Stop::LinkLost(lost)));
            }
        }
        let decoding = link.as_ref().is_some_and(|link| link.fresh);
        let step = match held.hold(|session, front| turn(session, front, cx, link.as_deref_mut())) {
            Ok(Ok(step)) => step,
            Ok(Err(stop)) => return Poll::Ready(Ok(stop)),
            Err(error) => return Poll::Ready(Err(error)),
        };
        let mut again = matches!(step, Step::Progressed);
        if let Some(link) = link.as_deref_mut() {
            // Server -> the room the decode made: until the socket would block.
            if decoding {
                if let Err(lost) = link.poll_read(cx) {
                    return Poll::Ready(Ok(Stop::LinkLost(lost)));
                }
                again |= link.fresh;
            }
            // Wire -> server.
            if let Err(lost) = link.poll_write(cx) {
                return Poll::Ready(Ok(Stop::LinkLost(lost)));
            }
            // Written out now: take what the session queued meanwhile (its
            // callers' wake-up was this turn).
            again |= std::mem::take(&mut link.left_queued) && link.out.is_empty();
        }
        if again {
            // Let the tasks the replies woke run first (on a single-threaded
            // runtime they could not submit more URBs to keep the server busy
            // while replies keep coming), then carry on: the same as a yield,
            // without its extra poll of the I/O driver. With nothing more to
            // do at once, returning lets them run anyway: what they submit
            // wakes the relay, as the server's bytes do.
            if matches!(step, Step::Woke) {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            continue;
        }
        // Idle: acknowledge what the server sent (busy, the acknowledgement
        // rides with the next command instead of costing a write of its own).
        if !link.as_ref().is_some_and(|link| link.acknowledges) || !held.hold(|session, _| session.acknowledge()) {
            return Poll::Pending;
        }
    }
}

/// The part of a turn that holds the session (once): keep-alive, what was
/// read decoded and delivered, the front's commands taken, what the session
/// queued taken to the wire, and the front flushed.
fn turn<F: Front>(
    session: &mut ClientSession<F::Tag>,
    front: &mut F,
    cx: &mut Context<'_>,
    mut link: Option<&mut Link>,
) -> Result<Result<Step, Stop>, RelayError> {
    if let Some(link) = link.as_deref_mut() {
        // Keep-alive: a ping when quiet, and a link gone silent is lost.
        if let Some(silent) = poll_keepalive(cx, link, session)? {
            let reason = format!("nothing heard from the server for {:.1} s", silent.as_secs_f64());
            return Ok(Err(Stop::LinkLost(io::Error::new(io::ErrorKind::TimedOut, reason))));
        }
        // Session -> front: what was read, decoded (the replies before an
        // error, or the server's end, reach the front too).
        if std::mem::take(&mut link.fresh) {
            let decoded = session.handle_input(&mut link.input, |event| front.deliver(event));
            if let Err(error) = decoded {
                flush_after(front, cx);
                return Err(error.into());
            }
        }
        link.take(session);
    }
    // Front -> session: the kernel's commands (or room for the callers').
    let commands = front.poll_commands(cx, session)?;
    if let (Some(link), Step::Progressed) = (link.as_deref_mut(), &commands) {
        link.take(session);
    }
    let flushed = front.poll_flush(cx);
    if let Some(link) = link {
        link.listening = front.takes_replies();
    }
    // Only a userspace front wakes tasks, and the commands it moves (what a
    // dropped queue left) were taken above: woken, its tasks run first.
    Ok(match (commands, flushed) {
        (Step::Detached, _) | (_, Step::Detached) => Err(Stop::Detached),
        (_, Step::Woke) => Ok(Step::Woke),
        (Step::Progressed, _) | (_, Step::Progressed) => Ok(Step::Progressed),
        _ => Ok(Step::Idle),
    })
}

/// Hands the front what was delivered before the session's error, as far as
/// it goes at once (the kernel's relay writes the rest out as it ends).
fn flush_after<F: Front>(front: &mut F, cx: &mut Context<'_>) {
    while matches!(front.poll_flush(cx), Step::Progressed) {}
}

/// Runs the session's keep-alive timer: queues a ping when one is due, and
/// returns how long the server has been silent once that is too long. Leaves
/// the timer armed for the session's next deadline.
fn poll_keepalive<T>(
    cx: &mut Context<'_>,
    link: &mut Link,
    session: &mut ClientSession<T>,
) -> Result<Option<Duration>, RelayError> {
    while let Some(deadline) = session.poll_timeout() {
        let deadline = tokio::time::Instant::from_std(deadline);
        if link.timer.deadline() != deadline {
            link.timer.as_mut().reset(deadline);
        }
        if link.timer.as_mut().poll(cx).is_pending() {
            break;
        }
        match session.handle_timeout(Instant::now(), link.listening) {
            Ok(()) => {}
            Err(ClientSessionError::Silent(silent)) => return Ok(Some(silent)),
            Err(error) => return Err(error.into()),
        }
    }
    Ok(None)
}

/// The front let go: tell a resumable server it may release the device now
/// (after whatever commands are still queued), rather than hold it for a resume.
async fn end_session<H: Hold>(link: &mut Link, held: &mut H) {
    held.hold(|session, _| {
        session.end();
        session.outbox().hand_over(&mut link.out);
    });
    let Link { out, stream: server, .. } = link;
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
        tokio::io::AsyncWriteExt::shutdown(server).await?;
        // Replies still come (reads ahead, say) until the server reads the end and closes.
        // Read them, unwanted, to its close: a socket closed with bytes unread resets the
        // connection, and a reset can reach the server before it has read the end, which
        // then holds the device for a resume that never comes.
        let mut unwanted = vec![0; 64 * 1024];
        while tokio::io::AsyncReadExt::read(server, &mut unwanted).await? > 0 {}
        Ok::<_, io::Error>(())
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

/// How long a detaching relay tries to deliver its last commands and the end
/// (and the kernel's relay the replies before a re-enumeration).
pub(crate) const END_TIMEOUT: Duration = Duration::from_secs(2);

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
