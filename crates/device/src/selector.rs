//! Device selectors and the facts they are matched against: a bus id
//! (`1-1.2`), a VID:PID (`0781:5567`), `serial=…` or `class=…` (hex, the
//! device class or any interface class). One parser and one `matches` for
//! every place that picks devices: the server's `[[bind]]` rules and labels,
//! the lab's `--device` terms and the client's attach rules.
//!
//! Each source of devices (a local USB device, a USB/IP device record, a lab
//! registry entry) says what it knows as [`DeviceFacts`]; this module is not
//! for finding devices or reading sysfs, only for deciding whether one fits.

use std::fmt;
use std::str::FromStr;

use usbwire_proto::op::DeviceRecord;

/// Which devices to pick: parsed once from a flag or a config rule, shown
/// back in the same form it was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    BusId(String),
    VidPid { vendor_id: u16, product_id: u16 },
    Serial(String),
    Class(u8),
}

/// A text that is not a selector; says every form that is.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "{0:?} is not a device selector: use a bus id (1-1.2), VID:PID in hex (0781:5567), serial=TEXT or class=HEX (class=08)"
)]
pub struct SelectorError(String);

/// What a selector can ask about one device. A fact the source does not know
/// is `None` (or absent from `classes`) and matches no selector that asks
/// for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceFacts<'a> {
    pub busid: &'a str,
    pub vendor_id: Option<u16>,
    pub product_id: Option<u16>,
    pub serial: Option<&'a str>,
    /// The classes a `class=` selector matches: the device class and every
    /// interface class, as far as the source counts them.
    pub classes: ClassSet,
}

/// Anything that can say its [`DeviceFacts`]; lets [`Selector::matches`]
/// take a source's own type (a local USB device) as well as the facts.
pub trait AsDeviceFacts {
    fn device_facts(&self) -> DeviceFacts<'_>;
}

impl AsDeviceFacts for DeviceFacts<'_> {
    fn device_facts(&self) -> DeviceFacts<'_> {
        *self
    }
}

impl<T: AsDeviceFacts + ?Sized> AsDeviceFacts for &T {
    fn device_facts(&self) -> DeviceFacts<'_> {
        (**self).device_facts()
    }
}

/// A set of USB class codes (0x00..=0xff), one bit each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassSet([u64; 4]);

impl ClassSet {
    pub fn insert(&mut self, class: u8) {
        self.0[usize::from(class / 64)] |= 1 << (class % 64);
    }

    pub fn contains(&self, class: u8) -> bool {
        self.0[usize::from(class / 64)] & (1 << (class % 64)) != 0
    }
}

impl FromIterator<u8> for ClassSet {
    fn from_iter<I: IntoIterator<Item = u8>>(classes: I) -> Self {
        let mut set = Self::default();
        for class in classes {
            set.insert(class);
        }
        set
    }
}

impl<'a> DeviceFacts<'a> {
    /// The facts of a device as USB/IP lists it. `serial` is its serial
    /// number where known (USB/IP does not carry one); the device class
    /// counts even when it is 0, as it always has for listed devices.
    pub fn of_record(record: &'a DeviceRecord, serial: Option<&'a str>) -> Self {
        Self {
            busid: record.busid.as_str(),
            vendor_id: Some(record.id_vendor),
            product_id: Some(record.id_product),
            serial,
            classes: std::iter::once(record.b_device_class)
                .chain(record.interfaces.iter().map(|i| i.b_interface_class))
                .collect(),
        }
    }
}

