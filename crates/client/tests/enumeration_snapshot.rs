//! Enumeration without round trips, end to end: a real server takes a
//! keyboard's descriptor snapshot at import, and the kernel relay answers a
//! stand-in for vhci-hcd's enumeration from it. The same requests through an
//! import with acceleration off are the reference: every reply is the same,
//! byte for byte, while the device sees none of the accelerated import's
//! `GET_DESCRIPTOR`s but the snapshot's own — and still every other request.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use usbwire_client::kernel_relay;
use usbwire_client::relay::Upstream;
use usbwire_client::{Imported, Security};
use usbwire_device::{Completion, Device, DeviceSummary, TransferType, Urb};
use usbwire_proto::op::BusId;
use usbwire_proto::urb::{CmdSubmit, HEADER_LEN};
use usbwire_proto::Direction;
use usbwire_testing::TestServer;

/// The keyboard, noting the SETUP packet of every control request it is sent.
struct Noting {
    inner: Box<dyn Device>,
    seen: Arc<Mutex<Vec<[u8; 8]>>>,
}

impl Device for Noting {
    fn summary(&self) -> DeviceSummary {
        self.inner.summary()
    }
    fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        self.inner.endpoint_type(direction, number)
    }
    fn submit(&mut self, urb: Urb) {
        if urb.endpoint == 0 {
            self.seen.lock().unwrap().push(urb.setup);
        }
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
}

fn get_descriptor(request_type: u8, kind: u8, index: u8, w_index: u16, length: u16) -> [u8; 8] {
    let [i0, i1] = w_index.to_le_bytes();
    let [l0, l1] = length.to_le_bytes();
    [request_type, 6, index, kind, i0, i1, l0, l1]
}

const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];

/// What Linux asks of a new HID device, in its order, as far as the answers tell
/// (the configuration's length, the language, the report descriptor's length).
fn linux_enumeration(total: u16, language: u16, report: u16) -> Vec<[u8; 8]> {
    vec![
        get_descriptor(0x80, 1, 0, 0, 64),
        get_descriptor(0x80, 1, 0, 0, 18),
        get_descriptor(0x80, 2, 0, 0, 9),
        get_descriptor(0x80, 2, 0, 0, total),
        get_descriptor(0x80, 3, 0, 0, 255),
        get_descriptor(0x80, 3, 2, language, 255),
        get_descriptor(0x80, 3, 1, language, 255),
        get_descriptor(0x80, 3, 3, language, 255),
        SET_CONFIGURATION_1,
        get_descriptor(0x81, 0x22, 0, 0, report),
    ]
}

/// One control request through the relay: (status, data) of its RET_SUBMIT.
async fn control(kernel: &mut UnixStream, seqnum: u32, devid: u32, setup: [u8; 8]) -> (i32, Bytes) {
    let length = u32::from(u16::from_le_bytes([setup[6], setup[7]]));
    let direction = if setup[0] & 0x80 != 0 { Direction::In } else { Direction::Out };
    let mut wire = BytesMut::new();
    CmdSubmit::new(
        seqnum,
        devid,
        direction,
        0,
        if direction == Direction::In { length } else { 0 },
        setup,
        Bytes::new(),
    )
    .encode(&mut wire);
    kernel.write_all(&wire).await.unwrap();
    let mut header = [0u8; HEADER_LEN];
    tokio::time::timeout(Duration::from_secs(5), kernel.read_exact(&mut header)).await.unwrap().unwrap();
    assert_eq!(header[..4], 3u32.to_be_bytes(), "a RET_SUBMIT");
    assert_eq!(header[4..8], seqnum.to_be_bytes());
    let status = i32::from_be_bytes(header[0x14..0x18].try_into().unwrap());
    let actual = u32::from_be_bytes(header[0x18..0x1c].try_into().unwrap());
    let mut data = vec![0u8; if direction == Direction::In { actual as usize } else { 0 }];
    kernel.read_exact(&mut data).await.unwrap();
    (status, data.into())
}

