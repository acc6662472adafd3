//! Shared by the modules' unit tests: URB builders and ways to drive a device.
//! Not for anything outside this crate's tests.

use std::future::poll_fn;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use usbwire_device::control::SetupPacket;
use usbwire_device::{Completion, Device, Direction, TransferFlags, Urb};

fn urb(seqnum: u32, endpoint: u8, direction: Direction, length: u32, data: Bytes) -> Urb {
    Urb {
        seqnum,
        endpoint,
        direction,
        setup: [0; 8],
        flags: TransferFlags(0),
        length,
        data,
        start_frame: 0,
        interval: 0,
        number_of_packets: 0,
        iso_packets: vec![],
    }
}

/// A control URB with `setup` and (for OUT requests) `data`.
pub(crate) fn control(seqnum: u32, setup: [u8; 8], data: &[u8]) -> Urb {
    let parsed = SetupPacket::parse(&setup);
    let direction = if parsed.is_in() && parsed.length > 0 { Direction::In } else { Direction::Out };
    let mut urb = urb(seqnum, 0, direction, u32::from(parsed.length), Bytes::copy_from_slice(data));
    urb.setup = setup;
    if direction == Direction::Out {
        urb.length = data.len() as u32;
    }
    urb
}

pub(crate) fn data_in(seqnum: u32, address: u8, length: u32) -> Urb {
    urb(seqnum, address & 0x0f, Direction::In, length, Bytes::new())
}

pub(crate) fn data_out(seqnum: u32, address: u8, data: Bytes) -> Urb {
    urb(seqnum, address & 0x0f, Direction::Out, data.len() as u32, data)
}

/// The next completion if one is ready now.
pub(crate) fn next(device: &mut impl Device) -> Option<Completion> {
    let mut cx = Context::from_waker(Waker::noop());
    match device.poll_complete(&mut cx) {
        Poll::Ready(done) => Some(done),
        Poll::Pending => None,
    }
}

/// The next completion, waiting up to two seconds (for devices driven by I/O).
pub(crate) async fn next_within(device: &mut impl Device) -> Option<Completion> {
    tokio::time::timeout(Duration::from_secs(2), poll_fn(|cx| device.poll_complete(cx))).await.ok()
}

/// Runs a control request that must succeed and returns its data.
pub(crate) fn request(device: &mut impl Device, setup: [u8; 8], data: &[u8]) -> Bytes {
    device.submit(control(0xc000, setup, data));
    let done = next(device).expect("control requests complete at once");
    assert_eq!(done.status, usbwire_device::Status::OK, "request {setup:02x?}");
    done.data
}

/// SET_CONFIGURATION(1).
pub(crate) fn configure(device: &mut impl Device) {
    request(device, [0x00, 0x09, 1, 0, 0, 0, 0, 0], &[]);
}
