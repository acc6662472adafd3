//! Fair admission and re-import after a disconnect, over real loopback TCP.
//!
//! One address (127.0.0.2) holding hundreds of half-open connections, and
//! re-opening each as soon as the server closes it, must not keep a client on
//! another address (127.0.0.1) from listing and importing — against a plain
//! server and a TLS-only one. And an import made right after the previous
//! importer cut its connection must never be answered "busy".

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use usbwire_testing::process::Scratch;

use tokio::io::AsyncReadExt;
use tokio::net::TcpSocket;
use usbwire_client::{Security, TlsClient};
use usbwire_proto::op::BusId;
use usbwire_server::{PlainPolicy, Security as ServerSecurity};
use usbwire_testing::TestServer;
use usbwire_transport::access::{AccessRules, Admission, Rule};
use usbwire_transport::known_servers::KnownServers;
use usbwire_transport::{Identity, PeerStream};

/// Half-open connections the flood keeps open (or re-opening) at once.
const FLOOD: usize = 400;
/// What the issue asks of the client on another address: list and import within this.
const SERVED_WITHIN: Duration = Duration::from_secs(2);

fn scratch(name: &str) -> Scratch {
    usbwire_testing::process::scratch("admission", name)
}

fn busid(text: &str) -> BusId {
    BusId::new(text).unwrap()
}

async fn serve(security: ServerSecurity) -> SocketAddr {
    TestServer::builder().security(security).loopback().start().await.keep_running()
}

/// A TLS-only server whose rules let `client` use everything, and that client's security.
async fn serve_tls() -> (SocketAddr, Security, Scratch) {
    let server = Identity::generate("server").unwrap();
    let client = Identity::generate("client").unwrap();
    let rules =
        AccessRules { rules: vec![Rule { client: client.fingerprint().to_string(), devices: vec!["*".into()] }] };
    let security = ServerSecurity::tls(&server, PlainPolicy::Never, Admission { rules, ca: None }).unwrap();
    let addr = serve(security).await;
    let dir = scratch("known");
    let known = KnownServers::in_dir(&dir);
    known.add(&addr.to_string(), server.fingerprint()).unwrap();
    (addr, Security::Tls(Arc::new(TlsClient { identity: client, known, trust_new: false, pinned: None })), dir)
}

/// Connections from 127.0.0.2 that send nothing, each re-opened as soon as the
/// server closes (or refuses) it, on their own thread and runtime until dropped.
/// `opened` counts connection attempts.
struct Flood {
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Flood {
    fn start(target: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicU64::new(0));
        let (stop_flag, counter) = (stop.clone(), opened.clone());
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async move {
                let mut tasks = tokio::task::JoinSet::new();
                for _ in 0..FLOOD {
                    let (stop, opened) = (stop_flag.clone(), counter.clone());
                    tasks.spawn(async move {
                        while !stop.load(Ordering::Relaxed) {
                            let connected = half_open(target).await;
                            opened.fetch_add(1, Ordering::Relaxed);
                            let mut stream = match connected {
                                Ok(stream) => stream,
                                // Reset by the server before the connect returned: re-open at once.
                                Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => continue,
                                Err(_) => {
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                    continue;
                                }
                            };
                            // Send nothing; wait for the server to close (or reset) it.
                            let mut byte = [0u8; 1];
                            let _ = tokio::time::timeout(Duration::from_secs(60), stream.read(&mut byte)).await;
                        }
                    });
                }
                while !stop_flag.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                tasks.abort_all();
            });
        });
        Self { stop, opened, thread: Some(thread) }
    }

    fn opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn half_open(target: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), 0)))?;
    socket.connect(target).await
}

