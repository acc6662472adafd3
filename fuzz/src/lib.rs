//! Fuzz harnesses for the `usbwire-proto` decoders and the stream-transform frames of
//! `usbwire-transform` (what a peer sends once transforms are negotiated).
//!
//! Each harness takes one arbitrary byte string: a few control bytes (how to cut the
//! stream into reads, which [`Limits`], what the caller knows about endpoints or
//! submitted URBs) followed by the byte stream a peer would send. The stream is decoded
//! twice, once from a single buffer and once fed in chunks as a socket would deliver
//! it, and these invariants are asserted:
//!
//! - no panic, and no allocation sized by a length the input has not backed with bytes
//!   (the `replay` binary and libFuzzer's `-malloc_limit_mb` catch those);
//! - `Ok(None)` leaves the buffer exactly as it was (nothing consumed);
//! - a decoded message is consumed from the front, and re-encoding it gives back the
//!   consumed bytes (every field the decoder keeps; padding and ignored fields excepted)
//!   and decodes again to the same message;
//! - chunked and one-shot decoding produce the same messages and the same error;
//! - `urb::command_frame_len` agrees with what `urb::decode_command` consumes.
//!
//! The cargo-fuzz targets (`fuzz_targets/*.rs`) and the stable-Rust `replay` binary
//! both call these functions, so a crash found by one reproduces with the other.

use std::cell::Cell;
use std::fmt::Debug;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use usbwire_proto::op::{self, DeviceRecord, OpRequest, OpStatus};
use usbwire_proto::urb::{self, ClientMessage, ServerMessage, SubmittedShape};
use usbwire_proto::{DecodeError, Direction, Limits};
use usbwire_transform::{Frame, Pipeline, Side, TransformSpec, FRAME_HEADER_LEN, MAX_FRAME_PAYLOAD};

mod client;
mod descriptors;
mod dfu;
mod external;
mod lab;
mod model_server;
mod recording;
mod redir;
mod redir_bridge;
mod redir_host;
pub mod seeds;
mod session;
mod storage;
mod tls_differential;
mod tls_pair;
mod tls_records;

pub use client::client_session;
pub use dfu::dfu_control;
pub use external::external_frames;
pub use lab::lab_catalog;
pub use recording::recording;
pub use redir::redir_packets;
pub use redir_bridge::redir_bridge;
pub use redir_host::redir_host;
pub use session::{server_session, CountingAllocator};
pub use storage::storage_accelerator;
pub use tls_differential::tls_differential;
pub use tls_pair::tls_pair;
pub use tls_records::tls_records;

/// A harness: one fuzz input in, panics on a broken invariant.
pub type Harness = fn(&[u8]);

/// The fuzz targets, by name.
pub const TARGETS: [(&str, Harness); 17] = [
    ("decode_command", decode_command),
    ("decode_return", decode_return),
    ("op_phase", op_phase),
    ("transform_frames", transform_frames),
    ("server_session", server_session),
    ("client_session", client_session),
    ("redir_packets", redir_packets),
    ("redir_host", redir_host),
    ("dfu_control", dfu_control),
    ("redir_bridge", redir_bridge),
    ("external_frames", external_frames),
    ("tls_records", tls_records),
    ("tls_pair", tls_pair),
    ("tls_differential", tls_differential),
    ("storage_accelerator", storage_accelerator),
    ("recording", recording),
    ("lab_catalog", lab_catalog),
];

