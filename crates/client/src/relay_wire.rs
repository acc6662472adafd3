//! The relay's connection to the server ([`Link`]): the stream, the buffer it
//! reads into, the bytes it writes and the keep-alive timer, and the reads and
//! writes that move them without holding the session. Not the relay's loop
//! (`relay`), and no USB/IP: bytes only.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::AsyncWrite;
use tokio_util::io::poll_read_buf;
use usbwire_proto::client_session::{ClientSession, READ_CHUNK};
use usbwire_proto::{Outbox, RecvBuffer};
use usbwire_transport::{poll_write_outbox, PeerStream};

/// One connection to the server, as the relay drives it. What it holds goes
/// with the connection: a new one starts empty.
pub(crate) struct Link {
    pub(crate) stream: PeerStream,
    /// The server's bytes not decoded yet: the relay reads into it without
    /// holding the session, which makes room in it for the next whole reply.
    pub(crate) input: RecvBuffer,
    /// Bytes were read into `input` and not decoded yet.
    pub(crate) fresh: bool,
    /// Whether the front takes more replies (so the relay reads the server).
    pub(crate) listening: bool,
    /// Taken from the session's outbox, being written.
    pub(crate) out: Outbox,
    /// Everything written was flushed (TLS and transforms buffer until then).
    pub(crate) flushed: bool,
    /// `out` still held bytes, so what the session queued since was left there.
    pub(crate) left_queued: bool,
    /// Keep-alive's clock: reset to each deadline the session names.
    pub(crate) timer: Pin<Box<tokio::time::Sleep>>,
    /// The session acknowledges what it received (it is resumable).
    pub(crate) acknowledges: bool,
}

impl Link {
    pub(crate) fn new(stream: PeerStream, acknowledges: bool) -> Self {
        Self {
            stream,
            input: RecvBuffer::with_capacity(READ_CHUNK),
            fresh: false,
            listening: true,
            out: Outbox::default(),
            flushed: true,
            left_queued: false,
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            acknowledges,
        }
    }

    /// Reads the server into `input` while the front takes replies (`fresh`
    /// when bytes came); why the link ended, if it did.
    pub(crate) fn poll_read(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if !self.listening {
            return Ok(());
        }
        match poll_read_buf(Pin::new(&mut self.stream), cx, &mut *self.input) {
            Poll::Ready(Ok(0)) => Err(io::ErrorKind::UnexpectedEof.into()),
            Poll::Ready(Ok(_)) => {
                self.fresh = true;
                Ok(())
            }
            Poll::Ready(Err(error)) => Err(error),
            Poll::Pending => Ok(()),
        }
    }

    /// Moves what `session` queued to `out`, once the last of it is written
    /// (`left_queued` meanwhile).
    pub(crate) fn take<T>(&mut self, session: &mut ClientSession<T>) {
        if !self.out.is_empty() {
            self.left_queued = true;
        } else if session.outbox().hand_over(&mut self.out) {
            self.flushed = false;
        }
    }

    /// Writes `out` to the server until it is empty or the socket would
    /// block, and flushes once it is all out (TLS and transforms buffer until
    /// then). Nothing to write and nothing to flush costs nothing.
    pub(crate) fn poll_write(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.out.is_empty() && self.flushed {
            return Ok(());
        }
        if let Poll::Ready(Err(error)) = poll_write_outbox(&mut self.out, cx, &mut self.stream) {
            return Err(error);
        }
        if self.out.is_empty() {
            match Pin::new(&mut self.stream).poll_flush(cx) {
                Poll::Ready(Ok(())) => self.flushed = true,
                Poll::Ready(Err(error)) => return Err(error),
                Poll::Pending => {}
            }
        }
        Ok(())
    }
}

/// Writes `outbox` until it is empty or the writer would block, then flushes
/// (TLS and transforms buffer until flushed). `Ready(Ok(wrote))`: whether any
/// byte went out; `Pending` only when none could.
pub(crate) fn poll_write_all<W: AsyncWrite + Unpin>(
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
