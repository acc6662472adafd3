//! Reading an imported device's descriptors over ep0: the data behind
//! `usbwire describe` (like `lsusb -v` for a remote device).
//!
//! Everything the device returns is untrusted: lengths are bounded by what
//! was received, and a malformed descriptor ends the walk instead of
//! panicking.

use bytes::Bytes;
use serde::Serialize;
use usbwire_device::control::SetupPacket;
use usbwire_device::descriptor::{self, DeviceDescriptor};
use usbwire_proto::Status;

use crate::{Connection, Transfer, TransferError};

/// Why a description could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DescribeError {
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// A request the device must answer failed.
    #[error("GET_DESCRIPTOR({what}) failed: {status}")]
    Request { what: &'static str, status: Status },
    /// The device returned something that is not the descriptor asked for.
    #[error("the device returned a malformed {0} descriptor")]
    Malformed(&'static str),
}

/// One descriptor inside a configuration, in the order the device sent it.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Item {
    InterfaceAssociation {
        first_interface: u8,
        interface_count: u8,
        class: String,
    },
    Interface {
        number: u8,
        alt_setting: u8,
        num_endpoints: u8,
        class: String,
        name: Option<String>,
    },
    Endpoint {
        address: String,
        direction: &'static str,
        transfer_type: &'static str,
        max_packet_size: u16,
        interval: u8,
    },
    SuperSpeedCompanion {
        max_burst: u8,
        attributes: u8,
        bytes_per_interval: u16,
    },
    /// HID class descriptor (in a HID interface).
    Hid {
        bcd_hid: String,
        country_code: u8,
        /// (descriptor type, length) of each class descriptor it announces; 0x22 is the report descriptor.
        descriptors: Vec<(String, u16)>,
    },
    /// CDC Header functional descriptor.
    CdcHeader {
        bcd_cdc: String,
    },
    /// CDC Call Management functional descriptor.
    CdcCallManagement {
        capabilities: String,
        data_interface: u8,
    },
    /// CDC Abstract Control Management functional descriptor.
    CdcAcm {
        capabilities: String,
    },
    /// CDC Union functional descriptor.
    CdcUnion {
        control_interface: u8,
        subordinate_interfaces: Vec<u8>,
    },
    /// BOS: USB 2.0 Extension (link power management).
    Usb2Extension {
        attributes: String,
        lpm: bool,
    },
    /// BOS: SuperSpeed USB device capability.
    SuperSpeedCapability {
        speeds_supported: Vec<&'static str>,
        lowest_full_function_speed: &'static str,
        u1_exit_latency_us: u8,
        u2_exit_latency_us: u16,
    },
    /// BOS: Container ID.
    ContainerId {
        uuid: String,
    },
    /// Class-specific or unknown descriptors, as hex.
    Other {
        descriptor_type: String,
        bytes: String,
    },
}

/// A device's descriptors, decoded.
#[derive(Clone, Debug, Serialize)]
pub struct Description {
    pub bcd_usb: String,
    pub device_class: String,
    pub max_packet_size0: u8,
    pub vendor_id: String,
    pub product_id: String,
    pub bcd_device: String,
    pub manufacturer: Option<String>,
    pub product: Option<String>,
    pub serial: Option<String>,
    pub num_configurations: u8,
    pub configuration_value: u8,
    pub configuration_attributes: String,
    pub max_power_ma: u32,
    pub items: Vec<Item>,
    /// BOS device capabilities (type code and hex), for USB 2.1+ devices.
    pub bos: Vec<Item>,
}

async fn get_descriptor(
    conn: &Connection,
    kind: u8,
    index: u8,
    language: u16,
    length: u16,
) -> Result<Bytes, DescribeError> {
    let setup = SetupPacket {
        request_type: 0x80,
        request: 0x06,
        value: (u16::from(kind) << 8) | u16::from(index),
        index: language,
        length,
    };
    let ret = conn.transfer(Transfer::control_in(setup.to_bytes())).await?;
    if ret.status != Status::OK {
        let what = match kind {
            descriptor::DEVICE => "device",
            descriptor::CONFIGURATION => "configuration",
            descriptor::STRING => "string",
            descriptor::BOS => "bos",
            _ => "other",
        };
        return Err(DescribeError::Request { what, status: ret.status });
    }
    Ok(ret.data)
}