/// Runs Linux's enumeration through a kernel relay over `imported`; the replies.
async fn enumerate(server: &TestServer, imported: Imported, accelerate: bool) -> Vec<(i32, Bytes)> {
    let devid = imported.device.devid();
    let upstream = Upstream {
        addr: server.addr(),
        security: Security::Plain,
        transforms: vec![],
        resume: imported.resume,
        give_up_after: Duration::from_secs(10),
        storage: false,
        descriptors: imported.descriptors.filter(|_| accelerate),
    };
    let (mut kernel, relay_end) = UnixStream::pair().unwrap();
    let relay = tokio::spawn(kernel_relay::run(relay_end, imported.stream, devid, upstream, None, None));
    let mut replies = Vec::new();
    // The lengths the later requests use come from the earlier answers, as in the kernel.
    let head = control(&mut kernel, 1, devid, get_descriptor(0x80, 2, 0, 0, 9)).await.1;
    let total = u16::from_le_bytes([head[2], head[3]]);
    let languages = control(&mut kernel, 2, devid, get_descriptor(0x80, 3, 0, 0, 255)).await.1;
    let language = u16::from_le_bytes([languages[2], languages[3]]);
    let whole = control(&mut kernel, 3, devid, get_descriptor(0x80, 2, 0, 0, total)).await.1;
    let report = whole.windows(3).find(|w| w[0] == 0x22).map(|w| u16::from_le_bytes([w[1], w[2]])).unwrap();
    for (setup, seqnum) in linux_enumeration(total, language, report).into_iter().zip(4u32..) {
        replies.push(control(&mut kernel, seqnum, devid, setup).await);
    }
    drop(kernel);
    relay.await.unwrap().unwrap();
    replies
}

fn descriptor_requests(seen: &[[u8; 8]]) -> usize {
    seen.iter().filter(|setup| setup[1] == 6).count()
}

#[tokio::test]
async fn the_kernels_enumeration_is_answered_from_the_snapshot_as_the_device_answers_it() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (keyboard, _keys) = usbwire_gadgets::hid::keyboard();
    let device = Noting { inner: Box::new(keyboard), seen: seen.clone() };
    let server = TestServer::builder().device("keyboard", Box::new(device)).start().await;
    let busid = BusId::new("0-1").unwrap();

    // The reference: acceleration off, every request to the device, no snapshot taken.
    let plain =
        usbwire_client::import_for_relay(server.addr(), &busid, &Security::Plain, &[], None, false).await.unwrap();
    assert!(plain.descriptors.is_none() && !plain.storage, "nothing offered, nothing sent");
    assert_eq!(descriptor_requests(&seen.lock().unwrap()), 0);
    let reference = enumerate(&server, plain, false).await;
    let asked = linux_enumeration(0, 0, 0).len();
    assert_eq!(descriptor_requests(&seen.lock().unwrap()), 3 + asked - 1, "every GET_DESCRIPTOR reached the device");
    seen.lock().unwrap().clear();

    // Accelerated: the snapshot is taken at import, and the kernel's requests are answered from it.
    let accelerated = loop {
        match usbwire_client::import_resumable(server.addr(), &busid, &Security::Plain, &[]).await {
            Ok(imported) => break imported,
            // The previous import's release may not be done yet.
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let snapshot = accelerated.descriptors.clone().expect("a usbwire server sends the snapshot when asked");
    let taken = descriptor_requests(&seen.lock().unwrap());
    assert_eq!(taken, snapshot.entries().len() + 1, "one request per descriptor, the configuration twice");
    let replies = enumerate(&server, accelerated, true).await;
    assert_eq!(replies, reference, "every reply as the device gave it");
    let seen = seen.lock().unwrap();
    assert_eq!(descriptor_requests(&seen), taken, "no GET_DESCRIPTOR of the kernel's reached the device: {seen:02x?}");
    assert!(seen.contains(&SET_CONFIGURATION_1), "every other request still does");
}
