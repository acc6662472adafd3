//! TLS 1.3 record protection (RFC 8446 §5.2) with the traffic keys rustls negotiated.
//!
//! Owns one direction's AEAD key, IV and sequence number: [`Sealer`] writes whole records
//! (header, plaintext gathered from the caller's buffers, content type, tag) straight into
//! a send buffer and encrypts them there; [`Opener`] decrypts a received record in place
//! and says what it holds. No allocation per record and one pass over the plaintext
//! besides the cipher's. Not for the handshake (rustls runs it, see `handshake`), nor for
//! sockets (`tls_stream`).

use std::ops::Range;

use aws_lc_rs::aead;
use rustls::ConnectionTrafficSecrets;

/// Bytes of a record header: content type, legacy version, length.
pub(crate) const HEADER: usize = 5;
/// Bytes of an AEAD tag (AES-GCM and ChaCha20-Poly1305 alike).
pub(crate) const TAG: usize = 16;
/// Plaintext bytes per record at most (2^14, TLS's limit).
pub const MAX_PLAINTEXT: usize = 16 * 1024;
/// The largest record body a peer may send: 2^14 + 256 (RFC 8446 §5.2).
const MAX_BODY: usize = MAX_PLAINTEXT + 256;
/// The largest whole record a peer may send.
pub(crate) const MAX_RECORD: usize = HEADER + MAX_BODY;
/// What a protected record's outer header says (TLS 1.3 hides the real type inside).
const OUTER_TYPE: u8 = 23;

/// The content types a TLS 1.3 record carries inside its protection.
pub mod content {
    pub const ALERT: u8 = 21;
    pub const HANDSHAKE: u8 = 22;
    pub const APPLICATION_DATA: u8 = 23;
}

