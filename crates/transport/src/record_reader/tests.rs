//! The receive side against records a peer could send, each rule of RFC 8446 that it
//! enforces with the alert that rule names.

use rustls::crypto::cipher::{AeadKey, Iv};
use rustls::{AlertDescription, ConnectionTrafficSecrets};
use tokio::io::ReadBuf;

use super::{PeerSession, Reader, MAX_HANDSHAKE_MESSAGE};
use crate::record::{content, wire_len, RecordError, Sealer, HEADER, MAX_PLAINTEXT};

fn secrets(generation: u8) -> ConnectionTrafficSecrets {
    ConnectionTrafficSecrets::Aes256Gcm { key: AeadKey::from([generation; 32]), iv: Iv::new([generation; 12]) }
}

/// A session whose key generation `n` is `secrets(n)`.
#[derive(Default)]
struct Fake {
    generation: u8,
    server: bool,
    tickets: Vec<Vec<u8>>,
}

impl PeerSession for Fake {
    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        self.generation += 1;
        Ok((0, secrets(self.generation)))
    }

    fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        Err(RecordError::Unexpected("the receive side never updates our key"))
    }

    fn new_session_ticket(&mut self, body: &[u8]) -> Result<(), RecordError> {
        if self.server {
            return Err(RecordError::Unexpected("a NewSessionTicket sent to a server"));
        }
        self.tickets.push(body.to_vec());
        Ok(())
    }
}

/// The peer: seals records under key generation 0, then 1 after each KeyUpdate it sends.
struct Peer {
    sealer: Sealer,
    generation: u8,
    wire: Vec<u8>,
}

impl Peer {
    fn new() -> Self {
        Self { sealer: Sealer::new(0, secrets(0)).unwrap(), generation: 0, wire: Vec::new() }
    }

    /// A record whose inner plaintext is `inner` exactly (content, type, padding).
    fn inner(&mut self, inner: &[u8]) -> &mut Self {
        let (&last, content) = inner.split_last().unwrap();
        let mut out = vec![0; wire_len(content.len())];
        self.sealer.seal_from(last, content, &mut out).unwrap();
        self.wire.extend_from_slice(&out);
        self
    }

    fn record(&mut self, kind: u8, content: &[u8]) -> &mut Self {
        self.inner(&[content, &[kind]].concat())
    }

    fn key_update(&mut self, request: u8) -> &mut Self {
        self.record(content::HANDSHAKE, &[24, 0, 0, 1, request]);
        self.generation += 1;
        self.sealer = Sealer::new(0, secrets(self.generation)).unwrap();
        self
    }
}

/// Everything the reader makes of `wire`, in reads of `chunk` bytes: the data, then the
/// error that ended it (`None`: the peer's close_notify or the end of the bytes).
fn read_all(reader: &mut Reader, session: &mut Fake, wire: &[u8], chunk: usize) -> (Vec<u8>, Option<RecordError>) {
    let mut data = Vec::new();
    let mut fed = 0;
    let mut out = vec![0; chunk];
    loop {
        let mut buf = ReadBuf::new(&mut out);
        match reader.read(session, &mut buf) {
            Err(error) => return (data, Some(error)),
            Ok(true) if fed == wire.len() => return (data, None),
            Ok(true) => {
                let space = reader.space();
                let n = space.len().min(wire.len() - fed).min(chunk);
                space[..n].copy_from_slice(&wire[fed..fed + n]);
                fed += n;
                reader.received(n).unwrap();
            }
            Ok(false) if buf.filled().is_empty() => return (data, None),
            Ok(false) => data.extend_from_slice(buf.filled()),
        }
    }
}

fn run(wire: &[u8]) -> (Vec<u8>, Option<RecordError>, Reader, Fake) {
    let mut reader = Reader::new((0, secrets(0)), &[], &[]).unwrap();
    let mut session = Fake::default();
    let (data, error) = read_all(&mut reader, &mut session, wire, 1000);
    (data, error, reader, session)
}

fn alert_of(error: Option<RecordError>) -> Option<AlertDescription> {
    error.expect("the connection failed").alert()
}

#[test]
fn rfc8446_5_4_padding_is_stripped_and_the_type_is_the_last_non_zero_byte() {
    let mut peer = Peer::new();
    peer.inner(b"ab\0c\x17\0\0\0").inner(&[b"x\0".as_slice(), &[23], &[0; 200]].concat());
    let (data, error, ..) = run(&peer.wire);
    assert!(error.is_none());
    assert_eq!(data, b"ab\0cx\0");
}

