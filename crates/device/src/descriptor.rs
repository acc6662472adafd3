//! Building and walking USB descriptors.
//!
//! Builders emit the exact bytes a device returns to GET_DESCRIPTOR; the
//! walker parses a configuration descriptor into interfaces and endpoints
//! (used for endpoint validation, for listing and, on the client, for
//! `describe`). Parsing never trusts a length byte: a truncated or
//! zero-length descriptor ends the walk.

use usbwire_proto::Speed;

use crate::TransferType;

pub const DEVICE: u8 = 0x01;
pub const CONFIGURATION: u8 = 0x02;
pub const STRING: u8 = 0x03;
pub const INTERFACE: u8 = 0x04;
pub const ENDPOINT: u8 = 0x05;
pub const DEVICE_QUALIFIER: u8 = 0x06;
pub const OTHER_SPEED_CONFIGURATION: u8 = 0x07;
pub const INTERFACE_ASSOCIATION: u8 = 0x0b;
pub const BOS: u8 = 0x0f;
pub const DEVICE_CAPABILITY: u8 = 0x10;
pub const HID: u8 = 0x21;
pub const HID_REPORT: u8 = 0x22;
pub const CS_INTERFACE: u8 = 0x24;
pub const SS_ENDPOINT_COMPANION: u8 = 0x30;

/// The 18-byte device descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceDescriptor {
    pub bcd_usb: u16,
    pub class: u8,
    pub subclass: u8,
    pub protocol: u8,
    /// bMaxPacketSize0 as sent: 64 for high speed, 9 (2^9 = 512) for SuperSpeed.
    pub max_packet_size0: u8,
    pub vendor_id: u16,
    pub product_id: u16,
    pub bcd_device: u16,
    pub manufacturer_index: u8,
    pub product_index: u8,
    pub serial_index: u8,
    pub num_configurations: u8,
}

impl DeviceDescriptor {
    /// A descriptor with the USB version and ep0 packet size right for `speed`.
    pub fn for_speed(speed: Speed, vendor_id: u16, product_id: u16) -> Self {
        let (bcd_usb, max_packet_size0) = match speed {
            s if s.is_superspeed() => (0x0320, 9),
            Speed::HIGH => (0x0200, 64),
            _ => (0x0200, 64),
        };
        Self {
            bcd_usb,
            class: 0,
            subclass: 0,
            protocol: 0,
            max_packet_size0,
            vendor_id,
            product_id,
            bcd_device: 0x0100,
            manufacturer_index: 1,
            product_index: 2,
            serial_index: 3,
            num_configurations: 1,
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![18, DEVICE];
        b.extend_from_slice(&self.bcd_usb.to_le_bytes());
        b.extend_from_slice(&[self.class, self.subclass, self.protocol, self.max_packet_size0]);
        b.extend_from_slice(&self.vendor_id.to_le_bytes());
        b.extend_from_slice(&self.product_id.to_le_bytes());
        b.extend_from_slice(&self.bcd_device.to_le_bytes());
        b.extend_from_slice(&[self.manufacturer_index, self.product_index, self.serial_index, self.num_configurations]);
        b
    }

    pub fn parse(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < 18 || bytes[1] != DEVICE {
            return None;
        }
        let le = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        Some(Self {
            bcd_usb: le(2),
            class: bytes[4],
            subclass: bytes[5],
            protocol: bytes[6],
            max_packet_size0: bytes[7],
            vendor_id: le(8),
            product_id: le(10),
            bcd_device: le(12),
            manufacturer_index: bytes[14],
            product_index: bytes[15],
            serial_index: bytes[16],
            num_configurations: bytes[17],
        })
    }
}

/// An endpoint to put in a configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointSpec {
    /// Address with direction bit, e.g. `0x81`.
    pub address: u8,
    pub transfer_type: TransferType,
    pub max_packet_size: u16,
    pub interval: u8,
}

impl EndpointSpec {
    /// A bulk endpoint with the largest packet size `speed` allows.
    pub fn bulk(address: u8, speed: Speed) -> Self {
        let max_packet_size = if speed.is_superspeed() {
            1024
        } else if speed == Speed::HIGH {
            512
        } else {
            64
        };
        Self { address, transfer_type: TransferType::Bulk, max_packet_size, interval: 0 }
    }

