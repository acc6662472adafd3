//! The `tls_records` harness: what a hostile TLS peer sends once the handshake is over,
//! through the record layer's receive side (`usbwire_transport`'s `Reader`) set up with
//! fixed keys, so that the fuzzer reaches everything past decryption too.
//!
//! Input: `[chunking, read_size, flags] ++ ops`. `flags` bit 0: we are the server (a
//! NewSessionTicket is unexpected); bit 1: ChaCha20-Poly1305 keys instead of AES-256-GCM.
//! Each op appends to the byte stream the peer sends:
//!
//! - `0, n, bytes[n]`: raw bytes (bad headers, oversize lengths, records that fail
//!   authentication);
//! - `1, kind, pad, len_hi, len_lo, n, pattern[n]`: one record sealed with the peer's
//!   current key whose inner plaintext is `len` bytes of `pattern` repeated (zeros if
//!   empty), then `kind` unless it is 0, then `2 * pad` zero bytes: any content type, any
//!   padding, all-zero inner plaintexts, and sizes past 2^14;
//! - `2, request`: a KeyUpdate record, after which the peer seals with its next key;
//! - `3, level, description`: an alert record;
//! - `4, type, split, n, body[n]`: a handshake message (NewSessionTicket, KeyUpdate or
//!   any other) in one record or, if `split` cuts it, in two.
//!
//! The stream is read once whole through a large buffer and once in chunks (`chunking`)
//! through reads of `read_size` bytes (so records are opened both into the caller's buffer
//! and in place). Invariants: no panic; the application data handed out is a prefix of what
//! the peer sealed as application data, in order; both runs end the same way (the same
//! error, or none); a failure is reported again by the next read; the reader holds no
//! more memory than its fixed buffers and one post-handshake message, whatever arrives.

use tokio::io::ReadBuf;
use usbwire_transport::fuzzing::{
    content, wire_len, AeadKey, ConnectionTrafficSecrets, Iv, PeerSession, Reader, Sealer, MAX_PLAINTEXT,
};
use usbwire_transport::RecordError;

/// The receive buffer, a record, and the largest post-handshake message, with room.
const MAX_HELD: usize = 400 * 1024;

pub fn tls_records(data: &[u8]) {
    let Some((&[chunking, read_size, flags], ops)) = data.split_first_chunk::<3>() else { return };
    let chacha = flags & 2 != 0;
    let (wire, sealed_data) = peer_bytes(ops, chacha);
    let whole = read_all(&[&wire[..]], 1 << 20, flags, chacha);
    let read_size = match read_size % 4 {
        0 => 1 + usize::from(read_size >> 2),
        1 => MAX_PLAINTEXT + 256,
        2 => 64 * 1024,
        _ => usize::from(read_size) * 131,
    };
    let chunked = read_all(&crate::chunks(&wire, chunking), read_size, flags, chacha);
    for (data, _) in [&whole, &chunked] {
        assert!(sealed_data.starts_with(data), "only what the peer sealed as data is handed out, in order");
    }
    assert_eq!(whole.1, chunked.1, "chunking does not change how the stream ends");
}

/// The keys of generation `n` (0 after the handshake, then one more per KeyUpdate).
fn secrets(generation: u8, chacha: bool) -> ConnectionTrafficSecrets {
    let (key, iv) = (AeadKey::from([generation; 32]), Iv::new([generation ^ 0x5a; 12]));
    if chacha {
        ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv }
    } else {
        ConnectionTrafficSecrets::Aes256Gcm { key, iv }
    }
}

struct Session {
    generation: u8,
    chacha: bool,
    server: bool,
}

impl PeerSession for Session {
    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        self.generation = self.generation.wrapping_add(1);
        Ok((0, secrets(self.generation, self.chacha)))
    }

    fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        Err(RecordError::Unexpected("only the receive side runs here"))
    }

    fn new_session_ticket(&mut self, body: &[u8]) -> Result<(), RecordError> {
        match (self.server, body.first()) {
            (true, _) => Err(RecordError::Unexpected("a NewSessionTicket sent to a server")),
            // A stand-in for rustls's parser: some tickets are refused.
            (false, Some(0xff)) => Err(RecordError::Malformed("ticket")),
            (false, _) => Ok(()),
        }
    }
}

