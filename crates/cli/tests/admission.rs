//! The real `usbwire serve` under a half-open flood: what it logs, and that
//! `[admission]` in its config file is what it enforces.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use usbwire_testing::process::Scratch;

use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn scratch(name: &str) -> Scratch {
    usbwire_testing::process::scratch("cli-admission", name)
}

/// A running `usbwire serve` with every stderr line kept.
struct Served {
    child: Child,
    addr: SocketAddr,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Served {
    fn start(dir: &Path, config: &str) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let config_path = dir.join("server.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut child = Command::new(BIN)
            .args(["serve", "--no-advertise", "--virtual", "loopback", "--listen", &addr.to_string(), "--config"])
            .arg(&config_path)
            .arg("--control")
            .arg(dir.join("control.sock"))
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let kept = stderr.clone();
        std::thread::spawn(move || lines.map_while(Result::ok).for_each(|line| kept.lock().unwrap().push(line)));
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = stdout.by_ref().map_while(Result::ok).find(|l| l.starts_with("usbwire serving"));
        assert!(
            first.is_some_and(|l| l.contains(&addr.to_string())),
            "server did not start: {:?}",
            stderr.lock().unwrap()
        );
        std::thread::spawn(move || for _ in stdout {});
        Self { child, addr, stderr }
    }

    fn warnings(&self) -> Vec<String> {
        self.stderr.lock().unwrap().iter().filter(|l| l.contains(" WARN ") || l.contains(" ERROR ")).cloned().collect()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn from_127_0_0_2(target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), 0)))?;
    socket.connect(target).await
}

/// Waits until the server closes or resets `stream`; how long that took.
async fn closed_after(mut stream: TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut byte = [0u8; 1];
    match tokio::time::timeout(limit, stream.read(&mut byte)).await {
        Ok(Ok(0) | Err(_)) => Some(started.elapsed()),
        Ok(Ok(_)) => panic!("the server sent something to a client that sent nothing"),
        Err(_) => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_flood_is_logged_as_a_few_summary_lines() {
    let dir = scratch("flood-log");
    let served = Served::start(&dir, "");
    let addr = served.addr;
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicU64::new(0));
    let mut flood = Vec::new();
    for _ in 0..300 {
        let (stop, opened) = (stop.clone(), opened.clone());
        flood.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let Ok(stream) = from_127_0_0_2(addr).await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                opened.fetch_add(1, Ordering::Relaxed);
                let _ = closed_after(stream, Duration::from_secs(30)).await;
            }
        }));
    }
    // 12 s of flood; the client on 127.0.0.1 is listed every second meanwhile.
    let started = Instant::now();
    let mut unserved = Vec::new();
    while started.elapsed() < Duration::from_secs(12) {
        let listed = tokio::time::timeout(
            Duration::from_secs(2),
            usbwire_client::list_devices(addr, &usbwire_client::Security::Plain),
        )
        .await;
        if !matches!(&listed, Ok(Ok(devices)) if devices.len() == 1) {
            unserved.push(format!("at {:?}: {listed:?}", started.elapsed()));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    stop.store(true, Ordering::Relaxed);
    for task in flood {
        task.abort();
    }
    let opened = opened.load(Ordering::Relaxed);
    assert!(opened > 1000, "the flood re-opened only {opened} connections");
    let warnings = served.warnings();
    eprintln!("{opened} flood connections; {} warning lines:\n{}", warnings.len(), warnings.join("\n"));
    // One at the first refusal, then at most one per 10 s interval: 2 in 12 s, 3 with scheduling slack.
    assert!(warnings.len() <= 3, "{} warning lines for {opened} connections", warnings.len());
    let summary = warnings.first().expect("refusals are reported");
    assert!(summary.contains("refused") && summary.contains("127.0.0.2"), "{summary}");
    assert!(unserved.is_empty(), "127.0.0.1 not served during the flood: {unserved:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_limits_come_from_the_config_file() {
    let dir = scratch("config");
    let served = Served::start(&dir, "[admission]\nper_address_max = 2\nfirst_byte_timeout = \"500ms\"\n");
    let held = [from_127_0_0_2(served.addr).await.unwrap(), from_127_0_0_2(served.addr).await.unwrap()];
    // Let the server accept both before the third arrives.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Reset at once: sometimes before the connect has even returned.
    let refused = match from_127_0_0_2(served.addr).await {
        Ok(third) => closed_after(third, Duration::from_millis(400)).await.is_some(),
        Err(error) => error.kind() == std::io::ErrorKind::ConnectionReset,
    };
    assert!(refused, "a third idle connection from one address is refused at once with per_address_max = 2");
    for stream in held {
        // The default would hold them 3 s.
        let closed = closed_after(stream, Duration::from_millis(2500)).await;
        assert!(closed.is_some(), "first_byte_timeout = 500ms: an idle connection is closed within 2.5 s");
    }
    let listed = usbwire_client::list_devices(served.addr, &usbwire_client::Security::Plain).await.unwrap();
    assert_eq!(listed.len(), 1, "another address is still served");
}
