//! The kernel's relay: vhci-hcd's end of a socket pair as the relay's
//! [`Front`]. The kernel writes plain USB/IP commands into it and reads the
//! replies back; [`run`] decodes the commands into the session the relay
//! drives (its own, held without a lock) and encodes each reply for the
//! kernel, answering its enumeration from the import's descriptor snapshot
//! and its mass storage through the accelerator (`accelerators`) when the
//! server agreed to them. It owns the kernel's socket and the bytes to and from it; the
//! relay's loop, resume and keep-alive are `relay`'s; the userspace front is
//! `waiters`'. Not for anything but vhci-hcd: the kernel is trusted to send
//! well-formed isochronous descriptors (`urb::announces_iso_packets`).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio_util::io::poll_read_buf;
use usbwire_proto::client_session::{ClientSession, ClientSessionError, Event};
use usbwire_proto::urb::{self, ClientMessage, ServerMessage};
use usbwire_proto::{Budget, Limits, Outbox};
use usbwire_transport::PeerStream;

use crate::accelerators::Accelerators;
use crate::relay::{drive, new_session, Front, RelayError, RelayState, Step, Upstream, END_TIMEOUT};
use crate::relay_wire::poll_write_all;
use crate::storage::StorageCounters;

/// Replies waiting for the kernel to read them before the relay stops reading the server.
const KERNEL_BACKLOG: usize = 8 * 1024 * 1024;

/// How often the storage accelerator's counters are published, at most.
const COUNTERS_EVERY: Duration = Duration::from_secs(1);

/// Relays between the kernel's socket and the server until the port is
/// detached (`Ok`) or the session is lost. `stream` is the imported
/// device's URB channel. `state` follows the connection; `counters`, the
/// storage accelerator's work (at most once a second).
pub async fn run<K>(
    kernel: K,
    stream: PeerStream,
    devid: u32,
    upstream: Upstream,
    state: Option<watch::Sender<RelayState>>,
    counters: Option<watch::Sender<StorageCounters>>,
) -> Result<(), RelayError>
where
    K: AsyncRead + AsyncWrite + Unpin,
{
    let front = KernelFront {
        kernel,
        kernel_in: BytesMut::with_capacity(64 * 1024),
        kernel_out: Outbox::default(),
        accelerators: Accelerators::new(devid, &upstream),
        counters: counters.map(|sender| (sender, Instant::now())),
    };
    // The kernel's session is the relay's alone: held without a lock.
    let mut held = (new_session(devid, &upstream, Budget::default()), front);
    let result = drive(&mut held, stream, upstream, state).await;
    if let Some(accelerators) = &held.1.accelerators {
        if let (Some(counters), Some((sender, _))) = (accelerators.storage_counters(), &held.1.counters) {
            sender.send_replace(counters);
        }
        accelerators.log_summary();
    }
    if let Err(RelayError::Reenumerated { .. }) = &result {
        // The replies before the end (a DFU_DETACH's) reach the kernel first.
        held.1.flush().await;
    }
    result
}

fn to_server(session: &mut ClientSession<()>, message: ClientMessage) -> Result<(), ClientSessionError> {
    match message {
        ClientMessage::Submit(submit) => session.submit(submit, ()),
        ClientMessage::Unlink(unlink) => session.unlink(unlink),
    }
}

fn push_reply(kernel_out: &mut Outbox, reply: ServerMessage) {
    match reply {
        ServerMessage::Submit(reply) => kernel_out.push_ret_submit(&reply),
        ServerMessage::Unlink(reply) => kernel_out.push_ret_unlink(&reply),
    }
}

/// vhci-hcd's end of the socket pair: commands as bytes in, replies as bytes out.
struct KernelFront<K> {
    kernel: K,
    /// Commands from the kernel not decoded yet.
    kernel_in: BytesMut,
    /// Replies for the kernel.
    kernel_out: Outbox,
    /// The kernel's `GET_DESCRIPTOR`s answered from the import's snapshot,
    /// and mass-storage commands in one round trip, when the server agreed.
    accelerators: Option<Accelerators>,
    /// Where its counters go, and when they last went.
    counters: Option<(watch::Sender<StorageCounters>, Instant)>,
}

