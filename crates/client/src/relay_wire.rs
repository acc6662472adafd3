//! The relay's bytes outside the session: what it writes to the server and
//! the buffer it reads into ([`Wire`]), and the reads and writes that move
//! them without holding the session. Not the relay's loop (`relay`), and no
//! USB/IP: bytes only.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::AsyncWrite;
use tokio_util::io::poll_read_buf;
use usbwire_proto::Outbox;
use usbwire_transport::{poll_write_outbox, PeerStream};

/// What the relay holds of the session's bytes outside it: what it writes to
/// the server, and the buffer it reads into.
pub(crate) struct Wire {
    /// Taken from the session's outbox, being written.
    pub(crate) out: Outbox,
    /// Everything written was flushed (TLS and transforms buffer until then).
    pub(crate) flushed: bool,
    /// The session's read buffer, lent out while the relay reads.
    pub(crate) input: Option<BytesMut>,
    /// Bytes were read into `input` and not decoded yet.
    pub(crate) fresh: bool,
}

impl Default for Wire {
    fn default() -> Self {
        Self { out: Outbox::default(), flushed: true, input: None, fresh: false }
    }
}

/// Reads the server into the buffer the session lent (`wire.fresh` when
/// bytes came); why the link ended, if it did.
pub(crate) fn poll_read_wire(wire: &mut Wire, cx: &mut Context<'_>, stream: &mut PeerStream) -> Option<io::Error> {
    let input = wire.input.as_mut()?;
    match poll_read_buf(Pin::new(stream), cx, input) {
        Poll::Ready(Ok(0)) => Some(io::ErrorKind::UnexpectedEof.into()),
        Poll::Ready(Ok(_)) => {
            wire.fresh = true;
            None
        }
        Poll::Ready(Err(error)) => Some(error),
        Poll::Pending => None,
    }
}

/// Writes the wire's bytes to the server until they are out or the socket
/// would block, and flushes once they are all out (TLS and transforms buffer
/// until then). Nothing to write and nothing to flush costs nothing.
pub(crate) fn poll_write_wire(wire: &mut Wire, cx: &mut Context<'_>, stream: &mut PeerStream) -> io::Result<()> {
    if wire.out.is_empty() && wire.flushed {
        return Ok(());
    }
    if let Poll::Ready(Err(error)) = poll_write_outbox(&mut wire.out, cx, &mut *stream) {
        return Err(error);
    }
    if wire.out.is_empty() {
        match Pin::new(&mut *stream).poll_flush(cx) {
            Poll::Ready(Ok(())) => wire.flushed = true,
            Poll::Ready(Err(error)) => return Err(error),
            Poll::Pending => {}
        }
    }
    Ok(())
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