    /// An interrupt endpoint polled every `millis` milliseconds at `speed`.
    pub fn interrupt(address: u8, max_packet_size: u16, millis: u8, speed: Speed) -> Self {
        // High speed and SuperSpeed count in 125 µs microframes, 2^(bInterval-1).
        let interval = if speed == Speed::HIGH || speed.is_superspeed() {
            let microframes = u32::from(millis.max(1)) * 8;
            (microframes.ilog2() + 1).min(16) as u8
        } else {
            millis.max(1)
        };
        Self { address, transfer_type: TransferType::Interrupt, max_packet_size, interval }
    }
}

/// Builds a configuration descriptor with its interfaces, class descriptors,
/// endpoints and (at SuperSpeed) endpoint companions; wTotalLength and
/// bNumInterfaces are filled in by [`build`](Self::build).
#[derive(Clone, Debug)]
pub struct ConfigurationBuilder {
    speed: Speed,
    bytes: Vec<u8>,
    interfaces: u8,
}

impl ConfigurationBuilder {
    /// Configuration 1, bus powered, `max_power_ma` milliamps.
    pub fn new(speed: Speed, max_power_ma: u16) -> Self {
        // bMaxPower is in 2 mA units (8 mA at SuperSpeed).
        let unit = if speed.is_superspeed() { 8 } else { 2 };
        let max_power = (max_power_ma / unit).min(255) as u8;
        Self { speed, bytes: vec![9, CONFIGURATION, 0, 0, 0, 1, 0, 0x80, max_power], interfaces: 0 }
    }

    /// Adds an interface association descriptor (for multi-interface functions such as CDC).
    pub fn association(mut self, first_interface: u8, count: u8, class: u8, subclass: u8, protocol: u8) -> Self {
        self.bytes.extend_from_slice(&[8, INTERFACE_ASSOCIATION, first_interface, count, class, subclass, protocol, 0]);
        self
    }

    /// Starts interface `number` (alt setting 0) with `endpoints` endpoints to follow.
    pub fn interface(
        mut self,
        number: u8,
        endpoints: u8,
        class: u8,
        subclass: u8,
        protocol: u8,
        string_index: u8,
    ) -> Self {
        self.bytes.extend_from_slice(&[9, INTERFACE, number, 0, endpoints, class, subclass, protocol, string_index]);
        self.interfaces = self.interfaces.max(number + 1);
        self
    }

    /// Adds alternate setting `alt_setting` (not 0: that is [`interface`](Self::interface))
    /// of interface `number`, with `endpoints` endpoints to follow. Alternate
    /// settings do not count in bNumInterfaces.
    #[allow(clippy::too_many_arguments)] // the descriptor's own fields, in their order
    pub fn alternate(
        mut self,
        number: u8,
        alt_setting: u8,
        endpoints: u8,
        class: u8,
        subclass: u8,
        protocol: u8,
        string_index: u8,
    ) -> Self {
        self.bytes.extend_from_slice(&[
            9,
            INTERFACE,
            number,
            alt_setting,
            endpoints,
            class,
            subclass,
            protocol,
            string_index,
        ]);
        self
    }

    /// Appends a class-specific descriptor verbatim (HID, CDC functional, …).
    pub fn raw(mut self, descriptor: &[u8]) -> Self {
        self.bytes.extend_from_slice(descriptor);
        self
    }

    /// Appends an endpoint, and its SuperSpeed companion when the speed calls for one.
    pub fn endpoint(mut self, endpoint: EndpointSpec) -> Self {
        let attributes = match endpoint.transfer_type {
            TransferType::Control => 0,
            TransferType::Isochronous => 1,
            TransferType::Bulk => 2,
            TransferType::Interrupt => 3,
        };
        let [lo, hi] = endpoint.max_packet_size.to_le_bytes();
        self.bytes.extend_from_slice(&[7, ENDPOINT, endpoint.address, attributes, lo, hi, endpoint.interval]);
        if self.speed.is_superspeed() {
            let per_interval = match endpoint.transfer_type {
                TransferType::Interrupt | TransferType::Isochronous => endpoint.max_packet_size,
                _ => 0,
            };
            let [plo, phi] = per_interval.to_le_bytes();
            // bMaxBurst 0: one packet per burst keeps every host controller happy.
            self.bytes.extend_from_slice(&[6, SS_ENDPOINT_COMPANION, 0, 0, plo, phi]);
        }
        self
    }

    pub fn build(mut self) -> Vec<u8> {
        let total = (self.bytes.len() as u16).to_le_bytes();
        self.bytes[2] = total[0];
        self.bytes[3] = total[1];
        self.bytes[4] = self.interfaces;
        self.bytes
    }
}

