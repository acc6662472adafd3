//! The `external_frames` harness: what a hostile device process sends the
//! server, through `usbwire_external::codec` and then the server's `Core`.
//!
//! Input: `[chunking] ++ stream`. The stream is decoded once whole and once in
//! chunks (sizes from `chunking`), then the decoded answers are handed to a
//! core that has a few requests of every kind pending.
//!
//! Invariants: no panic; chunked and one-shot decoding agree, message for
//! message and on the error; `Ok(None)` consumes nothing; every decoded frame
//! re-encodes to exactly the bytes it was decoded from; the core completes
//! each URB at most once, never holds more requests than were submitted, and
//! once the process is dropped every URB has completed exactly once.

use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use usbwire_device::descriptor::{ConfigurationBuilder, ConfigurationInfo, EndpointSpec};
use usbwire_device::{Direction, Speed, TransferFlags, Urb};
use usbwire_external::codec::{decode, CodecError, Message};
use usbwire_external::core::{Core, Gone, Layout};

pub fn external_frames(data: &[u8]) {
    let Some((&chunking, stream)) = data.split_first() else { return };
    let (whole, whole_error) = decode_all(stream, usize::MAX);
    let (chunked, chunked_error) = decode_all(stream, usize::from(chunking % 16) + 1);
    assert_eq!(whole, chunked, "chunked decoding agrees");
    assert_eq!(whole_error, chunked_error, "and fails the same");
    drive_core(whole, whole_error.is_some());
}

fn decode_all(stream: &[u8], chunk: usize) -> (Vec<Message>, Option<CodecError>) {
    let mut input = BytesMut::new();
    let mut messages = Vec::new();
    for piece in stream.chunks(chunk.min(stream.len().max(1))) {
        input.extend_from_slice(piece);
        loop {
            let before = input.clone();
            match decode(&mut input) {
                Ok(Some(message)) => {
                    let consumed = &before[..before.len() - input.len()];
                    let mut again = BytesMut::new();
                    message.encode(&mut again);
                    assert_eq!(&again[..], consumed, "{message:?} re-encodes to its bytes");
                    messages.push(message);
                }
                Ok(None) => {
                    assert_eq!(input, before, "Ok(None) consumes nothing");
                    break;
                }
                Err(error) => return (messages, Some(error)),
            }
        }
    }
    (messages, None)
}

fn drive_core(answers: Vec<Message>, broken_stream: bool) {
    let now = Instant::now();
    let config = ConfigurationBuilder::new(Speed::HIGH, 100)
        .interface(0, 2, 0xff, 0, 0, 0)
        .endpoint(EndpointSpec::bulk(0x81, Speed::HIGH))
        .endpoint(EndpointSpec::bulk(0x02, Speed::HIGH))
        .build();
    let mut core = Core::new(Duration::from_secs(5));
    core.set_layout(Layout::new(ConfigurationInfo::parse(&config).into_iter().collect()));
    let urbs = [
        (0, Direction::Out, [0x00, 0x09, 0x01, 0, 0, 0, 0, 0]),
        (0, Direction::In, [0x80, 0x06, 0x00, 0x01, 0, 0, 0x12, 0]),
        (1, Direction::In, [0; 8]),
        (2, Direction::Out, [0; 8]),
    ];
    let mut submitted = 0u32;
    let mut done = std::collections::HashSet::new();
    let mut cx = Context::from_waker(Waker::noop());
    let mut collect = |core: &mut Core| {
        while let Poll::Ready(completion) = core.poll_complete(&mut cx) {
            assert!(done.insert(completion.seqnum), "seqnum {} completed twice", completion.seqnum);
        }
    };
    for (round, answer) in answers.into_iter().enumerate() {
        if round % 2 == 0 {
            let (endpoint, direction, setup) = urbs[round / 2 % urbs.len()];
            submitted += 1;
            core.submit(urb(submitted, endpoint, direction, setup), now);
        }
        if let Err(error) = core.handle(answer) {
            core.close(Gone::Protocol(error));
        }
        collect(&mut core);
        assert!(core.pending() <= submitted as usize);
    }
    if broken_stream {
        core.close(Gone::Closed);
    }
    // What is not NAKed is overdue now; then the server lets the process go.
    core.handle_timeout(now + Duration::from_secs(6));
    core.close(Gone::Dropped);
    collect(&mut core);
    assert_eq!(core.pending(), 0);
    assert_eq!(done.len() as u32, submitted, "every URB completed exactly once");
}

fn urb(seqnum: u32, endpoint: u8, direction: Direction, setup: [u8; 8]) -> Urb {
    Urb {
        seqnum,
        endpoint,
        direction,
        setup,
        flags: TransferFlags(0),
        length: 64,
        data: if direction == Direction::Out && endpoint != 0 { Bytes::from_static(b"out") } else { Bytes::new() },
        start_frame: 0,
        interval: 0,
        number_of_packets: 0,
        iso_packets: Vec::new(),
    }
}
