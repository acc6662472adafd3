//! A golden file per `--json` document (docs/json.md), from the real binary
//! against a real server (and a real etcd for the lab's documents): `list
//! -r`, `state`, `describe`, `/status.json`, `reserve`, `who`, `list
//! --registry`. Addresses, times, counters' numbers and usb.ids names (which
//! depend on the machine) are normalised; everything else must match byte for byte, so
//! a field that changes its name, format or meaning changes a file here.
//! `USBWIRE_BLESS=1 cargo test -p usbwire-cli --test json_golden` rewrites the
//! files after an intended change (review the diff).
//!
//! Every device in every document must also carry every field of the device
//! record, whatever its state (`list -l` and `port` too, on machines that
//! have devices and vhci-hcd).

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;
use usbwire_device::record::{DeviceJson, JSON_SCHEMA_VERSION};
use usbwire_testing::etcd::Etcd;
use usbwire_testing::process::{free_addr, scratch, start, Running};

use usbwire_testing::stock_client::hold_import;

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn usbwire(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("usbwire runs")
}

fn json_of(args: &[&str]) -> Value {
    let out = usbwire(args);
    assert!(out.status.success(), "usbwire {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("usbwire {args:?} printed no JSON ({e})"))
}

/// The fields every device record has (docs/json.md).
fn record_fields() -> Vec<String> {
    let Value::Object(fields) = serde_json::to_value(DeviceJson::default()).expect("record serialises") else {
        panic!("the device record is not an object");
    };
    fields.keys().cloned().collect()
}

/// Each device of `devices` has every field of the record.
fn assert_records(what: &str, devices: &Value) {
    let devices = devices.as_array().unwrap_or_else(|| panic!("{what}: no device list"));
    for device in devices {
        for field in record_fields() {
            assert!(device.get(&field).is_some(), "{what}: {field} missing from {device}");
        }
    }
}

/// Addresses, times, counters, versions and usb.ids names made the same on every run and machine.
fn normalise(value: &mut Value, dir: &Path) {
    match value {
        Value::Object(fields) => {
            for (key, field) in fields.iter_mut() {
                match key.as_str() {
                    "since" | "resuming_since" | "time_ms" | "revision" | "pid" if field.is_number() => {
                        *field = Value::from(0)
                    }
                    "counters" => skeleton(field),
                    "version" | "lease" if field.is_string() => *field = Value::from(format!("<{key}>")),
                    "vendor_name" | "product_name" => *field = Value::from("<usb.ids>"),
                    _ => normalise(field, dir),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|item| normalise(item, dir)),
        Value::String(text) => *text = normalise_text(text, dir),
        _ => {}
    }
}

/// Traffic counters vary with timing: their fields stay, every number is 0
/// and every list keeps its first entry.
fn skeleton(value: &mut Value) {
    match value {
        Value::Number(_) => *value = Value::from(0),
        Value::Array(items) => {
            items.truncate(1);
            items.iter_mut().for_each(skeleton);
        }
        Value::Object(fields) => fields.values_mut().for_each(skeleton),
        _ => {}
    }
}

fn normalise_text(text: &str, dir: &Path) -> String {
    let mut text = text.replace(&dir.display().to_string(), "<dir>");
    // RFC 3339 to the second: 2026-11-26T10:00:00Z.
    if text.len() == 20 && text.as_bytes()[10] == b'T' && text.ends_with('Z') {
        return "<time>".into();
    }
    // Loopback ports: 127.0.0.1:40123 → 127.0.0.1:<port>.
    let mut out = String::new();
    while let Some(at) = text.find("127.0.0.1:") {
        let (before, rest) = text.split_at(at + "127.0.0.1:".len());
        out.push_str(before);
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        out.push_str(if digits > 0 { "<port>" } else { "" });
        text = rest[digits..].to_owned();
    }
    out.push_str(&text);
    // The `user@host` a reservation names.
    if out.contains('@') && !out.contains(':') && !out.contains(' ') {
        return "<user>@<host>".into();
    }
    out
}

/// Compares `document` (normalised) with `golden/NAME.json`, or writes it with `USBWIRE_BLESS=1`.
fn golden(name: &str, mut document: Value, dir: &Path) {
    assert_eq!(document["schema_version"], JSON_SCHEMA_VERSION, "{name}: {document}");
    normalise(&mut document, dir);
    let text = serde_json::to_string_pretty(&document).expect("JSON") + "\n";
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(format!("{name}.json"));
    if std::env::var_os("USBWIRE_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().expect("golden dir")).expect("golden dir");
        std::fs::write(&path, &text).expect("golden file written");
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (USBWIRE_BLESS=1 writes it)", path.display()));
    assert!(
        text == expected,
        "{name}: the document no longer matches {}; if the change is meant, bump schema_version where a \
         field changed meaning, update docs/json.md and rerun with USBWIRE_BLESS=1.\n--- now ---\n{text}",
        path.display()
    );
}

/// A server with a keyboard and a loopback device, its status page on.
fn serve(dir: &Path, extra: &[&str]) -> (Running, String, String) {
    let (addr, http) = (free_addr().to_string(), free_addr().to_string());
    let mut command = Command::new(BIN);
    command
        .args(["serve", "--no-advertise", "--listen", &addr, "--http", &http, "--control"])
        .arg(dir.join("control.sock"))
        .args(["--virtual", "keyboard", "--virtual", "loopback"])
        .args(extra);
    (start(command, "usbwire serving").ready(), addr, http)
}

fn http_get(addr: &str, path: &str) -> Value {
    let mut stream = std::net::TcpStream::connect(addr).expect("status page answers");
    write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").expect("request");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("response");
    let body = reply.split_once("\r\n\r\n").map(|(_, body)| body).unwrap_or_default();
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: {e}: {reply}"))
}

#[test]
fn list_state_describe_and_status_documents_match_their_golden_files() {
    let dir = scratch("golden", "server");
    let (server, addr, http) = serve(&dir, &[]);
    let control = dir.join("control.sock");
    let control = control.to_str().expect("path");
    // A device described is imported and released: do it before another is held.
    let described = json_of(&["describe", "-r", &addr, "-b", "0-1", "--json"]);
    assert_eq!((described["busid"].as_str(), described["speed"].as_str()), (Some("0-1"), Some("high")));
    golden("describe", described, &dir);

    let held = hold_import(&addr, "0-2");
    let listed = json_of(&["list", "-r", &addr, "--json"]);
    let state = json_of(&["state", "--json", "--control", control]);
    let status = http_get(&http, "/status.json");
    for (what, document) in [("list -r", &listed), ("state", &state), ("/status.json", &status)] {
        assert_records(what, &document["devices"]);
        let devices = document["devices"].as_array().expect("devices");
        let states: Vec<&str> = devices.iter().filter_map(|d| d["state"].as_str()).collect();
        assert_eq!(states, ["available", "in_use"], "{what}: the device in use is listed with the others");
        assert!(devices[1]["holder"].as_str().is_some_and(|h| h.starts_with("127.0.0.1:")), "{what}");
        assert_eq!(devices[0]["product"], "usbwire keyboard", "{what}: the device's own string");
        assert_eq!(devices[0]["bcd_device"], devices[1]["bcd_device"], "{what}: one format");
    }
    assert_eq!(listed["devices"][0]["bcd_device"], state["devices"][0]["bcd_device"]);
    golden("list_r", listed, &dir);
    golden("state", state, &dir);
    golden("status", status, &dir);
    drop(held);
    drop(server);
}

#[test]
fn local_devices_and_ports_are_device_records() {
    let local = json_of(&["list", "-l", "--json"]);
    assert_eq!(local["schema_version"], JSON_SCHEMA_VERSION);
    assert_records("list -l", &local["devices"]);
    // Without vhci-hcd there are no ports to show (and `port` says why).
    let out = usbwire(&["port", "--json"]);
    if out.status.success() {
        let ports: Value = serde_json::from_slice(&out.stdout).expect("port --json");
        assert_eq!(ports["schema_version"], JSON_SCHEMA_VERSION);
        assert_records("port", &ports["ports"]);
    } else {
        eprintln!("port --json not checked here: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// Retries `args` until its JSON satisfies `done` (the registry catches up), for at most 20 s.
fn json_when(args: &[&str], done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = usbwire(args);
        if let Ok(value) = serde_json::from_slice::<Value>(&out.stdout) {
            if out.status.success() && done(&value) {
                return value;
            }
        }
        assert!(Instant::now() < deadline, "usbwire {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `list --registry URL [--device SEL] --json-lines`: the header, each server before its devices,
/// the counts last (those two with the document's `schema_version`), and every server and device
/// the `--json` document's record with `what` beside it.
fn json_lines_match_the_document(registry: &str, fleet: &Value) {
    let mut args = vec!["list", "--registry"];
    args.extend(registry.split(' '));
    args.push("--json-lines");
    let out = usbwire(&args);
    assert!(out.status.success(), "usbwire {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{args:?}: {line:?} is not JSON ({e})")))
        .collect();
    let what: Vec<&str> = lines.iter().map(|line| line["what"].as_str().unwrap_or("?")).collect();
    let filtered = registry.contains("--device");
    let expected: &[&str] = if filtered {
        &["fleet", "server", "device", "listed"]
    } else {
        &["fleet", "server", "device", "device", "listed"]
    };
    assert_eq!(what, expected, "{args:?}");
    let last = &lines[lines.len() - 1];
    assert_eq!(
        (&lines[0]["schema_version"], &last["schema_version"]),
        (&fleet["schema_version"], &fleet["schema_version"])
    );
    let record = |line: &Value| {
        let mut line = line.clone();
        if let Some(fields) = line.as_object_mut() {
            fields.remove("what");
        }
        line
    };
    assert_eq!(record(&lines[1]), fleet["servers"][0], "{args:?}");
    assert_eq!(record(&lines[2]), fleet["devices"][0], "{args:?}");
    let devices = if filtered { 1 } else { 2 };
    assert_eq!((last["servers"].as_u64(), last["devices"].as_u64()), (Some(1), Some(devices)), "{args:?}");
    assert_eq!(lines[0]["revision"], last["revision"], "{args:?}: one revision");
    assert!(last["revision"].as_i64() >= fleet["revision"].as_i64(), "{args:?}");
}

#[test]
fn lab_registry_documents_match_their_golden_files() {
    let dir = scratch("golden", "lab");
    let Some(etcd) = Etcd::start(&dir, "golden") else { return };
    let url = format!("{}/golden", etcd.url());
    let (_server, _addr, _http) = serve(&dir, &["--registry", &url]);
    let fleet = json_when(&["list", "--registry", &url, "--json"], |fleet| {
        fleet["devices"].as_array().is_some_and(|devices| devices.len() == 2)
    });
    assert_records("list --registry", &fleet["devices"]);
    json_lines_match_the_document(&url, &fleet);
    json_lines_match_the_document(&format!("{url} --device 1209:0001"), &fleet);
    golden("list_registry", fleet, &dir);
    let reserved = json_of(&["reserve", "--registry", &url, "--device", "1209:0001", "--for", "1m", "--json"]);
    assert_records("reserve", &Value::Array(vec![reserved["device"].clone()]));
    golden("reserve", reserved, &dir);
    // Taken: the refusal names the command that shows who holds it, with this registry's
    // URL (here the default registry, from USBWIRE_REGISTRY), not a placeholder.
    let again = Command::new(BIN)
        .args(["reserve", "--device", "1209:0001", "--for", "1m"])
        .env("USBWIRE_REGISTRY", &url)
        .output()
        .expect("usbwire runs");
    assert_eq!(again.status.code(), Some(75), "{}", String::from_utf8_lossy(&again.stderr));
    let said = String::from_utf8_lossy(&again.stderr);
    assert!(said.contains(&format!("`usbwire who --registry {url}`")), "{said}");
    let who = json_of(&["who", "--registry", &url, "--json"]);
    assert_records("who", &who["reservations"]);
    golden("who", who, &dir);
    let out = usbwire(&["release", "--registry", &url, "--device", "1209:0001"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
