//! A TLS 1.3 connection after its handshake: the record layer over a TCP socket (or any
//! [`Socket`]: tests script one that takes a few bytes, would block or fails).
//!
//! rustls runs the handshake (`handshake`) and then hands over the traffic keys and a
//! `KernelConnection` (the API it offers kernel TLS), which keeps what only it can do: new
//! traffic secrets on a key update, session tickets. [`TlsStream`] is the glue between the
//! socket and the two halves of the record layer, neither of which does I/O:
//! * **reads**: `record_reader` opens records from one 256 KiB buffer filled by the socket,
//!   straight into the caller's buffer when a record fits there. Through rustls's buffered
//!   API a byte was copied three times besides: into its deframer, into its plaintext
//!   queue, out of it. A record that breaks the rules ends the connection with the alert
//!   RFC 8446 names, sent here.
//! * **writes**: `record_writer` encrypts the caller's slices straight into its send buffer
//!   (see there how records are laid out and when they go); this writes what it has sealed
//!   to the socket. Through rustls each byte was copied into a record allocated for it,
//!   then encrypted. A failed write ends the connection: nothing sealed goes out after it.
//! * key updates the peer asks for are passed from the reader to the writer, which sends
//!   ours (and its own before AES-GCM's record limit); close_notify, fatal alerts.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use rustls::client::ClientConnectionData;
use rustls::kernel::KernelConnection;
use rustls::server::ServerConnectionData;
use rustls::{ConnectionTrafficSecrets, SupportedCipherSuite};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::record::{PeerSession, RecordError};
use crate::record_reader::Reader;
use crate::record_writer::Writer;

/// What rustls keeps of the connection once we hold the keys.
pub(crate) enum Session {
    Server(KernelConnection<ServerConnectionData>),
    Client(KernelConnection<ClientConnectionData>),
}

impl Session {
    fn suite(&self) -> SupportedCipherSuite {
        match self {
            Self::Server(s) => s.negotiated_cipher_suite(),
            Self::Client(s) => s.negotiated_cipher_suite(),
        }
    }
}

impl PeerSession for Session {
    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        match self {
            Self::Server(s) => s.update_rx_secret(),
            Self::Client(s) => s.update_rx_secret(),
        }
        .map_err(RecordError::Session)
    }

    fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        match self {
            Self::Server(s) => s.update_tx_secret(),
            Self::Client(s) => s.update_tx_secret(),
        }
        .map_err(RecordError::Session)
    }

    fn new_session_ticket(&mut self, body: &[u8]) -> Result<(), RecordError> {
        match self {
            Self::Client(client) => client.handle_new_session_ticket(body).map_err(RecordError::Session),
            // RFC 8446 §4.6.1: only servers send tickets.
            Self::Server(_) => Err(RecordError::Unexpected("a NewSessionTicket sent to a server")),
        }
    }
}

/// What a handshake leaves for the record layer.
pub(crate) struct Established {
    pub(crate) session: Session,
    pub(crate) tx: (u64, ConnectionTrafficSecrets),
    pub(crate) rx: (u64, ConnectionTrafficSecrets),
    /// Application data rustls already decrypted during the handshake.
    pub(crate) plaintext: Vec<u8>,
    /// Bytes read past the handshake, not yet processed (whole or partial records).
    pub(crate) ciphertext: Vec<u8>,
}

/// What a [`TlsStream`] runs over: a byte stream that can also take bytes at once, without
/// waiting and without registering a wake-up (an alert on the way out of a failed read
/// must not take the waker of a task waiting to write).
pub trait Socket: AsyncRead + AsyncWrite + Unpin {
    /// Writes what the socket takes now; `WouldBlock` when it takes nothing.
    fn try_write_now(&mut self, buf: &[u8]) -> io::Result<usize>;
}

impl Socket for TcpStream {
    fn try_write_now(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.try_write(buf)
    }
}

/// A TLS 1.3 connection over TCP (or another [`Socket`]), past its handshake.
pub struct TlsStream<S = TcpStream> {
    tcp: S,
    session: Session,
    tx: Writer,
    rx: Reader,
}