async fn string(conn: &Connection, index: u8, language: u16) -> Option<String> {
    if index == 0 {
        return None;
    }
    let bytes = get_descriptor(conn, descriptor::STRING, index, language, 255).await.ok()?;
    descriptor::parse_string(&bytes)
}

/// Reads the device, configuration 1, strings and (for USB 2.1+) BOS descriptors.
pub async fn describe(conn: &Connection) -> Result<Description, DescribeError> {
    let raw = get_descriptor(conn, descriptor::DEVICE, 0, 0, 18).await?;
    let device = DeviceDescriptor::parse(&raw).ok_or(DescribeError::Malformed("device"))?;
    let header = get_descriptor(conn, descriptor::CONFIGURATION, 0, 0, 9).await?;
    if header.len() < 9 || header[1] != descriptor::CONFIGURATION {
        return Err(DescribeError::Malformed("configuration"));
    }
    let total = u16::from_le_bytes([header[2], header[3]]);
    let config = get_descriptor(conn, descriptor::CONFIGURATION, 0, 0, total).await?;
    let languages = get_descriptor(conn, descriptor::STRING, 0, 0, 255).await.ok();
    let language = languages.filter(|l| l.len() >= 4).map_or(0x0409, |l| u16::from_le_bytes([l[2], l[3]]));
    let mut items = Vec::new();
    for (mut item, name_index) in decode_configuration(&config) {
        if let (Item::Interface { name, .. }, Some(index)) = (&mut item, name_index) {
            *name = string(conn, index, language).await;
        }
        items.push(item);
    }
    let mut bos = Vec::new();
    if device.bcd_usb >= 0x0201 {
        if let Ok(header) = get_descriptor(conn, descriptor::BOS, 0, 0, 5).await {
            if header.len() >= 5 {
                let total = u16::from_le_bytes([header[2], header[3]]);
                if let Ok(all) = get_descriptor(conn, descriptor::BOS, 0, 0, total).await {
                    bos = decode_bos(&all);
                }
            }
        }
    }
    Ok(Description {
        bcd_usb: bcd(device.bcd_usb),
        device_class: class_triple(device.class, device.subclass, device.protocol),
        max_packet_size0: device.max_packet_size0,
        vendor_id: format!("{:04x}", device.vendor_id),
        product_id: format!("{:04x}", device.product_id),
        bcd_device: bcd(device.bcd_device),
        manufacturer: string(conn, device.manufacturer_index, language).await,
        product: string(conn, device.product_index, language).await,
        serial: string(conn, device.serial_index, language).await,
        num_configurations: device.num_configurations,
        configuration_value: config[5],
        configuration_attributes: format!("{:#04x}", config[7]),
        max_power_ma: u32::from(config[8]) * if device.bcd_usb >= 0x0300 { 8 } else { 2 },
        items,
        bos,
    })
}

