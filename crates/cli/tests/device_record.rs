//! One device, one record (docs/json.md): a real `usbwire serve` with a
//! keyboard, a disk and a loopback device, and each device shown by every
//! verb that shows it — `list -r --json`, `describe --json`, `state --json`
//! (the control socket) and the status page's `/status.json` — must carry
//! the same record, field for field; and the name a person reads — the
//! `list -r` table (with and without `-v`), `describe`'s first line and the
//! `state` table — must be one name per device, its own, so that the
//! keyboard, the disk and the loopback device are told apart by what they
//! are (not all "Generic : pid.codes Test PID"), each under its own id.
//!
//! Regression test for issue 32 item 6: `state --json` and `/status.json`
//! had no usb.ids or class names, `describe --json` no `kind` or `state`,
//! and the table named every virtual device after pid.codes' test PIDs.

use std::io::{Read as _, Write as _};
use std::process::{Command, Output};

use serde_json::Value;
use usbwire_device::record::DeviceJson;
use usbwire_testing::process::{free_addr, scratch, start};

use usbwire_testing::stock_client::hold_import;

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

/// The devices served, in bus id order: bus id, kind, product string.
const DEVICES: [(&str, &str, &str); 3] =
    [("0-1", "keyboard", "usbwire keyboard"), ("0-2", "disk", "usbwire disk"), ("0-3", "loopback", "usbwire loopback")];

fn usbwire(args: &[&str]) -> Output {
    let out = Command::new(BIN).args(args).env("RUST_LOG", "off").output().expect("usbwire runs");
    assert!(out.status.success(), "usbwire {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn text_of(args: &[&str]) -> String {
    String::from_utf8(usbwire(args).stdout).expect("UTF-8 output")
}

fn json_of(args: &[&str]) -> Value {
    serde_json::from_slice(&usbwire(args).stdout).unwrap_or_else(|e| panic!("usbwire {args:?} printed no JSON ({e})"))
}

/// `GET path` on the status page, HTTP/1.0 by hand: the body as JSON.
fn http_get(addr: &str, path: &str) -> Value {
    let mut stream = std::net::TcpStream::connect(addr).expect("status page answers");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").expect("request sent");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("response read");
    let body = reply.split_once("\r\n\r\n").map(|(_, body)| body).unwrap_or_default();
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: {e}: {reply}"))
}

/// The device record's own fields (docs/json.md), whichever verb printed it.
/// What a verb adds beside the record is left out by being no record field:
/// `list -r`'s `path`, `busnum`, `devnum` and configuration numbers (the
/// USB/IP listing's), `state`'s and `/status.json`'s `counters` (traffic,
/// which moves between two reads) and `reservation`, `describe`'s descriptor
/// tree.
fn record_of(document: &Value, what: &str) -> Value {
    let Value::Object(fields) = serde_json::to_value(DeviceJson::default()).expect("record serialises") else {
        panic!("the device record is not an object");
    };
    let record = fields
        .keys()
        .map(|field| {
            let value = document.get(field).unwrap_or_else(|| panic!("{what}: no {field} in {document}"));
            (field.clone(), value.clone())
        })
        .collect();
    Value::Object(record)
}

fn device<'a>(document: &'a Value, busid: &str, what: &str) -> &'a Value {
    document["devices"]
        .as_array()
        .and_then(|devices| devices.iter().find(|d| d["busid"] == busid))
        .unwrap_or_else(|| panic!("{what}: no device {busid} in {document}"))
}

/// The name on a device's line of usbip's table: `{busid:>11}: NAME (vvvv:pppp)`.
fn table_name(table: &str, busid: &str, ids: &str) -> String {
    let head = format!("{busid:>11}: ");
    let tail = format!(" ({ids})");
    table
        .lines()
        .find_map(|line| line.strip_prefix(head.as_str())?.strip_suffix(tail.as_str()))
        .unwrap_or_else(|| panic!("no line for {busid} ({ids}) in\n{table}"))
        .to_owned()
}

