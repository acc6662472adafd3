//! The device records the CLI's `--json` documents print (`list -r`, `list
//! -l`, `describe`, `port`), made from what each source knows and named from
//! usb.ids. The record itself is `usbwire_device::record::DeviceJson`; the
//! field reference is docs/json.md. Printing is [`super::output`]'s.

use serde::Serialize;
use usbwire_device::devstate::{DeviceStateEntry, ShownReservation};
use usbwire_device::record::{bcd, class_triple, hex16, DeviceJson, InterfaceJson};
use usbwire_host::LocalDevice;
use usbwire_proto::op::DeviceRecord;

use super::usb_names::UsbIds;

/// A device of `list -r`: its record, and the numbers only a USB/IP listing
/// has (`null` for a device in use, which the listing leaves out).
#[derive(Debug, Serialize)]
pub(crate) struct ListedDevice {
    #[serde(flatten)]
    pub(crate) device: DeviceJson,
    pub(crate) busnum: Option<u32>,
    pub(crate) devnum: Option<u32>,
    /// The sysfs path on the server (free text for virtual devices).
    pub(crate) path: Option<String>,
    pub(crate) configuration_value: Option<u8>,
    pub(crate) num_configurations: Option<u8>,
    /// Reserved in the lab registry (what the server knows of it), else `null`.
    pub(crate) reservation: Option<ShownReservation>,
}

/// A device plugged into this machine (`list -l`).
#[derive(Debug, Serialize)]
pub(crate) struct LocalListed {
    #[serde(flatten)]
    pub(crate) device: DeviceJson,
    pub(crate) busnum: u8,
    pub(crate) devnum: u8,
}

/// Every device of a server: each one its DEVLIST names, with its strings
/// and state from the DEVSTATE document when the server sends one, then
/// those the document has in use (a DEVLIST leaves them out, as usbip's
/// does) — the same record whatever their state.
pub(crate) fn listed(
    devices: &[DeviceRecord],
    states: Option<&[DeviceStateEntry]>,
    names: &UsbIds,
) -> Vec<ListedDevice> {
    let states = states.unwrap_or_default();
    let mut listed: Vec<ListedDevice> = devices
        .iter()
        .map(|record| {
            let mut device = DeviceJson::from_wire(record);
            let state = states.iter().find(|s| s.busid == record.busid.as_str());
            if let Some(state) = state {
                device = DeviceJson { interfaces: device.interfaces, ..DeviceJson::from(state) };
                device.bcd_device = Some(bcd(record.bcd_device));
                device.device_class =
                    Some(class_triple(record.b_device_class, record.b_device_sub_class, record.b_device_protocol));
                device.speed = record.speed.name().to_owned();
            }
            device.fill_names(names);
            ListedDevice {
                device,
                busnum: Some(record.busnum),
                devnum: Some(record.devnum),
                path: Some(record.path.clone()),
                configuration_value: Some(record.b_configuration_value),
                num_configurations: Some(record.b_num_configurations),
                reservation: state.and_then(|s| s.reservation.as_ref()).map(ShownReservation::from),
            }
        })
        .collect();
    for state in states.iter().filter(|s| !devices.iter().any(|d| d.busid.as_str() == s.busid)) {
        let mut device = DeviceJson::from(state);
        device.fill_names(names);
        listed.push(ListedDevice {
            device,
            busnum: None,
            devnum: None,
            path: None,
            configuration_value: None,
            num_configurations: None,
            reservation: state.reservation.as_ref().map(ShownReservation::from),
        });
    }
    listed
}

/// A device on this machine, with its interfaces' drivers.
pub(crate) fn local(local: &LocalDevice, names: &UsbIds) -> LocalListed {
    let mut device = DeviceJson {
        busid: local.busid.clone(),
        vendor_id: hex16(local.vendor_id),
        product_id: hex16(local.product_id),
        bcd_device: Some(bcd(local.bcd_device)),
        device_class: Some(class_triple(local.class, local.subclass, local.protocol)),
        speed: local.speed.name().to_owned(),
        manufacturer: local.manufacturer.clone(),
        product: local.product.clone(),
        serial: local.serial.clone(),
        interfaces: local
            .interfaces
            .iter()
            .map(|i| InterfaceJson {
                number: i.number,
                class: class_triple(i.class, i.subclass, i.protocol),
                driver: i.driver.clone(),
                ..InterfaceJson::default()
            })
            .collect(),
        ..DeviceJson::default()
    };
    device.fill_names(names);
    LocalListed { device, busnum: local.busnum, devnum: local.devnum }
}

