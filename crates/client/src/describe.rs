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
    for d in walk(&config).skip(1) {
        let item = match d[1] {
            descriptor::INTERFACE if d.len() >= 9 => Item::Interface {
                number: d[2],
                alt_setting: d[3],
                num_endpoints: d[4],
                class: class_triple(d[5], d[6], d[7]),
                name: string(conn, d[8], language).await,
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
        items.push(item);
    }
    let mut bos = Vec::new();
    if device.bcd_usb >= 0x0201 {
        if let Ok(header) = get_descriptor(conn, descriptor::BOS, 0, 0, 5).await {
            if header.len() >= 5 {
                let total = u16::from_le_bytes([header[2], header[3]]);
                if let Ok(all) = get_descriptor(conn, descriptor::BOS, 0, 0, total).await {
                    bos = walk(&all)
                        .skip(1)
                        .map(|d| Item::Other { descriptor_type: format!("{:#04x}", d[1]), bytes: hex(d) })
                        .collect();
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
}
