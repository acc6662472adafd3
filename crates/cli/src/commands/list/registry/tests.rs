use usbwire_device::record::DeviceJson;
use usbwire_lab::entry::ReservationView;
use usbwire_lab::{DeviceEntry, SCHEMA_VERSION};

use serde_json::json;

use super::*;

fn server(address: &str, fingerprint: Option<&str>) -> ServerEntry {
    ServerEntry {
        schema_version: SCHEMA_VERSION,
        address: address.into(),
        tls_fingerprint: fingerprint.map(Into::into),
        plain: fingerprint.is_none(),
        implementation: "usbwire".into(),
        version: "0.1.0".into(),
        started_at: "2026-11-18T11:06:40Z".into(),
        catalog: false,
        catalog_terms: Vec::new(),
    }
}

fn device(server: &str, busid: &str, product: &str, reserved: bool) -> FleetDevice {
    FleetDevice {
        device: DeviceEntry {
            schema_version: SCHEMA_VERSION,
            server: server.into(),
            record: DeviceJson {
                busid: busid.into(),
                vendor_id: "0483".into(),
                product_id: "374b".into(),
                product: Some(product.into()),
                speed: "full".into(),
                state: Some("available".into()),
                ..DeviceJson::default()
            },
            class: "ef".into(),
            interface_classes: vec!["02".into(), "0a".into()],
            labels: vec!["nucleo".into(), "bench-3".into()],
        },
        reservation: reserved.then(|| ReservationView {
            holder: "ci@runner".into(),
            client: "usbwire reserve".into(),
            pid: 7,
            since_at: "2026-11-18T11:06:40Z".into(),
            until_at: None,
        }),
    }
}

/// Fleets of no, one and several servers and devices, one of them named to
/// drive a terminal.
fn fleets() -> Vec<Fleet> {
    let key = format!("sha256:{}", "ab".repeat(32));
    let hostile = "disk\x1b[2J\u{9b}2J\u{202e}gpj.exe\n";
    vec![
        Fleet::default(),
        Fleet { revision: 9, servers: vec![server("10.0.0.1:3240", None)], devices: vec![] },
        Fleet {
            revision: 12345,
            servers: vec![server("10.0.0.1:3240", Some(&key)), server("10.0.0.2:3240", None)],
            devices: vec![
                device("10.0.0.1:3240", "1-1", "ST-LINK", false),
                device("10.0.0.1:3240", "1-2", hostile, true),
                device("10.0.0.2:3240", "2-1", "ST-LINK", false),
            ],
        },
    ]
}

/// What `printer` writes for `fleet`, fed as pages would feed it: each
/// server, then its devices.
fn printed(shape: Shape, watch: bool, fleet: &Fleet) -> String {
    let mut printer = Printer::new(shape, watch, "etcd://127.0.0.1:2379/usbwire".into());
    printer.begin(fleet.revision);
    for server in &fleet.servers {
        printer.server(server);
        fleet.devices.iter().filter(|d| d.device.server == server.address).for_each(|d| printer.device(d));
    }
    printer.end();
    printer.text
}

/// The `--json` document, written as the pages come, is byte for byte the
/// document built whole (`print_json` of the `Fleet`), indented and on one line.
#[test]
fn the_document_written_as_pages_come_is_the_document_built_whole() {
    for fleet in fleets() {
        for (watch, pretty) in [(false, true), (true, false)] {
            let whole = json_text(&fleet, pretty) + "\n";
            assert_eq!(printed(Shape::Document, watch, &fleet), whole);
        }
    }
}

#[test]
fn json_lines_say_what_each_object_is_with_each_server_before_its_devices() {
    let fleet = fleets().remove(2);
    let text = printed(Shape::Lines, false, &fleet);
    let lines: Vec<Value> = text.lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    let what: Vec<&str> = lines.iter().map(|line| line["what"].as_str().unwrap()).collect();
    assert_eq!(what, ["fleet", "server", "device", "device", "server", "device", "listed"]);
    // The document's version first and last; each record keeps its own, as in the document.
    assert_eq!(
        (&lines[0]["schema_version"], &lines[6]["schema_version"]),
        (&json!(JSON_SCHEMA_VERSION), &json!(JSON_SCHEMA_VERSION))
    );
    assert!(lines[1..6].iter().all(|line| line["schema_version"] == SCHEMA_VERSION));
    assert_eq!(lines[0]["revision"], 12345);
    assert_eq!(lines[6]["revision"], 12345);
    assert_eq!(
        (lines[6]["servers"].as_u64(), lines[6]["devices"].as_u64(), lines[6]["free"].as_u64()),
        (Some(2), Some(3), Some(2))
    );
    // Each object is the document's record, with `what` beside its fields.
    let document: Value = serde_json::from_str(&json_text(&fleet, false)).unwrap();
    for (line, record) in [(&lines[1], &document["servers"][0]), (&lines[3], &document["devices"][1])] {
        let mut line = line.clone();
        let fields = line.as_object_mut().unwrap();
        fields.remove("what");
        assert_eq!(&line, record);
    }
    assert!(!text.contains('\x1b') && !text.contains('\u{9b}') && !text.contains('\u{202e}'), "{text}");
}

#[test]
fn the_table_prints_each_server_before_its_devices_and_the_counts_last() {
    let text = printed(Shape::Table, false, &fleets().remove(2));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    assert!(lines[0].starts_with("10.0.0.1:3240  usbwire 0.1.0 (TLS only, sha256:abab"), "{text}");
    assert!(lines[1].starts_with("    1-1    0483:374b  ST-LINK"), "{text}");
    assert!(lines[2].contains(r"disk\x1b[2J") && lines[2].contains("reserved by ci@runner"), "{text}");
    assert!(lines[3].starts_with("10.0.0.2:3240  usbwire 0.1.0 (plain)"), "{text}");
    assert_eq!(lines[5], "lab registry etcd://127.0.0.1:2379/usbwire: 2 server(s), 3 device(s), 2 free");
}

/// A filtered list, read whole, prints each server with its devices under
/// it, as the fleet read a page at a time does, whatever order the
/// servers come in; its document is the fleet's.
#[test]
fn a_fleet_read_whole_prints_each_server_with_its_devices() {
    let mut fleets = fleets();
    let mut reordered = fleets[2].clone();
    reordered.servers.reverse();
    fleets.push(reordered);
    for fleet in &fleets {
        let mut table = Printer::new(Shape::Table, false, "etcd://127.0.0.1:2379/usbwire".into());
        table.write_fleet(fleet);
        assert_eq!(table.text, printed(Shape::Table, false, fleet));
        let mut document = Printer::new(Shape::Document, false, "etcd://127.0.0.1:2379/usbwire".into());
        document.write_fleet(fleet);
        assert_eq!(document.text, json_text(fleet, true) + "\n");
    }
}
