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
//! [`ReplayDevice`] is none of these: it serves back a device recorded by a
//! server's capture (`--virtual replay=FILE`), with the recorded ids.
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
mod identity;
pub mod loopback;
pub mod mass_storage;
pub mod replay;
pub mod serial;
#[cfg(test)]
mod testing;

pub use dfu::{DfuDevice, DfuError, DfuOptions};
pub use hid::{keyboard, mouse, Keyboard, KeyboardHandle, Mouse, MouseHandle, TypeError};
pub use identity::VENDOR_ID;
pub use loopback::{loopback, Loopback};
pub use mass_storage::{DiskError, DiskOptions, MassStorage};
pub use replay::{ReplayDevice, ReplayOptions};
pub use serial::{serial, CdcAcm, LineCoding, SerialError};