/// Server side: `[chunking, limits, iso_mode] ++ stream` through `urb::decode_command`.
///
/// `iso_mode` picks the endpoint table: 0 no endpoint is isochronous, 1 all are,
/// 2 odd endpoint numbers are, 3 IN endpoints are.
pub fn decode_command(data: &[u8]) {
    let Some((&[chunking, limits, iso_mode], stream)) = split_control::<3>(data) else { return };
    let limits = limits_from(limits);
    let is_iso = move |direction: Direction, ep: u8| match iso_mode % 4 {
        0 => false,
        1 => true,
        2 => ep % 2 == 1,
        _ => direction == Direction::In,
    };
    let decode = |buf: &mut BytesMut| {
        let frame = urb::command_frame_len(buf, &limits, is_iso);
        let before = buf.len();
        let decoded = urb::decode_command(buf, &limits, is_iso);
        match (&frame, &decoded) {
            (Err(a), Err(b)) => assert_eq!(a, b, "command_frame_len and decode_command disagree"),
            (Ok(None), Ok(None)) => {}
            (Ok(Some(n)), Ok(None)) => assert!(before < *n, "{before} bytes buffered, frame is {n}, not decoded"),
            (Ok(Some(n)), Ok(Some(_))) => assert_eq!(before - buf.len(), *n, "frame length != bytes consumed"),
            // Descriptor checks need the whole frame: only then can decoding fail where
            // the header alone looked fine.
            (Ok(Some(n)), Err(_)) => assert!(before >= *n),
            _ => panic!("command_frame_len {frame:?} but decode_command {decoded:?}"),
        }
        decoded
    };
    let check = |message: &ClientMessage, consumed: &[u8]| {
        let encoded = encode_client(message);
        assert_eq!(encoded.len(), consumed.len(), "re-encoded length");
        match message {
            // Every byte of a CMD_SUBMIT is a field the decoder keeps.
            ClientMessage::Submit(_) => assert_eq!(encoded, consumed, "CMD_SUBMIT re-encodes differently"),
            // direction and ep (0x0C..0x14) are not kept (vhci sends 0), 0x18.. is padding.
            ClientMessage::Unlink(_) => {
                assert_eq!(encoded[..0x0c], consumed[..0x0c], "CMD_UNLINK basic header");
                assert_eq!(encoded[0x14..0x18], consumed[0x14..0x18], "CMD_UNLINK unlink_seqnum");
            }
        }
        let mut again = BytesMut::from(&encoded[..]);
        assert_eq!(urb::decode_command(&mut again, &limits, is_iso), Ok(Some(message.clone())), "round trip");
        assert!(again.is_empty());
    };
    drive(stream, chunking, decode, check);
}

/// Client side: `[chunking, limits, flags, tbl (4, BE), np (i8)] ++ stream` through
/// `urb::decode_return`.
///
/// The submitted shape for every seqnum: direction IN if `flags & 1`; isochronous if
/// `flags & 2`, with the packet count taken from the reply header itself if `flags & 4`
/// (so counts match and descriptors get parsed) or from the `np` byte otherwise; seqnums
/// divisible by 5 are unknown if `flags & 8`.
pub fn decode_return(data: &[u8]) {
    let Some((&[chunking, limits, flags, t0, t1, t2, t3, np], stream)) = split_control::<8>(data) else { return };
    let limits = limits_from(limits);
    let transfer_buffer_length = u32::from_be_bytes([t0, t1, t2, t3]);
    let header_np = Cell::new(0i32);
    let shape = |seqnum: u32| {
        if flags & 8 != 0 && seqnum.is_multiple_of(5) {
            return None;
        }
        let iso_packets = (flags & 2 != 0).then(|| if flags & 4 != 0 { header_np.get() } else { i32::from(np as i8) });
        let direction = if flags & 1 != 0 { Direction::In } else { Direction::Out };
        Some(SubmittedShape { direction, transfer_buffer_length, iso_packets })
    };
    let decode = |buf: &mut BytesMut| {
        if buf.len() >= 0x24 {
            header_np.set(i32::from_be_bytes([buf[0x20], buf[0x21], buf[0x22], buf[0x23]]));
        }
        urb::decode_return(buf, &limits, shape)
    };
    let check = |message: &ServerMessage, consumed: &[u8]| {
        let encoded = encode_server(message);
        assert_eq!(encoded.len(), consumed.len(), "re-encoded length");
        // devid, direction and ep (0x08..0x14) are not kept: replies carry 0 there.
        assert_eq!(encoded[..0x08], consumed[..0x08]);
        match message {
            ServerMessage::Submit(_) => {
                assert_eq!(encoded[0x14..0x28], consumed[0x14..0x28], "RET_SUBMIT header");
                assert_eq!(encoded[0x30..], consumed[0x30..], "RET_SUBMIT payload or descriptors");
            }
            ServerMessage::Unlink(_) => assert_eq!(encoded[0x14..0x18], consumed[0x14..0x18], "RET_UNLINK status"),
        }
        let mut again = BytesMut::from(&encoded[..]);
        assert_eq!(decode(&mut again), Ok(Some(message.clone())), "round trip");
        assert!(again.is_empty());
    };
    drive(stream, chunking, &decode, check);
}

