//! Recordings of the loopback device made in-process, replayed with the
//! same workload (identical completions) and another (strict stalls at the
//! first divergence, lenient goes on); hostile files; recorded timing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use proptest::prelude::*;
use usbwire_device::{Speed, Status};

use super::*;
use crate::loopback::{LOOP_IN, LOOP_OUT, SOURCE_IN, TICK_IN};
use crate::testing::{control, data_in, data_out, next};

/// pcapng block bytes: type, total length, body padded to 4, total length.
fn block(out: &mut Vec<u8>, kind: u32, body: &[u8]) {
    let padded = body.len().div_ceil(4) * 4;
    let total = (12 + padded) as u32;
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&total.to_le_bytes());
    out.extend_from_slice(body);
    out.resize(out.len() + padded - body.len(), 0);
    out.extend_from_slice(&total.to_le_bytes());
}

/// A section header and one usbmon interface at 480 Mbit/s.
fn headers() -> Vec<u8> {
    let mut out = Vec::new();
    block(&mut out, 0x0A0D_0D0A, &[0x4d, 0x3c, 0x2b, 0x1a, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
    let mut interface = vec![220, 0, 0, 0, 0, 0, 0, 0, 8, 0, 8, 0];
    interface.extend_from_slice(&480_000_000u64.to_le_bytes());
    interface.extend_from_slice(&[0; 4]);
    block(&mut out, 1, &interface);
    out
}

/// A usbmon record in an enhanced packet block.
struct Record<'a> {
    kind: u8,
    id: u64,
    transfer: u8,
    endpoint: u8,
    setup: Option<[u8; 8]>,
    status: i32,
    length: u32,
    micros: u64,
    data: &'a [u8],
}

impl Record<'_> {
    fn write(&self, out: &mut Vec<u8>) {
        let mut record = Vec::new();
        record.extend_from_slice(&self.id.to_le_bytes());
        record.extend_from_slice(&[self.kind, self.transfer, self.endpoint, 2, 1, 0]);
        record.extend_from_slice(&[if self.setup.is_some() { 0 } else { b'-' }, 0]);
        record.extend_from_slice(&((self.micros / 1_000_000) as i64).to_le_bytes());
        record.extend_from_slice(&((self.micros % 1_000_000) as i32).to_le_bytes());
        record.extend_from_slice(&self.status.to_le_bytes());
        record.extend_from_slice(&self.length.to_le_bytes());
        record.extend_from_slice(&(self.data.len() as u32).to_le_bytes());
        record.extend_from_slice(&self.setup.unwrap_or_default());
        record.extend_from_slice(&[0; 16]);
        record.extend_from_slice(self.data);
        let mut body = vec![0; 20];
        body[12..16].copy_from_slice(&(record.len() as u32).to_le_bytes());
        body[16..20].copy_from_slice(&(record.len() as u32).to_le_bytes());
        body.extend_from_slice(&record);
        block(out, 6, &body);
    }
}

/// A device driven by hand whose URBs are written down as a server's capture writes them.
pub(super) struct Recorder<D> {
    device: D,
    pub(super) out: Vec<u8>,
    micros: u64,
    in_flight: HashMap<u32, (u8, u8)>,
}

impl<D: Device> Recorder<D> {
    pub(super) fn new(device: D) -> Self {
        Self { device, out: headers(), micros: 1_000_000, in_flight: HashMap::new() }
    }

    pub(super) fn submit(&mut self, urb: Urb) {
        let transfer = match self.device.endpoint_type(urb.direction, urb.endpoint) {
            Some(TransferType::Isochronous) => 0,
            Some(TransferType::Interrupt) => 1,
            Some(TransferType::Control) | None => 2,
            Some(TransferType::Bulk) => 3,
        };
        let endpoint = urb.endpoint_address();
        self.in_flight.insert(urb.seqnum, (transfer, endpoint));
        let data: &[u8] = if urb.is_in() { &[] } else { &urb.data };
        let setup = (transfer == 2).then_some(urb.setup);
        let (id, length, micros) = (u64::from(urb.seqnum), urb.length, self.micros);
        Record { kind: b'S', id, transfer, endpoint, setup, status: -115, length, micros, data }.write(&mut self.out);
        self.device.submit(urb);
    }

