//! Seed inputs built from the golden vectors in `tests/vectors/`: each vector behind the
//! control bytes that make its harness decode it as intended (the right endpoint table or
//! submitted shape), plus a few multi-message streams.
//!
//! `replay --write-seeds fuzz/seeds` writes them to `fuzz/seeds/<target>/`; they are
//! committed so that libFuzzer starts from real messages rather than from nothing.

use std::time::Duration;

use bytes::BytesMut;
use usbwire_transform::{Frame, Pipeline, Side, TransformSpec};

mod redir_bridge;

use self::redir_bridge::redir_bridge_seeds;

macro_rules! vector {
    ($name:literal) => {
        ($name, include_str!(concat!("../../tests/vectors/", $name, ".hex")))
    };
}

/// One seed: the target it feeds, a file name, and the bytes (control bytes included).
pub struct Seed {
    pub target: &'static str,
    pub name: String,
    pub bytes: Vec<u8>,
}

/// Every seed.
pub fn all() -> Vec<Seed> {
    let mut seeds = Vec::new();
    let mut add = |target: &'static str, name: &str, control: &[u8], stream: Vec<u8>| {
        let mut bytes = control.to_vec();
        bytes.extend_from_slice(&stream);
        seeds.push(Seed { target, name: name.to_owned(), bytes });
    };

    // decode_command: [chunking, limits, iso_mode]; chunking 1 = byte by byte.
    let mut stream = Vec::new();
    for (name, text) in [
        vector!("cmd_submit_intr_in_kernel_doc"),
        vector!("cmd_submit_get_descriptor"),
        vector!("cmd_submit_bulk_out"),
        vector!("cmd_unlink"),
    ] {
        let bytes = parse_hex(text);
        add("decode_command", name, &[1, 0, 0], bytes.clone());
        stream.extend(bytes);
    }
    add("decode_command", "stream_non_iso", &[2, 0, 0], stream);
    for (name, text) in [vector!("cmd_submit_iso_in"), vector!("cmd_submit_iso_out")] {
        add("decode_command", name, &[1, 0, 1], parse_hex(text));
    }

    // decode_return: [chunking, limits, flags, tbl (BE u32), np]; flags: 1 IN, 2 iso,
    // 4 packet count from the reply header.
    for (flags, tbl, (name, text)) in [
        (1u8, 18u32, vector!("ret_submit_get_descriptor")),
        (0, 31, vector!("ret_submit_bulk_out")),
        (1 | 2 | 4, 576, vector!("ret_submit_iso_in")),
        (2 | 4, 8, vector!("ret_submit_iso_out")),
        (1 | 2 | 4, 576, vector!("ret_unlink_econnreset")),
        (0, 0, vector!("ret_unlink_ok")),
    ] {
        let [t0, t1, t2, t3] = tbl.to_be_bytes();
        add("decode_return", name, &[3, 0, flags, t0, t1, t2, t3, 0], parse_hex(text));
    }
    let mut stream = parse_hex(vector!("ret_submit_get_descriptor").1);
    stream.extend(parse_hex(vector!("ret_unlink_econnreset").1));
    stream.extend(parse_hex(vector!("ret_submit_get_descriptor").1));
    add("decode_return", "stream_in", &[2, 0, 1, 0, 0, 0, 64, 0], stream);

    // op_phase: [chunking, limits, which]; 0 request, 1 devlist, 2 import, 3 devstate reply, 4-5 descriptors.
    for (which, (name, text)) in [
        (0u8, vector!("op_req_devlist")),
        (0, vector!("op_req_import")),
        (1, vector!("op_rep_devlist_empty")),
        (1, vector!("op_rep_devlist")),
        (2, vector!("op_rep_import_ok")),
        (2, vector!("op_rep_import_nodev")),
    ] {
        add("op_phase", name, &[3, 0, which], parse_hex(text));
    }
    let body = br#"{"devices":[{"busid":"1-1","state":"in_use","client":"10.0.0.2:40000"}]}"#;
    let mut devstate = vec![0x01, 0x11, 0x00, 0xf1, 0, 0, 0, 0];
    devstate.extend((body.len() as u32).to_be_bytes());
    devstate.extend(body);
    add("op_phase", "op_rep_devstate", &[3, 0, 3], devstate);
    add("op_phase", "op_req_devstate", &[3, 0, 0], vec![0x01, 0x11, 0x80, 0xf1, 0, 0, 0, 0]);
    for (name, which, stream) in crate::descriptors::seeds() {
        add("op_phase", name, &[3, 0, which], stream);
    }

    // transform_frames: [chunking, stack]; stack % 3 = none, zstd, lz4; stack & 4 = jitter.
    // Frames as a server pipeline sends them: a compressible URB reply, a short one, noise.
    let reply: Vec<u8> = b"RET_SUBMIT 0123456789abcdef ".iter().copied().cycle().take(4096).collect();
    let noise: Vec<u8> = (0u32..300).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    for (stack, name) in [(0u8, "frames_plain"), (1, "frames_zstd"), (2, "frames_lz4"), (5, "frames_zstd_jitter")] {
        let specs = match stack % 3 {
            0 => vec![],
            1 => vec![TransformSpec::Zstd],
            _ => vec![TransformSpec::Lz4],
        };
        let specs = if stack & 4 != 0 {
            [specs, vec![TransformSpec::Jitter(Duration::from_millis(5))]].concat()
        } else {
            specs
        };
        let mut pipeline = Pipeline::new(&specs, Side::Server);
        let mut stream = Vec::new();
        for (at_ms, payload) in [(0u64, &reply[..]), (8, &b"short"[..]), (16, &noise[..])] {
            let mut frame = Frame { flags: 0, sent_at_us: at_ms * 1000, payload: BytesMut::from(payload) };
            pipeline.encode(&mut frame);
            stream.extend_from_slice(&frame.header());
            stream.extend_from_slice(&frame.payload);
        }
        add("transform_frames", name, &[2, stack], stream);
    }
    server_session_seeds(&mut add);
    client_session_seeds(&mut add);
    redir_seeds(&mut add);
    dfu_seeds(&mut add);
    redir_bridge_seeds(&mut add);
    external_seeds(&mut add);
    tls_seeds(&mut add);
    crate::storage::storage_seeds(&mut add);
    crate::lab::lab_seeds(&mut add);
    seeds
}

