//! The relay: one task that drives a [`ClientSession`] between whoever
//! submits URBs (its [`Front`]) and the server, so the URB channel can be
//! encrypted, transformed and — when the server granted resume — outlive its
//! connection. Two fronts: vhci-hcd speaking plain USB/IP on one end of a
//! socket pair ([`run`]), and every userspace [`Connection`](crate::Connection)
//! (the library, the usbredir bridge, the bench), handing over commands with
//! their waiters (no bytes in between).
//!
//! While connected, the front's commands go into the session (which keeps
//! each, whole when resumable, until its reply), and the replies the session
//! decodes go back to the front. When the connection drops, the front is still served: its new URBs
//! wait in the session, and the relay reconnects (at once, then backing off)
//! and resumes; both sides then send what the other is missing, and the
//! front sees a delay. Without resume, or when the server no longer holds the
//! session, the relay ends with [`RelayError::SessionLost`] and the caller
//! detaches.

use std::future::Future as _;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio_util::io::poll_read_buf;
use tracing::{info, warn};
use usbwire_proto::client_session::{ClientSession, ClientSessionError, Event};
use usbwire_proto::resume::{Grant, Token};
use usbwire_proto::urb::{self, ClientMessage};
use usbwire_proto::{Budget, Limits, Outbox};
use usbwire_transport::{poll_write_outbox, PeerStream};

use crate::{resume_session, Backoff, ClientError, Security, TransformSpec};

/// Replies waiting for the kernel to read them before the relay stops reading the server.
const KERNEL_BACKLOG: usize = 8 * 1024 * 1024;

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

/// What [`Front::take_replies`] did.
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
    /// Moves the front's next commands into `session` while it
    /// [wants them](ClientSession::wants_commands).
    fn poll_commands(
        &mut self,
        cx: &mut Context<'_>,
        session: &mut ClientSession<Self::Tag>,
    ) -> Result<Step, RelayError>;
    /// Whether to read more replies from the server (the front keeps up).
    fn takes_replies(&self) -> bool;
    /// Has `session` decode what the server sent
    /// ([`ClientSession::handle_input_with`]) and takes each reply as it is
    /// decoded, those before an error too.
    fn take_replies(&mut self, session: &mut ClientSession<Self::Tag>) -> Replies;
    /// Writes replies taken but not yet out to the front.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Step;
    /// The relay is ending; called before the session (and with it every
    /// pending URB's tag) is dropped.
    fn ended(&mut self) {}
    /// Whether replies taken are still waiting to be written out to the front.
    fn unflushed(&self) -> bool {
        false
    }
}

/// Relays between the kernel's socket and the server until the port is
/// detached (`Ok`) or the session is lost. `stream` is the imported
/// device's URB channel.
pub async fn run<K>(
    kernel: K,
    stream: PeerStream,
    devid: u32,
    upstream: Upstream,
    state: Option<watch::Sender<RelayState>>,
) -> Result<(), RelayError>
where
    K: AsyncRead + AsyncWrite + Unpin,
{
    let front = KernelFront { kernel, kernel_in: BytesMut::with_capacity(64 * 1024), kernel_out: Outbox::default() };
    drive(front, stream, devid, upstream, state, Budget::default()).await
}

/// Drives `front`'s session with the server until the front lets go (`Ok`)
/// or the session is lost; the session keeps to `budget`.
pub(crate) async fn drive<F: Front>(
    mut front: F,
    stream: PeerStream,
    devid: u32,
    upstream: Upstream,
    state: Option<watch::Sender<RelayState>>,
    budget: Budget,
) -> Result<(), RelayError> {
    let mut session = ClientSession::new(devid, BytesMut::new(), Limits::default(), budget);
    if let Some(grant) = upstream.resume {
        session = session.resumable();
        if grant.keepalive {
            session = session.keepalive(Instant::now());
        }
        if let Some((urbs, bytes)) = grant.in_flight {
            session = session.server_takes(urbs, bytes);
        }
    }
    let result = drive_session(&mut front, &mut session, stream, upstream, state).await;
    front.ended();
    drop(session);
    result
}

