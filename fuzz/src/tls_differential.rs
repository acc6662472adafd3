//! The `tls_differential` harness: the same records, after a real handshake, to our
//! record layer's receive side (`Reader`) and to a stock rustls client, which must agree.
//!
//! Per input, a rustls client and a rustls server (its unbuffered API, as our handshake
//! drives it) complete a TLS 1.3 handshake in memory with usbwire's configurations; the
//! server's sending keys (this one and the next few, from its `KernelConnection`) seal
//! what the input describes, and the bytes go, in the same chunks, to the rustls client
//! and to a `Reader` opened with those keys.
//!
//! Input: `[chunking] ++ ops`, the ops of `tls_records` (raw bytes; a record around any
//! inner plaintext; a KeyUpdate, after which the sender seals with its next key; an alert;
//! a post-handshake message, whole or split) but for NewSessionTicket bodies, which only
//! rustls parses (`tls_records` covers how we hand them over). Invariants: both hand out
//! the same application data, in order; both end the same way: still open, closed by the
//! peer's close_notify, or failed — and then with the same error where the two name it
//! alike (a record that fails authentication, one too large, the peer's own alert). The
//! stream ends with filler that completes a partial record and breaks the framing, so
//! both have seen every record whole (rustls checks a record's length once all of it is
//! there, ours at its header). `TLS_DIFF_DEBUG=1` prints both sides' errors.

use std::sync::{Arc, OnceLock};

use rustls::pki_types::ServerName;
use rustls::unbuffered::{ConnectionState, EncodeError};
use rustls::{ClientConnection, ConnectionTrafficSecrets};
use tokio::io::ReadBuf;
use usbwire_transport::access::{AccessRules, Admission, Rule};
use usbwire_transport::fuzzing::{content, AeadKey, Iv, PeerSession, Reader, Sealer, MAX_PLAINTEXT};
use usbwire_transport::tls::{client_config, server_config, server_name, ServerTrust};
use usbwire_transport::{Identity, RecordError};

use crate::tls_records::{peer_ops, seal_record, PeerOp};

/// Bytes past the largest record rustls buffers (its 16 KiB + 2 KiB payload limit and a header).
const FILLER: usize = 18 * 1024 + 5 + 1;
/// Application data's content type: the outer type of every protected record.
const OUTER_TYPE: u8 = 23;
/// The server's sending keys a run may reach: this one and the next few.
const GENERATIONS: usize = 6;

struct Configs {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

fn configs() -> &'static Configs {
    static CONFIGS: OnceLock<Configs> = OnceLock::new();
    CONFIGS.get_or_init(|| {
        let (server, client) = match (Identity::generate("server"), Identity::generate("client")) {
            (Ok(server), Ok(client)) => (server, client),
            _ => panic!("identities"),
        };
        let rules =
            AccessRules { rules: vec![Rule { client: client.fingerprint().to_string(), devices: vec!["*".into()] }] };
        let Ok(server_config) = server_config(&server, Admission { rules, ca: None }) else { panic!("server config") };
        let Ok((client_config, _)) = client_config(&client, ServerTrust::Pinned(server.fingerprint())) else {
            panic!("client config")
        };
        Configs { server: server_config, client: client_config }
    })
}

/// A key the server sends under: its first sequence number, and the secrets as bytes (so
/// both the sender and our reader can have them).
#[derive(Clone)]
struct Generation {
    sequence: u64,
    kind: u8,
    key: Vec<u8>,
    iv: [u8; 12],
}

