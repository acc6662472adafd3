//! `usbwire list -r` against a hostile server (plain TCP on loopback, written
//! here): the strings it sends — the device `path` of `OP_REP_DEVLIST`, the
//! product, bus id and holder of `OP_REP_DEVSTATE` — carry terminal escapes
//! (clear screen, set window title, a C1 CSI, a bidi override). What the
//! real binary prints must hold none of them, and show them as visible
//! escapes; `--json` must hold none either and still decode to exactly what
//! the server sent.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::BytesMut;
use usbwire_proto::display::needs_escape;
use usbwire_proto::op::{self, BusId, DeviceRecord, OpRequest};
use usbwire_proto::{Limits, Speed};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

const PATH: &str = "/sys/devices/evil\x1b[2J\x1b]0;owned\x07\u{9b}31m\u{202e}";
const PRODUCT: &str = "Totally a keyboard\x1b[2J\r\n";
const HOLDER: &str = "sha256:\x1b]52;c;cm0gLXJmIH4=\x07";
const CLIENT: &str = "10.0.0.9:4000\u{9b}8m\x7f";

/// A server that answers every connection's DEVLIST or DEVSTATE with hostile
/// strings, until dropped.
struct HostileServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl HostileServer {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((socket, _)) => answer(socket),
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Self { addr, stop, thread: Some(thread) }
    }
}

impl Drop for HostileServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn record() -> DeviceRecord {
    DeviceRecord {
        path: PATH.into(),
        busid: BusId::new("1-1").unwrap(),
        busnum: 1,
        devnum: 2,
        speed: Speed::HIGH,
        id_vendor: 0x1209,
        id_product: 0x0001,
        bcd_device: 0x0100,
        b_device_class: 0,
        b_device_sub_class: 0,
        b_device_protocol: 0,
        b_configuration_value: 1,
        b_num_configurations: 1,
        interfaces: Vec::new(),
        b_num_interfaces: 0,
    }
}

fn devstate_body() -> Vec<u8> {
    let device = serde_json::json!({
        "busid": "2-1\x1b[H",
        "vendor_id": "1209",
        "product_id": "0001\u{202e}",
        "product": PRODUCT,
        "state": "in_use",
        "client": CLIENT,
        "identity": HOLDER,
        "since": 0,
    });
    serde_json::to_vec(&serde_json::json!({ "devices": [device] })).unwrap()
}

fn answer(mut socket: TcpStream) {
    socket.set_nonblocking(false).unwrap();
    socket.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut header = [0u8; 8];
    if socket.read_exact(&mut header).is_err() {
        return;
    }
    let mut request = BytesMut::from(&header[..]);
    let mut reply = BytesMut::new();
    match op::decode_request(&mut request, &Limits::default()) {
        Ok(Some(OpRequest::DevList)) => op::encode_devlist_reply(&[record()], &mut reply),
        Ok(Some(OpRequest::DevState)) => op::encode_devstate_reply(&devstate_body(), &mut reply),
        other => panic!("the client asked for something unexpected: {other:?}"),
    }
    socket.write_all(&reply).unwrap();
    // Let the client read it all and hang up first.
    let _ = socket.read(&mut header);
}

fn list(server: &HostileServer, extra: &[&str]) -> Output {
    let output = Command::new(BIN)
        .args(["list", "-r", &server.addr.to_string()])
        .args(extra)
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "usbwire list failed: {}\n{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    output
}

fn assert_terminal_safe(bytes: &[u8], what: &str) {
    let text = std::str::from_utf8(bytes).unwrap_or_else(|e| panic!("{what} is not UTF-8: {e}"));
    assert!(!bytes.contains(&0x1b), "{what} holds a raw ESC:\n{text}");
    let bad: Vec<char> = text.chars().filter(|&c| needs_escape(c) && c != '\n').collect();
    assert!(bad.is_empty(), "{what} holds raw control characters {bad:?}:\n{text}");
}

#[test]
fn list_shows_hostile_server_strings_as_visible_escapes() {
    let server = HostileServer::start();
    // -v: who holds what is shown only with it (without, the listing is usbip's).
    let output = list(&server, &["-v"]);
    assert_terminal_safe(&output.stdout, "list output");
    assert_terminal_safe(&output.stderr, "list errors");
    let text = String::from_utf8(output.stdout).unwrap();
    // Each string is there, escaped, on its own line (no raw \r or \n split it).
    assert!(text.contains(r"/sys/devices/evil\x1b[2J\x1b]0;owned\x07\u{9b}31m\u{202e}"), "{text}");
    let in_use = text.lines().find(|l| l.contains("in use by")).unwrap_or_else(|| panic!("no in-use line:\n{text}"));
    assert!(
        in_use.contains(r"2-1\x1b[H: unknown vendor : Totally a keyboard\x1b[2J\r\n (1209:0001\u{202e})"),
        "{in_use}"
    );
    assert!(in_use.contains(r"in use by sha256:\x1b]52;c;cm0gLXJmIH4=\x07 at 10.0.0.9:4000\u{9b}8m\x7f"), "{in_use}");
}

#[test]
fn list_json_holds_no_raw_controls_and_decodes_to_what_the_server_sent() {
    let server = HostileServer::start();
    let output = list(&server, &["--json"]);
    assert_terminal_safe(&output.stdout, "list --json output");
    let listing: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(listing["devices"][0]["path"], PATH);
    // The device in use is listed among the devices, with its holder (docs/json.md).
    let devices = listing["devices"].as_array().unwrap();
    let holder = devices.iter().find(|d| d["state"] == "in_use").unwrap_or_else(|| panic!("{listing}"));
    assert_eq!(holder["product"], PRODUCT);
    assert_eq!(holder["identity"], HOLDER);
    assert_eq!(holder["client"], CLIENT);
    assert_eq!(holder["holder"], HOLDER);
}