impl Selector {
    /// Whether the device fits this selector.
    pub fn matches(&self, device: &(impl AsDeviceFacts + ?Sized)) -> bool {
        let facts = device.device_facts();
        match self {
            Self::BusId(busid) => facts.busid == busid,
            Self::VidPid { vendor_id, product_id } => {
                facts.vendor_id == Some(*vendor_id) && facts.product_id == Some(*product_id)
            }
            Self::Serial(serial) => facts.serial == Some(serial.as_str()),
            Self::Class(class) => facts.classes.contains(*class),
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
    use usbwire_proto::op::InterfaceRecord;
    use usbwire_proto::Speed;

    fn selector(text: &str) -> Selector {
        text.parse().unwrap()
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
    fn the_error_names_every_form() {
        assert_eq!(
            "x".parse::<Selector>().unwrap_err().to_string(),
            "\"x\" is not a device selector: use a bus id (1-1.2), VID:PID in hex (0781:5567), serial=TEXT or class=HEX (class=08)"
        );
    }

    #[test]
    fn class_set_holds_every_code() {
        let set: ClassSet = [0x00, 0x3f, 0x40, 0x7f, 0x80, 0xff].into_iter().collect();
        for class in 0..=255u8 {
            assert_eq!(set.contains(class), [0x00, 0x3f, 0x40, 0x7f, 0x80, 0xff].contains(&class), "{class:#x}");
        }
    }

    /// Every selector form against facts with and without each fact.
    #[test]
    fn selector_strings_against_facts() {
        let disk = DeviceFacts {
            busid: "1-1.2",
            vendor_id: Some(0x0781),
            product_id: Some(0x5567),
            serial: Some("ABC 1"),
            classes: [0x08].into_iter().collect(),
        };
        let unknown = DeviceFacts {
            busid: "2-1",
            vendor_id: None,
            product_id: Some(0x5567),
            serial: None,
            classes: ClassSet::default(),
        };
        let table: &[(&str, bool, bool)] = &[
            // selector, matches disk, matches unknown
            ("1-1.2", true, false),
            ("1-1", false, false),
            ("2-1", false, true),
            ("0781:5567", true, false),
            ("0781:5568", false, false),
            ("0782:5567", false, false),
            ("serial=ABC 1", true, false),
            ("serial=ABC", false, false),
            ("class=08", true, false),
            ("class=0x8", true, false),
            ("class=03", false, false),
            ("class=00", false, false),
        ];
        for &(text, on_disk, on_unknown) in table {
            assert_eq!(selector(text).matches(&disk), on_disk, "{text} on the disk");
            assert_eq!(selector(text).matches(&unknown), on_unknown, "{text} on the unknown device");
        }
    }

    #[test]
    fn a_record_matches_by_device_or_interface_class_and_a_known_serial() {
        let interface =
            |class| InterfaceRecord { b_interface_class: class, b_interface_sub_class: 6, b_interface_protocol: 0x50 };
        let record = DeviceRecord {
            path: "/sys/devices/usbwire/2-1".into(),
            busid: usbwire_proto::op::BusId::new("2-1").unwrap(),
            busnum: 2,
            devnum: 1,
            speed: Speed::HIGH,
            id_vendor: 0x1209,
            id_product: 0x0003,
            bcd_device: 0x0100,
            b_device_class: 0,
            b_device_sub_class: 0,
            b_device_protocol: 0,
            b_configuration_value: 1,
            b_num_configurations: 1,
            interfaces: vec![interface(8)],
            b_num_interfaces: 1,
        };
        let without_serial = DeviceFacts::of_record(&record, None);
        let with_serial = DeviceFacts::of_record(&record, Some("A1"));
        assert!(selector("2-1").matches(&without_serial));
        assert!(!selector("1-1").matches(&without_serial));
        assert!(selector("1209:0003").matches(&without_serial));
        assert!(selector("class=08").matches(&without_serial));
        assert!(selector("class=00").matches(&without_serial), "a listed device's class 0 counts");
        assert!(!selector("class=03").matches(&without_serial));
        assert!(selector("serial=A1").matches(&with_serial));
        assert!(!selector("serial=A1").matches(&DeviceFacts::of_record(&record, Some("B2"))));
        assert!(!selector("serial=A1").matches(&without_serial), "no serial known: no match");
    }
}
