//! Property tests for every decoder:
//!
//! - round trip: `decode(encode(m)) == m` for every message type;
//! - incremental input: every prefix of an encoding decodes to `Ok(None)` without consuming
//!   anything, and any split into chunks (of a stream of several messages) decodes the same;
//! - hostile input: arbitrary bytes, and valid encodings with bytes overwritten, never panic
//!   and never consume on `Ok(None)`.
//!
//! Allocation bounds are in `tests/allocation.rs` (it needs its own global allocator).

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use proptest::sample::Index;
use usbwire_proto::op::{self, BusId, DeviceRecord, InterfaceRecord, OpRequest, OpStatus};
use usbwire_proto::urb::{
    self, ClientMessage, CmdSubmit, CmdUnlink, IsoPacketDescriptor, RetSubmit, RetUnlink, ServerMessage,
    SubmittedShape, TransferFlags,
};
use usbwire_proto::{DecodeError, Direction, Limits, Speed, Status};

// ---------------------------------------------------------------------------------------
// Strategies

fn busid() -> impl Strategy<Value = BusId> {
    "[!-~]{1,31}".prop_map(|text| BusId::new(&text).expect("printable ascii, 1..=31 bytes"))
}

fn interface() -> impl Strategy<Value = InterfaceRecord> {
    any::<[u8; 3]>().prop_map(|[class, sub, protocol]| InterfaceRecord {
        b_interface_class: class,
        b_interface_sub_class: sub,
        b_interface_protocol: protocol,
    })
}

/// A device as a devlist carries it (interfaces listed) or, with `listed = false`, as an
/// import reply does (only their count). Paths are any text without NUL that fits the
/// 256-byte field, non-ASCII included.
fn device(listed: bool) -> impl Strategy<Value = DeviceRecord> {
    (
        "[^\u{0}]{0,60}".prop_filter("fits the path field", |p| p.len() < op::PATH_LEN),
        busid(),
        any::<(u32, u32, u32, u16, u16, u16)>(),
        any::<[u8; 6]>(),
        prop::collection::vec(interface(), 0..6),
    )
        .prop_map(move |(path, busid, (busnum, devnum, speed, vendor, product, bcd), b, interfaces)| {
            let (interfaces, count) =
                if listed { (interfaces.clone(), interfaces.len() as u8) } else { (vec![], b[5]) };
            DeviceRecord {
                path,
                busid,
                busnum,
                devnum,
                speed: Speed(speed),
                id_vendor: vendor,
                id_product: product,
                bcd_device: bcd,
                b_device_class: b[0],
                b_device_sub_class: b[1],
                b_device_protocol: b[2],
                b_configuration_value: b[3],
                b_num_configurations: b[4],
                interfaces,
                b_num_interfaces: count,
            }
        })
}

fn op_request() -> impl Strategy<Value = OpRequest> {
    prop_oneof![Just(OpRequest::DevList), busid().prop_map(|busid| OpRequest::Import { busid })]
}

fn import_reply() -> impl Strategy<Value = Result<DeviceRecord, OpStatus>> {
    prop_oneof![device(false).prop_map(Ok), (1u32..).prop_map(|status| Err(OpStatus(status)))]
}

fn direction() -> impl Strategy<Value = Direction> {
    prop_oneof![Just(Direction::Out), Just(Direction::In)]
}

/// Contiguous isochronous packets (as vhci builds them) of the given lengths.
fn iso_layout(lengths: &[u32]) -> Vec<IsoPacketDescriptor> {
    let mut offset = 0;
    lengths
        .iter()
        .map(|&length| {
            let packet = IsoPacketDescriptor { offset, length, actual_length: 0, status: Status::OK };
            offset += length;
            packet
        })
        .collect()
}

