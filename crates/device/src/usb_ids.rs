//! Names for USB ids and classes: vendor and product names from the
//! system's usb.ids (hwdata), and the names of the device classes people
//! meet. What fills a [`DeviceJson`](crate::record::DeviceJson)'s
//! `vendor_name`, `product_name` and each interface's `class_name`, the same
//! way in the CLI and in the server's status page.
//!
//! Not for showing a device to a person (the CLI words its tables), nor for
//! fetching usb.ids: a machine without it has no names, and says `null`.

use std::collections::HashMap;
use std::ops::Range;

/// Vendor, product and class names from the system's usb.ids, when present.
/// Each vendor's section is found by its id at once (the server names every
/// device on each `/status.json`), not by reading the file from the top.
#[derive(Clone, Debug, Default)]
pub struct UsbIds {
    text: String,
    /// Where each vendor's section is in `text`: its line and its products'.
    vendors: HashMap<u16, Range<usize>>,
}

impl UsbIds {
    /// The usb.ids of this machine (hwdata's, or the older places), else none.
    pub fn load() -> Self {
        for path in ["/usr/share/hwdata/usb.ids", "/usr/share/misc/usb.ids", "/usr/share/usb.ids"] {
            if let Ok(text) = std::fs::read_to_string(path) {
                return Self::from_text(text);
            }
        }
        Self::default()
    }

    /// A usb.ids of this text.
    pub fn from_text(text: impl Into<String>) -> Self {
        let text = text.into();
        let mut vendors = HashMap::new();
        let mut open: Option<(u16, usize)> = None;
        let mut at = 0;
        for line in text.split_inclusive('\n') {
            let inside = line.starts_with('\t') || line.starts_with('#');
            if !inside {
                if let Some((vendor, start)) = open.take() {
                    vendors.entry(vendor).or_insert(start..at);
                }
                open = vendor_line(line).map(|vendor| (vendor, at));
            }
            at += line.len();
        }
        if let Some((vendor, start)) = open {
            vendors.entry(vendor).or_insert(start..at);
        }
        Self { text, vendors }
    }

    /// A vendor's section: its line, then its products' lines.
    fn section(&self, vendor: u16) -> Option<std::str::Lines<'_>> {
        let range = self.vendors.get(&vendor)?;
        Some(self.text.get(range.clone())?.lines())
    }

    /// The vendor's name: `Linux Foundation` for `1d6b`.
    pub fn vendor(&self, vendor: u16) -> Option<String> {
        let line = self.section(vendor)?.next()?;
        line.get(6..).map(|name| name.trim().to_owned())
    }

    /// The product's name, under its vendor's: `2.0 root hub` for `1d6b:0002`.
    pub fn product(&self, vendor: u16, product: u16) -> Option<String> {
        let product_key = format!("\t{product:04x}  ");
        self.section(vendor)?
            .skip(1)
            .find_map(|l| l.strip_prefix(product_key.as_str()))
            .map(|name| name.trim().to_owned())
    }

    /// `Class / Subclass / Protocol (cc/ss/pp)` as usbip's `usbip_names_get_class`
    /// words it ("unknown …" for what usb.ids lacks; 0/0/0 is "Defined at Interface level").
    pub fn class(&self, class: u8, subclass: u8, protocol: u8) -> String {
        let numbers = format!("({class:02x}/{subclass:02x}/{protocol:02x})");
        if (class, subclass, protocol) == (0, 0, 0) {
            return format!("(Defined at Interface level) {numbers}");
        }
        let (mut class_name, mut subclass_name, mut protocol_name) = (None, None, None);
        let class_key = format!("C {class:02x}  ");
        let subclass_key = format!("\t{subclass:02x}  ");
        let protocol_key = format!("\t\t{protocol:02x}  ");
        let mut lines = self.text.lines().skip_while(|l| !l.starts_with(class_key.as_str()));
        if let Some(line) = lines.next() {
            class_name = line.strip_prefix(class_key.as_str()).map(str::trim);
            let mut in_subclass = false;
            for line in lines.take_while(|l| l.starts_with('\t') || l.starts_with('#')) {
                if let Some(name) = line.strip_prefix(subclass_key.as_str()) {
                    subclass_name = Some(name.trim());
                    in_subclass = true;
                } else if !line.starts_with("\t\t") {
                    in_subclass = false;
                } else if in_subclass {
                    protocol_name = protocol_name.or(line.strip_prefix(protocol_key.as_str()).map(str::trim));
                }
            }
        }
        format!(
            "{} / {} / {} {numbers}",
            class_name.unwrap_or("unknown class"),
            subclass_name.unwrap_or("unknown subclass"),
            protocol_name.unwrap_or("unknown protocol")
        )
    }
}

