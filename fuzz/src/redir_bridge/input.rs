//! The redir_bridge harness's input read as steps: [`Op`], what one step does,
//! and [`Input`], which reads ops and the guest packets they carry from the
//! fuzzer's bytes (the format is in the parent module's docs).

use std::time::Duration;

use bytes::Bytes;
use usbwire_redir::{Caps, Packet, Status};

/// The most data a guest packet built from the input carries (past every budget's bytes).
const MAX_OUT: usize = 8 * 1024;
/// What one input step does.
pub(super) enum Op {
    GuestRaw(Vec<u8>),
    GuestPacket(u64, Packet),
    ServerAnswers {
        pick: u8,
        how: u8,
    },
    ServerRaw(Vec<u8>),
    /// The guest reads this many bytes (0: all it has been sent).
    GuestReads(usize),
    TimePasses(Duration),
    ServerGone,
    GuestHangsUp,
    ServerReading(bool),
    /// The device re-enumerates (bridges that follow only).
    Reenumerates,
    /// The device is back and imported again (bridges that follow only).
    ImportedAgain,
}

/// The input, read a field at a time; `None` once it runs out.
pub(super) struct Input<'a>(pub(super) &'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&first, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(first)
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes([self.byte()?, self.byte()?]))
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        taken.to_vec()
    }

    /// The next op; `follows` adds the re-enumeration ops (9, 10).
    pub(super) fn op(&mut self, follows: bool) -> Option<Op> {
        let kinds = if follows { 11 } else { 9 };
        Some(match self.byte()? % kinds {
            0 => {
                let n = self.byte()?;
                Op::GuestRaw(self.bytes(usize::from(n)))
            }
            1 => {
                let (id, packet) = self.packet()?;
                Op::GuestPacket(id, packet)
            }
            2 => Op::ServerAnswers { pick: self.byte()?, how: self.byte()? },
            3 => {
                let n = self.byte()?;
                Op::ServerRaw(self.bytes(usize::from(n)))
            }
            4 => Op::GuestReads(usize::from(self.byte()?) * 64),
            5 => Op::TimePasses(Duration::from_millis(u64::from(self.byte()?) * 50)),
            6 => Op::ServerGone,
            7 => Op::GuestHangsUp,
            8 => Op::ServerReading(self.byte()? % 2 == 0),
            9 => Op::Reenumerates,
            _ => Op::ImportedAgain,
        })
    }

    /// A guest packet and its id, its fields from the input (data made up to its length).
    pub(super) fn packet(&mut self) -> Option<(u64, Packet)> {
        let kind = self.byte()?;
        let id = u64::from(self.byte()?);
        let endpoint = self.byte()?;
        let data = |length: usize, endpoint: u8| match endpoint & 0x80 {
            0 => Bytes::from(vec![0x3c; length.min(MAX_OUT)]),
            _ => Bytes::new(),
        };
        let status = Status::SUCCESS;
        let packet = match kind % 20 {
            0 => {
                let (request, requesttype) = (self.byte()?, self.byte()?);
                let (value, index, length) = (self.u16()?, self.u16()?, self.u16()?);
                let endpoint = requesttype & 0x80;
                let data = data(usize::from(length), endpoint);
                let length = if endpoint == 0 { data.len() as u16 } else { length };
                Packet::Control { endpoint, request, requesttype, status, value, index, length, data }
            }
            1 => {
                // IN claims reach the codec's limit; OUT data stays within MAX_OUT.
                let length = u32::from(self.u16()?) << (self.byte()? % 12);
                let data = data(length as usize, endpoint);
                let length = if endpoint & 0x80 == 0 { data.len() as u32 } else { length };
                Packet::Bulk { endpoint, status, length, stream_id: 0, data }
            }
            2 => {
                let data = data(usize::from(self.u16()?), endpoint);
                Packet::Interrupt { endpoint, status, length: data.len() as u16, data }
            }
            3 => {
                let data = data(usize::from(self.u16()?), endpoint);
                Packet::Iso { endpoint, status, length: data.len() as u16, data }
            }
            4 => Packet::StartInterruptReceiving { endpoint },
            5 => Packet::StopInterruptReceiving { endpoint },
            6 => Packet::StartIsoStream { endpoint, pkts_per_urb: self.byte()?, no_urbs: self.byte()? },
            7 => Packet::StopIsoStream { endpoint },
            8 => Packet::CancelDataPacket,
            9 => Packet::SetConfiguration { configuration: endpoint },
            10 => Packet::GetConfiguration,
            11 => Packet::SetAltSetting { interface: endpoint, alt: self.byte()? },
            12 => Packet::GetAltSetting { interface: endpoint },
            13 => Packet::Reset,
            14 => {
                let rules = match endpoint % 4 {
                    0 => "-1,-1,-1,-1,1",
                    1 => "0x03,-1,-1,-1,0|-1,-1,-1,-1,1",
                    2 => "-1,0x1209,-1,-1,0|-1,-1,-1,-1,1",
                    _ => "not a rule",
                };
                Packet::FilterFilter { rules: rules.into() }
            }
            15 => Packet::FilterReject,
            16 => Packet::DeviceDisconnectAck,
            17 => Packet::AllocBulkStreams { endpoints: u32::from(endpoint), no_streams: u32::from(self.byte()?) },
            18 => Packet::StartBulkReceiving {
                stream_id: 0,
                bytes_per_transfer: u32::from(self.u16()?),
                endpoint,
                no_transfers: self.byte()?,
            },
            _ => Packet::Hello { version: "fuzz again".into(), caps: Caps(u32::from(endpoint)) },
        };
        Some((id, packet))
    }
}