/// A `CMD_SUBMIT` and whether its endpoint is isochronous. The invariants the encoder
/// relies on hold: OUT data is `transfer_buffer_length` bytes, IN has none, and only
/// isochronous endpoints carry `number_of_packets` descriptors.
fn cmd_submit() -> impl Strategy<Value = (CmdSubmit, bool)> {
    let iso = (prop::collection::vec(0u32..200, 0..6), 0u32..16)
        .prop_map(|(lengths, slack)| {
            let packets = iso_layout(&lengths);
            let length = lengths.iter().sum::<u32>() + slack;
            (length, packets.len() as i32, packets)
        })
        .boxed();
    let other = (0u32..600, prop_oneof![Just(0), Just(-1), any::<i32>()]).prop_map(|(length, np)| (length, np, vec![]));
    (
        any::<(u32, u32, u32, i32, i32)>(),
        direction(),
        0u8..16,
        any::<[u8; 8]>(),
        prop_oneof![iso.prop_map(|s| (s, true)), other.prop_map(|s| (s, false))],
        any::<u8>(),
    )
        .prop_map(
            |(
                (seqnum, devid, flags, start_frame, interval),
                direction,
                ep,
                setup,
                ((length, np, packets), iso),
                fill,
            )| {
                let data = match direction {
                    Direction::Out => Bytes::from(vec![fill; length as usize]),
                    Direction::In => Bytes::new(),
                };
                let submit = CmdSubmit {
                    seqnum,
                    devid,
                    direction,
                    ep,
                    transfer_flags: TransferFlags(flags),
                    transfer_buffer_length: length,
                    start_frame,
                    number_of_packets: np,
                    interval,
                    setup,
                    data,
                    iso_packets: packets,
                };
                (submit, iso)
            },
        )
}

fn cmd_unlink() -> impl Strategy<Value = CmdUnlink> {
    any::<(u32, u32, u32)>().prop_map(|(seqnum, devid, unlink_seqnum)| CmdUnlink { seqnum, devid, unlink_seqnum })
}

/// A `RET_SUBMIT` and the shape of the `CMD_SUBMIT` it answers: IN replies carry
/// `actual_length` bytes (compacted for isochronous), OUT replies none.
fn ret_submit() -> impl Strategy<Value = (RetSubmit, SubmittedShape)> {
    let iso = prop::collection::vec((0u32..200, any::<Index>(), any::<i32>()), 0..6)
        .prop_map(|packets| {
            let lengths: Vec<u32> = packets.iter().map(|p| p.0).collect();
            let mut descriptors = iso_layout(&lengths);
            for (descriptor, (length, actual, status)) in descriptors.iter_mut().zip(&packets) {
                descriptor.actual_length = actual.index(*length as usize + 1) as u32;
                descriptor.status = Status(*status);
            }
            let actual: u32 = descriptors.iter().map(|d| d.actual_length).sum();
            let requested = lengths.iter().sum::<u32>();
            (requested, actual, descriptors.len() as i32, descriptors, true)
        })
        .boxed();
    let other = (0u32..600, any::<Index>(), prop_oneof![Just(0), Just(-1), any::<i32>()]).prop_map(
        |(requested, actual, np)| (requested, actual.index(requested as usize + 1) as u32, np, vec![], false),
    );
    (any::<(u32, i32, i32, i32)>(), direction(), prop_oneof![iso, other], any::<u8>()).prop_map(
        |((seqnum, status, start_frame, error_count), direction, (requested, actual, np, packets, iso), fill)| {
            let data = match direction {
                Direction::In => Bytes::from(vec![fill; actual as usize]),
                Direction::Out => Bytes::new(),
            };
            let ret = RetSubmit {
                seqnum,
                status: Status(status),
                actual_length: actual,
                start_frame,
                number_of_packets: np,
                error_count,
                data,
                iso_packets: packets,
            };
            let shape = SubmittedShape { direction, transfer_buffer_length: requested, iso_packets: iso.then_some(np) };
            (ret, shape)
        },
    )
}

fn ret_unlink() -> impl Strategy<Value = RetUnlink> {
    any::<(u32, i32)>().prop_map(|(seqnum, status)| RetUnlink { seqnum, status: Status(status) })
}

/// Split points for chunked feeding.
fn splits() -> impl Strategy<Value = Vec<Index>> {
    prop::collection::vec(any::<Index>(), 1..6)
}

