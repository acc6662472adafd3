//! Device processes through a running server: the socket's permissions, the
//! device listed while its process is connected and withdrawn when it goes,
//! traffic from a USB/IP importer, and a process that stops answering.

use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::net::UnixStream;
use usbwire_client::{Connection, Security, Transfer};
use usbwire_device::control::SetupPacket;
use usbwire_device::Speed;
use usbwire_external::process::{serve, Answer, Echo, Handler, ServeError};
use usbwire_proto::op::BusId;
use usbwire_proto::Status;
use usbwire_server::{ExternalOptions, Registry, Server, ServerConfig, ServerError};

const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];
const GET_STATUS: [u8; 8] = [0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00];

struct Running {
    addr: SocketAddr,
    registry: Registry,
    socket: PathBuf,
    busid: BusId,
    _stop: tokio::sync::oneshot::Sender<()>,
    /// Holds the socket; removed when the test ends.
    _dir: usbwire_testing::process::Scratch,
}

async fn server(name: &str) -> Running {
    let dir = usbwire_testing::process::scratch("external", name);
    let socket = dir.join("device.sock");
    let config = ServerConfig { listen: "127.0.0.1:0".parse().unwrap(), control_path: None, ..ServerConfig::default() };
    let mut server = Server::new(config);
    let options = ExternalOptions { hello_timeout: Duration::from_secs(2), reply_timeout: Duration::from_secs(1) };
    let busid = server.export_external(socket.clone(), options);
    // A virtual device added after it does not take the bus id set aside.
    let other = server.export("loopback", Box::new(usbwire_gadgets::loopback(Speed::HIGH)));
    assert_eq!((busid.as_str(), other.as_str()), ("0-1", "0-2"));
    let bound = server.bind().await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (addr, registry) = (bound.local_addr(), bound.registry().clone());
    tokio::spawn(bound.run(async move { drop(stopped.await) }));
    Running { addr, registry, socket, busid, _stop: stop, _dir: dir }
}

