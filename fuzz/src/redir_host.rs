//! The `redir_host` harness: a hostile QEMU (usbredir guest) against the
//! bridge's whole host core, [`usbwire_redir::UsbHost`], not just its codec.
//!
//! Input: `[chunking, caps, answers] ++ stream`. The host reads the
//! descriptors of a model device (interrupt IN, bulk IN and OUT, an
//! isochronous alt setting), gets a guest hello announcing `caps`, then
//! `stream` in pieces (`chunking`). After each piece the harness plays the
//! device: every URB the core asks for completes at once, fails, or stays in
//! flight for later, as `answers` (a seed for a deterministic sequence)
//! says; cancels complete their URB as unlinked.
//!
//! Invariants: no panic; every byte the core sends the guest decodes as
//! usbredir on the guest's side (we never send a malformed or
//! direction-breaking packet, whatever the guest did); the core never asks
//! to cancel a URB it did not submit or submit a tag twice; once the device
//! is lost nothing stays in flight and nothing more is submitted.

use std::collections::HashSet;

use bytes::{Bytes, BytesMut};
use usbwire_proto::urb::IsoPacketDescriptor;
use usbwire_proto::{Speed, Status as UrbStatus};
use usbwire_redir::host::{UrbCommand, UrbRequest, UrbResult};
use usbwire_redir::{Caps, Codec, Side, UsbHost, MAX_PACKET_LEN};

/// The model device: high speed, configuration 1 with interface 0 (interrupt
/// IN 0x81), interface 1 (bulk IN 0x82, OUT 0x02) and interface 2 whose alt 1
/// has isochronous IN 0x83 and OUT 0x03.
pub(crate) const DEVICE: [u8; 18] = [18, 1, 0, 2, 0, 0, 0, 64, 0x09, 0x12, 0x05, 0, 0, 1, 1, 2, 3, 1];
pub(crate) const CONFIGURATION: [u8; 80] = [
    9, 2, 80, 0, 3, 1, 0, 0x80, 50, //
    9, 4, 0, 0, 1, 3, 1, 1, 0, //
    7, 5, 0x81, 3, 8, 0, 4, //
    9, 4, 1, 0, 2, 8, 6, 0x50, 0, //
    7, 5, 0x82, 2, 0, 2, 0, //
    7, 5, 0x02, 2, 0, 2, 0, //
    9, 4, 2, 0, 0, 1, 2, 0, 0, //
    9, 4, 2, 1, 2, 1, 2, 0, 0, //
    7, 5, 0x83, 5, 0xc0, 0, 1, //
    7, 5, 0x03, 5, 0xc0, 0, 1,
];

/// The largest IN completion the harness returns (the guest may ask for 4 GiB).
const MAX_IN: u32 = 4096;

/// Deterministic choices from a seed byte (xorshift32).
struct Answers(u32);

impl Answers {
    fn next(&mut self, n: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        self.0 % n
    }
}

/// What the device returns for a URB, per `answers`.
fn device_result(urb: &UrbRequest, answers: &mut Answers) -> UrbResult {
    let status = match answers.next(8) {
        0 => UrbStatus::EPIPE,
        1 => UrbStatus::EPROTO,
        2 => UrbStatus::ENODEV,
        _ => UrbStatus::OK,
    };
    if !urb.is_in() {
        let actual = if status == UrbStatus::OK { urb.data.len() as u32 } else { 0 };
        return UrbResult { status, actual_length: actual, data: Bytes::new(), iso_packets: Vec::new() };
    }
    if urb.iso_packet_lengths.is_empty() {
        let length = urb.length.min(MAX_IN).min(answers.next(MAX_IN + 1));
        let data = Bytes::from(vec![0xa5; length as usize]);
        return UrbResult { status, actual_length: length, data, iso_packets: Vec::new() };
    }
    let mut data = Vec::new();
    let mut offset = 0;
    let iso_packets = urb
        .iso_packet_lengths
        .iter()
        .map(|&length| {
            let actual = length.min(answers.next(length.saturating_add(1).max(1)));
            data.extend(std::iter::repeat_n(0x5a, actual as usize));
            let descriptor = IsoPacketDescriptor { offset, length, actual_length: actual, status: UrbStatus::OK };
            offset += length;
            descriptor
        })
        .collect();
    UrbResult { status, actual_length: data.len() as u32, data: data.into(), iso_packets }
}

