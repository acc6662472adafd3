//! The core's rules, one request at a time, with a hand-driven clock.

use std::task::{Context, Poll, Waker};

use usbwire_device::descriptor::{ConfigurationBuilder, EndpointSpec};
use usbwire_device::{Speed, TransferFlags};

use super::*;
use crate::codec::decode;

fn urb(seqnum: u32, endpoint: u8, direction: Direction, setup: [u8; 8], length: u32, data: &'static [u8]) -> Urb {
    Urb {
        seqnum,
        endpoint,
        direction,
        setup,
        flags: TransferFlags(0),
        length,
        data: Bytes::from_static(data),
        start_frame: 0,
        interval: 0,
        number_of_packets: 0,
        iso_packets: Vec::new(),
    }
}

const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];
const GET_STATUS: [u8; 8] = [0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00];

/// A core for a device with bulk IN 0x81 and bulk OUT 0x02, configured.
fn configured(now: Instant) -> Core {
    let config = ConfigurationBuilder::new(Speed::HIGH, 100)
        .interface(0, 2, 0xff, 0, 0, 0)
        .endpoint(EndpointSpec::bulk(0x81, Speed::HIGH))
        .endpoint(EndpointSpec::bulk(0x02, Speed::HIGH))
        .build();
    let mut core = Core::new(Duration::from_secs(5));
    core.set_layout(Layout::new(vec![ConfigurationInfo::parse(&config).unwrap()]));
    core.submit(urb(1, 0, Direction::Out, SET_CONFIGURATION_1, 0, b""), now);
    core.handle(Message::Ack { id: 1 }).unwrap();
    assert_eq!(completions(&mut core)[0].status, Status::OK);
    sent(&mut core);
    core
}

fn completions(core: &mut Core) -> Vec<Completion> {
    let mut cx = Context::from_waker(Waker::noop());
    let mut done = Vec::new();
    while let Poll::Ready(completion) = core.poll_complete(&mut cx) {
        done.push(completion);
    }
    done
}

fn sent(core: &mut Core) -> Vec<Message> {
    let mut bytes = BytesMut::new();
    while let Some(piece) = core.poll_transmit() {
        bytes.extend_from_slice(&piece);
    }
    std::iter::from_fn(|| decode(&mut bytes).unwrap()).collect()
}

#[test]
fn endpoints_exist_only_once_configured() {
    let now = Instant::now();
    let mut core = Core::new(Duration::from_secs(5));
    core.submit(urb(1, 1, Direction::In, [0; 8], 64, b""), now);
    assert_eq!(completions(&mut core)[0].status, Status::EPIPE, "no configuration yet");
    let mut core = configured(now);
    core.submit(urb(2, 1, Direction::In, [0; 8], 64, b""), now);
    assert_eq!(sent(&mut core), [Message::In { id: 2, endpoint: 1, length: 64 }]);
    core.submit(urb(3, 3, Direction::Out, [0; 8], 1, b"x"), now);
    assert_eq!(completions(&mut core)[0].status, Status::EPIPE, "no endpoint 3");
}

#[test]
fn a_nak_lets_an_in_request_wait_but_not_a_control_request() {
    let now = Instant::now();
    let mut core = configured(now);
    core.submit(urb(2, 1, Direction::In, [0; 8], 64, b""), now);
    core.handle(Message::Nak { id: 2 }).unwrap();
    assert_eq!(core.poll_timeout(), None, "a NAKed IN waits as long as the device likes");
    core.submit(urb(3, 0, Direction::In, GET_STATUS, 2, b""), now);
    core.handle(Message::Nak { id: 3 }).unwrap();
    assert_eq!(core.poll_timeout(), Some(now + Duration::from_secs(5)), "a control request must finish");
    core.handle_timeout(now + Duration::from_secs(5));
    let done = completions(&mut core);
    let status: Vec<_> = done.iter().map(|c| (c.seqnum, c.status)).collect();
    assert_eq!(status, [(2, Status::ESHUTDOWN), (3, Status::ETIMEDOUT)]);
    assert!(matches!(core.gone(), Some(Gone::TimedOut { id: 3, .. })));
    core.submit(urb(4, 0, Direction::In, GET_STATUS, 2, b""), now);
    assert_eq!(completions(&mut core)[0].status, Status::ESHUTDOWN, "later URBs end at once");
}

