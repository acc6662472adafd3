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

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::AsyncWrite;
use tokio::sync::watch;
use tokio_util::io::poll_read_buf;
use usbwire_device::{Device, TransferType, Urb};
use usbwire_proto::server_session::{DeviceCall, ServerSession, SessionError};
use usbwire_proto::Outbox;
use usbwire_transport::PeerStream;

use crate::registry::Lease;
use crate::ServerConfig;

/// iovecs per write call.
const MAX_SLICES: usize = 64;

/// How a URB channel ended without a protocol error.
#[derive(Debug)]
pub(crate) enum End {
    ClientClosed,
    Shutdown,
    /// The device was unplugged; every URB in flight has been answered.
    DeviceGone,
    /// The export was withdrawn (`usbwire unbind`) while imported.
    Withdrawn,
}

/// Why a URB channel was closed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ChannelError {
    #[error(transparent)]
    Protocol(#[from] SessionError),
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
}

pub(crate) async fn run(
    stream: PeerStream,
    leftover: BytesMut,
    lease: &mut Lease,
    config: &ServerConfig,
    mut stop: watch::Receiver<bool>,
) -> Result<End, ChannelError> {
    let mut channel = Channel {
        stream,
        unflushed: false,
        session: ServerSession::new(lease.record().devid(), leftover, config.limits.clone(), config.budget.clone()),
    };
    let device = lease.device();
    tokio::select! {
        result = std::future::poll_fn(|cx| channel.poll_drive(cx, device)) => result,
        () = crate::stopped(&mut stop) => Ok(End::Shutdown),
    }
}

struct Channel {
    stream: PeerStream,
    /// Written since the last flush (TLS buffers records until flushed).
    unflushed: bool,
    session: ServerSession,
}

impl Channel {
    fn poll_drive(&mut self, cx: &mut Context<'_>, device: &mut dyn Device) -> Poll<Result<End, ChannelError>> {
        loop {
            let mut progressed = false;

            // Commands: decode what is buffered, then read more while the session wants it.
            progressed |= self.handle_buffered(device)?;
            if self.session.wants_input() {
                let inbuf = self.session.input(|d, ep| is_iso(device, d, ep))?;
                match poll_read_buf(Pin::new(&mut self.stream), cx, inbuf) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Ok(End::ClientClosed)),
                    Poll::Ready(Ok(_)) => {
                        progressed = true;
                        self.handle_buffered(device)?;
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
                        self.session.complete(done.into_ret_submit());
                        progressed = true;
                    }
                    Poll::Pending => break,
                }
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

    /// Lets the session take buffered commands and carries out what they ask of the device.
    fn handle_buffered(&mut self, device: &mut dyn Device) -> Result<bool, ChannelError> {
        let handled = self.session.handle_input(|d, ep| is_iso(device, d, ep))?;
        while let Some(call) = self.session.poll_device_call() {
            match call {
                DeviceCall::Submit(submit) => device.submit(Urb::from_submit(submit)),
                DeviceCall::Cancel { seqnum } => device.cancel(seqnum),
            }
        }
        Ok(handled)
    }
}

/// Writes from `outbox` until the socket would block or all is out.
/// `Ready(Ok(wrote))` says whether any byte went out; `Pending` only when none did.
fn poll_write_outbox<W: AsyncWrite + Unpin>(
    outbox: &mut Outbox,
    cx: &mut Context<'_>,
    writer: &mut W,
) -> Poll<io::Result<bool>> {
    let mut wrote = false;
    while !outbox.is_empty() {
        let written = match Pin::new(&mut *writer).poll_write_vectored(cx, &outbox.slices(MAX_SLICES)) {
            Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
            Poll::Ready(Ok(n)) => n,
            Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
            Poll::Pending if wrote => return Poll::Ready(Ok(true)),
            Poll::Pending => return Poll::Pending,
        };
        outbox.advance(written);
        wrote = true;
    }
    Poll::Ready(Ok(wrote))
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
