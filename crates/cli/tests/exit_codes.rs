//! Every row of the exit code table (README, `usbwire(1)` EXIT STATUS),
//! provoked with the real binary; and the `-r HOST:PORT` / `--tcp-port`
//! forms, IPv6 included.

use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use usbwire_testing::etcd::Etcd;
use usbwire_testing::process::{free_addr, scratch, start, Running};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn usbwire(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

/// Asserts the exit code and that stderr says `needle`; returns stderr.
fn exits(out: &Output, code: i32, needle: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    assert!(stderr.contains(needle), "expected {needle:?} in: {stderr}");
    stderr
}

/// `usbwire serve` on `listen` with `extra` flags, its control socket in `dir`.
fn serve(dir: &Path, listen: &str, extra: &[&str]) -> Running {
    let mut command = Command::new(BIN);
    command.args(["serve", "--no-advertise", "--listen", listen, "--control"]).arg(dir.join("control.sock"));
    command.args(extra);
    start(command, "usbwire serving on").ready()
}

#[test]
fn usage_64() {
    exits(&usbwire(&["bogus-verb"]), 64, "bogus-verb");
    // A port out of range is a bad command line, not a host name the resolver does not know.
    exits(&usbwire(&["list", "-r", "127.0.0.1:99999"]), 64, "\"99999\" is not a port (a number from 1 to 65535)");
    exits(&usbwire(&["describe", "-r", "[::1]:x", "-b", "0-1"]), 64, "is not a port");
    // A port given twice, one of which would be ignored.
    let out = usbwire(&["list", "-r", "127.0.0.1:3240", "--tcp-port", "4000"]);
    exits(&out, 64, "it names port 3240 and --tcp-port says 4000: give the port once");
    exits(&usbwire(&["list", "-r", "[::1]:3240", "--tcp-port", "4000"]), 64, "give the port once");
}

#[test]
fn data_65() {
    let dir = scratch("exit_codes", "data");
    let served = serve(&dir, &free_addr().to_string(), &["--virtual", "keyboard"]);
    let control = dir.join("control.sock");
    let control = control.to_str().unwrap();
    // A character with no key, refused whether or not a host has the keyboard.
    exits(&usbwire(&["type", "--control", control, "caf\u{e9}"]), 65, "cannot type 'é'");
    exits(&usbwire(&["unbind", "--control", control, "-b", "9-9"]), 65, "9-9 is not exported by this server");
    // The virtual keyboard is exported, but not bound: unbind says what it is.
    exits(&usbwire(&["unbind", "--control", control, "-b", "0-1"]), 65, "0-1 is this server's virtual keyboard");
    // A --device rule never bound: nothing to forget.
    exits(&usbwire(&["unbind", "--control", control, "--device", "0781:5567"]), 65, "no bind matches 0781:5567");
    drop(served);

    // A peer that does not speak USB/IP.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let peer = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        let mut request = [0u8; 8];
        socket.read_exact(&mut request).unwrap();
        let _ = socket.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
    });
    exits(&usbwire(&["list", "-r", &addr]), 65, "protocol error");
    peer.join().unwrap();
}

#[test]
fn unavailable_69() {
    let closed = free_addr().to_string();
    exits(&usbwire(&["list", "-r", &closed]), 69, "cannot connect");
    let dir = scratch("exit_codes", "unavailable");
    let served = serve(&dir, &free_addr().to_string(), &["--virtual", "keyboard"]);
    let control = dir.join("control.sock");
    exits(&usbwire(&["type", "--control", control.to_str().unwrap(), "hi"]), 69, "not attached by any host");
    // The virtual keyboard's bus id as a --device rule: it is exported already, and not a real device.
    let out = usbwire(&["bind", "--control", control.to_str().unwrap(), "--device", "0-1"]);
    exits(&out, 69, "0-1 is already exported: it is this server's virtual keyboard");
    drop(served);
    exits(&usbwire(&["state", "--control", control.to_str().unwrap()]), 69, "is `usbwire serve` running");
}

/// An internal failure is a bug, which a working server does not have: a
/// scripted control socket answers as a server whose request handler failed.
#[test]
fn internal_70() {
    let dir = scratch("exit_codes", "internal");
    let path = dir.join("control.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let server = std::thread::spawn(move || {
        let (mut socket, _) = listener.accept().unwrap();
        let mut request = Vec::new();
        let mut byte = [0u8; 1];
        while socket.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
            request.push(byte[0]);
        }
        let answer = r#"{"ok":false,"error":"request failed: task panicked","error_kind":"internal"}"#;
        socket.write_all(format!("{answer}\n").as_bytes()).unwrap();
        String::from_utf8(request).unwrap()
    });
    exits(&usbwire(&["state", "--control", path.to_str().unwrap()]), 70, "request failed: task panicked");
    assert!(server.join().unwrap().contains("state"));
}