/// OP phase: `[chunking, limits, which] ++ stream`; `which % 6` selects
/// `op::decode_request` (server side), `op::decode_devlist_reply`,
/// `op::decode_import_reply` or `op::decode_devstate_reply` (client side),
/// or the descriptor snapshot: its frame (client side), or a device's answers
/// to the plan that fills it (server side; `descriptors`).
pub fn op_phase(data: &[u8]) {
    let Some((&[chunking, limits, which], stream)) = split_control::<3>(data) else { return };
    let limits = limits_from(limits);
    match which % 6 {
        4 => descriptors::snapshot_frame(stream),
        5 => descriptors::device_answers(stream),
        0 => drive(
            stream,
            chunking,
            |buf| op::decode_request(buf, &limits),
            |request: &OpRequest, consumed| {
                let mut encoded = BytesMut::new();
                request.encode(&mut encoded);
                assert_eq!(encoded.len(), consumed.len());
                assert_eq!(encoded[..op::OP_HEADER_LEN], consumed[..op::OP_HEADER_LEN]);
                // The busid, valid or not, is the bytes sent up to the NUL.
                let requested = match request {
                    OpRequest::Import { busid } => Some(busid.as_str().as_bytes()),
                    OpRequest::ImportMalformedBusId { requested } => Some(&requested[..]),
                    OpRequest::DevList
                    | OpRequest::DevState
                    | OpRequest::Transforms { .. }
                    | OpRequest::Resume { .. } => None,
                };
                if let Some(requested) = requested {
                    let sent = &consumed[op::OP_HEADER_LEN..];
                    assert!(sent.starts_with(requested) && sent[requested.len()] == 0, "busid {requested:?}");
                }
                assert_eq!(op::decode_request(&mut encoded, &limits), Ok(Some(request.clone())));
            },
        ),
        1 => drive(
            stream,
            chunking,
            |buf| op::decode_devlist_reply(buf, &limits),
            |devices: &Vec<DeviceRecord>, consumed| {
                let mut encoded = BytesMut::new();
                op::encode_devlist_reply(devices, &mut encoded);
                assert_eq!(encoded.len(), consumed.len());
                assert_eq!(encoded[..12], consumed[..12], "header and ndev");
                let mut at = 12;
                for device in devices {
                    assert_eq!(device.interfaces.len(), usize::from(device.b_num_interfaces));
                    check_device_record(&encoded[at..], &consumed[at..]);
                    at += op::DEVICE_RECORD_LEN;
                    for _ in 0..device.b_num_interfaces {
                        // The fourth byte is padding.
                        assert_eq!(encoded[at..at + 3], consumed[at..at + 3], "interface record");
                        at += op::INTERFACE_RECORD_LEN;
                    }
                }
                let again = op::decode_devlist_reply(&mut encoded, &limits).expect("re-decode").expect("complete");
                assert_eq!(again.len(), devices.len());
                for (again, device) in again.iter().zip(devices) {
                    same_device(again, device);
                }
            },
        ),
        3 => drive(stream, chunking, op::decode_devstate_reply, |body: &Vec<u8>, consumed| {
            assert!(body.len() <= op::MAX_DEVSTATE_LEN as usize);
            let mut encoded = BytesMut::new();
            op::encode_devstate_reply(body, &mut encoded);
            assert_eq!(&encoded[..], consumed);
        }),
        _ => drive(stream, chunking, op::decode_import_reply, |reply: &Result<DeviceRecord, OpStatus>, consumed| {
            let mut encoded = BytesMut::new();
            op::encode_import_reply(reply.as_ref().map_err(|status| *status), &mut encoded);
            assert_eq!(encoded.len(), consumed.len());
            assert_eq!(encoded[..op::OP_HEADER_LEN], consumed[..op::OP_HEADER_LEN]);
            match reply {
                Ok(device) => {
                    assert!(device.interfaces.is_empty(), "an import reply lists no interfaces");
                    check_device_record(&encoded[op::OP_HEADER_LEN..], &consumed[op::OP_HEADER_LEN..]);
                    let again = op::decode_import_reply(&mut encoded).expect("re-decode").expect("complete");
                    same_device(&again.expect("status ok"), device);
                }
                Err(status) => assert_ne!(*status, OpStatus::OK),
            }
        }),
    }
}

