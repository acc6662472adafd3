//! The send side of a TLS 1.3 connection past its handshake, without I/O: application
//! data in, sealed records out (RFC 8446 §5), our key updates and alerts on the way.
//!
//! Owns the send buffer, our traffic key ([`Sealer`]), when that key changes (the peer
//! asked, or AES-GCM's record limit is near: the one place a key update is due), and
//! whether anything more may go out (nothing after close_notify, after a fatal alert's
//! record, or at all once a write failed). The caller seals ([`Writer::seal`]), writes
//! [`Writer::pending`] to its socket and says how much went ([`Writer::sent`]).
//!
//! How bytes are laid out: the caller's slices are encrypted straight into one send
//! buffer, up to 16 KiB a record (small slices are gathered there first and sealed in
//! place), and are offered to the socket 64 KiB sealed at a time (the peer opens one while
//! we seal the next), or per large slice (a large URB's data, sealed whole into the 1 MiB
//! buffer). Sealed bytes are never sealed again nor dropped unless the connection ends.
//!
//! Not for sockets (`tls_stream`), nor the receive side (`record_reader`), nor for
//! deriving keys (rustls's `KernelConnection`, behind [`PeerSession`]).

use std::io::IoSlice;

use rustls::{AlertDescription, ConnectionTrafficSecrets};

use crate::record::{self, content, wire_len, PeerSession, RecordError, Sealer, MAX_PLAINTEXT};

/// Sealed bytes waiting for the socket, at most (records of data; an alert has room of its
/// own after them): a 1 MiB URB's data is sealed whole and goes to the socket in one piece
/// (fewer, larger socket writes).
const WRITE_BUFFER: usize = 1024 * 1024;
/// The part of the send buffer slices shorter than [`LARGE_SLICE`] fill (they are offered
/// to the socket [`SEND_AT`] at a time), so the buffer's hot part stays in cache.
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
/// An alert record's room (close_notify or a fatal alert), kept free at the end of the
/// send buffer: the last record we send always fits.
const ALERT_ROOM: usize = wire_len(2);
/// Slices at least this long are sealed from where they lie; shorter ones are gathered.
const SEAL_DIRECT: usize = 2048;
/// A KeyUpdate, update_not_requested (RFC 8446 §4.6.3).
const KEY_UPDATE_NOT_REQUESTED: [u8; 5] = [24, 0, 0, 1, 0];

/// Whether more may be sealed, and what may still go out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Open,
    /// close_notify is sealed (RFC 8446 §6.1): what is pending still goes out, nothing after.
    Closed,
    /// A fatal alert went either way (RFC 8446 §6.2; ours is sealed): likewise.
    Ended,
    /// A write failed or a record could not be sealed: nothing more goes out, not even what
    /// was sealed before (the caller was told the write failed, and a sealed KeyUpdate
    /// whose key we could not switch to would put the peer out of step).
    Failed,
}

/// The send side: see the module docs.
pub struct Writer {
    tx: Sealer,
    /// Records to seal under one key before updating it (the suite's confidentiality
    /// limit, with room).
    rekey_at: u64,
    /// A KeyUpdate of ours goes before the next record of data.
    key_update_due: bool,
    /// Sealed records in `outgoing[sent..filled]`, waiting for the socket.
    outgoing: Vec<u8>,
    sent: usize,
    filled: usize,
    state: State,
}

impl Writer {
    /// A writer with our key `tx`, rekeying well before `confidentiality_limit` records
    /// (the suite's: 2^24.5 for AES-GCM, RFC 8446 §5.5).
    pub fn new(tx: (u64, ConnectionTrafficSecrets), confidentiality_limit: u64) -> Result<Self, RecordError> {
        Ok(Self {
            tx: Sealer::new(tx.0, tx.1)?,
            rekey_at: confidentiality_limit - confidentiality_limit / 16,
            key_update_due: false,
            outgoing: vec![0; WRITE_BUFFER + ALERT_ROOM],
            sent: 0,
            filled: 0,
            state: State::Open,
        })
    }

