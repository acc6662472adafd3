//! A device that re-enumerates while imported (the DFU device: DFU_DETACH
//! into its bootloader, manifestation back into its firmware): the replies
//! before the switch reach the client, a resumable import ends with END
//! saying why, a stock one with a plain close, and the same bus id is
//! exported again as the new device, without a reset, within 100 ms.

use std::net::SocketAddr;
use std::time::{Duration, Instant};
use usbwire_testing::process::Scratch;

use bytes::{Bytes, BytesMut};
use sha2::Digest as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use usbwire_client::Security;
use usbwire_gadgets::dfu::{
    machine::request, DfuDevice, DfuOptions, State, DFU_MODE_INTERFACE, DFU_PRODUCT_ID, FLASH_ALT,
    RUNTIME_DFU_INTERFACE, RUNTIME_PRODUCT_ID, TRANSFER_SIZE,
};
use usbwire_proto::op::BusId;
use usbwire_proto::resume::{self, EndReason};
use usbwire_proto::urb::{CmdSubmit, TransferFlags, HEADER_LEN};
use usbwire_proto::{Direction, Status};
use usbwire_testing::TestServer;
use usbwire_transport::PeerStream;

/// What the server promises: the new device is listed this soon after the switch.
const REEXPORT_WITHIN: Duration = Duration::from_millis(100);

const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];

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

/// One end of an import, speaking raw URBs.
struct Import {
    stream: PeerStream,
    devid: u32,
    seqnum: u32,
    input: BytesMut,
}

/// What came back for one control request, or how the import ended.
#[derive(Debug, PartialEq)]
enum Reply {
    Done { status: Status, data: Vec<u8> },
    End(EndReason),
    Closed,
}

impl Import {
    async fn resumable(addr: SocketAddr) -> Self {
        let imported = usbwire_client::import_resumable(addr, &busid(), &Security::Plain, &[]).await.unwrap();
        assert!(imported.resume.is_some(), "a usbwire server grants resume");
        Self { stream: imported.stream, devid: imported.device.devid(), seqnum: 0, input: BytesMut::new() }
    }

    async fn stock(addr: SocketAddr) -> Self {
        let (stream, record) = usbwire_client::import(addr, &busid(), &Security::Plain).await.unwrap();
        Self { stream, devid: record.devid(), seqnum: 0, input: BytesMut::new() }
    }

    /// Sends one control request on ep0 and reads what comes back for it.
    async fn control(&mut self, setup: [u8; 8], data: &[u8]) -> Reply {
        self.seqnum += 1;
        let direction = if setup[0] & 0x80 != 0 { Direction::In } else { Direction::Out };
        let length = u32::from(u16::from_le_bytes([setup[6], setup[7]]));
        let submit = CmdSubmit {
            seqnum: self.seqnum,
            devid: self.devid,
            direction,
            ep: 0,
            transfer_flags: TransferFlags(if direction == Direction::In { TransferFlags::DIR_IN } else { 0 }),
            transfer_buffer_length: length,
            start_frame: 0,
            number_of_packets: 0,
            interval: 0,
            setup,
            data: if direction == Direction::Out { Bytes::copy_from_slice(data) } else { Bytes::new() },
            iso_packets: vec![],
        };
        let mut wire = BytesMut::new();
        submit.encode(&mut wire);
        self.stream.write_all(&wire).await.unwrap();
        self.stream.flush().await.unwrap();
        self.next(direction).await
    }

    /// The next reply, skipping keep-alive pings.
    async fn next(&mut self, direction: Direction) -> Reply {
        loop {
            if !self.fill(HEADER_LEN).await {
                return Reply::Closed;
            }
            let word = u32::from_be_bytes(self.input[..4].try_into().unwrap());
            if let Some(reason) = resume::parse_end(&self.input) {
                let _ = self.input.split_to(HEADER_LEN);
                return Reply::End(reason);
            }
            if word == 0x8000_0003 {
                let _ = self.input.split_to(HEADER_LEN);
                continue;
            }
            assert_eq!(word, 3, "a RET_SUBMIT");
            let field = |at: usize| i32::from_be_bytes(self.input[at..at + 4].try_into().unwrap());
            let (status, actual) = (Status(field(0x14)), field(0x18) as usize);
            let data_len = if direction == Direction::In { actual } else { 0 };
            assert!(self.fill(HEADER_LEN + data_len).await, "a reply cut short");
            let message = self.input.split_to(HEADER_LEN + data_len);
            return Reply::Done { status, data: message[HEADER_LEN..].to_vec() };
        }
    }

