//! The device record: how every `--json` document (`list`, `state`,
//! `describe`, `port`, `who`, `list --registry`), the status page's
//! `/status.json` and the lab registry's device records show one USB device.
//! One set of fields, one meaning and one format each, so a script reads a
//! device the same way whichever verb printed it; `docs/json.md` is the
//! field reference.
//!
//! Every field is always present: what a source does not know is `null`
//! (a stock `usbipd` reports no strings and no state; a local listing no
//! holder), so an available device and one in use have the same shape and
//! differ in `state` and the holder's fields.
//!
//! Not a wire format: the USB/IP records are `usbwire-proto`'s, and the
//! `OP_REP_DEVSTATE` document a server sends is [`crate::devstate`]
//! (which converts into this record).

use serde::{Deserialize, Serialize};
use usbwire_proto::op::DeviceRecord;

use crate::usb_ids::{class_name, UsbIds};

/// The version of the JSON vocabulary: every document the CLI prints and
/// `/status.json` carry it as `schema_version`. A field changes meaning
/// or format only with a new version (docs/json.md lists what each changed).
pub const JSON_SCHEMA_VERSION: u32 = 2;

/// One device, as every JSON document shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceJson {
    /// The bus id the device is exported (or plugged in) as: `1-1.2`.
    pub busid: String,
    /// What exports it: a virtual device kind (`disk`, `keyboard`, …) or `host` (a real device).
    #[serde(default)]
    pub kind: Option<String>,
    /// Four lowercase hex digits.
    pub vendor_id: String,
    pub product_id: String,
    /// The device's release number in binary-coded decimal, as USB and lsusb write it: `1.00`.
    #[serde(default)]
    pub bcd_device: Option<String>,
    /// Class, subclass and protocol of the device, two hex digits each: `00/00/00`.
    #[serde(default)]
    pub device_class: Option<String>,
    /// `low`, `full`, `high`, `super`, `super-plus`, `wireless` or `unknown`.
    #[serde(default)]
    pub speed: String,
    /// The device's own manufacturer string (what it says of itself).
    #[serde(default)]
    pub manufacturer: Option<String>,
    /// The device's own product string.
    #[serde(default)]
    pub product: Option<String>,
    /// The device's own serial number string.
    #[serde(default)]
    pub serial: Option<String>,
    /// The vendor's name in the system's usb.ids (looked up by `vendor_id`).
    #[serde(default)]
    pub vendor_name: Option<String>,
    /// The product's name in the system's usb.ids (looked up by `vendor_id:product_id`).
    #[serde(default)]
    pub product_name: Option<String>,
    /// Interfaces of the current configuration.
    #[serde(default)]
    pub interfaces: Vec<InterfaceJson>,
    /// `available`, `in_use` or `resuming` (in use, its importer's connection
    /// lost and held for it to resume); `null` where the source does not say.
    #[serde(default)]
    pub state: Option<String>,
    /// Who holds it: the importer's TLS identity, else its address.
    #[serde(default)]
    pub holder: Option<String>,
    /// The importer's address (`IP:PORT`).
    #[serde(default)]
    pub client: Option<String>,
    /// The importer's certificate fingerprint (`sha256:…`), when it came over TLS.
    #[serde(default)]
    pub identity: Option<String>,
    /// RFC 3339, to the second: since when it is in use.
    #[serde(default)]
    pub since_at: Option<String>,
    /// `since_at` in seconds since the Unix epoch.
    #[serde(default)]
    pub since: Option<u64>,
    /// RFC 3339: when the importer's connection was lost (state `resuming`).
    #[serde(default)]
    pub resuming_since_at: Option<String>,
    /// `resuming_since_at` in seconds since the Unix epoch.
    #[serde(default)]
    pub resuming_since: Option<u64>,
}

/// One interface of a [`DeviceJson`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterfaceJson {
    pub number: u8,
    /// Class, subclass and protocol, two hex digits each: `08/06/50`.
    pub class: String,
    /// The class's name in usb.ids (`Mass Storage`), where the reader has it.
    #[serde(default)]
    pub class_name: Option<String>,
    /// The kernel driver bound to it on this machine (`list -l`; `usbfs`
    /// while a usbwire server holds it); `null` when none is, or elsewhere.
    #[serde(default)]
    pub driver: Option<String>,
}

impl DeviceJson {
    /// What a USB/IP device record says: bus id, ids, release, class, speed
    /// and interfaces. Strings, names and state are left for the caller.
    pub fn from_wire(record: &DeviceRecord) -> Self {
        Self {
            busid: record.busid.to_string(),
            vendor_id: hex16(record.id_vendor),
            product_id: hex16(record.id_product),
            bcd_device: Some(bcd(record.bcd_device)),
            device_class: Some(class_triple(
                record.b_device_class,
                record.b_device_sub_class,
                record.b_device_protocol,
            )),
            speed: record.speed.name().to_owned(),
            interfaces: record
                .interfaces
                .iter()
                .zip(0u8..)
                .map(|(interface, number)| InterfaceJson {
                    number,
                    class: class_triple(
                        interface.b_interface_class,
                        interface.b_interface_sub_class,
                        interface.b_interface_protocol,
                    ),
                    ..InterfaceJson::default()
                })
                .collect(),
            ..Self::default()
        }
    }

