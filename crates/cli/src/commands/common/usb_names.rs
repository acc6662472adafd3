//! Showing a listed device as usbip does: vendor, product and class names
//! from the system's usb.ids, and `usbip list -r`'s layout byte for byte.

use usbwire_proto::display::escape;
use usbwire_proto::op::DeviceRecord;

/// What `usbip list -r` prints, byte for byte (the host without its port,
/// names from usb.ids as usbip's `usbip_names_get_*`). `verbose` (`-v`) adds
/// each device's speed, which usbip does not print.
pub(crate) fn format_like_usbip(host: &str, devices: &[DeviceRecord], names: &UsbIds, verbose: bool) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let host = host_without_port(host);
    if devices.is_empty() {
        let _ = writeln!(out, "{host}: no exportable devices");
        return out;
    }
    let _ = writeln!(out, "Exportable USB devices\n======================\n - {host}");
    for d in devices {
        let vendor = names.vendor(d.id_vendor).unwrap_or_else(|| "unknown vendor".into());
        let product = names.product(d.id_vendor, d.id_product).unwrap_or_else(|| "unknown product".into());
        let _ =
            writeln!(out, "{:>11}: {vendor} : {product} ({:04x}:{:04x})", d.busid.as_str(), d.id_vendor, d.id_product);
        // `path` is free text from the server.
        let _ = writeln!(out, "{:>11}: {}", "", escape(&d.path));
        let _ =
            writeln!(out, "{:>11}: {}", "", names.class(d.b_device_class, d.b_device_sub_class, d.b_device_protocol));
        if verbose {
            let _ = writeln!(out, "{:>11}: speed {}", "", d.speed.name());
        }
        for (i, f) in d.interfaces.iter().enumerate() {
            let class = names.class(f.b_interface_class, f.b_interface_sub_class, f.b_interface_protocol);
            let _ = writeln!(out, "{:>11}: {i:2} - {class}", "");
        }
        out.push('\n');
    }
    out
}

/// `HOST:PORT`, `[V6]:PORT` or `HOST` → the host as usbip prints it.
fn host_without_port(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') && port.parse::<u16>().is_ok() => name,
        _ => host,
    }
}

/// USB class names for the classes people meet.
pub(crate) fn class_name(class: u8) -> &'static str {
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

/// Vendor and product names from the system's usb.ids (hwdata), when present.
#[derive(Default)]
pub(crate) struct UsbIds {
    text: String,
}

impl UsbIds {
    pub(crate) fn load() -> Self {
        for path in ["/usr/share/hwdata/usb.ids", "/usr/share/misc/usb.ids", "/usr/share/usb.ids"] {
            if let Ok(text) = std::fs::read_to_string(path) {
                return Self { text };
            }
        }
        Self::default()
    }

    pub(crate) fn vendor(&self, vendor: u16) -> Option<String> {
        let key = format!("{vendor:04x}  ");
        self.text.lines().find_map(|l| l.strip_prefix(key.as_str())).map(|name| name.trim().to_owned())
    }

    /// `Class / Subclass / Protocol (cc/ss/pp)` as usbip's `usbip_names_get_class`
    /// words it ("unknown …" for what usb.ids lacks; 0/0/0 is "Defined at Interface level").
    pub(crate) fn class(&self, class: u8, subclass: u8, protocol: u8) -> String {
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

    pub(crate) fn product(&self, vendor: u16, product: u16) -> Option<String> {
        let key = format!("{vendor:04x}  ");
        let product_key = format!("\t{product:04x}  ");
        let mut lines = self.text.lines().skip_while(|l| !l.starts_with(key.as_str()));
        lines.next()?;
        lines
            .take_while(|l| l.starts_with('\t') || l.starts_with('#'))
            .find_map(|l| l.strip_prefix(product_key.as_str()))
            .map(|name| name.trim().to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usb_ids_lookup() {
        let ids = UsbIds {
            text: "# comment\n1209  Generic\n\t0001  pid.codes Test PID\n\t0002  Other\n1d6b  Linux Foundation\n\t0002  2.0 root hub\n".into(),
        };
        assert_eq!(ids.vendor(0x1209).as_deref(), Some("Generic"));
        assert_eq!(ids.product(0x1209, 0x0002).as_deref(), Some("Other"));
        assert_eq!(ids.product(0x1209, 0x0003), None);
        assert_eq!(ids.product(0x1d6b, 0x0002).as_deref(), Some("2.0 root hub"));
        assert_eq!(ids.vendor(0xffff), None);
    }

    #[test]
    fn class_names_as_usbip_words_them() {
        let ids = UsbIds {
            text: "1209  Generic\nC 03  Human Interface Device\n\t00  No Subclass\n\t01  Boot Interface Subclass\n\
                   \t\t01  Keyboard\n\t\t02  Mouse\nC 08  Mass Storage\n\t06  SCSI\n\t\t50  Bulk-Only\n"
                .into(),
        };
        assert_eq!(ids.class(3, 1, 1), "Human Interface Device / Boot Interface Subclass / Keyboard (03/01/01)");
        assert_eq!(ids.class(3, 0, 2), "Human Interface Device / No Subclass / unknown protocol (03/00/02)");
        assert_eq!(ids.class(8, 6, 0x50), "Mass Storage / SCSI / Bulk-Only (08/06/50)");
        assert_eq!(ids.class(0xff, 0, 0), "unknown class / unknown subclass / unknown protocol (ff/00/00)");
        assert_eq!(ids.class(0, 0, 0), "(Defined at Interface level) (00/00/00)");
        assert_eq!(host_without_port("127.0.0.1:3240"), "127.0.0.1");
        assert_eq!(host_without_port("[::1]:3240"), "::1");
        assert_eq!(host_without_port("lab-server"), "lab-server");
    }
}
