//! The receive side of a TLS 1.3 connection past its handshake, without I/O: ciphertext
//! in, application data out (RFC 8446 §5), post-handshake messages and alerts handled on
//! the way.
//!
//! Owns the receive buffer (fixed size: a peer cannot make it grow), the peer's traffic
//! key ([`Opener`]), the reassembly of post-handshake messages, and what the peer's
//! records oblige us to do (a key update of ours, which it reports for the send side to
//! owe, an end of stream). Not for sockets (`tls_stream`) nor the send side
//! (`record_writer`), nor for deriving keys or keeping tickets (rustls's
//! `KernelConnection`, behind [`PeerSession`]).

use std::ops::Range;

use rustls::{AlertDescription, ConnectionTrafficSecrets};
use tokio::io::ReadBuf;

use crate::record::{self, content, Opener, PeerSession, RecordError, MAX_RECORD};

/// Ciphertext read from the socket at once, at most.
const READ_BUFFER: usize = 256 * 1024;
/// The largest post-handshake message we reassemble, header included (rustls's limit on
/// a handshake message).
const MAX_HANDSHAKE_MESSAGE: usize = 4 + 0xffff;
/// Key updates in a row with no application data between them, at most (rustls's limit;
/// an empty application data record counts as data, as it does for rustls).
const MAX_KEY_UPDATES_IN_A_ROW: u8 = 32;
/// Empty records in a row, at most (rustls's `ALLOWED_CONSECUTIVE_EMPTY_FRAGMENTS_MAX`):
/// each costs a decryption and yields nothing, so a peer could keep us busy forever.
const MAX_EMPTY_RECORDS_IN_A_ROW: u8 = 32;
/// Warning-level alerts over the connection's life, at most (rustls's `allowed_warning_alerts`).
const MAX_WARNING_ALERTS: u8 = 4;
/// An alert's level byte: a warning, or fatal (RFC 8446 §6).
const WARNING: u8 = 1;
const FATAL: u8 = 2;
/// Handshake message types after the handshake (RFC 8446 §4).
const NEW_SESSION_TICKET: u8 = 4;
const KEY_UPDATE: u8 = 24;

/// The receive side: see the module docs.
pub struct Reader {
    rx: Opener,
    /// Received bytes: `plain` (decrypted, not yet handed out) lies before `start..end`
    /// (records not yet opened).
    incoming: Vec<u8>,
    plain: Range<usize>,
    start: usize,
    end: usize,
    /// The start of a post-handshake message whose rest is in the next records.
    handshake: Vec<u8>,
    key_updates_in_a_row: u8,
    empty_records_in_a_row: u8,
    warning_alerts: u8,
    /// The peer asked for a key update, not yet passed on to the send side.
    update_requested: bool,
    /// The peer's close_notify arrived.
    closed: bool,
    /// What ended the connection: every later call reports it again.
    failed: Option<RecordError>,
}

impl Reader {
    /// A reader with the peer's key `rx` and what arrived with the handshake: `plaintext`
    /// rustls already decrypted, then `ciphertext` it did not process.
    pub fn new(rx: (u64, ConnectionTrafficSecrets), plaintext: &[u8], ciphertext: &[u8]) -> Result<Self, RecordError> {
        let mut incoming = vec![0; READ_BUFFER + MAX_RECORD];
        let held = plaintext.len() + ciphertext.len();
        if held > incoming.len() {
            return Err(RecordError::Overflow("more than 256 KiB arrived with the TLS handshake"));
        }
        incoming[..plaintext.len()].copy_from_slice(plaintext);
        incoming[plaintext.len()..held].copy_from_slice(ciphertext);
        Ok(Self {
            rx: Opener::new(rx.0, rx.1)?,
            incoming,
            plain: 0..plaintext.len(),
            start: plaintext.len(),
            end: held,
            handshake: Vec::new(),
            key_updates_in_a_row: 0,
            empty_records_in_a_row: 0,
            warning_alerts: 0,
            update_requested: false,
            closed: false,
            failed: None,
        })
    }

    /// Where the next bytes from the socket go (never empty: moves the partial record
    /// to the front first when the tail runs short).
    pub fn space(&mut self) -> &mut [u8] {
        if self.plain.is_empty() && self.incoming.len() - self.end < MAX_RECORD {
            self.incoming.copy_within(self.start..self.end, 0);
            (self.end, self.start, self.plain) = (self.end - self.start, 0, 0..0);
        }
        &mut self.incoming[self.end..]
    }

