//! The real `usbwire serve --metrics`: the counters move by exactly what a
//! client transferred, `state --json` says the same, and the endpoint answers
//! only `/metrics`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use usbwire_client::{Connection, Security, Transfer};
use usbwire_gadgets::loopback::{SINK_OUT, SOURCE_IN};
use usbwire_proto::op::BusId;
use usbwire_proto::Status;

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Served {
    child: Child,
    addr: SocketAddr,
    metrics: SocketAddr,
    control: PathBuf,
    /// Holds the control socket and config; removed after the server is killed.
    _dir: usbwire_testing::process::Scratch,
}

impl Served {
    fn start(name: &str) -> Self {
        Self::start_with(name, "")
    }

    /// With `config` as the server's configuration file.
    fn start_with(name: &str, config: &str) -> Self {
        let dir = usbwire_testing::process::scratch("cli-metrics", name);
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let control = dir.join("control.sock");
        let config_path = dir.join("server.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut child = Command::new(BIN)
            .args(["serve", "--no-advertise", "--virtual", "loopback", "--listen", &addr.to_string()])
            .arg("--config")
            .arg(&config_path)
            .args(["--metrics", &metrics.to_string(), "--control"])
            .arg(&control)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut said = Vec::new();
        for line in stdout.lines().map_while(Result::ok) {
            let done = line.contains("metrics on");
            said.push(line);
            if done {
                break;
            }
        }
        assert!(said.iter().any(|l| l.contains(&format!("http://{metrics}/metrics"))), "{said:?}");
        Self { child, addr, metrics, control, _dir: dir }
    }

    fn get(&self, path: &str) -> (String, String) {
        let mut stream = TcpStream::connect(self.metrics).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(stream, "GET {path} HTTP/1.1\r\nHost: {}\r\n\r\n", self.metrics).unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        (head.to_owned(), body.to_owned())
    }

    /// The value of the first sample whose line starts with `series` (a name
    /// and labels as printed, in order; a prefix of them will do).
    fn sample(&self, series: &str) -> u64 {
        let (_, body) = self.get("/metrics");
        let line =
            body.lines().find(|line| line.starts_with(series)).unwrap_or_else(|| panic!("no {series} in\n{body}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn counters_move_by_exactly_what_was_transferred() {
    let served = Served::start("exact");
    let bulk = |direction: &str, what: &str| {
        format!("usbwire_device_{what}_total{{busid=\"0-1\",kind=\"loopback\",direction=\"{direction}\",transfer=\"bulk\"}}")
    };
    assert_eq!(served.sample(&bulk("out", "bytes")), 0);
    assert_eq!(served.sample("usbwire_device_imports_total{busid=\"0-1\",kind=\"loopback\"}"), 0);

    let busid = BusId::new("0-1").unwrap();
    let (connection, _) = Connection::import_resumable(served.addr, &busid, &Security::Plain, &[]).await.unwrap();
    assert_eq!(served.sample("usbwire_device_in_use{busid=\"0-1\",kind=\"loopback\",client=\"127.0.0.1:"), 1);
    // SET_CONFIGURATION 1, as a kernel would: one control OUT, no data.
    connection.transfer_checked(Transfer::control_out([0x00, 0x09, 1, 0, 0, 0, 0, 0], Bytes::new())).await.unwrap();
    for n in 0..10u8 {
        connection.transfer_checked(Transfer::bulk_out(SINK_OUT, Bytes::from(vec![n; 4096]))).await.unwrap();
    }
    for _ in 0..5 {
        let ret = connection.transfer_checked(Transfer::bulk_in(SOURCE_IN, 512)).await.unwrap();
        assert_eq!(ret.actual_length, 512);
    }
    // An endpoint the device does not have: an error status, counted by its errno.
    let refused = connection.transfer(Transfer::bulk_in(0x8e, 64)).await.unwrap();
    assert_eq!(refused.status, Status::EPIPE);
    connection.close().await;

    assert_eq!(served.sample(&bulk("out", "bytes")), 40_960);
    assert_eq!(served.sample(&bulk("out", "urbs")), 10);
    assert_eq!(served.sample(&bulk("in", "bytes")), 5 * 512);
    assert_eq!(served.sample(&bulk("in", "urbs")), 6, "five from the source, one refused");
    let control = "usbwire_device_urbs_total{busid=\"0-1\",kind=\"loopback\",direction=\"out\",transfer=\"control\"}";
    assert_eq!(served.sample(control), 1);
    let errors = "usbwire_device_urb_errors_total{busid=\"0-1\",kind=\"loopback\",status=\"-32\",name=\"EPIPE\"}";
    assert_eq!(served.sample(errors), 1);
    assert_eq!(served.sample("usbwire_device_imports_total{busid=\"0-1\",kind=\"loopback\"}"), 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while served.sample("usbwire_device_in_use{busid=\"0-1\"") != 0 {
        assert!(Instant::now() < deadline, "the device was not released");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(served.sample("usbwire_device_urbs_in_flight{busid=\"0-1\",kind=\"loopback\"}"), 0);
    let budget = "usbwire_device_budget_refusals_total{busid=\"0-1\",kind=\"loopback\",budget=\"in_flight_urbs\"}";
    assert_eq!(served.sample(budget), 0, "one URB at a time never fills a budget");

    // `state --json` carries the same counters.
    let state = Command::new(BIN).args(["state", "--json", "--control"]).arg(&served.control).output().unwrap();
    let state: serde_json::Value = serde_json::from_slice(&state.stdout).unwrap();
    let counters = &state["devices"][0]["counters"];
    let out_bulk = counters["transfers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["direction"] == "out" && t["transfer"] == "bulk")
        .unwrap();
    assert_eq!((out_bulk["urbs"].as_u64(), out_bulk["bytes"].as_u64()), (Some(10), Some(40_960)));
    assert_eq!(counters["imports"], 1);
    assert_eq!(counters["errors"][0]["urbs"], 1);
}

#[test]
fn the_endpoint_serves_metrics_only() {
    let served = Served::start("paths");
    let (head, body) = served.get("/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    assert!(body.contains("# TYPE usbwire_device_bytes_total counter"), "{body}");
    let (head, _) = served.get("/");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    // A request that never ends its headers is cut off, and the server still answers the next.
    let mut endless = TcpStream::connect(served.metrics).unwrap();
    endless.write_all(&vec![b'a'; 16 * 1024]).unwrap_or(());
    let (head, _) = served.get("/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

/// The usbmon ids of the enhanced packet blocks in a pcapng file, in order
/// (the descriptor snapshot's records carry id 0, a URB's its seqnum).
fn usbmon_ids_in(path: &std::path::Path) -> Vec<u64> {
    let bytes = std::fs::read(path).unwrap();
    let mut at = 0;
    let mut ids = Vec::new();
    while at + 12 <= bytes.len() {
        let kind = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
        assert!(len >= 12 && at + len <= bytes.len(), "a cut or malformed block at {at}");
        if kind == 6 {
            assert!(len >= 28 + 64, "an enhanced packet block shorter than a usbmon header at {at}");
            ids.push(u64::from_le_bytes(bytes[at + 28..at + 36].try_into().unwrap()));
        }
        at += len;
    }
    ids
}

#[tokio::test]
async fn usbwire_capture_switches_a_running_import_on_and_off() {
    let served = Served::start("capture");
    let busid = BusId::new("0-1").unwrap();
    let (connection, _) = Connection::import_resumable(served.addr, &busid, &Security::Plain, &[]).await.unwrap();
    connection.transfer_checked(Transfer::control_out([0x00, 0x09, 1, 0, 0, 0, 0, 0], Bytes::new())).await.unwrap();
    let dir = served.control.parent().unwrap().join("capture");
    let started = Command::new(BIN).arg("capture").arg(&dir).arg("--control").arg(&served.control).output().unwrap();
    assert!(started.status.success(), "{}", String::from_utf8_lossy(&started.stderr));
    // The running import starts its file as soon as it hears of the switch.
    let deadline = Instant::now() + Duration::from_secs(10);
    let file = loop {
        let found = std::fs::read_dir(&dir).ok().and_then(|mut d| d.next()).and_then(Result::ok).map(|e| e.path());
        if let Some(file) = found {
            break file;
        }
        assert!(Instant::now() < deadline, "no capture file for the running import");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for n in 0..5u8 {
        connection.transfer_checked(Transfer::bulk_out(SINK_OUT, Bytes::from(vec![n; 512]))).await.unwrap();
    }
    let stopped = Command::new(BIN).args(["capture", "--stop", "--control"]).arg(&served.control).output().unwrap();
    assert!(stopped.status.success(), "{}", String::from_utf8_lossy(&stopped.stderr));
    tokio::time::sleep(Duration::from_millis(500)).await;
    for n in 0..3u8 {
        connection.transfer_checked(Transfer::bulk_out(SINK_OUT, Bytes::from(vec![n; 512]))).await.unwrap();
    }
    connection.close().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let ids = usbmon_ids_in(&file);
    let snapshot = ids.iter().take_while(|id| **id == 0).count();
    assert!(snapshot > 0 && snapshot % 2 == 0, "the file starts with the descriptor snapshot, in pairs: {ids:?}");
    assert_eq!(
        ids.len() - snapshot,
        10,
        "a submit and a completion for each of the 5 URBs made while capturing: {ids:?}"
    );
    assert!(ids[snapshot..].iter().all(|id| *id != 0), "snapshot records after the URBs: {ids:?}");
}

/// Sixteen 512-byte bulk OUT URBs to the sink, all at once.
async fn sixteen_at_once(
    connection: &Connection,
) -> Vec<Result<usbwire_proto::urb::RetSubmit, usbwire_client::TransferError>> {
    let transfers =
        (0..16u8).map(|n| connection.transfer_checked(Transfer::bulk_out(SINK_OUT, Bytes::from(vec![n; 512]))));
    futures_util::future::join_all(transfers).await
}

#[tokio::test]
async fn a_client_outrunning_its_budget_is_counted() {
    let served = Served::start_with("budget", "[limits]\nin_flight_urbs = 2\n");
    let busid = BusId::new("0-1").unwrap();
    // A resumable client hears what the server's table takes and sends no more:
    // sixteen URBs at once never fill it.
    let (connection, _) = Connection::import_resumable(served.addr, &busid, &Security::Plain, &[]).await.unwrap();
    connection.transfer_checked(Transfer::control_out([0x00, 0x09, 1, 0, 0, 0, 0, 0], Bytes::new())).await.unwrap();
    for done in sixteen_at_once(&connection).await {
        done.unwrap();
    }
    connection.close().await;
    let budget = "usbwire_device_budget_refusals_total{busid=\"0-1\",kind=\"loopback\",budget=\"in_flight_urbs\"}";
    assert_eq!(served.sample(budget), 0, "a resumable client filled the server's table");
    // A plain client (as the kernel's) does not know the budget: sixteen URBs at
    // once against two in flight, and the server stops reading until the device
    // completes some, and says so.
    let (stream, device) = usbwire_client::import(served.addr, &busid, &Security::Plain).await.unwrap();
    let connection = Connection::new(stream, &device);
    connection.transfer_checked(Transfer::control_out([0x00, 0x09, 1, 0, 0, 0, 0, 0], Bytes::new())).await.unwrap();
    for done in sixteen_at_once(&connection).await {
        done.unwrap();
    }
    connection.close().await;
    assert!(served.sample(budget) >= 1, "the in-flight URB budget was full at least once");
    assert_eq!(served.sample(&budget.replace("in_flight_urbs", "unacked_reply_bytes")), 0);
    let state = Command::new(BIN).args(["state", "--json", "--control"]).arg(&served.control).output().unwrap();
    let state: serde_json::Value = serde_json::from_slice(&state.stdout).unwrap();
    let refusals = &state["devices"][0]["counters"]["budget_refusals"];
    assert_eq!(refusals[0]["budget"], "in_flight_urbs", "{refusals}");
    assert_eq!(refusals[0]["times"].as_u64(), Some(served.sample(budget)));
}
