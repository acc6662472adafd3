//! A TLS 1.3 connection after its handshake: the record layer over a TCP socket.
//!
//! rustls runs the handshake (`handshake`) and then hands over the traffic keys and a
//! `KernelConnection` (the API it offers kernel TLS), which keeps what only it can do: new
//! traffic secrets on a key update, session tickets. [`TlsStream`] owns everything else:
//! * **reads**: one 256 KiB buffer filled by the socket; each record is decrypted straight
//!   into the caller's buffer when it fits there (else in place, then copied). Through
//!   rustls's buffered API a byte was copied three times besides: into its deframer, into
//!   its plaintext queue, out of it.
//! * **writes**: the caller's slices are encrypted straight into one send buffer, up to
//!   16 KiB a record (small slices are gathered there first and sealed in place), and go to
//!   the socket with one write per up to 256 KiB. Through rustls each byte was copied
//!   into a record allocated for it, then encrypted.
//! * post-handshake messages (key updates both ways, tickets for the client), alerts and
//!   close_notify, and a key update of our own before AES-GCM's record limit.

use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use rustls::client::ClientConnectionData;
use rustls::kernel::KernelConnection;
use rustls::server::ServerConnectionData;
use rustls::{ConnectionTrafficSecrets, SupportedCipherSuite};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::record::{self, content, wire_len, Opener, Sealer, MAX_PLAINTEXT, MAX_RECORD};

/// Ciphertext read from the socket at once, at most.
const READ_BUFFER: usize = 256 * 1024;
/// Sealed bytes waiting for the socket, at most.
const WRITE_BUFFER: usize = 256 * 1024;
/// The largest record we seal.
const MAX_SEALED: usize = wire_len(MAX_PLAINTEXT);
/// Room a record needs in the send buffer: its own and a key update's before it.
const ROOM: usize = 2 * MAX_SEALED;
/// Slices at least this long are sealed from where they lie; shorter ones are gathered.
const SEAL_DIRECT: usize = 2048;
/// Handshake message types after the handshake (RFC 8446 §4).
const NEW_SESSION_TICKET: u8 = 4;
const KEY_UPDATE: u8 = 24;

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

    fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), rustls::Error> {
        match self {
            Self::Server(s) => s.update_tx_secret(),
            Self::Client(s) => s.update_tx_secret(),
        }
    }

    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), rustls::Error> {
        match self {
            Self::Server(s) => s.update_rx_secret(),
            Self::Client(s) => s.update_rx_secret(),
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

/// A TLS 1.3 connection over TCP, past its handshake.
pub struct TlsStream {
    tcp: TcpStream,
    session: Session,
    tx: Sealer,
    rx: Opener,
    /// Records to seal under one key before updating it (the suite's confidentiality limit, with room).
    tx_limit: u64,
    /// The peer asked for a key update: send ours before the next record.
    key_update_due: bool,
    /// Received bytes: `plain` (decrypted, not yet handed out) lies before `start..end`
    /// (records not yet opened).
    incoming: Vec<u8>,
    plain: Range<usize>,
    start: usize,
    end: usize,
    /// The peer's close_notify arrived, or the socket reached EOF.
    read_closed: bool,
    /// Sealed records in `outgoing[sent..filled]`, waiting for the socket.
    outgoing: Vec<u8>,
    sent: usize,
    filled: usize,
    close_notify_sent: bool,
}

impl std::fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream").field("tcp", &self.tcp).field("tx_sequence", &self.tx.sequence()).finish()
    }
}

impl TlsStream {
    pub(crate) fn new(tcp: TcpStream, established: Established) -> io::Result<Self> {
        let Established { session, tx, rx, plaintext, ciphertext } = established;
        let limit = match session.suite() {
            SupportedCipherSuite::Tls13(suite) => suite.common.confidentiality_limit,
            SupportedCipherSuite::Tls12(_) => {
                return Err(io::Error::other("TLS 1.2 negotiated; usbwire speaks TLS 1.3 only"))
            }
        };
        let mut incoming = vec![0; READ_BUFFER + MAX_RECORD];
        let held = plaintext.len() + ciphertext.len();
        if held > incoming.len() {
            return Err(io::Error::other("more than 256 KiB arrived with the TLS handshake"));
        }
        incoming[..plaintext.len()].copy_from_slice(&plaintext);
        incoming[plaintext.len()..held].copy_from_slice(&ciphertext);
        Ok(Self {
            tcp,
            session,
            tx: Sealer::new(tx.0, tx.1)?,
            rx: Opener::new(rx.0, rx.1)?,
            tx_limit: limit - limit / 16,
            key_update_due: false,
            incoming,
            plain: 0..plaintext.len(),
            start: plaintext.len(),
            end: held,
            read_closed: false,
            outgoing: vec![0; WRITE_BUFFER],
            sent: 0,
            filled: 0,
            close_notify_sent: false,
        })
    }

