//! A device that re-enumerates while imported (the DFU device: DFU_DETACH
//! into its bootloader, manifestation back into its firmware): the replies
//! before the switch reach the client, a resumable import ends with END
//! saying why, a stock one with a plain close, and the same bus id is
//! exported again as the new device, without a reset, within 100 ms.

use std::net::SocketAddr;
use std::time::{Duration, Instant};
use usbwire_testing::process::Scratch;

use sha2::Digest as _;
use usbwire_client::Security;
use usbwire_gadgets::dfu::{DfuDevice, DfuOptions, DFU_PRODUCT_ID, RUNTIME_PRODUCT_ID, TRANSFER_SIZE};
use usbwire_proto::op::BusId;
use usbwire_proto::resume::EndReason;
use usbwire_proto::Direction;
use usbwire_testing::dfu::{Reply, UrbHost};
use usbwire_testing::TestServer;
use usbwire_transport::PeerStream;

/// What the server promises: the new device is listed this soon after the switch.
const REEXPORT_WITHIN: Duration = Duration::from_millis(100);

fn scratch(name: &str) -> Scratch {
    usbwire_testing::process::scratch("reenumeration", name)
}

async fn dfu_server(firmware: &std::path::Path) -> SocketAddr {
    let device = DfuDevice::open(firmware, &DfuOptions::default()).unwrap();
    TestServer::builder().device("dfu", Box::new(device)).start().await.keep_running()
}

fn busid() -> BusId {
    BusId::new("0-1").unwrap()
}

/// An import speaking raw URBs.
type Import = UrbHost<PeerStream>;

async fn resumable(addr: SocketAddr) -> Import {
    let imported = usbwire_client::import_resumable(addr, &busid(), &Security::Plain, &[]).await.unwrap();
    assert!(imported.resume.is_some(), "a usbwire server grants resume");
    UrbHost::new(imported.stream, imported.device.devid())
}

async fn stock(addr: SocketAddr) -> Import {
    let (stream, record) = usbwire_client::import(addr, &busid(), &Security::Plain).await.unwrap();
    UrbHost::new(stream, record.devid())
}

/// Waits until 0-1 is listed with `product_id`; returns how long that took.
async fn listed_as(addr: SocketAddr, product_id: u16, since: Instant) -> Duration {
    loop {
        let devices = usbwire_client::list_devices(addr, &Security::Plain).await.unwrap();
        if devices.iter().any(|d| d.busid == busid() && d.id_product == product_id) {
            return since.elapsed();
        }
        assert!(since.elapsed() < Duration::from_secs(5), "0-1 never came back as {product_id:04x}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Runtime → DFU mode: the detach's reply, then END(REENUMERATED); returns when END arrived.
async fn detach(import: &mut Import) -> Instant {
    import.detach().await;
    let end = import.next(Direction::In).await;
    let ended = Instant::now();
    assert_eq!(end, Reply::End(EndReason::REENUMERATED), "the import ends saying the device re-enumerated");
    ended
}

#[tokio::test]
async fn detach_and_manifestation_end_the_import_as_a_reenumeration_and_reexport_the_bus_id() {
    let dir = scratch("flash");
    let firmware = dir.join("fw.bin");
    let addr = dfu_server(&firmware).await;

    let mut runtime = resumable(addr).await;
    let ended = detach(&mut runtime).await;
    assert_eq!(runtime.next(Direction::In).await, Reply::Closed, "nothing after the end");
    let took = listed_as(addr, DFU_PRODUCT_ID, ended).await;
    assert!(took < REEXPORT_WITHIN, "the bootloader was listed {took:?} after the end");
    eprintln!("bootloader listed {} us after the end", took.as_micros());

    // Flash a small image in the bootloader, as dfu-util does.
    let image: Vec<u8> = (0..3 * usize::from(TRANSFER_SIZE) + 100).map(|i| (i * 7 + i / 251) as u8).collect();
    let mut bootloader = resumable(addr).await;
    assert_eq!(bootloader.devid(), runtime.devid(), "the same port");
    bootloader.download(&image).await;
    assert_eq!(bootloader.next(Direction::In).await, Reply::End(EndReason::REENUMERATED));
    let took = listed_as(addr, RUNTIME_PRODUCT_ID, Instant::now()).await;
    assert!(took < REEXPORT_WITHIN, "the new firmware was listed {took:?} after the end");
    eprintln!("new firmware listed {} us after the end", took.as_micros());

    // The runtime device runs the image: its product string says so.
    let digest: String = sha2::Sha256::digest(&image).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(std::fs::read(&firmware).unwrap(), image, "FILE holds the image");
    let states = usbwire_client::device_states(addr, &Security::Plain).await.unwrap().unwrap();
    let product = &states.iter().find(|s| s.busid == "0-1").unwrap().product;
    assert_eq!(product, &format!("usbwire DFU demo (fw {})", &digest[..8]));
}

#[tokio::test]
async fn after_the_end_the_server_reads_on_until_the_client_closes_so_it_never_resets_the_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = scratch("linger");
    let addr = dfu_server(&dir.join("fw.bin")).await;
    let mut runtime = resumable(addr).await;
    detach(&mut runtime).await;
    let mut stream = runtime.into_stream();
    // A client that sent on before it read the end: a server that closed
    // with these unread would reset the connection, and a proxy on the way
    // would drop the end it still held.
    let late = vec![0u8; 64 * 1024];
    stream.write_all(&late).await.expect("the server still reads");
    tokio::time::sleep(Duration::from_millis(200)).await;
    stream.write_all(&late).await.expect("the server still reads 200 ms later: no reset came back");
    stream.shutdown().await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
    assert!(matches!(read, Ok(Ok(0))), "a plain close after the end, no reset: {read:?}");
}

#[tokio::test]
async fn a_stock_importer_gets_the_detach_reply_then_an_ordinary_close() {
    let dir = scratch("stock");
    let firmware = dir.join("fw.bin");
    let addr = dfu_server(&firmware).await;
    let mut stock = stock(addr).await;
    stock.detach().await;
    let ended = Instant::now();
    assert_eq!(stock.next(Direction::In).await, Reply::Closed, "no usbwire message to a stock client");
    let took = listed_as(addr, DFU_PRODUCT_ID, ended).await;
    assert!(took < REEXPORT_WITHIN, "the bootloader was listed {took:?} after the close");
}