/// The BOS descriptor a SuperSpeed device must offer: a USB 2.0 extension and
/// a SuperSpeed device capability (no LPM, no U1/U2 latency promises).
pub fn superspeed_bos() -> Vec<u8> {
    let mut b = vec![5, BOS, 0, 0, 2];
    b.extend_from_slice(&[7, DEVICE_CAPABILITY, 0x02, 0, 0, 0, 0]);
    // wSpeedsSupported = full | high | super; bFunctionalitySupport = full speed;
    // bU1DevExitLat 10 µs, wU2DevExitLat 2047 µs.
    b.extend_from_slice(&[10, DEVICE_CAPABILITY, 0x03, 0, 0x0e, 0x00, 1, 0x0a, 0xff, 0x07]);
    let total = (b.len() as u16).to_le_bytes();
    b[2] = total[0];
    b[3] = total[1];
    b
}

/// The device qualifier a high-speed device returns (what it would be at full speed).
pub fn device_qualifier(device: &DeviceDescriptor) -> Vec<u8> {
    let [lo, hi] = device.bcd_usb.to_le_bytes();
    vec![10, DEVICE_QUALIFIER, lo, hi, device.class, device.subclass, device.protocol, 64, device.num_configurations, 0]
}

/// String descriptor `index` from a table (index 0 is the language list: US English).
pub fn string_descriptor(strings: &[String], index: u8) -> Option<Vec<u8>> {
    if index == 0 {
        return Some(vec![4, STRING, 0x09, 0x04]);
    }
    let text = strings.get(usize::from(index) - 1)?;
    let units: Vec<u16> = text.encode_utf16().take(126).collect();
    let mut b = Vec::with_capacity(2 + units.len() * 2);
    b.push((2 + units.len() * 2) as u8);
    b.push(STRING);
    for unit in units {
        b.extend_from_slice(&unit.to_le_bytes());
    }
    Some(b)
}

/// Decodes a string descriptor's UTF-16LE text.
pub fn parse_string(bytes: &[u8]) -> Option<String> {
    let len = usize::from(*bytes.first()?).min(bytes.len());
    if len < 2 || bytes[1] != STRING {
        return None;
    }
    let units: Vec<u16> = bytes[2..len].chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    Some(String::from_utf16_lossy(&units))
}

/// An interface (one alt setting) found in a configuration descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceInfo {
    pub number: u8,
    pub alt_setting: u8,
    pub class: u8,
    pub subclass: u8,
    pub protocol: u8,
    pub string_index: u8,
    pub endpoints: Vec<EndpointInfo>,
}

impl InterfaceInfo {
    /// Whether this is mass storage over Bulk-Only Transport with SCSI (08/06/50).
    pub fn is_bulk_only_storage(&self) -> bool {
        (self.class, self.subclass, self.protocol) == (0x08, 0x06, 0x50)
    }

    /// The address of the first bulk endpoint of this direction (IN when `inward`).
    pub fn bulk_endpoint(&self, inward: bool) -> Option<u8> {
        self.endpoints
            .iter()
            .find(|e| e.transfer_type == TransferType::Bulk && (e.address & 0x80 != 0) == inward)
            .map(|e| e.address)
    }
}

/// An endpoint found in a configuration descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    pub address: u8,
    pub transfer_type: TransferType,
    /// wMaxPacketSize as sent (bits 11-12 carry the high-bandwidth multiplier).
    pub max_packet_size: u16,
    pub interval: u8,
}

/// The parts of a configuration descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigurationInfo {
    pub value: u8,
    pub attributes: u8,
    pub max_power: u8,
    pub interfaces: Vec<InterfaceInfo>,
}

