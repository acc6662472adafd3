//! The `tls_pair` harness: both halves of `usbwire_transport`'s TLS 1.3 record layer
//! against each other, without a socket: a `Writer` seals what the input writes, a
//! "socket" the input schedules moves its pending bytes to a `Reader`, which hands the
//! data out in reads of the input's sizes.
//!
//! Input: `[flags] ++ ops`. `flags` bit 0: ChaCha20-Poly1305 keys instead of AES-256-GCM;
//! the other bits: the key's confidentiality limit (a KeyUpdate every few records, or
//! none). Each op:
//!
//! - `0, n, (hi, lo)[n]`: one vectored write of `n % 8` slices; a slice is `hi, lo` bytes
//!   long, or with `hi`'s top bit `(hi & 0x7f, lo) * 64` (up to 2 MiB: the large-slice path);
//! - `1`: the peer asked for a key update (ours goes before the next record);
//! - `2, hi, lo`: the socket takes up to `hi, lo` bytes of what is pending (`0, 0`: all);
//! - `3, size`: the application reads, `size` bytes a read at most;
//! - `4`: the socket fails;
//! - `5`: close_notify.
//!
//! Invariants: no panic; a write fails exactly when the writer is closed or failed, and
//! takes no more than it is offered; the reader never fails (every record opens, under
//! the key and sequence number it was sealed with, so none is repeated or skipped) and
//! hands out exactly a prefix of the bytes the writer took, in order; nothing is pending
//! once the socket failed; at the end, everything written arrives (unless the socket
//! failed), close_notify is seen when it was sealed, and both ends are on the same key.

use std::io::IoSlice;

use tokio::io::ReadBuf;
use usbwire_transport::fuzzing::{AeadKey, ConnectionTrafficSecrets, Iv, PeerSession, Reader, Writer};
use usbwire_transport::RecordError;

/// Bytes written per input at most, so each run stays short.
const MAX_WRITTEN: usize = 8 << 20;
/// Bytes the application reads at a time at most (the buffer is kept between reads).
const READ_AT_MOST: usize = 64 << 10;

pub fn tls_pair(data: &[u8]) {
    let Some((&flags, mut ops)) = data.split_first() else { return };
    let chacha = flags & 1 != 0;
    let limit = match flags >> 1 {
        0 => 1 << 24,
        n => 1 + u64::from(n),
    };
    let mut pair = Pair::new(chacha, limit);
    while let Some((&op, rest)) = ops.split_first() {
        ops = rest;
        match op % 6 {
            0 => {
                let count = take(&mut ops, 1).first().map_or(0, |n| usize::from(n % 8));
                let sizes: Vec<usize> = take(&mut ops, 2 * count).chunks_exact(2).map(slice_len).collect();
                pair.write(&sizes);
            }
            1 => pair.writer.update_key(),
            2 => {
                let n = match *take(&mut ops, 2) {
                    [hi, lo] => usize::from(u16::from_be_bytes([hi, lo])),
                    _ => 0,
                };
                pair.transmit(if n == 0 { usize::MAX } else { n });
            }
            3 => {
                let size = take(&mut ops, 1).first().map_or(1, |&n| 1 + usize::from(n) * 97);
                pair.read(size);
            }
            4 => {
                pair.writer.fail();
                pair.failed = true;
                assert!(pair.writer.pending().is_empty(), "nothing goes out after a failure");
            }
            _ => {
                let closed = pair.writer.close();
                assert_eq!(closed.is_err(), pair.failed, "close_notify fails only after a failure");
                pair.closed |= !pair.failed;
            }
        }
    }
    pair.finish();
}

/// A slice's length from its two bytes (see the module docs).
fn slice_len(bytes: &[u8]) -> usize {
    let (hi, lo) = (bytes[0], bytes[1]);
    if hi & 0x80 == 0 {
        usize::from(u16::from_be_bytes([hi, lo]))
    } else {
        usize::from(u16::from_be_bytes([hi & 0x7f, lo])) * 64
    }
}

fn take<'a>(ops: &mut &'a [u8], n: usize) -> &'a [u8] {
    let (taken, rest) = ops.split_at(n.min(ops.len()));
    *ops = rest;
    taken
}

/// The stream the writer is given (its first [`MAX_WRITTEN`] bytes), made once: every
/// write borrows from it and every read is compared with it.
fn stream() -> &'static [u8] {
    static STREAM: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    STREAM.get_or_init(|| (0..MAX_WRITTEN).map(|at| (at % 251) as u8 ^ (at >> 16) as u8).collect())
}

/// The keys of generation `n` (0 after the handshake, then one more per KeyUpdate).
fn secrets(generation: u32, chacha: bool) -> ConnectionTrafficSecrets {
    let [a, b, ..] = generation.to_le_bytes();
    let mut key = [a; 32];
    key[1] = b;
    let (key, iv) = (AeadKey::from(key), Iv::new([a ^ 0x5a; 12]));
    if chacha {
        ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv }
    } else {
        ConnectionTrafficSecrets::Aes256Gcm { key, iv }
    }
}

/// Both ends' key generations: what rustls's `KernelConnection` keeps on each side.
struct Keys {
    tx: u32,
    rx: u32,
    chacha: bool,
}

impl PeerSession for Keys {
    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        self.rx += 1;
        Ok((0, secrets(self.rx, self.chacha)))
    }

    fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        self.tx += 1;
        Ok((0, secrets(self.tx, self.chacha)))
    }

    fn new_session_ticket(&mut self, _: &[u8]) -> Result<(), RecordError> {
        panic!("the writer sent a NewSessionTicket")
    }
}