    /// The TCP socket underneath.
    pub fn get_ref(&self) -> &TcpStream {
        &self.tcp
    }

    /// The length of the next record if the buffer holds all of it.
    fn next_record(&self) -> io::Result<Option<usize>> {
        let buffered = &self.incoming[self.start..self.end];
        Ok(record::record_len(buffered)?.filter(|&len| len <= buffered.len()))
    }

    /// Opens the next record into `buf` if it is whole and fits there; `Ok(false)` if not.
    fn open_into(&mut self, buf: &mut ReadBuf<'_>) -> io::Result<bool> {
        let Some(len) = self.next_record()? else { return Ok(false) };
        let room = record::plaintext_room(len);
        if room > buf.remaining() {
            return Ok(false);
        }
        let at = self.start;
        let (kind, plaintext) = self.rx.open_into(&self.incoming[at..at + len], buf.initialize_unfilled_to(room))?;
        self.start += len;
        if kind == content::APPLICATION_DATA {
            buf.advance(plaintext);
        } else {
            let message = buf.initialize_unfilled_to(plaintext)[..plaintext].to_vec();
            self.control(kind, &message)?;
        }
        Ok(true)
    }

    /// Opens the next record in place, if it is whole; `Ok(false)` if not.
    fn open_in_place(&mut self) -> io::Result<bool> {
        let Some(len) = self.next_record()? else { return Ok(false) };
        let at = self.start;
        let (kind, range) = self.rx.open(&mut self.incoming[at..at + len])?;
        self.start += len;
        let plaintext = at + range.start..at + range.end;
        if kind == content::APPLICATION_DATA {
            self.plain = plaintext;
        } else {
            let message = self.incoming[plaintext].to_vec();
            self.control(kind, &message)?;
        }
        Ok(true)
    }

    /// A record that is not application data: an alert or post-handshake messages.
    fn control(&mut self, kind: u8, message: &[u8]) -> io::Result<()> {
        match kind {
            content::ALERT => self.alert(message),
            content::HANDSHAKE => self.post_handshake(message),
            _ => Err(record::RecordError::Malformed("unexpected content type").into()),
        }
    }

    fn alert(&mut self, message: &[u8]) -> io::Result<()> {
        let &[_level, description] = message else {
            return Err(record::RecordError::Malformed("alert of the wrong size").into());
        };
        let description = rustls::AlertDescription::from(description);
        if description == rustls::AlertDescription::CloseNotify {
            tracing::trace!("TLS close_notify received");
            self.read_closed = true;
            return Ok(());
        }
        Err(io::Error::new(io::ErrorKind::InvalidData, rustls::Error::AlertReceived(description)))
    }

    /// Key updates and (for clients) session tickets; each message whole in its record.
    fn post_handshake(&mut self, mut message: &[u8]) -> io::Result<()> {
        while let [kind, a, b, c, rest @ ..] = message {
            let len = u32::from_be_bytes([0, *a, *b, *c]) as usize;
            let Some((body, rest)) = rest.split_at_checked(len) else {
                return Err(record::RecordError::Malformed("handshake message split across records").into());
            };
            match (*kind, &mut self.session) {
                (KEY_UPDATE, _) => {
                    let (&[request], []) = (body, rest) else {
                        return Err(
                            record::RecordError::Malformed("key update of the wrong size, or data after it").into()
                        );
                    };
                    let (sequence, secrets) = self.session.update_rx().map_err(io::Error::other)?;
                    self.rx = Opener::new(sequence, secrets)?;
                    self.key_update_due |= request == 1;
                    tracing::debug!(requested = request == 1, "TLS key update received");
                }
                (NEW_SESSION_TICKET, Session::Client(client)) => {
                    client.handle_new_session_ticket(body).map_err(io::Error::other)?;
                }
                _ => return Err(record::RecordError::Malformed("unexpected handshake message").into()),
            }
            message = rest;
        }
        if !message.is_empty() {
            return Err(record::RecordError::Malformed("handshake message split across records").into());
        }
        Ok(())
    }