#[test]
fn rfc8446_5_4_an_all_zero_inner_plaintext_is_unexpected_message() {
    // The data before it is handed out first, as rustls does; then the error.
    let (data, error, ..) = run(&Peer::new().record(content::APPLICATION_DATA, b"ok").inner(&[0; 9]).wire.clone());
    assert_eq!(data, b"ok");
    assert_eq!(alert_of(error), Some(AlertDescription::UnexpectedMessage));
}

#[test]
fn rfc8446_5_4_inner_plaintext_over_2_14_plus_1_bytes_is_record_overflow() {
    // 2^14 bytes of content and one of padding: within 2^14 + 256 of ciphertext, over
    // 2^14 + 1 of inner plaintext.
    let inner = [&[7u8; MAX_PLAINTEXT][..], &[23, 0]].concat();
    let (_, error, ..) = run(&Peer::new().inner(&inner).wire.clone());
    assert_eq!(alert_of(error), Some(AlertDescription::RecordOverflow));
    let (data, error, ..) = run(&Peer::new().inner(&inner[..MAX_PLAINTEXT + 1]).wire.clone());
    assert!(error.is_none() && data.len() == MAX_PLAINTEXT, "2^14 bytes of content are allowed");
}

#[test]
fn rfc8446_5_2_ciphertext_over_2_14_plus_256_bytes_is_record_overflow() {
    let mut wire = vec![23, 3, 3, 0x41, 0x01];
    wire.resize(HEADER + 0x4101, 0);
    assert_eq!(alert_of(run(&wire).1), Some(AlertDescription::RecordOverflow));
}

#[test]
fn rfc8446_5_2_a_record_that_fails_authentication_is_bad_record_mac() {
    let mut wire = Peer::new().record(content::APPLICATION_DATA, b"payload").wire.clone();
    wire[HEADER + 1] ^= 0x40;
    assert_eq!(alert_of(run(&wire).1), Some(AlertDescription::BadRecordMac));
    // Too short to hold a tag: no arithmetic on its length, bad_record_mac too.
    assert_eq!(alert_of(run(&[23, 3, 3, 0, 15]).1), Some(AlertDescription::BadRecordMac));
}

#[test]
fn rfc8446_5_1_zero_length_application_data_is_allowed() {
    let (data, error, ..) = run(&Peer::new()
        .record(content::APPLICATION_DATA, b"")
        .record(content::APPLICATION_DATA, b"after")
        .wire
        .clone());
    assert!(error.is_none());
    assert_eq!(data, b"after");
}

#[test]
fn thirty_two_empty_records_in_a_row_are_read_and_the_thirty_third_is_unexpected_message_as_rustls_says() {
    let peer = |empty: usize| {
        let mut peer = Peer::new();
        for round in 0..3 {
            for _ in 0..empty {
                peer.record(content::APPLICATION_DATA, b"");
            }
            // Data between the runs starts the count again.
            peer.record(content::APPLICATION_DATA, &[b'a' + round]);
        }
        peer.wire.clone()
    };
    for chunk in [1, 7, 4096] {
        let mut reader = Reader::new((0, secrets(0)), &[], &[]).unwrap();
        let (data, error) = read_all(&mut reader, &mut Fake::default(), &peer(32), chunk);
        assert!(error.is_none(), "chunk {chunk}: {error:?}");
        assert_eq!(data, b"abc");
        let mut reader = Reader::new((0, secrets(0)), &[], &[]).unwrap();
        let (data, error) = read_all(&mut reader, &mut Fake::default(), &peer(33), chunk);
        assert_eq!(alert_of(error), Some(AlertDescription::UnexpectedMessage), "chunk {chunk}");
        assert!(data.is_empty(), "nothing past the refused record: {data:?}");
    }
}

#[test]
fn rfc8446_5_1_a_zero_length_handshake_record_is_passed_over_as_rustls_does_and_counts_as_empty() {
    let mut peer = Peer::new();
    peer.record(content::APPLICATION_DATA, b"a")
        .record(content::HANDSHAKE, b"")
        .record(content::APPLICATION_DATA, b"b");
    let (data, error, ..) = run(&peer.wire.clone());
    assert!(error.is_none(), "{error:?}");
    assert_eq!(data, b"ab");
    for _ in 0..33 {
        peer.record(content::HANDSHAKE, b"");
    }
    let (_, error, ..) = run(&peer.wire);
    assert_eq!(alert_of(error), Some(AlertDescription::UnexpectedMessage), "the 33rd empty record in a row");
}

