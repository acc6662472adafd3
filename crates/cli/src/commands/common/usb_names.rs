//! Showing a device to a person: the one name every human line gives it
//! ([`display_name`]), and `usbip list -r`'s table ([`format_like_usbip`]),
//! with class names from the system's usb.ids. The lookups themselves are
//! `usbwire_device::usb_ids`'.

use usbwire_device::record::DeviceJson;
pub(crate) use usbwire_device::usb_ids::{class_name, UsbIds};
use usbwire_proto::display::escape;
use usbwire_proto::op::DeviceRecord;

/// pid.codes, the open-source hardware vendor id: its products `0001` to
/// `0010` are test ids anyone may use (usb.ids names each "pid.codes Test
/// PID"), so that name says nothing about which device it is.
const PID_CODES: u16 = 0x1209;

/// The one name a person reads for a device, on every line that shows one
/// (`list -r`'s table and its "In use" lines, `describe`'s first line, the
/// `state` table): `VENDOR : PRODUCT`, as usbip words it.
///
/// usb.ids' names where it names this very product, exactly as usbip prints
/// them; otherwise the device's own manufacturer and product strings, when
/// the server sent them (a usbwire server does), so that a keyboard and a
/// disk under pid.codes' test ids are not both "Generic : pid.codes Test
/// PID"; otherwise usbip's words for what is not known. A device's strings
/// are its own choice, so they are escaped.
pub(crate) fn display_name(device: &DeviceJson) -> String {
    let test_id = device.vendor_number() == Some(PID_CODES) && matches!(device.product_number(), Some(0x0001..=0x0010));
    let listed = device.product_name.as_deref().filter(|_| !test_id);
    let (vendor, product) = match (listed, device.product.as_deref()) {
        (Some(product), _) => (device.vendor_name.as_deref(), product),
        (None, Some(own)) => (device.manufacturer.as_deref().or(device.vendor_name.as_deref()), own),
        (None, None) => (device.vendor_name.as_deref(), device.product_name.as_deref().unwrap_or("unknown product")),
    };
    format!("{} : {}", escape(vendor.unwrap_or("unknown vendor")), escape(product))
}

/// What `usbip list -r` prints, in its layout (the host without its port,
/// class names from usb.ids as usbip's `usbip_names_get_*`), each device
/// named by [`display_name`] from its record in `named` (found by bus id;
/// usb.ids alone for one that is not there). For a device usb.ids names, or
/// from a server that sends no strings, that is usbip's output byte for
/// byte. `verbose` (`-v`) adds each device's speed, which usbip does not print.
pub(crate) fn format_like_usbip(
    host: &str,
    devices: &[DeviceRecord],
    named: &[&DeviceJson],
    names: &UsbIds,
    verbose: bool,
) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let host = host_without_port(host);
    if devices.is_empty() {
        let _ = writeln!(out, "{host}: no exportable devices");
        return out;
    }
    let _ = writeln!(out, "Exportable USB devices\n======================\n - {host}");
    for d in devices {
        let name = match named.iter().find(|n| n.busid == d.busid.as_str()) {
            Some(record) => display_name(record),
            None => {
                let mut record = DeviceJson::from_wire(d);
                record.fill_names(names);
                display_name(&record)
            }
        };
        let _ = writeln!(out, "{:>11}: {name} ({:04x}:{:04x})", d.busid.as_str(), d.id_vendor, d.id_product);
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

#[cfg(test)]
mod tests {
    use usbwire_device::record::known;

    use super::*;

    const IDS: &str = "1209  Generic\n\t0001  pid.codes Test PID\n\t2000  Some Board\n\
                       0781  SanDisk Corp.\n\t5567  Cruzer Blade\n";

    fn device(ids: (&str, &str), strings: Option<(&str, &str)>) -> DeviceJson {
        let mut device = DeviceJson {
            vendor_id: ids.0.into(),
            product_id: ids.1.into(),
            manufacturer: strings.and_then(|s| known(s.0)),
            product: strings.and_then(|s| known(s.1)),
            ..DeviceJson::default()
        };
        device.fill_names(&UsbIds::from_text(IDS));
        device
    }

    #[test]
    fn a_device_is_named_by_usb_ids_unless_it_knows_only_a_shared_test_id() {
        // usb.ids names this product: usbip's name, whatever the device says.
        assert_eq!(
            display_name(&device(("0781", "5567"), Some(("SanDisk", "Cruzer")))),
            "SanDisk Corp. : Cruzer Blade"
        );
        assert_eq!(display_name(&device(("1209", "2000"), None)), "Generic : Some Board");
        // A pid.codes test id: the device's own strings tell which it is.
        let keyboard = device(("1209", "0001"), Some(("usbwire", "usbwire keyboard")));
        assert_eq!(display_name(&keyboard), "usbwire : usbwire keyboard");
        // ... and without them (a stock server sends none), usbip's words.
        assert_eq!(display_name(&device(("1209", "0001"), None)), "Generic : pid.codes Test PID");
        // A product usb.ids lacks: its own strings, else "unknown".
        assert_eq!(display_name(&device(("0781", "9999"), Some(("", "Stick")))), "SanDisk Corp. : Stick");
        assert_eq!(display_name(&device(("610b", "4653"), None)), "unknown vendor : unknown product");
        let hostile = device(("610b", "4653"), Some(("\u{1b}[2J", "Key\r\n")));
        assert_eq!(display_name(&hostile), r"\x1b[2J : Key\r\n");
    }

    #[test]
    fn hosts_are_printed_as_usbip_prints_them() {
        assert_eq!(host_without_port("127.0.0.1:3240"), "127.0.0.1");
        assert_eq!(host_without_port("[::1]:3240"), "::1");
        assert_eq!(host_without_port("lab-server"), "lab-server");
    }
}