/// The TLS record layer's targets.
fn tls_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    crate::tls_records::tls_records_seeds(add);
    crate::tls_differential::tls_differential_seeds(add);
    crate::tls_pair::tls_pair_seeds(add);
}

/// redir_packets: `[chunking, caps]`; what QEMU's usb-redir sends after its hello:
/// GET_DESCRIPTOR, SET_CONFIGURATION, a bulk OUT with data, a bulk IN, a cancel, a reset.
fn redir_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    use bytes::Bytes;
    use usbwire_redir::{Caps, Codec, Packet, Status, MAX_PACKET_LEN};
    for (name, caps) in [("qemu_caps", 0xfeu8), ("no_caps", 0)] {
        let mut guest = Codec::new(usbwire_redir::Side::Guest, Caps(u32::from(caps)), MAX_PACKET_LEN);
        let mut host_hello = BytesMut::new();
        let host = Codec::new(usbwire_redir::Side::Host, Caps(0xff), MAX_PACKET_LEN);
        host.encode(0, &host.hello("seed"), &mut host_hello).expect("a hello");
        guest.decode(&mut host_hello).expect("a host hello").expect("whole");
        let control = |request, requesttype, value, length, data: &'static [u8]| Packet::Control {
            endpoint: requesttype & 0x80,
            request,
            requesttype,
            status: Status::SUCCESS,
            value,
            index: 0,
            length,
            data: Bytes::from_static(data),
        };
        let packets = [
            control(6, 0x80, 0x0100, 18, b""),
            Packet::SetConfiguration { configuration: 1 },
            Packet::Bulk {
                endpoint: 0x02,
                status: Status::SUCCESS,
                length: 31,
                stream_id: 0,
                data: Bytes::from(vec![0x55; 31]),
            },
            Packet::Bulk { endpoint: 0x81, status: Status::SUCCESS, length: 512, stream_id: 0, data: Bytes::new() },
            Packet::CancelDataPacket,
            Packet::StartInterruptReceiving { endpoint: 0x83 },
            Packet::Reset,
        ];
        let mut stream = BytesMut::new();
        for (id, packet) in packets.iter().enumerate() {
            guest.encode(id as u64 + 1, packet, &mut stream).expect("a guest packet");
        }
        add("redir_packets", name, &[2, caps], stream.to_vec());
        add("redir_host", name, &[2, caps, 7], stream.to_vec());
        // The host core's streams: interrupt receiving, an alt setting with iso endpoints,
        // iso IN started and stopped, iso OUT packets, a bulk transfer each way.
        let streams = [
            Packet::SetConfiguration { configuration: 1 },
            Packet::StartInterruptReceiving { endpoint: 0x81 },
            Packet::SetAltSetting { interface: 2, alt: 1 },
            Packet::StartIsoStream { endpoint: 0x83, pkts_per_urb: 4, no_urbs: 2 },
            Packet::StartIsoStream { endpoint: 0x03, pkts_per_urb: 2, no_urbs: 2 },
            Packet::Iso { endpoint: 0x03, status: Status::SUCCESS, length: 3, data: Bytes::from_static(b"abc") },
            Packet::Iso { endpoint: 0x03, status: Status::SUCCESS, length: 0, data: Bytes::new() },
            Packet::Bulk { endpoint: 0x82, status: Status::SUCCESS, length: 512, stream_id: 0, data: Bytes::new() },
            Packet::Bulk {
                endpoint: 0x02,
                status: Status::SUCCESS,
                length: 4,
                stream_id: 0,
                data: Bytes::from_static(b"data"),
            },
            Packet::StopIsoStream { endpoint: 0x83 },
            Packet::StopInterruptReceiving { endpoint: 0x81 },
            Packet::GetAltSetting { interface: 2 },
        ];
        let mut stream = BytesMut::new();
        for (id, packet) in streams.iter().enumerate() {
            guest.encode(id as u64 + 1, packet, &mut stream).expect("a guest packet");
        }
        add("redir_host", &format!("{name}_streams"), &[2, caps, 11], stream.to_vec());
    }
}

