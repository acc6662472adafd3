//! A TLS 1.3 connection after its handshake: the record layer over a TCP socket.
//!
//! rustls runs the handshake (`handshake`) and then hands over the traffic keys and a
//! `KernelConnection` (the API it offers kernel TLS), which keeps what only it can do: new
//! traffic secrets on a key update, session tickets. [`TlsStream`] owns everything else:
//! * **reads**: `record_reader` (no I/O of its own) opens records from one 256 KiB buffer
//!   filled by the socket, straight into the caller's buffer when a record fits there.
//!   Through rustls's buffered API a byte was copied three times besides: into its
//!   deframer, into its plaintext queue, out of it. A record that breaks the rules ends
//!   the connection with the alert RFC 8446 names, sent here.
//! * **writes**: the caller's slices are encrypted straight into one send buffer, up to
//!   16 KiB a record (small slices are gathered there first and sealed in place), and go to
//!   the socket with one write per 64 KiB sealed (the peer opens one while we seal the
//!   next), or per large slice (a large URB's data, sealed whole into the 1 MiB buffer).
//!   Through rustls each byte was copied into a record allocated for it, then encrypted.
//! * key updates we send (answering the peer's request, or before AES-GCM's record
//!   limit), close_notify, fatal alerts.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use rustls::client::ClientConnectionData;
use rustls::kernel::KernelConnection;
use rustls::server::ServerConnectionData;
use rustls::{AlertDescription, ConnectionTrafficSecrets, SupportedCipherSuite};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::record::{self, content, wire_len, RecordError, Sealer, MAX_PLAINTEXT};
use crate::record_reader::{PeerSession, Reader};

/// Sealed bytes waiting for the socket, at most (records of data; a fatal alert has
/// room of its own after them): a 1 MiB URB's data is sealed whole and goes to the socket
/// in one piece (fewer, larger socket writes).
const WRITE_BUFFER: usize = 1024 * 1024;
/// The part of the send buffer slices shorter than [`LARGE_SLICE`] fill (they go to the
/// socket [`SEND_AT`] at a time), so the buffer's hot part stays in cache.
const SMALL_WRITES: usize = 256 * 1024;
/// A slice at least this long may fill the whole send buffer.
const LARGE_SLICE: usize = 256 * 1024;
/// Sealed bytes of shorter slices that go to the socket together: about a 64 KiB URB's
/// reply, so the peer decrypts one while we seal the next. Waiting for a quarter MiB
/// instead, both sides took turns idling: 64 KiB bulk IN over TLS ran at 2 800 MiB/s
/// against 3 950 (2 vCPUs, loopback).
const SEND_AT: usize = 64 * 1024;
/// The largest record we seal.
const MAX_SEALED: usize = wire_len(MAX_PLAINTEXT);
/// Room a record needs in the send buffer: its own and a key update's before it.
const ROOM: usize = 2 * MAX_SEALED;
/// An alert record's room, kept free at the end of the send buffer.
const ALERT_ROOM: usize = wire_len(2);
/// Slices at least this long are sealed from where they lie; shorter ones are gathered.
const SEAL_DIRECT: usize = 2048;
/// A KeyUpdate, update_not_requested (RFC 8446 §4.6.3).
const KEY_UPDATE_NOT_REQUESTED: [u8; 5] = [24, 0, 0, 1, 0];

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
}

