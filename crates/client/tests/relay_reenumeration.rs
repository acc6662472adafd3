//! The kernel relay when the device re-enumerates: a stand-in for vhci-hcd
//! sends DFU_DETACH to the DFU device of a real server through the relay; the
//! detach's reply reaches the "kernel" before the relay ends, and it ends
//! with `RelayError::Reenumerated` — what `usbwire attach --follow` acts on —
//! while the same bus id can be imported at once as the bootloader.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use usbwire_client::kernel_relay;
use usbwire_client::relay::{RelayError, Upstream};
use usbwire_client::Security;
use usbwire_gadgets::dfu::{machine::request, DfuDevice, DfuOptions, DFU_PRODUCT_ID, RUNTIME_DFU_INTERFACE};
use usbwire_proto::op::BusId;
use usbwire_proto::urb::{CmdSubmit, TransferFlags, HEADER_LEN};
use usbwire_proto::{Direction, Status};
use usbwire_testing::TestServer;

const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];

fn control_out(seqnum: u32, devid: u32, setup: [u8; 8]) -> BytesMut {
    let submit = CmdSubmit {
        seqnum,
        devid,
        direction: Direction::Out,
        ep: 0,
        transfer_flags: TransferFlags::default(),
        transfer_buffer_length: 0,
        start_frame: 0,
        number_of_packets: 0,
        interval: 0,
        setup,
        data: Bytes::new(),
        iso_packets: vec![],
    };
    let mut wire = BytesMut::new();
    submit.encode(&mut wire);
    wire
}

#[tokio::test]
async fn the_detach_reply_reaches_the_kernel_before_the_relay_ends_as_a_reenumeration() {
    let dir = usbwire_testing::process::scratch("relay", "dfu");
    let device = DfuDevice::open(&dir.join("fw.bin"), &DfuOptions::default()).unwrap();
    let server = TestServer::builder().device("dfu", Box::new(device)).start().await;
    let busid = BusId::new("0-1").unwrap();
    let imported = usbwire_client::import_resumable(server.addr(), &busid, &Security::Plain, &[]).await.unwrap();
    let devid = imported.device.devid();
    let upstream = Upstream {
        addr: server.addr(),
        security: Security::Plain,
        transforms: vec![],
        resume: imported.resume,
        give_up_after: Duration::from_secs(10),
        storage: false,
        descriptors: None,
    };
    let (mut kernel, relay_end) = UnixStream::pair().unwrap();
    let relay = tokio::spawn(kernel_relay::run(relay_end, imported.stream, devid, upstream, None, None));

    kernel.write_all(&control_out(1, devid, SET_CONFIGURATION_1)).await.unwrap();
    let detach = [0x21, request::DETACH, 0xe8, 0x03, RUNTIME_DFU_INTERFACE, 0, 0, 0];
    kernel.write_all(&control_out(2, devid, detach)).await.unwrap();
    let mut replies = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), kernel.read_to_end(&mut replies)).await;
    assert!(read.is_ok(), "the relay closes the kernel's socket once the device re-enumerated");
    assert_eq!(replies.len(), 2 * HEADER_LEN, "both replies, then the end: {replies:02x?}");
    for (reply, seqnum) in replies.chunks(HEADER_LEN).zip(1u32..) {
        assert_eq!(reply[..4], 3u32.to_be_bytes(), "a RET_SUBMIT");
        assert_eq!(reply[4..8], seqnum.to_be_bytes());
        assert_eq!(reply[0x14..0x18], Status::OK.0.to_be_bytes());
    }
    let ended = relay.await.unwrap();
    assert!(matches!(ended, Err(RelayError::Reenumerated { addr }) if addr == server.addr()), "{ended:?}");

    // What a follower does next: the same bus id, now the bootloader.
    let again = usbwire_client::import_resumable(server.addr(), &busid, &Security::Plain, &[]).await.unwrap();
    assert_eq!(again.device.id_product, DFU_PRODUCT_ID);
    assert_eq!(again.device.devid(), devid, "the same port");
    let _ = std::fs::remove_dir_all(&dir);
}
