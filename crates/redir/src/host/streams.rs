//! The host-driven streams: interrupt receiving and isochronous streams, where the host keeps
//! URBs queued on an endpoint and sends the guest each completion as it comes (usbredir's
//! unsolicited packets), until the guest stops the stream, an error ends it, or a new
//! configuration or alt setting removes its endpoint. Not here: requests the guest sends one
//! packet at a time (`host.rs`).

use bytes::{Bytes, BytesMut};
use usbwire_device::TransferType;

use super::state::Stream;
use super::{redir_status, Pending, UrbCommand, UrbRequest, UrbResult, UsbHost};
use crate::packet::Packet;
use crate::wire::Status;

/// Interrupt IN URBs kept in flight per receiving endpoint, so a report is
/// never waiting for the round trip of the previous one.
pub(super) const INTERRUPT_URBS: usize = 4;

impl UsbHost {
    pub(super) fn start_interrupt_receiving(&mut self, endpoint: u8) -> Status {
        let Some((TransferType::Interrupt, max_packet)) = self.device.endpoint(endpoint, self.speed) else {
            return Status::INVAL;
        };
        if endpoint & 0x80 == 0 {
            return Status::INVAL;
        }
        self.stop_stream(endpoint);
        self.streams.insert(endpoint, Stream::default());
        for _ in 0..INTERRUPT_URBS {
            self.submit_interrupt_in(endpoint, max_packet);
        }
        Status::SUCCESS
    }

    fn submit_interrupt_in(&mut self, endpoint: u8, max_packet: u32) {
        let urb = UrbRequest::data(endpoint, TransferType::Interrupt, max_packet, Bytes::new());
        let tag = self.submit(Pending::InterruptIn { endpoint }, urb);
        if let Some(stream) = self.streams.get_mut(&endpoint) {
            stream.in_flight.insert(tag);
        }
    }

    pub(super) fn interrupt_in_done(&mut self, tag: u64, endpoint: u8, status: Status, result: UrbResult) {
        let Some(stream) = self.streams.get_mut(&endpoint) else { return };
        if !stream.in_flight.remove(&tag) {
            return; // stopped (and maybe started again) meanwhile
        }
        if status != Status::SUCCESS {
            // The guest sees the error on its next poll and starts receiving again.
            self.stop_stream(endpoint);
            self.send(0, &Packet::InterruptReceivingStatus { status, endpoint });
            return;
        }
        let id = stream.next_id;
        stream.next_id += 1;
        self.traffic.interrupt_in += 1;
        let length = result.data.len().min(0xffff) as u16;
        let data = result.data.slice(..usize::from(length));
        self.send(id, &Packet::Interrupt { endpoint, status, length, data });
        if let Some((_, max_packet)) = self.device.endpoint(endpoint, self.speed) {
            self.submit_interrupt_in(endpoint, max_packet);
        }
    }

    pub(super) fn start_iso(&mut self, endpoint: u8, pkts_per_urb: u8, no_urbs: u8) -> Status {
        let Some((TransferType::Isochronous, max_packet)) = self.device.endpoint(endpoint, self.speed) else {
            return Status::INVAL;
        };
        if pkts_per_urb == 0 || no_urbs == 0 {
            return Status::INVAL;
        }
        self.stop_stream(endpoint);
        self.streams.insert(endpoint, Stream { pkts_per_urb, ..Stream::default() });
        if endpoint & 0x80 != 0 {
            for _ in 0..no_urbs {
                self.submit_iso_in(endpoint, max_packet);
            }
        }
        Status::SUCCESS
    }

    fn submit_iso_in(&mut self, endpoint: u8, max_packet: u32) {
        let Some(stream) = self.streams.get(&endpoint) else { return };
        let lengths = vec![max_packet; usize::from(stream.pkts_per_urb)];
        let mut urb =
            UrbRequest::data(endpoint, TransferType::Isochronous, max_packet * lengths.len() as u32, Bytes::new());
        urb.iso_packet_lengths = lengths;
        let tag = self.submit(Pending::IsoIn { endpoint }, urb);
        if let Some(stream) = self.streams.get_mut(&endpoint) {
            stream.in_flight.insert(tag);
        }
    }

    pub(super) fn iso_in_done(&mut self, tag: u64, endpoint: u8, status: Status, result: UrbResult) {
        let Some(stream) = self.streams.get_mut(&endpoint) else { return };
        if !stream.in_flight.remove(&tag) {
            return;
        }
        if status != Status::SUCCESS {
            self.stop_stream(endpoint);
            self.send(0, &Packet::IsoStreamStatus { status, endpoint });
            return;
        }
        // The IN data is compacted: each packet's actual bytes, one after another.
        let mut at = 0usize;
        let mut packets = Vec::with_capacity(result.iso_packets.len());
        for descriptor in &result.iso_packets {
            let len = (descriptor.actual_length as usize).min(result.data.len() - at).min(0xffff);
            let id = stream.next_id;
            stream.next_id += 1;
            packets.push((id, redir_status(descriptor.status), result.data.slice(at..at + len)));
            at += len;
        }
        self.traffic.iso_in_packets += packets.len() as u64;
        for (id, status, data) in packets {
            self.send(id, &Packet::Iso { endpoint, status, length: data.len() as u16, data });
        }
        if let Some((_, max_packet)) = self.device.endpoint(endpoint, self.speed) {
            self.submit_iso_in(endpoint, max_packet);
        }
    }

    pub(super) fn iso_out_packet(&mut self, endpoint: u8, data: Bytes) {
        let Some(stream) = self.streams.get_mut(&endpoint) else {
            tracing::debug!(target: "usbwire::redir", endpoint, "isochronous OUT packet for a stream not started; dropped");
            return;
        };
        stream.out_packets.push(data);
        if stream.out_packets.len() < usize::from(stream.pkts_per_urb) {
            return;
        }
        let packets = std::mem::take(&mut stream.out_packets);
        let lengths: Vec<u32> = packets.iter().map(|p| p.len() as u32).collect();
        let lengths_count = lengths.len() as u32;
        let mut joined = BytesMut::with_capacity(lengths.iter().sum::<u32>() as usize);
        packets.iter().for_each(|p| joined.extend_from_slice(p));
        let mut urb = UrbRequest::data(endpoint, TransferType::Isochronous, 0, joined.freeze());
        urb.iso_packet_lengths = lengths;
        let tag = self.submit(Pending::IsoOut { endpoint, packets: lengths_count }, urb);
        if let Some(stream) = self.streams.get_mut(&endpoint) {
            stream.in_flight.insert(tag);
        }
    }

    /// Stops a stream: its URBs are cancelled and their completions dropped.
    pub(super) fn stop_stream(&mut self, endpoint: u8) {
        if let Some(stream) = self.streams.remove(&endpoint) {
            for tag in stream.in_flight {
                self.commands.push_back(UrbCommand::Cancel { tag });
            }
        }
    }

    pub(super) fn stop_streams_of(&mut self, interface: u8) {
        let endpoints: Vec<u8> =
            self.streams.keys().copied().filter(|&ep| self.device.interface_of(ep) == Some(interface)).collect();
        endpoints.into_iter().for_each(|ep| self.stop_stream(ep));
    }

    pub(super) fn stop_all_streams(&mut self) {
        let endpoints: Vec<u8> = self.streams.keys().copied().collect();
        endpoints.into_iter().for_each(|ep| self.stop_stream(ep));
    }
}
