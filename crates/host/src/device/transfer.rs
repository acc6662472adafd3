//! One URB in its usbfs form: the `usbdevfs_urb` (with its isochronous packets) and buffer
//! built for the kernel from a USB/IP URB, and the completion read back from them once the
//! kernel hands them back. Not here: submitting, reaping and who is told (`device.rs`).

use std::collections::HashMap;

use bytes::Bytes;
use usbwire_device::{Completion, Status, TransferFlags, TransferType, Urb};
use usbwire_proto::urb::IsoPacketDescriptor;

use crate::usbfs::{self, IsoPacket, RawUrb};

/// `-EINVAL`: a URB whose lengths or packets do not add up, as the kernel answers it.
const EINVAL: Status = Status(-libc::EINVAL);

/// A URB the kernel holds: the usbfs URB (with its iso packet array) and
/// buffer must not move until it is reaped.
pub(super) struct InFlight {
    /// `RawUrb` followed by `IsoPacket`s, in 8-byte words for alignment.
    block: Box<[u64]>,
    buffer: Vec<u8>,
    pub(super) urb: Urb,
}

impl InFlight {
    pub(super) fn raw(&mut self) -> *mut RawUrb {
        self.block.as_mut_ptr().cast()
    }

    /// Builds the usbfs URB and buffer for `urb`, or the status to complete it with.
    /// `endpoints` are the transfer types of the current configuration's endpoints.
    pub(super) fn prepare(urb: Urb, endpoints: &HashMap<u8, TransferType>) -> Result<Self, (Urb, Status)> {
        let kind = if urb.endpoint == 0 {
            TransferType::Control
        } else {
            match endpoints.get(&urb.endpoint_address()) {
                Some(&kind) => kind,
                None => return Err((urb, Status::EPIPE)),
            }
        };
        let length = urb.length as usize;
        let mut flags = 0;
        let mut iso_packets = Vec::new();
        let buffer = match kind {
            TransferType::Control => {
                let w_length = usize::from(u16::from_le_bytes([urb.setup[6], urb.setup[7]]));
                if urb.is_in() && length < w_length || !urb.is_in() && urb.data.len() != w_length {
                    return Err((urb, EINVAL));
                }
                let mut buffer = Vec::with_capacity(8 + w_length);
                buffer.extend_from_slice(&urb.setup);
                if urb.is_in() {
                    buffer.resize(8 + w_length, 0);
                } else {
                    buffer.extend_from_slice(&urb.data);
                }
                buffer
            }
            TransferType::Isochronous => {
                if urb.iso_packets.is_empty() {
                    return Err((urb, EINVAL));
                }
                let mut buffer = Vec::new();
                for packet in &urb.iso_packets {
                    iso_packets.push(IsoPacket { length: packet.length, ..IsoPacket::default() });
                    if !urb.is_in() {
                        let start = packet.offset as usize;
                        let Some(bytes) = urb.data.get(start..start + packet.length as usize) else {
                            return Err((urb, EINVAL));
                        };
                        buffer.extend_from_slice(bytes);
                    }
                }
                if urb.is_in() {
                    buffer.resize(iso_packets.iter().map(|p| p.length as usize).sum(), 0);
                }
                flags |= usbfs::URB_ISO_ASAP;
                buffer
            }
            TransferType::Bulk | TransferType::Interrupt => {
                if urb.is_in() {
                    if urb.flags.contains(TransferFlags::SHORT_NOT_OK) {
                        flags |= usbfs::URB_SHORT_NOT_OK;
                    }
                    vec![0; length]
                } else {
                    if urb.flags.contains(TransferFlags::ZERO_PACKET) {
                        flags |= usbfs::URB_ZERO_PACKET;
                    }
                    urb.data.to_vec()
                }
            }
        };
        let words = (std::mem::size_of::<RawUrb>() + iso_packets.len() * std::mem::size_of::<IsoPacket>()).div_ceil(8);
        let mut in_flight = Self { block: vec![0u64; words].into_boxed_slice(), buffer, urb };
        let raw = in_flight.raw();
        let buffer_ptr = in_flight.buffer.as_mut_ptr();
        // SAFETY: `block` is zeroed, 8-byte aligned and large enough for a RawUrb
        // followed by `iso_packets.len()` IsoPackets.
        unsafe {
            let header = &mut *raw;
            header.kind = match kind {
                TransferType::Control => usbfs::URB_TYPE_CONTROL,
                TransferType::Isochronous => usbfs::URB_TYPE_ISO,
                TransferType::Bulk => usbfs::URB_TYPE_BULK,
                TransferType::Interrupt => usbfs::URB_TYPE_INTERRUPT,
            };
            header.endpoint = in_flight.urb.endpoint_address();
            header.flags = flags;
            header.buffer = buffer_ptr.cast();
            header.buffer_length = in_flight.buffer.len() as i32;
            header.number_of_packets = iso_packets.len() as i32;
            // For strace and usbmon readers only: reaps are matched by address.
            header.user_context = in_flight.urb.seqnum as usize as *mut _;
            let packets = raw.add(1).cast::<IsoPacket>();
            for (i, packet) in iso_packets.iter().enumerate() {
                packets.add(i).write(*packet);
            }
        }
        Ok(in_flight)
    }