/// Appends to `wire` a record sealed by `sealer` whose inner plaintext is `inner` exactly
/// (its last byte the content type; empty: nothing to seal).
pub(crate) fn seal_record(sealer: &mut Sealer, inner: &[u8], wire: &mut Vec<u8>) {
    let Some((&last, rest)) = inner.split_last() else { return };
    let mut record = vec![0; wire_len(rest.len())];
    if let Err(error) = sealer.seal_from(last, rest, &mut record) {
        panic!("sealing {} bytes: {error}", inner.len());
    }
    wire.extend_from_slice(&record);
}

/// One thing a peer sends, as the input describes it (see the module docs).
pub(crate) enum PeerOp<'a> {
    /// Raw bytes on the wire.
    Raw(&'a [u8]),
    /// A record around this inner plaintext (content, then its type unless 0, then padding).
    Inner(Vec<u8>),
    /// A KeyUpdate (`request` its byte), after which the peer seals with its next key.
    KeyUpdate(u8),
    /// An alert record.
    Alert(u8, u8),
    /// A post-handshake message of type `kind`, in one record or cut in two at `at`.
    Handshake { kind: u8, message: Vec<u8>, at: usize },
}

/// The peer's ops in `input`, in order.
pub(crate) fn peer_ops(mut ops: &[u8]) -> Vec<PeerOp<'_>> {
    let mut out = Vec::new();
    while let Some((&op, rest)) = ops.split_first() {
        ops = rest;
        out.push(match op % 5 {
            0 => {
                let n = take(&mut ops, 1).first().copied().unwrap_or(0);
                PeerOp::Raw(take(&mut ops, usize::from(n)))
            }
            1 => {
                let &[kind, pad, high, low, n] = take(&mut ops, 5) else { break };
                let pattern = take(&mut ops, usize::from(n));
                let len = usize::from(u16::from_be_bytes([high, low])).min(MAX_PLAINTEXT + 300);
                let mut inner: Vec<u8> = pattern.iter().copied().cycle().take(len).collect();
                inner.resize(len, 0);
                if kind != 0 {
                    inner.push(kind);
                }
                inner.resize(inner.len() + 2 * usize::from(pad), 0);
                PeerOp::Inner(inner)
            }
            2 => PeerOp::KeyUpdate(take(&mut ops, 1).first().copied().unwrap_or(1)),
            3 => {
                let &[level, description] = take(&mut ops, 2) else { break };
                PeerOp::Alert(level, description)
            }
            _ => {
                let &[kind, split, n] = take(&mut ops, 3) else { break };
                let body = take(&mut ops, usize::from(n));
                let message = [&[kind, 0, 0, n][..], body].concat();
                let at = usize::from(split) % (message.len() + 1);
                PeerOp::Handshake { kind, message, at }
            }
        });
    }
    out
}

/// The peer's byte stream for `ops`, and the application data it sealed, in order.
fn peer_bytes(ops: &[u8], chacha: bool) -> (Vec<u8>, Vec<u8>) {
    let mut peer = Peer { sealer: sealer(0, chacha), generation: 0, wire: Vec::new(), data: Vec::new() };
    for op in peer_ops(ops) {
        match op {
            PeerOp::Raw(bytes) => peer.wire.extend_from_slice(bytes),
            PeerOp::Inner(inner) => peer.seal(&inner),
            PeerOp::KeyUpdate(request) => {
                peer.seal(&[24, 0, 0, 1, request, content::HANDSHAKE]);
                peer.generation = peer.generation.wrapping_add(1);
                peer.sealer = sealer(peer.generation, chacha);
            }
            PeerOp::Alert(level, description) => peer.seal(&[level, description, content::ALERT]),
            PeerOp::Handshake { message, at, .. } => {
                for part in [&message[..at], &message[at..]] {
                    if !part.is_empty() {
                        peer.seal(&[part, &[content::HANDSHAKE]].concat());
                    }
                }
            }
        }
    }
    (peer.wire, peer.data)
}

fn take<'a>(ops: &mut &'a [u8], n: usize) -> &'a [u8] {
    let (taken, rest) = ops.split_at(n.min(ops.len()));
    *ops = rest;
    taken
}

fn sealer(generation: u8, chacha: bool) -> Sealer {
    match Sealer::new(0, secrets(generation, chacha)) {
        Ok(sealer) => sealer,
        Err(error) => panic!("fixed keys: {error}"),
    }
}

