//! The USB/IP server the `redir_bridge` harness's connection talks to: it
//! decodes what the client writes (panicking on anything malformed: the
//! client is ours), keeps the commands it has not answered, and answers the
//! one the fuzz input picks, in the way it picks: whole, short, failed,
//! cancelled, or the way a kernel stub or a usbwire server answers an unlink.
//! It plays the model device of the `redir_host` harness (its descriptors
//! for GET_DESCRIPTOR) so enumeration can succeed.
//!
//! Not a server: no OP phase, no device behind it, no budget of its own; a
//! hostile server's malformed bytes are the harness's raw input, not this.

use std::collections::HashSet;

use bytes::{Bytes, BytesMut};
use usbwire_proto::urb::{self, ClientMessage, CmdSubmit, CmdUnlink, IsoPacketDescriptor, RetSubmit, RetUnlink};
use usbwire_proto::{liveness, resume, Direction, Limits, Status};

use crate::redir_host::{CONFIGURATION, DEVICE};

/// The most IN data one answer carries (a guest may ask for 128 MiB).
pub(crate) const MAX_IN: usize = 64 * 1024;

/// A command the server received and has not answered.
pub(crate) enum Received {
    Submit(CmdSubmit),
    Unlink(CmdUnlink),
}

#[derive(Default)]
pub(crate) struct ModelServer {
    /// What the client wrote, not decoded yet.
    from_client: BytesMut,
    /// Commands not answered yet, in the order they came.
    pub(crate) received: Vec<Received>,
    /// Every seqnum the client used, for freshness.
    seen: HashSet<u32>,
    /// Bytes for the client, not delivered yet.
    pub(crate) to_client: BytesMut,
    /// The client ended the session (a resumable session's END).
    pub(crate) ended: bool,
}

impl ModelServer {
    /// Takes what the client wrote; every command must decode and use a fresh seqnum.
    pub(crate) fn receive(&mut self, bytes: &[u8]) {
        self.from_client.extend_from_slice(bytes);
        loop {
            if self.from_client.len() < urb::HEADER_LEN {
                return;
            }
            let header: &[u8] = &self.from_client[..urb::HEADER_LEN];
            let command = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
            if liveness::is_ping(header) || resume::parse_ack(header).is_some() || command == resume::END.0 {
                assert!(!self.ended, "the client wrote after ending the session");
                self.ended |= command == resume::END.0;
                let _ = self.from_client.split_to(urb::HEADER_LEN);
                continue;
            }
            let iso = i32::from_be_bytes([header[0x20], header[0x21], header[0x22], header[0x23]]) > 0;
            let message = urb::decode_command(&mut self.from_client, &Limits::default(), |_, _| iso)
                .expect("the client wrote a malformed command");
            let Some(message) = message else { return };
            assert!(!self.ended, "the client wrote after ending the session");
            let (seqnum, received) = match message {
                ClientMessage::Submit(submit) => (submit.seqnum, Received::Submit(submit)),
                ClientMessage::Unlink(unlink) => {
                    assert!(self.seen.contains(&unlink.unlink_seqnum), "an unlink of a seqnum never submitted");
                    (unlink.seqnum, Received::Unlink(unlink))
                }
            };
            assert!(self.seen.insert(seqnum), "seqnum {seqnum} used twice");
            self.received.push(received);
        }
    }

