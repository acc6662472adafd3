//! Reattach under fire: a userspace client holds a loopback device while the
//! server restarts 20 times and the network (a proxy in between) drops 20
//! times. Each time the device must be back and usable within 5 s, and at the
//! end nothing is left behind: no open sockets or files, no extra threads.
//! Run against a server without resume (every drop is a new import) and one
//! with it (a restart loses the session and is a new import; a cut is resumed).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use usbwire_bench::proxy::Proxy;
use usbwire_client::{ReattachingDevice, Security, Transfer, TransferError};
use usbwire_device::Speed;
use usbwire_proto::op::BusId;
use usbwire_server::{Server, ServerConfig};

const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];
const BACK_WITHIN: Duration = Duration::from_secs(5);

struct RunningServer {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

async fn start_server(addr: SocketAddr, resume_grace: Duration) -> RunningServer {
    let config = ServerConfig { listen: addr, control_path: None, resume_grace, ..ServerConfig::default() };
    let mut server = Server::new(config);
    server.export("loopback", Box::new(usbwire_gadgets::loopback(Speed::HIGH)));
    let bound = server.bind().await.expect("port free again after the previous server stopped");
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(bound.run(async move {
        let _ = stopped.await;
    }));
    RunningServer { stop, task }
}

impl RunningServer {
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap();
    }
}

/// Uses the device until one round trip through the loopback pair succeeds.
async fn use_device(device: &mut ReattachingDevice, round: usize) {
    let payload = Bytes::from(vec![round as u8; 4096]);
    loop {
        let (connection, fresh) = device.connection().await;
        let result = async {
            if fresh {
                connection.transfer_checked(Transfer::control_out(SET_CONFIGURATION_1, Bytes::new())).await?;
            }
            connection.transfer_checked(Transfer::bulk_out(0x03, payload.clone())).await?;
            connection.transfer_checked(Transfer::bulk_in(0x83, 4096)).await
        }
        .await;
        match result {
            Ok(back) => {
                assert_eq!(back.data, payload, "round {round}: loopback data");
                return;
            }
            Err(TransferError::Disconnected | TransferError::DeviceGone | TransferError::Cancelled) => {
                device.disconnect()
            }
            Err(other) => panic!("round {round}: {other}"),
        }
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_is_back_after_server_restarts_and_network_cuts() {
    // Warm the runtime's lazily created pieces before taking the baseline.
    tokio::task::spawn_blocking(|| ()).await.unwrap();
    let fds_before = open_fds();
    let threads_before = threads();
    // One scenario after the other: both count this process's descriptors.
    let imports = restarts_and_cuts(Duration::ZERO).await;
    assert_eq!(imports, 41, "without resume: one import at first, then one per restart and per cut");
    let imports = restarts_and_cuts(Duration::from_secs(30)).await;
    assert_eq!(imports, 21, "with resume: one import at first, then one per restart; cuts are resumed");

    // Everything is closed asynchronously; give it a moment, then nothing may remain.
    let mut left = (open_fds(), threads());
    for _ in 0..50 {
        if left.0 <= fds_before && left.1 <= threads_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = (open_fds(), threads());
    }
    assert!(left.0 <= fds_before, "file descriptors leaked: {} before, {} after", fds_before, left.0);
    assert!(left.1 <= threads_before, "threads leaked: {} before, {} after", threads_before, left.1);
}

/// 20 server restarts, then 20 cuts, against a server with `resume_grace`;
/// returns how many times the device was imported.
async fn restarts_and_cuts(resume_grace: Duration) -> u64 {
    let addr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let mut server = start_server(addr, resume_grace).await;
    let proxy = Proxy::start(addr, Duration::ZERO, Duration::ZERO).await.unwrap();
    let mut device = ReattachingDevice::new(proxy.addr, BusId::new("0-1").unwrap(), Security::Plain);
    tokio::time::timeout(BACK_WITHIN, use_device(&mut device, 0)).await.expect("first import");

    let mut slowest = Duration::ZERO;
    for round in 1..=20 {
        server.stop().await;
        server = start_server(addr, resume_grace).await;
        let started = Instant::now();
        tokio::time::timeout(BACK_WITHIN, use_device(&mut device, round))
            .await
            .unwrap_or_else(|_| panic!("not back within 5 s after server restart {round}"));
        slowest = slowest.max(started.elapsed());
    }
    for round in 21..=40 {
        proxy.cut_all();
        let started = Instant::now();
        tokio::time::timeout(BACK_WITHIN, use_device(&mut device, round))
            .await
            .unwrap_or_else(|_| panic!("not back within 5 s after network cut {}", round - 20));
        slowest = slowest.max(started.elapsed());
    }
    println!("resume grace {resume_grace:?}: slowest recovery {slowest:?}");
    let imports = device.imports();
    drop(device);
    drop(proxy);
    server.stop().await;
    imports
}