/// The record of a device a `describe` read: what its import said (bus id,
/// speed, ids), its descriptors (strings, release, class), and what the
/// server's device state said of it before (`kind`, `state` and the holder's
/// fields, as `list -r` shows them; `null` from a server that sends none).
pub(crate) fn described(
    record: &DeviceRecord,
    description: &usbwire_client::describe::Description,
    state: Option<&DeviceStateEntry>,
    names: &UsbIds,
) -> DeviceJson {
    let mut device = match state {
        Some(state) => DeviceJson { speed: record.speed.name().to_owned(), ..DeviceJson::from(state) },
        None => DeviceJson::from_wire(record),
    };
    device.busid = record.busid.to_string();
    device.vendor_id = hex16(record.id_vendor);
    device.product_id = hex16(record.id_product);
    device.bcd_device = Some(description.bcd_device.clone());
    device.device_class = Some(description.device_class.clone());
    device.manufacturer = description.manufacturer.clone();
    device.product = description.product.clone();
    device.serial = description.serial.clone();
    device.interfaces = description
        .items
        .iter()
        .filter_map(|item| match item {
            usbwire_client::describe::Item::Interface { number, alt_setting: 0, class, .. } => {
                Some(InterfaceJson { number: *number, class: class.clone(), ..InterfaceJson::default() })
            }
            _ => None,
        })
        .collect();
    device.fill_names(names);
    device
}

#[cfg(test)]
mod tests {
    use usbwire_proto::op::{BusId, InterfaceRecord};
    use usbwire_proto::Speed;

    use super::*;

    fn record(busid: &str) -> DeviceRecord {
        DeviceRecord {
            path: "usbwire/virtual/disk".into(),
            busid: BusId::new(busid).unwrap(),
            busnum: 2,
            devnum: 1,
            speed: Speed::SUPER,
            id_vendor: 0x1209,
            id_product: 0x0003,
            bcd_device: 0x0100,
            b_device_class: 0,
            b_device_sub_class: 0,
            b_device_protocol: 0,
            b_configuration_value: 1,
            b_num_configurations: 1,
            interfaces: vec![InterfaceRecord {
                b_interface_class: 8,
                b_interface_sub_class: 6,
                b_interface_protocol: 0x50,
            }],
            b_num_interfaces: 1,
        }
    }

    #[test]
    fn an_available_and_an_in_use_device_have_the_same_record_shape() {
        let names = UsbIds::default();
        let available = DeviceStateEntry {
            busid: "2-1".into(),
            kind: "disk".into(),
            vendor_id: "1209".into(),
            product_id: "0003".into(),
            product: "usbwire disk".into(),
            speed: "super".into(),
            state: "available".into(),
            ..DeviceStateEntry::default()
        };
        let in_use = DeviceStateEntry {
            busid: "2-2".into(),
            state: "in_use".into(),
            client: Some("10.0.0.9:4000".into()),
            bcd_device: Some("1.00".into()),
            ..available.clone()
        };
        let listed = listed(&[record("2-1")], Some(&[available, in_use]), &names);
        let json: Vec<serde_json::Value> = listed.iter().map(|d| serde_json::to_value(d).unwrap()).collect();
        let keys = |v: &serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(&json[0]), keys(&json[1]));
        assert_eq!(json[0]["product"], "usbwire disk");
        assert_eq!(json[0]["bcd_device"], "1.00");
        assert_eq!(json[0]["interfaces"][0]["class_name"], "Mass Storage");
        assert_eq!(json[1]["state"], "in_use");
        assert_eq!(json[1]["holder"], "10.0.0.9:4000");
        assert!(json[1]["path"].is_null());
        // A stock server: no document, the DEVLIST alone.
        let stock = serde_json::to_value(&listed_only(&[record("1-1")])[0]).unwrap();
        assert!(stock["state"].is_null() && stock["product"].is_null(), "{stock}");
        assert_eq!(keys(&stock), keys(&json[0]));
    }

    fn listed_only(devices: &[DeviceRecord]) -> Vec<ListedDevice> {
        listed(devices, None, &UsbIds::default())
    }
}
