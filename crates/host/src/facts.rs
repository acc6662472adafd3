//! What a local USB device tells a [`Selector`](usbwire_device::Selector): its bus id, VID:PID,
//! serial number and classes. The selector itself (parsing, matching) lives
//! in `usbwire-device`, shared with the server's rules, the lab and the client.

use usbwire_device::{AsDeviceFacts, DeviceFacts};

use crate::LocalDevice;

impl AsDeviceFacts for LocalDevice {
    /// A device class of 0 ("defined per interface") is not a class here:
    /// `class=00` picks no local device by its device class.
    fn device_facts(&self) -> DeviceFacts<'_> {
        DeviceFacts {
            busid: &self.busid,
            vendor_id: Some(self.vendor_id),
            product_id: Some(self.product_id),
            serial: self.serial.as_deref(),
            classes: self.classes().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalInterface;
    use usbwire_device::Selector;
    use usbwire_device::Speed;

    fn disk(busid: &str, serial: &str) -> LocalDevice {
        LocalDevice {
            busid: busid.into(),
            busnum: 1,
            devnum: 2,
            vendor_id: 0x46f4,
            product_id: 0x0001,
            manufacturer: None,
            product: None,
            serial: Some(serial.into()),
            speed: Speed::HIGH,
            bcd_device: 0x0100,
            class: 0,
            subclass: 0,
            protocol: 0,
            interfaces: vec![LocalInterface { number: 0, class: 8, subclass: 6, protocol: 0x50, driver: None }],
            configuration: Some(1),
            sysfs_path: Default::default(),
        }
    }

    #[test]
    fn matches_by_serial_among_identical_devices() {
        let (a, b) = (disk("1-1", "AAA"), disk("1-2", "BBB"));
        let by_serial: Selector = "serial=BBB".parse().unwrap();
        assert!(!by_serial.matches(&a) && by_serial.matches(&b));
        let by_id: Selector = "46f4:0001".parse().unwrap();
        assert!(by_id.matches(&a) && by_id.matches(&b));
        assert!("class=08".parse::<Selector>().unwrap().matches(&a), "interface class counts");
        assert!(!"class=03".parse::<Selector>().unwrap().matches(&a));
        assert!(!"class=00".parse::<Selector>().unwrap().matches(&a), "device class 0 is not a class");
        assert!("1-2".parse::<Selector>().unwrap().matches(&b));
    }
}