    /// Fills in what the ids and classes are called: `vendor_name` and
    /// `product_name` from `names` (this machine's usb.ids), each interface's
    /// `class_name`. Every document that shows a record names it here, so
    /// `list`, `state`, `describe` and `/status.json` name a device alike.
    pub fn fill_names(&mut self, names: &UsbIds) {
        if let (Some(vendor), Some(product)) = (self.vendor_number(), self.product_number()) {
            self.vendor_name = names.vendor(vendor);
            self.product_name = names.product(vendor, product);
        }
        for interface in &mut self.interfaces {
            let class = interface.class.get(..2).and_then(|hex| u8::from_str_radix(hex, 16).ok());
            interface.class_name = class.map(|class| class_name(class).to_owned());
        }
    }

    /// The vendor id as a number, if it reads as hex.
    pub fn vendor_number(&self) -> Option<u16> {
        u16::from_str_radix(&self.vendor_id, 16).ok()
    }

    /// The product id as a number, if it reads as hex.
    pub fn product_number(&self) -> Option<u16> {
        u16::from_str_radix(&self.product_id, 16).ok()
    }
}

/// Four lowercase hex digits: `0781`.
pub fn hex16(value: u16) -> String {
    format!("{value:04x}")
}

/// A binary-coded decimal release number as USB writes it: `0x0100` → `1.00`.
pub fn bcd(value: u16) -> String {
    format!("{:x}.{:02x}", value >> 8, value & 0xff)
}

/// `cc/ss/pp` in hex.
pub fn class_triple(class: u8, subclass: u8, protocol: u8) -> String {
    format!("{class:02x}/{subclass:02x}/{protocol:02x}")
}

/// A device string as the record holds it: an empty one is not known.
pub fn known(text: &str) -> Option<String> {
    (!text.is_empty()).then(|| text.to_owned())
}

#[cfg(test)]
mod tests {
    use usbwire_proto::op::{BusId, InterfaceRecord};
    use usbwire_proto::Speed;

    use super::*;

    #[test]
    fn a_wire_record_gives_ids_release_class_and_interfaces_in_one_format() {
        let record = DeviceRecord {
            path: "/sys/devices/usb1/1-1".into(),
            busid: BusId::new("1-1").unwrap(),
            busnum: 1,
            devnum: 2,
            speed: Speed::SUPER,
            id_vendor: 0x0781,
            id_product: 0x5567,
            bcd_device: 0x0210,
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
        };
        let device = DeviceJson::from_wire(&record);
        let json = serde_json::to_value(&device).unwrap();
        assert_eq!(json["busid"], "1-1");
        assert_eq!(json["vendor_id"], "0781");
        assert_eq!(json["bcd_device"], "2.10");
        assert_eq!(json["device_class"], "00/00/00");
        assert_eq!(json["speed"], "super");
        assert_eq!(json["interfaces"][0]["class"], "08/06/50");
        // Every field is there, unknown ones as null: one shape.
        assert!(json["product"].is_null() && json["holder"].is_null() && json["state"].is_null(), "{json}");
        assert_eq!(device.vendor_number(), Some(0x0781));
    }

    #[test]
    fn a_record_with_fields_left_out_reads_with_defaults_and_round_trips() {
        let old = r#"{"busid":"1-1","vendor_id":"1209","product_id":"0001","speed":"high","state":"available"}"#;
        let device: DeviceJson = serde_json::from_str(old).unwrap();
        assert_eq!(device.state.as_deref(), Some("available"));
        assert_eq!(device.bcd_device, None);
        let again: DeviceJson = serde_json::from_str(&serde_json::to_string(&device).unwrap()).unwrap();
        assert_eq!(again, device);
    }

    #[test]
    fn names_come_from_usb_ids_and_the_class_table() {
        let mut device = DeviceJson {
            vendor_id: "1d6b".into(),
            product_id: "0002".into(),
            interfaces: vec![InterfaceJson { class: "09/00/00".into(), ..InterfaceJson::default() }],
            ..DeviceJson::default()
        };
        device.fill_names(&UsbIds::from_text("1d6b  Linux Foundation\n\t0002  2.0 root hub\n"));
        assert_eq!(device.vendor_name.as_deref(), Some("Linux Foundation"));
        assert_eq!(device.product_name.as_deref(), Some("2.0 root hub"));
        assert_eq!(device.interfaces[0].class_name.as_deref(), Some("Hub"));
        // No usb.ids on this machine: no names, but the class is still named.
        device.fill_names(&UsbIds::default());
        assert_eq!((device.vendor_name, device.product_name), (None, None));
        assert_eq!(device.interfaces[0].class_name.as_deref(), Some("Hub"));
    }

    #[test]
    fn release_numbers_read_as_usb_writes_them() {
        assert_eq!(bcd(0x0100), "1.00");
        assert_eq!(bcd(0x0210), "2.10");
        assert_eq!(bcd(0x1234), "12.34");
        assert_eq!(known(""), None);
        assert_eq!(known("x").as_deref(), Some("x"));
    }
}
