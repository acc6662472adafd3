//! A refused import says why, over the wire against a real in-process
//! server: in use (by whom, since when) and withdrawn (unplugged), through
//! the import `usbwire attach` makes; and a stock client's bytes are the
//! status code alone, as before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use usbwire_client::{ClientError, Connection, Security};
use usbwire_device::{Completion, Device, DeviceSummary, Direction, Speed, TransferType, Urb};
use usbwire_proto::op::OpStatus;
use usbwire_testing::TestServer;

/// A loopback device with a plug: pulled, it says it is gone, as a real
/// device does when unplugged.
struct Pluggable {
    inner: Box<dyn Device>,
    pulled: Arc<AtomicBool>,
}

impl Device for Pluggable {
    fn summary(&self) -> DeviceSummary {
        self.inner.summary()
    }
    fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        self.inner.endpoint_type(direction, number)
    }
    fn submit(&mut self, urb: Urb) {
        self.inner.submit(urb);
    }
    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        self.inner.poll_complete(cx)
    }
    fn cancel(&mut self, seqnum: u32) {
        self.inner.cancel(seqnum);
    }
    fn reset(&mut self) {
        self.inner.reset();
    }
    fn is_gone(&self) -> bool {
        self.pulled.load(Ordering::SeqCst)
    }
}

/// A loopback server that answers an import from the holder's own host busy
/// after 200 ms, not the default 5 s it waits for a reconnecting holder.
async fn impatient_loopback() -> TestServer {
    TestServer::builder().loopback().config(|c| c.admission.release_wait = Duration::from_millis(200)).start().await
}

fn refusal(result: Result<impl Sized, ClientError>) -> (OpStatus, Option<String>) {
    match result {
        Err(ClientError::Refused { status, reason, .. }) => (status, reason),
        Err(other) => panic!("not a refusal: {other}"),
        Ok(_) => panic!("imported"),
    }
}

#[tokio::test]
async fn an_import_of_a_device_in_use_says_by_whom_and_since_when() {
    let server = impatient_loopback().await;
    let (addr, busid) = (server.addr(), server.busids()[0].clone());
    let held = usbwire_client::import(addr, &busid, &Security::Plain).await.expect("the first import");
    let (status, reason) = refusal(usbwire_client::import_resumable(addr, &busid, &Security::Plain, &[]).await);
    assert_eq!(status, OpStatus::DEV_BUSY);
    let reason = reason.expect("a usbwire server says why");
    assert!(reason.starts_with("in use by 127.0.0.1:"), "{reason}");
    assert!(reason.contains(" since 20") && reason.ends_with("detach it there first"), "{reason}");
    // The plain import (`usbwire describe`'s) is told too, and the message says both.
    let plain = match usbwire_client::import(addr, &busid, &Security::Plain).await {
        Err(refused) => refused.to_string(),
        Ok(_) => panic!("imported a device in use"),
    };
    assert!(
        plain.starts_with(&format!("server refused {busid}: device busy (exported); in use by 127.0.0.1:")),
        "{plain}"
    );
    drop(held);
}

#[tokio::test]
async fn an_import_of_an_unplugged_device_says_it_was_unplugged() {
    let pulled = Arc::new(AtomicBool::new(false));
    let device = Pluggable { inner: Box::new(usbwire_gadgets::loopback(Speed::HIGH)), pulled: pulled.clone() };
    let server = TestServer::builder().device("loopback", Box::new(device)).start().await;
    let (addr, busid) = (server.addr(), server.busids()[0].clone());
    let (stream, record) = usbwire_client::import(addr, &busid, &Security::Plain).await.expect("imported");
    let connection = Connection::new(stream, &record);
    pulled.store(true, Ordering::SeqCst);
    // A URB wakes the server's channel, which then sees the device gone and drops the export.
    let _ = usbwire_client::describe::describe(&connection).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = usbwire_client::server_state(addr, &Security::Plain).await.unwrap().expect("a usbwire server");
        if state.withdrawn.iter().any(|w| w.busid == busid.as_str()) {
            break;
        }
        assert!(Instant::now() < deadline, "never withdrawn: {state:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, reason) = refusal(usbwire_client::import_resumable(addr, &busid, &Security::Plain, &[]).await);
    assert_eq!(status, OpStatus::NODEV);
    let reason = reason.expect("a usbwire server says why");
    assert!(reason.starts_with("unplugged from the server at 20"), "{reason}");
}

/// What the kernel's `usbip attach` sends, and reads back, for a device in
/// use: `OP_REP_IMPORT` with `ST_DEV_BUSY` and nothing after it.
#[tokio::test]
async fn a_stock_client_sees_the_status_code_alone() {
    let server = impatient_loopback().await;
    let (addr, busid) = (server.addr(), server.busids()[0].clone());
    let _held = usbwire_client::import(addr, &busid, &Security::Plain).await.expect("the first import");
    let mut request = vec![0x01, 0x11, 0x80, 0x03, 0, 0, 0, 0];
    let mut field = [0u8; 32];
    field[..busid.as_str().len()].copy_from_slice(busid.as_str().as_bytes());
    request.extend_from_slice(&field);
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(&request).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await.unwrap().unwrap();
    assert_eq!(answer, [0x01, 0x11, 0x00, 0x03, 0, 0, 0, 0x02], "OP_REP_IMPORT, ST_DEV_BUSY, then the server hangs up");
}
