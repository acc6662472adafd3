//! The send side against our own receive side, without a socket: what is sealed arrives
//! whole and in order however the socket takes it, key updates the reader follows, and
//! nothing goes out after close_notify, an alert or a failure.

use std::io::IoSlice;

use rustls::crypto::cipher::{AeadKey, Iv};
use rustls::{AlertDescription, ConnectionTrafficSecrets};
use tokio::io::ReadBuf;

use super::{Writer, SEND_AT, WRITE_BUFFER};
use crate::record::{wire_len, PeerSession, RecordError, MAX_PLAINTEXT};
use crate::record_reader::Reader;

fn secrets(generation: u8) -> ConnectionTrafficSecrets {
    ConnectionTrafficSecrets::Aes256Gcm { key: AeadKey::from([generation; 32]), iv: Iv::new([generation; 12]) }
}

/// Both ends' secrets: key generation `n` either way is `secrets(n)`; `refuse_tx` makes
/// our next key unavailable.
#[derive(Default)]
struct Keys {
    tx: u8,
    rx: u8,
    refuse_tx: bool,
}

impl PeerSession for Keys {
    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        self.rx += 1;
        Ok((0, secrets(self.rx)))
    }

    fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        if self.refuse_tx {
            return Err(RecordError::Session(rustls::Error::General("no next secret".into())));
        }
        self.tx += 1;
        Ok((0, secrets(self.tx)))
    }

    fn new_session_ticket(&mut self, _: &[u8]) -> Result<(), RecordError> {
        Err(RecordError::Unexpected("no tickets here"))
    }
}

