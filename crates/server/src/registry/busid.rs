//! Bus ids of virtual devices: `0-N`, the first free `N`, and the ones set
//! aside for devices that come and go (a device process that disconnects
//! keeps its bus id for when it comes back).

use std::collections::HashSet;

use usbwire_proto::op::BusId;

/// The bus number of virtual devices. Linux numbers its USB buses from 1
/// (`usb_register_bus`: `idr_alloc(&usb_bus_idr, bus, 1, USB_MAXBUS, …)` in
/// `drivers/usb/core/hcd.c`), so bus 0 is never a real controller's and no
/// real device's bus id (`1-1`, `3-2.4`) is ever `0-N`. vhci-hcd takes any
/// `devid` (`busnum << 16 | devnum`) and `usbip attach` any bus id string.
pub const VIRTUAL_BUS: u32 = 0;

/// The first free `0-N` bus id (`taken` says which are used) and its `N`.
/// (The `usbip` tool hands `devnum` to vhci as a `uint8_t`: past 255 virtual
/// devices the kernel client would see the wrong one.)
pub(super) fn virtual_busid(taken: impl Fn(&str) -> bool) -> (BusId, u32) {
    let mut devnum = 1u32;
    loop {
        // Ends: only finitely many bus ids are taken, and `0-N` is always a valid bus id.
        if let Some(busid) = BusId::new(&format!("{VIRTUAL_BUS}-{devnum}")).filter(|b| !taken(b.as_str())) {
            return (busid, devnum);
        }
        devnum = devnum.saturating_add(1);
    }
}

/// Bus ids set aside ([`Registry::reserve`](super::Registry::reserve)): no other
/// virtual device takes them while their device is away.
#[derive(Default)]
pub(super) struct Reserved(pub(super) HashSet<String>);