/// Byte overwrites applied to a valid encoding.
fn corruptions() -> impl Strategy<Value = Vec<(Index, u8)>> {
    prop::collection::vec((any::<Index>(), any::<u8>()), 1..4)
}

// ---------------------------------------------------------------------------------------
// Encoders and the incremental harness

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

fn encode_request(request: &OpRequest) -> Vec<u8> {
    let mut out = BytesMut::new();
    request.encode(&mut out);
    out.to_vec()
}

type Decoder<'a, M> = &'a mut dyn FnMut(&mut BytesMut) -> Result<Option<M>, DecodeError>;

/// Calls `decode` until it wants more input, asserting that `Ok(None)` consumed nothing.
fn decode_ready<M>(buf: &mut BytesMut, decode: Decoder<'_, M>, out: &mut Vec<M>) -> Result<(), TestCaseError> {
    loop {
        let before = buf.clone();
        match decode(buf) {
            Ok(None) => {
                prop_assert_eq!(&*buf, &before, "Ok(None) consumed input");
                return Ok(());
            }
            Ok(Some(message)) => {
                prop_assert!(buf.len() < before.len(), "a message from no bytes");
                out.push(message);
            }
            Err(error) => return Err(TestCaseError::fail(format!("valid input rejected: {error}"))),
        }
    }
}

/// Feeds `wire` cut at `cuts`, decoding after every chunk; returns every message.
fn decode_in_chunks<M>(wire: &[u8], cuts: &[Index], decode: Decoder<'_, M>) -> Result<Vec<M>, TestCaseError> {
    let mut points: Vec<usize> = cuts.iter().map(|cut| cut.index(wire.len() + 1)).collect();
    points.push(0);
    points.push(wire.len());
    points.sort_unstable();
    points.dedup();
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for pair in points.windows(2) {
        buf.extend_from_slice(&wire[pair[0]..pair[1]]);
        decode_ready(&mut buf, decode, &mut out)?;
    }
    prop_assert!(buf.is_empty(), "{} bytes left over", buf.len());
    Ok(out)
}

/// Every strict prefix of one message's encoding is `Ok(None)` and consumes nothing; the
/// whole encoding decodes to `expected` and consumes exactly it.
fn check_prefixes<M: PartialEq + std::fmt::Debug>(
    wire: &[u8],
    expected: &M,
    decode: Decoder<'_, M>,
) -> Result<(), TestCaseError> {
    for end in 0..wire.len() {
        let mut buf = BytesMut::from(&wire[..end]);
        prop_assert_eq!(decode(&mut buf), Ok(None), "prefix of {} of {} bytes", end, wire.len());
        prop_assert_eq!(&buf[..], &wire[..end], "prefix consumed");
    }
    let mut buf = BytesMut::from(wire);
    let decoded = decode(&mut buf);
    prop_assert_eq!(decoded.as_ref().map(Option::as_ref), Ok(Some(expected)));
    prop_assert!(buf.is_empty());
    Ok(())
}

/// Any outcome but a panic is fine for hostile input; `Ok(None)` must not consume and a
/// message must come from the front of the buffer.
fn check_hostile<M>(input: &[u8], decode: Decoder<'_, M>) -> Result<(), TestCaseError> {
    let mut buf = BytesMut::from(input);
    loop {
        let before = buf.clone();
        match decode(&mut buf) {
            Ok(None) => {
                prop_assert_eq!(&buf, &before, "Ok(None) consumed input");
                return Ok(());
            }
            Ok(Some(_)) => {
                prop_assert!(buf.len() < before.len());
                prop_assert_eq!(&before[before.len() - buf.len()..], &buf[..]);
            }
            Err(_) => return Ok(()),
        }
    }
}

fn corrupt(mut wire: Vec<u8>, corruptions: &[(Index, u8)]) -> Vec<u8> {
    if !wire.is_empty() {
        for (at, byte) in corruptions {
            let at = at.index(wire.len());
            wire[at] = *byte;
        }
    }
    wire
}

fn limits() -> Limits {
    Limits::default()
}

// ---------------------------------------------------------------------------------------
// OP phase

