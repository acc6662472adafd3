//! `usbwire list -r HOST`: a server's exported devices, printed the way
//! `usbip list -r` prints them (names from usb.ids when the system has it).

use serde_json::json;
use usbwire_proto::display::escape;
use usbwire_proto::op::DeviceRecord;

use crate::args::ListArgs;
use crate::exit::Failure;

pub(crate) async fn run(args: ListArgs) -> Result<(), Failure> {
    if args.registry.registry.is_some() {
        return super::lab::list(&args.registry, args.json, args.watch).await;
    }
    if args.discover {
        return discovered(&args).await;
    }
    let Some(remote) = &args.remote else {
        return local_devices(args.json);
    };
    let addr = resolve(remote, args.tcp_port).await?;
    let security = super::client_security(&args.security)?;
    let devices = usbwire_client::list_devices(addr, &security).await?;
    // usbwire servers also say what is in use and by whom; others do not, and that is fine.
    let states = match usbwire_client::device_states(addr, &security).await {
        Ok(states) => states,
        Err(error) => {
            tracing::debug!(%error, "no device state from this server");
            None
        }
    };
    let names = UsbIds::load();
    if args.json {
        let mut listing = devices_json(remote, &devices, &names);
        add_states(&mut listing, states.as_deref());
        super::output::print_json(&listing, false);
    } else {
        let verbose = super::verbosity() > 0;
        print!("{}", format_like_usbip(remote, &devices, &names, verbose));
        // Who holds what (usbwire servers) is ours, not usbip's: with -v.
        if let (true, Some(states)) = (verbose, &states) {
            print!("{}", format_in_use(states));
        }
    }
    Ok(())
}

/// Adds each listed device's state and serial, and an `in_use` list of the
/// devices a DEVLIST leaves out (null when the server does not report state).
fn add_states(listing: &mut serde_json::Value, states: Option<&[usbwire_client::RemoteDeviceState]>) {
    let Some(states) = states else {
        listing["in_use"] = serde_json::Value::Null;
        return;
    };
    if let Some(devices) = listing["devices"].as_array_mut() {
        for device in devices {
            if let Some(state) = states.iter().find(|s| Some(s.busid.as_str()) == device["busid"].as_str()) {
                device["state"] = json!(state.state);
                device["serial"] = json!(state.serial);
                device["product_string"] = json!(state.product);
            }
        }
    }
    listing["in_use"] = json!(states.iter().filter(|s| s.state == "in_use").collect::<Vec<_>>());
}

/// The devices in use, with who holds them and since when. Every string here
/// is the server's word, so each is escaped.
fn format_in_use(states: &[usbwire_client::RemoteDeviceState]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let in_use: Vec<_> = states.iter().filter(|s| s.state == "in_use").collect();
    if in_use.is_empty() {
        return out;
    }
    let _ = writeln!(out, "In use\n======");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    for s in in_use {
        let who = match (&s.identity, &s.client) {
            (Some(identity), Some(client)) => format!("{} at {}", escape(identity), escape(client)),
            (None, Some(client)) => escape(client).to_string(),
            (Some(identity), None) => escape(identity).to_string(),
            (None, None) => "unknown".into(),
        };
        let since = s.since.map_or(String::new(), |t| format!(" for {}", elapsed(now.saturating_sub(t))));
        let away = s.resuming_since.map_or(String::new(), |t| {
            format!(", connection lost {} ago: waiting for it to resume", elapsed(now.saturating_sub(t)))
        });
        let _ = writeln!(
            out,
            "{:>11}: {} ({}:{}) in use by {who}{since}{away}",
            escape(&s.busid),
            escape(&s.product),
            escape(&s.vendor_id),
            escape(&s.product_id)
        );
    }
    out
}

fn elapsed(seconds: u64) -> String {
    match seconds {
        0..=119 => format!("{seconds} s"),
        120..=7199 => format!("{} min", seconds / 60),
        _ => format!("{} h", seconds / 3600),
    }
}

