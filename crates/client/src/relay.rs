//! The kernel relay: vhci-hcd speaks plain USB/IP on one end of a socket
//! pair, and this relays it to the server through a [`ClientSession`], so
//! the URB channel can be encrypted, transformed and — when the server
//! granted resume — outlive its connection.
//!
//! While connected, commands the kernel writes are decoded and handed to the
//! session (which keeps each until its reply), replies the server sends are
//! decoded by the session and written to the kernel. When the connection
//! drops, the kernel's socket stays open: its new URBs wait in the session,
//! and the relay reconnects (at once, then backing off) and resumes; both
//! sides then send what the other is missing, and the kernel sees a delay.
//! Without resume, or when the server no longer holds the session, the
//! relay ends with [`RelayError::SessionLost`] and the caller detaches.

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
use usbwire_proto::resume::Token;
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
    /// The session token, when the server granted resume.
    pub resume: Option<Token>,
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
}

/// How one stretch of the driver loop ended.
enum Stop {
    /// The kernel closed its socket: the port was detached.
    Detached,
    LinkLost(io::Error),
}

/// Relays between the kernel's socket and the server until the port is
/// detached (`Ok`) or the session is lost. `stream` is the imported
/// device's URB channel; `leftover` what was read past the import reply.
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
    let mut session = ClientSession::new(devid, BytesMut::new(), Limits::default(), Budget::default());
    if upstream.resume.is_some() {
        session = session.resumable();
    }
    let mut relay = Relay { kernel, kernel_in: BytesMut::with_capacity(64 * 1024), kernel_out: Outbox::default() };
    let mut server = stream;
    let limits = Limits::default();
    loop {
        let lost =
            match std::future::poll_fn(|cx| relay.poll_drive(cx, Some(&mut server), &mut session, &limits)).await? {
                Stop::Detached => {
                    end_session(&mut server, &mut session).await;
                    return Ok(());
                }
                Stop::LinkLost(error) => error,
            };
        let Some(token) = upstream.resume else {
            return Err(RelayError::SessionLost { addr: upstream.addr, reason: format!("{lost} (no resume)") });
        };
        session.disconnected();
        let since = Instant::now();
        warn!(addr = %upstream.addr, error = %lost, outstanding = session.outstanding(), "connection lost; resuming");
        if let Some(state) = &state {
            let _ = state.send(RelayState::Resuming { since });
        }
        let replies_received = session.replies_received();
        // The kernel is served (its commands wait in the session) while reconnecting.
        let resumed = tokio::select! {
            stop = std::future::poll_fn(|cx| relay.poll_drive(cx, None, &mut session, &limits)) => match stop? {
                Stop::Detached => {
                    end_while_away(&upstream, &token, replies_received, session.devid()).await;
                    return Ok(());
                }
                Stop::LinkLost(_) => unreachable_while_disconnected(),
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

/// The kernel let go: tell a resumable server it may release the device now
/// (after whatever commands are still queued), rather than hold it for a resume.
async fn end_session(server: &mut PeerStream, session: &mut ClientSession<()>) {
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
            Err(error @ (ClientError::ResumeRefused { .. } | ClientError::ServerKeyChanged { .. })) => {
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

struct Relay<K> {
    kernel: K,
    /// Commands from the kernel not decoded yet.
    kernel_in: BytesMut,
    /// Replies for the kernel.
    kernel_out: Outbox,
}

impl<K: AsyncRead + AsyncWrite + Unpin> Relay<K> {
    fn poll_drive(
        &mut self,
        cx: &mut Context<'_>,
        mut server: Option<&mut PeerStream>,
        session: &mut ClientSession<()>,
        limits: &Limits,
    ) -> Poll<Result<Stop, RelayError>> {
        loop {
            let mut progressed = false;

            // Kernel -> session.
            if session.wants_commands() {
                self.kernel_in.reserve(64 * 1024);
                match poll_read_buf(Pin::new(&mut self.kernel), cx, &mut self.kernel_in) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Ok(Stop::Detached)),
                    Poll::Ready(Ok(_)) => {
                        progressed = true;
                        self.take_commands(session, limits)?;
                    }
                    // The kernel resets its socket on detach.
                    Poll::Ready(Err(_)) => return Poll::Ready(Ok(Stop::Detached)),
                    Poll::Pending => {}
                }
            }

            if let Some(stream) = server.as_deref_mut() {
                // Server -> session -> kernel.
                if self.kernel_out.queued() < KERNEL_BACKLOG {
                    match poll_read_buf(Pin::new(&mut *stream), cx, session.input()) {
                        Poll::Ready(Ok(0)) => {
                            return Poll::Ready(Ok(Stop::LinkLost(io::ErrorKind::UnexpectedEof.into())));
                        }
                        Poll::Ready(Ok(_)) => {
                            progressed = true;
                            session.handle_input()?;
                            while let Some(event) = session.poll_event() {
                                match event {
                                    Event::Completed { reply, .. } => self.kernel_out.push_ret_submit(&reply),
                                    Event::Unlinked { reply, .. } => self.kernel_out.push_ret_unlink(&reply),
                                }
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

            // Replies -> kernel.
            match poll_write_all(&mut self.kernel_out, cx, &mut self.kernel) {
                Poll::Ready(Ok(wrote)) => progressed |= wrote,
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(Stop::Detached)),
                Poll::Pending => {}
            }

            if !progressed {
                return Poll::Pending;
            }
        }
    }

    /// Decodes the kernel's whole commands into the session.
    fn take_commands(&mut self, session: &mut ClientSession<()>, limits: &Limits) -> Result<(), RelayError> {
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
            let message = urb::decode_command(&mut self.kernel_in, limits, |_, _| iso)
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