/// The descriptors after a configuration header, decoded; each interface
/// comes with its iInterface index (its name is read by the caller).
/// Class-specific descriptors are decoded by the class of the interface they
/// follow (0x21 is HID in a HID interface but DFU's in a DFU one).
fn decode_configuration(config: &[u8]) -> Vec<(Item, Option<u8>)> {
    let mut items = Vec::new();
    let mut class = 0u8;
    for d in walk(config).skip(1) {
        let mut name_index = None;
        let item = match d[1] {
            descriptor::INTERFACE if d.len() >= 9 => {
                class = d[5];
                name_index = Some(d[8]).filter(|&i| i != 0);
                Item::Interface {
                    number: d[2],
                    alt_setting: d[3],
                    num_endpoints: d[4],
                    class: class_triple(d[5], d[6], d[7]),
                    name: None,
                }
            }
            descriptor::HID if class == 0x03 && d.len() >= 6 => Item::Hid {
                bcd_hid: bcd(u16::from_le_bytes([d[2], d[3]])),
                country_code: d[4],
                descriptors: d[6..]
                    .chunks_exact(3)
                    .take(usize::from(d[5]))
                    .map(|c| (format!("{:#04x}", c[0]), u16::from_le_bytes([c[1], c[2]])))
                    .collect(),
            },
            descriptor::CS_INTERFACE if class == 0x02 && d.len() >= 3 => match (d[2], d.len()) {
                (0x00, 5..) => Item::CdcHeader { bcd_cdc: bcd(u16::from_le_bytes([d[3], d[4]])) },
                (0x01, 5..) => Item::CdcCallManagement { capabilities: format!("{:#04x}", d[3]), data_interface: d[4] },
                (0x02, 4..) => Item::CdcAcm { capabilities: format!("{:#04x}", d[3]) },
                (0x06, 5..) => Item::CdcUnion { control_interface: d[3], subordinate_interfaces: d[4..].to_vec() },
                _ => Item::Other { descriptor_type: format!("{:#04x}", d[1]), bytes: hex(d) },
            },
            descriptor::INTERFACE_ASSOCIATION if d.len() >= 8 => Item::InterfaceAssociation {
                first_interface: d[2],
                interface_count: d[3],
                class: class_triple(d[4], d[5], d[6]),
            },
            descriptor::ENDPOINT if d.len() >= 7 => Item::Endpoint {
                address: format!("{:#04x}", d[2]),
                direction: if d[2] & 0x80 != 0 { "in" } else { "out" },
                transfer_type: ["control", "isochronous", "bulk", "interrupt"][usize::from(d[3] & 3)],
                max_packet_size: u16::from_le_bytes([d[4], d[5]]),
                interval: d[6],
            },
            descriptor::SS_ENDPOINT_COMPANION if d.len() >= 6 => Item::SuperSpeedCompanion {
                max_burst: d[2],
                attributes: d[3],
                bytes_per_interval: u16::from_le_bytes([d[4], d[5]]),
            },
            other => Item::Other { descriptor_type: format!("{other:#04x}"), bytes: hex(d) },
        };
        items.push((item, name_index));
    }
    items
}

/// The device capabilities in a BOS descriptor, decoded where known.
fn decode_bos(bos: &[u8]) -> Vec<Item> {
    walk(bos)
        .skip(1)
        .map(|d| match (d[1], d.get(2), d.len()) {
            (descriptor::DEVICE_CAPABILITY, Some(0x02), 7..) => {
                let attributes = u32::from_le_bytes([d[3], d[4], d[5], d[6]]);
                Item::Usb2Extension { attributes: format!("{attributes:#010x}"), lpm: attributes & 0x02 != 0 }
            }
            (descriptor::DEVICE_CAPABILITY, Some(0x03), 10..) => {
                let speeds = u16::from_le_bytes([d[4], d[5]]);
                let names = ["low", "full", "high", "super"];
                Item::SuperSpeedCapability {
                    speeds_supported: (0..4).filter(|bit| speeds & (1 << bit) != 0).map(|bit| names[bit]).collect(),
                    lowest_full_function_speed: names.get(usize::from(d[6])).copied().unwrap_or("reserved"),
                    u1_exit_latency_us: d[7],
                    u2_exit_latency_us: u16::from_le_bytes([d[8], d[9]]),
                }
            }
            (descriptor::DEVICE_CAPABILITY, Some(0x04), 20..) => {
                let u = &d[4..20];
                // Stored little-endian in its first three fields, as Windows GUIDs are.
                let uuid = format!(
                    "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{}",
                    u[3],
                    u[2],
                    u[1],
                    u[0],
                    u[5],
                    u[4],
                    u[7],
                    u[6],
                    u[8],
                    u[9],
                    u[10..].iter().map(|b| format!("{b:02x}")).collect::<String>()
                );
                Item::ContainerId { uuid }
            }
            _ => Item::Other { descriptor_type: format!("{:#04x}", d[1]), bytes: hex(d) },
        })
        .collect()
}

/// The descriptors in a buffer, each bounded by its length byte and the buffer.
fn walk(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let len = usize::from(*bytes.get(at)?);
        if len < 2 || at + len > bytes.len() {
            return None;
        }
        let d = &bytes[at..at + len];
        at += len;
        Some(d)
    })
}

fn class_triple(class: u8, subclass: u8, protocol: u8) -> String {
    format!("{class:02x}/{subclass:02x}/{protocol:02x}")
}

