//! A refused import says why, through the real binary against a real
//! server and a real etcd: a device in use (by whom) and a device reserved
//! in the lab registry (for whom, until when), in `usbwire describe`,
//! `usbwire list -r -v` and `list -r --json`. The client library's side (the import `attach`
//! makes, a withdrawn device, a stock client's bytes) is
//! crates/client/tests/refusals.rs.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use usbwire_client::Security;
use usbwire_proto::op::BusId;
use usbwire_testing::etcd::Etcd;
use usbwire_testing::process::{free_addr, scratch, start, Running};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn usbwire(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

/// Runs `args` until its stdout contains `needle` (what the server or the
/// registry takes a moment to know); returns that stdout.
fn until_printed(args: &[&str], needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = usbwire(args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if stdout.contains(needle) {
            return stdout;
        }
        assert!(Instant::now() < deadline, "{args:?} never printed {needle:?}: {stdout}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `usbwire describe` of `busid` fails with 69; its stderr.
fn describe_refused(addr: &str, busid: &str) -> String {
    let out = usbwire(&["describe", "-r", addr, "-b", busid]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread")]
async fn describe_and_list_say_who_holds_a_device_and_for_whom_it_is_reserved() {
    let dir = scratch("refusals", "lab");
    let Some(etcd) = Etcd::start(&dir, "refusals") else { return };
    let registry = etcd.url().to_owned();
    let addr = free_addr().to_string();
    let mut command = Command::new(BIN);
    command.args(["serve", "--no-advertise", "--listen", &addr, "--control"]).arg(dir.join("control.sock"));
    command.args(["--virtual", "keyboard", "--virtual", "mouse", "--registry", &registry]);
    let _served: Running = start(command, "usbwire serving on").ready();
    until_printed(&["list", "--registry", &registry], "0-2");

    // In use: held by this test's import.
    let socket = addr.parse().unwrap();
    let busid = BusId::new("0-1").unwrap();
    let held = usbwire_client::import(socket, &busid, &Security::Plain).await.expect("the first import");
    let stderr = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || describe_refused(&addr, "0-1")
    })
    .await
    .unwrap();
    assert!(stderr.contains("server refused 0-1: device busy (exported); in use by 127.0.0.1:"), "{stderr}");
    assert!(stderr.contains("detach it there first"), "{stderr}");

    // Reserved in the lab registry for someone else.
    let mut holder = Command::new(BIN);
    holder.args(["reserve", "--registry", &registry, "--device", "0-2", "--for", "1h"]);
    let holding = start(holder, "reserved 0-2").ready();
    let listed = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || until_printed(&["list", "-r", &addr, "-v"], "Reserved in the lab registry")
    })
    .await
    .unwrap();
    assert!(listed.contains("0-1: ") && listed.contains(" in use by 127.0.0.1:"), "{listed}");
    let reserved = listed.lines().find(|l| l.contains("0-2: ") && l.contains(" reserved for ")).unwrap_or_default();
    assert!(reserved.contains("(usbwire reserve) until 20"), "{listed}");
    let json = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || usbwire(&["list", "-r", &addr, "--json"])
    })
    .await
    .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).expect("list -r --json");
    let devices = json["devices"].as_array().expect("devices");
    let device = |busid: &str| devices.iter().find(|d| d["busid"] == busid).cloned().unwrap_or_default();
    assert!(device("0-1")["reservation"].is_null(), "{json}");
    let reservation = &device("0-2")["reservation"];
    assert_eq!(reservation["client"], "usbwire reserve", "{json}");
    assert!(reservation["holder"].as_str().is_some_and(|h| h.contains('@')), "{json}");
    assert!(reservation["until_at"].as_str().is_some_and(|u| u.starts_with("20")), "{json}");
    // The server's own view (state --json over the control socket) shows the same reservation.
    let control = dir.join("control.sock");
    let state = usbwire(&["state", "--control", control.to_str().unwrap(), "--json"]);
    let state: serde_json::Value = serde_json::from_slice(&state.stdout).expect("state --json");
    let states = state["devices"].as_array().expect("devices");
    let state_of = |busid: &str| states.iter().find(|d| d["busid"] == busid).cloned().unwrap_or_default();
    assert!(state_of("0-1")["reservation"].is_null(), "{state}");
    assert_eq!(state_of("0-2")["reservation"], *reservation, "state --json and list -r --json agree: {state}");
    let stderr = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || describe_refused(&addr, "0-2")
    })
    .await
    .unwrap();
    assert!(
        stderr.contains("server refused 0-2: device busy (exported); reserved in the lab registry for "),
        "{stderr}"
    );
    assert!(stderr.contains("(usbwire reserve) since 20") && stderr.contains(" until 20"), "{stderr}");
    holding.stop();
    drop(held);
}
