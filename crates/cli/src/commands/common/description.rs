//! A remote device's descriptors as `usbwire describe` shows them: fetched
//! over USB/IP and printed with class names.

use std::fmt::Write as _;

use usbwire_client::describe::{self, Description, Item};
use usbwire_client::Connection;
use usbwire_proto::display::escape;
use usbwire_proto::op::BusId;

use crate::exit::Failure;

/// Imports `busid`, reads its descriptors and releases it again: the
/// import's device record (bus id, speed, ids) and the descriptors.
pub(crate) async fn fetch(
    addr: std::net::SocketAddr,
    busid: &BusId,
    security: &usbwire_client::Security,
) -> Result<(usbwire_proto::op::DeviceRecord, Description), Failure> {
    let (stream, record) = usbwire_client::import(addr, busid, security).await?;
    let connection = Connection::new(stream, &record);
    let description = describe::describe(&connection).await.map_err(|e| Failure::unavailable(e.into()))?;
    // Closing the connection releases the device on the server.
    connection.close().await;
    Ok((record, description))
}

/// `cc/ss/pp` with its names from usb.ids, as lsusb prints a class.
fn named_class(triple: &str, names: &super::usb_names::UsbIds) -> String {
    let parts: Vec<u8> = triple.split('/').filter_map(|p| u8::from_str_radix(p, 16).ok()).collect();
    match parts[..] {
        [class, subclass, protocol] => names.class(class, subclass, protocol),
        _ => triple.to_owned(),
    }
}

/// The descriptor tree as `lsusb -v` shows one, under `Device BUSID: ID
/// VVVV:PPPP NAME` (NAME: the device's one name, `usb_names::display_name`).
pub(crate) fn format(busid: &BusId, shown_as: &str, d: &Description, names: &super::usb_names::UsbIds) -> String {
    let mut o = String::new();
    // String descriptors are the remote device's own words: shown escaped.
    let name = |s: &Option<String>| escape(s.as_deref().unwrap_or_default()).to_string();
    let _ = writeln!(o, "Device {busid}: ID {}:{} {shown_as}", d.vendor_id, d.product_id);
    let _ = writeln!(o, "Device Descriptor:");
    let _ = writeln!(o, "  bcdUSB              {}", d.bcd_usb);
    let _ = writeln!(o, "  class/sub/proto     {}", named_class(&d.device_class, names));
    let _ = writeln!(o, "  bMaxPacketSize0     {}", d.max_packet_size0);
    let _ = writeln!(o, "  idVendor            0x{}", d.vendor_id);
    let _ = writeln!(o, "  idProduct           0x{}", d.product_id);
    let _ = writeln!(o, "  bcdDevice           {}", d.bcd_device);
    let _ = writeln!(o, "  iManufacturer       {}", name(&d.manufacturer));
    let _ = writeln!(o, "  iProduct            {}", name(&d.product));
    let _ = writeln!(o, "  iSerial             {}", name(&d.serial));
    let _ = writeln!(o, "  bNumConfigurations  {}", d.num_configurations);
    let _ = writeln!(o, "  Configuration Descriptor:");
    let _ = writeln!(o, "    bConfigurationValue {}", d.configuration_value);
    let _ = writeln!(o, "    bmAttributes        {}", d.configuration_attributes);
    let _ = writeln!(o, "    MaxPower            {}mA", d.max_power_ma);
    for item in &d.items {
        match item {
            Item::InterfaceAssociation { first_interface, interface_count, class } => {
                let _ = writeln!(o, "    Interface Association:");
                let _ = writeln!(o, "      bFirstInterface     {first_interface}");
                let _ = writeln!(o, "      bInterfaceCount     {interface_count}");
                let _ = writeln!(o, "      class/sub/proto     {}", named_class(class, names));
            }
            Item::Interface { number, alt_setting, num_endpoints, class, name } => {
                let _ = writeln!(o, "    Interface Descriptor:");
                let _ = writeln!(o, "      bInterfaceNumber    {number}");
                let _ = writeln!(o, "      bAlternateSetting   {alt_setting}");
                let _ = writeln!(o, "      bNumEndpoints       {num_endpoints}");
                let _ = writeln!(o, "      class/sub/proto     {}", named_class(class, names));
                if let Some(name) = name {
                    let _ = writeln!(o, "      iInterface          {}", escape(name));
                }
            }
            Item::Endpoint { address, direction, transfer_type, max_packet_size, interval } => {
                let _ = writeln!(o, "      Endpoint Descriptor:");
                let _ = writeln!(o, "        bEndpointAddress  {address} EP {direction}");
                let _ = writeln!(o, "        Transfer Type     {transfer_type}");
                let _ = writeln!(o, "        wMaxPacketSize    {max_packet_size}");
                let _ = writeln!(o, "        bInterval         {interval}");
            }
            Item::SuperSpeedCompanion { max_burst, attributes, bytes_per_interval } => {
                let _ = writeln!(
                    o,
                    "        SuperSpeed Companion: bMaxBurst {max_burst} bmAttributes {attributes:#04x} wBytesPerInterval {bytes_per_interval}"
                );
            }
            Item::Hid { bcd_hid, country_code, descriptors } => {
                let _ = writeln!(o, "      HID Device Descriptor:");
                let _ = writeln!(o, "        bcdHID            {bcd_hid}");
                let _ = writeln!(o, "        bCountryCode      {country_code}");
                for (kind, length) in descriptors {
                    let what = if kind == "0x22" { "Report" } else { "Class" };
                    let _ = writeln!(o, "        {what} Descriptor  type {kind}, {length} bytes");
                }
            }
            Item::CdcHeader { bcd_cdc } => {
                let _ = writeln!(o, "      CDC Header:");
                let _ = writeln!(o, "        bcdCDC            {bcd_cdc}");
            }
            Item::CdcCallManagement { capabilities, data_interface } => {
                let _ = writeln!(o, "      CDC Call Management:");
                let _ = writeln!(o, "        bmCapabilities    {capabilities}");
                let _ = writeln!(o, "        bDataInterface    {data_interface}");
            }
            Item::CdcAcm { capabilities } => {
                let _ = writeln!(o, "      CDC ACM:");
                let _ = writeln!(o, "        bmCapabilities    {capabilities}");
            }
            Item::CdcUnion { control_interface, subordinate_interfaces } => {
                let _ = writeln!(o, "      CDC Union:");
                let _ = writeln!(o, "        bMasterInterface  {control_interface}");
                let slaves: Vec<String> = subordinate_interfaces.iter().map(u8::to_string).collect();
                let _ = writeln!(o, "        bSlaveInterface   {}", slaves.join(" "));
            }
            other => format_other(&mut o, other, "      "),
        }
    }
    if !d.bos.is_empty() {
        let _ = writeln!(o, "Binary Object Store Descriptor:");
        for item in &d.bos {
            format_other(&mut o, item, "  ");
        }
    }
    o
}

