//! URBs as a device sees them, and their completions.

use bytes::Bytes;
use usbwire_proto::urb::{CmdSubmit, IsoPacketDescriptor, RetSubmit, TransferFlags};
use usbwire_proto::{Direction, Status};

/// The four USB transfer types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferType {
    Control,
    Isochronous,
    Bulk,
    Interrupt,
}

impl TransferType {
    /// From the low two bits of an endpoint descriptor's `bmAttributes`.
    pub fn from_attributes(attributes: u8) -> Self {
        match attributes & 0x03 {
            0 => Self::Control,
            1 => Self::Isochronous,
            2 => Self::Bulk,
            _ => Self::Interrupt,
        }
    }
}

/// One USB request block: a transfer the host asks the device to perform.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Urb {
    /// The client's id for this URB; completions and cancels refer to it.
    pub seqnum: u32,
    /// Endpoint number, 0..=15.
    pub endpoint: u8,
    pub direction: Direction,
    /// The SETUP packet of a control transfer (zeros otherwise).
    pub setup: [u8; 8],
    pub flags: TransferFlags,
    /// OUT: length of `data`. IN: the most the device may return.
    pub length: u32,
    /// OUT payload.
    pub data: Bytes,
    pub start_frame: i32,
    pub interval: i32,
    /// The submitted `number_of_packets`, echoed in the completion.
    pub number_of_packets: i32,
    /// Isochronous packets (empty for other transfer types).
    pub iso_packets: Vec<IsoPacketDescriptor>,
}

impl Urb {
    /// Takes a decoded `CMD_SUBMIT` apart without copying its payload.
    pub fn from_submit(submit: CmdSubmit) -> Self {
        Self {
            seqnum: submit.seqnum,
            endpoint: submit.ep,
            direction: submit.direction,
            setup: submit.setup,
            flags: submit.transfer_flags,
            length: submit.transfer_buffer_length,
            data: submit.data,
            start_frame: submit.start_frame,
            interval: submit.interval,
            number_of_packets: submit.number_of_packets,
            iso_packets: submit.iso_packets,
        }
    }

    /// The endpoint address with its direction bit (`0x81` for EP1 IN).
    pub fn endpoint_address(&self) -> u8 {
        match self.direction {
            Direction::In => self.endpoint | 0x80,
            Direction::Out => self.endpoint,
        }
    }

    pub fn is_in(&self) -> bool {
        self.direction == Direction::In
    }

    /// A successful IN completion carrying `data` (cut to the requested length).
    pub fn complete_in(&self, mut data: Bytes) -> Completion {
        data.truncate(self.length as usize);
        let status = if self.flags.contains(TransferFlags::SHORT_NOT_OK) && (data.len() as u32) < self.length {
            Status::EREMOTEIO
        } else {
            Status::OK
        };
        Completion { actual_length: data.len() as u32, data, ..self.complete_with(status) }
    }

    /// A successful OUT completion: every byte was taken.
    pub fn complete_out(&self) -> Completion {
        Completion { actual_length: self.data.len() as u32, ..self.complete_with(Status::OK) }
    }

    /// A completion with no data and the given status.
    pub fn complete_with(&self, status: Status) -> Completion {
        Completion {
            seqnum: self.seqnum,
            status,
            actual_length: 0,
            data: Bytes::new(),
            start_frame: self.start_frame,
            number_of_packets: self.number_of_packets,
            error_count: 0,
            iso_packets: self.iso_packets.clone(),
        }
    }
}

/// The result of one URB.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    pub seqnum: u32,
    pub status: Status,
    pub actual_length: u32,
    /// IN data, `actual_length` bytes (compacted for isochronous IN).
    pub data: Bytes,
    pub start_frame: i32,
    pub number_of_packets: i32,
    pub error_count: i32,
    pub iso_packets: Vec<IsoPacketDescriptor>,
}

impl Completion {
    /// The `RET_SUBMIT` that reports this completion. For a non-isochronous
    /// URB `number_of_packets` is 0, as the Linux stub sends it.
    pub fn into_ret_submit(self) -> RetSubmit {
        let number_of_packets =
            if self.iso_packets.is_empty() && self.number_of_packets <= 0 { 0 } else { self.number_of_packets };
        RetSubmit {
            seqnum: self.seqnum,
            status: self.status,
            actual_length: self.actual_length,
            start_frame: self.start_frame,
            number_of_packets,
            error_count: self.error_count,
            data: self.data,
            iso_packets: self.iso_packets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn urb(direction: Direction, length: u32, flags: u32) -> Urb {
        Urb {
            seqnum: 5,
            endpoint: 1,
            direction,
            setup: [0; 8],
            flags: TransferFlags(flags),
            length,
            data: Bytes::new(),
            start_frame: 0,
            interval: 0,
            number_of_packets: -1,
            iso_packets: vec![],
        }
    }

    #[test]
    fn in_data_is_cut_to_the_requested_length() {
        let done = urb(Direction::In, 4, 0).complete_in(Bytes::from_static(b"abcdef"));
        assert_eq!(done.actual_length, 4);
        assert_eq!(&done.data[..], b"abcd");
        assert_eq!(done.status, Status::OK);
    }

    #[test]
    fn short_read_with_short_not_ok_is_eremoteio() {
        let done = urb(Direction::In, 8, TransferFlags::SHORT_NOT_OK).complete_in(Bytes::from_static(b"ab"));
        assert_eq!(done.status, Status::EREMOTEIO);
        assert_eq!(done.actual_length, 2);
    }

    #[test]
    fn non_iso_reply_sends_zero_packets() {
        let ret = urb(Direction::Out, 0, 0).complete_out().into_ret_submit();
        assert_eq!(ret.number_of_packets, 0);
        assert_eq!(urb(Direction::In, 1, 0).endpoint_address(), 0x81);
    }
}