proptest! {
    #[test]
    fn op_request_round_trips_in_any_chunks(requests in prop::collection::vec(op_request(), 1..4), cuts in splits()) {
        let wire: Vec<u8> = requests.iter().flat_map(encode_request).collect();
        check_prefixes(&encode_request(&requests[0]), &requests[0], &mut |b| op::decode_request(b, &limits()))?;
        let decoded = decode_in_chunks(&wire, &cuts, &mut |b| op::decode_request(b, &limits()))?;
        prop_assert_eq!(decoded, requests);
    }

    #[test]
    fn devlist_reply_round_trips_in_any_chunks(devices in prop::collection::vec(device(true), 0..4), cuts in splits()) {
        let mut wire = BytesMut::new();
        op::encode_devlist_reply(&devices, &mut wire);
        let expected = 12 + devices.iter().map(|d| op::DEVICE_RECORD_LEN + 4 * d.interfaces.len()).sum::<usize>();
        prop_assert_eq!(wire.len(), expected);
        check_prefixes(&wire, &devices, &mut |b| op::decode_devlist_reply(b, &limits()))?;
        let decoded = decode_in_chunks(&wire, &cuts, &mut |b| op::decode_devlist_reply(b, &limits()))?;
        prop_assert_eq!(decoded, vec![devices]);
    }

    #[test]
    fn import_reply_round_trips_in_any_chunks(reply in import_reply(), cuts in splits()) {
        let mut wire = BytesMut::new();
        op::encode_import_reply(reply.as_ref().map_err(|status| *status), &mut wire);
        prop_assert_eq!(wire.len(), if reply.is_ok() { 320 } else { 8 });
        check_prefixes(&wire, &reply, &mut op::decode_import_reply)?;
        let decoded = decode_in_chunks(&wire, &cuts, &mut op::decode_import_reply)?;
        prop_assert_eq!(decoded, vec![reply]);
    }

    #[test]
    fn op_decoders_survive_arbitrary_bytes(input in prop::collection::vec(any::<u8>(), 0..700)) {
        for limits in [limits(), Limits { max_devices: 1, ..limits() }] {
            check_hostile(&input, &mut |b| op::decode_request(b, &limits))?;
            check_hostile(&input, &mut |b| op::decode_devlist_reply(b, &limits))?;
            check_hostile(&input, &mut op::decode_import_reply)?;
        }
    }

    /// Arbitrary bytes rarely get past the version check; valid replies with bytes
    /// overwritten reach the record parsers.
    #[test]
    fn op_decoders_survive_corrupted_messages(
        request in op_request(),
        devices in prop::collection::vec(device(true), 0..3),
        reply in import_reply(),
        corruptions in corruptions(),
    ) {
        let request = corrupt(encode_request(&request), &corruptions);
        check_hostile(&request, &mut |b| op::decode_request(b, &limits()))?;
        let mut wire = BytesMut::new();
        op::encode_devlist_reply(&devices, &mut wire);
        let wire = corrupt(wire.to_vec(), &corruptions);
        check_hostile(&wire, &mut |b| op::decode_devlist_reply(b, &limits()))?;
        let mut wire = BytesMut::new();
        op::encode_import_reply(reply.as_ref().map_err(|status| *status), &mut wire);
        let wire = corrupt(wire.to_vec(), &corruptions);
        check_hostile(&wire, &mut op::decode_import_reply)?;
    }
}

// ---------------------------------------------------------------------------------------
// URB phase

/// A client stream: submits and unlinks, all on isochronous endpoints or none.
fn client_stream() -> impl Strategy<Value = (Vec<ClientMessage>, bool)> {
    any::<bool>().prop_flat_map(|iso| {
        let message = prop_oneof![
            3 => cmd_submit().prop_filter_map("endpoint kind", move |(s, i)| (i == iso).then_some(ClientMessage::Submit(s))),
            1 => cmd_unlink().prop_map(ClientMessage::Unlink),
        ];
        (prop::collection::vec(message, 1..5), Just(iso))
    })
}