struct Pair {
    writer: Writer,
    reader: Reader,
    keys: Keys,
    /// Bytes the writer took (the stream's first `written` bytes).
    written: usize,
    /// Bytes the reader handed out.
    read: usize,
    failed: bool,
    closed: bool,
    /// The writer's key generation and sequence number after its last seal.
    last_sealed: (u32, u64),
    /// The application's read buffer.
    out: Vec<u8>,
}

impl Pair {
    fn new(chacha: bool, limit: u64) -> Self {
        let (Ok(writer), Ok(reader)) =
            (Writer::new((0, secrets(0, chacha)), limit), Reader::new((0, secrets(0, chacha)), &[], &[]))
        else {
            panic!("fixed keys")
        };
        let keys = Keys { tx: 0, rx: 0, chacha };
        Self {
            writer,
            reader,
            keys,
            written: 0,
            read: 0,
            failed: false,
            closed: false,
            last_sealed: (0, 0),
            out: Vec::new(),
        }
    }

    fn write(&mut self, sizes: &[usize]) {
        let total: usize = sizes.iter().sum();
        if self.written + total > MAX_WRITTEN {
            return;
        }
        let slices: Vec<IoSlice<'_>> = sizes
            .iter()
            .scan(self.written, |at, &len| {
                let part = IoSlice::new(&stream()[*at..*at + len]);
                *at += len;
                Some(part)
            })
            .collect();
        match self.writer.seal(&mut self.keys, &slices) {
            Ok(taken) => {
                assert!(!self.failed && !self.closed, "a write after close_notify or a failure was taken");
                assert!(taken <= total, "took {taken} of {total} bytes");
                self.written += taken;
                let sealed = (self.keys.tx, self.writer.sequence());
                assert!(sealed >= self.last_sealed, "a sequence number went back: {sealed:?}");
                self.last_sealed = sealed;
            }
            Err(RecordError::Closed) => assert!(self.failed || self.closed, "a write refused on an open stream"),
            Err(error) => panic!("sealing failed: {error}"),
        }
    }

    /// The socket takes up to `n` bytes of what is pending, as much as the reader has
    /// room for at a time.
    fn transmit(&mut self, mut n: usize) {
        while n > 0 && !self.writer.pending().is_empty() {
            let space = self.reader.space();
            assert!(!space.is_empty(), "the reader has room whenever it wants bytes");
            let pending = self.writer.pending();
            let len = n.min(pending.len()).min(space.len());
            space[..len].copy_from_slice(&pending[..len]);
            self.writer.sent(len);
            if let Err(error) = self.reader.received(len) {
                panic!("a non-empty read is not an end: {error}");
            }
            n -= len;
            // Open what arrived, so the reader's buffer has room again.
            self.read(64 << 10);
        }
    }

    /// Reads until the reader wants more bytes; every byte is checked against the stream.
    fn read(&mut self, size: usize) {
        let mut out = std::mem::take(&mut self.out);
        out.resize(size.min(READ_AT_MOST), 0);
        self.read_into(&mut out);
        self.out = out;
    }

    fn read_into(&mut self, out: &mut [u8]) {
        loop {
            let mut buf = ReadBuf::new(out);
            match self.reader.read(&mut self.keys, &mut buf) {
                Err(error) => panic!("the reader failed on what the writer sealed: {error}"),
                Ok(true) => return,
                Ok(false) if buf.filled().is_empty() => {
                    assert!(self.closed && self.reader.closed(), "nothing handed out only after close_notify");
                    return;
                }
                Ok(false) => {
                    let got = buf.filled();
                    assert!(self.read + got.len() <= self.written, "more handed out than was written");
                    let expected = &stream()[self.read..self.read + got.len()];
                    if got != expected {
                        let at = got.iter().zip(expected).position(|(a, b)| a != b).unwrap_or(0);
                        panic!("byte {} differs", self.read + at);
                    }
                    self.read += got.len();
                }
            }
        }
    }

    fn finish(mut self) {
        self.transmit(usize::MAX);
        self.read(1 << 20);
        if self.failed {
            return;
        }
        assert_eq!(self.read, self.written, "everything written arrived");
        assert_eq!(self.reader.closed(), self.closed, "close_notify arrives when it was sealed");
        assert_eq!(self.keys.rx, self.keys.tx, "the reader follows every key update");
    }
}

/// Seeds: `[flags] ++ ops` (ops as in the module docs).
pub(crate) fn tls_pair_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    let urbs = [
        // A 64 KiB URB's reply (48-byte header, then the data), four times over.
        [&[0u8, 2, 0, 48, 0x84, 0][..], &[0, 2, 0, 48, 0x84, 0], &[0, 2, 0, 48, 0x84, 0], &[0, 2, 0, 48, 0x84, 0]]
            .concat(),
        vec![2, 0x30, 0x39, 3, 200],
        // A 1 MiB URB's data (a large slice), a key update, small writes.
        vec![0, 1, 0xc0, 0, 1, 0, 0, 0, 3, 0, 7, 0x08, 0x00, 0x07, 0xff],
        vec![2, 0, 0, 3, 5, 5],
    ]
    .concat();
    add("tls_pair", "urbs", &[0], urbs.clone());
    add("tls_pair", "urbs_chacha_rekey_every_7", &[1 | (6 << 1)], urbs.clone());
    add("tls_pair", "socket_fails", &[0], [&urbs[..18], &[2, 0, 100, 4, 0, 1, 0, 9]].concat());
}
