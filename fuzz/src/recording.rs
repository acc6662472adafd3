//! The `recording` harness: a capture file as `usbwire serve --virtual
//! replay=FILE` reads it (`usbwire_gadgets::replay::recording`), then the
//! replay device driven with every request the recording holds.
//!
//! Input: `[flags] ++ bytes`. Flag bit 0 puts a valid section header and
//! usbmon interface in front of the bytes (so the fuzzer reaches the
//! records without finding the headers first); bit 1 replays in lenient
//! mode. Invariants: no panic, no allocation sized by an unbacked length;
//! an error names a block; a parsed recording's device answers each of its
//! own requests at once or holds it until cancelled, IN data never longer
//! than asked.

use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use usbwire_device::{Device, Direction, Status, TransferFlags, Urb};
use usbwire_gadgets::replay::{Mode, Recording, RecordingError, ReplayDevice, ReplayOptions};

/// A section header and one usbmon interface at 480 Mbit/s.
const HEADERS: [u8; 64] = [
    0x0a, 0x0d, 0x0d, 0x0a, 28, 0, 0, 0, 0x4d, 0x3c, 0x2b, 0x1a, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xff, 28, 0, 0, 0, 1, 0, 0, 0, 36, 0, 0, 0, 220, 0, 0, 0, 0, 0, 0, 0, 8, 0, 8, 0, 0x00, 0x38, 0x9c, 0x1c, 0, 0, 0,
    0, 0, 0, 0, 0, 36, 0, 0, 0,
];

pub fn recording(data: &[u8]) {
    let Some((&flags, bytes)) = data.split_first() else { return };
    let mut file = Vec::with_capacity(HEADERS.len() + bytes.len());
    if flags & 1 != 0 {
        file.extend_from_slice(&HEADERS);
    }
    file.extend_from_slice(bytes);
    let recording = match Recording::parse(Bytes::from(file)) {
        Ok(recording) => recording,
        Err(RecordingError::Block { block, .. }) => {
            assert!(block >= 1);
            return;
        }
        Err(_) => return,
    };
    let mode = if flags & 2 != 0 { Mode::Lenient } else { Mode::Strict };
    let mut device = ReplayDevice::new(recording.clone(), "fuzz".into(), ReplayOptions { mode, ..Default::default() });
    let mut seqnum = 0;
    let own = recording.control.iter().chain(recording.endpoints.iter().flat_map(|(_, list)| list.iter()));
    for exchange in own.take(256) {
        seqnum += 1;
        let direction = if exchange.endpoint & 0x80 != 0 { Direction::In } else { Direction::Out };
        let urb = Urb {
            seqnum,
            endpoint: exchange.endpoint & 0x0f,
            direction,
            setup: exchange.setup,
            flags: TransferFlags(0),
            length: exchange.requested,
            data: exchange.out.clone(),
            start_frame: 0,
            interval: 0,
            number_of_packets: 0,
            iso_packets: Vec::new(),
        };
        let asked = urb.length;
        device.submit(urb);
        let done = match next(&mut device) {
            Some(done) => done,
            None => {
                device.cancel(seqnum);
                next(&mut device).unwrap_or_else(|| panic!("URB {seqnum} neither answered nor cancelled"))
            }
        };
        assert_eq!(done.seqnum, seqnum);
        if direction == Direction::In {
            assert!(done.data.len() <= asked as usize, "{} bytes for {asked} asked", done.data.len());
        }
        assert!(done.status != Status::ECONNRESET || device.report().requests == u64::from(seqnum));
    }
    device.reset();
}

fn next(device: &mut ReplayDevice) -> Option<usbwire_device::Completion> {
    match device.poll_complete(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(done) => Some(done),
        Poll::Pending => None,
    }
}
