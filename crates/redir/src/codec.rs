//! [`Codec`]: one end of a usbredir connection's framing. It decodes the
//! peer's packets from a byte buffer, incrementally, and encodes ours, with
//! the capabilities both hellos announced (see the crate docs).
//!
//! It sits above the packets and below the usb-host core. It is not for
//! what a packet means to either role, nor for I/O.

use bytes::{Buf, BufMut, BytesMut};

use crate::error::RedirError;
use crate::packet::Packet;
use crate::wire::{Caps, PacketType, Side, MAX_PACKET_LEN};

/// One end of a usbredir connection's framing (see the crate docs).
#[derive(Debug, Clone)]
pub struct Codec {
    ours: Side,
    our_caps: Caps,
    /// The peer's announced capabilities, once its hello arrived.
    peer_caps: Option<Caps>,
    max_data: u32,
}

impl Codec {
    /// The codec of the `ours` side announcing `our_caps` in its hello;
    /// packets longer than `max_data` (after the main header) are refused.
    pub fn new(ours: Side, our_caps: Caps, max_data: u32) -> Self {
        Self { ours, our_caps, peer_caps: None, max_data: max_data.min(MAX_PACKET_LEN) }
    }

    /// What both sides announced (empty until the peer's hello arrived).
    pub fn caps(&self) -> Caps {
        self.peer_caps.map_or(Caps(0), |peer| peer.both(self.our_caps))
    }

    /// The peer's own hello capabilities, once received.
    pub fn peer_caps(&self) -> Option<Caps> {
        self.peer_caps
    }

    fn header_len(&self, kind: PacketType) -> usize {
        if kind != PacketType::HELLO && self.caps().has(Caps::IDS_64) {
            16
        } else {
            12
        }
    }

