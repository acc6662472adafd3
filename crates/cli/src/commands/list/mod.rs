//! `usbwire list -r HOST`: a server's exported devices, printed the way
//! `usbip list -r` prints them (names from usb.ids when the system has it);
//! `list -l` for this machine's devices, `list -d` for servers found by
//! mDNS, `list --registry [--watch]` for the lab registry's fleet
//! ([`registry`]).

use anyhow::anyhow;
use serde_json::json;
use usbwire_device::devstate::DeviceStateEntry;
use usbwire_device::record::DeviceJson;
use usbwire_proto::display::escape;

use super::common::device_json::{listed, local};
use super::common::output::print_json;
use super::common::peer::resolve;
use super::common::stdout::{out, outln};
use super::common::usb_names::{class_name, display_name, format_like_usbip, UsbIds};
use crate::args::ListArgs;
use crate::exit::Failure;

mod registry;

use registry::Shape;

pub(crate) async fn run(args: ListArgs) -> Result<(), Failure> {
    if args.registry.registry.is_some() {
        let shape = match (args.json_lines, args.json) {
            (true, _) => Shape::Lines,
            (false, true) => Shape::Document,
            (false, false) => Shape::Table,
        };
        return registry::list(&args.registry, args.device.as_deref(), shape, args.watch).await;
    }
    if args.discover {
        return discovered(&args).await;
    }
    let Some(remote) = &args.remote else {
        return local_devices(args.json, args.parsable);
    };
    let addr = resolve(remote, args.tcp_port).await?;
    let security = super::common::peer::client_security(&args.security)?;
    let devices = usbwire_client::list_devices(addr, &security).await?;
    // usbwire servers also say what is in use and by whom, and whether a
    // plain client must use TLS to see anything; others do not, and that is fine.
    let document = if args.parsable && !devices.is_empty() {
        None
    } else {
        match usbwire_client::server_state(addr, &security).await {
            Ok(document) => document,
            Err(error) => {
                tracing::debug!(%error, "no device state from this server");
                None
            }
        }
    };
    if devices.is_empty() && document.as_ref().is_some_and(|d| d.tls_required) {
        return Err(Failure::not_admitted(anyhow!("{remote}: {}", usbwire_client::refusal::TLS_REQUIRED)));
    }
    if args.parsable {
        for d in &devices {
            out!("{}", parsable_line(d.busid.as_str(), d.id_vendor, d.id_product))?;
        }
        return Ok(());
    }
    let states = document.as_ref().map(|d| d.devices.as_slice());
    let names = UsbIds::load();
    let records = listed(&devices, states, &names);
    if args.json {
        return print_json(&json!({ "host": remote, "devices": records }), false);
    }
    let verbose = super::common::process::verbosity() > 0;
    let named: Vec<&DeviceJson> = records.iter().map(|r| &r.device).collect();
    out!("{}", format_like_usbip(remote, &devices, &named, &names, verbose))?;
    // Who holds what (usbwire servers) is ours, not usbip's: with -v.
    if let (true, Some(states)) = (verbose, states) {
        out!("{}", format_in_use(states, &names))?;
        out!("{}", format_reserved(states, &names))?;
    }
    Ok(())
}

/// The name a device has on every line ([`display_name`]), from what the server said of it.
fn shown_name(state: &DeviceStateEntry, names: &UsbIds) -> String {
    let mut device = DeviceJson::from(state);
    device.fill_names(names);
    display_name(&device)
}

/// The devices in use, with who holds them and since when. Every string here
/// is the server's word, so each is escaped.
fn format_in_use(states: &[DeviceStateEntry], names: &UsbIds) -> String {
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
            shown_name(s, names),
            escape(&s.vendor_id),
            escape(&s.product_id)
        );
    }
    out
}

/// The devices reserved in the lab registry: for whom and until when.
fn format_reserved(states: &[DeviceStateEntry], names: &UsbIds) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let reserved: Vec<_> = states.iter().filter_map(|s| Some((s, s.reservation.as_ref()?))).collect();
    if reserved.is_empty() {
        return out;
    }
    let _ = writeln!(out, "Reserved in the lab registry\n============================");
    for (s, reservation) in reserved {
        let client =
            if reservation.client.is_empty() { String::new() } else { format!(" ({})", escape(&reservation.client)) };
        let until = reservation
            .until_at
            .as_deref()
            .map_or_else(|| " until released".to_owned(), |u| format!(" until {}", escape(u)));
        let _ = writeln!(
            out,
            "{:>11}: {} ({}:{}) reserved for {}{client}{until}",
            escape(&s.busid),
            shown_name(s, names),
            escape(&s.vendor_id),
            escape(&s.product_id),
            escape(&reservation.holder)
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
    let security = super::common::peer::client_security(&args.security)?;
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
                Ok(devices) => record["devices"] = json!(listed(devices, None, &names)),
                Err(error) => record["error"] = json!(error),
            }
            records.push(record);
        } else {
            outln!("{}", found_server_line(server, &host))?;
            match &listing {
                Ok(devices) => {
                    let verbose = super::common::process::verbosity() > 0;
                    out!("{}", format_like_usbip(&host, devices, &[], &names, verbose))?
                }
                Err(error) => outln!("  {}", escape(error))?,
            }
            outln!()?;
        }
    }
    if args.json {
        print_json(&json!({ "servers": records }), false)?;
    } else if servers.is_empty() {
        outln!("no USB/IP servers answered within {:.1} s (mDNS, _usbip._tcp)", wait.as_secs_f64())?;
    }
    Ok(())
}