impl Generation {
    fn of((sequence, secrets): (u64, ConnectionTrafficSecrets)) -> Self {
        let (kind, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (0, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (1, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (2, key, iv),
            _ => panic!("a suite the record layer does not implement was negotiated"),
        };
        let Ok(iv) = iv.as_ref().try_into() else { panic!("a 12-byte IV") };
        Self { sequence, kind, key: key.as_ref().to_vec(), iv }
    }

    fn secrets(&self) -> (u64, ConnectionTrafficSecrets) {
        let (key, iv) = (AeadKey::from(aead_key(&self.key)), Iv::new(self.iv));
        let secrets = match self.kind {
            0 => ConnectionTrafficSecrets::Aes128Gcm { key, iv },
            1 => ConnectionTrafficSecrets::Aes256Gcm { key, iv },
            _ => ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv },
        };
        (self.sequence, secrets)
    }
}

/// `AeadKey` is built from 32 bytes and says how many of them are the key.
fn aead_key(key: &[u8]) -> [u8; 32] {
    let mut bytes = [0; 32];
    bytes[..key.len()].copy_from_slice(key);
    bytes
}

/// Runs the handshake in memory: the rustls client, ready to read, and the server's
/// sending keys (generation 0, then each next one).
fn handshake() -> (ClientConnection, Vec<Generation>) {
    let configs = configs();
    let name: ServerName<'static> = server_name();
    let (Ok(mut client), Ok(mut server)) = (
        ClientConnection::new(configs.client.clone(), name),
        rustls::server::UnbufferedServerConnection::new(configs.server.clone()),
    ) else {
        panic!("connections")
    };
    let (mut to_server, mut used) = (vec![0u8; 80 * 1024], 0usize);
    for _ in 0..64 {
        // The client's bytes to the server.
        let mut sent = Vec::new();
        while client.wants_write() {
            if client.write_tls(&mut sent).is_err() {
                panic!("client write");
            }
        }
        to_server[used..used + sent.len()].copy_from_slice(&sent);
        used += sent.len();
        // The server's answers to the client, until it blocks or is done.
        loop {
            let status = server.process_tls_records(&mut to_server[..used]);
            let discard = status.discard;
            let mut done = false;
            let mut blocked = false;
            match status.state {
                Ok(ConnectionState::EncodeTlsData(mut encode)) => {
                    let mut out = vec![0u8; 16 * 1024];
                    let n = match encode.encode(&mut out) {
                        Ok(n) => n,
                        Err(EncodeError::InsufficientSize(need)) => {
                            out.resize(need.required_size, 0);
                            encode.encode(&mut out).unwrap_or_else(|e| panic!("encode: {e}"))
                        }
                        Err(error) => panic!("encode: {error}"),
                    };
                    let mut from_server = &out[..n];
                    while !from_server.is_empty() {
                        if client.read_tls(&mut from_server).is_err() {
                            panic!("client read");
                        }
                        if let Err(error) = client.process_new_packets() {
                            panic!("client handshake: {error}");
                        }
                    }
                }
                Ok(ConnectionState::TransmitTlsData(transmit)) => transmit.done(),
                Ok(ConnectionState::BlockedHandshake) => blocked = true,
                Ok(ConnectionState::WriteTraffic(_)) => done = true,
                Ok(_) => panic!("unexpected server state during the handshake"),
                Err(error) => panic!("server handshake: {error}"),
            }
            to_server.copy_within(discard..used, 0);
            used -= discard;
            if done && !server.is_handshaking() {
                assert!(!client.is_handshaking(), "the client is done once the server is");
                let Ok((secrets, mut kernel)) = server.dangerous_into_kernel_connection() else {
                    panic!("the server's keys")
                };
                let mut generations = vec![Generation::of(secrets.tx)];
                for _ in 1..GENERATIONS {
                    let Ok(next) = kernel.update_tx_secret() else { panic!("the next key") };
                    generations.push(Generation::of(next));
                }
                return (client, generations);
            }
            if blocked || done {
                break;
            }
        }
    }
    panic!("the handshake did not finish")
}

/// How a reader's run ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// Every byte taken, no failure, no close_notify.
    Open,
    /// The peer's close_notify.
    Closed,
    /// A failure, named where both layers name it alike.
    Failed(Failure),
}

#[derive(Debug, PartialEq, Eq)]
enum Failure {
    BadRecordMac,
    /// Ours only: a header refused before decryption (its outer type is not application
    /// data, or its version not 3.x).
    Header,
    RecordOverflow,
    AlertReceived(rustls::AlertDescription),
    Other,
}

pub fn tls_differential(data: &[u8]) {
    let Some((&chunking, ops)) = data.split_first() else { return };
    let (client, generations) = handshake();
    let mut wire = peer_bytes(ops, &generations);
    // Filler that completes any record left partial and then breaks the framing: the two
    // layers check a header's length at different times (ours as soon as the header is
    // here, rustls once the record is), and a stream that stopped in between would show
    // that, not a difference in what they accept.
    wire.resize(wire.len() + FILLER, OUTER_TYPE);
    let chunks = crate::chunks(&wire, chunking);
    let (ours, our_end) = ours(&chunks, &generations);
    let (theirs, their_end) = rustls_reads(client, &chunks);
    assert!(ours == theirs, "both hand out the same data ({} bytes ours, {} rustls)", ours.len(), theirs.len());
    assert!(agree(&our_end, &their_end), "both end the same way: ours {our_end:?}, rustls {their_end:?}");
}