/// dfu_control: `[size] ++ ops` (see `src/dfu.rs`): a flash through both
/// re-enumerations, uploads of both regions, and the error paths.
fn dfu_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    const DETACH: u8 = 0;
    const DNLOAD: u8 = 1;
    const UPLOAD: u8 = 2;
    const GETSTATUS: u8 = 3;
    const CLRSTATUS: u8 = 4;
    const ABORT: u8 = 6;
    let request = |out: bool, request: u8, value: u16, length: u16, data: &[u8]| {
        let [v0, v1] = value.to_le_bytes();
        let [l0, l1] = length.to_le_bytes();
        let mut op = vec![0, if out { 0x21 } else { 0xa1 }, request, v0, v1, 0, 0, l0, l1];
        op.extend_from_slice(data);
        op
    };
    let status = request(false, GETSTATUS, 0, 6, &[]);
    let jump = vec![5u8];
    let into_dfu_mode = [status.clone(), request(true, DETACH, 1000, 0, &[]), jump.clone()].concat();
    let block = |n: u16, data: &[u8]| request(true, DNLOAD, n, data.len() as u16, data);
    let flash = [
        into_dfu_mode.clone(),
        vec![2, 0],
        block(0, &[0xa5; 64]),
        status.clone(),
        jump.clone(),
        status.clone(),
        block(1, &[0x5a; 32]),
        status.clone(),
        jump.clone(),
        status.clone(),
        block(2, &[]),
        status.clone(),
        jump.clone(),
        status.clone(),
        jump.clone(),
        status.clone(),
    ]
    .concat();
    add("dfu_control", "flash", &[3], flash);
    let upload = request(false, UPLOAD, 0, 32, &[]);
    let uploads = [
        into_dfu_mode.clone(),
        upload.clone(),
        upload.clone(),
        upload.clone(),
        upload.clone(),
        request(false, 5, 0, 1, &[]),
        upload.clone(),
        request(true, ABORT, 0, 0, &[]),
        vec![2, 1],
        upload.clone(),
        vec![2, 0],
        vec![3],
    ]
    .concat();
    add("dfu_control", "uploads", &[0], uploads);
    let errors = [
        into_dfu_mode,
        block(0, &[]),
        status.clone(),
        request(true, CLRSTATUS, 0, 0, &[]),
        block(0, &[1; 48]),
        status.clone(),
        vec![1, 10],
        status.clone(),
        block(1, &[2; 48]),
        status.clone(),
        request(true, CLRSTATUS, 0, 0, &[]),
        vec![2, 1],
        block(0, &[3; 8]),
        status.clone(),
        jump,
        status.clone(),
        block(1, &[]),
        status,
        vec![3],
    ]
    .concat();
    add("dfu_control", "errors", &[0], errors);
}

