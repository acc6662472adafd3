//! The descriptor snapshot (`usbwire_proto::descriptors`), from both of its
//! untrusted sides, as two kinds of `op_phase` input:
//!
//! - the frame a server sends after `OP_REP_IMPORT` (the client decodes it):
//!   a frame that decodes re-encodes to exactly its bytes, and every answer
//!   the client would give is a prefix of the entry it came from and no
//!   longer than the request asked;
//! - the answers of a device to the server's snapshot plan (a hostile or
//!   broken device): the plan ends within `MAX_REQUESTS`, asks only standard
//!   `GET_DESCRIPTOR`s, and the snapshot it fills encodes within the frame's
//!   bounds and decodes back to itself.

use bytes::{Bytes, BytesMut};
use usbwire_proto::descriptors::plan::{Plan, MAX_REQUESTS};
use usbwire_proto::descriptors::{Entry, Snapshot, HEADER_LEN, MAX_LEN};

/// The client's side: `stream` is a snapshot frame.
pub(crate) fn snapshot_frame(stream: &[u8]) {
    let Some(header) = stream.first_chunk::<HEADER_LEN>() else { return };
    let Ok(len) = Snapshot::body_len(header) else { return };
    let Some(body) = stream.get(HEADER_LEN..HEADER_LEN + len) else { return };
    let Ok(snapshot) = Snapshot::decode(Bytes::copy_from_slice(body)) else { return };
    let mut encoded = BytesMut::new();
    snapshot.encode(&mut encoded);
    assert_eq!(&encoded[..], &stream[..HEADER_LEN + len], "a decoded frame re-encodes to its bytes");
    for entry in snapshot.entries() {
        let full = entry.data.len() as u16;
        for asked in [1, full.saturating_sub(1), full, full.saturating_add(1), u16::MAX] {
            let mut setup = [entry.request_type, 6, 0, 0, 0, 0, 0, 0];
            setup[2..4].copy_from_slice(&entry.value.to_le_bytes());
            setup[4..6].copy_from_slice(&entry.index.to_le_bytes());
            setup[6..8].copy_from_slice(&asked.to_le_bytes());
            match snapshot.answer(&setup) {
                Some(answer) => {
                    assert!(asked > 0 && answer.len() <= usize::from(asked), "never more than asked");
                    assert!(entry.data.starts_with(&answer), "what the device gave");
                    assert!(answer.len() == usize::from(asked) || entry.complete, "short only when complete");
                }
                None => assert!(asked == 0 || (asked > full && !entry.complete), "what it holds is answered"),
            }
        }
    }
}

/// The server's side: `stream` is the device's answers, each a length byte
/// (255: the request failed) and that many bytes, in the order the plan asks.
pub(crate) fn device_answers(stream: &[u8]) {
    let mut plan = Plan::new();
    let mut rest = stream;
    let mut requests = 0;
    while let Some(request) = plan.next_request() {
        requests += 1;
        assert!(requests <= MAX_REQUESTS, "the plan ends");
        assert!(matches!(request[0], 0x80 | 0x81) && request[1] == 6, "only standard GET_DESCRIPTORs: {request:02x?}");
        let Some((&len, after)) = rest.split_first() else { break };
        if len == 255 {
            rest = after;
            plan.answered(request, None);
            continue;
        }
        let take = usize::from(len).min(after.len());
        let (data, after) = after.split_at(take);
        rest = after;
        // A device may repeat its answer to fill a long request (a big configuration).
        let asked = usize::from(u16::from_le_bytes([request[6], request[7]]));
        let answer: Vec<u8> = data.iter().copied().cycle().take(if data.is_empty() { 0 } else { asked }).collect();
        plan.answered(request, Some(&answer[..answer.len().min(asked)]));
    }
    let snapshot = plan.finish();
    let mut encoded = BytesMut::new();
    snapshot.encode(&mut encoded);
    assert!(encoded.len() <= HEADER_LEN + MAX_LEN);
    let decoded =
        Snapshot::decode(encoded.freeze().slice(HEADER_LEN..)).expect("what a server encodes, a client decodes");
    assert_eq!(decoded, snapshot);
}

/// Seeds: a keyboard's snapshot frame, and a keyboard's answers to the plan.
pub(crate) fn seeds() -> [(&'static str, u8, Vec<u8>); 2] {
    let device = [18u8, 1, 0, 2, 0, 0, 0, 64, 0x09, 0x12, 0x01, 0, 0, 1, 1, 2, 3, 1];
    let mut configuration = vec![9u8, 2, 34, 0, 1, 1, 0, 0xa0, 50];
    configuration.extend([9, 4, 0, 0, 1, 3, 1, 1, 0, 9, 0x21, 0x11, 1, 0, 1, 0x22, 8, 0, 7, 5, 0x81, 3, 8, 0, 10]);
    let report = [0x05u8, 0x01, 0x09, 0x06, 0xa1, 0x01, 0xc0, 0x00];
    let languages = [4u8, 3, 0x09, 0x04];
    let product = [6u8, 3, b'k', 0, b'b', 0];
    let mut snapshot = Snapshot::default();
    for (request_type, value, index, data) in [
        (0x80, 0x0100, 0, &device[..]),
        (0x80, 0x0200, 0, &configuration[..]),
        (0x81, 0x2200, 0, &report[..]),
        (0x80, 0x0300, 0, &languages[..]),
        (0x80, 0x0302, 0x0409, &product[..]),
    ] {
        snapshot.insert(Entry { request_type, value, index, complete: true, data: Bytes::copy_from_slice(data) });
    }
    let mut frame = BytesMut::new();
    snapshot.encode(&mut frame);
    let mut answers = Vec::new();
    for data in [
        &device[..],
        &configuration[..9],
        &configuration[..],
        &report[..],
        &languages[..],
        &product[..],
        &[][..],
        &product[..],
    ] {
        answers.push(if data.is_empty() { 255 } else { data.len() as u8 });
        answers.extend_from_slice(data);
    }
    [("descriptor_snapshot_keyboard", 4, frame.to_vec()), ("descriptor_plan_keyboard", 5, answers)]
}