struct Peer {
    sealer: Sealer,
    generation: u8,
    wire: Vec<u8>,
    data: Vec<u8>,
}

impl Peer {
    /// Seals a record whose inner plaintext is `inner` exactly (empty: nothing to seal).
    fn seal(&mut self, inner: &[u8]) {
        seal_record(&mut self.sealer, inner, &mut self.wire);
        // What a reader makes of it (RFC 8446 §5.4), said independently of the reader.
        if let Some(end) = inner.iter().rposition(|&b| b != 0) {
            if inner[end] == content::APPLICATION_DATA {
                self.data.extend_from_slice(&inner[..end]);
            }
        }
    }
}

/// Feeds `chunks` to a fresh reader, as the socket would (no more than its free space at
/// a time), through reads of `read_size` bytes. Returns the data handed out and how it
/// ended (`None`: every byte taken, no failure).
fn read_all(chunks: &[&[u8]], read_size: usize, flags: u8, chacha: bool) -> (Vec<u8>, Option<String>) {
    let Ok(mut reader) = Reader::new((0, secrets(0, chacha)), &[], &[]) else { panic!("fixed keys") };
    let mut session = Session { generation: 0, chacha, server: flags & 1 != 0 };
    let mut data = Vec::new();
    let mut out = vec![0; read_size];
    let mut chunks = chunks.iter().copied();
    let mut chunk: &[u8] = &[];
    loop {
        assert!(reader.held() <= MAX_HELD, "the reader holds {} bytes", reader.held());
        let mut buf = ReadBuf::new(&mut out);
        match reader.read(&mut session, &mut buf) {
            Err(error) => {
                let again = reader.read(&mut session, &mut ReadBuf::new(&mut out));
                assert!(again.is_err(), "a failure is reported again");
                return (data, Some(format!("{error:?}")));
            }
            Ok(false) if buf.filled().is_empty() => {
                assert!(reader.closed(), "nothing handed out only at the end of the stream");
                return (data, None);
            }
            Ok(false) => data.extend_from_slice(buf.filled()),
            Ok(true) => {
                while chunk.is_empty() {
                    let Some(next) = chunks.next() else { return (data, None) };
                    chunk = next;
                }
                let space = reader.space();
                assert!(!space.is_empty(), "the reader has room whenever it wants bytes");
                let n = space.len().min(chunk.len());
                space[..n].copy_from_slice(&chunk[..n]);
                chunk = &chunk[n..];
                if let Err(error) = reader.received(n) {
                    panic!("a non-empty read is not an end: {error}");
                }
            }
        }
    }
}

/// Seeds: `[chunking, read_size, flags] ++ ops` (ops as in the module docs).
pub(crate) fn tls_records_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    let data = |kind: u8, pad: u8, len: u16, pattern: &[u8]| {
        let [high, low] = len.to_be_bytes();
        [&[1, kind, pad, high, low, pattern.len() as u8][..], pattern].concat()
    };
    let ticket = [4u8, 4, 3, 8, 0, 0, 0, 60, 1, 2, 3, 4];
    let conversation = [
        data(content::APPLICATION_DATA, 3, 100, b"hello"),
        vec![2, 1],
        data(content::APPLICATION_DATA, 0, MAX_PLAINTEXT as u16, b"x"),
        ticket.to_vec(),
        data(content::APPLICATION_DATA, 0, 0, b""),
        vec![2, 0],
        data(content::APPLICATION_DATA, 120, 7000, b"0123456789"),
        vec![3, 1, 0],
    ]
    .concat();
    add("tls_records", "conversation", &[2, 1, 0], conversation.clone());
    add("tls_records", "conversation_chacha_small_reads", &[3, 8, 2], conversation);
    let broken =
        [data(content::APPLICATION_DATA, 0, 10, b"ok"), data(0, 4, 0, b""), vec![0, 5, 23, 3, 3, 0x41, 0x01]].concat();
    add("tls_records", "padding_only", &[1, 2, 0], broken);
    add("tls_records", "oversize", &[0, 1, 0], data(content::APPLICATION_DATA, 0, MAX_PLAINTEXT as u16, b"z\0"));
    add("tls_records", "ticket_to_server", &[0, 3, 1], ticket.to_vec());
    add("tls_records", "alert", &[0, 0, 0], [data(content::APPLICATION_DATA, 0, 3, b"abc"), vec![3, 2, 20]].concat());
}