impl<S: std::fmt::Debug> std::fmt::Debug for TlsStream<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream").field("tcp", &self.tcp).field("tx_sequence", &self.tx.sequence()).finish()
    }
}

impl<S: Socket> TlsStream<S> {
    pub(crate) fn new(tcp: S, established: Established) -> io::Result<Self> {
        let Established { session, tx, rx, plaintext, ciphertext } = established;
        let limit = match session.suite() {
            SupportedCipherSuite::Tls13(suite) => suite.common.confidentiality_limit,
            SupportedCipherSuite::Tls12(_) => {
                return Err(io::Error::other("TLS 1.2 negotiated; usbwire speaks TLS 1.3 only"))
            }
        };
        Ok(Self { tcp, session, tx: Writer::new(tx, limit)?, rx: Reader::new(rx, &plaintext, &ciphertext)? })
    }

    /// The socket underneath.
    pub fn get_ref(&self) -> &S {
        &self.tcp
    }

    /// Reads more ciphertext from the socket.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut buf = ReadBuf::new(self.rx.space());
        ready!(Pin::new(&mut self.tcp).poll_read(cx, &mut buf))?;
        let read = buf.filled().len();
        Poll::Ready(self.rx.received(read).map_err(io::Error::from))
    }

    /// The peer's records broke the connection: tell it why (RFC 8446 §6.2; best effort,
    /// without waiting for the socket) and stop sending.
    fn fail(&mut self, error: RecordError) -> io::Error {
        if !matches!(error, RecordError::Truncated(_)) {
            let alert = error.alert();
            self.tx.end(alert);
            if let Some(alert) = alert {
                tracing::debug!(?alert, "TLS alert sent");
            }
            while !self.tx.pending().is_empty() {
                match self.tcp.try_write_now(self.tx.pending()) {
                    Ok(n) if n > 0 => self.tx.sent(n),
                    _ => break,
                }
            }
        }
        error.into()
    }

    /// Writes sealed records until all are out (`Ready(Ok)`) or the socket is full. A
    /// failed write ends the connection.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.tx.pending().is_empty() {
            let written = ready!(Pin::new(&mut self.tcp).poll_write(cx, self.tx.pending()));
            match written {
                Ok(n) if n > 0 => self.tx.sent(n),
                Ok(_) => return Poll::Ready(Err(self.write_failed(io::ErrorKind::WriteZero.into()))),
                Err(error) => return Poll::Ready(Err(self.write_failed(error))),
            }
        }
        Poll::Ready(Ok(()))
    }

    /// The socket refused a write: the connection is over, nothing sealed goes out after.
    fn write_failed(&mut self, error: io::Error) -> io::Error {
        self.tx.fail();
        error
    }
}

impl<S: Socket> AsyncRead for TlsStream<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let read = this.rx.read(&mut this.session, buf);
            if this.rx.take_update_requested() {
                this.tx.update_key();
            }
            match read {
                Ok(false) => return Poll::Ready(Ok(())),
                Ok(true) => {}
                Err(error) => return Poll::Ready(Err(this.fail(error))),
            }
            ready!(this.poll_fill(cx))?;
        }
    }
}

impl<S: Socket> AsyncWrite for TlsStream<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if !this.tx.is_open() {
            return Poll::Ready(Err(RecordError::Closed.into()));
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        let mut take = this.tx.seal(&mut this.session, bufs)?;
        if take == 0 {
            ready!(this.poll_send(cx))?;
            take = this.tx.seal(&mut this.session, bufs)?;
        }
        // The bytes are ours now; what the socket does not take goes with the next write or flush.
        if let Poll::Ready(Err(error)) = this.poll_send(cx) {
            return Poll::Ready(Err(error));
        }
        Poll::Ready(Ok(take))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.tx.has_failed() {
            return Poll::Ready(Err(RecordError::Closed.into()));
        }
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // RFC 8446 §6.1: close_notify before closing our side, unless a fatal alert went.
        this.tx.close()?;
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