    /// Reads until `len` bytes are buffered; false at the end of the stream.
    async fn fill(&mut self, len: usize) -> bool {
        while self.input.len() < len {
            let read = tokio::time::timeout(Duration::from_secs(5), self.stream.read_buf(&mut self.input))
                .await
                .expect("the server answers within 5 s");
            if read.unwrap_or(0) == 0 {
                return false;
            }
        }
        true
    }

    async fn ok(&mut self, setup: [u8; 8], data: &[u8]) -> Vec<u8> {
        match self.control(setup, data).await {
            Reply::Done { status: Status::OK, data } => data,
            other => panic!("{setup:02x?}: {other:?}"),
        }
    }

    /// DFU_GETSTATUS: (bStatus, bwPollTimeout, bState).
    async fn get_status(&mut self, interface: u8) -> (u8, Duration, u8) {
        let b = self.ok([0xa1, request::GETSTATUS, 0, 0, interface, 0, 6, 0], &[]).await;
        (b[0], Duration::from_millis(u64::from(u32::from_le_bytes([b[1], b[2], b[3], 0]))), b[4])
    }
}

fn dfu_out(request: u8, interface: u8, value: u16, length: u16) -> [u8; 8] {
    let ([v0, v1], [l0, l1]) = (value.to_le_bytes(), length.to_le_bytes());
    [0x21, request, v0, v1, interface, 0, l0, l1]
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
    import.ok(SET_CONFIGURATION_1, &[]).await;
    import.ok(dfu_out(request::DETACH, RUNTIME_DFU_INTERFACE, 1000, 0), &[]).await;
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

    let mut runtime = Import::resumable(addr).await;
    let ended = detach(&mut runtime).await;
    assert_eq!(runtime.next(Direction::In).await, Reply::Closed, "nothing after the end");
    let took = listed_as(addr, DFU_PRODUCT_ID, ended).await;
    assert!(took < REEXPORT_WITHIN, "the bootloader was listed {took:?} after the end");
    eprintln!("bootloader listed {} us after the end", took.as_micros());

    // Flash a small image in the bootloader, as dfu-util does.
    let image: Vec<u8> = (0..3 * usize::from(TRANSFER_SIZE) + 100).map(|i| (i * 7 + i / 251) as u8).collect();
    let mut bootloader = Import::resumable(addr).await;
    assert_eq!(bootloader.devid, runtime.devid, "the same port");
    bootloader.ok(SET_CONFIGURATION_1, &[]).await;
    bootloader.ok([0x01, 0x0b, FLASH_ALT, 0, DFU_MODE_INTERFACE, 0, 0, 0], &[]).await;
    for (number, block) in image.chunks(usize::from(TRANSFER_SIZE)).enumerate() {
        let setup = dfu_out(request::DNLOAD, DFU_MODE_INTERFACE, number as u16, block.len() as u16);
        bootloader.ok(setup, block).await;
        loop {
            let (status, poll, state) = bootloader.get_status(DFU_MODE_INTERFACE).await;
            assert_eq!(status, 0);
            if state == State::DnloadIdle as u8 {
                break;
            }
            tokio::time::sleep(poll).await;
        }
    }
    bootloader.ok(dfu_out(request::DNLOAD, DFU_MODE_INTERFACE, 0xffff, 0), &[]).await;
    let (status, poll, state) = bootloader.get_status(DFU_MODE_INTERFACE).await;
    assert_eq!((status, state), (0, State::Manifest as u8));
    tokio::time::sleep(poll).await;
    let (status, _, state) = bootloader.get_status(DFU_MODE_INTERFACE).await;
    assert_eq!((status, state), (0, State::ManifestWaitReset as u8), "the last reply reaches the client");
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
async fn a_stock_importer_gets_the_detach_reply_then_an_ordinary_close() {
    let dir = scratch("stock");
    let firmware = dir.join("fw.bin");
    let addr = dfu_server(&firmware).await;
    let mut stock = Import::stock(addr).await;
    stock.ok(SET_CONFIGURATION_1, &[]).await;
    stock.ok(dfu_out(request::DETACH, RUNTIME_DFU_INTERFACE, 1000, 0), &[]).await;
    let ended = Instant::now();
    assert_eq!(stock.next(Direction::In).await, Reply::Closed, "no usbwire message to a stock client");
    let took = listed_as(addr, DFU_PRODUCT_ID, ended).await;
    assert!(took < REEXPORT_WITHIN, "the bootloader was listed {took:?} after the close");
}
