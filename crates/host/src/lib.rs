//! Real USB devices on this machine, shared from userspace through Linux usbfs.
//!
//! [`list`] enumerates local devices (through nusb) with what a user needs to
//! pick one: bus id as usbip names it, VID:PID, strings, speed, and the kernel
//! driver of each interface. A [`Selector`](usbwire_device::Selector) (from `usbwire-device`) matches them by bus id, VID:PID,
//! serial or class (bind rules). [`HostDevice`] is an opened device that the
//! server exports: it implements `usbwire_device::Device` over usbfs URBs.
//! [`hotplug::watch`] reports arrivals and departures.
//!
//! Not for virtual devices (see `usbwire-gadgets`) nor for sockets.

mod device;
mod facts;
pub mod hotplug;
mod local;
mod urb_table;
mod usbfs;

pub use device::HostDevice;
pub use local::{list, LocalDevice, LocalInterface};