/// `1d6b  Linux Foundation` → `0x1d6b`: four lowercase hex digits, two spaces.
fn vendor_line(line: &str) -> Option<u16> {
    let (id, rest) = (line.get(..4)?, line.get(4..)?);
    if !rest.starts_with("  ") || !id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    u16::from_str_radix(id, 16).ok()
}

/// The name of a USB class people meet (`Mass Storage` for `08`), the same
/// on every machine: an interface's `class_name`.
pub fn class_name(class: u8) -> &'static str {
    match class {
        0x01 => "Audio",
        0x02 => "Communications",
        0x03 => "Human Interface Device",
        0x05 => "Physical",
        0x06 => "Imaging",
        0x07 => "Printer",
        0x08 => "Mass Storage",
        0x09 => "Hub",
        0x0a => "CDC Data",
        0x0b => "Chip/SmartCard",
        0x0d => "Content Security",
        0x0e => "Video",
        0x0f => "Personal Healthcare",
        0x10 => "Audio/Video",
        0xdc => "Diagnostic",
        0xe0 => "Wireless",
        0xef => "Miscellaneous Device",
        0xfe => "Application Specific Interface",
        0xff => "Vendor Specific Class",
        _ => "unknown class",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usb_ids_lookup() {
        let ids = UsbIds::from_text(
            "# comment\n1209  Generic\n\t0001  pid.codes Test PID\n\t0002  Other\n1d6b  Linux Foundation\n\t0002  2.0 root hub\n",
        );
        assert_eq!(ids.vendor(0x1209).as_deref(), Some("Generic"));
        assert_eq!(ids.product(0x1209, 0x0002).as_deref(), Some("Other"));
        assert_eq!(ids.product(0x1209, 0x0003), None);
        assert_eq!(ids.product(0x1d6b, 0x0002).as_deref(), Some("2.0 root hub"));
        assert_eq!(ids.vendor(0xffff), None);
        // The last section, and a product under a vendor that has a comment among its products.
        let ids = UsbIds::from_text("0001  First\n\t0001  One\n# a comment\n\t0002  Two\nffff  Last\n\tfffe  End");
        assert_eq!(ids.product(0x0001, 0x0002).as_deref(), Some("Two"));
        assert_eq!(ids.product(0xffff, 0xfffe).as_deref(), Some("End"));
        assert_eq!(ids.vendor(0xffff).as_deref(), Some("Last"));
        assert_eq!(ids.product(0xffff, 0x0001), None);
    }

    #[test]
    fn class_names_as_usbip_words_them() {
        let ids = UsbIds::from_text(
            "1209  Generic\nC 03  Human Interface Device\n\t00  No Subclass\n\t01  Boot Interface Subclass\n\
             \t\t01  Keyboard\n\t\t02  Mouse\nC 08  Mass Storage\n\t06  SCSI\n\t\t50  Bulk-Only\n",
        );
        assert_eq!(ids.class(3, 1, 1), "Human Interface Device / Boot Interface Subclass / Keyboard (03/01/01)");
        assert_eq!(ids.class(3, 0, 2), "Human Interface Device / No Subclass / unknown protocol (03/00/02)");
        assert_eq!(ids.class(8, 6, 0x50), "Mass Storage / SCSI / Bulk-Only (08/06/50)");
        assert_eq!(ids.class(0xff, 0, 0), "unknown class / unknown subclass / unknown protocol (ff/00/00)");
        assert_eq!(ids.class(0, 0, 0), "(Defined at Interface level) (00/00/00)");
        assert_eq!(class_name(8), "Mass Storage");
        assert_eq!(class_name(0x42), "unknown class");
    }
}
