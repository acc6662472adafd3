//! Which local devices to export: a bus id (`1-1.2`), a VID:PID (`0781:5567`),
//! `serial=…` or `class=…` (hex, matched against the device class and every
//! interface class). Parsed once from a flag or a config rule.

use std::fmt;
use std::str::FromStr;

use crate::LocalDevice;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    BusId(String),
    VidPid { vendor_id: u16, product_id: u16 },
    Serial(String),
    Class(u8),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "{0:?} is not a device selector: use a bus id (1-1.2), VID:PID in hex (0781:5567), serial=TEXT or class=HEX (class=08)"
)]
pub struct SelectorError(String);

impl Selector {
    pub fn matches(&self, device: &LocalDevice) -> bool {
        match self {
            Self::BusId(busid) => &device.busid == busid,
            Self::VidPid { vendor_id, product_id } => {
                device.vendor_id == *vendor_id && device.product_id == *product_id
            }
            Self::Serial(serial) => device.serial.as_deref() == Some(serial.as_str()),
            Self::Class(class) => device.classes().any(|c| c == *class),
        }
    }

    /// Whether a device as USB/IP lists it matches (`serial`: its serial
    /// number, when known; a serial selector matches nothing without one).
    pub fn matches_record(&self, device: &usbwire_proto::op::DeviceRecord, serial: Option<&str>) -> bool {
        match self {
            Self::BusId(busid) => device.busid.as_str() == busid,
            Self::VidPid { vendor_id, product_id } => {
                device.id_vendor == *vendor_id && device.id_product == *product_id
            }
            Self::Serial(wanted) => serial == Some(wanted.as_str()),
            Self::Class(class) => {
                device.b_device_class == *class || device.interfaces.iter().any(|i| i.b_interface_class == *class)
            }
        }
    }
}

impl FromStr for Selector {
    type Err = SelectorError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = || SelectorError(text.to_owned());
        if let Some(serial) = text.strip_prefix("serial=") {
            return if serial.is_empty() { Err(error()) } else { Ok(Self::Serial(serial.to_owned())) };
        }
        if let Some(class) = text.strip_prefix("class=") {
            return u8::from_str_radix(class.trim_start_matches("0x"), 16).map(Self::Class).map_err(|_| error());
        }
        if let Some((vendor, product)) = text.split_once(':') {
            let parse = |hex: &str| (hex.len() == 4).then(|| u16::from_str_radix(hex, 16).ok()).flatten();
            return match (parse(vendor), parse(product)) {
                (Some(vendor_id), Some(product_id)) => Ok(Self::VidPid { vendor_id, product_id }),
                _ => Err(error()),
            };
        }
        // BUS-PORT[.PORT...], all numbers.
        let valid_busid = text.split_once('-').is_some_and(|(bus, ports)| {
            bus.parse::<u8>().is_ok() && !ports.is_empty() && ports.split('.').all(|p| p.parse::<u8>().is_ok())
        });
        if valid_busid {
            Ok(Self::BusId(text.to_owned()))
        } else {
            Err(error())
        }
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BusId(busid) => f.write_str(busid),
            Self::VidPid { vendor_id, product_id } => write!(f, "{vendor_id:04x}:{product_id:04x}"),
            Self::Serial(serial) => write!(f, "serial={serial}"),
            Self::Class(class) => write!(f, "class={class:02x}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalInterface;
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
            class: 0,
            interfaces: vec![LocalInterface { number: 0, class: 8, subclass: 6, protocol: 0x50, driver: None }],
            sysfs_path: Default::default(),
        }
    }

    #[test]
    fn parses_every_form_and_round_trips() {
        for text in ["1-1", "3-2.4.1", "46f4:0001", "serial=ABC 1", "class=08"] {
            assert_eq!(text.parse::<Selector>().unwrap().to_string(), text);
        }
        assert_eq!("class=0x3".parse(), Ok(Selector::Class(3)));
        for bad in ["", "1", "1-", "x-1", "1-1..2", "46f4:1", "zzzz:0001", "serial=", "class=", "class=100"] {
            assert!(bad.parse::<Selector>().is_err(), "{bad:?} accepted");
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
        assert!("1-2".parse::<Selector>().unwrap().matches(&b));
    }
}