#[test]
fn os_error_71() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = scratch("exit_codes", "os");
    let control = dir.join("control.sock");
    let out = usbwire(&["serve", "--listen", &addr, "--control", control.to_str().unwrap(), "--virtual", "keyboard"]);
    exits(&out, 71, &format!("cannot listen on {addr}"));
    let demo_dir = dir.join("demo");
    let out = Command::new(BIN)
        .args(["demo", "--listen", &addr, "--dir"])
        .arg(&demo_dir)
        .arg("--control")
        .arg(dir.join("demo.sock"))
        .stdout(Stdio::null())
        .output()
        .unwrap();
    exits(&out, 71, "is taken");
    // vhci-hcd not loaded (checked before the server is asked): only where it is not.
    if !Path::new("/sys/devices/platform/vhci_hcd.0").exists() {
        exits(&usbwire(&["attach", "-r", "127.0.0.1", "-b", "0-1"]), 71, "vhci-hcd is not loaded");
    }
}

#[test]
fn cannot_create_73() {
    let out = usbwire(&["serve", "--listen", "127.0.0.1:0", "--control", "/proc/usbwire-none/control.sock"]);
    exits(&out, 73, "cannot use directory /proc/usbwire-none");
}

#[test]
fn io_74() {
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = Command::new(BIN).arg("man").stdout(full).output().unwrap();
    exits(&out, 74, "No space left on device");
}

#[test]
fn permission_77() {
    let dir = scratch("exit_codes", "permission");
    let out = usbwire(&["identity", "--create", "--dir", dir.join("admitted").to_str().unwrap(), "--json"]);
    let admitted: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let server_identity = dir.join("server");
    let served = serve(
        &dir,
        &free_addr().to_string(),
        &[
            "--virtual",
            "keyboard",
            "--tls",
            "--identity",
            server_identity.to_str().unwrap(),
            "--allow",
            admitted["fingerprint"].as_str().unwrap(),
        ],
    );
    let addr = served.line().trim_start_matches("usbwire serving on ").to_owned();
    let stranger = dir.join("stranger");
    let out = usbwire(&["list", "-r", &addr, "--tls", "--trust-new", "--identity", stranger.to_str().unwrap()]);
    exits(&out, 77, "does not admit this client");
}

#[test]
fn config_78() {
    let dir = scratch("exit_codes", "config");
    let missing = dir.join("missing.img");
    let out = usbwire(&["serve", "--listen", "127.0.0.1:0", "--virtual", &format!("disk={}", missing.display())]);
    exits(&out, 78, "missing.img");
}

/// `list -r ::1 --tcp-port N` dialled 3240: `--tcp-port` was dropped for any host with a colon.
#[test]
fn the_tcp_port_applies_to_ipv6_hosts() {
    let dir = scratch("exit_codes", "ipv6");
    let Ok(probe) = TcpListener::bind("[::1]:0") else {
        eprintln!("the_tcp_port_applies_to_ipv6_hosts: skipped, no IPv6 loopback");
        return;
    };
    let port = probe.local_addr().unwrap().port();
    drop(probe);
    let _served = serve(&dir, &format!("[::1]:{port}"), &["--virtual", "keyboard"]);
    let port = port.to_string();
    let bracketed = format!("[::1]:{port}");
    for args in [
        vec!["list", "-r", "::1", "--tcp-port", &port],
        vec!["list", "-r", "[::1]", "--tcp-port", &port],
        vec!["list", "-r", &bracketed, "--json"],
    ] {
        let out = usbwire(&args);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("0-1"), "{args:?}");
    }
}

/// Polls `list --registry` until the fleet has `devices` devices.
fn registered(registry: &str, devices: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let out = usbwire(&["list", "--registry", registry, "--json"]);
        let fleet: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if fleet["devices"].as_array().is_some_and(|d| d.len() == devices) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "not registered: {fleet}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// 75 (every matching device taken), and the two ways `release` finds
/// nothing of its own: nothing reserved that matches (65), or only others'
/// reservations (77).
#[test]
fn temporary_75_and_releasing_what_is_not_there_or_not_yours() {
    let dir = scratch("exit_codes", "lab");
    let Some(etcd) = Etcd::start(&dir, "exit-codes") else { return };
    let registry = etcd.url().to_owned();
    let _served = serve(&dir, &free_addr().to_string(), &["--virtual", "keyboard", "--registry", &registry]);
    registered(&registry, 1);
    let mut holder = Command::new(BIN);
    holder.args(["reserve", "--registry", &registry, "--device", "0-1"]);
    let holding = start(holder, "reserved 0-1").ready();
    exits(&usbwire(&["reserve", "--registry", &registry, "--device", "0-1"]), 75, "");
    exits(&usbwire(&["release", "--registry", &registry, "--device", "1209:ffff"]), 65, "no reserved device matches");
    exits(&usbwire(&["release", "--registry", &registry, "--device", "0-1"]), 77, "is yours");
    holding.stop();
}