/// Client side of a transformed stream: `[chunking, stack] ++ stream` through
/// `Frame::decode` and a client `Pipeline`. `stack % 3` picks the compressor (none, zstd,
/// lz4), `stack & 4` adds a jitter buffer (its release times are checked too).
///
/// Beyond the common invariants: a decoded frame never holds more than a sender puts in
/// one (`MAX_FRAME_PAYLOAD`, so no decompression bomb), the jitter buffer never holds a
/// frame past its playout nor releases out of order, and every decoded payload, sent
/// back through a server pipeline, comes out of a fresh client pipeline unchanged.
pub fn transform_frames(data: &[u8]) {
    let Some((&[chunking, stack], stream)) = split_control::<2>(data) else { return };
    let playout = Duration::from_millis(5);
    let mut specs = match stack % 3 {
        0 => vec![],
        1 => vec![TransformSpec::Zstd],
        _ => vec![TransformSpec::Lz4],
    };
    if stack & 4 != 0 {
        specs.push(TransformSpec::Jitter(playout));
    }
    let start = Instant::now();
    // Frames decoded (payload, release offset) and the error that ended the stream, if any.
    let decode_all = |pieces: Vec<&[u8]>| {
        let mut pipeline = Pipeline::new(&specs, Side::Client);
        let mut raw = BytesMut::new();
        let mut frames = Vec::new();
        let mut last_release = start;
        // `raw` holds stream[consumed..fed]: compared against, never cloned.
        let (mut fed, mut consumed) = (0, 0);
        for (i, piece) in pieces.into_iter().enumerate() {
            // Each piece arrives 1 ms after the one before.
            let arrived = start + Duration::from_millis(i as u64);
            raw.extend_from_slice(piece);
            fed += piece.len();
            loop {
                let before_len = raw.len();
                let mut frame = match Frame::decode(&mut raw) {
                    Ok(Some(frame)) => frame,
                    Ok(None) => {
                        assert!(raw[..] == stream[consumed..fed], "Ok(None) consumed input");
                        break;
                    }
                    Err(error) => return (frames, Some(error.to_string())),
                };
                consumed += before_len - raw.len();
                assert_eq!(before_len - raw.len(), FRAME_HEADER_LEN + frame.payload.len(), "frame length");
                if let Err(error) = pipeline.decode(&mut frame) {
                    return (frames, Some(error.to_string()));
                }
                assert!(frame.payload.len() <= MAX_FRAME_PAYLOAD, "a frame decoded to {} bytes", frame.payload.len());
                let release = pipeline.release_at(&frame, arrived);
                assert!(release >= arrived && release >= last_release, "released early or out of order");
                assert!(release <= arrived + playout, "held past the playout");
                last_release = release;
                frames.push(frame.payload.to_vec());
            }
        }
        (frames, None)
    };
    let (frames, error) = decode_all(vec![stream]);
    let (chunked_frames, chunked_error) = decode_all(chunks(stream, chunking));
    // Chunks arrive later than the whole, so only the payloads and the outcome compare.
    assert_eq!(frames, chunked_frames, "one-shot and chunked decoding differ");
    assert_eq!(error.is_some(), chunked_error.is_some(), "one-shot {error:?}, chunked {chunked_error:?}");
    let mut sender = Pipeline::new(&specs, Side::Server);
    let mut receiver = Pipeline::new(&specs, Side::Client);
    for payload in frames {
        let mut frame = Frame { flags: 0, sent_at_us: 0, payload: BytesMut::from(&payload[..]) };
        sender.encode(&mut frame);
        let mut wire = BytesMut::from(&frame.header()[..]);
        wire.extend_from_slice(&frame.payload);
        let mut back = Frame::decode(&mut wire).expect("our own frame").expect("whole");
        receiver.decode(&mut back).expect("our own frame decodes");
        assert_eq!(back.payload, payload, "round trip");
    }
}

/// Splits off `N` control bytes; inputs shorter than that are not interesting.
fn split_control<const N: usize>(data: &[u8]) -> Option<(&[u8; N], &[u8])> {
    let (control, stream) = data.split_first_chunk::<N>()?;
    Some((control, stream))
}

/// Default limits, tight ones (so limit checks are hit by small inputs), no limits at
/// all (so only the input's own size bounds anything), or zero.
pub fn limits_from(byte: u8) -> Limits {
    match byte % 4 {
        0 => Limits::default(),
        1 => Limits { max_transfer_length: 256, max_iso_packets: 4, max_devices: 2 },
        2 => Limits { max_transfer_length: u32::MAX, max_iso_packets: u32::MAX, max_devices: u32::MAX },
        _ => Limits { max_transfer_length: 0, max_iso_packets: 0, max_devices: 0 },
    }
}

/// Read sizes: everything at once, one byte at a time, or pseudo-random sizes
/// (small or up to 512 bytes), seeded by the control byte.
fn chunks(stream: &[u8], chunking: u8) -> Vec<&[u8]> {
    let mut state = u32::from(chunking) | 0x9e37_0000;
    let mut next_size = |max: u32| {
        // xorshift32: deterministic, so a failing input replays exactly.
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        1 + (state % max) as usize
    };
    let mut out = Vec::new();
    let mut rest = stream;
    while !rest.is_empty() {
        let size = match chunking % 4 {
            0 => rest.len(),
            1 => 1,
            2 => next_size(16),
            _ => next_size(512),
        }
        .min(rest.len());
        let (chunk, tail) = rest.split_at(size);
        out.push(chunk);
        rest = tail;
    }
    out
}