    /// Answers the unanswered command number `pick` (modulo their count) as
    /// `how` says. Returns whether there was one.
    pub(crate) fn answer(&mut self, pick: u8, how: u8) -> bool {
        if self.received.is_empty() {
            return false;
        }
        let at = usize::from(pick) % self.received.len();
        match self.received.remove(at) {
            Received::Submit(submit) => {
                let ret = answer_submit(&submit, how);
                ret.encode(&mut self.to_client);
            }
            Received::Unlink(unlink) => {
                let target = self.received.iter().position(
                    |received| matches!(received, Received::Submit(submit) if submit.seqnum == unlink.unlink_seqnum),
                );
                let status = match (target, how % 2) {
                    // The kernel stub's way: the RET_UNLINK is the cancelled URB's only answer.
                    (Some(target), 0) => {
                        self.received.remove(target);
                        Status::ECONNRESET
                    }
                    // usbwire's way: the URB answered as cancelled, then the unlink as too late.
                    (Some(target), _) => {
                        if let Received::Submit(submit) = self.received.remove(target) {
                            cancelled(submit.seqnum).encode(&mut self.to_client);
                        }
                        Status::OK
                    }
                    // Its URB was answered already.
                    (None, _) => Status::OK,
                };
                self.to_client.extend_from_slice(&RetUnlink { seqnum: unlink.seqnum, status }.header());
            }
        }
        true
    }
}

fn cancelled(seqnum: u32) -> RetSubmit {
    RetSubmit::new(seqnum, Status::ECONNRESET, Bytes::new())
}

/// The answer to `submit`: `how % 8` is 0–3 success (IN: the whole length,
/// half of it, none, or what the model device has for a GET_DESCRIPTOR),
/// 4 a stall, 5 a protocol error, 6 the device gone, 7 cancelled.
fn answer_submit(submit: &CmdSubmit, how: u8) -> RetSubmit {
    let status = match how % 8 {
        4 => Status::EPIPE,
        5 => Status::EPROTO,
        6 => Status::ENODEV,
        7 => return cancelled(submit.seqnum),
        _ => Status::OK,
    };
    let wanted = (submit.transfer_buffer_length as usize).min(MAX_IN);
    let short = |length: usize| match how % 8 {
        1 => length / 2,
        2 => 0,
        _ => length,
    };
    if !submit.iso_packets.is_empty() {
        return answer_iso(submit, status, &short);
    }
    let (actual_length, data) = match (submit.direction, status) {
        (Direction::In, Status::OK) => {
            let data = match (how % 8, submit.ep, submit.setup[1], submit.setup[3]) {
                (3, 0, 0x06, 0x01) => Bytes::copy_from_slice(&DEVICE[..wanted.min(DEVICE.len())]),
                (3, 0, 0x06, 0x02) => Bytes::copy_from_slice(&CONFIGURATION[..wanted.min(CONFIGURATION.len())]),
                (3, 0, 0x08, _) => Bytes::copy_from_slice(&[1][..wanted.min(1)]),
                _ => Bytes::from(vec![0xa5; short(wanted)]),
            };
            (data.len() as u32, data)
        }
        (Direction::Out, Status::OK) => (short(submit.data.len()) as u32, Bytes::new()),
        _ => (0, Bytes::new()),
    };
    RetSubmit {
        seqnum: submit.seqnum,
        status,
        actual_length,
        start_frame: 0,
        number_of_packets: 0,
        error_count: 0,
        data,
        iso_packets: Vec::new(),
    }
}

/// An isochronous answer: every packet's actual length (IN data compacted, as
/// the kernel's stub sends it), the URB's status as given.
fn answer_iso(submit: &CmdSubmit, status: Status, short: &dyn Fn(usize) -> usize) -> RetSubmit {
    let mut data = Vec::new();
    let mut actual_length = 0u32;
    let iso_packets = submit
        .iso_packets
        .iter()
        .map(|packet| {
            let actual = if status == Status::OK { short(packet.length as usize).min(MAX_IN) as u32 } else { 0 };
            if submit.direction == Direction::In {
                data.extend(std::iter::repeat_n(0x5a, actual as usize));
            }
            actual_length += actual;
            IsoPacketDescriptor { offset: packet.offset, length: packet.length, actual_length: actual, status }
        })
        .collect();
    RetSubmit {
        seqnum: submit.seqnum,
        status,
        actual_length,
        start_frame: 0,
        number_of_packets: submit.number_of_packets,
        error_count: 0,
        data: data.into(),
        iso_packets,
    }
}
