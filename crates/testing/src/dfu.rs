//! A host driving the virtual DFU device (`usbwire_gadgets::dfu`) over raw
//! USB/IP URBs, as a kernel would through vhci-hcd: control requests on
//! ep0 of an import (or of a relay's kernel end), each answered or ending
//! how the import ended (END's reason, or a close), and a flash's steps in
//! the order dfu-util takes them. Used by the tests of re-enumeration and
//! of following a device through it.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use usbwire_gadgets::dfu::{
    machine::request, State, DFU_MODE_INTERFACE, FLASH_ALT, RUNTIME_DFU_INTERFACE, TRANSFER_SIZE,
};
use usbwire_proto::resume::{self, EndReason};
use usbwire_proto::urb::{CmdSubmit, HEADER_LEN};
use usbwire_proto::{liveness, Direction, Status};

/// SET_CONFIGURATION(1), as a host configures the device.
pub const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];

/// How long one reply may take before the test fails.
const REPLY_WITHIN: Duration = Duration::from_secs(5);

/// What came back for one control request, or how the import ended.
#[derive(Debug, PartialEq)]
pub enum Reply {
    Done { status: Status, data: Vec<u8> },
    End(EndReason),
    Closed,
}

/// One end of an import (or a relay's kernel end) speaking raw URBs.
pub struct UrbHost<S> {
    stream: S,
    devid: u32,
    seqnum: u32,
    input: BytesMut,
}

/// A DFU class request to `interface` (host to device).
pub fn dfu_out(request: u8, interface: u8, value: u16, length: u16) -> [u8; 8] {
    let ([v0, v1], [l0, l1]) = (value.to_le_bytes(), length.to_le_bytes());
    [0x21, request, v0, v1, interface, 0, l0, l1]
}

impl<S: AsyncRead + AsyncWrite + Unpin> UrbHost<S> {
    /// URBs for device `devid` on `stream`.
    pub fn new(stream: S, devid: u32) -> Self {
        Self { stream, devid, seqnum: 0, input: BytesMut::new() }
    }

    pub fn devid(&self) -> u32 {
        self.devid
    }

    /// The stream, once nothing more is to be read as URBs (after the end).
    pub fn into_stream(self) -> S {
        self.stream
    }

    /// Sends one control request on ep0 and reads what comes back for it.
    pub async fn control(&mut self, setup: [u8; 8], data: &[u8]) -> Reply {
        self.seqnum += 1;
        let direction = if setup[0] & 0x80 != 0 { Direction::In } else { Direction::Out };
        let length = u32::from(u16::from_le_bytes([setup[6], setup[7]]));
        let data = if direction == Direction::Out { Bytes::copy_from_slice(data) } else { Bytes::new() };
        let submit = CmdSubmit::new(self.seqnum, self.devid, direction, 0, length, setup, data);
        let mut wire = BytesMut::new();
        submit.encode(&mut wire);
        if self.stream.write_all(&wire).await.is_err() || self.stream.flush().await.is_err() {
            return Reply::Closed;
        }
        self.next(direction).await
    }

    /// The next reply (skipping keep-alive pings), END, or the close.
    pub async fn next(&mut self, direction: Direction) -> Reply {
        loop {
            if !self.fill(HEADER_LEN).await {
                return Reply::Closed;
            }
            if let Some(reason) = resume::parse_end(&self.input) {
                let _ = self.input.split_to(HEADER_LEN);
                return Reply::End(reason);
            }
            if liveness::is_ping(&self.input) {
                let _ = self.input.split_to(HEADER_LEN);
                continue;
            }
            let field = |at: usize| {
                i32::from_be_bytes([self.input[at], self.input[at + 1], self.input[at + 2], self.input[at + 3]])
            };
            assert_eq!(field(0), 3, "a RET_SUBMIT: {:02x?}", &self.input[..HEADER_LEN]);
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
            let read = tokio::time::timeout(REPLY_WITHIN, self.stream.read_buf(&mut self.input))
                .await
                .unwrap_or_else(|_| panic!("no reply within {REPLY_WITHIN:?}"));
            if read.unwrap_or(0) == 0 {
                return false;
            }
        }
        true
    }

    /// A request that must succeed; its IN data.
    pub async fn ok(&mut self, setup: [u8; 8], data: &[u8]) -> Vec<u8> {
        match self.control(setup, data).await {
            Reply::Done { status: Status::OK, data } => data,
            other => panic!("{setup:02x?}: {other:?}"),
        }
    }

    /// DFU_GETSTATUS: (bStatus, bwPollTimeout, bState).
    pub async fn get_status(&mut self, interface: u8) -> (u8, Duration, u8) {
        let b = self.ok([0xa1, request::GETSTATUS, 0, 0, interface, 0, 6, 0], &[]).await;
        (b[0], Duration::from_millis(u64::from(u32::from_le_bytes([b[1], b[2], b[3], 0]))), b[4])
    }

    /// In runtime mode: configures the device and sends DFU_DETACH, whose
    /// reply comes back before the device re-enumerates into its bootloader.
    pub async fn detach(&mut self) {
        self.ok(SET_CONFIGURATION_1, &[]).await;
        self.ok(dfu_out(request::DETACH, RUNTIME_DFU_INTERFACE, 1000, 0), &[]).await;
    }

    /// In the bootloader: downloads `image` to the flash as dfu-util does
    /// (each block polled until dfuDNLOAD-IDLE, then the zero-length block),
    /// and polls through manifestation until dfuMANIFEST-WAIT-RESET was
    /// reported; the device re-enumerates into runtime mode after that.
    pub async fn download(&mut self, image: &[u8]) {
        self.ok(SET_CONFIGURATION_1, &[]).await;
        self.ok([0x01, 0x0b, FLASH_ALT, 0, DFU_MODE_INTERFACE, 0, 0, 0], &[]).await;
        for (number, block) in image.chunks(usize::from(TRANSFER_SIZE)).enumerate() {
            let setup = dfu_out(request::DNLOAD, DFU_MODE_INTERFACE, number as u16, block.len() as u16);
            self.ok(setup, block).await;
            loop {
                let (status, poll, state) = self.get_status(DFU_MODE_INTERFACE).await;
                assert_eq!(status, 0, "block {number}");
                if state == State::DnloadIdle as u8 {
                    break;
                }
                tokio::time::sleep(poll).await;
            }
        }
        self.ok(dfu_out(request::DNLOAD, DFU_MODE_INTERFACE, 0xffff, 0), &[]).await;
        let (status, poll, state) = self.get_status(DFU_MODE_INTERFACE).await;
        assert_eq!((status, state), (0, State::Manifest as u8));
        tokio::time::sleep(poll).await;
        let (status, _, state) = self.get_status(DFU_MODE_INTERFACE).await;
        assert_eq!((status, state), (0, State::ManifestWaitReset as u8), "the last reply reaches the host");
    }
}