/// `usbwire list --discover`: servers that answer mDNS/DNS-SD, each with its devices.
async fn discovered(args: &ListArgs) -> Result<(), Failure> {
    let wait = std::time::Duration::from_secs_f64(args.timeout.clamp(0.1, 60.0));
    let servers = tokio::task::spawn_blocking(move || usbwire_discovery::browse(wait))
        .await
        .map_err(|e| Failure::software(e.into()))?
        .map_err(|e| Failure::unavailable(anyhow::anyhow!("cannot browse with mDNS: {e}")))?;
    let security = super::client_security(&args.security)?;
    let names = UsbIds::load();
    let mut records = Vec::new();
    for server in &servers {
        let Some(ip) = server.addresses.first() else { continue };
        let addr = std::net::SocketAddr::new(*ip, server.port);
        let host = addr.to_string();
        let listing = if server.requires_tls() && !args.security.tls {
            Err(format!("{host} requires TLS: list it with --tls"))
        } else {
            usbwire_client::list_devices(addr, &security).await.map_err(|e| e.to_string())
        };
        if args.json {
            let mut record = json!({
                "name": server.name, "host": server.host, "addresses": server.addresses,
                "port": server.port, "txt": server.txt,
            });
            match &listing {
                Ok(devices) => record["devices"] = devices_json(&host, devices, &names)["devices"].clone(),
                Err(error) => record["error"] = json!(error),
            }
            records.push(record);
        } else {
            println!("{}", found_server_line(server, &host));
            match &listing {
                Ok(devices) => print!("{}", format_like_usbip(&host, devices, &names, super::verbosity() > 0)),
                Err(error) => println!("  {}", escape(error)),
            }
            println!();
        }
    }
    if args.json {
        super::output::print_json(&json!({ "servers": records }), false);
    } else if servers.is_empty() {
        println!("no USB/IP servers answered within {:.1} s (mDNS, _usbip._tcp)", wait.as_secs_f64());
    }
    Ok(())
}

/// `NAME at ADDRESS (TXT…)` for one browse answer. The name and TXT records
/// come from any machine on the LAN, so each is escaped.
fn found_server_line(server: &usbwire_discovery::FoundServer, host: &str) -> String {
    let txt: Vec<String> = server.txt.iter().map(|(k, v)| format!("{}={}", escape(k), escape(v))).collect();
    format!("{} at {host} ({})", escape(&server.name), txt.join(" "))
}

/// `usbwire list -l`: what is plugged into this machine, like `usbip list -l`
/// plus strings, speed and the driver of each interface.
fn local_devices(json: bool) -> Result<(), Failure> {
    let devices = usbwire_host::list().map_err(|error| Failure::unavailable(error.into()))?;
    if json {
        super::output::print_json(&json!({ "devices": devices }), false);
        return Ok(());
    }
    if devices.is_empty() {
        println!("no USB devices on this machine");
        return Ok(());
    }
    let names = UsbIds::load();
    for d in &devices {
        let vendor =
            d.manufacturer.clone().or_else(|| names.vendor(d.vendor_id)).unwrap_or_else(|| "unknown vendor".into());
        let product = d
            .product
            .clone()
            .or_else(|| names.product(d.vendor_id, d.product_id))
            .unwrap_or_else(|| "unknown product".into());
        // A device chooses its own strings (think of a hostile USB stick).
        println!(" - busid {} ({:04x}:{:04x})", d.busid, d.vendor_id, d.product_id);
        print!("   {} : {}, {} speed", escape(&vendor), escape(&product), d.speed.name());
        match &d.serial {
            Some(serial) => println!(", serial {}", escape(serial)),
            None => println!(),
        }
        for i in &d.interfaces {
            let driver = i.driver.as_deref().unwrap_or("(none)");
            println!(
                "   {}: {:02x}/{:02x}/{:02x} {} - driver {driver}",
                i.number,
                i.class,
                i.subclass,
                i.protocol,
                class_name(i.class)
            );
        }
        println!();
    }
    Ok(())
}

/// `HOST`, `HOST:PORT`, or `HOST` with `--tcp-port PORT`.
pub(crate) async fn resolve(remote: &str, tcp_port: Option<u16>) -> Result<std::net::SocketAddr, Failure> {
    let target = match tcp_port {
        Some(port) if !remote.contains(':') => format!("{remote}:{port}"),
        _ => remote.to_owned(),
    };
    Ok(usbwire_client::resolve(&target).await?)
}