/// A writer at sequence 0 of key generation 0, with a reader of what it seals.
fn pair() -> (Writer, Keys, Reader, Keys) {
    let writer = Writer::new((0, secrets(0)), 1 << 24).unwrap();
    let reader = Reader::new((0, secrets(0)), &[], &[]).unwrap();
    (writer, Keys::default(), reader, Keys::default())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Moves what `writer` has pending to `reader`, `chunk` bytes a socket write (0: none,
/// only what the reader holds already), and returns the data the reader hands out, up
/// to the end of what it was given or its close_notify, or the error it ends with.
fn deliver(writer: &mut Writer, reader: &mut Reader, keys: &mut Keys, chunk: usize) -> Result<Vec<u8>, RecordError> {
    let mut data = Vec::new();
    let mut out = vec![0; 100_000];
    loop {
        let mut buf = ReadBuf::new(&mut out);
        if !reader.read(keys, &mut buf)? {
            if buf.filled().is_empty() {
                return Ok(data);
            }
            data.extend_from_slice(buf.filled());
            continue;
        }
        if chunk == 0 || writer.pending().is_empty() {
            return Ok(data);
        }
        let space = reader.space();
        let n = space.len().min(writer.pending().len()).min(chunk);
        space[..n].copy_from_slice(&writer.pending()[..n]);
        writer.sent(n);
        reader.received(n)?;
    }
}

/// Seals all of `parts` (a write at a time, as `write_all_parts` does), writing out what
/// is pending whenever the writer is full; returns the data `reader` handed out.
fn write_all(writer: &mut Writer, keys: &mut Keys, parts: &[Vec<u8>], reader: &mut Reader, rx: &mut Keys) -> Vec<u8> {
    let mut got = Vec::new();
    let mut at = 0;
    let total: usize = parts.iter().map(Vec::len).sum();
    while at < total {
        let slices: Vec<IoSlice<'_>> = remaining(parts, at).into_iter().map(IoSlice::new).collect();
        let taken = writer.seal(keys, &slices).unwrap();
        if taken == 0 {
            got.extend(deliver(writer, reader, rx, 7000).unwrap());
        }
        at += taken;
    }
    got.extend(deliver(writer, reader, rx, usize::MAX).unwrap());
    got
}

/// The parts from byte `at` of their concatenation on.
fn remaining(parts: &[Vec<u8>], mut at: usize) -> Vec<&[u8]> {
    let mut rest = Vec::new();
    for part in parts {
        if at >= part.len() {
            at -= part.len();
            continue;
        }
        rest.push(&part[at..]);
        at = 0;
    }
    rest
}

#[test]
fn slices_of_every_size_arrive_whole_and_in_order() {
    let (mut writer, mut keys, mut reader, mut rx) = pair();
    let parts: Vec<Vec<u8>> = [48, 3 << 20, 0, 16385, 7, 2047, 2048, 300_000, 1, 64 << 10, 5]
        .into_iter()
        .enumerate()
        .map(|(i, len)| pattern(len, i as u8))
        .collect();
    let got = write_all(&mut writer, &mut keys, &parts, &mut reader, &mut rx);
    assert!(got == parts.concat(), "every byte arrived, in order");
    assert_eq!((keys.tx, rx.rx), (0, 0), "no key update was due");
}

#[test]
fn a_write_stops_at_about_64_kib_sealed_and_a_full_buffer_takes_nothing() {
    let (mut writer, mut keys, ..) = pair();
    let parts: Vec<Vec<u8>> = (0..8u8).map(|i| pattern(if i % 2 == 0 { 48 } else { 64 << 10 }, i)).collect();
    let slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
    assert_eq!(writer.seal(&mut keys, &slices).unwrap(), 48 + (64 << 10), "one reply's worth");
    assert!(writer.pending().len() >= SEND_AT);
    assert_eq!(writer.seal(&mut keys, &slices[2..]).unwrap(), 0, "nothing more until it is written");
    let large = pattern(3 << 20, 9);
    writer.sent(writer.pending().len());
    let taken = writer.seal(&mut keys, &[IoSlice::new(&large)]).unwrap();
    assert!(taken > WRITE_BUFFER - 3 * wire_len(MAX_PLAINTEXT) && taken <= WRITE_BUFFER, "a large slice fills it");
    assert_eq!(writer.seal(&mut keys, &[IoSlice::new(&large[taken..])]).unwrap(), 0);
}

#[test]
fn rfc8446_4_6_3_a_requested_key_update_goes_once_before_the_next_record() {
    let (mut writer, mut keys, mut reader, mut rx) = pair();
    let first = [pattern(100, 1)];
    assert_eq!(write_all(&mut writer, &mut keys, &first, &mut reader, &mut rx), first[0]);
    writer.update_key();
    writer.update_key();
    let parts = [pattern(100, 2), pattern(40_000, 3)];
    assert_eq!(write_all(&mut writer, &mut keys, &parts, &mut reader, &mut rx), parts.concat());
    assert_eq!((keys.tx, rx.rx), (1, 1), "one key update, and the reader followed it");
    assert_eq!(writer.sequence(), 4, "four records under the new key");
}

#[test]
fn rfc8446_5_5_the_key_changes_before_its_record_limit_and_the_reader_follows() {
    let (_, mut keys, mut reader, mut rx) = pair();
    // A limit of 16 records: a new key after 15.
    let mut writer = Writer::new((0, secrets(0)), 16).unwrap();
    let parts = [pattern(100 * MAX_PLAINTEXT + 5, 4)];
    assert!(write_all(&mut writer, &mut keys, &parts, &mut reader, &mut rx) == parts[0]);
    assert_eq!((keys.tx, rx.rx), (6, 6), "101 records, 15 a key");
    assert_eq!(writer.sequence(), 11, "101 records and 6 key updates: 11 under the last key");
}

#[test]
fn close_notify_is_the_last_record_and_nothing_is_sealed_after_it() {
    let (mut writer, mut keys, mut reader, mut rx) = pair();
    writer.seal(&mut keys, &[IoSlice::new(b"last words")]).unwrap();
    writer.close().unwrap();
    let sealed = writer.pending().len();
    assert!(matches!(writer.seal(&mut keys, &[IoSlice::new(b"more")]), Err(RecordError::Closed)));
    writer.close().unwrap();
    writer.end(Some(AlertDescription::InternalError));
    assert_eq!(writer.pending().len(), sealed, "no second close_notify, no alert after it");
    assert_eq!(deliver(&mut writer, &mut reader, &mut rx, 10).unwrap(), b"last words");
    assert!(reader.closed());
}

#[test]
fn a_fatal_alert_goes_after_what_is_pending_and_ends_the_stream() {
    let (mut writer, mut keys, mut reader, mut rx) = pair();
    writer.seal(&mut keys, &[IoSlice::new(b"data")]).unwrap();
    writer.end(Some(AlertDescription::BadRecordMac));
    assert!(!writer.is_open());
    assert!(matches!(writer.seal(&mut keys, &[IoSlice::new(b"more")]), Err(RecordError::Closed)));
    writer.close().unwrap();
    let error = deliver(&mut writer, &mut reader, &mut rx, 1000).unwrap_err();
    assert!(matches!(error, RecordError::AlertReceived(AlertDescription::BadRecordMac)), "{error:?}");
}

/// Issue 35: a failed write, a record that cannot be sealed, or a KeyUpdate sealed whose
/// key we cannot switch to: the connection is over and nothing sealed goes out, since the
/// caller was told its write failed (and the peer would have been left out of step).
#[test]
fn every_write_side_error_ends_the_connection_and_nothing_sealed_goes_out() {
    let data = pattern(5 * MAX_PLAINTEXT, 5);
    // The socket failed.
    let (mut writer, mut keys, ..) = pair();
    assert!(writer.seal(&mut keys, &[IoSlice::new(&data)]).unwrap() > 0);
    writer.fail();
    assert!(writer.has_failed() && writer.pending().is_empty());
    assert!(matches!(writer.seal(&mut keys, &[IoSlice::new(&data)]), Err(RecordError::Closed)));
    assert!(matches!(writer.close(), Err(RecordError::Closed)));
    writer.end(Some(AlertDescription::InternalError));
    assert!(writer.pending().is_empty(), "not even an alert");

    // The sequence ran out after three records (RFC 8446 §5.3); a ChaCha20 key, since an
    // AES-GCM one is only taken fresh.
    let chacha = ConnectionTrafficSecrets::Chacha20Poly1305 { key: AeadKey::from([0; 32]), iv: Iv::new([0; 12]) };
    let mut writer = Writer::new((u64::MAX - 3, chacha), 1 << 24).unwrap();
    writer.set_rekey_at(u64::MAX);
    assert!(matches!(writer.seal(&mut keys, &[IoSlice::new(&data)]), Err(RecordError::Exhausted)));
    assert!(writer.has_failed() && writer.pending().is_empty(), "the three records sealed stay unsent");
    assert!(matches!(writer.seal(&mut keys, &[IoSlice::new(b"x")]), Err(RecordError::Closed)));

    // The KeyUpdate is sealed, then rustls has no next secret.
    let (mut writer, mut keys, ..) = pair();
    writer.seal(&mut keys, &[IoSlice::new(b"before")]).unwrap();
    writer.update_key();
    keys.refuse_tx = true;
    assert!(matches!(writer.seal(&mut keys, &[IoSlice::new(&data)]), Err(RecordError::Session(_))));
    assert!(writer.pending().is_empty(), "neither the data before nor the KeyUpdate goes out");
    assert!(matches!(writer.close(), Err(RecordError::Closed)));
}

#[test]
fn partial_socket_writes_and_compaction_keep_every_byte_in_order() {
    let (mut writer, mut keys, mut reader, mut rx) = pair();
    let mut expected = Vec::new();
    let mut got = Vec::new();
    for round in 0..200usize {
        let part = pattern([48, 65_536, 3000, 16_384, 900][round % 5], round as u8);
        let mut at = 0;
        while at < part.len() {
            let taken = writer.seal(&mut keys, &[IoSlice::new(&part[at..])]).unwrap();
            at += taken;
            // The socket takes an odd amount, often less than what is pending.
            let n = writer.pending().len().min(1 + round * 7919 % 90_000);
            let space = reader.space();
            let n = n.min(space.len());
            space[..n].copy_from_slice(&writer.pending()[..n]);
            writer.sent(n);
            reader.received(n).unwrap();
            got.extend(deliver(&mut writer, &mut reader, &mut rx, 0).unwrap());
        }
        expected.extend_from_slice(&part);
    }
    got.extend(deliver(&mut writer, &mut reader, &mut rx, usize::MAX).unwrap());
    assert!(got == expected, "{} of {} bytes arrived in order", got.len(), expected.len());
}
