//! Seed inputs built from the golden vectors in `tests/vectors/`: each vector behind the
//! control bytes that make its harness decode it as intended (the right endpoint table or
//! submitted shape), plus a few multi-message streams.
//!
//! `replay --write-seeds fuzz/seeds` writes them to `fuzz/seeds/<target>/`; they are
//! committed so that libFuzzer starts from real messages rather than from nothing.

use std::time::Duration;

use bytes::BytesMut;
use usbwire_transform::{Frame, Pipeline, Side, TransformSpec};

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

    // op_phase: [chunking, limits, which]; 0 request, 1 devlist reply, 2 import reply, 3 devstate reply.
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
    seeds
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