    /// The next completion, written down `took` µs after the last record.
    pub(super) fn complete(&mut self, took: u64) -> Completion {
        let done = next(&mut self.device).expect("the loopback completes at once");
        self.micros += took;
        let (transfer, endpoint) = self.in_flight.remove(&done.seqnum).expect("submitted");
        let data: &[u8] = if endpoint & 0x80 != 0 { &done.data } else { &[] };
        let (id, status, length, micros) = (u64::from(done.seqnum), done.status.0, done.actual_length, self.micros);
        Record { kind: b'C', id, transfer, endpoint, setup: None, status, length, micros, data }.write(&mut self.out);
        done
    }
}

/// What a workload saw: each completion's status, length and data.
type Seen = Vec<(Status, u32, Bytes)>;

/// Enumerates and configures, then loops `payloads` through the device and reads the source.
fn workload(device: &mut dyn FnMut(Urb) -> Completion, payloads: &[&[u8]]) -> Seen {
    let mut seen = Vec::new();
    let mut seqnum = 0;
    let mut run = |urb: Urb| {
        let done = device(urb);
        seen.push((done.status, done.actual_length, done.data));
    };
    for setup in [
        [0x80, 6, 0, 1, 0, 0, 18, 0],
        [0x80, 6, 0, 2, 0, 0, 9, 0],
        [0x80, 6, 0, 2, 0, 0, 0xff, 0],
        [0x80, 6, 0, 3, 0, 0, 0xff, 0],
        [0x80, 6, 2, 3, 9, 4, 0xff, 0],
        [0x00, 9, 1, 0, 0, 0, 0, 0],
        [0x80, 0, 0, 0, 0, 0, 2, 0],
    ] {
        seqnum += 1;
        run(control(seqnum, setup, &[]));
    }
    for payload in payloads {
        seqnum += 1;
        run(data_out(seqnum, LOOP_OUT, Bytes::copy_from_slice(payload)));
        seqnum += 1;
        run(data_in(seqnum, LOOP_IN, 512));
    }
    seqnum += 1;
    run(data_in(seqnum, SOURCE_IN, 512));
    seen
}

const RECORDED: [&[u8]; 2] = [b"hello, replay", b"second payload"];

/// The loopback recorded running [`workload`] with [`RECORDED`].
fn recording() -> (Bytes, Seen) {
    let mut recorder = Recorder::new(crate::loopback(Speed::HIGH));
    let seen = workload(
        &mut |urb| {
            recorder.submit(urb);
            recorder.complete(100)
        },
        &RECORDED,
    );
    (Bytes::from(recorder.out), seen)
}

/// A replay of [`recording`] whose reports land in the returned list.
fn replay(mode: Mode, timing: Timing) -> (ReplayDevice, Arc<Mutex<Vec<Report>>>) {
    let reports = Arc::new(Mutex::new(Vec::new()));
    let sink = reports.clone();
    let on_report: ReportSink = Box::new(move |report: &Report| sink.lock().unwrap().push(report.clone()));
    let recording = Recording::parse(recording().0).unwrap();
    let options = ReplayOptions { mode, timing, on_report: Some(on_report) };
    (ReplayDevice::new(recording, "loopback.pcapng".into(), options), reports)
}

fn run_on(device: &mut ReplayDevice, payloads: &[&[u8]]) -> Seen {
    workload(
        &mut |urb| {
            device.submit(urb);
            next(device).expect("a replay answers at once")
        },
        payloads,
    )
}

#[test]
fn a_recording_holds_the_descriptors_and_each_endpoints_urbs_in_order() {
    let recording = Recording::parse(recording().0).unwrap();
    assert_eq!(recording.speed, Speed::HIGH, "from the interface's if_speed");
    assert_eq!((recording.device.vendor_id, recording.device.product_id), (0x1209, 0x0005));
    assert_eq!(
        recording.configuration,
        usbwire_device::Function::descriptors(crate::loopback(Speed::HIGH).function()).configuration
    );
    assert_eq!(recording.control.len(), 2, "SET_CONFIGURATION and GET_STATUS; the descriptors are apart");
    let addresses: Vec<u8> = recording.endpoints.iter().map(|(a, _)| *a).collect();
    assert_eq!(addresses, [LOOP_OUT, SOURCE_IN, LOOP_IN]);
    let looped = &recording.endpoints[2].1;
    assert_eq!(&looped[1].completion.as_ref().unwrap().data[..], RECORDED[1]);
    assert_eq!(&recording.endpoints[0].1[0].out[..], RECORDED[0]);
}