/// Whether the two ends are the same, but for the headers we refuse before decryption
/// (RFC 8446 §5.2) where rustls decrypts first and, for a forged record, says
/// bad_record_mac (or refuses the header for a reason of its own): ciphertext over 2^14 +
/// 256 bytes is record_overflow for us, an outer type other than application data
/// unexpected_message, a version other than 3.x decode_error (rustls lets through the
/// versions it knows by name, SSLv2's 0x0002 among them).
fn agree(ours: &End, theirs: &End) -> bool {
    ours == theirs
        || (matches!(ours, End::Failed(Failure::RecordOverflow | Failure::Header))
            && matches!(theirs, End::Failed(Failure::BadRecordMac | Failure::Other)))
}

/// The sender: seals with generation `generation` of the server's keys.
struct Peer<'a> {
    generations: &'a [Generation],
    generation: usize,
    sealer: Sealer,
    wire: Vec<u8>,
}

impl Peer<'_> {
    fn seal(&mut self, inner: &[u8]) {
        seal_record(&mut self.sealer, inner, &mut self.wire);
    }

    fn next_key(&mut self) {
        self.generation = (self.generation + 1).min(self.generations.len() - 1);
        self.sealer = sealer(&self.generations[self.generation]);
    }
}

fn sealer(generation: &Generation) -> Sealer {
    match Sealer::new(generation.sequence, generation.secrets().1) {
        Ok(sealer) => sealer,
        Err(error) => panic!("the server's key: {error}"),
    }
}

/// The sender's byte stream for `ops` (`tls_records`' ops, tickets left out).
fn peer_bytes(ops: &[u8], generations: &[Generation]) -> Vec<u8> {
    let mut peer = Peer { generations, generation: 0, sealer: sealer(&generations[0]), wire: Vec::new() };
    for op in peer_ops(ops) {
        match op {
            PeerOp::Raw(bytes) => peer.wire.extend_from_slice(bytes),
            PeerOp::Inner(inner) => peer.seal(&inner),
            // Past the last key both sides know, the sender stops updating.
            PeerOp::KeyUpdate(_) if peer.generation + 1 >= generations.len() => {}
            PeerOp::KeyUpdate(request) => {
                peer.seal(&[24, 0, 0, 1, request & 1, content::HANDSHAKE]);
                peer.next_key();
            }
            PeerOp::Alert(level, description) => peer.seal(&[level, description, content::ALERT]),
            // NewSessionTicket bodies only rustls parses; KeyUpdates go as above (a
            // malformed one here would move rustls's key without the sender).
            PeerOp::Handshake { kind: 4 | 24, .. } => {}
            PeerOp::Handshake { message, at, .. } => {
                for part in [&message[..at], &message[at..]] {
                    if !part.is_empty() {
                        peer.seal(&[part, &[content::HANDSHAKE]].concat());
                    }
                }
            }
        }
    }
    peer.wire
}

/// Our reader's session: the server's next keys, in order.
struct Keys<'a> {
    generations: &'a [Generation],
    generation: usize,
}

impl PeerSession for Keys<'_> {
    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        self.generation += 1;
        match self.generations.get(self.generation) {
            Some(next) => Ok(next.secrets()),
            None => Err(RecordError::Unexpected("more key updates than the harness derived")),
        }
    }

    fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        Err(RecordError::Unexpected("only the receive side runs here"))
    }

    fn new_session_ticket(&mut self, _: &[u8]) -> Result<(), RecordError> {
        Err(RecordError::Unexpected("no tickets in this harness"))
    }
}