impl PeerSession for Session {
    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        match self {
            Self::Server(s) => s.update_rx_secret(),
            Self::Client(s) => s.update_rx_secret(),
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

/// A TLS 1.3 connection over TCP, past its handshake.
pub struct TlsStream {
    tcp: TcpStream,
    session: Session,
    tx: Sealer,
    rx: Reader,
    /// Records to seal under one key before updating it (the suite's confidentiality limit, with room).
    tx_limit: u64,
    /// The peer asked for a key update (or we want one): send ours before the next record.
    key_update_due: bool,
    /// Sealed records in `outgoing[sent..filled]`, waiting for the socket.
    outgoing: Vec<u8>,
    sent: usize,
    filled: usize,
    close_notify_sent: bool,
    /// A fatal alert went either way (RFC 8446 §6.2): nothing more is sent.
    fatal: bool,
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
        Ok(Self {
            tcp,
            session,
            tx: Sealer::new(tx.0, tx.1)?,
            rx: Reader::new(rx, &plaintext, &ciphertext)?,
            // RFC 8446 §5.5: a new key well before the suite's limit (2^24.5 records for AES-GCM).
            tx_limit: limit - limit / 16,
            key_update_due: false,
            outgoing: vec![0; WRITE_BUFFER + ALERT_ROOM],
            sent: 0,
            filled: 0,
            close_notify_sent: false,
            fatal: false,
        })
    }

    /// The TCP socket underneath.
    pub fn get_ref(&self) -> &TcpStream {
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
        if let Some(alert) = error.alert() {
            self.send_fatal_alert(alert);
        }
        if !matches!(error, RecordError::Truncated(_)) {
            self.fatal = true;
        }
        error.into()
    }

    fn send_fatal_alert(&mut self, alert: AlertDescription) {
        if self.fatal || self.close_notify_sent {
            return;
        }
        let at = self.filled;
        // The room past WRITE_BUFFER is kept for this record.
        match self.tx.seal_from(content::ALERT, &[2, u8::from(alert)], &mut self.outgoing[at..]) {
            Ok(len) => self.filled += len,
            Err(_) => return,
        }
        tracing::debug!(?alert, "TLS alert sent");
        while self.sent < self.filled {
            match self.tcp.try_write(&self.outgoing[self.sent..self.filled]) {
                Ok(n) if n > 0 => self.sent += n,
                _ => break,
            }
        }
    }

    /// Seals as much of `bufs` as the send buffer has room for; returns how much.
    fn seal_slices(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        // Make room by moving what is still unsent to the front, once that moves at most
        // as much as it frees.
        if SMALL_WRITES.saturating_sub(self.filled) < ROOM
            && self.sent >= (self.filled - self.sent).max(SMALL_WRITES / 2)
        {
            self.outgoing.copy_within(self.sent..self.filled, 0);
            (self.filled, self.sent) = (self.filled - self.sent, 0);
        }
        let mut taken = 0;
        // Short slices gathered for one record, at `outgoing[filled + HEADER..]`.
        let mut gathered = 0;
        'slices: for slice in bufs {
            let (end, send_at) =
                if slice.len() >= LARGE_SLICE { (WRITE_BUFFER, WRITE_BUFFER) } else { (SMALL_WRITES, SEND_AT) };
            let mut piece: &[u8] = slice;
            while !piece.is_empty() {
                if end.saturating_sub(self.filled) < ROOM || self.filled - self.sent >= send_at {
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
    /// RFC 8446 §4.6.3: a requested update is answered before our next application data,
    /// once however many requests came; §5.5: a new key before AES-GCM's record limit.
    fn before_record(&mut self) -> io::Result<()> {
        self.key_update_due |= self.rx.take_key_update_due();
        if !self.key_update_due && self.tx.sequence() < self.tx_limit {
            return Ok(());
        }
        let message = KEY_UPDATE_NOT_REQUESTED;
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
        loop {
            match this.rx.read(&mut this.session, buf) {
                Ok(false) => return Poll::Ready(Ok(())),
                Ok(true) => {}
                Err(error) => return Poll::Ready(Err(this.fail(error))),
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
        if this.close_notify_sent || this.fatal {
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
        // RFC 8446 §6.1: close_notify before closing our side, unless a fatal alert went.
        if !this.close_notify_sent && !this.fatal {
            if WRITE_BUFFER - this.filled < ALERT_ROOM {
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
mod tests;