impl<K: AsyncRead + AsyncWrite + Unpin> Front for KernelFront<K> {
    type Tag = ();

    fn poll_commands(&mut self, cx: &mut Context<'_>, session: &mut ClientSession<()>) -> Result<Step, RelayError> {
        if !session.wants_commands() {
            return Ok(Step::Idle);
        }
        let mut released = false;
        let storage = self.accelerators.as_ref().and_then(Accelerators::storage_counters);
        if let (Some(counters), Some((sender, published))) = (storage, &mut self.counters) {
            if published.elapsed() >= COUNTERS_EVERY && *sender.borrow() != counters {
                sender.send_replace(counters);
                *published = Instant::now();
            }
        }
        if let Some(accelerators) = &mut self.accelerators {
            // Commands that waited for the reads ahead in flight.
            let kernel_out = &mut self.kernel_out;
            released =
                accelerators.release(Instant::now(), &mut |message| to_server(session, message), &mut |reply| {
                    push_reply(kernel_out, reply)
                })?;
        }
        // Whole commands left over from a read the session's budget cut short come first.
        let before = session.outstanding();
        self.take_commands(session)?;
        let took = released || session.outstanding() != before;
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

    #[inline]
    fn deliver(&mut self, event: Event<()>) {
        let kernel_out = &mut self.kernel_out;
        match (&mut self.accelerators, event) {
            (Some(accelerators), event) => accelerators.server_sent(event, &mut |reply| push_reply(kernel_out, reply)),
            (None, Event::Completed { reply, .. }) => kernel_out.push_ret_submit(&reply),
            (None, Event::Unlinked { reply, .. }) => kernel_out.push_ret_unlink(&reply),
        }
    }

    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Step {
        match poll_write_all(&mut self.kernel_out, cx, &mut self.kernel) {
            Poll::Ready(Ok(true)) => Step::Progressed,
            Poll::Ready(Ok(false)) | Poll::Pending => Step::Idle,
            Poll::Ready(Err(_)) => Step::Detached,
        }
    }

    fn takes_replies(&self) -> bool {
        self.kernel_out.queued() < KERNEL_BACKLOG
    }
}

impl<K: AsyncRead + AsyncWrite + Unpin> KernelFront<K> {
    /// Decodes the kernel's whole commands into the session.
    fn take_commands(&mut self, session: &mut ClientSession<()>) -> Result<(), RelayError> {
        let limits = Limits::default();
        while session.wants_commands() {
            // vhci sends isochronous descriptors exactly when the URB has packets:
            // the kernel is trusted here.
            let iso = urb::announces_iso_packets(&self.kernel_in);
            let message = urb::decode_command(&mut self.kernel_in, &limits, |_, _| iso)
                .map_err(|error| RelayError::Kernel(error.to_string()))?;
            let Some(message) = message else { return Ok(()) };
            match &mut self.accelerators {
                Some(accelerators) => {
                    let kernel_out = &mut self.kernel_out;
                    accelerators.host_sent(
                        message,
                        Instant::now(),
                        &mut |message| to_server(session, message),
                        &mut |reply| push_reply(kernel_out, reply),
                    )?
                }
                None => to_server(session, message)?,
            }
        }
        Ok(())
    }

    /// Writes the replies still waiting for the kernel, for at most [`END_TIMEOUT`].
    async fn flush(&mut self) {
        let out = &mut self.kernel_out;
        let kernel = &mut self.kernel;
        let flushed = tokio::time::timeout(
            END_TIMEOUT,
            std::future::poll_fn(|cx| loop {
                match poll_write_all(out, cx, &mut *kernel) {
                    Poll::Ready(Ok(_)) if out.is_empty() => return Poll::Ready(()),
                    Poll::Ready(Ok(_)) => {}
                    Poll::Ready(Err(_)) => return Poll::Ready(()),
                    Poll::Pending => return Poll::Pending,
                }
            }),
        )
        .await;
        if flushed.is_err() {
            tracing::debug!("the last replies did not reach the kernel in time");
        }
    }
}