/// `NAME at ADDRESS (TXT…)` for one browse answer. The name and TXT records
/// come from any machine on the LAN, so each is escaped.
fn found_server_line(server: &usbwire_discovery::FoundServer, host: &str) -> String {
    let txt: Vec<String> = server.txt.iter().map(|(k, v)| format!("{}={}", escape(k), escape(v))).collect();
    format!("{} at {host} ({})", escape(&server.name), txt.join(" "))
}

/// One device as `usbip list -p` prints it: `busid=1-1#usbid=046d:c52b#`, a line each.
fn parsable_line(busid: &str, vendor_id: u16, product_id: u16) -> String {
    format!("busid={busid}#usbid={vendor_id:04x}:{product_id:04x}#\n")
}

/// The devices `usbip list -l` shows, in its order: by sysfs path (udev's
/// enumeration order), leaving out hubs (device class 09) and devices attached
/// through vhci-hcd (imported from elsewhere, not this machine's).
fn as_usbip_lists(devices: &[usbwire_host::LocalDevice]) -> Vec<&usbwire_host::LocalDevice> {
    let mut listed: Vec<(String, &usbwire_host::LocalDevice)> = devices
        .iter()
        .filter(|d| d.class != 0x09)
        .map(|d| {
            let link = std::path::Path::new("/sys/bus/usb/devices").join(&d.busid);
            let real = std::fs::canonicalize(&link).unwrap_or(link);
            (real.to_string_lossy().into_owned(), d)
        })
        .filter(|(path, _)| !path.contains("vhci_hcd"))
        .collect();
    listed.sort_by(|a, b| a.0.cmp(&b.0));
    listed.into_iter().map(|(_, d)| d).collect()
}

/// `usbwire list -l`: what is plugged into this machine, like `usbip list -l`
/// plus strings, speed and the driver of each interface; `-p`, byte for byte
/// what `usbip list -p -l` prints.
fn local_devices(json: bool, parsable: bool) -> Result<(), Failure> {
    let devices = usbwire_host::list().map_err(|error| Failure::unavailable(error.into()))?;
    if parsable {
        for d in as_usbip_lists(&devices) {
            out!("{}", parsable_line(&d.busid, d.vendor_id, d.product_id))?;
        }
        return Ok(());
    }
    let names = UsbIds::load();
    if json {
        let devices: Vec<_> = devices.iter().map(|d| local(d, &names)).collect();
        return print_json(&json!({ "devices": devices }), false);
    }
    if devices.is_empty() {
        return outln!("no USB devices on this machine");
    }
    for d in &devices {
        let vendor =
            d.manufacturer.clone().or_else(|| names.vendor(d.vendor_id)).unwrap_or_else(|| "unknown vendor".into());
        let product = d
            .product
            .clone()
            .or_else(|| names.product(d.vendor_id, d.product_id))
            .unwrap_or_else(|| "unknown product".into());
        // A device chooses its own strings (think of a hostile USB stick).
        outln!(" - busid {} ({:04x}:{:04x})", d.busid, d.vendor_id, d.product_id)?;
        out!("   {} : {}, {} speed", escape(&vendor), escape(&product), d.speed.name())?;
        match &d.serial {
            Some(serial) => outln!(", serial {}", escape(serial))?,
            None => outln!()?,
        }
        for i in &d.interfaces {
            let driver = i.driver.as_deref().unwrap_or("(none)");
            outln!(
                "   {}: {:02x}/{:02x}/{:02x} {} - driver {driver}",
                i.number,
                i.class,
                i.subclass,
                i.protocol,
                class_name(i.class)
            )?;
        }
        outln!()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(
        busid: &str,
        state: &str,
        client: Option<&str>,
        identity: Option<&str>,
        since: Option<u64>,
    ) -> DeviceStateEntry {
        DeviceStateEntry {
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
    fn parsable_lines_are_usbips() {
        // usbip's format: "busid=%s#usbid=%.4s:%.4s#" and a newline, the ids as sysfs has them.
        assert_eq!(parsable_line("1-1", 0x046d, 0xc52b), "busid=1-1#usbid=046d:c52b#\n");
        assert_eq!(parsable_line("3-2.10", 0x0a5c, 0x0001), "busid=3-2.10#usbid=0a5c:0001#\n");
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
        let text = format_in_use(&[held], &UsbIds::default());
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
        let text = format_in_use(&states, &UsbIds::default());
        assert!(
            text.contains(
                "2-1: unknown vendor : usbwire disk (1209:0003) in use by sha256:ab at 10.0.0.9:4000 for 5 min"
            ),
            "{text}"
        );
        assert!(!text.contains("1-1"));
    }
}