#[test]
fn every_verb_and_the_status_page_show_a_device_as_the_same_record_and_name() {
    let dir = scratch("device-record", "serve");
    let (addr, http) = (free_addr().to_string(), free_addr().to_string());
    let control = dir.join("control.sock");
    let control = control.to_str().expect("UTF-8 path");
    let disk = format!("disk={},size=1M", dir.join("disk.img").display());
    let mut command = Command::new(BIN);
    command.args(["serve", "--no-advertise", "--listen", &addr, "--http", &http, "--control", control]).args([
        "--virtual",
        "keyboard",
        "--virtual",
        &disk,
        "--virtual",
        "loopback",
    ]);
    let server = start(command, "usbwire serving").ready();

    // Everything read while every device is available (describe imports
    // one and releases it: it comes last).
    let listed = json_of(&["list", "-r", &addr, "--json"]);
    let table = text_of(&["list", "-r", &addr]);
    let verbose = text_of(&["list", "-r", &addr, "-v"]);
    let state = json_of(&["state", "--json", "--control", control]);
    let state_table = text_of(&["state", "--control", control]);
    let status = http_get(&http, "/status.json");

    let mut names = Vec::new();
    let mut ids = Vec::new();
    for (busid, kind, product) in DEVICES {
        let described = json_of(&["describe", "-r", &addr, "-b", busid, "--json"]);
        let described_text = text_of(&["describe", "-r", &addr, "-b", busid]);
        let record = record_of(device(&listed, busid, "list -r --json"), "list -r --json");
        assert_eq!(record["kind"], kind, "list -r --json: {record}");
        assert_eq!(record["state"], "available", "list -r --json: {record}");
        assert_eq!(record["product"], product, "list -r --json: {record}");
        let interface = &record["interfaces"][0];
        assert!(interface["class_name"].is_string(), "list -r --json names the interface's class: {record}");
        for (what, other) in [
            ("describe --json", record_of(&described, "describe --json")),
            ("state --json", record_of(device(&state, busid, "state --json"), "state --json")),
            ("/status.json", record_of(device(&status, busid, "/status.json"), "/status.json")),
        ] {
            assert_eq!(other, record, "{busid}: {what} shows another record than list -r --json");
        }

        // One name, the same on every line a person reads.
        let id =
            format!("{}:{}", record["vendor_id"].as_str().expect("id"), record["product_id"].as_str().expect("id"));
        let name = table_name(&table, busid, &id);
        assert!(name.contains(product), "{busid}: the table names it by its own product string: {name:?}\n{table}");
        assert_eq!(table_name(&verbose, busid, &id), name, "{busid}: list -r -v\n{verbose}");
        let first = described_text.lines().next().unwrap_or_default();
        assert_eq!(first, format!("Device {busid}: ID {id} {name}"), "{busid}: describe's first line");
        let row = state_table
            .lines()
            .find(|line| line.split_whitespace().next() == Some(busid))
            .unwrap_or_else(|| panic!("no row for {busid} in\n{state_table}"));
        assert!(row.ends_with(&name), "{busid}: the state table names it {name:?}: {row:?}");
        names.push(name);
        ids.push(id);
    }

    // A device in use leaves the table (as usbip's does) for `-v`'s "In use", under the same name.
    let held = hold_import(&addr, "0-3");
    let verbose = text_of(&["list", "-r", &addr, "-v"]);
    let in_use = verbose
        .lines()
        .find(|line| line.trim_start().starts_with("0-3: ") && line.contains(" in use by "))
        .unwrap_or_else(|| panic!("0-3 is not shown in use:\n{verbose}"));
    assert!(in_use.starts_with(&format!("{:>11}: {} ({}) in use by ", "0-3", names[2], ids[2])), "{in_use}");
    drop(held);

    let distinct = |items: &[String]| items.iter().collect::<std::collections::BTreeSet<_>>().len();
    assert_eq!(distinct(&names), DEVICES.len(), "each device has a name of its own: {names:?}");
    assert_eq!(distinct(&ids), DEVICES.len(), "each kind has a product id of its own: {ids:?}");
    drop(server);
}