    /// Turns a reaped usbfs URB back into a completion.
    pub(super) fn finish(self, cancelled: bool, endpoints: &HashMap<u8, TransferType>) -> Completion {
        let mut done = self;
        let raw = done.raw();
        // SAFETY: the kernel has handed the URB back; nothing else touches it.
        let header = unsafe { &*raw };
        let mut status = Status(header.status);
        if cancelled && (status == Status::ENOENT || status == Status::ECONNRESET) {
            status = Status::ECONNRESET;
        }
        let actual = (header.actual_length.max(0) as usize).min(done.buffer.len());
        let urb = &done.urb;
        let mut completion = urb.complete_with(status);
        completion.start_frame = header.start_frame;
        completion.error_count = header.error_count;
        match endpoint_kind(urb, endpoints) {
            TransferType::Control => {
                completion.actual_length = actual as u32;
                if urb.is_in() {
                    completion.data = Bytes::copy_from_slice(&done.buffer[8..8 + actual.min(done.buffer.len() - 8)]);
                }
            }
            TransferType::Isochronous => {
                // SAFETY: the packet array follows the header in `block`.
                let packets =
                    unsafe { std::slice::from_raw_parts(raw.add(1).cast::<IsoPacket>(), urb.iso_packets.len()) };
                let mut data = Vec::new();
                let mut at = 0usize;
                let mut total = 0u32;
                completion.iso_packets = urb
                    .iso_packets
                    .iter()
                    .zip(packets)
                    .map(|(sent, got)| {
                        let got_len = got.actual_length.min(got.length);
                        if urb.is_in() {
                            // usbfs leaves each packet at its place; USB/IP sends them back to back.
                            data.extend_from_slice(&done.buffer[at..at + got_len as usize]);
                        }
                        at += got.length as usize;
                        total += got_len;
                        IsoPacketDescriptor {
                            offset: sent.offset,
                            length: sent.length,
                            actual_length: got_len,
                            status: Status(got.status as i32),
                        }
                    })
                    .collect();
                completion.actual_length = total;
                completion.data = data.into();
            }
            TransferType::Bulk | TransferType::Interrupt => {
                completion.actual_length = actual as u32;
                if urb.is_in() {
                    done.buffer.truncate(actual);
                    completion.data = std::mem::take(&mut done.buffer).into();
                }
            }
        }
        completion
    }
}

fn endpoint_kind(urb: &Urb, endpoints: &HashMap<u8, TransferType>) -> TransferType {
    if urb.endpoint == 0 {
        TransferType::Control
    } else if !urb.iso_packets.is_empty() {
        TransferType::Isochronous
    } else {
        endpoints.get(&urb.endpoint_address()).copied().unwrap_or(TransferType::Bulk)
    }
}