#[test]
fn the_same_workload_gets_the_same_completions_byte_for_byte() {
    let recorded = recording().1;
    let (mut device, reports) = replay(Mode::Strict, Timing::Asap);
    assert_eq!(device.summary().product, "usbwire loopback");
    assert_eq!(device.endpoint_type(Direction::In, 4), Some(TransferType::Interrupt));
    assert_eq!(run_on(&mut device, &RECORDED), recorded);
    device.reset();
    let report = reports.lock().unwrap().pop().expect("a report when the import ends");
    assert_eq!((report.requests, report.matched, report.descriptors), (12, 7, 5));
    assert!(report.is_clean() && report.never_asked == 0, "{report:?}");
    // The next import starts from the beginning.
    assert_eq!(run_on(&mut device, &RECORDED), recorded);
}

#[test]
fn strict_stalls_the_first_divergent_request_and_the_report_names_it() {
    let (mut device, reports) = replay(Mode::Strict, Timing::Asap);
    let seen = run_on(&mut device, &[b"hello, replay", b"another payload"]);
    assert_eq!(seen[9].0, Status::EPIPE, "the second OUT differs");
    drop(device);
    let report = reports.lock().unwrap().pop().unwrap();
    let first = &report.first_divergences[0];
    assert_eq!((first.position, first.endpoint.as_str(), first.answered.as_str()), (10, "0x03", "stall"));
    assert_eq!(first.reason, "OUT data differs from byte 0 on");
    let recorded = first.recorded.as_ref().unwrap();
    assert_eq!((recorded.index, recorded.length), (Some(2), 14));
    assert!(recorded.data.starts_with("73 65 63"), "{recorded:?}");
    assert!(first.received.data.starts_with("61 6e 6f"));
    assert!(report.never_asked >= 1, "the recorded second OUT was never matched");
}

#[test]
fn lenient_answers_from_the_recording_and_keeps_going() {
    let recorded = recording().1;
    let (mut device, reports) = replay(Mode::Lenient, Timing::Asap);
    let seen = run_on(&mut device, &[b"hello, replay", b"another payload"]);
    assert_eq!(seen[9].0, Status::OK);
    assert_eq!(seen[10], recorded[10], "the loop gives back what was recorded");
    drop(device);
    let report = reports.lock().unwrap().pop().unwrap();
    assert_eq!((report.divergences, report.never_asked), (1, 0));
    assert_eq!(report.first_divergences[0].answered, "recorded");
}

#[test]
fn a_request_never_recorded_stalls_and_an_in_past_the_end_is_held_until_cancelled() {
    let (mut device, _reports) = replay(Mode::Lenient, Timing::Asap);
    device.submit(control(1, [0xc0, 0x42, 0, 0, 0, 0, 4, 0], &[]));
    assert_eq!(next(&mut device).unwrap().status, Status::EPIPE);
    device.submit(data_in(2, SOURCE_IN, 512));
    assert_eq!(next(&mut device).unwrap().status, Status::OK);
    device.submit(data_in(3, SOURCE_IN, 512));
    assert!(next(&mut device).is_none(), "nothing more was recorded: held");
    device.cancel(3);
    assert_eq!(next(&mut device).unwrap().status, Status::ECONNRESET);
    assert_eq!(device.report().held_past_end, 1);
    assert_eq!(device.report().first_divergences[0].reason, "not in the recording");
}

#[test]
fn a_port_reset_and_get_configuration_the_recording_lacks_are_answered_from_the_devices_state() {
    // As through a usbredir bridge: the guest asks GET_CONFIGURATION, then resets the port.
    let (mut device, reports) = replay(Mode::Strict, Timing::Asap);
    let get_configuration = [0x80, 8, 0, 0, 0, 0, 1, 0];
    device.submit(control(1, get_configuration, &[]));
    assert_eq!(&next(&mut device).unwrap().data[..], [0], "unconfigured before a SET_CONFIGURATION");
    device.submit(control(2, [0x00, 9, 1, 0, 0, 0, 0, 0], &[]));
    assert_eq!(next(&mut device).unwrap().status, Status::OK);
    device.submit(control(3, get_configuration, &[]));
    assert_eq!(&next(&mut device).unwrap().data[..], [1], "the configuration the host set");
    device.submit(control(4, [0x23, 3, 4, 0, 1, 0, 0, 0], &[]));
    assert_eq!(next(&mut device).unwrap().status, Status::OK, "a port reset is taken, not stalled");
    device.submit(control(5, get_configuration, &[]));
    assert_eq!(&next(&mut device).unwrap().data[..], [0], "a reset unconfigures the device");
    // The recording keeps its place: GET_STATUS is still its next control request.
    device.submit(control(6, [0x80, 0, 0, 0, 0, 0, 2, 0], &[]));
    assert_eq!(next(&mut device).unwrap().status, Status::OK);
    // A SET_CONFIGURATION the recording holds no more of is a divergence, and stays unset.
    device.submit(control(7, [0x00, 9, 1, 0, 0, 0, 0, 0], &[]));
    assert_eq!(next(&mut device).unwrap().status, Status::EPIPE);
    device.submit(control(8, get_configuration, &[]));
    assert_eq!(&next(&mut device).unwrap().data[..], [0]);
    device.reset();
    let report = reports.lock().unwrap().pop().unwrap();
    assert_eq!((report.resets, report.configuration_answered, report.matched), (1, 4, 2));
    assert_eq!(report.divergences, 1);
    assert_eq!(report.first_divergences[0].reason, "asked more often than recorded");
}