    /// Seals as much of `bufs` as the send buffer has room for and returns how much: 0
    /// when it is full (write out [`Writer::pending`] first). A KeyUpdate of ours goes
    /// first when one is due, with the next key from `session`. An error ends the
    /// connection: nothing sealed before it goes out, and every later call fails.
    pub fn seal(&mut self, session: &mut impl PeerSession, bufs: &[IoSlice<'_>]) -> Result<usize, RecordError> {
        if self.state != State::Open {
            return Err(RecordError::Closed);
        }
        let sealed = self.seal_slices(session, bufs);
        if sealed.is_err() {
            self.fail();
        }
        sealed
    }

    /// Sealed bytes for the socket, in order (empty when all went, or after a failure).
    pub fn pending(&self) -> &[u8] {
        &self.outgoing[self.sent..self.filled]
    }

    /// The socket took the first `n` bytes of [`Writer::pending`].
    pub fn sent(&mut self, n: usize) {
        debug_assert!(n <= self.filled - self.sent, "more sent than was pending");
        self.sent = (self.sent + n).min(self.filled);
        if self.sent == self.filled {
            (self.sent, self.filled) = (0, 0);
        }
    }

    /// Seals close_notify (RFC 8446 §6.1): what is pending and it still go out, nothing
    /// after. Nothing to do if a close_notify or a fatal alert is sealed already; an error
    /// once a write failed.
    pub fn close(&mut self) -> Result<(), RecordError> {
        match self.state {
            State::Open => {}
            State::Closed | State::Ended => return Ok(()),
            State::Failed => return Err(RecordError::Closed),
        }
        self.seal_last(&[1, u8::from(AlertDescription::CloseNotify)])?;
        self.state = State::Closed;
        Ok(())
    }

    /// A fatal alert ends the connection (RFC 8446 §6.2): ours, sealed here (`Some`), or
    /// the peer's (`None`). What is pending still goes out, nothing after. Nothing to do
    /// once it is closed or failed.
    pub fn end(&mut self, alert: Option<AlertDescription>) {
        if self.state != State::Open {
            return;
        }
        if let Some(alert) = alert {
            if self.seal_last(&[2, u8::from(alert)]).is_err() {
                return;
            }
        }
        self.state = State::Ended;
    }

    /// A write failed: nothing pending goes out, and nothing more is sealed.
    pub fn fail(&mut self) {
        self.state = State::Failed;
        (self.sent, self.filled) = (0, 0);
    }

    /// Our key changes before the next record of data (the peer asked, RFC 8446 §4.6.3):
    /// one KeyUpdate however many times this is called before it.
    pub fn update_key(&mut self) {
        self.key_update_due = true;
    }

    /// Data may still be sealed (no close_notify, alert or failure yet).
    pub fn is_open(&self) -> bool {
        self.state == State::Open
    }

    /// A write failed or a record could not be sealed: the connection is over.
    pub fn has_failed(&self) -> bool {
        self.state == State::Failed
    }

    /// Records sealed under the current key so far.
    pub fn sequence(&self) -> u64 {
        self.tx.sequence()
    }

    /// Rekeys after `records` records, for tests that reach the limit quickly.
    #[cfg(test)]
    pub(crate) fn set_rekey_at(&mut self, records: u64) {
        self.rekey_at = records;
    }

    /// Seals an alert record into the room kept for it; on failure the connection is over.
    fn seal_last(&mut self, alert: &[u8; 2]) -> Result<(), RecordError> {
        match self.tx.seal_from(content::ALERT, alert, &mut self.outgoing[self.filled..]) {
            Ok(len) => {
                self.filled += len;
                Ok(())
            }
            Err(error) => {
                self.fail();
                Err(error)
            }
        }
    }

    fn seal_slices(&mut self, session: &mut impl PeerSession, bufs: &[IoSlice<'_>]) -> Result<usize, RecordError> {
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
                    self.before_record(session)?;
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
                    self.before_record(session)?;
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
    fn seal_gathered(&mut self, gathered: &mut usize) -> Result<(), RecordError> {
        if *gathered > 0 {
            let at = self.filled;
            self.filled += self.tx.seal_in_place(content::APPLICATION_DATA, *gathered, &mut self.outgoing[at..])?;
            *gathered = 0;
        }
        Ok(())
    }

    /// A KeyUpdate of ours first if the peer asked for one or the key is near its limit.
    /// RFC 8446 §4.6.3: a requested update is answered before our next application data,
    /// once however many requests came; §5.5: a new key before AES-GCM's record limit.
    fn before_record(&mut self, session: &mut impl PeerSession) -> Result<(), RecordError> {
        if !self.key_update_due && self.tx.sequence() < self.rekey_at {
            return Ok(());
        }
        let message = KEY_UPDATE_NOT_REQUESTED;
        self.filled += self.tx.seal_from(content::HANDSHAKE, &message, &mut self.outgoing[self.filled..])?;
        let (sequence, secrets) = session.update_tx()?;
        self.tx = Sealer::new(sequence, secrets)?;
        self.key_update_due = false;
        tracing::debug!("TLS key update sent");
        Ok(())
    }
}

#[cfg(test)]
mod tests;