    /// Decodes the next whole packet the peer sent, with its id. `Ok(None)`:
    /// more bytes are needed, and nothing was consumed. Data is sliced from
    /// `buf`, not copied; nothing is allocated for a packet until all of it
    /// is buffered.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<(u64, Packet)>, RedirError> {
        if buf.len() < 8 {
            return Ok(None);
        }
        let kind = PacketType(u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]));
        let length = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
        if self.peer_caps.is_none() && kind != PacketType::HELLO {
            return Err(RedirError::HelloFirst(kind.0));
        }
        let sender = self.ours.other();
        let caps = self.caps();
        let type_header = match kind.header_len(sender, caps) {
            Some(len) => len,
            None if kind.header_len(self.ours, caps).is_some() => return Err(RedirError::WrongSender(kind.0, sender)),
            None => return Err(RedirError::UnknownType(kind.0)),
        };
        if (length as usize) < type_header {
            return Err(RedirError::Short { kind: kind.0, length, header: type_header });
        }
        if length > self.max_data {
            return Err(RedirError::TooLong { kind: kind.0, length, limit: self.max_data });
        }
        let header = self.header_len(kind);
        if buf.len() < header + length as usize {
            return Ok(None);
        }
        let id = if header == 16 {
            u64::from_le_bytes(buf[8..16].try_into().unwrap_or_default())
        } else {
            u64::from(u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]))
        };
        // Validate before consuming, so an error leaves the buffer as it was.
        let body = &buf[header..header + length as usize];
        let packet = Packet::parse(kind, &body[..type_header], &body[type_header..], sender, caps)?;
        buf.advance(header + type_header);
        let data = buf.split_to(length as usize - type_header).freeze();
        let packet = packet.with_data(data)?;
        if let Packet::Hello { caps, .. } = &packet {
            // A second hello is ignored, as the reference parser does.
            if self.peer_caps.is_none() {
                self.peer_caps = Some(*caps);
            }
        }
        Ok(Some((id, packet)))
    }

    /// Encodes `packet` with `id` onto `out`. A hello goes first; anything
    /// else only once the peer's hello has set the framing.
    pub fn encode(&self, id: u64, packet: &Packet, out: &mut BytesMut) -> Result<(), RedirError> {
        let kind = packet.kind();
        if kind != PacketType::HELLO && self.peer_caps.is_none() {
            return Err(RedirError::BeforePeerHello(kind.0));
        }
        let caps = self.caps();
        let Some(type_header) = kind.header_len(self.ours, caps) else {
            return Err(RedirError::WrongSender(kind.0, self.ours));
        };
        if let Packet::Bulk { length, .. } = packet {
            if *length > 0xffff && !caps.has(Caps::BULK_LENGTH_32) {
                return Err(RedirError::BulkLengthNeedsCap(*length));
            }
        }
        let data = packet.data();
        out.reserve(16 + type_header + data.len());
        let start = out.len();
        out.put_u32_le(kind.0);
        out.put_u32_le(0); // the length, once known
        if self.header_len(kind) == 16 {
            out.put_u64_le(id);
        } else {
            out.put_u32_le(id as u32);
        }
        let body = out.len();
        // A hello's capabilities and a filter's text are written with the type header.
        packet.put_type_header(out, caps);
        out.extend_from_slice(data);
        let length = (out.len() - body) as u32;
        out[start + 4..start + 8].copy_from_slice(&length.to_le_bytes());
        Ok(())
    }

    /// Our hello, announcing `our_caps`.
    pub fn hello(&self, version: &str) -> Packet {
        Packet::Hello { version: version.to_owned(), caps: self.our_caps }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::packet::{EndpointInfo, InterfaceInfo};
    use crate::wire::Status;

    /// Everything usbredirhost announces (`usbredirhost.c`), bulk streams excepted.
    fn full_caps() -> Caps {
        (1..=7).fold(Caps(0), Caps::with)
    }

    /// A host and a guest codec that have exchanged hellos.
    fn pair(host_caps: Caps, guest_caps: Caps) -> (Codec, Codec) {
        let mut host = Codec::new(Side::Host, host_caps, MAX_PACKET_LEN);
        let mut guest = Codec::new(Side::Guest, guest_caps, MAX_PACKET_LEN);
        let (mut to_guest, mut to_host) = (BytesMut::new(), BytesMut::new());
        host.encode(0, &host.hello("usbwire"), &mut to_guest).unwrap();
        guest.encode(0, &guest.hello("qemu"), &mut to_host).unwrap();
        assert!(matches!(guest.decode(&mut to_guest), Ok(Some((0, Packet::Hello { .. })))));
        assert!(matches!(host.decode(&mut to_host), Ok(Some((0, Packet::Hello { .. })))));
        (host, guest)
    }

    fn send(from: &Codec, to: &mut Codec, id: u64, packet: &Packet) -> (u64, Packet) {
        let mut wire = BytesMut::new();
        from.encode(id, packet, &mut wire).unwrap();
        let decoded = to.decode(&mut wire).unwrap().expect("a whole packet");
        assert!(wire.is_empty(), "{packet:?} left {} bytes", wire.len());
        decoded
    }

    fn guest_packets() -> Vec<Packet> {
        vec![
            Packet::Reset,
            Packet::SetConfiguration { configuration: 1 },
            Packet::GetConfiguration,
            Packet::SetAltSetting { interface: 1, alt: 2 },
            Packet::GetAltSetting { interface: 3 },
            Packet::StartIsoStream { endpoint: 0x83, pkts_per_urb: 8, no_urbs: 4 },
            Packet::StopIsoStream { endpoint: 0x83 },
            Packet::StartInterruptReceiving { endpoint: 0x81 },
            Packet::StopInterruptReceiving { endpoint: 0x81 },
            Packet::AllocBulkStreams { endpoints: 6, no_streams: 4 },
            Packet::FreeBulkStreams { endpoints: 6 },
            Packet::CancelDataPacket,
            Packet::FilterReject,
            Packet::FilterFilter { rules: "-1,-1,-1,-1,1".into() },
            Packet::DeviceDisconnectAck,
            Packet::StartBulkReceiving { stream_id: 0, bytes_per_transfer: 16384, endpoint: 0x82, no_transfers: 4 },
            Packet::StopBulkReceiving { stream_id: 0, endpoint: 0x82 },
            Packet::Control {
                endpoint: 0x80,
                request: 6,
                requesttype: 0x80,
                status: Status::SUCCESS,
                value: 0x0100,
                index: 0,
                length: 18,
                data: Bytes::new(),
            },
            Packet::Control {
                endpoint: 0,
                request: 9,
                requesttype: 0x21,
                status: Status::SUCCESS,
                value: 0x0200,
                index: 0,
                length: 1,
                data: Bytes::from_static(&[1]),
            },
            Packet::Bulk {
                endpoint: 0x02,
                status: Status::SUCCESS,
                length: 31,
                stream_id: 0,
                data: Bytes::from(vec![0x55; 31]),
            },
            Packet::Bulk { endpoint: 0x81, status: Status::SUCCESS, length: 65536, stream_id: 0, data: Bytes::new() },
            Packet::Iso { endpoint: 0x03, status: Status::SUCCESS, length: 3, data: Bytes::from_static(b"abc") },
            Packet::Interrupt { endpoint: 0x04, status: Status::SUCCESS, length: 2, data: Bytes::from_static(b"hi") },
        ]
    }

    fn host_packets() -> Vec<Packet> {
        let mut ep = EndpointInfo::default();
        ep.kind[0] = 0;
        ep.kind[16] = 0;
        ep.kind[EndpointInfo::index(0x81)] = 2;
        ep.max_packet_size[EndpointInfo::index(0x81)] = 512;
        ep.interface[EndpointInfo::index(0x81)] = 0;
        vec![
            Packet::DeviceConnect {
                speed: 2,
                class: 0,
                subclass: 0,
                protocol: 0,
                vendor_id: 0x1d6b,
                product_id: 0x0104,
                device_version_bcd: 0x0100,
            },
            Packet::DeviceDisconnect,
            Packet::InterfaceInfo(InterfaceInfo {
                interface: vec![0, 1],
                class: vec![8, 3],
                subclass: vec![6, 0],
                protocol: vec![0x50, 0],
            }),
            Packet::EpInfo(Box::new(ep)),
            Packet::ConfigurationStatus { status: Status::SUCCESS, configuration: 1 },
            Packet::AltSettingStatus { status: Status::STALL, interface: 1, alt: 0 },
            Packet::IsoStreamStatus { status: Status::SUCCESS, endpoint: 0x83 },
            Packet::InterruptReceivingStatus { status: Status::SUCCESS, endpoint: 0x81 },
            Packet::BulkStreamsStatus { endpoints: 6, no_streams: 4, status: Status::INVAL },
            Packet::FilterFilter { rules: "0x08,-1,-1,-1,1|-1,-1,-1,-1,0".into() },
            Packet::BulkReceivingStatus { stream_id: 0, endpoint: 0x82, status: Status::SUCCESS },
            Packet::Control {
                endpoint: 0x80,
                request: 6,
                requesttype: 0x80,
                status: Status::SUCCESS,
                value: 0x0100,
                index: 0,
                length: 4,
                data: Bytes::from_static(&[18, 1, 0, 2]),
            },
            Packet::Control {
                endpoint: 0,
                request: 9,
                requesttype: 0x21,
                status: Status::STALL,
                value: 0,
                index: 0,
                length: 0,
                data: Bytes::new(),
            },
            Packet::Bulk {
                endpoint: 0x81,
                status: Status::SUCCESS,
                length: 70_000,
                stream_id: 0,
                data: Bytes::from(vec![7; 70_000]),
            },
            Packet::Bulk { endpoint: 0x02, status: Status::SUCCESS, length: 31, stream_id: 0, data: Bytes::new() },
            Packet::Iso { endpoint: 0x83, status: Status::SUCCESS, length: 2, data: Bytes::from_static(&[1, 2]) },
            Packet::Interrupt { endpoint: 0x81, status: Status::SUCCESS, length: 1, data: Bytes::from_static(&[9]) },
            Packet::BufferedBulk {
                stream_id: 0,
                length: 5,
                endpoint: 0x82,
                status: Status::SUCCESS,
                data: Bytes::from_static(b"hello"),
            },
        ]
    }

    #[test]
    fn every_packet_round_trips_with_and_without_the_optional_caps() {
        for (host_caps, guest_caps) in [(full_caps(), full_caps()), (Caps(0), full_caps()), (full_caps(), Caps(0))] {
            let (mut host, mut guest) = pair(host_caps, guest_caps);
            for (id, packet) in guest_packets().into_iter().enumerate() {
                let id = id as u64 + (1 << 40);
                if matches!(packet, Packet::Bulk { length, .. } if length > 0xffff)
                    && !host.caps().has(Caps::BULK_LENGTH_32)
                {
                    let mut out = BytesMut::new();
                    assert_eq!(guest.encode(id, &packet, &mut out), Err(RedirError::BulkLengthNeedsCap(65536)));
                    continue;
                }
                let (got_id, got) = send(&guest, &mut host, id, &packet);
                // Without 64-bit ids in effect only the low 32 bits travel.
                let expected_id = if host.caps().has(Caps::IDS_64) { id } else { id & 0xffff_ffff };
                assert_eq!((got_id, &got), (expected_id, &packet));
            }
            for packet in host_packets() {
                // Fields that only exist with a cap come back as zero without it.
                let expected = match (&packet, guest.caps()) {
                    (Packet::DeviceConnect { .. }, caps) if !caps.has(Caps::CONNECT_DEVICE_VERSION) => {
                        let Packet::DeviceConnect { speed, class, subclass, protocol, vendor_id, product_id, .. } =
                            packet.clone()
                        else {
                            unreachable!()
                        };
                        Packet::DeviceConnect {
                            speed,
                            class,
                            subclass,
                            protocol,
                            vendor_id,
                            product_id,
                            device_version_bcd: 0,
                        }
                    }
                    (Packet::EpInfo(info), caps) if !caps.has(Caps::EP_INFO_MAX_PACKET_SIZE) => {
                        Packet::EpInfo(Box::new(EndpointInfo { max_packet_size: [0; 32], ..(**info).clone() }))
                    }
                    (Packet::Bulk { length, .. }, caps) if *length > 0xffff && !caps.has(Caps::BULK_LENGTH_32) => {
                        continue; // does not fit a 16-bit length: not sendable then
                    }
                    _ => packet.clone(),
                };
                assert_eq!(send(&host, &mut guest, 7, &packet).1, expected);
            }
        }
    }

    /// A guest's hello as the protocol document lays it out: type 0, length 68, id 0,
    /// a 64-byte NUL-padded version string, one capability word.
    #[test]
    fn a_guest_hello_from_its_bytes() {
        let mut wire = BytesMut::new();
        wire.extend_from_slice(&[0, 0, 0, 0, 68, 0, 0, 0, 0, 0, 0, 0]);
        let mut version = [0u8; 64];
        version[..14].copy_from_slice(b"qemu usb-redir");
        wire.extend_from_slice(&version);
        wire.extend_from_slice(&0xfeu32.to_le_bytes()); // caps 1..7
        let mut host = Codec::new(Side::Host, full_caps(), MAX_PACKET_LEN);
        let (id, hello) = host.decode(&mut wire).unwrap().unwrap();
        assert_eq!(id, 0);
        assert_eq!(hello, Packet::Hello { version: "qemu usb-redir".into(), caps: Caps(0xfe) });
        assert!(host.caps().has(Caps::IDS_64) && host.caps().has(Caps::BULK_LENGTH_32));
        // 64-bit ids from now on: a bulk IN request is a 16-byte header and a 10-byte type header.
        let mut bulk = BytesMut::new();
        bulk.extend_from_slice(&[101, 0, 0, 0, 10, 0, 0, 0]);
        bulk.extend_from_slice(&0x1_0000_0002u64.to_le_bytes());
        bulk.extend_from_slice(&[0x81, 0, 0x00, 0x00, 0, 0, 0, 0, 0x01, 0x00]);
        let (id, packet) = host.decode(&mut bulk).unwrap().unwrap();
        assert_eq!(id, 0x1_0000_0002);
        assert_eq!(
            packet,
            Packet::Bulk { endpoint: 0x81, status: Status::SUCCESS, length: 65536, stream_id: 0, data: Bytes::new() }
        );
    }

    #[test]
    fn our_hello_bytes() {
        let host = Codec::new(Side::Host, Caps(0).with(Caps::IDS_64), MAX_PACKET_LEN);
        let mut wire = BytesMut::new();
        host.encode(0, &host.hello("usbwire 0.1"), &mut wire).unwrap();
        let mut expected = vec![0, 0, 0, 0, 68, 0, 0, 0, 0, 0, 0, 0];
        expected.extend_from_slice(b"usbwire 0.1");
        expected.resize(12 + 64, 0);
        expected.extend_from_slice(&[0x20, 0, 0, 0]);
        assert_eq!(&wire[..], &expected[..]);
    }

    #[test]
    fn a_long_version_is_cut_at_a_character_boundary() {
        let host = Codec::new(Side::Host, Caps(0), MAX_PACKET_LEN);
        let mut wire = BytesMut::new();
        host.encode(0, &host.hello(&"\u{fffd}".repeat(30)), &mut wire).unwrap();
        let mut guest = Codec::new(Side::Guest, Caps(0), MAX_PACKET_LEN);
        let Some((_, Packet::Hello { version, .. })) = guest.decode(&mut wire).unwrap() else { panic!("a hello") };
        assert_eq!(version, "\u{fffd}".repeat(21), "63 bytes hold 21 three-byte characters");
    }

    #[test]
    fn what_the_reference_parser_refuses_we_refuse() {
        let mut host = Codec::new(Side::Host, full_caps(), 1 << 20);
        let mut wire = BytesMut::from(&[3u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0][..]);
        assert_eq!(host.decode(&mut wire), Err(RedirError::HelloFirst(3)));
        assert_eq!(wire.len(), 12, "an error consumes nothing");

        let (mut host, guest) = pair(full_caps(), full_caps());
        let refuse = |host: &mut Codec, kind: u32, body: &[u8]| {
            let mut wire = BytesMut::new();
            wire.extend_from_slice(&kind.to_le_bytes());
            wire.extend_from_slice(&(body.len() as u32).to_le_bytes());
            wire.extend_from_slice(&[0; 8]);
            wire.extend_from_slice(body);
            host.decode(&mut wire).unwrap_err()
        };
        assert_eq!(
            refuse(&mut host, 1, &[0; 10]),
            RedirError::WrongSender(1, Side::Guest),
            "a guest announcing a device"
        );
        assert_eq!(refuse(&mut host, 99, &[]), RedirError::UnknownType(99));
        assert!(matches!(refuse(&mut host, 6, &[]), RedirError::Short { kind: 6, .. }));
        assert!(matches!(refuse(&mut host, 3, &[1]), RedirError::BadData { kind: 3, data: 1, expected: 0 }));
        // A control OUT whose data is not what its length says.
        let control_out = [0u8, 9, 0x21, 0, 0, 0, 0, 0, 4, 0, 1, 2];
        assert!(matches!(refuse(&mut host, 100, &control_out), RedirError::BadData { data: 2, expected: 4, .. }));
        // A control IN request carries no data.
        let control_in = [0x80u8, 6, 0x80, 0, 0, 1, 0, 0, 18, 0, 1];
        assert!(matches!(refuse(&mut host, 100, &control_in), RedirError::BadData { data: 1, expected: 0, .. }));
        assert_eq!(refuse(&mut host, 23, b"no nul"), RedirError::BadFilter);
        let mut limited = Codec::new(Side::Host, full_caps(), 1024);
        let mut hello = BytesMut::new();
        guest.encode(0, &guest.hello("g"), &mut hello).unwrap();
        limited.decode(&mut hello).unwrap();
        let mut huge = BytesMut::new();
        huge.extend_from_slice(&[101, 0, 0, 0]);
        huge.extend_from_slice(&(1u32 << 30).to_le_bytes());
        huge.extend_from_slice(&[0; 8]);
        assert!(matches!(limited.decode(&mut huge), Err(RedirError::TooLong { .. })), "refused from its header alone");

        // The guest's side: an interface_info claiming 33 interfaces (16-byte header: 64-bit ids).
        let (_, mut guest) = pair(full_caps(), full_caps());
        let mut wire = BytesMut::new();
        wire.extend_from_slice(&4u32.to_le_bytes());
        wire.extend_from_slice(&132u32.to_le_bytes());
        wire.extend_from_slice(&[0; 8]);
        let mut body = 33u32.to_le_bytes().to_vec();
        body.resize(132, 0);
        wire.extend_from_slice(&body);
        assert_eq!(guest.decode(&mut wire), Err(RedirError::TooManyInterfaces(33)));
    }

    #[test]
    fn nothing_but_a_hello_goes_out_before_the_peers() {
        let host = Codec::new(Side::Host, full_caps(), MAX_PACKET_LEN);
        let mut out = BytesMut::new();
        assert_eq!(host.encode(1, &Packet::DeviceDisconnect, &mut out), Err(RedirError::BeforePeerHello(2)));
        assert!(out.is_empty());
        let (host, _) = pair(full_caps(), full_caps());
        assert_eq!(host.encode(1, &Packet::Reset, &mut out), Err(RedirError::WrongSender(3, Side::Host)));
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        /// The host after the guest's hello (full caps), and the guest's hello bytes.
        fn host_after_hello() -> Codec {
            let (host, _) = pair(full_caps(), full_caps());
            host
        }

        proptest! {
            #[test]
            fn no_byte_string_panics_and_every_split_decodes_the_same(
                bytes in proptest::collection::vec(any::<u8>(), 0..600),
                cut in 0usize..600,
            ) {
                let mut one_shot = Vec::new();
                let mut host = host_after_hello();
                let mut buf = BytesMut::from(&bytes[..]);
                loop {
                    let before = buf.clone();
                    match host.decode(&mut buf) {
                        Ok(Some(packet)) => one_shot.push(Ok(packet)),
                        Ok(None) => { prop_assert_eq!(&buf, &before); break; }
                        Err(error) => { prop_assert_eq!(&buf, &before); one_shot.push(Err(error)); break; }
                    }
                }
                let mut split = Vec::new();
                let mut host = host_after_hello();
                let mut buf = BytesMut::new();
                let cut = cut.min(bytes.len());
                'pieces: for piece in [&bytes[..cut], &bytes[cut..]] {
                    buf.extend_from_slice(piece);
                    loop {
                        match host.decode(&mut buf) {
                            Ok(Some(packet)) => split.push(Ok(packet)),
                            Ok(None) => break,
                            Err(error) => { split.push(Err(error)); break 'pieces; }
                        }
                    }
                }
                prop_assert_eq!(one_shot, split);
            }

            /// Packets of known types with bodies of any size and content: the
            /// checks, not the type number, are what meets them.
            #[test]
            fn plausible_packets_never_panic_and_split_the_same(
                packets in proptest::collection::vec(
                    (
                        prop::sample::select(vec![3u32, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19, 21, 22, 23, 24, 25, 26, 100, 101, 102, 103]),
                        any::<u64>(),
                        proptest::collection::vec(any::<u8>(), 0..80),
                    ),
                    1..8,
                ),
                cut in 0usize..1000,
            ) {
                let mut bytes = Vec::new();
                for (kind, id, body) in &packets {
                    bytes.extend_from_slice(&kind.to_le_bytes());
                    bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
                    bytes.extend_from_slice(&id.to_le_bytes());
                    bytes.extend_from_slice(body);
                }
                let decode_all = |pieces: &[&[u8]]| {
                    let mut host = host_after_hello();
                    let mut buf = BytesMut::new();
                    let mut out = Vec::new();
                    for piece in pieces {
                        buf.extend_from_slice(piece);
                        loop {
                            match host.decode(&mut buf) {
                                Ok(Some(packet)) => out.push(Ok(packet)),
                                Ok(None) => break,
                                Err(error) => { out.push(Err(error)); return out; }
                            }
                        }
                    }
                    out
                };
                let cut = cut.min(bytes.len());
                let whole = decode_all(&[&bytes]);
                prop_assert_eq!(&whole, &decode_all(&[&bytes[..cut], &bytes[cut..]]));
                // What decodes re-encodes (as the guest would send it) to the same packet.
                let (mut host, guest) = pair(full_caps(), full_caps());
                for (id, packet) in whole.into_iter().flatten() {
                    prop_assert_eq!(send(&guest, &mut host, id, &packet), (id, packet));
                }
            }

            #[test]
            fn bulk_packets_round_trip(
                endpoint in any::<u8>(),
                length in 0u32..200_000,
                stream_id in any::<u32>(),
                id in any::<u64>(),
                status in 0u8..8,
            ) {
                let (host, mut guest) = pair(full_caps(), full_caps());
                let data = if endpoint & 0x80 != 0 { Bytes::from(vec![0xa5; length as usize]) } else { Bytes::new() };
                let packet = Packet::Bulk { endpoint, status: Status(status), length, stream_id, data };
                prop_assert_eq!(send(&host, &mut guest, id, &packet), (id, packet));
            }
        }
    }
}