#[tokio::test(start_paused = true)]
async fn recorded_timing_keeps_the_recorded_wait_of_an_interrupt_in() {
    let mut recorder = Recorder::new(crate::loopback(Speed::HIGH));
    for (seqnum, setup) in [[0x80, 6, 0, 1, 0, 0, 18, 0], [0x80, 6, 0, 2, 0, 0, 0xff, 0], [0x00, 9, 1, 0, 0, 0, 0, 0]]
        .into_iter()
        .enumerate()
    {
        recorder.submit(control(seqnum as u32 + 1, setup, &[]));
        recorder.complete(10);
    }
    // A tick the device gave a quarter of a second after it was asked for.
    let tick = [7u8; 16];
    let base = Record {
        kind: b'S',
        id: 9,
        transfer: 1,
        endpoint: TICK_IN,
        setup: None,
        status: -115,
        length: 16,
        micros: 2_000_000,
        data: &[],
    };
    base.write(&mut recorder.out);
    Record { kind: b'C', micros: 2_250_000, status: 0, data: &tick, ..base }.write(&mut recorder.out);
    let recording = Recording::parse(Bytes::from(recorder.out)).unwrap();
    for (timing, least) in [(Timing::Asap, 0), (Timing::Recorded, 250)] {
        let options = ReplayOptions { timing, ..ReplayOptions::default() };
        let mut device = ReplayDevice::new(recording.clone(), "tick".into(), options);
        device.submit(control(1, [0x00, 9, 1, 0, 0, 0, 0, 0], &[]));
        assert_eq!(next(&mut device).unwrap().status, Status::OK);
        let started = Instant::now();
        device.submit(data_in(2, TICK_IN, 16));
        let done = std::future::poll_fn(|cx| device.poll_complete(cx)).await;
        assert_eq!(&done.data[..], &tick);
        let waited = started.elapsed().as_millis();
        assert!(waited >= least && waited < least + 5, "{timing:?}: {waited} ms");
    }
}

#[test]
fn a_recording_without_descriptors_is_refused_by_name() {
    let error = Recording::parse(Bytes::from(headers())).unwrap_err();
    assert_eq!(
        error.to_string(),
        "recording has no device descriptor: capture from the start of an import with a server that writes descriptors"
    );
}

#[test]
fn damaged_blocks_are_named_with_their_number_and_offset() {
    let (bytes, _) = recording();
    let error = |bytes: Vec<u8>| Recording::parse(Bytes::from(bytes)).unwrap_err().to_string();
    assert_eq!(
        error(bytes[28..].to_vec()),
        "block 1 at offset 0: not a pcapng file: it does not start with a section header"
    );
    let mut long = bytes.to_vec();
    long[28 + 4..28 + 8].copy_from_slice(&0xffff_fff0u32.to_le_bytes());
    assert_eq!(error(long), "block 2 at offset 28: block length 4294967280 is over the limit of 67108864");
    // The third block is the first record: announce more data than it holds.
    let third = 28 + 36;
    let mut announced = bytes.to_vec();
    announced[third + 28 + 36..third + 28 + 40].copy_from_slice(&1000u32.to_le_bytes());
    assert_eq!(error(announced), "block 3 at offset 64: 1000 bytes of data announced, 0 in the record");
    let cut = bytes.len() - 3;
    assert!(error(bytes[..cut].to_vec()).contains("runs past the end"));
    let mut kind = bytes.to_vec();
    kind[third + 28 + 8] = b'X';
    assert_eq!(error(kind), "block 3 at offset 64: event type 'X' is none of S, C, E");
}

