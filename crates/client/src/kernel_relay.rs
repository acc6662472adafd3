//! The kernel's relay: vhci-hcd's end of a socket pair as the relay's
//! [`Front`]. The kernel writes plain USB/IP commands into it and reads the
//! replies back; [`run`] decodes the commands into the session the relay
//! drives and encodes each reply for the kernel. The relay's loop, resume and
//! keep-alive are `relay`'s; the userspace fronts are `waiters`' and
//! `driven`'s. Not for anything but vhci-hcd: the kernel is trusted to send
//! well-formed isochronous descriptors.

use std::ops::DerefMut;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;
use tokio_util::io::poll_read_buf;
use usbwire_proto::client_session::{ClientSession, Event};
use usbwire_proto::urb::{self, ClientMessage};
use usbwire_proto::{Budget, Limits, Outbox};
use usbwire_transport::PeerStream;

use crate::relay::{drive, new_session, Front, Held, RelayError, RelayState, Replies, Step, Upstream};
use crate::relay_wire::poll_write_all;

/// Replies waiting for the kernel to read them before the relay stops reading the server.
const KERNEL_BACKLOG: usize = 8 * 1024 * 1024;

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
    let session = new_session(devid, &upstream, Budget::default());
    let front =
        KernelFront { kernel, kernel_in: BytesMut::with_capacity(64 * 1024), kernel_out: Outbox::default(), session };
    drive(front, stream, upstream, state).await
}

/// vhci-hcd's end of the socket pair: commands as bytes in, replies as bytes out.
struct KernelFront<K> {
    kernel: K,
    /// Commands from the kernel not decoded yet.
    kernel_in: BytesMut,
    /// Replies for the kernel.
    kernel_out: Outbox,
    /// The kernel's session: the relay's alone.
    session: ClientSession<()>,
}

/// The kernel's session, held, beside the replies for the kernel.
struct KernelHeld<'a> {
    session: &'a mut ClientSession<()>,
    kernel_out: &'a mut Outbox,
}

impl std::ops::Deref for KernelHeld<'_> {
    type Target = ClientSession<()>;

    fn deref(&self) -> &ClientSession<()> {
        self.session
    }
}

impl DerefMut for KernelHeld<'_> {
    fn deref_mut(&mut self) -> &mut ClientSession<()> {
        self.session
    }
}

impl Held<()> for KernelHeld<'_> {
    fn take_replies(&mut self) -> Replies {
        let kernel_out = &mut *self.kernel_out;
        let handled = self.session.handle_input_with(|event| match event {
            Event::Completed { reply, .. } => kernel_out.push_ret_submit(&reply),
            Event::Unlinked { reply, .. } => kernel_out.push_ret_unlink(&reply),
        });
        // The kernel runs elsewhere: nothing to make room for.
        Replies { handled, woke: false }
    }
}

impl<K: AsyncRead + AsyncWrite + Unpin> Front for KernelFront<K> {
    type Tag = ();
    type Held<'a>
        = KernelHeld<'a>
    where
        K: 'a;

    fn hold(&mut self) -> KernelHeld<'_> {
        KernelHeld { session: &mut self.session, kernel_out: &mut self.kernel_out }
    }

    fn poll_commands(&mut self, cx: &mut Context<'_>) -> Result<Step, RelayError> {
        if !self.session.wants_commands() {
            return Ok(Step::Idle);
        }
        // Whole commands left over from a read the session's budget cut short come first.
        let before = self.session.outstanding();
        self.take_commands()?;
        let took = self.session.outstanding() != before;
        if !self.session.wants_commands() {
            return Ok(if took { Step::Progressed } else { Step::Idle });
        }
        self.kernel_in.reserve(64 * 1024);
        match poll_read_buf(Pin::new(&mut self.kernel), cx, &mut self.kernel_in) {
            Poll::Ready(Ok(0)) => Ok(Step::Detached),
            Poll::Ready(Ok(_)) => {
                self.take_commands()?;
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
    fn take_commands(&mut self) -> Result<(), RelayError> {
        let limits = Limits::default();
        let session = &mut self.session;
        while session.wants_commands() {
            // vhci sends isochronous descriptors exactly when the URB has packets:
            // the kernel is trusted here.
            let iso = urb::announces_iso_packets(&self.kernel_in);
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