/// client_session: `[chunking, cut, claim]`; replies to the harness's outstanding URBs
/// (seqnum 1: bulk IN 512, 2: bulk OUT 512 with an unlink 9 aimed at it, 5: iso IN 3 x 64).
fn client_session_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    use usbwire_proto::urb::{IsoPacketDescriptor, RetSubmit, RetUnlink};
    use usbwire_proto::Status;
    let ret = |seqnum: u32, data: Vec<u8>| RetSubmit {
        seqnum,
        status: Status::OK,
        actual_length: data.len() as u32,
        start_frame: 0,
        number_of_packets: 0,
        error_count: 0,
        data: data.into(),
        iso_packets: vec![],
    };
    let mut stream = BytesMut::new();
    ret(1, vec![0x11; 100]).encode(&mut stream);
    ret(2, vec![]).encode(&mut stream);
    stream.extend_from_slice(&RetUnlink { seqnum: 9, status: Status::OK }.header());
    let iso = RetSubmit {
        number_of_packets: 3,
        actual_length: 96,
        data: vec![0x22; 96].into(),
        iso_packets: (0..3)
            .map(|i| IsoPacketDescriptor { offset: i * 64, length: 64, actual_length: 32, status: Status::OK })
            .collect(),
        ..ret(5, vec![])
    };
    iso.encode(&mut stream);
    add("client_session", "replies_then_cut", &[2, 1, 3], stream.to_vec());
    let mut cancelled = BytesMut::new();
    cancelled.extend_from_slice(&RetUnlink { seqnum: 9, status: Status::ECONNRESET }.header());
    ret(1, vec![0x11; 512]).encode(&mut cancelled);
    add("client_session", "unlink_cancels_its_target", &[1, 7, 0], cancelled.to_vec());
    let mut pinging = BytesMut::new();
    pinging.extend_from_slice(&usbwire_proto::liveness::ping_header(0x0001_0002));
    ret(1, vec![0x11; 100]).encode(&mut pinging);
    pinging.extend_from_slice(&usbwire_proto::liveness::ping_header(0x0001_0002));
    ret(2, vec![]).encode(&mut pinging);
    add("client_session", "keepalive_pings_between_replies", &[2, 5, 0x80], pinging.to_vec());
}