async fn drive_session<F: Front>(
    front: &mut F,
    session: &mut ClientSession<F::Tag>,
    stream: PeerStream,
    upstream: Upstream,
    state: Option<watch::Sender<RelayState>>,
) -> Result<(), RelayError> {
    let mut server = stream;
    // Keep-alive's clock (sessions that negotiated it): reset to each deadline the session names.
    let mut timer = Box::pin(tokio::time::sleep(Duration::ZERO));
    loop {
        let mut link = Link { stream: &mut server, timer: &mut timer };
        let lost = match std::future::poll_fn(|cx| poll_drive(front, cx, Some(&mut link), session)).await? {
            Stop::Detached => {
                end_session(&mut server, session).await;
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
        session.disconnected();
        let since = Instant::now();
        warn!(addr = %upstream.addr, error = %lost, outstanding = session.outstanding(), "connection lost; resuming");
        if let Some(state) = &state {
            let _ = state.send(RelayState::Resuming { since });
        }
        let replies_received = session.replies_received();
        // The front is served (its commands wait in the session) while reconnecting.
        let resumed = tokio::select! {
            stop = std::future::poll_fn(|cx| poll_drive(front, cx, None, session)) => match stop? {
                Stop::Detached => {
                    end_while_away(&upstream, &token, replies_received, session.devid()).await;
                    return Ok(());
                }
                Stop::LinkLost(_) | Stop::ServerEnded | Stop::Reenumerated => unreachable_while_disconnected(),
            },
            resumed = reconnect(&upstream, &token, replies_received) => resumed,
        };
        let (stream, commands_received) = resumed?;
        let resent = session.resumed(commands_received, BytesMut::new())?;
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
}

/// One turn of the relay: front -> session -> server and server -> session
/// -> front, until nothing moves. `link` is `None` while reconnecting.
fn poll_drive<F: Front>(
    front: &mut F,
    cx: &mut Context<'_>,
    mut link: Option<&mut Link<'_>>,
    session: &mut ClientSession<F::Tag>,
) -> Poll<Result<Stop, RelayError>> {
    loop {
        // Keep-alive: a ping when quiet, and a link gone silent is lost.
        if let Some(link) = link.as_deref_mut() {
            if let Some(silent) = poll_keepalive(cx, link, session, front.takes_replies())? {
                let reason = format!("nothing heard from the server for {:.1} s", silent.as_secs_f64());
                return Poll::Ready(Ok(Stop::LinkLost(io::Error::new(io::ErrorKind::TimedOut, reason))));
            }
        }
        let server = link.as_deref_mut().map(|link| &mut *link.stream);
        let mut progressed = false;
        let mut woke = false;

        // Front -> session.
        if session.wants_commands() {
            match front.poll_commands(cx, session)? {
                Step::Progressed => progressed = true,
                Step::Idle => {}
                Step::Detached => return Poll::Ready(Ok(Stop::Detached)),
            }
        }

        if let Some(stream) = server {
            // Server -> session -> front.
            if front.takes_replies() {
                match poll_read_buf(Pin::new(&mut *stream), cx, session.input()) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Ok(Stop::LinkLost(io::ErrorKind::UnexpectedEof.into()))),
                    Poll::Ready(Ok(_)) => {
                        progressed = true;
                        // Replies before an error (or the server's end) still reach the front.
                        let replies = front.take_replies(session);
                        woke = replies.woke;
                        match replies.handled {
                            Ok(()) => {}
                            Err(ClientSessionError::ServerEnded) => return Poll::Ready(Ok(Stop::ServerEnded)),
                            Err(ClientSessionError::Reenumerated) => return Poll::Ready(Ok(Stop::Reenumerated)),
                            Err(error) => return Poll::Ready(Err(error.into())),
                        }
                    }
                    Poll::Ready(Err(error)) => return Poll::Ready(Ok(Stop::LinkLost(error))),
                    Poll::Pending => {}
                }
            }
            // Session -> server.
            match poll_write_all(session.outbox(), cx, &mut *stream) {
                Poll::Ready(Ok(wrote)) => progressed |= wrote,
                Poll::Ready(Err(error)) => return Poll::Ready(Ok(Stop::LinkLost(error))),
                Poll::Pending => {}
            }
        }

        // Replies -> front.
        match front.poll_flush(cx) {
            Step::Progressed => progressed = true,
            Step::Idle => {}
            Step::Detached => return Poll::Ready(Ok(Stop::Detached)),
        }

        // Let the tasks the replies woke run (on a single-threaded runtime they
        // could not submit more URBs to keep the server busy while replies keep
        // coming), then carry on: the same as a yield, without its extra poll
        // of the I/O driver.
        if woke {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        // Idle: acknowledge what the server sent (busy, the acknowledgement
        // rides with the next command instead of costing a write of its own).
        if progressed {
            continue;
        }
        if link.is_none() || !session.acknowledge() {
            return Poll::Pending;
        }
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

/// The kernel let go: tell a resumable server it may release the device now
/// (after whatever commands are still queued), rather than hold it for a resume.
async fn end_session<T>(server: &mut PeerStream, session: &mut ClientSession<T>) {
    session.end();
    let flushed = tokio::time::timeout(END_TIMEOUT, async {
        std::future::poll_fn(|cx| loop {
            match poll_write_all(session.outbox(), cx, &mut *server) {
                Poll::Ready(Ok(_)) if session.outbox().is_empty() => return Poll::Ready(Ok(())),
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
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
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

/// vhci-hcd's end of the socket pair: commands as bytes in, replies as bytes out.
struct KernelFront<K> {
    kernel: K,
    /// Commands from the kernel not decoded yet.
    kernel_in: BytesMut,
    /// Replies for the kernel.
    kernel_out: Outbox,
}

impl<K: AsyncRead + AsyncWrite + Unpin> Front for KernelFront<K> {
    type Tag = ();

    fn poll_commands(&mut self, cx: &mut Context<'_>, session: &mut ClientSession<()>) -> Result<Step, RelayError> {
        // Whole commands left over from a read the session's budget cut short come first.
        let before = session.outstanding();
        self.take_commands(session)?;
        let took = session.outstanding() != before;
        if !session.wants_commands() {
            return Ok(if took { Step::Progressed } else { Step::Idle });
        }
        self.kernel_in.reserve(64 * 1024);
        match poll_read_buf(Pin::new(&mut self.kernel), cx, &mut self.kernel_in) {
            Poll::Ready(Ok(0)) => Ok(Step::Detached),
            Poll::Ready(Ok(_)) => {
                self.take_commands(session)?;
                Ok(Step::Progressed)
            }
            // The kernel resets its socket on detach.
            Poll::Ready(Err(_)) => Ok(Step::Detached),
            Poll::Pending if took => Ok(Step::Progressed),
            Poll::Pending => Ok(Step::Idle),
        }
    }

    fn takes_replies(&self) -> bool {
        self.kernel_out.queued() < KERNEL_BACKLOG
    }

    fn take_replies(&mut self, session: &mut ClientSession<()>) -> Replies {
        let kernel_out = &mut self.kernel_out;
        let handled = session.handle_input_with(|event| match event {
            Event::Completed { reply, .. } => kernel_out.push_ret_submit(&reply),
            Event::Unlinked { reply, .. } => kernel_out.push_ret_unlink(&reply),
        });
        // The kernel runs elsewhere: nothing to make room for.
        Replies { handled, woke: false }
    }

    fn unflushed(&self) -> bool {
        !self.kernel_out.is_empty()
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Step {
        match poll_write_all(&mut self.kernel_out, cx, &mut self.kernel) {
            Poll::Ready(Ok(true)) => Step::Progressed,
            Poll::Ready(Ok(false)) | Poll::Pending => Step::Idle,
            Poll::Ready(Err(_)) => Step::Detached,
        }
    }
}

impl<K> KernelFront<K> {
    /// Decodes the kernel's whole commands into the session.
    fn take_commands(&mut self, session: &mut ClientSession<()>) -> Result<(), RelayError> {
        let limits = Limits::default();
        while session.wants_commands() {
            // vhci sends isochronous descriptors exactly when the URB has packets
            // (number_of_packets is 0 otherwise); the kernel is trusted here.
            let iso = self.kernel_in.len() >= urb::HEADER_LEN
                && i32::from_be_bytes([
                    self.kernel_in[0x20],
                    self.kernel_in[0x21],
                    self.kernel_in[0x22],
                    self.kernel_in[0x23],
                ]) > 0;
            let message = urb::decode_command(&mut self.kernel_in, &limits, |_, _| iso)
                .map_err(|error| RelayError::Kernel(error.to_string()))?;
            let Some(message) = message else { return Ok(()) };
            match message {
                ClientMessage::Submit(submit) => session.submit(submit, ())?,
                ClientMessage::Unlink(unlink) => session.unlink(unlink)?,
            }
        }
        Ok(())
    }
}

/// Writes `outbox` until it is empty or the writer would block, then flushes
/// (TLS and transforms buffer until flushed). `Ready(Ok(wrote))`: whether any
/// byte went out; `Pending` only when none could.
fn poll_write_all<W: AsyncWrite + Unpin>(
    outbox: &mut Outbox,
    cx: &mut Context<'_>,
    writer: &mut W,
) -> Poll<io::Result<bool>> {
    let wrote = match poll_write_outbox(outbox, cx, &mut *writer) {
        Poll::Ready(Ok(wrote)) => wrote,
        Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
        Poll::Pending => return Poll::Pending,
    };
    if !outbox.is_empty() {
        return Poll::Ready(Ok(wrote));
    }
    // Nothing left to write: push out what the stream buffers (a no-op for plain TCP).
    match Pin::new(&mut *writer).poll_flush(cx) {
        Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
        Poll::Ready(Ok(())) => Poll::Ready(Ok(wrote)),
        Poll::Pending if wrote => Poll::Ready(Ok(true)),
        Poll::Pending => Poll::Pending,
    }
}
