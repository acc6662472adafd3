//! No decoder allocates from a length the input has not backed with bytes: huge
//! `transfer_buffer_length`, `number_of_packets`, `ndev` or `actual_length` values behind a
//! tiny input must give `Ok(None)` or an error, quickly, with no large allocation, even
//! with every limit raised to the maximum.
//!
//! Its own test binary because it installs a global allocator that records the largest
//! single request; one `#[test]` so no other test allocates concurrently.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use usbwire_proto::op;
use usbwire_proto::urb::{self, SubmittedShape};
use usbwire_proto::{Direction, Limits};

struct Recording;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator, only recording sizes.
unsafe impl GlobalAlloc for Recording {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static RECORDING: Recording = Recording;

/// Runs `decode` on `input` and returns the largest single allocation it made.
fn largest_allocation(input: &[u8], decode: impl FnOnce(&mut BytesMut)) -> usize {
    let mut buf = BytesMut::with_capacity(input.len());
    buf.extend_from_slice(input);
    LARGEST.store(0, Ordering::Relaxed);
    let started = Instant::now();
    decode(&mut buf);
    assert!(started.elapsed() < Duration::from_secs(1), "decoding {} bytes took {:?}", input.len(), started.elapsed());
    LARGEST.load(Ordering::Relaxed)
}

fn header(words: [u32; 12]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_be_bytes()).collect()
}

#[test]
fn huge_announced_lengths_allocate_nothing_large() {
    // Well above what 400 bytes of input could need, far below what a huge length asks for.
    const BOUND: usize = 64 * 1024;
    let unlimited = Limits { max_transfer_length: u32::MAX, max_iso_packets: u32::MAX, max_devices: u32::MAX };
    let all_limits = [Limits::default(), unlimited];

    // CMD_SUBMIT: OUT with transfer_buffer_length i32::MAX; ISO IN with np i32::MAX.
    let out = header([1, 1, 0x10001, 0, 2, 0, 0x7fff_ffff, 0, 0, 0, 0, 0]);
    let iso_in = header([1, 1, 0x10001, 1, 1, 0x202, 0x7fff_ffff, 0, 0x7fff_ffff, 1, 0, 0]);
    for limits in &all_limits {
        for input in [&out, &iso_in] {
            let mut padded = input.clone();
            padded.resize(400, 0);
            let largest = largest_allocation(&padded, |buf| {
                let _ = urb::decode_command(buf, limits, |_, _| true);
                let _ = urb::command_frame_len(buf, limits, |_, _| true);
            });
            assert!(largest <= BOUND, "decode_command allocated {largest} bytes");
        }
    }

    // RET_SUBMIT: actual_length i32::MAX for an IN request of the same size; np i32::MAX
    // when the caller (wrongly) expects that many.
    let ret = header([3, 1, 0, 0, 0, 0, 0x7fff_ffff, 0, 0x7fff_ffff, 0, 0, 0]);
    for limits in &all_limits {
        for iso_packets in [None, Some(i32::MAX)] {
            let shape = SubmittedShape { direction: Direction::In, transfer_buffer_length: u32::MAX, iso_packets };
            let largest = largest_allocation(&ret, |buf| {
                let _ = urb::decode_return(buf, limits, |_| Some(shape));
            });
            assert!(largest <= BOUND, "decode_return allocated {largest} bytes");
        }
    }

    // OP_REP_DEVLIST announcing u32::MAX devices, each with 255 interfaces.
    let mut devlist = vec![0x01, 0x11, 0x00, 0x05, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff];
    devlist.resize(12 + op::DEVICE_RECORD_LEN, 0);
    devlist[12 + op::DEVICE_RECORD_LEN - 1] = 255;
    for limits in &all_limits {
        let largest = largest_allocation(&devlist, |buf| {
            let _ = op::decode_devlist_reply(buf, limits);
        });
        assert!(largest <= BOUND, "decode_devlist_reply allocated {largest} bytes");
    }
}