#[test]
fn rfc8446_5_1_a_fragmented_new_session_ticket_is_reassembled() {
    let ticket = [&[4u8, 0, 0, 10][..], b"0123456789"].concat();
    let mut peer = Peer::new();
    peer.record(content::HANDSHAKE, &ticket[..2])
        .record(content::HANDSHAKE, &ticket[2..7])
        .record(content::HANDSHAKE, &[&ticket[7..], &ticket[..]].concat())
        .record(content::APPLICATION_DATA, b"data");
    let (data, error, _, session) = run(&peer.wire);
    assert!(error.is_none(), "{error:?}");
    assert_eq!(data, b"data");
    assert_eq!(session.tickets, vec![b"0123456789".to_vec(); 2]);
}

#[test]
fn rfc8446_5_1_a_record_inside_a_fragmented_handshake_message_is_unexpected_message() {
    for kind in [content::APPLICATION_DATA, content::ALERT] {
        let wire = Peer::new().record(content::HANDSHAKE, &[4, 0, 0, 10, 1]).record(kind, &[1, 0]).wire.clone();
        assert_eq!(alert_of(run(&wire).1), Some(AlertDescription::UnexpectedMessage));
    }
}

#[test]
fn rfc8446_5_1_data_after_a_key_update_in_its_record_is_unexpected_message() {
    let ticket = [4u8, 0, 0, 2, 9, 9];
    let wire = Peer::new().record(content::HANDSHAKE, &[&[24, 0, 0, 1, 0][..], &ticket].concat()).wire.clone();
    assert_eq!(alert_of(run(&wire).1), Some(AlertDescription::UnexpectedMessage));
}

#[test]
fn rfc8446_5_1_a_post_handshake_message_over_64_kib_is_refused_before_it_is_buffered() {
    let wire = Peer::new().record(content::HANDSHAKE, &[4, 1, 0, 0, 0]).wire.clone();
    assert_eq!(alert_of(run(&wire).1), Some(AlertDescription::DecodeError));
    let mut peer = Peer::new();
    let len = MAX_HANDSHAKE_MESSAGE - 4;
    peer.record(content::HANDSHAKE, &[4, 0, (len >> 8) as u8, len as u8]);
    for _ in 0..3 {
        peer.record(content::HANDSHAKE, &[0; 16 * 1024]);
    }
    let (_, error, reader, _) = run(&peer.wire);
    assert!(error.is_none(), "{error:?}");
    assert!(reader.handshake.len() <= MAX_HANDSHAKE_MESSAGE, "a message's start, no more");
}

#[test]
fn rfc8446_5_change_cipher_spec_after_the_handshake_is_unexpected_message() {
    // Unprotected (outer type 20) and protected (inner type 20) alike.
    assert_eq!(alert_of(run(&[20, 3, 3, 0, 1, 1]).1), Some(AlertDescription::UnexpectedMessage));
    let wire = Peer::new().record(20, &[1]).wire.clone();
    assert_eq!(alert_of(run(&wire).1), Some(AlertDescription::UnexpectedMessage));
    let wire = Peer::new().record(99, b"unknown").wire.clone();
    assert_eq!(alert_of(run(&wire).1), Some(AlertDescription::UnexpectedMessage));
}

#[test]
fn rfc8446_4_6_3_a_key_update_with_an_illegal_request_is_illegal_parameter() {
    let wire = Peer::new().record(content::HANDSHAKE, &[24, 0, 0, 1, 2]).wire.clone();
    assert_eq!(alert_of(run(&wire).1), Some(AlertDescription::IllegalParameter));
    let wire = Peer::new().record(content::HANDSHAKE, &[24, 0, 0, 2, 0, 0]).wire.clone();
    assert_eq!(alert_of(run(&wire).1), Some(AlertDescription::DecodeError));
}

#[test]
fn rfc8446_4_6_3_key_updates_switch_keys_and_requests_are_answered_once() {
    let mut peer = Peer::new();
    peer.record(content::APPLICATION_DATA, b"a").key_update(1).record(content::APPLICATION_DATA, b"b");
    peer.key_update(1).key_update(0).record(content::APPLICATION_DATA, b"c");
    let (data, error, mut reader, session) = run(&peer.wire);
    assert!(error.is_none(), "{error:?}");
    assert_eq!((data.as_slice(), session.generation), (&b"abc"[..], 3));
    assert!(reader.take_update_requested(), "requested");
    assert!(!reader.take_update_requested(), "one answer for any number of requests");
}