proptest! {
    #[test]
    fn cmd_submit_round_trips((submit, iso) in cmd_submit()) {
        let message = ClientMessage::Submit(submit);
        let wire = encode_client(&message);
        prop_assert_eq!(urb::command_frame_len(&wire, &limits(), |_, _| iso), Ok(Some(wire.len())));
        check_prefixes(&wire, &message, &mut |b| urb::decode_command(b, &limits(), |_, _| iso))?;
    }

    #[test]
    fn cmd_unlink_round_trips(unlink in cmd_unlink()) {
        let message = ClientMessage::Unlink(unlink);
        let wire = encode_client(&message);
        prop_assert_eq!(wire.len(), urb::HEADER_LEN);
        check_prefixes(&wire, &message, &mut |b| urb::decode_command(b, &limits(), |_, _| false))?;
    }

    #[test]
    fn client_stream_decodes_the_same_in_any_chunks((messages, iso) in client_stream(), cuts in splits()) {
        let wire: Vec<u8> = messages.iter().flat_map(encode_client).collect();
        let decoded = decode_in_chunks(&wire, &cuts, &mut |b| urb::decode_command(b, &limits(), |_, _| iso))?;
        prop_assert_eq!(decoded, messages);
    }

    #[test]
    fn ret_submit_round_trips((ret, shape) in ret_submit()) {
        let message = ServerMessage::Submit(ret);
        let wire = encode_server(&message);
        check_prefixes(&wire, &message, &mut |b| urb::decode_return(b, &limits(), |_| Some(shape)))?;
    }

    #[test]
    fn ret_unlink_round_trips(ret in ret_unlink()) {
        let message = ServerMessage::Unlink(ret);
        let wire = encode_server(&message);
        prop_assert_eq!(wire.len(), urb::HEADER_LEN);
        // RET_UNLINK needs no submitted shape.
        check_prefixes(&wire, &message, &mut |b| urb::decode_return(b, &limits(), |_| None))?;
    }

    /// Replies to different submits (each seqnum its own shape) interleaved with unlink
    /// answers, cut anywhere.
    #[test]
    fn server_stream_decodes_the_same_in_any_chunks(
        replies in prop::collection::vec(prop_oneof![
            3 => ret_submit().prop_map(|(r, s)| (ServerMessage::Submit(r), Some(s))),
            1 => ret_unlink().prop_map(|r| (ServerMessage::Unlink(r), None)),
        ], 1..5),
        cuts in splits(),
    ) {
        // Give every message its own seqnum so the shape table is unambiguous.
        let mut shapes = std::collections::HashMap::new();
        let mut messages = Vec::new();
        for (seqnum, (mut message, shape)) in (0u32..).zip(replies) {
            match &mut message {
                ServerMessage::Submit(ret) => ret.seqnum = seqnum,
                ServerMessage::Unlink(ret) => ret.seqnum = seqnum,
            }
            if let Some(shape) = shape {
                shapes.insert(seqnum, shape);
            }
            messages.push(message);
        }
        let wire: Vec<u8> = messages.iter().flat_map(encode_server).collect();
        let decoded = decode_in_chunks(&wire, &cuts, &mut |b| urb::decode_return(b, &limits(), |seq| shapes.get(&seq).copied()))?;
        prop_assert_eq!(decoded, messages);
    }

    #[test]
    fn decode_command_survives_arbitrary_bytes(input in prop::collection::vec(any::<u8>(), 0..400), iso in any::<bool>()) {
        for limits in [limits(), Limits { max_transfer_length: 64, max_iso_packets: 2, max_devices: 0 }] {
            check_hostile(&input, &mut |b| urb::decode_command(b, &limits, |_, _| iso))?;
            check_hostile(&input, &mut |b| urb::decode_command(b, &limits, |d, ep| d == Direction::In && ep % 2 == 1))?;
        }
    }

    #[test]
    fn decode_command_survives_corrupted_messages((messages, iso) in client_stream(), corruptions in corruptions()) {
        let wire = corrupt(messages.iter().flat_map(encode_client).collect(), &corruptions);
        check_hostile(&wire, &mut |b| urb::decode_command(b, &limits(), |_, _| iso))?;
        check_hostile(&wire, &mut |b| urb::decode_command(b, &limits(), |_, _| !iso))?;
    }

    #[test]
    fn decode_return_survives_arbitrary_bytes(
        input in prop::collection::vec(any::<u8>(), 0..400),
        direction in direction(),
        transfer_buffer_length in prop_oneof![Just(0u32), 0u32..1024, any::<u32>()],
        iso_packets in prop::option::of(prop_oneof![Just(0i32), 0i32..8, any::<i32>()]),
    ) {
        let shape = SubmittedShape { direction, transfer_buffer_length, iso_packets };
        check_hostile(&input, &mut |b| urb::decode_return(b, &limits(), |_| Some(shape)))?;
        check_hostile(&input, &mut |b| urb::decode_return(b, &limits(), |_| None))?;
        // The packet count the reply announces, as a client that submitted it would expect.
        check_hostile(&input, &mut |b| {
            let np = b.get(0x20..0x24).map_or(0, |w| i32::from_be_bytes([w[0], w[1], w[2], w[3]]));
            urb::decode_return(b, &limits(), |_| Some(SubmittedShape { iso_packets: Some(np), ..shape }))
        })?;
    }

    #[test]
    fn decode_return_survives_corrupted_messages((ret, shape) in ret_submit(), corruptions in corruptions()) {
        let wire = corrupt(encode_server(&ServerMessage::Submit(ret)), &corruptions);
        check_hostile(&wire, &mut |b| urb::decode_return(b, &limits(), |_| Some(shape)))?;
    }
}

