//! The real `usbwire` binary: serve, list, state, type, signals and errors.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use usbwire_testing::process::Scratch;

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn scratch(name: &str) -> Scratch {
    usbwire_testing::process::scratch("cli", name)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Served {
    child: Child,
    addr: String,
    control: PathBuf,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(dir: &Path, specs: &[&str]) -> Served {
    serve_with(dir, specs, &[])
}

fn serve_with(dir: &Path, specs: &[&str], extra: &[&str]) -> Served {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let control = dir.join("control.sock");
    let mut command = Command::new(BIN);
    command.args(["serve", "--listen", &addr, "--control"]).arg(&control);
    for spec in specs {
        command.args(["--virtual", spec]);
    }
    command.args(extra);
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    // The server prints its address once it listens.
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.by_ref().map(|l| l.unwrap()).find(|l| l.starts_with("usbwire serving")).expect("server output");
    assert!(first.contains(&addr), "unexpected line: {first}");
    std::thread::spawn(move || for _ in lines {});
    Served { child, addr, control }
}

fn usbwire(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

#[test]
fn list_json_shows_exported_devices() {
    let dir = scratch("list");
    let disk = dir.join("disk.img");
    let served = serve(&dir, &["keyboard", &format!("disk={},size=1M,speed=super", disk.display()), "loopback"]);
    let out = usbwire(&["list", "-r", &served.addr, "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let devices = json["devices"].as_array().unwrap();
    let summary: Vec<(String, String, String)> = devices
        .iter()
        .map(|d| {
            (
                d["busid"].as_str().unwrap().into(),
                d["product_id"].as_str().unwrap().into(),
                d["speed"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("0-1".into(), "0001".into(), "high".into()),
            ("0-2".into(), "0003".into(), "super".into()),
            ("0-3".into(), "0005".into(), "high".into())
        ]
    );
    assert_eq!(devices[1]["interfaces"][0]["class"], "08/06/50");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 1 << 20, "image created with the given size");

    let text = usbwire(&["list", "-r", &served.addr]);
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("1209:0003") && text.contains("(08/06/50)"), "{text}");
    assert!(!text.contains("speed"), "usbip's format, the speed only with -v: {text}");
    let verbose = usbwire(&["list", "-v", "-r", &served.addr]);
    assert!(String::from_utf8_lossy(&verbose.stdout).contains("speed super"));
}

#[test]
fn state_and_type_go_through_the_control_socket() {
    let dir = scratch("state");
    let served = serve(&dir, &["keyboard", "loopback"]);
    let control = served.control.to_str().unwrap();
    let out = usbwire(&["state", "--json", "--control", control]);
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["devices"][0]["state"], "available");
    assert_eq!(json["devices"][1]["kind"], "loopback");

    // No host has the keyboard: a clear error and exit code 69.
    let out = usbwire(&["type", "--control", control, "hello"]);
    assert_eq!(out.status.code(), Some(69));
    let message = String::from_utf8_lossy(&out.stderr);
    assert!(message.contains("not attached"), "{message}");
}

#[test]
fn errors_have_meaningful_exit_codes() {
    let dir = scratch("errors");
    // Nothing listens on this port.
    let port = free_port();
    let out = usbwire(&["list", "-r", &format!("127.0.0.1:{port}")]);
    assert_eq!(out.status.code(), Some(69));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot connect"));
    // Bad spec: usage.
    let out = usbwire(&["serve", "--listen", "127.0.0.1:0", "--virtual", "webcam"]);
    assert_eq!(out.status.code(), Some(64));
    // Missing image without a size: configuration error that says what to do.
    let missing = dir.join("missing.img");
    let out = usbwire(&["serve", "--listen", "127.0.0.1:0", "--virtual", &format!("disk={}", missing.display())]);
    assert_eq!(out.status.code(), Some(78), "{}", String::from_utf8_lossy(&out.stderr));
    // No control socket to talk to.
    let out = usbwire(&["state", "--control", dir.join("nope.sock").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(69));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is `usbwire serve` running"));
}

#[test]
fn sigterm_shuts_down_cleanly() {
    let dir = scratch("sigterm");
    let mut served = serve(&dir, &["loopback"]);
    let pid = served.child.id() as i32;
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(status) = served.child.try_wait().unwrap() {
            assert!(status.success(), "exit status {status}");
            break;
        }
        assert!(Instant::now() < deadline, "server did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!served.control.exists(), "control socket removed on shutdown");
}

#[test]
fn describe_prints_the_descriptor_tree_and_releases_the_device() {
    let dir = scratch("describe");
    let disk = dir.join("disk.img");
    let served = serve(&dir, &[&format!("disk={},size=1M,speed=super", disk.display()), "serial"]);
    let out = usbwire(&["describe", "-r", &served.addr, "-b", "0-1", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(d["bcd_usb"], "3.20");
    assert_eq!(d["product"], "usbwire disk");
    assert_eq!(d["max_packet_size0"], 9);
    let endpoints: Vec<(String, String, u64)> = d["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "endpoint")
        .map(|i| {
            (
                i["address"].as_str().unwrap().into(),
                i["transfer_type"].as_str().unwrap().into(),
                i["max_packet_size"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(endpoints, vec![("0x81".into(), "bulk".into(), 1024), ("0x02".into(), "bulk".into(), 1024)]);
    assert_eq!(d["items"].as_array().unwrap().iter().filter(|i| i["type"] == "super_speed_companion").count(), 2);
    assert_eq!(d["bos"].as_array().unwrap().len(), 2);

    // The text form of the CDC-ACM device shows its class-specific descriptors.
    let out = usbwire(&["describe", "-r", &served.addr, "-b", "0-2"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("Interface Association") && text.contains("CDC Union") && text.contains("bcdCDC"), "{text}");

    // Released: both are listed (importable) again once the server saw the close.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let out = usbwire(&["list", "-r", &served.addr, "--json"]);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        if json["devices"].as_array().unwrap().len() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "devices not released: {json}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn tls_identity_pinning_and_access_end_to_end() {
    let dir = scratch("tls");
    let client_dir = dir.join("client");
    let out = usbwire(&["identity", "--create", "--json", "--dir", client_dir.to_str().unwrap()]);
    assert!(out.status.success());
    let id: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let fingerprint = id["fingerprint"].as_str().unwrap().to_owned();
    assert!(fingerprint.starts_with("sha256:"));
    let served = serve_with(
        &dir,
        &["keyboard", "loopback"],
        &[
            "--tls",
            "--identity",
            dir.join("server").to_str().unwrap(),
            "--allow-plain",
            "never",
            "--allow",
            &fingerprint,
        ],
    );
    let tls = ["--tls", "--identity", client_dir.to_str().unwrap()];
    // Unknown server key: refused with the key to check and what to run.
    let out = usbwire(&[&["list", "-r", &served.addr][..], &tls[..]].concat());
    assert_eq!(out.status.code(), Some(69));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--trust-new"));
    // Trust on first use, then pinned.
    let out = usbwire(&[&["list", "-r", &served.addr, "--json", "--trust-new"][..], &tls[..]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["devices"].as_array().unwrap().len(), 2);
    let out = usbwire(&[&["list", "-r", &served.addr, "--json"][..], &tls[..]].concat());
    assert!(out.status.success());
    // doctor sees that plain USB/IP is refused, and that TLS with this identity works.
    let out = usbwire(&["doctor", "--json", "-r", &served.addr, "--identity", client_dir.to_str().unwrap()]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let doctor_check = |name: &str| report["checks"].as_array().unwrap().iter().find(|c| c["name"] == name).cloned();
    assert_eq!(doctor_check("usbip").unwrap()["verdict"], "warn", "{report}");
    let tls_check = doctor_check("tls").unwrap();
    assert_eq!(tls_check["verdict"], "ok", "{report}");
    assert!(tls_check["detail"].as_str().unwrap().contains(&fingerprint), "{tls_check}");
    // Plain USB/IP (a downgrade) is refused before anything is listed.
    let out = usbwire(&["list", "-r", &served.addr]);
    assert_eq!(out.status.code(), Some(69));
    assert!(String::from_utf8_lossy(&out.stderr).contains("may require TLS"));
    // Another client identity is not admitted, and is told so with the line that would admit it.
    let stranger = dir.join("stranger");
    let out = usbwire(&["list", "-r", &served.addr, "--tls", "--trust-new", "--identity", stranger.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(77));
    let shown = usbwire(&["identity", "--json", "--dir", stranger.to_str().unwrap()]);
    let stranger_fp =
        serde_json::from_slice::<serde_json::Value>(&shown.stdout).unwrap()["fingerprint"].as_str().unwrap().to_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("does not admit this client (identity {stranger_fp})")), "{stderr}");
    assert!(stderr.contains(&format!("usbwire serve --allow {stranger_fp}")), "{stderr}");
    // doctor says the same, with the fix to run on the server.
    let out = usbwire(&["doctor", "--json", "-r", &served.addr, "--identity", stranger.to_str().unwrap()]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let tls_check = report["checks"].as_array().unwrap().iter().find(|c| c["name"] == "tls").unwrap().clone();
    assert_eq!(tls_check["verdict"], "fail", "{report}");
    assert!(tls_check["fix"].as_str().unwrap().contains(&format!("--allow {stranger_fp}")), "{tls_check}");
}

#[test]
fn bench_json_has_a_record_per_point_with_the_ceiling_beside_it() {
    let dir = scratch("bench");
    let csv = dir.join("bench.csv");
    let out = usbwire(&[
        "bench",
        "--sizes",
        "512,64K",
        "--depths",
        "1,4",
        "--seconds",
        "0.05",
        "--rtt-ms",
        "0,4",
        "--json",
        "--csv",
        csv.to_str().unwrap(),
        "--plot",
        dir.join("plots").to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let records = report["records"].as_array().unwrap();
    assert_eq!(records.len(), 2 * 2 * 2 * 2, "rtt x direction x size x depth");
    for r in records {
        for field in ["direction", "urb_size", "depth", "rtt_ms", "mib_per_s", "ratio_to_raw_tcp", "raw_tcp_mib_per_s"]
        {
            assert!(!r[field].is_null(), "missing {field} in {r}");
        }
        assert!(r["mib_per_s"].as_f64().unwrap() > 0.0 && r["raw_tcp_mib_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["latency_us"]["p99"].as_f64().unwrap() >= r["latency_us"]["p50"].as_f64().unwrap());
        assert!(r["raw_tcp_latency_us"]["p50"].as_f64().unwrap() > 0.0);
    }
    // With 4 ms of emulated RTT, a depth-1 round trip takes at least that long.
    let delayed = records.iter().find(|r| r["rtt_ms"] == 4.0 && r["depth"] == 1).unwrap();
    assert!(delayed["latency_us"]["p50"].as_f64().unwrap() >= 4000.0, "{delayed}");
    assert_eq!(report["model"].as_array().unwrap().len(), 4);
    assert_eq!(std::fs::read_to_string(&csv).unwrap().lines().count(), 1 + 16);
    // 2 directions x 2 RTTs of throughput charts, and a latency CDF for each.
    let pngs: Vec<_> = std::fs::read_dir(dir.join("plots")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(pngs.len(), 8, "{pngs:?}");
    for png in pngs {
        assert_eq!(&std::fs::read(&png).unwrap()[1..4], b"PNG");
    }
}

/// Over TLS each rate is put against one core's AES-256-GCM twice, measured in the same
/// run: the record layer's own cipher and `openssl speed` (or why there is no figure).
#[test]
fn bench_over_tls_puts_each_rate_against_the_cipher_and_openssl_speed() {
    let dir = scratch("bench-tls");
    let client_dir = dir.join("client");
    let out = usbwire(&["identity", "--create", "--json", "--dir", client_dir.to_str().unwrap()]);
    let id: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let fingerprint = id["fingerprint"].as_str().unwrap().to_owned();
    let server_dir = dir.join("server");
    let served = serve_with(
        &dir,
        &["loopback"],
        &["--tls", "--identity", server_dir.to_str().unwrap(), "--allow-plain", "never", "--allow", &fingerprint],
    );
    let out = usbwire(&[
        "bench",
        "-r",
        &served.addr,
        "-b",
        "0-1",
        "--tls",
        "--trust-new",
        "--identity",
        client_dir.to_str().unwrap(),
        "--sizes",
        "64K",
        "--depths",
        "2",
        "--seconds",
        "0.05",
        "--repeat",
        "1",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["cipher_one_core"]["mib_per_s"].as_f64().unwrap() > 0.0, "{report}");
    let openssl_installed = Command::new("openssl").arg("version").output().is_ok_and(|o| o.status.success());
    let openssl = &report["openssl_aes_256_gcm"];
    if openssl_installed {
        assert!(openssl["mib_per_s"].as_f64().unwrap() > 0.0, "{report}");
        assert!(openssl["command"].as_str().unwrap().starts_with("openssl speed -evp aes-256-gcm"), "{report}");
    } else {
        assert!(openssl["error"].as_str().unwrap().contains("openssl"), "{report}");
    }
    let records = report["records"].as_array().unwrap();
    assert_eq!(records.len(), 2, "IN and OUT");
    for r in records {
        let rate = r["mib_per_s"].as_f64().unwrap();
        let ratio = r["ratio_to_cipher"].as_f64().unwrap();
        assert!((ratio * report["cipher_one_core"]["mib_per_s"].as_f64().unwrap() - rate).abs() < 1e-6 * rate, "{r}");
        if openssl_installed {
            let ratio = r["ratio_to_openssl"].as_f64().unwrap();
            assert!((ratio * openssl["mib_per_s"].as_f64().unwrap() - rate).abs() < 1e-6 * rate, "{r}");
        } else {
            assert!(r["ratio_to_openssl"].is_null(), "{r}");
        }
    }
    drop(served);
}

#[test]
fn bench_resume_measures_through_the_resuming_relay() {
    let out = usbwire(&["bench", "--resume", "--sizes", "512,64K", "--depths", "1,4", "--seconds", "0.05", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let records = report["records"].as_array().unwrap();
    assert_eq!(records.len(), 2 * 2 * 2, "direction x size x depth");
    assert!(records.iter().all(|r| r["mib_per_s"].as_f64().unwrap() > 0.0), "{report}");
    // Each RTT imports again: the previous import's session ended (or, parked, is taken
    // back by the same client), so a matrix over several RTTs runs through.
    let out = usbwire(&[
        "bench",
        "--resume",
        "--rtt-ms",
        "0,4",
        "--sizes",
        "512",
        "--depths",
        "2",
        "--seconds",
        "0.05",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rtts: Vec<f64> = report["records"].as_array().unwrap().iter().map(|r| r["rtt_ms"].as_f64().unwrap()).collect();
    assert!(rtts.contains(&0.0) && rtts.contains(&4.0), "{report}");
}

#[test]
fn bench_resume_cuts_times_each_stall() {
    let out = usbwire(&["bench", "--resume", "--cuts", "3", "--sizes", "4K", "--depths", "2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let resume = &report["resume"];
    assert_eq!((resume["urb_size"].as_u64(), resume["depth"].as_u64()), (Some(4096), Some(2)), "{report}");
    let times = &resume["times"];
    assert_eq!(times["cuts"], 3, "{report}");
    assert!(times["urbs"].as_u64().unwrap() > 0, "{report}");
    // The stall ends with a completion after the resume, so it is never shorter than the resume.
    for p in ["p50", "p90", "p99", "max"] {
        assert!(times["stall_us"][p].as_f64().unwrap() >= times["resumed_us"][p].as_f64().unwrap(), "{report}");
    }
    // Only the resumable import can be cut and resumed.
    let out = usbwire(&["bench", "--cuts", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("--resume"), "{stderr}");
}

#[test]
fn bench_storage_reports_reads_and_writes_with_the_accelerator_off_and_on() {
    let out = usbwire(&["bench", "--storage", "--rtt-ms", "0", "--seconds", "0.2", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["schema_version"].as_u64().is_some(), "{report}");
    let records = report["storage"].as_array().unwrap();
    assert_eq!(records.len(), 4, "direction x accelerator: {report}");
    for direction in ["in", "out"] {
        for accelerate in [false, true] {
            let record = records
                .iter()
                .find(|r| r["direction"] == direction && r["accelerate"] == accelerate)
                .unwrap_or_else(|| panic!("no {direction} record with accelerate {accelerate}: {report}"));
            assert_eq!(record["rtt_ms"], 0.0, "{report}");
            assert_eq!(record["command_bytes"], 120 * 1024, "{report}");
            assert!(record["commands"].as_u64().unwrap() >= 1, "{report}");
            assert!(record["mib_per_s"].as_f64().unwrap() > 0.0, "{report}");
            // The in-process server agrees to the storage extension.
            assert_eq!(record["accelerated"], accelerate, "{report}");
        }
    }
    // A device without a Bulk-Only interface cannot be measured: said, with "unavailable".
    let dir = scratch("bench-storage");
    let served = serve(&dir, &["loopback"]);
    let out = usbwire(&["bench", "--storage", "-r", &served.addr, "-b", "0-1", "--seconds", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(stderr.contains("Bulk-Only"), "{stderr}");
}

#[test]
fn doctor_checks_the_local_server_and_a_remote_port() {
    let dir = scratch("doctor");
    let served = serve(&dir, &["keyboard", "loopback"]);
    let control = served.control.to_str().unwrap();
    let out = usbwire(&["doctor", "--json", "--control", control, "-r", &served.addr]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let verdict = |name: &str| {
        report["checks"].as_array().unwrap().iter().find(|c| c["name"] == name).map(|c| c["verdict"].clone())
    };
    assert_eq!(verdict("local server"), Some("ok".into()), "{report}");
    assert_eq!(verdict("server port"), Some("ok".into()), "{report}");
    assert_eq!(verdict("usbip"), Some("ok".into()), "{report}");
    let detail = report["checks"].as_array().unwrap().iter().find(|c| c["name"] == "local server").unwrap();
    assert!(detail["detail"].as_str().unwrap().contains("2 devices exported"), "{detail}");

    // Nothing listening: a failed check with what to do, exit code 69.
    let closed = format!("127.0.0.1:{}", free_port());
    let out = usbwire(&["doctor", "--control", control, "-r", &closed]);
    assert_eq!(out.status.code(), Some(69));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("[FAIL] server port") && text.contains("start `usbwire serve`"), "{text}");
}

#[test]
fn a_bad_command_line_exits_64_and_each_error_is_said_once() {
    let out = usbwire(&["bogus-verb"]);
    assert_eq!(out.status.code(), Some(64));
    let out = usbwire(&["list"]);
    assert_eq!(out.status.code(), Some(64));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("--remote") && said.contains("--local") && said.contains("--discover"), "{said}");
    assert_eq!(usbwire(&["--help"]).status.code(), Some(0));
    let version = usbwire(&["-V"]);
    assert_eq!(version.status.code(), Some(0));
    let port = free_port();
    let out = usbwire(&["list", "-r", &format!("127.0.0.1:{port}")]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(said.matches("Connection refused").count(), 1, "{said}");
    // A fleet with no share of keyboards is refused before etcd is asked anything.
    let registry = format!("etcd://127.0.0.1:{port}/lab");
    let out = usbwire(&["bench", "--registry", &registry, "--keyboard-every", "0"]);
    assert_eq!(out.status.code(), Some(64));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("--keyboard-every") && !said.contains("Connection refused"), "{said}");
}

#[test]
fn under_systemd_the_server_says_ready_and_logs_with_priorities_for_the_journal() {
    use std::os::unix::fs::MetadataExt as _;
    use std::os::unix::net::UnixDatagram;
    let dir = scratch("systemd");
    let notify_path = dir.join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let log_path = dir.join("journal.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let meta = log.metadata().unwrap();
    let mut child = Command::new(BIN)
        .args(["serve", "--no-advertise", "--virtual", "keyboard", "--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--control")
        .arg(dir.join("control.sock"))
        .env("NOTIFY_SOCKET", &notify_path)
        .env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()))
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut message = [0u8; 64];
    let got = notify.recv(&mut message);
    let _ = child.kill();
    let _ = child.wait();
    let n = got.expect("READY=1 within 20 s");
    assert_eq!(&message[..n], b"READY=1");
    let logged = std::fs::read_to_string(&log_path).unwrap();
    let first = logged.lines().next().unwrap_or_default();
    assert!(first.starts_with("<6>"), "an info line with its syslog priority: {logged}");
    assert!(!first.contains("Z "), "no timestamp of its own (journald adds one): {first}");
}

#[test]
fn json_output_speaks_one_vocabulary() {
    let dir = scratch("vocabulary");
    let served = serve(&dir, &["keyboard", "loopback"]);
    // Hold the loopback device: OP_REQ_IMPORT by hand (version 0x0111, code 0x8003, status 0, bus id).
    let mut import = vec![0x01, 0x11, 0x80, 0x03, 0, 0, 0, 0];
    import.extend_from_slice(&{
        let mut busid = [0u8; 32];
        busid[..3].copy_from_slice(b"0-2");
        busid
    });
    let mut held = std::net::TcpStream::connect(&served.addr).unwrap();
    std::io::Write::write_all(&mut held, &import).unwrap();
    let mut reply = [0u8; 8 + 312];
    std::io::Read::read_exact(&mut held, &mut reply).unwrap();
    assert_eq!(&reply[4..8], &[0, 0, 0, 0], "imported");

    let control = served.control.to_str().unwrap();
    let state: serde_json::Value =
        serde_json::from_slice(&usbwire(&["state", "--json", "--control", control]).stdout).unwrap();
    let listed: serde_json::Value =
        serde_json::from_slice(&usbwire(&["list", "-r", &served.addr, "--json"]).stdout).unwrap();
    for document in [&state, &listed] {
        assert_eq!(document["schema_version"], 2, "{document}");
    }
    let loopback = &state["devices"][1];
    assert_eq!((loopback["busid"].as_str(), loopback["state"].as_str()), (Some("0-2"), Some("in_use")));
    let since = loopback["since"].as_u64().expect("the Unix time stays");
    let since_at = loopback["since_at"].as_str().expect("and its RFC 3339 form is beside it");
    let parsed = humantime::parse_rfc3339(since_at).unwrap();
    assert_eq!(parsed.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs(), since);
    // `product` is the device's own string in every verb, `product_name` the usb.ids name.
    let keyboard = &listed["devices"][0];
    assert_eq!(keyboard["product"], "usbwire keyboard");
    assert_eq!(state["devices"][0]["product"], keyboard["product"]);
    assert_ne!(keyboard["product_name"], keyboard["product"]);
    // The device in use is among list -r's devices, with the same holder and time as in state.
    assert_eq!(listed["devices"][1]["busid"], "0-2");
    assert_eq!(listed["devices"][1]["since_at"], since_at);
    assert_eq!(listed["devices"][1]["holder"], loopback["holder"]);
    drop(held);
}

/// `usbwire udev-rules`: one narrow rule per `[[bind]]` selector of a sample
/// config (the package ships none), none for a class, exit 78 without binds.
#[test]
fn udev_rules_name_the_bind_devices_and_nothing_else() {
    let dir = scratch("udev-rules");
    let config = dir.join("server.toml");
    std::fs::write(
        &config,
        "[[bind]]\ndevice = \"0781:5567\"\nalso = [\"0781:df11\", \"serial=4C530001\"]\n\
         [[bind]]\ndevice = \"1-1.2\"\n[[bind]]\ndevice = \"class=03\"\n[[bind]]\ndevice = \"0781:5567\"\n",
    )
    .unwrap();
    let out = Command::new(BIN).args(["udev-rules", "--config"]).arg(&config).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let rules: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    let rule = |matcher: &str| {
        format!("SUBSYSTEM==\"usb\", ENV{{DEVTYPE}}==\"usb_device\", {matcher}, MODE=\"0660\", GROUP=\"usbwire\"")
    };
    assert_eq!(
        rules,
        [
            rule("ATTR{idVendor}==\"0781\", ATTR{idProduct}==\"5567\""),
            rule("ATTR{idVendor}==\"0781\", ATTR{idProduct}==\"df11\""),
            rule("ATTR{serial}==\"4C530001\""),
            rule("KERNEL==\"1-1.2\""),
        ],
        "one rule per selector, the repeated one once:\n{text}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("class=03 gets no rule"));

    let out = Command::new(BIN).args(["udev-rules", "--group", "plugdev", "--config"]).arg(&config).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .all(|l| l.ends_with("GROUP=\"plugdev\"")));

    std::fs::write(&config, "listen = \"127.0.0.1:3240\"\n").unwrap();
    let out = Command::new(BIN).args(["udev-rules", "--config"]).arg(&config).output().unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no [[bind]] rules"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