impl ConfigurationInfo {
    /// Walks a whole configuration descriptor (as returned with wLength = wTotalLength).
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < 9 || bytes[1] != CONFIGURATION {
            return None;
        }
        let mut info = Self { value: bytes[5], attributes: bytes[7], max_power: bytes[8], interfaces: Vec::new() };
        let total = usize::from(u16::from_le_bytes([bytes[2], bytes[3]])).min(bytes.len());
        let mut at = usize::from(bytes[0]);
        while at + 2 <= total {
            let len = usize::from(bytes[at]);
            if len < 2 || at + len > total {
                break;
            }
            let d = &bytes[at..at + len];
            match d[1] {
                INTERFACE if len >= 9 => info.interfaces.push(InterfaceInfo {
                    number: d[2],
                    alt_setting: d[3],
                    class: d[5],
                    subclass: d[6],
                    protocol: d[7],
                    string_index: d[8],
                    endpoints: Vec::new(),
                }),
                ENDPOINT if len >= 7 => {
                    if let Some(interface) = info.interfaces.last_mut() {
                        interface.endpoints.push(EndpointInfo {
                            address: d[2],
                            transfer_type: TransferType::from_attributes(d[3]),
                            max_packet_size: u16::from_le_bytes([d[4], d[5]]),
                            interval: d[6],
                        });
                    }
                }
                _ => {}
            }
            at += len;
        }
        Some(info)
    }

    /// Endpoints of the given alt settings (`alt_of(interface) -> alt`).
    pub fn active_endpoints(&self, alt_of: impl Fn(u8) -> u8) -> impl Iterator<Item = &EndpointInfo> {
        self.interfaces.iter().filter(move |i| i.alt_setting == alt_of(i.number)).flat_map(|i| i.endpoints.iter())
    }

    /// (class, subclass, protocol) of each interface's first alt setting.
    pub fn interface_classes(&self) -> Vec<(u8, u8, u8)> {
        self.interfaces.iter().filter(|i| i.alt_setting == 0).map(|i| (i.class, i.subclass, i.protocol)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_round_trips_through_the_walker() {
        let config = ConfigurationBuilder::new(Speed::SUPER, 100)
            .interface(0, 2, 8, 6, 0x50, 0)
            .endpoint(EndpointSpec::bulk(0x81, Speed::SUPER))
            .endpoint(EndpointSpec::bulk(0x02, Speed::SUPER))
            .build();
        assert_eq!(config.len(), 9 + 9 + 2 * (7 + 6));
        assert_eq!(u16::from_le_bytes([config[2], config[3]]) as usize, config.len());
        let info = ConfigurationInfo::parse(&config).unwrap();
        assert_eq!(info.interfaces.len(), 1);
        let eps: Vec<_> = info.active_endpoints(|_| 0).map(|e| (e.address, e.max_packet_size)).collect();
        assert_eq!(eps, vec![(0x81, 1024), (0x02, 1024)]);
    }

    #[test]
    fn alternate_settings_do_not_count_as_interfaces() {
        let config = ConfigurationBuilder::new(Speed::HIGH, 100)
            .interface(0, 0, 0xfe, 1, 2, 4)
            .alternate(0, 1, 0, 0xfe, 1, 2, 5)
            .build();
        assert_eq!(config[4], 1, "bNumInterfaces");
        let info = ConfigurationInfo::parse(&config).unwrap();
        let alts: Vec<_> = info.interfaces.iter().map(|i| (i.number, i.alt_setting, i.string_index)).collect();
        assert_eq!(alts, vec![(0, 0, 4), (0, 1, 5)]);
        assert_eq!(info.interface_classes(), vec![(0xfe, 1, 2)]);
    }

    #[test]
    fn walker_stops_at_bad_lengths() {
        let mut config = ConfigurationBuilder::new(Speed::HIGH, 100).interface(0, 1, 3, 1, 1, 0).build();
        config.extend_from_slice(&[0, 0, 0]);
        let total = (config.len() as u16).to_le_bytes();
        config[2] = total[0];
        config[3] = total[1];
        assert_eq!(ConfigurationInfo::parse(&config).unwrap().interfaces.len(), 1);
        assert!(ConfigurationInfo::parse(&[9, 2]).is_none());
    }

    #[test]
    fn strings_encode_as_utf16() {
        let strings = vec!["usbwire".to_string()];
        let d = string_descriptor(&strings, 1).unwrap();
        assert_eq!(d[0] as usize, d.len());
        assert_eq!(parse_string(&d).unwrap(), "usbwire");
        assert_eq!(string_descriptor(&strings, 2), None);
        assert_eq!(string_descriptor(&strings, 0).unwrap(), vec![4, 3, 9, 4]);
    }

    #[test]
    fn high_speed_interrupt_interval_is_in_microframe_exponents() {
        assert_eq!(EndpointSpec::interrupt(0x81, 8, 10, Speed::HIGH).interval, 7); // 2^6 * 125us = 8 ms
        assert_eq!(EndpointSpec::interrupt(0x81, 8, 10, Speed::FULL).interval, 10);
        assert_eq!(superspeed_bos().len(), 22);
    }
}
