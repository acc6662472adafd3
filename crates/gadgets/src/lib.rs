//! Virtual USB devices the server can export: a HID keyboard and mouse, a
//! CDC-ACM serial port bridged to a pseudo-terminal, mass storage backed by a
//! disk image, a loopback test device, and a DFU device flashed into a file.
//!
//! Each gadget is a [`Function`](usbwire_device::Function) wrapped in a
//! [`VirtualDevice`](usbwire_device::VirtualDevice), which answers the
//! chapter-9 requests; the modules here only add class behaviour (the DFU
//! device is two of them, one per mode, and re-enumerates between them). All of them
//! are high speed (the loopback can also be SuperSpeed) with vendor id
//! `0x1209` and manufacturer "usbwire":
//!
//! | product id | constructor | what |
//! |---|---|---|
//! | `0x0001` | [`keyboard`] | boot keyboard, typed into through a [`KeyboardHandle`] |
//! | `0x0002` | [`mouse`] | boot mouse with wheel, moved through a [`MouseHandle`] |
//! | `0x0003` | [`MassStorage::open`] | Bulk-Only + SCSI disk on an image file (high speed or SuperSpeed) |
//! | `0x0004` | [`serial`] | CDC-ACM bridged to `/dev/pts/N` (needs a tokio runtime) |
//! | `0x0005` | [`loopback`] | source, sink and loop endpoints for tests and benchmarks |
//! | `0x0006`, `0x0007` | [`DfuDevice::open`] | DFU 1.1 runtime mode, and the DFU mode it re-enumerates into |
//!
//! These are pid.codes' shared test ids, so a device is told apart by its
//! own strings too (`usbwire list -r` names it by them). The project's
//! devices outside this crate keep clear of these ids: the Python echo
//! example is `0x0008` and the Python tests' vendor device `0x0009`
//! (`python/`), `usbwire_external`'s echo `0x000e`.
//!
//! ```
//! use usbwire_device::Device;
//!
//! let (keyboard, handle) = usbwire_gadgets::keyboard();
//! assert_eq!(keyboard.summary().product, "usbwire keyboard");
//! // Nothing is typed until a host has configured the device.
//! assert!(!handle.is_attached());
//! assert!(handle.type_text("hello").is_err());
//! ```
//!
//! This crate is not for sockets or the wire protocol: a gadget sees URBs,
//! and the server decides who gets to send them.

pub mod dfu;
pub mod hid;
pub mod loopback;
pub mod mass_storage;
pub mod serial;

pub use dfu::{DfuDevice, DfuError, DfuOptions};
pub use hid::{keyboard, mouse, Keyboard, KeyboardHandle, Mouse, MouseHandle, TypeError};
pub use loopback::{loopback, Loopback};
pub use mass_storage::{DiskError, DiskOptions, MassStorage};
pub use serial::{serial, CdcAcm, LineCoding, SerialError};

/// The vendor id of every gadget (pid.codes, the open-source hardware vendor id).
pub const VENDOR_ID: u16 = 0x1209;

/// The manufacturer string of every gadget.
const MANUFACTURER: &str = "usbwire";

/// A stable serial number for a backing file's path (so the host recognises
/// the device across restarts): FNV-1a of the canonical path (the path as given
/// if it does not exist), as 16 hex digits.
fn serial_number(path: &std::path::Path) -> String {
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let hash = canonical
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("{hash:016X}")
}

/// Shared by the modules' unit tests: URB builders and ways to drive a device.
#[cfg(test)]
mod testing {
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
}