    /// Reads more ciphertext from the socket (moving a partial record to the front first).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.plain.is_empty() && self.incoming.len() - self.end < MAX_RECORD {
            self.incoming.copy_within(self.start..self.end, 0);
            (self.end, self.start, self.plain) = (self.end - self.start, 0, 0..0);
        }
        let mut buf = ReadBuf::new(&mut self.incoming[self.end..]);
        ready!(Pin::new(&mut self.tcp).poll_read(cx, &mut buf))?;
        let read = buf.filled().len();
        self.end += read;
        if read == 0 {
            self.read_closed = true;
            if self.start != self.end {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the TLS peer closed mid-record",
                )));
            }
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed connection without sending TLS close_notify",
            )));
        }
        Poll::Ready(Ok(()))
    }

    /// Seals as much of `bufs` as the send buffer has room for; returns how much.
    fn seal_slices(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        // Make room by moving what is still unsent to the front, once that moves at most
        // as much as it frees.
        if self.outgoing.len() - self.filled < ROOM && self.sent >= self.outgoing.len() / 2 {
            self.outgoing.copy_within(self.sent..self.filled, 0);
            (self.filled, self.sent) = (self.filled - self.sent, 0);
        }
        let mut taken = 0;
        // Short slices gathered for one record, at `outgoing[filled + HEADER..]`.
        let mut gathered = 0;
        'slices: for slice in bufs {
            let mut piece: &[u8] = slice;
            while !piece.is_empty() {
                if self.outgoing.len() - self.filled < ROOM {
                    break 'slices;
                }
                if gathered == 0 && piece.len() >= SEAL_DIRECT {
                    self.before_record()?;
                    let (now, rest) = piece.split_at(piece.len().min(MAX_PLAINTEXT));
                    self.filled +=
                        self.tx.seal_from(content::APPLICATION_DATA, now, &mut self.outgoing[self.filled..])?;
                    (piece, taken) = (rest, taken + now.len());
                    continue;
                }
                if piece.len() >= SEAL_DIRECT {
                    self.seal_gathered(&mut gathered)?;
                    continue;
                }
                if gathered == 0 {
                    self.before_record()?;
                }
                let n = piece.len().min(MAX_PLAINTEXT - gathered);
                let at = self.filled + record::HEADER + gathered;
                self.outgoing[at..at + n].copy_from_slice(&piece[..n]);
                (piece, gathered, taken) = (&piece[n..], gathered + n, taken + n);
                if gathered == MAX_PLAINTEXT {
                    self.seal_gathered(&mut gathered)?;
                }
            }
        }
        self.seal_gathered(&mut gathered)?;
        Ok(taken)
    }

    /// Seals the `gathered` bytes waiting at `outgoing[filled + HEADER..]` as one record.
    fn seal_gathered(&mut self, gathered: &mut usize) -> io::Result<()> {
        if *gathered > 0 {
            let at = self.filled;
            self.filled += self.tx.seal_in_place(content::APPLICATION_DATA, *gathered, &mut self.outgoing[at..])?;
            *gathered = 0;
        }
        Ok(())
    }

    /// A key update of ours first if the peer asked for one or the key is near its limit.
    fn before_record(&mut self) -> io::Result<()> {
        if !self.key_update_due && self.tx.sequence() < self.tx_limit {
            return Ok(());
        }
        let message = [KEY_UPDATE, 0, 0, 1, 0];
        self.filled += self.tx.seal_from(content::HANDSHAKE, &message, &mut self.outgoing[self.filled..])?;
        let (sequence, secrets) = self.session.update_tx().map_err(io::Error::other)?;
        self.tx = Sealer::new(sequence, secrets)?;
        self.key_update_due = false;
        tracing::debug!("TLS key update sent");
        Ok(())
    }

    /// Writes sealed records until all are out (`Ready(Ok)`) or the socket is full.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.filled {
            let n = ready!(Pin::new(&mut self.tcp).poll_write(cx, &self.outgoing[self.sent..self.filled]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        (self.sent, self.filled) = (0, 0);
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        loop {
            if !this.plain.is_empty() {
                let n = this.plain.len().min(buf.remaining());
                buf.put_slice(&this.incoming[this.plain.start..this.plain.start + n]);
                this.plain.start += n;
                if buf.remaining() == 0 {
                    return Poll::Ready(Ok(()));
                }
            }
            if this.read_closed {
                return Poll::Ready(Ok(()));
            }
            if this.open_into(buf)? || this.open_in_place()? {
                continue;
            }
            if buf.filled().len() > before {
                return Poll::Ready(Ok(()));
            }
            ready!(this.poll_fill(cx))?;
        }
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.close_notify_sent {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "TLS connection already closed")));
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        let mut take = this.seal_slices(bufs)?;
        if take == 0 {
            ready!(this.poll_send(cx))?;
            take = this.seal_slices(bufs)?;
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
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.close_notify_sent {
            if this.outgoing.len() - this.filled < MAX_RECORD {
                ready!(this.poll_send(cx))?;
            }
            this.filled += this.tx.seal_from(content::ALERT, &[1, 0], &mut this.outgoing[this.filled..])?;
            this.close_notify_sent = true;
        }
        ready!(this.poll_send(cx))?;
        Pin::new(&mut this.tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[path = "tls_stream_tests.rs"]
mod tests;