pub(crate) fn devices_json(host: &str, devices: &[DeviceRecord], names: &UsbIds) -> serde_json::Value {
    let devices: Vec<_> = devices
        .iter()
        .map(|d| {
            json!({
                "busid": d.busid.as_str(),
                "busnum": d.busnum,
                "devnum": d.devnum,
                "path": d.path,
                "speed": d.speed.name(),
                "vendor_id": format!("{:04x}", d.id_vendor),
                "product_id": format!("{:04x}", d.id_product),
                "vendor": names.vendor(d.id_vendor),
                "product": names.product(d.id_vendor, d.id_product),
                "product_name": names.product(d.id_vendor, d.id_product),
                "vendor_name": names.vendor(d.id_vendor),
                "bcd_device": format!("{:04x}", d.bcd_device),
                "device_class": format!("{:02x}/{:02x}/{:02x}", d.b_device_class, d.b_device_sub_class, d.b_device_protocol),
                "configuration_value": d.b_configuration_value,
                "num_configurations": d.b_num_configurations,
                "interfaces": d.interfaces.iter().enumerate().map(|(i, f)| json!({
                    "number": i,
                    "class": format!("{:02x}/{:02x}/{:02x}", f.b_interface_class, f.b_interface_sub_class, f.b_interface_protocol),
                    "class_name": class_name(f.b_interface_class),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "host": host, "devices": devices })
}

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

    fn state(
        busid: &str,
        state: &str,
        client: Option<&str>,
        identity: Option<&str>,
        since: Option<u64>,
    ) -> usbwire_client::RemoteDeviceState {
        usbwire_client::RemoteDeviceState {
            busid: busid.into(),
            kind: "disk".into(),
            vendor_id: "1209".into(),
            product_id: "0003".into(),
            product: "usbwire disk".into(),
            manufacturer: String::new(),
            serial: "S1".into(),
            speed: "super".into(),
            state: state.into(),
            client: client.map(Into::into),
            identity: identity.map(Into::into),
            since,
            resuming_since: None,
            counters: None,
            ..Default::default()
        }
    }

    #[test]
    fn mdns_names_and_txt_values_are_printed_escaped() {
        let server = usbwire_discovery::FoundServer {
            name: "lab\x1b]0;owned\x07 server\u{202e}".into(),
            host: "lab.local".into(),
            addresses: vec!["192.0.2.1".parse().unwrap()],
            port: 3240,
            txt: [("tls\r".to_owned(), "off\x1b[2J".to_owned()), ("impl".to_owned(), "usbwire".to_owned())].into(),
        };
        let line = found_server_line(&server, "192.0.2.1:3240");
        assert_eq!(line, r"lab\x1b]0;owned\x07 server\u{202e} at 192.0.2.1:3240 (impl=usbwire tls\r=off\x1b[2J)");
    }

    #[test]
    fn a_holder_whose_connection_dropped_is_shown_resuming() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let mut held = state("2-1", "in_use", Some("10.0.0.9:4000"), None, Some(now - 300));
        held.resuming_since = Some(now - 4);
        let text = format_in_use(&[held]);
        assert!(
            text.contains("in use by 10.0.0.9:4000 for 5 min, connection lost 4 s ago: waiting for it to resume"),
            "{text}"
        );
    }

    #[test]
    fn in_use_devices_are_listed_with_holder_and_age() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let states = [
            state("1-1", "available", None, None, None),
            state("2-1", "in_use", Some("10.0.0.9:4000"), Some("sha256:ab"), Some(now - 300)),
        ];
        let text = format_in_use(&states);
        assert!(
            text.contains("2-1: usbwire disk (1209:0003) in use by sha256:ab at 10.0.0.9:4000 for 5 min"),
            "{text}"
        );
        assert!(!text.contains("1-1"));
        let mut listing = json!({ "devices": [{ "busid": "1-1" }] });
        add_states(&mut listing, Some(&states));
        assert_eq!(listing["devices"][0]["state"], "available");
        assert_eq!(listing["devices"][0]["serial"], "S1");
        assert_eq!(listing["in_use"][0]["busid"], "2-1");
        let mut unknown = json!({ "devices": [] });
        add_states(&mut unknown, None);
        assert!(unknown["in_use"].is_null());
    }
}