    /// `n` bytes arrived in [`Reader::space`]; 0 is the socket's end, which without a
    /// close_notify is a truncation (RFC 8446 §6.1).
    pub fn received(&mut self, n: usize) -> Result<(), RecordError> {
        self.end = (self.end + n).min(self.incoming.len());
        if n == 0 && !self.closed {
            let error = if self.start != self.end || !self.handshake.is_empty() {
                RecordError::Truncated("the TLS peer closed mid-record")
            } else {
                RecordError::Truncated("peer closed connection without sending TLS close_notify")
            };
            self.failed.get_or_insert(error.clone());
            return Err(error);
        }
        Ok(())
    }

    /// Hands out application data into `buf`, opening whole records, until `buf` is full,
    /// the next record is not all there, or the peer closed. `Ok(true)`: nothing handed out
    /// and more bytes are needed. An error ends the connection (see [`RecordError::alert`]);
    /// data opened before it in the same call is handed out first, the error with the next.
    pub fn read(&mut self, session: &mut impl PeerSession, buf: &mut ReadBuf<'_>) -> Result<bool, RecordError> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        let before = buf.filled().len();
        match self.read_records(session, buf) {
            // What was opened before the failure is handed out first, as rustls does; the
            // failure is the next read's.
            Err(error) if buf.filled().len() > before => {
                self.failed = Some(error);
                Ok(false)
            }
            Err(error) => {
                self.failed = Some(error.clone());
                Err(error)
            }
            read => read,
        }
    }

    /// The peer asked for a key update since the last call: the send side owes one
    /// (`Writer::update_key`; answered once however many requests came, RFC 8446 §4.6.3).
    pub fn take_update_requested(&mut self) -> bool {
        std::mem::take(&mut self.update_requested)
    }

    /// The peer's close_notify arrived: the stream has ended.
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// Bytes held, for bounds checks: the receive buffer and a partial handshake message.
    pub fn held(&self) -> usize {
        self.incoming.len() + self.handshake.capacity()
    }

    fn read_records(&mut self, session: &mut impl PeerSession, buf: &mut ReadBuf<'_>) -> Result<bool, RecordError> {
        let before = buf.filled().len();
        loop {
            if !self.plain.is_empty() {
                let n = self.plain.len().min(buf.remaining());
                buf.put_slice(&self.incoming[self.plain.start..self.plain.start + n]);
                self.plain.start += n;
            }
            // RFC 8446 §6.1: whatever follows close_notify is ignored.
            if self.closed || buf.remaining() == 0 {
                return Ok(false);
            }
            let buffered = &self.incoming[self.start..self.end];
            let Some(len) = record::record_len(buffered)?.filter(|&len| len <= buffered.len()) else {
                return Ok(buf.filled().len() == before);
            };
            self.open_next(len, session, buf)?;
        }
    }

    /// Opens the next record (`len` bytes, all there): into `buf` when its plaintext fits
    /// there, else in place.
    fn open_next(
        &mut self,
        len: usize,
        session: &mut impl PeerSession,
        buf: &mut ReadBuf<'_>,
    ) -> Result<(), RecordError> {
        let at = self.start;
        let room = record::plaintext_room(len);
        let (kind, message) = if room <= buf.remaining() {
            let (kind, n) = self.rx.open_into(&self.incoming[at..at + len], buf.initialize_unfilled_to(room))?;
            self.start += len;
            self.count_empty(n)?;
            if kind == content::APPLICATION_DATA && self.handshake.is_empty() {
                buf.advance(n);
                self.key_updates_in_a_row = 0;
                return Ok(());
            }
            (kind, buf.initialize_unfilled_to(n)[..n].to_vec())
        } else {
            let (kind, range) = self.rx.open(&mut self.incoming[at..at + len])?;
            self.start += len;
            self.count_empty(range.len())?;
            let plaintext = at + range.start..at + range.end;
            if kind == content::APPLICATION_DATA && self.handshake.is_empty() {
                self.plain = plaintext;
                self.key_updates_in_a_row = 0;
                return Ok(());
            }
            (kind, self.incoming[plaintext].to_vec())
        };
        self.control(kind, &message, session)
    }

    /// Counts a record whose plaintext was `len` bytes: the 33rd empty one in a row is refused.
    fn count_empty(&mut self, len: usize) -> Result<(), RecordError> {
        if len > 0 {
            self.empty_records_in_a_row = 0;
            return Ok(());
        }
        if self.empty_records_in_a_row == MAX_EMPTY_RECORDS_IN_A_ROW {
            return Err(RecordError::Unexpected("too many empty records in a row"));
        }
        self.empty_records_in_a_row += 1;
        Ok(())
    }