/// Our reader, fed `chunks` as the socket would.
fn ours(chunks: &[&[u8]], generations: &[Generation]) -> (Vec<u8>, End) {
    let Ok(mut reader) = Reader::new(generations[0].secrets(), &[], &[]) else { panic!("the server's key") };
    let mut session = Keys { generations, generation: 0 };
    let mut data = Vec::new();
    let mut out = vec![0; 64 * 1024];
    let mut chunks = chunks.iter().copied();
    let mut chunk: &[u8] = &[];
    loop {
        let mut buf = ReadBuf::new(&mut out);
        match reader.read(&mut session, &mut buf) {
            Err(error) => {
                if std::env::var_os("TLS_DIFF_DEBUG").is_some() {
                    eprintln!("ours: {error:?}");
                }
                return (data, End::Failed(our_failure(&error)));
            }
            Ok(false) if buf.filled().is_empty() => return (data, End::Closed),
            Ok(false) => data.extend_from_slice(buf.filled()),
            Ok(true) => {
                while chunk.is_empty() {
                    let Some(next) = chunks.next() else { return (data, End::Open) };
                    chunk = next;
                }
                let space = reader.space();
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

fn our_failure(error: &RecordError) -> Failure {
    match error {
        RecordError::Authentication => Failure::BadRecordMac,
        RecordError::Unexpected("a record that is not protected" | "a record of an unknown content type")
        | RecordError::Malformed("not a TLS record") => Failure::Header,
        RecordError::Overflow(_) => Failure::RecordOverflow,
        RecordError::AlertReceived(alert) => Failure::AlertReceived(*alert),
        _ => Failure::Other,
    }
}

/// The rustls client, fed the same chunks.
fn rustls_reads(mut client: ClientConnection, chunks: &[&[u8]]) -> (Vec<u8>, End) {
    use std::io::Read;
    let mut data = Vec::new();
    let mut out = vec![0; 64 * 1024];
    for chunk in chunks {
        let mut chunk: &[u8] = chunk;
        while !chunk.is_empty() {
            if client.read_tls(&mut chunk).is_err() {
                panic!("rustls takes bytes it has room for");
            }
            let processed = client.process_new_packets();
            // What it decrypted before a failure is still handed out first.
            loop {
                match client.reader().read(&mut out) {
                    Ok(0) => return (data, End::Closed),
                    Ok(n) => data.extend_from_slice(&out[..n]),
                    Err(_) => break,
                }
            }
            if let Err(error) = processed {
                if std::env::var_os("TLS_DIFF_DEBUG").is_some() {
                    eprintln!("rustls: {error:?}");
                }
                return (data, End::Failed(rustls_failure(&error)));
            }
        }
    }
    (data, End::Open)
}

fn rustls_failure(error: &rustls::Error) -> Failure {
    match error {
        rustls::Error::DecryptError => Failure::BadRecordMac,
        rustls::Error::PeerSentOversizedRecord => Failure::RecordOverflow,
        rustls::Error::AlertReceived(alert) => Failure::AlertReceived(*alert),
        _ => Failure::Other,
    }
}

/// Seeds: `[chunking] ++ ops`.
pub(crate) fn tls_differential_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    let data = |kind: u8, pad: u8, len: u16, pattern: &[u8]| {
        let [high, low] = len.to_be_bytes();
        [&[1, kind, pad, high, low, pattern.len() as u8][..], pattern].concat()
    };
    let conversation = [
        data(content::APPLICATION_DATA, 3, 100, b"hello"),
        vec![2, 1],
        data(content::APPLICATION_DATA, 0, MAX_PLAINTEXT as u16, b"x"),
        data(content::APPLICATION_DATA, 0, 0, b""),
        vec![2, 0],
        data(content::APPLICATION_DATA, 120, 7000, b"0123456789"),
        vec![3, 1, 0],
    ]
    .concat();
    add("tls_differential", "conversation", &[2], conversation.clone());
    add("tls_differential", "conversation_small_chunks", &[9], conversation);
    let broken =
        [data(content::APPLICATION_DATA, 0, 10, b"ok"), data(0, 4, 0, b""), vec![0, 5, 23, 3, 3, 0x41, 0x01]].concat();
    add("tls_differential", "padding_only", &[1], broken);
    add("tls_differential", "oversize", &[0], data(content::APPLICATION_DATA, 0, MAX_PLAINTEXT as u16, b"z\0"));
    add(
        "tls_differential",
        "warning_alert",
        &[0],
        [data(content::APPLICATION_DATA, 0, 3, b"abc"), vec![3, 1, 90]].concat(),
    );
    add(
        "tls_differential",
        "fatal_alert",
        &[0],
        [data(content::APPLICATION_DATA, 0, 3, b"abc"), vec![3, 2, 20]].concat(),
    );
    add("tls_differential", "split_handshake", &[3], [vec![4, 13, 2, 6], b"abcdef".to_vec()].concat());
}