/// Answers the enumeration reads the core starts with.
fn enumerate(host: &mut UsbHost) {
    while let Some(UrbCommand::Submit { tag, urb }) = host.poll_urb() {
        let wanted = usize::from(u16::from_le_bytes([urb.setup[6], urb.setup[7]]));
        let reply: &[u8] = match (urb.setup[1], urb.setup[3]) {
            (0x06, 0x01) => &DEVICE,
            (0x06, 0x02) => &CONFIGURATION,
            _ => &[1],
        };
        let data = Bytes::copy_from_slice(&reply[..wanted.min(reply.len())]);
        let result =
            UrbResult { status: UrbStatus::OK, actual_length: data.len() as u32, data, iso_packets: Vec::new() };
        host.handle_urb(tag, result).expect("the model device's descriptors are valid");
    }
}

/// The guest's view: decodes everything the host sent; panics on a malformed packet.
fn guest_reads(guest: &mut Codec, host: &mut UsbHost) {
    let mut wire = host.to_guest().split();
    while let Some(_packet) = guest.decode(&mut wire).expect("the host sent the guest a malformed packet") {}
    assert!(wire.is_empty() || wire.len() < 1 << 20, "a partial packet left over");
}

pub fn redir_host(data: &[u8]) {
    let Some((&[chunking, caps, answers], stream)) = crate::split_control::<3>(data) else { return };
    let caps = Caps(u32::from(caps));
    let mut answers = Answers(u32::from(answers) | 0x5eed_0000);
    let mut host = UsbHost::new("usbwire fuzz", Speed::HIGH);
    enumerate(&mut host);
    let mut guest = Codec::new(Side::Guest, caps, MAX_PACKET_LEN);
    let mut hello = BytesMut::new();
    guest.encode(0, &guest.hello("fuzz"), &mut hello).expect("a hello always encodes");
    host.handle_guest(&mut hello).expect("a valid hello");
    guest_reads(&mut guest, &mut host);

    let mut submitted = HashSet::new();
    let mut in_flight: Vec<(u64, UrbRequest)> = Vec::new();
    let mut buf = BytesMut::new();
    for piece in crate::chunks(stream, chunking) {
        buf.extend_from_slice(piece);
        if host.handle_guest(&mut buf).is_err() {
            break; // the bridge drops this guest; what it sent so far must still be valid
        }
        play_device(&mut host, &mut answers, &mut submitted, &mut in_flight);
        guest_reads(&mut guest, &mut host);
    }
    host.device_lost();
    assert_eq!(host.urbs_in_flight(), 0, "URBs left in flight after the device was lost");
    assert!(host.poll_urb().is_none(), "URBs for a lost device");
    guest_reads(&mut guest, &mut host);
}

/// Completes, fails or keeps the core's URBs, until it asks for nothing new.
fn play_device(
    host: &mut UsbHost,
    answers: &mut Answers,
    submitted: &mut HashSet<u64>,
    in_flight: &mut Vec<(u64, UrbRequest)>,
) {
    // Streams resubmit on completion: bound the rounds, the rest stays in flight.
    for _ in 0..16 {
        let mut any = false;
        while let Some(command) = host.poll_urb() {
            any = true;
            match command {
                UrbCommand::Submit { tag, urb } => {
                    assert!(submitted.insert(tag), "tag {tag} submitted twice");
                    in_flight.push((tag, urb));
                }
                UrbCommand::Cancel { tag } => {
                    assert!(submitted.contains(&tag), "cancel of tag {tag}, never submitted");
                    if let Some(at) = in_flight.iter().position(|(t, _)| *t == tag) {
                        in_flight.swap_remove(at);
                        let unlinked = UrbResult {
                            status: UrbStatus::ECONNRESET,
                            actual_length: 0,
                            data: Bytes::new(),
                            iso_packets: Vec::new(),
                        };
                        let _ = host.handle_urb(tag, unlinked);
                    }
                }
            }
        }
        let mut completed = false;
        let mut keep = Vec::new();
        for (tag, urb) in std::mem::take(in_flight) {
            if answers.next(4) == 0 {
                keep.push((tag, urb));
            } else {
                let result = device_result(&urb, answers);
                let _ = host.handle_urb(tag, result);
                completed = true;
            }
        }
        *in_flight = keep;
        if !any && !completed {
            break;
        }
    }
}
