//! `usbwire attach --auto-attach` without a kernel: what it runs after its
//! argument checks — the client crate's first import and its follower with
//! `Persistence::Forever` — against the real `usbwire serve` binary, stopped
//! and started again on the same port. vhci-hcd is replaced by a userspace
//! stand-in ([`StandIn`]) that does what the kernel does first with a new
//! device: GET_DESCRIPTOR through the socket it was given. (The whole binary
//! against a real vhci-hcd is `tests/interop/test_client.py`.)
//!
//! Checked: a server that is not up yet is waited for; after the server stops
//! the device is attached again once it is back, within the bounded backoff;
//! over a long outage the log says "waiting" once while the attempts go on;
//! the kernel letting go ends it. And the binary's own refusals.

use std::io::Write as _;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, watch};
use usbwire_client::follow::{self, FollowStatus, Persistence, Ports, Reimport, Target, AUTO_ATTACH_MAX_INTERVAL};
use usbwire_client::relay::RelayState;
use usbwire_client::vhci::{Record, VhciError};
use usbwire_client::Security;
use usbwire_proto::op::{BusId, DeviceRecord};
use usbwire_proto::urb::{CmdSubmit, TransferFlags, HEADER_LEN};
use usbwire_proto::Direction;
use usbwire_testing::process::{free_addr, start, Running};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");
/// The virtual keyboard's ids.
const KEYBOARD: (u16, u16) = (0x1209, 0x0001);

/// vhci-hcd's part, in userspace: each attach makes a socket pair and hands
/// the "kernel" end to the test, which enumerates through it.
struct StandIn {
    kernel_ends: mpsc::Sender<(u32, UnixStream)>,
    next_port: u32,
}

impl Ports for StandIn {
    fn attach(
        &mut self,
        _device: &DeviceRecord,
        _record: &Record,
        preferred: Option<u32>,
    ) -> Result<(u32, UnixStream), VhciError> {
        let port = preferred.unwrap_or(self.next_port);
        self.next_port += 1;
        let (kernel, ours) = UnixStream::pair().map_err(|source| VhciError::Io { path: "pair".into(), source })?;
        self.kernel_ends.try_send((port, kernel)).expect("the test takes each attachment");
        Ok((port, ours))
    }

    fn detach(&mut self, _port: u32) -> Result<(), VhciError> {
        Ok(())
    }

    async fn freed(&mut self, _port: u32) {}
}

/// GET_DESCRIPTOR(device) through `kernel`, as the kernel's first URB: the device's VID:PID.
async fn enumerate(kernel: &mut UnixStream, devid: u32, seqnum: u32) -> (u16, u16) {
    let submit = CmdSubmit {
        seqnum,
        devid,
        direction: Direction::In,
        ep: 0,
        transfer_flags: TransferFlags::default(),
        transfer_buffer_length: 18,
        start_frame: 0,
        number_of_packets: 0,
        interval: 0,
        setup: [0x80, 0x06, 0x00, 0x01, 0x00, 0x00, 18, 0],
        data: Bytes::new(),
        iso_packets: vec![],
    };
    let mut wire = BytesMut::new();
    submit.encode(&mut wire);
    kernel.write_all(&wire).await.expect("submit");
    let mut header = [0u8; HEADER_LEN];
    tokio::time::timeout(Duration::from_secs(10), kernel.read_exact(&mut header)).await.expect("reply").expect("read");
    assert_eq!(header[..4], 3u32.to_be_bytes(), "a RET_SUBMIT");
    assert_eq!(header[0x14..0x18], [0; 4], "status 0");
    let length = u32::from_be_bytes([header[0x18], header[0x19], header[0x1a], header[0x1b]]) as usize;
    let mut descriptor = vec![0u8; length];
    kernel.read_exact(&mut descriptor).await.expect("descriptor");
    assert_eq!(length, 18, "{descriptor:02x?}");
    (u16::from_le_bytes([descriptor[8], descriptor[9]]), u16::from_le_bytes([descriptor[10], descriptor[11]]))
}

fn serve(addr: &str) -> Running {
    let mut command = Command::new(BIN);
    command.args(["serve", "--no-advertise", "--listen", addr, "--virtual", "keyboard"]);
    start(command, "usbwire serving").ready()
}

/// SIGTERM, as `systemctl restart` does: the server tells resuming clients the session is over.
fn stop(mut server: Running) {
    let pid = server.child().id() as libc::pid_t;
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let _ = server.child().wait();
}

/// Everything the client crate logs, down to trace (each retry), as text.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log")).into_owned()
    }
    fn count(&self, what: &str) -> usize {
        self.text().lines().filter(|line| line.contains(what)).count()
    }
}