fn bcd(value: u16) -> String {
    format!("{:x}.{:02x}", value >> 8, value & 0xff)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_stops_at_malformed_lengths() {
        let bytes = [9, 2, 0, 0, 0, 0, 0, 0, 0, 3, 0x24, 1, 0, 5];
        let found: Vec<_> = walk(&bytes).collect();
        assert_eq!(found.len(), 2);
        assert_eq!(walk(&[1, 2, 3]).count(), 0);
        assert_eq!(walk(&[200, 2]).count(), 0);
        assert_eq!(bcd(0x0320), "3.20");
    }

    #[test]
    fn hid_cdc_and_iad_descriptors_are_decoded_by_their_interfaces_class() {
        #[rustfmt::skip]
        let config: &[u8] = &[
            9, 2, 0, 0, 3, 1, 0, 0x80, 50,
            9, 4, 0, 0, 1, 3, 1, 1, 4,                // HID keyboard, iInterface 4
            9, 0x21, 0x11, 0x01, 0, 1, 0x22, 63, 0,   // HID 1.11, report descriptor 63 bytes
            7, 5, 0x81, 3, 8, 0, 10,
            8, 0x0b, 1, 2, 2, 2, 1, 0,                // IAD: interfaces 1..2, CDC ACM
            9, 4, 1, 0, 1, 2, 2, 1, 0,                // CDC control
            5, 0x24, 0x00, 0x10, 0x01,                // header, CDC 1.10
            5, 0x24, 0x01, 0x00, 2,                   // call management, data interface 2
            4, 0x24, 0x02, 0x02,                      // ACM
            5, 0x24, 0x06, 1, 2,                      // union: control 1, subordinate 2
            9, 4, 3, 0, 0, 0xfe, 1, 1, 0,             // DFU
            9, 0x21, 0x0b, 0xff, 0, 0, 4, 0x10, 0x01, // DFU functional: not HID
        ];
        let items: Vec<Item> = decode_configuration(config).into_iter().map(|(item, _)| item).collect();
        let json = serde_json::to_value(&items).unwrap();
        assert_eq!(
            json[1],
            serde_json::json!({"type": "hid", "bcd_hid": "1.11", "country_code": 0, "descriptors": [["0x22", 63]]})
        );
        assert_eq!(json[3]["type"], "interface_association");
        assert_eq!(json[5], serde_json::json!({"type": "cdc_header", "bcd_cdc": "1.10"}));
        assert_eq!(
            json[6],
            serde_json::json!({"type": "cdc_call_management", "capabilities": "0x00", "data_interface": 2})
        );
        assert_eq!(json[7], serde_json::json!({"type": "cdc_acm", "capabilities": "0x02"}));
        assert_eq!(
            json[8],
            serde_json::json!({"type": "cdc_union", "control_interface": 1, "subordinate_interfaces": [2]})
        );
        assert_eq!(json[10]["type"], "other", "0x21 after a DFU interface is not HID");
        assert_eq!(decode_configuration(config)[0].1, Some(4), "the interface's name index");
    }

    #[test]
    fn bos_capabilities_are_decoded() {
        #[rustfmt::skip]
        let bos: &[u8] = &[
            5, 0x0f, 42, 0, 3,
            7, 0x10, 0x02, 0x02, 0, 0, 0,                   // USB 2.0 extension, LPM
            10, 0x10, 0x03, 0, 0x0e, 0, 1, 10, 0xff, 0x07,  // SuperSpeed: full, high, super; U1 10, U2 2047
            20, 0x10, 0x04, 0, 0x78, 0x56, 0x34, 0x12, 0x34, 0x12, 0x78, 0x56, 1, 2, 3, 4, 5, 6, 7, 8,
        ];
        let json = serde_json::to_value(decode_bos(bos)).unwrap();
        assert_eq!(json[0], serde_json::json!({"type": "usb2_extension", "attributes": "0x00000002", "lpm": true}));
        assert_eq!(json[1]["speeds_supported"], serde_json::json!(["full", "high", "super"]));
        assert_eq!(json[1]["u2_exit_latency_us"], 2047);
        assert_eq!(json[2]["uuid"], "12345678-1234-5678-0102-030405060708");
    }
}
