//! [`Transfer`]: what a caller asks of an endpoint, with builders per transfer type.

use bytes::Bytes;
use usbwire_proto::urb::{CmdSubmit, IsoPacketDescriptor, RetSubmit, TransferFlags};
use usbwire_proto::{Direction, Status};

/// A transfer to submit.
#[derive(Clone, Debug)]
pub struct Transfer {
    pub endpoint: u8,
    pub direction: Direction,
    /// SETUP packet for control transfers.
    pub setup: [u8; 8],
    pub flags: u32,
    /// IN: bytes wanted. OUT: ignored (the data's length is used).
    pub length: u32,
    pub data: Bytes,
    pub interval: i32,
    /// Isochronous packets; `Some` marks the endpoint as isochronous.
    pub iso_packets: Option<Vec<IsoPacketDescriptor>>,
}

impl Transfer {
    pub fn control_in(setup: [u8; 8]) -> Self {
        let length = u32::from(u16::from_le_bytes([setup[6], setup[7]]));
        Self {
            endpoint: 0,
            direction: Direction::In,
            setup,
            flags: TransferFlags::DIR_IN,
            length,
            data: Bytes::new(),
            interval: 0,
            iso_packets: None,
        }
    }

    pub fn control_out(setup: [u8; 8], data: Bytes) -> Self {
        Self {
            endpoint: 0,
            direction: Direction::Out,
            setup,
            flags: 0,
            length: data.len() as u32,
            data,
            interval: 0,
            iso_packets: None,
        }
    }

    pub fn bulk_in(endpoint: u8, length: u32) -> Self {
        Self {
            endpoint: endpoint & 0x0f,
            direction: Direction::In,
            setup: [0; 8],
            flags: TransferFlags::DIR_IN,
            length,
            data: Bytes::new(),
            interval: 0,
            iso_packets: None,
        }
    }

    pub fn bulk_out(endpoint: u8, data: Bytes) -> Self {
        Self {
            endpoint: endpoint & 0x0f,
            direction: Direction::Out,
            setup: [0; 8],
            flags: 0,
            length: data.len() as u32,
            data,
            interval: 0,
            iso_packets: None,
        }
    }
}

/// The status a RET_SUBMIT carries, for callers that only care about success.
pub fn is_ok(ret: &RetSubmit) -> bool {
    ret.status == Status::OK
}

/// The `CMD_SUBMIT` for `transfer`.
pub(crate) fn build_submit(devid: u32, seqnum: u32, transfer: Transfer) -> CmdSubmit {
    let length = match transfer.direction {
        Direction::Out => transfer.data.len() as u32,
        Direction::In => transfer.length,
    };
    CmdSubmit {
        seqnum,
        devid,
        direction: transfer.direction,
        ep: transfer.endpoint,
        transfer_flags: TransferFlags(transfer.flags),
        transfer_buffer_length: length,
        start_frame: 0,
        number_of_packets: transfer.iso_packets.as_ref().map_or(0, |p| p.len() as i32),
        interval: transfer.interval,
        setup: transfer.setup,
        data: transfer.data,
        iso_packets: transfer.iso_packets.unwrap_or_default(),
    }
}