/// Decodes `stream` in one buffer and again in chunks, asserting the invariants in the
/// crate docs; `check` is given each message and the bytes it was decoded from.
fn drive<M: PartialEq + Debug>(
    stream: &[u8],
    chunking: u8,
    mut decode: impl FnMut(&mut BytesMut) -> Result<Option<M>, DecodeError>,
    mut check: impl FnMut(&M, &[u8]),
) {
    let mut one_shot = Vec::new();
    let mut buf = BytesMut::from(stream);
    decode_available(&mut buf, stream, &mut 0, &mut decode, &mut check, &mut one_shot);

    let mut chunked = Vec::new();
    let mut buf = BytesMut::new();
    let (mut fed, mut consumed) = (0, 0);
    for chunk in chunks(stream, chunking) {
        buf.extend_from_slice(chunk);
        fed += chunk.len();
        if !decode_available(&mut buf, &stream[..fed], &mut consumed, &mut decode, &mut check, &mut chunked) {
            break;
        }
    }
    assert_eq!(one_shot, chunked, "one-shot and chunked decoding differ");
}

/// Decodes every complete message in `buf`, which holds `fed[*consumed..]` (the
/// harness knows what it fed, so no copy of the buffer is taken per call: fed a
/// byte at a time, that copy made every input quadratic); false once an error
/// ended the stream.
fn decode_available<M: PartialEq + Debug>(
    buf: &mut BytesMut,
    fed: &[u8],
    consumed: &mut usize,
    decode: &mut impl FnMut(&mut BytesMut) -> Result<Option<M>, DecodeError>,
    check: &mut impl FnMut(&M, &[u8]),
    results: &mut Vec<Result<M, DecodeError>>,
) -> bool {
    loop {
        let before = &fed[*consumed..];
        let (before_ptr, before_len) = (buf.as_ptr(), buf.len());
        match decode(buf) {
            Ok(None) => {
                // Decoders read through `&mut`: consuming moves the start or the end.
                assert!(buf.as_ptr() == before_ptr && buf.len() == before_len, "Ok(None) consumed input");
                // The bytes themselves once per read, where a clone would be per message.
                if buf.len() != before.len() || buf[..] != *before {
                    panic!("Ok(None) changed the buffer");
                }
                return true;
            }
            Ok(Some(message)) => {
                let taken = before.len() - buf.len();
                assert!(taken > 0, "a message from no bytes");
                assert_eq!(before[taken..], buf[..], "consumed from somewhere other than the front");
                check(&message, &before[..taken]);
                *consumed += taken;
                results.push(Ok(message));
            }
            Err(error) => {
                results.push(Err(error));
                return false;
            }
        }
    }
}

/// The numeric part of `usbip_usb_device` (0x120..0x138) is kept whole; the strings are
/// kept up to their NUL.
fn check_device_record(encoded: &[u8], consumed: &[u8]) {
    let numbers = op::PATH_LEN + op::BUSID_LEN..op::DEVICE_RECORD_LEN;
    assert_eq!(encoded[numbers.clone()], consumed[numbers], "usbip_usb_device numeric fields");
    let busid = op::PATH_LEN..op::PATH_LEN + op::BUSID_LEN;
    assert_eq!(encoded[busid.clone()].split(|&b| b == 0).next(), consumed[busid].split(|&b| b == 0).next(), "busid");
}

/// Equality after an encode/decode cycle. The path is informational and decoded lossily
/// (a byte that is not UTF-8 becomes U+FFFD, three bytes), so a path that grew past the
/// 255-byte field comes back cut at a character boundary.
fn same_device(again: &DeviceRecord, device: &DeviceRecord) {
    if device.path.len() < op::PATH_LEN {
        assert_eq!(again, device);
    } else {
        assert!(device.path.starts_with(&again.path) && again.path.len() < op::PATH_LEN, "path cut");
        assert_eq!(DeviceRecord { path: device.path.clone(), ..again.clone() }, *device);
    }
}

fn encode_client(message: &ClientMessage) -> Vec<u8> {
    let mut out = BytesMut::new();
    match message {
        ClientMessage::Submit(submit) => submit.encode(&mut out),
        ClientMessage::Unlink(unlink) => out.extend_from_slice(&unlink.header()),
    }
    out.to_vec()
}

fn encode_server(message: &ServerMessage) -> Vec<u8> {
    let mut out = BytesMut::new();
    match message {
        ServerMessage::Submit(ret) => ret.encode(&mut out),
        ServerMessage::Unlink(ret) => out.extend_from_slice(&ret.header()),
    }
    out.to_vec()
}