// size-exempt: a table of seed inputs, one per scenario.
/// server_session: `[chunking, mode]`; mode 1 reads replies, 2 half-closes at the end.
/// Devices, in export order: 1-1 keyboard, 1-2 mouse, 1-3 loopback, 2-1 loopback
/// (SuperSpeed), 1-4 disk.
fn server_session_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    use usbwire_proto::op::{BusId, OpRequest};
    use usbwire_proto::urb::{CmdSubmit, CmdUnlink, TransferFlags};
    use usbwire_proto::Direction;

    let request = |request: OpRequest| {
        let mut out = BytesMut::new();
        request.encode(&mut out);
        out.to_vec()
    };
    let import = |busid: &str| request(OpRequest::Import { busid: BusId::new(busid).expect("a bus id") });
    let submit = |devid: u32, seqnum: u32, direction: Direction, ep: u8, len: u32, setup: [u8; 8]| {
        let data = if direction == Direction::Out { vec![0xa5u8; len as usize] } else { Vec::new() };
        let mut out = BytesMut::new();
        CmdSubmit {
            seqnum,
            devid,
            direction,
            ep,
            transfer_flags: TransferFlags(0),
            transfer_buffer_length: len,
            start_frame: 0,
            number_of_packets: 0,
            interval: 0,
            setup,
            data: bytes::Bytes::from(data),
            iso_packets: Vec::new(),
        }
        .encode(&mut out);
        out.to_vec()
    };
    let unlink =
        |devid: u32, seqnum: u32, target: u32| CmdUnlink { seqnum, devid, unlink_seqnum: target }.header().to_vec();
    const GET_DEVICE: [u8; 8] = [0x80, 6, 0, 1, 0, 0, 18, 0];
    const NO_SETUP: [u8; 8] = [0; 8];

    add("server_session", "devlist", &[0, 3], request(OpRequest::DevList));
    add("server_session", "devstate", &[0, 3], request(OpRequest::DevState));

    // Loopback 1-3: a descriptor, a bulk OUT to the sink, IN from the source, unlinks of
    // one in flight and of one never submitted.
    let devid = 0x0001_0003;
    let mut urbs = submit(devid, 1, Direction::In, 0, 18, GET_DEVICE);
    urbs.extend(submit(devid, 2, Direction::Out, 2, 512, NO_SETUP));
    urbs.extend(submit(devid, 3, Direction::In, 1, 4096, NO_SETUP));
    urbs.extend(submit(devid, 4, Direction::In, 4, 16, NO_SETUP));
    urbs.extend(unlink(devid, 5, 4));
    urbs.extend(unlink(devid, 6, 1000));
    let mut session = import("1-3");
    session.extend(&urbs);
    add("server_session", "loopback_urbs", &[3, 3], session.clone());
    add("server_session", "loopback_urbs_unread", &[0, 0], session);

    // A resumable import with keep-alive: pings and an acknowledgement between the URBs.
    let mut pinging = request(OpRequest::Transforms { offer: "resume,keepalive".to_owned() });
    pinging.extend(import("1-3"));
    pinging.extend(usbwire_proto::liveness::ping_header(devid));
    pinging.extend(submit(devid, 1, Direction::In, 0, 18, GET_DEVICE));
    pinging.extend(usbwire_proto::resume::ack_header(devid, 1));
    pinging.extend(usbwire_proto::liveness::ping_header(devid));
    pinging.extend(submit(devid, 2, Direction::Out, 2, 512, NO_SETUP));
    pinging.extend(usbwire_proto::resume::end_header(devid));
    add("server_session", "resumable_keepalive_pings", &[2, 3], pinging);

    // The unread-unlink flood, in miniature.
    let mut flood = import("1-3");
    for seqnum in 1..200 {
        flood.extend(unlink(devid, seqnum, seqnum + 10_000));
    }
    add("server_session", "unlink_flood_unread", &[0, 0], flood);

    // Keyboard 1-1: an interrupt IN that pends until unlinked.
    let devid = 0x0001_0001;
    let mut session = import("1-1");
    session.extend(submit(devid, 1, Direction::In, 1, 8, NO_SETUP));
    session.extend(unlink(devid, 2, 1));
    add("server_session", "keyboard_unlink", &[2, 3], session);

    // Transforms: the offer, then the import and URBs in frames.
    for (offer, specs, name) in
        [("zstd", vec![TransformSpec::Zstd], "zstd_loopback"), ("lz4", vec![TransformSpec::Lz4], "lz4_loopback")]
    {
        let mut pipeline = Pipeline::new(&specs, Side::Client);
        let mut session = request(OpRequest::Transforms { offer: offer.to_owned() });
        for payload in [import("1-3"), urbs.clone()] {
            let mut frame = Frame { flags: 0, sent_at_us: 0, payload: BytesMut::from(&payload[..]) };
            pipeline.encode(&mut frame);
            session.extend_from_slice(&frame.header());
            session.extend_from_slice(&frame.payload);
        }
        add("server_session", name, &[0, 3], session);
    }

    // A compression bomb: 40 frames of zeros (40 MiB decompressed from about 4 KiB), never read.
    let mut pipeline = Pipeline::new(&[TransformSpec::Zstd], Side::Client);
    let mut bomb = request(OpRequest::Transforms { offer: "zstd".to_owned() });
    let zeros = std::iter::repeat_n(vec![0u8; 1 << 20], 40);
    for payload in std::iter::once(import("1-3")).chain(zeros) {
        let mut frame = Frame { flags: 0, sent_at_us: 0, payload: BytesMut::from(&payload[..]) };
        pipeline.encode(&mut frame);
        bomb.extend_from_slice(&frame.header());
        bomb.extend_from_slice(&frame.payload);
    }
    add("server_session", "zstd_bomb_unread", &[0, 0], bomb);
}