#[test]
fn answers_on_one_endpoint_come_in_order() {
    let now = Instant::now();
    let mut core = configured(now);
    core.submit(urb(2, 1, Direction::In, [0; 8], 64, b""), now);
    core.submit(urb(3, 1, Direction::In, [0; 8], 64, b""), now);
    core.submit(urb(4, 2, Direction::Out, [0; 8], 2, b"hi"), now);
    core.handle(Message::Ack { id: 4 }).unwrap();
    assert_eq!(
        core.handle(Message::Data { id: 3, data: Bytes::new() }),
        Err(ProtocolError::OutOfOrder { id: 3, oldest: 2 })
    );
    core.handle(Message::Data { id: 2, data: Bytes::from_static(b"ab") }).unwrap();
    let done = completions(&mut core);
    assert_eq!((done[0].seqnum, done[0].actual_length), (4, 2));
    assert_eq!((done[1].seqnum, &done[1].data[..]), (2, &b"ab"[..]));
}

#[test]
fn cancelled_requests_end_at_once_and_late_answers_are_ignored() {
    let now = Instant::now();
    let mut core = configured(now);
    core.submit(urb(2, 1, Direction::In, [0; 8], 64, b""), now);
    core.cancel(2);
    assert_eq!(completions(&mut core)[0].status, Status::ECONNRESET);
    assert_eq!(sent(&mut core), [Message::In { id: 2, endpoint: 1, length: 64 }, Message::Cancel { id: 2 }]);
    core.handle(Message::Data { id: 2, data: Bytes::from_static(b"late") }).unwrap();
    assert!(completions(&mut core).is_empty());
    assert_eq!(core.handle(Message::Ack { id: 99 }), Err(ProtocolError::NeverIssued(99)));
    assert_eq!(
        core.handle(Message::Welcome { version: 1, max_frame_len: 9 }),
        Err(ProtocolError::Unexpected(MessageType::WELCOME))
    );
}

#[test]
fn a_reset_abandons_everything_and_unconfigures() {
    let now = Instant::now();
    let mut core = configured(now);
    core.submit(urb(2, 1, Direction::In, [0; 8], 64, b""), now);
    core.submit(urb(3, 0, Direction::In, GET_STATUS, 2, b""), now);
    core.handle(Message::Data { id: 3, data: Bytes::from_static(b"\0\0") }).unwrap();
    core.reset();
    assert!(completions(&mut core).is_empty(), "abandoned, collected or not");
    assert_eq!(core.pending(), 0);
    assert_eq!(core.endpoint_type(Direction::In, 1), None);
    assert_eq!(sent(&mut core).last(), Some(&Message::Reset));
}

#[test]
fn more_in_data_than_asked_for_is_babble() {
    let now = Instant::now();
    let mut core = configured(now);
    core.submit(urb(2, 1, Direction::In, [0; 8], 2, b""), now);
    core.handle(Message::Data { id: 2, data: Bytes::from_static(b"abc") }).unwrap();
    let done = completions(&mut core);
    assert_eq!((done[0].status, done[0].actual_length), (Status::EOVERFLOW, 2));
    core.submit(urb(3, 2, Direction::Out, [0; 8], 1, b"x"), now);
    let error = core.handle(Message::Data { id: 3, data: Bytes::new() }).unwrap_err();
    assert_eq!(error, ProtocolError::DataForOut(3));
    core.close(Gone::Protocol(error));
    let done = completions(&mut core);
    assert_eq!((done[0].seqnum, done[0].status), (3, Status::ESHUTDOWN), "regression: its URB still completes");
}

#[test]
fn a_port_reset_is_a_reset() {
    let now = Instant::now();
    let mut core = configured(now);
    core.submit(urb(2, 0, Direction::Out, [0x23, 0x03, 0x04, 0x00, 0x01, 0x00, 0x00, 0x00], 0, b""), now);
    assert_eq!(completions(&mut core)[0].status, Status::OK);
    assert_eq!(sent(&mut core), [Message::Reset]);
}

#[test]
fn pending_requests_are_bounded() {
    let now = Instant::now();
    let mut core = configured(now);
    for seqnum in 0..=MAX_PENDING as u32 {
        core.submit(urb(seqnum + 10, 1, Direction::In, [0; 8], 8, b""), now);
    }
    assert_eq!(core.pending(), MAX_PENDING);
    let done = completions(&mut core);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].status, ENOMEM);
}
