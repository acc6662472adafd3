//! What resume's bookkeeping costs on its own, without sockets, tasks or the
//! relay: a [`ClientSession`] and a [`ServerSession`] joined in memory, with a
//! device that completes every URB at once, move URBs for a while with and
//! without resume, alternating. A resumable pair keeps each command until it
//! is answered, holds each reply until the client acknowledges it and sends
//! those acknowledgements; everything else (encoding, decoding, one copy of
//! the bytes each way) is the same in both (the pair reads like a driver: into the room each
//! session's `input` makes), so the difference per URB is the
//! bookkeeping's price.
//!
//! ```text
//! nice -n 5 cargo bench -p usbwire-bench --bench session_bookkeeping [-- out 1048576]
//! ```
//!
//! Not a test: it prints numbers and asserts nothing about them.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use usbwire_proto::client_session::{ClientSession, Event, READ_CHUNK};
use usbwire_proto::server_session::{DeviceCall, ServerSession};
use usbwire_proto::urb::{CmdSubmit, RetSubmit, TransferFlags};
use usbwire_proto::{Budget, Direction, Limits, Outbox, RecvBuffer, Status};

const DEVID: u32 = 0x0001_0002;
const SIZES: [usize; 3] = [512, 64 << 10, 1 << 20];
const DEPTHS: [usize; 2] = [8, 32];
/// Runs per mode and point, alternating; the median is reported.
const ROUNDS: usize = 5;
const RUN: Duration = Duration::from_millis(200);

fn main() {
    // `-- out 1048576`: only the rows whose direction or size is named.
    let only: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    println!("in-memory ClientSession <-> ServerSession, device completes at once; median of {ROUNDS} alternating runs of {RUN:?}");
    println!(
        "{:>4} {:>9} {:>5} {:>12} {:>12} {:>10} {:>8}",
        "dir", "urb_size", "depth", "off ns/URB", "on ns/URB", "extra ns", "on/off"
    );
    for direction in [Direction::In, Direction::Out] {
        for size in SIZES {
            for depth in DEPTHS {
                let dir = if direction == Direction::In { "in" } else { "out" };
                if !only.is_empty() && !only.iter().all(|o| o == dir || *o == size.to_string()) {
                    continue;
                }
                let mut off = Vec::new();
                let mut on = Vec::new();
                for _ in 0..ROUNDS {
                    off.push(run(false, direction, size, depth));
                    on.push(run(true, direction, size, depth));
                }
                let (off, on) = (median(off), median(on));
                println!("{dir:>4} {size:>9} {depth:>5} {off:>12.0} {on:>12.0} {:>10.0} {:>8.3}", on - off, off / on);
            }
        }
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Moves URBs for [`RUN`]; returns nanoseconds per URB.
fn run(resumable: bool, direction: Direction, size: usize, depth: usize) -> f64 {
    let mut client = ClientSession::new(DEVID, Limits::default(), Budget::default());
    let mut client_input = RecvBuffer::with_capacity(READ_CHUNK);
    let mut server = ServerSession::new(DEVID, BytesMut::new(), Limits::default(), Budget::default());
    if resumable {
        client = client.resumable();
        server = server.resumable();
    }
    // Like the loopback device: IN data and OUT payloads are slices of one buffer, never copied.
    let data = Bytes::from(vec![0xa5u8; size]);
    let mut device: VecDeque<CmdSubmit> = VecDeque::new();
    let no_iso = |_: Direction, _: u8| false;
    let (mut submitted, mut done) = (0u64, 0u64);
    let started = Instant::now();
    let mut stop = false;
    while !stop || done < submitted {
        let mut progressed = false;
        stop = stop || started.elapsed() >= RUN;
        while !stop && submitted - done < depth as u64 && client.wants_commands() {
            submitted += 1;
            let seqnum = submitted as u32;
            client.submit(command(seqnum, direction, &data), seqnum).expect("a valid submit");
            progressed = true;
        }
        // Like a driver: read into the room the session made, hand it over, again.
        while server.wants_input() && !client.outbox().is_empty() {
            pump(client.outbox(), server.input(no_iso).expect("valid commands"));
            server.handle_input(no_iso).expect("valid commands");
            progressed = true;
        }
        progressed |= server.handle_input(no_iso).expect("valid commands");
        while let Some(call) = server.poll_device_call() {
            if let DeviceCall::Submit(urb) = call {
                device.push_back(urb);
            }
            progressed = true;
        }
        while server.wants_completions() {
            let Some(urb) = device.pop_front() else { break };
            server.complete(completion(&urb, &data));
            progressed = true;
        }
        while pump(server.outbox(), &mut client_input) {
            let completed = |event| {
                if let Event::Completed { .. } = event {
                    done += 1;
                }
            };
            client.handle_input(&mut client_input, completed).expect("valid replies");
            progressed = true;
        }
        // Like a driver with nothing else to write: acknowledge.
        progressed |= client.acknowledge();
        assert!(progressed || done == submitted, "the pair stalled with {done} of {submitted} URBs answered");
    }
    started.elapsed().as_secs_f64() * 1e9 / done.max(1) as f64
}

/// Copies what `outbox` holds into the room `input` has, as a socket read
/// would (the sessions size that room for the next whole message).
fn pump(outbox: &mut Outbox, input: &mut BytesMut) -> bool {
    let mut room = input.capacity() - input.len();
    let mut moved = 0;
    for slice in outbox.slices(64) {
        let n = slice.len().min(room);
        input.extend_from_slice(&slice[..n]);
        moved += n;
        room -= n;
        if room == 0 {
            break;
        }
    }
    outbox.advance(moved);
    moved > 0
}

fn command(seqnum: u32, direction: Direction, data: &Bytes) -> CmdSubmit {
    CmdSubmit {
        seqnum,
        devid: DEVID,
        direction,
        ep: if direction == Direction::In { 1 } else { 2 },
        transfer_flags: TransferFlags::default(),
        transfer_buffer_length: data.len() as u32,
        start_frame: 0,
        number_of_packets: 0,
        interval: 0,
        setup: [0; 8],
        data: if direction == Direction::Out { data.clone() } else { Bytes::new() },
        iso_packets: vec![],
    }
}

fn completion(urb: &CmdSubmit, data: &Bytes) -> RetSubmit {
    RetSubmit {
        seqnum: urb.seqnum,
        status: Status::OK,
        actual_length: urb.transfer_buffer_length,
        start_frame: 0,
        number_of_packets: 0,
        error_count: 0,
        data: if urb.direction == Direction::In { data.clone() } else { Bytes::new() },
        iso_packets: vec![],
    }
}