/// Parses the vector format described in `tests/vectors/README.md` (the same parser as
/// `crates/proto/tests/vectors.rs`). The vectors are ours and checked by that test, so a
/// malformed one is a bug here: panic.
pub fn parse_hex(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        for token in line.split_whitespace() {
            if let Some((byte, count)) = token.split_once('*') {
                let byte = u8::from_str_radix(byte, 16).expect("run byte");
                out.extend(std::iter::repeat_n(byte, count.parse().expect("run length")));
            } else {
                assert!(token.len() % 2 == 0, "odd hex token {token:?}");
                for pair in token.as_bytes().chunks(2) {
                    let pair = std::str::from_utf8(pair).expect("ascii");
                    out.push(u8::from_str_radix(pair, 16).expect("hex digit"));
                }
            }
        }
    }
    out
}

/// external_frames: `[chunking] ++ stream`: what a device process sends
/// (hello, then answers of every kind), and a stream cut by an oversized frame.
fn external_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    use bytes::Bytes;
    use usbwire_external::codec::Message;
    let answers = [
        Message::Hello { version: 1, speed: usbwire_proto::Speed::HIGH, ep0_max_packet: 64 },
        Message::Ack { id: 1 },
        Message::Nak { id: 2 },
        Message::Data { id: 2, data: Bytes::from_static(&[18, 1, 0, 2, 0, 0, 0, 64]) },
        Message::Nak { id: 3 },
        Message::Data { id: 3, data: Bytes::from_static(b"echo") },
        Message::Stall { id: 4 },
        Message::Data { id: 9, data: Bytes::new() },
    ];
    let mut stream = BytesMut::new();
    for answer in &answers {
        answer.encode(&mut stream);
    }
    add("external_frames", "answers", &[3], stream.to_vec());
    let mut cut = stream.to_vec();
    cut.extend_from_slice(&[0xff, 0xff, 0xff, 0x0f, 0x11]);
    add("external_frames", "oversized", &[0], cut);
}