async fn listed(registry: &Registry, busid: &BusId, wanted: bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while registry.list().iter().any(|e| &e.record.busid == busid) != wanted {
        assert!(Instant::now() < deadline, "{busid} listed: {} expected", wanted);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn spawn_process<H: Handler + Send + 'static>(
    socket: &Path,
    mut handler: H,
) -> tokio::task::JoinHandle<Result<(), ServeError>> {
    let socket = socket.to_path_buf();
    tokio::spawn(async move { serve(UnixStream::connect(&socket).await?, &mut handler).await })
}

#[tokio::test]
async fn a_device_process_is_exported_while_connected_and_carries_urbs() {
    let running = server("echo").await;
    let mode = std::fs::metadata(&running.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the socket is the server user's alone");
    listed(&running.registry, &running.busid, false).await;
    let process = spawn_process(&running.socket, Echo::new("E-7"));
    listed(&running.registry, &running.busid, true).await;
    let listing = usbwire_client::list_devices(running.addr, &Security::Plain).await.unwrap();
    let record = listing.iter().find(|d| d.busid == running.busid).expect("in OP_REP_DEVLIST");
    assert_eq!((record.id_vendor, record.id_product), (0x1209, 0x000e));
    // A second process on the same socket is refused with the reason.
    let second = spawn_process(&running.socket, Echo::new("E-8")).await.unwrap();
    assert!(matches!(&second, Err(ServeError::Refused(reason)) if reason.contains("already connected")), "{second:?}");

    let (stream, record) = usbwire_client::import(running.addr, &running.busid, &Security::Plain).await.unwrap();
    let connection = Connection::new(stream, &record);
    connection.transfer_checked(Transfer::control_out(SET_CONFIGURATION_1, Bytes::new())).await.unwrap();
    let (_, reply) = connection.submit(Transfer::bulk_in(1, 512)).await.unwrap();
    connection.transfer_checked(Transfer::bulk_out(2, Bytes::from_static(b"through the socket"))).await.unwrap();
    assert_eq!(&reply.await.unwrap().data[..], b"through the socket");

    // The process goes: the device is withdrawn and the importer's connection ends.
    process.abort();
    listed(&running.registry, &running.busid, false).await;
    let end = tokio::time::timeout(Duration::from_secs(10), connection.ended()).await;
    assert!(end.is_ok(), "the importer's connection ends");
    // It comes back under the same bus id.
    let _again = spawn_process(&running.socket, Echo::new("E-7"));
    listed(&running.registry, &running.busid, true).await;
}

/// A device process that goes while a URB is pending: the importer gets that
/// URB's reply, -ESHUTDOWN, before the connection ends, as for a real device
/// unplugged (the export's withdrawal and the device's own end race).
#[tokio::test]
async fn a_device_process_that_goes_answers_the_pending_urb_before_the_connection_ends() {
    let running = server("gone").await;
    for round in 0..5 {
        let process = spawn_process(&running.socket, Echo::new("G-1"));
        listed(&running.registry, &running.busid, true).await;
        let (stream, record) = usbwire_client::import(running.addr, &running.busid, &Security::Plain).await.unwrap();
        let connection = Connection::new(stream, &record);
        connection.transfer_checked(Transfer::control_out(SET_CONFIGURATION_1, Bytes::new())).await.unwrap();
        // Nothing echoed yet: this bulk IN stays pending on the device.
        let (_, pending) = connection.submit(Transfer::bulk_in(1, 512)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        process.abort();
        let reply = tokio::time::timeout(Duration::from_secs(10), pending).await.expect("an answer, not a hang");
        assert_eq!(reply.map(|ret| ret.status), Ok(Status::ESHUTDOWN), "round {round}");
        let end = tokio::time::timeout(Duration::from_secs(10), connection.ended()).await;
        assert!(end.is_ok(), "then the importer's connection ends");
        listed(&running.registry, &running.busid, false).await;
    }
}

/// The echo device, until the host configures it: then it NAKs every control request forever.
struct Stuck(Echo, bool);

impl Handler for Stuck {
    fn hello(&self) -> (Speed, u8) {
        self.0.hello()
    }
    fn control(&mut self, setup: SetupPacket, data: &[u8]) -> Answer {
        if self.1 {
            return Answer::Nak;
        }
        self.1 = setup.request == 0x09;
        self.0.control(setup, data)
    }
    fn out(&mut self, endpoint: u8, data: &[u8]) -> Answer {
        self.0.out(endpoint, data)
    }
    fn poll_in(&mut self, endpoint: u8, length: u32) -> Option<Answer> {
        self.0.poll_in(endpoint, length)
    }
    fn reset(&mut self) {}
}

#[tokio::test]
async fn a_device_process_that_stops_answering_gives_the_importer_an_error() {
    let running = server("stuck").await;
    let _process = spawn_process(&running.socket, Stuck(Echo::new("S-1"), false));
    listed(&running.registry, &running.busid, true).await;
    let (stream, record) = usbwire_client::import(running.addr, &running.busid, &Security::Plain).await.unwrap();
    let connection = Connection::new(stream, &record);
    connection.transfer_checked(Transfer::control_out(SET_CONFIGURATION_1, Bytes::new())).await.unwrap();
    let started = Instant::now();
    let reply = tokio::time::timeout(Duration::from_secs(10), connection.transfer(Transfer::control_in(GET_STATUS)))
        .await
        .expect("an answer, not a hang");
    if let Ok(ret) = reply {
        assert_eq!(ret.status, Status::ETIMEDOUT);
    }
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    listed(&running.registry, &running.busid, false).await;
}

#[tokio::test]
async fn a_socket_directory_that_is_a_planted_link_is_refused() {
    let dir = usbwire_testing::process::scratch("external", "planted");
    let elsewhere = dir.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, dir.join("link")).unwrap();
    let mut server = Server::new(ServerConfig { control_path: None, ..ServerConfig::default() });
    server.export_external(dir.join("link").join("device.sock"), ExternalOptions::default());
    let error = server.bind().await.err().expect("refused");
    assert!(matches!(error, ServerError::External { .. }), "{error}");
    assert!(!elsewhere.join("device.sock").exists(), "nothing made through the link");
    // A link planted at the socket's own path is replaced, never followed.
    let target = dir.join("target");
    std::fs::write(&target, b"keep").unwrap();
    std::os::unix::fs::symlink(&target, dir.join("device.sock")).unwrap();
    let mut server = Server::new(ServerConfig {
        control_path: None,
        listen: "127.0.0.1:0".parse().unwrap(),
        ..ServerConfig::default()
    });
    server.export_external(dir.join("device.sock"), ExternalOptions::default());
    let _bound = server.bind().await.unwrap();
    assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    assert!(std::fs::symlink_metadata(dir.join("device.sock")).unwrap().file_type().is_socket());
}
