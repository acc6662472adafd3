//! Showing a listed device as usbip does: `usbip list -r`'s layout byte for
//! byte, with vendor, product and class names from the system's usb.ids (the
//! lookups are `usbwire_device::usb_ids`').

pub(crate) use usbwire_device::usb_ids::{class_name, UsbIds};
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_printed_as_usbip_prints_them() {
        assert_eq!(host_without_port("127.0.0.1:3240"), "127.0.0.1");
        assert_eq!(host_without_port("[::1]:3240"), "::1");
        assert_eq!(host_without_port("lab-server"), "lab-server");
    }
}