/// BOS capabilities, and what is left as hex.
fn format_other(o: &mut String, item: &Item, indent: &str) {
    match item {
        Item::Usb2Extension { attributes, lpm } => {
            let _ = writeln!(o, "{indent}USB 2.0 Extension Device Capability:");
            let _ = writeln!(o, "{indent}  bmAttributes      {attributes}");
            let _ = writeln!(o, "{indent}  LPM               {}", if *lpm { "supported" } else { "not supported" });
        }
        Item::SuperSpeedCapability {
            speeds_supported,
            lowest_full_function_speed,
            u1_exit_latency_us,
            u2_exit_latency_us,
        } => {
            let _ = writeln!(o, "{indent}SuperSpeed USB Device Capability:");
            let _ = writeln!(o, "{indent}  wSpeedsSupported  {}", speeds_supported.join(", "));
            let _ = writeln!(o, "{indent}  bFunctionalitySupport {lowest_full_function_speed}");
            let _ = writeln!(o, "{indent}  bU1DevExitLat     {u1_exit_latency_us} µs");
            let _ = writeln!(o, "{indent}  bU2DevExitLat     {u2_exit_latency_us} µs");
        }
        Item::ContainerId { uuid } => {
            let _ = writeln!(o, "{indent}Container ID Device Capability:");
            let _ = writeln!(o, "{indent}  ContainerID       {{{uuid}}}");
        }
        Item::Other { descriptor_type, bytes } => {
            let _ = writeln!(o, "{indent}Descriptor {descriptor_type}: {bytes}");
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_string_descriptors_are_printed_escaped() {
        let description = Description {
            bcd_usb: "2.00".into(),
            device_class: "00/00/00".into(),
            max_packet_size0: 64,
            vendor_id: "1209".into(),
            product_id: "0001".into(),
            bcd_device: "1.00".into(),
            manufacturer: Some("ACME\x1b[2J".into()),
            product: Some("Key\u{9b}31mboard\r\n".into()),
            serial: Some("\u{202e}123".into()),
            num_configurations: 1,
            configuration_value: 1,
            configuration_attributes: "0x80".into(),
            max_power_ma: 100,
            items: vec![Item::Interface {
                number: 0,
                alt_setting: 0,
                num_endpoints: 0,
                class: "03/00/00".into(),
                name: Some("HID\x07\x7f".into()),
            }],
            bos: Vec::new(),
        };
        let text = format(
            &BusId::new("1-1").unwrap(),
            "ACME : Key",
            &description,
            &crate::commands::common::usb_names::UsbIds::default(),
        );
        assert!(!text.chars().any(|c| usbwire_proto::display::needs_escape(c) && c != '\n'), "{text:?}");
        assert!(text.starts_with("Device 1-1: ID 1209:0001 ACME : Key\n"), "{text}");
        assert!(text.contains(r"iManufacturer       ACME\x1b[2J"), "{text}");
        assert!(text.contains(r"iProduct            Key\u{9b}31mboard\r\n"), "{text}");
        assert!(text.contains(r"iSerial             \u{202e}123"), "{text}");
        assert!(text.contains(r"iInterface          HID\x07\x7f"), "{text}");
    }
}