    /// A record that is not application data (or application data that interrupts a
    /// handshake message).
    fn control(&mut self, kind: u8, message: &[u8], session: &mut impl PeerSession) -> Result<(), RecordError> {
        // RFC 8446 §5.1: handshake messages are not interleaved with other record types.
        if kind != content::HANDSHAKE && !self.handshake.is_empty() {
            return Err(RecordError::Unexpected("a record inside a fragmented handshake message"));
        }
        match kind {
            content::ALERT => self.alert(message),
            content::HANDSHAKE => self.handshake_record(message, session),
            // RFC 8446 §5: change_cipher_spec (protected or not, §5) and unknown types.
            _ => Err(RecordError::Unexpected("a record of an unexpected content type")),
        }
    }

    fn alert(&mut self, message: &[u8]) -> Result<(), RecordError> {
        // RFC 8446 §5.1: one alert per record, never fragmented nor coalesced.
        let &[level, description] = message else {
            return Err(RecordError::Malformed("an alert record of the wrong size"));
        };
        let description = AlertDescription::from(description);
        // RFC 8446 §6: a level other than warning or fatal is the peer's error, whatever
        // the alert (rustls refuses it too).
        if !matches!(level, WARNING | FATAL) {
            return Err(RecordError::AlertReceived(description));
        }
        // §6.1: close_notify ends the stream.
        if description == AlertDescription::CloseNotify {
            tracing::trace!("TLS close_notify received");
            self.closed = true;
            return Ok(());
        }
        // §6.1: user_canceled is a closure alert, not an error; as warning rustls lets it
        // pass (a few warnings a connection), and so do we. §6.2: any other alert is an
        // error, whatever its level.
        if level == WARNING {
            self.warning_alerts += 1;
            if self.warning_alerts > MAX_WARNING_ALERTS {
                return Err(RecordError::Unexpected("too many warning alerts"));
            }
            if description == AlertDescription::UserCanceled {
                tracing::debug!("TLS user_canceled received (a warning; the stream goes on)");
                return Ok(());
            }
        }
        Err(RecordError::AlertReceived(description))
    }

    /// Post-handshake messages, reassembled when fragmented (RFC 8446 §5.1 allows it).
    fn handshake_record(&mut self, message: &[u8], session: &mut impl PeerSession) -> Result<(), RecordError> {
        // RFC 8446 §5.1: a peer must not send zero-length handshake records; one that
        // does has its passed over as rustls does, counted among the empty records in a row.
        if message.is_empty() {
            return Ok(());
        }
        let mut joined = std::mem::take(&mut self.handshake);
        let mut rest = if joined.is_empty() {
            message
        } else {
            joined.extend_from_slice(message);
            &joined[..]
        };
        while let [kind, a, b, c, after @ ..] = rest {
            let len = u32::from_be_bytes([0, *a, *b, *c]) as usize;
            if 4 + len > MAX_HANDSHAKE_MESSAGE {
                return Err(RecordError::Malformed("a post-handshake message over 64 KiB"));
            }
            let Some((body, after)) = after.split_at_checked(len) else { break };
            self.handshake_message(*kind, body, after.is_empty(), session)?;
            rest = after;
        }
        // What remains is a message's start, at most MAX_HANDSHAKE_MESSAGE bytes (checked above).
        let rest = rest.to_vec();
        self.handshake = rest;
        Ok(())
    }

    /// One whole post-handshake message; `last` if it ends its record.
    fn handshake_message(
        &mut self,
        kind: u8,
        body: &[u8],
        last: bool,
        session: &mut impl PeerSession,
    ) -> Result<(), RecordError> {
        match kind {
            KEY_UPDATE => {
                // RFC 8446 §4.6.3: one byte, update_not_requested (0) or update_requested (1);
                // any other value is illegal_parameter.
                let &[request] = body else { return Err(RecordError::Malformed("a KeyUpdate of the wrong size")) };
                if request > 1 {
                    return Err(RecordError::IllegalParameter("a KeyUpdate's request_update"));
                }
                // RFC 8446 §5.1: a key change falls on a record boundary.
                if !last {
                    return Err(RecordError::Unexpected("data after a KeyUpdate in its record"));
                }
                self.key_updates_in_a_row += 1;
                if self.key_updates_in_a_row > MAX_KEY_UPDATES_IN_A_ROW {
                    return Err(RecordError::Unexpected("too many key updates without data between them"));
                }
                // RFC 8446 §4.6.3, §7.2: the next secret from rustls; §5.3: its sequence starts at 0.
                let (sequence, secrets) = session.update_rx()?;
                self.rx = Opener::new(sequence, secrets)?;
                self.update_requested |= request == 1;
                tracing::debug!(requested = request == 1, "TLS key update received");
                Ok(())
            }
            NEW_SESSION_TICKET => session.new_session_ticket(body),
            // RFC 8446 §4: nothing else follows the handshake here (we offer no
            // post-handshake authentication); unexpected_message.
            _ => Err(RecordError::Unexpected("an unexpected post-handshake message")),
        }
    }
}

#[cfg(test)]
mod tests;