/// Over ~10 s of flood, the client on 127.0.0.1 lists and imports 0-1, each within 2 s, every time.
async fn served_during_flood(addr: SocketAddr, security: &Security) {
    let flood = Flood::start(addr);
    // Let the flood fill whatever it can first.
    let warming = Instant::now();
    while flood.opened() < FLOOD as u64 {
        assert!(warming.elapsed() < Duration::from_secs(20), "the flood does not start: {} opened", flood.opened());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let started = Instant::now();
    let mut rounds = 0;
    let mut slowest = Duration::ZERO;
    while started.elapsed() < Duration::from_secs(10) {
        let at = Instant::now();
        let devices = tokio::time::timeout(SERVED_WITHIN, usbwire_client::list_devices(addr, security))
            .await
            .unwrap_or_else(|_| {
                panic!("round {rounds}: no device list within 2 s ({} flood connections opened)", flood.opened())
            })
            .unwrap_or_else(|error| panic!("round {rounds}: list refused: {error}"));
        assert_eq!(devices.len(), 1, "round {rounds}");
        let listed = at.elapsed();
        let at = Instant::now();
        let (stream, record) =
            tokio::time::timeout(SERVED_WITHIN, usbwire_client::import(addr, &busid("0-1"), security))
                .await
                .unwrap_or_else(|_| panic!("round {rounds}: no import within 2 s"))
                .unwrap_or_else(|error| panic!("round {rounds}: import refused: {error}"));
        assert_eq!(record.busid.as_str(), "0-1");
        slowest = slowest.max(listed).max(at.elapsed());
        drop(stream);
        rounds += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let opened = flood.opened();
    drop(flood);
    eprintln!("{rounds} rounds served, slowest step {slowest:?}; the flood opened {opened} connections");
    assert!(rounds >= 5, "only {rounds} rounds in 10 s");
    // The flood really re-opened what the server closed, many times over.
    assert!(opened > 2 * FLOOD as u64, "the flood re-opened only {opened} connections");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_flood_from_one_address_does_not_lock_out_another_plain() {
    let addr = serve(ServerSecurity::default()).await;
    served_during_flood(addr, &Security::Plain).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_flood_from_one_address_does_not_lock_out_another_tls() {
    let (addr, security, _dir) = serve_tls().await;
    served_during_flood(addr, &security).await;
}

/// Imports 0-1, cuts the connection (a FIN, or a reset every other time) and at
/// once imports again from a new connection — the way `usbip detach` then
/// `usbip attach` does, which does not retry a busy answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_import_and_cut_cycles_are_never_refused() {
    const CYCLES: usize = 2000;
    let addr = serve(ServerSecurity::default()).await;
    let started = Instant::now();
    let mut refused = Vec::new();
    for cycle in 0..CYCLES {
        match usbwire_client::import(addr, &busid("0-1"), &Security::Plain).await {
            Ok((stream, _)) => {
                if cycle % 2 == 1 {
                    let PeerStream::Plain(tcp) = &stream else { panic!("a plain import is a TCP stream") };
                    socket2::SockRef::from(tcp).set_linger(Some(Duration::ZERO)).unwrap();
                }
                drop(stream);
            }
            Err(error) => refused.push(format!("cycle {cycle}: {error}")),
        }
        assert!(started.elapsed() < Duration::from_secs(120), "too slow: {cycle} cycles in {:?}", started.elapsed());
    }
    eprintln!("{CYCLES} cycles in {:?}", started.elapsed());
    assert!(
        refused.is_empty(),
        "{} of {CYCLES} imports refused, first: {:?}",
        refused.len(),
        &refused[..refused.len().min(5)]
    );
}

/// vhci-hcd closes the old socket some time after `usbip detach` returns (up
/// to a second on a slow guest), and `usbip attach` right after it must still
/// succeed: an import from the holder's own host waits for the holder to go.
/// From another host, the same import is refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_from_the_holders_host_waits_for_its_late_close() {
    let addr = serve(ServerSecurity::default()).await;
    let (stream, _) = usbwire_client::import(addr, &busid("0-1"), &Security::Plain).await.unwrap();
    let closer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(800)).await;
        drop(stream);
    });
    let started = Instant::now();
    let again = usbwire_client::import(addr, &busid("0-1"), &Security::Plain).await;
    assert!(again.is_ok(), "refused although the holder closed after 800 ms: {:?}", again.as_ref().err());
    assert!(started.elapsed() >= Duration::from_millis(700), "it waited for the close");
    closer.await.unwrap();

    // Held from 127.0.0.1, asked from 127.0.0.2: busy at once.
    let (_held, _) = again.unwrap();
    let from_elsewhere = TcpSocket::new_v4().unwrap();
    from_elsewhere.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut tcp = from_elsewhere.connect(addr).await.unwrap();
    let started = Instant::now();
    let mut request = bytes::BytesMut::new();
    usbwire_proto::op::OpRequest::Import { busid: busid("0-1") }.encode(&mut request);
    tokio::io::AsyncWriteExt::write_all(&mut tcp, &request).await.unwrap();
    let mut reply = [0u8; 8];
    tcp.read_exact(&mut reply).await.unwrap();
    assert_eq!(u32::from_be_bytes(reply[4..8].try_into().unwrap()), usbwire_proto::op::OpStatus::DEV_BUSY.0);
    assert!(started.elapsed() < Duration::from_secs(1), "another host is told at once");
}