#[test]
fn a_flood_of_key_updates_without_data_is_unexpected_message() {
    let mut peer = Peer::new();
    for _ in 0..33 {
        peer.key_update(1);
    }
    let (_, error, ..) = run(&peer.wire);
    assert_eq!(alert_of(error), Some(AlertDescription::UnexpectedMessage));
}

#[test]
fn a_new_session_ticket_to_a_server_is_unexpected_message_and_other_messages_too() {
    let wire = Peer::new().record(content::HANDSHAKE, &[4, 0, 0, 1, 0]).wire.clone();
    let mut reader = Reader::new((0, secrets(0)), &[], &[]).unwrap();
    let mut server = Fake { server: true, ..Fake::default() };
    let error = read_all(&mut reader, &mut server, &wire, 100).1;
    assert_eq!(alert_of(error), Some(AlertDescription::UnexpectedMessage));
    let wire = Peer::new().record(content::HANDSHAKE, &[13, 0, 0, 1, 0]).wire.clone();
    assert_eq!(alert_of(run(&wire).1), Some(AlertDescription::UnexpectedMessage));
}

#[test]
fn rfc8446_6_close_notify_ends_the_stream_and_any_other_alert_is_fatal() {
    let wire = Peer::new()
        .record(content::APPLICATION_DATA, b"last")
        .record(content::ALERT, &[1, 0])
        .record(content::APPLICATION_DATA, b"ignored")
        .wire
        .clone();
    let (data, error, reader, _) = run(&wire);
    assert!(error.is_none() && reader.closed());
    assert_eq!(data, b"last");
    // A warning-level alert other than close_notify and user_canceled is fatal too (§6.2),
    // and we answer none.
    let (_, error, ..) = run(&Peer::new().record(content::ALERT, &[1, 40]).wire.clone());
    let error = error.expect("fatal");
    assert!(matches!(error, RecordError::AlertReceived(AlertDescription::HandshakeFailure)));
    assert_eq!(error.alert(), None);
    // user_canceled is a closure alert (§6.1): fatal it ends the stream, a warning passes.
    let (_, error, ..) = run(&Peer::new().record(content::ALERT, &[2, 90]).wire.clone());
    assert!(matches!(error, Some(RecordError::AlertReceived(AlertDescription::UserCanceled))));
    let (_, error, ..) = run(&Peer::new().record(content::ALERT, &[2, 0, 0]).wire.clone());
    assert_eq!(alert_of(error), Some(AlertDescription::DecodeError));
}

/// As rustls: a user_canceled warning lets the stream go on, four warnings a connection
/// at most, the fifth an error.
#[test]
fn rfc8446_6_1_a_user_canceled_warning_passes_four_times_a_connection() {
    let mut peer = Peer::new();
    for round in 0..4u8 {
        peer.record(content::APPLICATION_DATA, &[b'a' + round]).record(content::ALERT, &[1, 90]);
    }
    let (data, error, reader, _) = run(&peer.wire.clone());
    assert!(error.is_none() && !reader.closed(), "{error:?}");
    assert_eq!(data, b"abcd");
    peer.record(content::APPLICATION_DATA, b"e")
        .record(content::ALERT, &[1, 90])
        .record(content::APPLICATION_DATA, b"f");
    let (data, error, ..) = run(&peer.wire);
    assert_eq!(data, b"abcde", "the data before the fifth warning, nothing after it");
    assert_eq!(alert_of(error), Some(AlertDescription::UnexpectedMessage));
}

#[test]
fn a_failure_is_reported_again_by_every_later_read() {
    let mut reader = Reader::new((0, secrets(0)), &[], &[]).unwrap();
    let mut session = Fake::default();
    let mut out = [0; 64];
    assert!(reader.received(0).is_err(), "a hang-up without close_notify");
    for _ in 0..2 {
        let error = reader.read(&mut session, &mut ReadBuf::new(&mut out)).unwrap_err();
        assert!(matches!(error, RecordError::Truncated(_)), "not a clean end: {error:?}");
    }
}

#[test]
fn a_flood_of_tiny_records_holds_no_more_memory() {
    // One-byte records (empty ones are capped at 32 in a row).
    let mut peer = Peer::new();
    for _ in 0..20_000 {
        peer.record(content::APPLICATION_DATA, b".");
    }
    peer.record(content::APPLICATION_DATA, b"end");
    let mut reader = Reader::new((0, secrets(0)), &[], &[]).unwrap();
    let held = reader.held();
    let (data, error) = read_all(&mut reader, &mut Fake::default(), &peer.wire, 7);
    assert!(error.is_none());
    assert_eq!(data.len(), 20_003);
    assert_eq!((&data[20_000..], reader.held()), (&b"end"[..], held));
}