// ---------------------------------------------------------------------------------------
// Regression tests for fixed bugs

/// `put_fixed_str` cut a long path in the middle of a UTF-8 character, so the peer got a
/// path that is not UTF-8 and we decoded our own encoding to something else.
#[test]
fn long_path_is_cut_at_a_char_boundary() {
    let device = DeviceRecord {
        path: "é".repeat(200), // 400 bytes; byte 255 is inside a character
        busid: BusId::new("1-1").unwrap(),
        busnum: 1,
        devnum: 1,
        speed: Speed::HIGH,
        id_vendor: 0,
        id_product: 0,
        bcd_device: 0,
        b_device_class: 0,
        b_device_sub_class: 0,
        b_device_protocol: 0,
        b_configuration_value: 1,
        b_num_configurations: 1,
        interfaces: vec![],
        b_num_interfaces: 0,
    };
    let mut wire = BytesMut::new();
    op::encode_import_reply(Ok(&device), &mut wire);
    assert_eq!(wire.len(), 320);
    let path_field = &wire[8..8 + op::PATH_LEN];
    let end = path_field.iter().position(|&b| b == 0).expect("NUL-terminated");
    assert!(std::str::from_utf8(&path_field[..end]).is_ok(), "path on the wire is not UTF-8");
    let decoded = op::decode_import_reply(&mut wire).unwrap().unwrap().unwrap();
    assert_eq!(decoded.path, "é".repeat(127));
}

/// A devlist reply with a non-zero status decoded as an empty list, so a server refusing
/// to list looked like a server with nothing exported. The kernel's client fails instead.
#[test]
fn devlist_error_status_is_not_an_empty_list() {
    let mut buf = BytesMut::from(&[0x01, 0x11, 0x00, 0x05, 0, 0, 0, 1][..]);
    assert_eq!(op::decode_devlist_reply(&mut buf, &limits()), Err(DecodeError::RequestFailed(1)));
}

/// `decode_return` sized the frame from the caller's expected packet count without
/// checking it against the limits.
#[test]
fn return_rejects_an_expected_packet_count_over_the_limit() {
    let ret = RetSubmit {
        seqnum: 1,
        status: Status::OK,
        actual_length: 0,
        start_frame: 0,
        number_of_packets: 5000,
        error_count: 0,
        data: Bytes::new(),
        iso_packets: vec![],
    };
    let mut buf = BytesMut::from(&ret.header()[..]);
    let shape = SubmittedShape { direction: Direction::In, transfer_buffer_length: 0, iso_packets: Some(5000) };
    assert_eq!(urb::decode_return(&mut buf, &limits(), |_| Some(shape)), Err(DecodeError::BadIsoPacketCount(5000)));
}