#[test]
fn golden_the_smallest_recording() {
    // A section, a usbmon interface (no options), and a device descriptor
    // and configuration answered (URB 1 and 2), as `usbwire serve --capture` writes them.
    let mut bytes = Vec::new();
    block(
        &mut bytes,
        0x0A0D_0D0A,
        &[0x4d, 0x3c, 0x2b, 0x1a, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
    );
    block(&mut bytes, 1, &[220, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(
        &bytes[..],
        &[
            0x0a, 0x0d, 0x0d, 0x0a, 28, 0, 0, 0, 0x4d, 0x3c, 0x2b, 0x1a, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff,
            0xff, 0xff, 0xff, 28, 0, 0, 0, 1, 0, 0, 0, 20, 0, 0, 0, 220, 0, 0, 0, 0, 0, 0, 0, 20, 0, 0, 0
        ][..]
    );
    let configuration = [9, 2, 9, 0, 0, 1, 0, 0x80, 50];
    descriptors_answered(&mut bytes, &configuration);
    let recording = Recording::parse(Bytes::from(bytes)).unwrap();
    assert_eq!((recording.device.vendor_id, recording.device.product_id), (0x1234, 0x5678));
    assert_eq!(recording.speed, Speed::HIGH, "no if_speed: from bcdUSB 2.00");
    assert_eq!(recording.configuration, configuration);
    assert_eq!(recording.urbs(), 0);
}

/// A device descriptor (URB 1) and `configuration` (URB 2) answered.
fn descriptors_answered(bytes: &mut Vec<u8>, configuration: &[u8]) {
    let device = [18, 1, 0, 2, 0, 0, 0, 64, 0x34, 0x12, 0x78, 0x56, 0, 1, 0, 0, 0, 1];
    for (id, setup, data) in
        [(1, [0x80, 6, 0, 1, 0, 0, 0xff, 0xff], &device[..]), (2, [0x80, 6, 0, 2, 0, 0, 0xff, 0xff], configuration)]
    {
        let base = Record {
            kind: b'S',
            id,
            transfer: 2,
            endpoint: 0x80,
            setup: Some(setup),
            status: -115,
            length: 0xffff,
            micros: 5,
            data: &[],
        };
        base.write(bytes);
        Record { kind: b'C', setup: None, status: 0, length: data.len() as u32, data, ..base }.write(bytes);
    }
}

#[test]
fn a_configuration_answer_too_short_to_hold_its_length_is_refused_by_name() {
    for short in [&[9u8][..], &[9, 2], &[9, 2, 9]] {
        let mut bytes = headers();
        descriptors_answered(&mut bytes, short);
        let error = Recording::parse(Bytes::from(bytes)).unwrap_err();
        assert!(error.to_string().contains("no configuration descriptor"), "{short:?}: {error}");
    }
}

proptest! {
    #[test]
    fn any_bytes_give_a_recording_or_an_error_never_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut file = headers();
        file.extend_from_slice(&bytes);
        let _ = Recording::parse(Bytes::from(file));
        let _ = Recording::parse(Bytes::from(bytes));
    }

    #[test]
    fn a_damaged_recording_gives_an_error_or_a_recording_never_a_panic(at in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<prop::sample::Index>()) {
        let (bytes, _) = recording();
        let mut damaged = bytes.to_vec();
        let i = at.index(damaged.len());
        damaged[i] = byte;
        let _ = Recording::parse(Bytes::from(damaged.clone()));
        damaged.truncate(cut.index(damaged.len()));
        if let Ok(recording) = Recording::parse(Bytes::from(damaged)) {
            let mut device = ReplayDevice::new(recording, "damaged".into(), ReplayOptions::default());
            let _ = run_on_lenient(&mut device);
        }
    }
}

/// Runs the workload on a replay that may hold requests: never waits.
fn run_on_lenient(device: &mut ReplayDevice) -> usize {
    let mut answered = 0;
    workload(
        &mut |urb| {
            let seqnum = urb.seqnum;
            device.submit(urb);
            let done = next(device).or_else(|| {
                device.cancel(seqnum);
                next(device)
            });
            answered += 1;
            done.unwrap_or_else(empty)
        },
        &RECORDED,
    );
    answered
}

/// A usbmon record of an isochronous URB on `endpoint`: `packets` are (status, offset, length).
fn iso_record(
    out: &mut Vec<u8>,
    kind: u8,
    id: u64,
    endpoint: u8,
    length: u32,
    packets: &[(i32, u32, u32)],
    data: &[u8],
) {
    let errors = packets.iter().filter(|(status, ..)| *status != 0).count() as u32;
    let mut record = Vec::new();
    record.extend_from_slice(&id.to_le_bytes());
    record.extend_from_slice(&[kind, 0, endpoint, 2, 1, 0, b'-', if data.is_empty() { b'<' } else { 0 }]);
    record.extend_from_slice(&1i64.to_le_bytes());
    record.extend_from_slice(&(if kind == b'S' { 10i32 } else { 1010 }).to_le_bytes());
    record.extend_from_slice(&(if kind == b'S' { -115i32 } else { 0 }).to_le_bytes());
    record.extend_from_slice(&length.to_le_bytes());
    record.extend_from_slice(&(data.len() as u32).to_le_bytes());
    record.extend_from_slice(&(if kind == b'S' { 0 } else { errors }).to_le_bytes());
    record.extend_from_slice(&(packets.len() as u32).to_le_bytes());
    record.extend_from_slice(&[0; 12]);
    record.extend_from_slice(&(packets.len() as u32).to_le_bytes());
    for &(status, offset, length) in packets {
        record.extend_from_slice(&status.to_le_bytes());
        record.extend_from_slice(&offset.to_le_bytes());
        record.extend_from_slice(&length.to_le_bytes());
        record.extend_from_slice(&[0; 4]);
    }
    record.extend_from_slice(data);
    let mut body = vec![0; 20];
    body[12..16].copy_from_slice(&(record.len() as u32).to_le_bytes());
    body[16..20].copy_from_slice(&(record.len() as u32).to_le_bytes());
    body.extend_from_slice(&record);
    block(out, 6, &body);
}

/// An isochronous IN URB of three 192-byte packets.
fn iso_in(seqnum: u32, packets: u32) -> Urb {
    let mut urb = data_in(seqnum, 0x81, 192 * packets);
    urb.number_of_packets = packets as i32;
    urb.iso_packets = (0..packets)
        .map(|n| IsoPacketDescriptor { offset: 192 * n, length: 192, actual_length: 0, status: Status::OK })
        .collect();
    urb
}

#[test]
fn an_isochronous_in_replays_its_packets_as_recorded() {
    // One interface with an isochronous IN endpoint (0x81, 512 bytes).
    let configuration = [9, 2, 25, 0, 1, 1, 0, 0x80, 50, 9, 4, 0, 0, 1, 0xff, 0, 0, 0, 7, 5, 0x81, 0x01, 0, 2, 1];
    let mut bytes = headers();
    descriptors_answered(&mut bytes, &configuration);
    let asked = [(0, 0, 192), (0, 192, 192), (0, 384, 192)];
    // The second packet was lost (-EXDEV); the third moved 16 bytes.
    let moved = [(0, 0, 192), (-18, 192, 0), (0, 384, 16)];
    let data: Vec<u8> = (0..208u32).map(|n| n as u8).collect();
    iso_record(&mut bytes, b'S', 7, 0x81, 576, &asked, &[]);
    iso_record(&mut bytes, b'C', 7, 0x81, 208, &moved, &data);
    let recording = Recording::parse(Bytes::from(bytes)).unwrap();
    let options = ReplayOptions { mode: Mode::Strict, timing: Timing::Asap, on_report: None };
    let mut device = ReplayDevice::new(recording.clone(), "iso.pcapng".into(), options);
    device.submit(iso_in(1, 3));
    let done = next(&mut device).expect("answered at once");
    assert_eq!((done.status, done.error_count, &done.data[..]), (Status::OK, 1, &data[..]));
    let packets: Vec<(Status, u32, u32, u32)> =
        done.iso_packets.iter().map(|p| (p.status, p.offset, p.length, p.actual_length)).collect();
    assert_eq!(packets, [(Status::OK, 0, 192, 192), (Status(-18), 192, 192, 0), (Status::OK, 384, 192, 16)]);
    assert_eq!((device.report().matched, device.report().divergences), (1, 0));

    let options = ReplayOptions { mode: Mode::Strict, timing: Timing::Asap, on_report: None };
    let mut device = ReplayDevice::new(recording, "iso.pcapng".into(), options);
    device.submit(iso_in(1, 2));
    assert_eq!(next(&mut device).expect("answered at once").status, Status::EPIPE);
    let report = device.report();
    assert_eq!(report.first_divergences[0].reason, "2 isochronous packets, the recording has 3");
}
