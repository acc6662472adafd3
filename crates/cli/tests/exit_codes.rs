//! The `-r HOST:PORT` / `--tcp-port` forms, IPv6 included: what they reach,
//! and the command lines they refuse (64). Every row of the exit code table
//! is `exit_table.rs`'s.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output};

use usbwire_testing::process::{scratch, start, Running};

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
fn a_bad_host_port_is_a_usage_error() {
    // A port out of range is a bad command line, not a host name the resolver does not know.
    exits(&usbwire(&["list", "-r", "127.0.0.1:99999"]), 64, "\"99999\" is not a port (a number from 1 to 65535)");
    exits(&usbwire(&["describe", "-r", "[::1]:x", "-b", "0-1"]), 64, "is not a port");
    // A port given twice, one of which would be ignored.
    let out = usbwire(&["list", "-r", "127.0.0.1:3240", "--tcp-port", "4000"]);
    exits(&out, 64, "it names port 3240 and --tcp-port says 4000: give the port once");
    exits(&usbwire(&["list", "-r", "[::1]:3240", "--tcp-port", "4000"]), 64, "give the port once");
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
