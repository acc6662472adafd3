//! What every exported device is: the [`Device`] trait (submit, complete,
//! cancel, reset, re-enumerate) with its contract, and the [`DeviceSummary`]
//! a device gives the server to list.
//!
//! It sits below `virtual_device` (which implements the trait for gadgets)
//! and everything that drives a device. It is not for the URB and completion
//! types themselves (`urb`) nor for answering control requests.

use std::task::{Context, Poll};

use usbwire_proto::{Direction, Speed};

use crate::urb::{Completion, TransferType, Urb};

/// What the server lists about a device (the parts of `usbip_usb_device` a
/// device knows; the server adds bus id, path and numbers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSummary {
    pub speed: Speed,
    pub vendor_id: u16,
    pub product_id: u16,
    pub bcd_device: u16,
    pub class: u8,
    pub subclass: u8,
    pub protocol: u8,
    pub configuration_value: u8,
    pub num_configurations: u8,
    /// (class, subclass, protocol) of each interface (alt setting 0) of the listed configuration.
    pub interfaces: Vec<(u8, u8, u8)>,
    /// Product string, for humans (`usbip list` looks names up in usb.ids instead).
    pub product: String,
    /// Manufacturer string, for humans.
    pub manufacturer: String,
    /// Serial number string (empty if the device has none); attach rules match on it.
    pub serial: String,
}

/// A USB device the server can export.
///
/// Contract:
/// * every submitted URB completes exactly once through [`poll_complete`](Self::poll_complete),
///   unless [`reset`](Self::reset) abandons it first;
/// * [`cancel`](Self::cancel) only asks: the URB still completes, with
///   [`Status::ECONNRESET`] if it was cut short or its real result if it had
///   already finished;
/// * URBs on one endpoint complete in submission order; different endpoints
///   are independent (an interrupt IN that waits forever must not hold up ep0).
///
/// [`Status::ECONNRESET`]: usbwire_proto::Status::ECONNRESET
pub trait Device: Send + 'static {
    /// What to list for this device.
    fn summary(&self) -> DeviceSummary;

    /// The transfer type of an endpoint (number 0..=15 plus direction) in the
    /// current configuration, or `None` if there is no such endpoint.
    fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType>;

    /// Starts a URB. Never blocks; problems are reported as a completion status.
    fn submit(&mut self, urb: Urb);

    /// The next finished URB, in completion order.
    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion>;

    /// Asks for the URB with this seqnum to end early (see the trait contract).
    fn cancel(&mut self, seqnum: u32);

    /// Abandons every URB in flight (no completions follow for them) and puts
    /// the device back in its default, unconfigured state, ready for a new importer.
    fn reset(&mut self);
    /// Whether the device has gone away (unplugged). Once true, every URB has
    /// completed and the server ends the connection and drops the export.
    fn is_gone(&self) -> bool {
        false
    }

    /// How many times this device has re-enumerated: disconnected and come
    /// back at the same port as another device (a DFU device entering its
    /// bootloader and, after flashing, its new firmware). 0 for a device that
    /// never does, which is every device that keeps the default.
    ///
    /// When the count changes:
    /// * every URB that was in flight has been abandoned: no completion follows
    ///   for it (as after [`reset`](Self::reset)); completions already collected
    ///   through [`poll_complete`](Self::poll_complete) stand, so a reply the
    ///   server holds (the request that caused the re-enumeration) should still
    ///   be sent;
    /// * [`summary`](Self::summary) and [`endpoint_type`](Self::endpoint_type)
    ///   describe the new device, which is unconfigured and ready for a new
    ///   importer: the server does not reset it again (a reset could make it
    ///   re-enumerate once more);
    /// * the device wakes the task that last polled `poll_complete`, so a server
    ///   that compares the count after each round of polling sees it without a
    ///   timer of its own.
    ///
    /// A device re-enumerates on its own (after a request, on its own timer,
    /// driven from `poll_complete`) or inside [`reset`](Self::reset) (a USB
    /// reset can make a DFU device leave its bootloader); a server that resets a
    /// device compares the count afterwards too. The server's part: end the
    /// current import (stock usbip importers see an ordinary disconnect), list
    /// the new device under the same bus id, and tell importers that understand
    /// it that this is the same port re-enumerated rather than a removal.
    fn enumeration(&self) -> u32 {
        0
    }
}

impl<D: Device + ?Sized> Device for Box<D> {
    fn summary(&self) -> DeviceSummary {
        (**self).summary()
    }
    fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        (**self).endpoint_type(direction, number)
    }
    fn submit(&mut self, urb: Urb) {
        (**self).submit(urb);
    }
    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        (**self).poll_complete(cx)
    }
    fn cancel(&mut self, seqnum: u32) {
        (**self).cancel(seqnum);
    }
    fn reset(&mut self) {
        (**self).reset();
    }
    fn is_gone(&self) -> bool {
        (**self).is_gone()
    }
    fn enumeration(&self) -> u32 {
        (**self).enumeration()
    }
}