#[tokio::test]
async fn the_device_is_attached_again_after_a_server_restart_and_the_wait_is_logged_once() {
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter("usbwire_client=trace")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // Current-thread runtime: every task of the test logs through this.
    let _logging = tracing::subscriber::set_default(subscriber);
    let addr = free_addr();
    let busid = BusId::new("0-1").expect("bus id");
    let reimport = Reimport {
        addr,
        security: Security::Plain,
        transforms: vec![],
        busid: busid.clone(),
        resumable: true,
        reservation: None,
        persistence: Persistence::Forever,
        accelerate: true,
    };

    // No server yet: the first import waits for it.
    let first = tokio::spawn({
        let reimport = reimport.clone();
        async move { reimport.first().await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!first.is_finished());
    let server = serve(&addr.to_string());
    let imported = tokio::time::timeout(Duration::from_secs(15), first).await.expect("in time").expect("task");
    let imported = imported.expect("imported once the server is up");
    assert_eq!(log.count("waiting for"), 1, "{}", log.text());

    let (kernel_ends, mut attached) = mpsc::channel(4);
    let mut ports = StandIn { kernel_ends, next_port: 3 };
    let record = Record { host: addr.ip().to_string(), service: addr.port().to_string(), busid: busid.to_string() };
    let (port, relay_end) = ports.attach(&imported.device, &record, None).expect("attach");
    let (_, mut kernel) = attached.recv().await.expect("the first attachment");
    let devid = imported.device.devid();
    let target = Target { reimport: reimport.clone(), give_up_after: usbwire_client::RESUME_GIVE_UP, record };
    let first_status = FollowStatus {
        port,
        attached: true,
        reattached: 0,
        vendor_id: KEYBOARD.0,
        product_id: KEYBOARD.1,
        relay: RelayState::Connected,
        storage: None,
    };
    let (status_tx, status) = watch::channel(first_status);
    let following =
        tokio::spawn(async move { follow::follow_on(&mut ports, target, imported, port, relay_end, status_tx).await });
    assert_eq!(enumerate(&mut kernel, devid, 1).await, KEYBOARD);

    // The server goes away for a long while: far more attempts than log lines.
    stop(server);
    let outage = Duration::from_secs(12);
    tokio::time::sleep(outage).await;
    assert!(!status.borrow().attached, "the device is away: {:?}", *status.borrow());
    let server = serve(&addr.to_string());
    let back = Instant::now();
    let (again_port, mut kernel) =
        tokio::time::timeout(Duration::from_secs(20), attached.recv()).await.expect("attached again").expect("port");
    let took = back.elapsed();
    assert_eq!(again_port, port, "on the same port");
    assert_eq!(enumerate(&mut kernel, devid, 1).await, KEYBOARD, "and it answers");
    let reattach_bound = AUTO_ATTACH_MAX_INTERVAL + Duration::from_secs(2);
    assert!(took < reattach_bound, "attached again {took:?} after the server was back");
    let now = *status.borrow();
    assert_eq!((now.reattached, now.attached), (1, true), "{now:?}");
    let text = log.text();
    let attempts = log.count("not back yet");
    assert!(attempts >= 6, "{attempts} attempts in {outage:?}: {text}");
    assert_eq!(log.count("waiting for"), 2, "once before the first import, once in the outage: {text}");
    assert_eq!(log.count("device went away"), 1, "{text}");
    assert_eq!(log.count("attached again"), 1, "{text}");
    let _ = std::io::stderr().write_all(format!("attached again {took:?} after the server was back\n").as_bytes());

    // The kernel lets go (`usbwire detach`): that ends it.
    drop(kernel);
    let ended = tokio::time::timeout(Duration::from_secs(10), following).await.expect("ends").expect("task");
    assert!(ended.is_ok(), "{ended:?}");
    drop(server);
}

#[test]
fn the_binary_refuses_what_auto_attach_cannot_do() {
    let run = |args: &[&str]| Command::new(BIN).args(args).env_remove("USBWIRE_REGISTRY").output().expect("runs");
    // A registry reservation is not kept forever.
    let out = run(&["attach", "--auto-attach", "--registry", "etcd://127.0.0.1:1", "--device", "label=x"]);
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
    // No vhci-hcd here: said before any waiting starts (where the module is loaded this is skipped).
    if !std::path::Path::new("/sys/devices/platform/vhci_hcd.0").exists() {
        let out = run(&["attach", "--auto-attach", "-r", "127.0.0.1:1", "-b", "0-1"]);
        assert_eq!(out.status.code(), Some(71), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let help = String::from_utf8_lossy(&run(&["attach", "--help"]).stdout).into_owned();
    assert!(help.contains("--auto-attach") && help.contains("usbipd-win"), "{help}");
    assert!(help.contains("usbwire attach --auto-attach -r"), "an example: {help}");
}
