//! The real `usbwire serve --http` as a door: a flood of half-sent HTTP
//! requests from many addresses, under a file descriptor limit of 256, takes
//! none of the descriptors USB/IP imports need; a request for a name the
//! server does not know (DNS rebinding) is refused with 421; one address
//! cannot hold every event stream.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use usbwire_testing::process::Scratch;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use usbwire_proto::op::{self, BusId, OpRequest};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn scratch(name: &str) -> Scratch {
    usbwire_testing::process::scratch("cli-http", name)
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// A running `usbwire serve --http` (under `prlimit` when given a limit), every stderr line kept.
struct Served {
    child: Child,
    addr: SocketAddr,
    http: SocketAddr,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Served {
    fn start(dir: &Path, config: &str, nofile: Option<u32>) -> Self {
        let (addr, http) = (free_addr(), free_addr());
        let config_path = dir.join("server.toml");
        std::fs::write(&config_path, config).unwrap();
        let mut command = match nofile {
            Some(limit) => {
                let mut command = Command::new("prlimit");
                command.arg(format!("--nofile={limit}")).arg(BIN);
                command
            }
            None => Command::new(BIN),
        };
        command
            .args(["serve", "--no-advertise", "--virtual", "loopback", "--listen", &addr.to_string()])
            .args(["--http", &http.to_string(), "--config"])
            .arg(&config_path)
            .arg("--control")
            .arg(dir.join("control.sock"))
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().unwrap();
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let kept = stderr.clone();
        std::thread::spawn(move || lines.map_while(Result::ok).for_each(|line| kept.lock().unwrap().push(line)));
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = stdout.by_ref().map_while(Result::ok).find(|l| l.starts_with("usbwire serving"));
        assert!(first.is_some(), "server did not start: {:?}", stderr.lock().unwrap());
        std::thread::spawn(move || for _ in stdout {});
        Self { child, addr, http, stderr }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn connect_from(source: Ipv4Addr, target: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((source, 0)))?;
    socket.connect(target).await
}

/// One request; the status line and body of the answer.
async fn get(target: SocketAddr, from: Ipv4Addr, path: &str, host: &str) -> (String, String) {
    let mut stream = connect_from(from, target).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (head.lines().next().unwrap_or("").to_owned(), body.to_owned())
}

/// Imports 0-1 (retrying while the last import is being released); how long the answer took.
async fn import(addr: SocketAddr) -> Result<Duration, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let started = Instant::now();
        let mut stream = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        let mut request = BytesMut::new();
        OpRequest::Import { busid: BusId::new("0-1").unwrap() }.encode(&mut request);
        stream.write_all(&request).await.map_err(|e| format!("write: {e}"))?;
        let mut reply = BytesMut::new();
        let result = loop {
            if let Some(result) = op::decode_import_reply(&mut reply).map_err(|e| format!("{e}"))? {
                break result;
            }
            let mut chunk = [0u8; 512];
            let n = stream.read(&mut chunk).await.map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Err("closed before answering".into());
            }
            reply.extend_from_slice(&chunk[..n]);
        };
        match result {
            Ok(_) => return Ok(started.elapsed()),
            Err(status) if Instant::now() < deadline => {
                let _ = status;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(status) => return Err(format!("refused: {status:?}")),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_half_sent_http_requests_leaves_usbip_imports_their_descriptors() {
    let dir = scratch("flood");
    let served = Served::start(&dir, "", Some(256));
    // Many addresses, so the per-address cap alone would not hold it: 600
    // connections from 100 loopback addresses, each a request never finished.
    let mut held = Vec::new();
    for n in 0..600u32 {
        let source = Ipv4Addr::new(127, 0, 1, (n % 100) as u8 + 1);
        if let Ok(Ok(mut stream)) =
            tokio::time::timeout(Duration::from_secs(2), connect_from(source, served.http)).await
        {
            let _ = stream.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n").await;
            held.push(stream);
        }
    }
    // USB/IP during the flood: every import answered, promptly.
    let mut slowest = Duration::ZERO;
    for _ in 0..40 {
        let took = import(served.addr).await.unwrap_or_else(|e| panic!("import during the HTTP flood: {e}"));
        slowest = slowest.max(took);
    }
    eprintln!("HTTP flood: {} connections made, slowest of 40 imports {slowest:?}", held.len());
    assert!(slowest < Duration::from_millis(500), "an import waited {slowest:?} during the HTTP flood");
    let exhausted: Vec<String> =
        served.stderr.lock().unwrap().iter().filter(|l| l.contains("Too many open files")).cloned().collect();
    assert!(exhausted.is_empty(), "the server ran out of descriptors: {exhausted:?}");
    // Once the half-sent requests time out (5 s), the page answers again.
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, _) = get(served.http, Ipv4Addr::LOCALHOST, "/status.json", "127.0.0.1").await;
        if status.contains("200") {
            break;
        }
        assert!(Instant::now() < deadline, "the status page did not come back: {status}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_a_foreign_host_is_refused_with_421() {
    let dir = scratch("host");
    let served = Served::start(&dir, "http_hosts = [\"usb.lab.test\"]\n", None);
    let port = served.http.port();
    let local = Ipv4Addr::LOCALHOST;
    // A page on evil.example that rebound its name to this address.
    let (status, body) = get(served.http, local, "/status.json", &format!("evil.example:{port}")).await;
    assert!(status.contains("421"), "{status}");
    assert!(body.contains("http_hosts"), "the refusal says what to do: {body}");
    assert!(!body.contains("devices"), "nothing of the status leaked: {body}");
    let (status, _) = get(served.http, local, "/metrics", "evil.example").await;
    assert!(status.contains("421"), "{status}");
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}"), "usb.lab.test".to_owned()] {
        let (status, body) = get(served.http, local, "/status.json", &host).await;
        assert!(status.contains("200"), "{host}: {status}");
        assert!(body.contains("\"devices\""), "{host}: {body}");
    }
    assert!(served.stderr.lock().unwrap().iter().any(|l| l.contains("evil.example")), "the refusal is logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_hold_every_event_stream() {
    let dir = scratch("events");
    let served = Served::start(&dir, "", None);
    let http = served.http;
    let open_stream = move |from: Ipv4Addr| async move {
        let mut stream = connect_from(from, http).await.unwrap();
        stream.write_all(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await.unwrap();
        let mut head = vec![0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut head)).await.unwrap().unwrap();
        (String::from_utf8_lossy(&head[..n]).into_owned(), stream)
    };
    let mut streams = Vec::new();
    for _ in 0..4 {
        let (head, stream) = open_stream(Ipv4Addr::LOCALHOST).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        streams.push(stream);
    }
    let (head, _) = open_stream(Ipv4Addr::LOCALHOST).await;
    assert!(head.starts_with("HTTP/1.1 503"), "a fifth stream from one address: {head}");
    let (head, _other) = open_stream(Ipv4Addr::new(127, 0, 0, 2)).await;
    assert!(head.starts_with("HTTP/1.1 200"), "another address still gets one: {head}");
}
