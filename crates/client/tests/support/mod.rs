//! What the client's test binaries share: the device a fake server offers.

use usbwire_proto::op::{BusId, DeviceRecord};
use usbwire_proto::Speed;

/// The record of a vendor-specific high-speed device at 1-1, as a fake server imports it.
pub(crate) fn record() -> DeviceRecord {
    DeviceRecord {
        path: "/sys/devices/fake/1-1".into(),
        busid: BusId::new("1-1").unwrap(),
        busnum: 1,
        devnum: 1,
        speed: Speed::HIGH,
        id_vendor: 0x1209,
        id_product: 0x0005,
        bcd_device: 0x0100,
        b_device_class: 0xff,
        b_device_sub_class: 0,
        b_device_protocol: 0,
        b_configuration_value: 1,
        b_num_configurations: 1,
        interfaces: Vec::new(),
        b_num_interfaces: 1,
    }
}
