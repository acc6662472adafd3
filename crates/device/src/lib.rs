//! The device model: one abstraction every exported USB device implements.
//!
//! A [`Device`] takes URBs ([`Urb`]) and hands back completions
//! ([`Completion`]) asynchronously, in the shape of nusb's transfer queue:
//! [`Device::submit`] never blocks, [`Device::poll_complete`] yields results
//! in whatever order the device finishes them, [`Device::cancel`] asks for one
//! URB to end early, and [`Device::reset`] abandons everything and returns the
//! device to its unconfigured state. A device that disconnects and comes back
//! at the same port as another device (a DFU bootloader) says so by counting
//! up [`Device::enumeration`]. The server drives one device from one
//! task, so implementations need no locking on the data path.
//!
//! Virtual devices implement the smaller [`Function`] trait and are wrapped in
//! a [`VirtualDevice`], which answers the standard control requests (descriptors,
//! configuration, interfaces, status, halt) from a [`DescriptorSet`] and
//! validates endpoints, so each gadget only writes its class behaviour.
//! Real devices (through usbfs) implement [`Device`] directly.
//!
//! A [`Selector`] (`1-1.2`, `0781:5567`, `serial=…`, `class=…`) picks
//! devices by their [`DeviceFacts`], wherever the devices come from.
//!
//! [`record::DeviceJson`] is how every JSON document shows a device, named
//! from usb.ids by [`usb_ids`]. [`devstate`] is the device state document a
//! server sends and a client reads (`OP_REP_DEVSTATE`, `usbwire state`), which
//! converts into that record, with a device's traffic [`counters`] beside it.
//! [`sync::lock`] is the poison policy of every mutex in usbwire.
//!
//! This crate is not for sockets or wire formats: it knows URBs and the JSON
//! documents that show devices, not the bytes around them on the network (it
//! borrows only value types from `usbwire-proto`).

pub mod control;
pub mod counters;
pub mod descriptor;
mod device;
pub mod devstate;
mod queue;
pub mod record;
pub mod selector;
pub mod sync;
mod urb;
pub mod usb_ids;
mod virtual_device;

pub use device::{Device, DeviceSummary};
pub use queue::CompletionQueue;
pub use selector::{AsDeviceFacts, ClassSet, DeviceFacts, Selector, SelectorError};
pub use urb::{Completion, TransferType, Urb};
pub use usbwire_proto::urb::{IsoPacketDescriptor, TransferFlags};
pub use usbwire_proto::{Direction, Speed, Status};
pub use virtual_device::{ControlReply, DescriptorSet, Function, VirtualDevice};