/// Why a record could not be sealed or opened, or why the peer's records end the
/// connection. Each ends the connection; [`RecordError::alert`] says what we tell the peer.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RecordError {
    #[error("the TLS peer negotiated a cipher suite this record layer does not implement (AES-GCM and ChaCha20-Poly1305 only)")]
    UnsupportedSuite,
    #[error("a TLS record failed authentication: the connection was altered in transit; reconnect")]
    Authentication,
    #[error("the TLS peer sent a record over the size limit ({0}); reconnect, and report it if it persists")]
    Overflow(&'static str),
    #[error("the TLS peer sent an unexpected message ({0}); reconnect, and report it if it persists")]
    Unexpected(&'static str),
    #[error("the TLS peer sent a malformed record ({0}); reconnect, and report it if it persists")]
    Malformed(&'static str),
    #[error("the TLS peer sent an illegal value ({0}); reconnect, and report it if it persists")]
    IllegalParameter(&'static str),
    #[error("the TLS session refused a post-handshake message: {0}")]
    Session(rustls::Error),
    #[error("the TLS peer ended the connection with the alert {0:?}")]
    AlertReceived(rustls::AlertDescription),
    #[error("{0}")]
    Truncated(&'static str),
    #[error("the TLS record sequence is exhausted; reconnect")]
    Exhausted,
    #[error("the cipher refused to seal a TLS record; reconnect")]
    Seal,
    /// rustls handed over an AES-GCM sending key it had already sealed records under.
    #[error(
        "the TLS handshake handed over a sending key already used for {0} records; the record layer takes \
         AES-GCM keys fresh (a server must send no session tickets)"
    )]
    KeyInUse(u64),
    /// A write after close_notify, after a fatal alert, or after a write that failed.
    #[error("the TLS connection is closed for writing")]
    Closed,
}

impl RecordError {
    /// The fatal alert we send the peer before closing, if any (RFC 8446 §6.2: none after
    /// the peer's own alert, nor after a bare hang-up).
    pub fn alert(&self) -> Option<rustls::AlertDescription> {
        use rustls::AlertDescription as A;
        match self {
            // RFC 8446 §5.2: an AEAD failure is bad_record_mac.
            Self::Authentication => Some(A::BadRecordMac),
            // RFC 8446 §5.2, §5.4: over 2^14 + 256 bytes of ciphertext, or 2^14 + 1 of inner plaintext.
            Self::Overflow(_) => Some(A::RecordOverflow),
            Self::Unexpected(_) => Some(A::UnexpectedMessage),
            Self::Malformed(_) => Some(A::DecodeError),
            Self::IllegalParameter(_) => Some(A::IllegalParameter),
            Self::Session(rustls::Error::InvalidMessage(_)) => Some(A::DecodeError),
            Self::Session(_) | Self::Exhausted => Some(A::InternalError),
            Self::UnsupportedSuite
            | Self::KeyInUse(_)
            | Self::AlertReceived(_)
            | Self::Truncated(_)
            | Self::Seal
            | Self::Closed => None,
        }
    }
}

impl From<RecordError> for std::io::Error {
    fn from(error: RecordError) -> Self {
        match error {
            // As rustls reported it, so callers that look for the peer's alert still find it.
            RecordError::AlertReceived(alert) => {
                Self::new(std::io::ErrorKind::InvalidData, rustls::Error::AlertReceived(alert))
            }
            RecordError::Truncated(_) => Self::new(std::io::ErrorKind::UnexpectedEof, error),
            RecordError::Closed => Self::new(std::io::ErrorKind::BrokenPipe, error),
            _ => Self::new(std::io::ErrorKind::InvalidData, error),
        }
    }
}

/// What the record layer asks of whoever keeps the handshake's secrets (rustls's
/// `KernelConnection`; a stand-in with fixed keys in tests and the fuzz harness).
pub trait PeerSession {
    /// The peer's next traffic secret after its KeyUpdate, and the sequence number to
    /// start from (0, RFC 8446 §5.3).
    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError>;
    /// Our next traffic secret, once our KeyUpdate is sealed, and the sequence number to
    /// start from (0).
    fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError>;
    /// A NewSessionTicket's body (without its 4-byte header). Servers refuse it.
    fn new_session_ticket(&mut self, body: &[u8]) -> Result<(), RecordError>;
}

/// A traffic secret's AEAD algorithm, key and IV.
fn parts(secrets: &ConnectionTrafficSecrets) -> Result<(&'static aead::Algorithm, &[u8], Nonces), RecordError> {
    let (algorithm, key, iv) = match secrets {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
        ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
        ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&aead::CHACHA20_POLY1305, key, iv),
        _ => return Err(RecordError::UnsupportedSuite),
    };
    let iv: [u8; aead::NONCE_LEN] = iv.as_ref().try_into().map_err(|_| RecordError::UnsupportedSuite)?;
    Ok((algorithm, key.as_ref(), Nonces { iv, sequence: 0 }))
}

/// One direction's IV and next sequence number.
struct Nonces {
    iv: [u8; aead::NONCE_LEN],
    sequence: u64,
}

impl Nonces {
    /// The per-record nonce: the IV XOR the sequence number left-padded to the IV's length
    /// (RFC 8446 §5.3), then the sequence moves on. It never wraps: the record that would
    /// take sequence number 2^64 - 1 is refused, which ends the connection (§5.3).
    fn next(&mut self) -> Result<aead::Nonce, RecordError> {
        let mut nonce = self.iv;
        for (byte, seq) in nonce[aead::NONCE_LEN - 8..].iter_mut().zip(self.sequence.to_be_bytes()) {
            *byte ^= seq;
        }
        self.sequence = self.sequence.checked_add(1).ok_or(RecordError::Exhausted)?;
        Ok(aead::Nonce::assume_unique_for_key(nonce))
    }
}

/// Our sending key.
enum SealingKey {
    /// AES-GCM: aws-lc's TLS 1.3 record key, which refuses a nonce that does not move
    /// forward (its first must be sequence 0), so a repeated nonce fails in the library
    /// even if our counting were wrong.
    Gcm(aead::TlsRecordSealingKey),
    /// ChaCha20-Poly1305, which that key type does not take: our counting alone.
    ChaCha(aead::LessSafeKey),
}

/// Protects records we send.
pub struct Sealer {
    key: SealingKey,
    nonces: Nonces,
}

impl Sealer {
    /// Our key from `secrets`, the next record to be sealed under it being number
    /// `sequence`. An AES-GCM key must be fresh (`sequence` 0: our servers send no session
    /// tickets, and a key update starts at 0), since the library counts from its first use.
    pub fn new(sequence: u64, secrets: ConnectionTrafficSecrets) -> Result<Self, RecordError> {
        let (algorithm, key, mut nonces) = parts(&secrets)?;
        nonces.sequence = sequence;
        let key = if algorithm == &aead::CHACHA20_POLY1305 {
            let key = aead::UnboundKey::new(algorithm, key).map_err(|_| RecordError::UnsupportedSuite)?;
            SealingKey::ChaCha(aead::LessSafeKey::new(key))
        } else if sequence != 0 {
            return Err(RecordError::KeyInUse(sequence));
        } else {
            let key = aead::TlsRecordSealingKey::new(algorithm, aead::TlsProtocolId::TLS13, key)
                .map_err(|_| RecordError::UnsupportedSuite)?;
            SealingKey::Gcm(key)
        };
        Ok(Self { key, nonces })
    }

    /// Records sealed under this key so far (counting from where rustls left off).
    pub(crate) fn sequence(&self) -> u64 {
        self.nonces.sequence
    }

    /// The nonce of the next record we seal.
    fn next_nonce(&mut self) -> Result<aead::Nonce, RecordError> {
        #[cfg(test)]
        testing::record_sealed(self.nonces.iv, self.nonces.sequence);
        self.nonces.next()
    }

    /// Seals `plaintext` (at most [`MAX_PLAINTEXT`] bytes) as one record of type `kind`
    /// at the front of `out` (at least [`wire_len`] bytes), encrypting it out of place: the
    /// plaintext is read once, by the cipher. Returns the record's length.
    pub fn seal_from(&mut self, kind: u8, plaintext: &[u8], out: &mut [u8]) -> Result<usize, RecordError> {
        let len = wire_len(plaintext.len());
        let header = header(len)?;
        let (head, rest) = out.get_mut(..len).ok_or(RecordError::Seal)?.split_at_mut(HEADER);
        head.copy_from_slice(&header);
        let (ciphertext, type_and_tag) = rest.split_at_mut(plaintext.len());
        let nonce = self.next_nonce()?;
        let aad = aead::Aad::from(header);
        let sealed = match &mut self.key {
            SealingKey::Gcm(key) => {
                key.seal_out_of_place_scatter(nonce, aad, plaintext, ciphertext, &[kind], type_and_tag)
            }
            SealingKey::ChaCha(key) => {
                key.seal_out_of_place_scatter(nonce, aad, plaintext, ciphertext, &[kind], type_and_tag)
            }
        };
        sealed.map_err(|_| RecordError::Seal)?;
        Ok(len)
    }

    /// Seals the `len` plaintext bytes that lie at `out[HEADER..HEADER + len]` as one
    /// record of type `kind`, in place. Returns the record's length.
    pub(crate) fn seal_in_place(&mut self, kind: u8, len: usize, out: &mut [u8]) -> Result<usize, RecordError> {
        debug_assert!(len <= MAX_PLAINTEXT);
        let total = wire_len(len);
        let header = header(total)?;
        let record = out.get_mut(..total).ok_or(RecordError::Seal)?;
        record[..HEADER].copy_from_slice(&header);
        record[HEADER + len] = kind;
        let (inner, tag) = record[HEADER..].split_at_mut(len + 1);
        let nonce = self.next_nonce()?;
        let aad = aead::Aad::from(header);
        let sealed = match &mut self.key {
            SealingKey::Gcm(key) => key.seal_in_place_separate_tag(nonce, aad, inner),
            SealingKey::ChaCha(key) => key.seal_in_place_separate_tag(nonce, aad, inner),
        };
        tag.copy_from_slice(sealed.map_err(|_| RecordError::Seal)?.as_ref());
        Ok(total)
    }

    /// Moves the sequence number back, as a counting bug would: the next seal repeats a nonce.
    #[cfg(test)]
    fn rewind(&mut self, records: u64) {
        self.nonces.sequence -= records;
    }
}

/// Every (key, sequence number) this thread sealed a record under since it last took
/// them, for tests that check none repeats. A key is known by its IV, which is derived
/// from the same traffic secret.
#[cfg(test)]
pub(crate) mod testing {
    use std::cell::RefCell;

    use aws_lc_rs::aead::NONCE_LEN;

    thread_local! {
        static SEALED: RefCell<Vec<([u8; NONCE_LEN], u64)>> = const { RefCell::new(Vec::new()) };
    }

    pub(crate) fn record_sealed(iv: [u8; NONCE_LEN], sequence: u64) {
        SEALED.with(|sealed| sealed.borrow_mut().push((iv, sequence)));
    }

    /// What was sealed since the last call, in order.
    pub(crate) fn take_sealed() -> Vec<([u8; NONCE_LEN], u64)> {
        SEALED.with(|sealed| std::mem::take(&mut *sealed.borrow_mut()))
    }
}

/// The bytes on the wire of a record holding `plaintext` bytes.
pub const fn wire_len(plaintext: usize) -> usize {
    HEADER + plaintext + 1 + TAG
}

/// The outer header of a protected record `total` bytes long (header included).
fn header(total: usize) -> Result<[u8; HEADER], RecordError> {
    let [high, low] = u16::try_from(total - HEADER).map_err(|_| RecordError::Seal)?.to_be_bytes();
    Ok([OUTER_TYPE, 3, 3, high, low])
}

/// Opens records we receive.
pub(crate) struct Opener {
    key: aead::LessSafeKey,
    nonces: Nonces,
}

impl Opener {
    pub(crate) fn new(sequence: u64, secrets: ConnectionTrafficSecrets) -> Result<Self, RecordError> {
        let (algorithm, key, mut nonces) = parts(&secrets)?;
        nonces.sequence = sequence;
        let key = aead::UnboundKey::new(algorithm, key).map_err(|_| RecordError::UnsupportedSuite)?;
        Ok(Self { key: aead::LessSafeKey::new(key), nonces })
    }

    /// Decrypts the record `record` (a whole one, see [`record_len`]) in place. Returns its
    /// content type and where its plaintext lies in `record`.
    pub(crate) fn open(&mut self, record: &mut [u8]) -> Result<(u8, Range<usize>), RecordError> {
        let (header, body) = record.split_at_mut(HEADER);
        let header: [u8; HEADER] = [header[0], header[1], header[2], header[3], header[4]];
        let nonce = self.nonces.next()?;
        // RFC 8446 §5.2: a record that fails authentication is bad_record_mac.
        let inner =
            self.key.open_in_place(nonce, aead::Aad::from(header), body).map_err(|_| RecordError::Authentication)?;
        let (kind, len) = unpad(inner)?;
        Ok((kind, HEADER..HEADER + len))
    }

    /// Decrypts the record `record` (a whole one) into `out`, which must hold at least
    /// [`plaintext_room`] bytes, leaving `record` as it was. Returns its content type and
    /// the length of its plaintext at the front of `out`.
    pub(crate) fn open_into(&mut self, record: &[u8], out: &mut [u8]) -> Result<(u8, usize), RecordError> {
        let header = record.get(..HEADER).ok_or(RecordError::Authentication)?;
        let body = &record[HEADER..];
        let (ciphertext, tag) = body.split_at(body.len().checked_sub(TAG).ok_or(RecordError::Authentication)?);
        let inner = out.get_mut(..ciphertext.len()).ok_or(RecordError::Malformed("no room"))?;
        let nonce = self.nonces.next()?;
        if self.key.open_separate_gather(nonce, aead::Aad::from(header), ciphertext, tag, inner).is_err() {
            // Leave no unauthenticated plaintext in the caller's buffer.
            inner.fill(0);
            return Err(RecordError::Authentication);
        }
        unpad(inner)
    }
}

/// The content type and content length of a decrypted TLSInnerPlaintext: content, type,
/// then zeros (RFC 8446 §5.4).
fn unpad(inner: &[u8]) -> Result<(u8, usize), RecordError> {
    // RFC 8446 §5.4: the inner plaintext, padding included, is at most 2^14 + 1 bytes;
    // past that is record_overflow (§5.2).
    if inner.len() > MAX_PLAINTEXT + 1 {
        return Err(RecordError::Overflow("inner plaintext over 2^14 + 1 bytes"));
    }
    // RFC 8446 §5.4: the type is the last non-zero byte; none at all is unexpected_message.
    let end = inner.iter().rposition(|&b| b != 0).ok_or(RecordError::Unexpected("a record of padding only"))?;
    Ok((inner[end], end))
}

/// The room [`Opener::open_into`] needs for a record `len` bytes long (header included).
pub(crate) const fn plaintext_room(len: usize) -> usize {
    len - HEADER - TAG
}

/// The length of the whole record at the start of `buf`, once its header is there;
/// `Ok(None)` until then.
pub(crate) fn record_len(buf: &[u8]) -> Result<Option<usize>, RecordError> {
    // A header that cannot become a record fails as soon as its first bytes are here, as
    // rustls's does: a content type no TLS version defines, a version other than 3.x.
    if buf.first().is_some_and(|kind| !(20..=24).contains(kind)) {
        return Err(RecordError::Unexpected("a record of an unknown content type"));
    }
    if buf.get(1).is_some_and(|&major| major != 3) {
        return Err(RecordError::Malformed("not a TLS record"));
    }
    let [kind, major, _, high, low, ..] = *buf else { return Ok(None) };
    // RFC 8446 §5: after the handshake every record is protected (outer type
    // application_data); anything else, a change_cipher_spec included (§5), is
    // unexpected_message.
    if kind != OUTER_TYPE {
        return Err(RecordError::Unexpected("a record that is not protected"));
    }
    if major != 3 {
        return Err(RecordError::Malformed("not a TLS record"));
    }
    let body = usize::from(u16::from_be_bytes([high, low]));
    // RFC 8446 §5.2: at most 2^14 + 256 bytes of ciphertext, else record_overflow.
    if body > MAX_BODY {
        return Err(RecordError::Overflow("ciphertext over 2^14 + 256 bytes"));
    }
    // Shorter than a tag: it cannot authenticate (RFC 8446 §5.2, bad_record_mac).
    if body < TAG {
        return Err(RecordError::Authentication);
    }
    Ok(Some(HEADER + body))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As rustls's: a header fails as soon as its first bytes show it cannot be a record.
    #[test]
    fn a_header_that_cannot_become_a_record_fails_at_its_first_bytes() {
        assert!(matches!(record_len(&[0x00]), Err(RecordError::Unexpected(_))), "no content type 0");
        assert!(matches!(record_len(&[0x17]), Ok(None)));
        assert!(matches!(record_len(&[0x17, 0x02]), Err(RecordError::Malformed(_))), "not TLS 3.x");
        assert!(matches!(record_len(&[0x15, 0x03, 0x03]), Ok(None)), "a known type waits for its header");
        assert!(matches!(record_len(&[0x15, 0x03, 0x03, 0, 20]), Err(RecordError::Unexpected(_))), "unprotected");
    }
    use rustls::crypto::cipher::{AeadKey, Iv};

    fn secrets(byte: u8) -> ConnectionTrafficSecrets {
        ConnectionTrafficSecrets::Aes256Gcm { key: AeadKey::from([byte; 32]), iv: Iv::new([byte; 12]) }
    }

    fn chacha(byte: u8) -> ConnectionTrafficSecrets {
        ConnectionTrafficSecrets::Chacha20Poly1305 { key: AeadKey::from([byte; 32]), iv: Iv::new([byte; 12]) }
    }

    /// Sealed out of place, or (`in_place`) from a copy in the record's own buffer.
    fn sealed(sealer: &mut Sealer, plaintext: &[u8], in_place: bool) -> Vec<u8> {
        let mut out = vec![0; wire_len(plaintext.len())];
        let len = if in_place {
            out[HEADER..HEADER + plaintext.len()].copy_from_slice(plaintext);
            sealer.seal_in_place(content::APPLICATION_DATA, plaintext.len(), &mut out).unwrap()
        } else {
            sealer.seal_from(content::APPLICATION_DATA, plaintext, &mut out).unwrap()
        };
        assert_eq!(len, out.len());
        out
    }

    #[test]
    fn a_sealed_record_opens_to_its_plaintext_in_sequence() {
        // AES-GCM keys start fresh; a ChaCha20 key may be handed over mid-sequence.
        for (start, secrets) in [(0, secrets as fn(u8) -> ConnectionTrafficSecrets), (7, chacha)] {
            let (mut sealer, mut opener) =
                (Sealer::new(start, secrets(1)).unwrap(), Opener::new(start, secrets(1)).unwrap());
            for (i, plaintext) in [&b"hello"[..], &[0u8; 0], &[0xa5; MAX_PLAINTEXT], b"four"].into_iter().enumerate() {
                let mut record = sealed(&mut sealer, plaintext, i % 2 == 1);
                assert_eq!(record_len(&record).unwrap(), Some(record.len()));
                assert_eq!(record.len(), HEADER + plaintext.len() + 1 + TAG);
                if i < 2 {
                    let (kind, range) = opener.open(&mut record).unwrap();
                    assert_eq!(kind, content::APPLICATION_DATA);
                    assert_eq!(&record[range], plaintext);
                } else {
                    let mut out = vec![0xff; plaintext_room(record.len())];
                    let (kind, len) = opener.open_into(&record, &mut out).unwrap();
                    assert_eq!((kind, &out[..len]), (content::APPLICATION_DATA, plaintext));
                }
            }
            assert_eq!(sealer.sequence(), start + 4);
        }
    }

    #[test]
    fn an_aes_gcm_key_already_used_is_refused_at_the_hand_over() {
        assert!(matches!(Sealer::new(2, secrets(1)), Err(RecordError::KeyInUse(2))));
        let error = RecordError::KeyInUse(2).to_string();
        assert!(error.contains("2 records") && error.contains("session tickets"), "{error}");
    }

    /// Item 6 of the TLS proof: were our counting ever wrong, the library itself refuses
    /// to seal an AES-GCM record under a nonce that does not move forward.
    #[test]
    fn the_cipher_refuses_a_repeated_or_decreasing_aes_gcm_nonce() {
        for in_place in [false, true] {
            let mut sealer = Sealer::new(0, secrets(1)).unwrap();
            for _ in 0..3 {
                sealed(&mut sealer, b"record", in_place);
            }
            sealer.rewind(1);
            let mut out = vec![0; wire_len(6)];
            out[HEADER..HEADER + 6].copy_from_slice(b"record");
            let repeated = if in_place {
                sealer.seal_in_place(content::APPLICATION_DATA, 6, &mut out)
            } else {
                sealer.seal_from(content::APPLICATION_DATA, b"record", &mut out)
            };
            assert!(matches!(repeated, Err(RecordError::Seal)), "sequence 2 again");
            // The refused record took sequence 2; 1 is behind the library's count too.
            sealer.rewind(2);
            assert!(matches!(sealer.seal_from(content::APPLICATION_DATA, b"x", &mut out), Err(RecordError::Seal)));
        }
        // ChaCha20 has no such guard in the library: our count is all (tested by the schedules).
        let mut sealer = Sealer::new(0, chacha(1)).unwrap();
        let mut out = vec![0; wire_len(1)];
        sealer.seal_from(content::APPLICATION_DATA, b"x", &mut out).unwrap();
        sealer.rewind(1);
        assert!(sealer.seal_from(content::APPLICATION_DATA, b"x", &mut out).is_ok());
    }

    #[test]
    fn tampering_a_wrong_key_or_a_skipped_record_fail_authentication() {
        let mut sealer = Sealer::new(0, secrets(1)).unwrap();
        let mut record = sealed(&mut sealer, b"payload", false);
        record[HEADER + 2] ^= 1;
        let mut out = [0; 64];
        assert!(matches!(
            Opener::new(0, secrets(1)).unwrap().open_into(&record, &mut out),
            Err(RecordError::Authentication)
        ));
        assert!(matches!(Opener::new(0, secrets(1)).unwrap().open(&mut record), Err(RecordError::Authentication)));
        let mut record = sealed(&mut sealer, b"payload", true);
        assert!(matches!(Opener::new(1, secrets(2)).unwrap().open(&mut record), Err(RecordError::Authentication)));
        assert!(matches!(Opener::new(0, secrets(1)).unwrap().open(&mut record), Err(RecordError::Authentication)));
    }

    #[test]
    fn headers_are_checked_before_any_byte_is_trusted() {
        assert_eq!(record_len(&[23, 3, 3]).unwrap(), None);
        assert!(record_len(&[22, 3, 3, 0, 40]).is_err());
        assert!(record_len(&[23, 3, 3, 0, 3]).is_err());
        assert!(record_len(&[23, 3, 3, 0x41, 0x01]).is_err());
        assert_eq!(record_len(&[23, 3, 3, 0x41, 0x00]).unwrap(), Some(HEADER + MAX_BODY));
    }

    #[test]
    fn rfc8446_5_3_the_sequence_number_never_wraps() {
        let mut sealer = Sealer::new(u64::MAX - 1, chacha(1)).unwrap();
        let mut out = vec![0; wire_len(1)];
        assert!(sealer.seal_from(content::APPLICATION_DATA, b"x", &mut out).is_ok());
        assert!(matches!(sealer.seal_from(content::APPLICATION_DATA, b"x", &mut out), Err(RecordError::Exhausted)));
        let mut opener = Opener::new(u64::MAX, chacha(1)).unwrap();
        assert!(matches!(opener.open(&mut out), Err(RecordError::Exhausted)));
    }

    #[test]
    fn a_record_that_fails_authentication_leaves_no_plaintext_in_the_callers_buffer() {
        let mut sealer = Sealer::new(0, secrets(1)).unwrap();
        let mut record = sealed(&mut sealer, &[0x5a; 100], false);
        record[HEADER + 50] ^= 1;
        let mut out = vec![0xff; plaintext_room(record.len())];
        assert!(matches!(
            Opener::new(0, secrets(1)).unwrap().open_into(&record, &mut out),
            Err(RecordError::Authentication)
        ));
        assert!(out.iter().all(|&b| b == 0), "no unauthenticated byte left behind");
    }
}
