//! [`Packet`]: every usbredir packet with its typed fields, parsed from and
//! written to the wire (field names as in `usbredirproto.h`).

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::RedirError;
use crate::wire::{Caps, PacketType, Side, Status};

/// `interface_info`: the current configuration's interfaces (at most 32).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InterfaceInfo {
    pub interface: Vec<u8>,
    pub class: Vec<u8>,
    pub subclass: Vec<u8>,
    pub protocol: Vec<u8>,
}

/// `ep_info`: per endpoint index `((ep & 0x80) >> 3) | (ep & 0x0f)` (0–15 OUT,
/// 16–31 IN), type 255 for an unused one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    pub kind: [u8; 32],
    pub interval: [u8; 32],
    pub interface: [u8; 32],
    /// Sent when [`Caps::EP_INFO_MAX_PACKET_SIZE`] is in effect.
    pub max_packet_size: [u16; 32],
    /// Sent when [`Caps::BULK_STREAMS`] is in effect.
    pub max_streams: [u32; 32],
}

impl EndpointInfo {
    /// The table index of endpoint address `ep`.
    pub fn index(ep: u8) -> usize {
        usize::from(((ep & 0x80) >> 3) | (ep & 0x0f))
    }
}

impl Default for EndpointInfo {
    fn default() -> Self {
        Self { kind: [255; 32], interval: [0; 32], interface: [0; 32], max_packet_size: [0; 32], max_streams: [0; 32] }
    }
}

/// A usbredir packet. Data packets carry their payload as `data` (sliced from
/// the read buffer when decoded); `length` is the wire field, which for a
/// reply without data (an OUT transfer's) is the length transferred.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Packet {
    Hello {
        version: String,
        caps: Caps,
    },
    DeviceConnect {
        speed: u8,
        class: u8,
        subclass: u8,
        protocol: u8,
        vendor_id: u16,
        product_id: u16,
        device_version_bcd: u16,
    },
    DeviceDisconnect,
    Reset,
    InterfaceInfo(InterfaceInfo),
    EpInfo(Box<EndpointInfo>),
    SetConfiguration {
        configuration: u8,
    },
    GetConfiguration,
    ConfigurationStatus {
        status: Status,
        configuration: u8,
    },
    SetAltSetting {
        interface: u8,
        alt: u8,
    },
    GetAltSetting {
        interface: u8,
    },
    AltSettingStatus {
        status: Status,
        interface: u8,
        alt: u8,
    },
    StartIsoStream {
        endpoint: u8,
        pkts_per_urb: u8,
        no_urbs: u8,
    },
    StopIsoStream {
        endpoint: u8,
    },
    IsoStreamStatus {
        status: Status,
        endpoint: u8,
    },
    StartInterruptReceiving {
        endpoint: u8,
    },
    StopInterruptReceiving {
        endpoint: u8,
    },
    InterruptReceivingStatus {
        status: Status,
        endpoint: u8,
    },
    AllocBulkStreams {
        endpoints: u32,
        no_streams: u32,
    },
    FreeBulkStreams {
        endpoints: u32,
    },
    BulkStreamsStatus {
        endpoints: u32,
        no_streams: u32,
        status: Status,
    },
    /// Cancels the data packet whose id this packet carries.
    CancelDataPacket,
    FilterReject,
    /// Rules as text (`class,vendor,product,version,allow|…`).
    FilterFilter {
        rules: String,
    },
    DeviceDisconnectAck,
    StartBulkReceiving {
        stream_id: u32,
        bytes_per_transfer: u32,
        endpoint: u8,
        no_transfers: u8,
    },
    StopBulkReceiving {
        stream_id: u32,
        endpoint: u8,
    },
    BulkReceivingStatus {
        stream_id: u32,
        endpoint: u8,
        status: Status,
    },
    Control {
        endpoint: u8,
        request: u8,
        requesttype: u8,
        status: Status,
        value: u16,
        index: u16,
        length: u16,
        data: Bytes,
    },
    Bulk {
        endpoint: u8,
        status: Status,
        length: u32,
        stream_id: u32,
        data: Bytes,
    },
    Iso {
        endpoint: u8,
        status: Status,
        length: u16,
        data: Bytes,
    },
    Interrupt {
        endpoint: u8,
        status: Status,
        length: u16,
        data: Bytes,
    },
    BufferedBulk {
        stream_id: u32,
        length: u32,
        endpoint: u8,
        status: Status,
        data: Bytes,
    },
}

/// Whether a transfer packet from `sender` on `endpoint` carries its data:
/// OUT data goes from the guest, IN data comes back from the host.
fn carries_data(endpoint: u8, sender: Side) -> bool {
    (endpoint & 0x80 != 0) == (sender == Side::Host)
}

impl Packet {
    pub fn kind(&self) -> PacketType {
        match self {
            Self::Hello { .. } => PacketType::HELLO,
            Self::DeviceConnect { .. } => PacketType::DEVICE_CONNECT,
            Self::DeviceDisconnect => PacketType::DEVICE_DISCONNECT,
            Self::Reset => PacketType::RESET,
            Self::InterfaceInfo(_) => PacketType::INTERFACE_INFO,
            Self::EpInfo(_) => PacketType::EP_INFO,
            Self::SetConfiguration { .. } => PacketType::SET_CONFIGURATION,
            Self::GetConfiguration => PacketType::GET_CONFIGURATION,
            Self::ConfigurationStatus { .. } => PacketType::CONFIGURATION_STATUS,
            Self::SetAltSetting { .. } => PacketType::SET_ALT_SETTING,
            Self::GetAltSetting { .. } => PacketType::GET_ALT_SETTING,
            Self::AltSettingStatus { .. } => PacketType::ALT_SETTING_STATUS,
            Self::StartIsoStream { .. } => PacketType::START_ISO_STREAM,
            Self::StopIsoStream { .. } => PacketType::STOP_ISO_STREAM,
            Self::IsoStreamStatus { .. } => PacketType::ISO_STREAM_STATUS,
            Self::StartInterruptReceiving { .. } => PacketType::START_INTERRUPT_RECEIVING,
            Self::StopInterruptReceiving { .. } => PacketType::STOP_INTERRUPT_RECEIVING,
            Self::InterruptReceivingStatus { .. } => PacketType::INTERRUPT_RECEIVING_STATUS,
            Self::AllocBulkStreams { .. } => PacketType::ALLOC_BULK_STREAMS,
            Self::FreeBulkStreams { .. } => PacketType::FREE_BULK_STREAMS,
            Self::BulkStreamsStatus { .. } => PacketType::BULK_STREAMS_STATUS,
            Self::CancelDataPacket => PacketType::CANCEL_DATA_PACKET,
            Self::FilterReject => PacketType::FILTER_REJECT,
            Self::FilterFilter { .. } => PacketType::FILTER_FILTER,
            Self::DeviceDisconnectAck => PacketType::DEVICE_DISCONNECT_ACK,
            Self::StartBulkReceiving { .. } => PacketType::START_BULK_RECEIVING,
            Self::StopBulkReceiving { .. } => PacketType::STOP_BULK_RECEIVING,
            Self::BulkReceivingStatus { .. } => PacketType::BULK_RECEIVING_STATUS,
            Self::Control { .. } => PacketType::CONTROL_PACKET,
            Self::Bulk { .. } => PacketType::BULK_PACKET,
            Self::Iso { .. } => PacketType::ISO_PACKET,
            Self::Interrupt { .. } => PacketType::INTERRUPT_PACKET,
            Self::BufferedBulk { .. } => PacketType::BUFFERED_BULK_PACKET,
        }
    }

    /// The payload of a data packet (empty for the others).
    pub fn data(&self) -> &[u8] {
        match self {
            Self::Control { data, .. }
            | Self::Bulk { data, .. }
            | Self::Iso { data, .. }
            | Self::Interrupt { data, .. }
            | Self::BufferedBulk { data, .. } => data,
            _ => &[],
        }
    }

    // size-exempt: a per-message match, one arm per packet type.
    /// Parses a type header (exactly its size, checked by the caller) and
    /// checks the `body` after it against the type's rules; data packets get
    /// their data from [`with_data`](Self::with_data).
    pub(crate) fn parse(
        kind: PacketType,
        header: &[u8],
        body: &[u8],
        sender: Side,
        caps: Caps,
    ) -> Result<Self, RedirError> {
        let mut f = Fields(header);
        let data_len = body.len();
        // Data of exactly `expected` bytes, or none at all.
        let data_must_be = |expected: usize| {
            if data_len == expected {
                Ok(())
            } else {
                Err(RedirError::BadData { kind: kind.0, data: data_len, expected })
            }
        };
        let transfer_data =
            |endpoint: u8, length: usize| data_must_be(if carries_data(endpoint, sender) { length } else { 0 });
        let packet = match kind {
            PacketType::HELLO => {
                let version = f.array::<64>();
                let text = version.split(|&b| b == 0).next().unwrap_or_default();
                // Longer caps arrays are taken and cut to what we know.
                let caps = body.get(..4).map_or(0, |word| u32::from_le_bytes([word[0], word[1], word[2], word[3]]));
                return Ok(Self::Hello { version: String::from_utf8_lossy(text).into_owned(), caps: Caps(caps) });
            }
            PacketType::DEVICE_CONNECT => Self::DeviceConnect {
                speed: f.u8(),
                class: f.u8(),
                subclass: f.u8(),
                protocol: f.u8(),
                vendor_id: f.u16(),
                product_id: f.u16(),
                device_version_bcd: if caps.has(Caps::CONNECT_DEVICE_VERSION) { f.u16() } else { 0 },
            },
            PacketType::DEVICE_DISCONNECT => Self::DeviceDisconnect,
            PacketType::RESET => Self::Reset,
            PacketType::INTERFACE_INFO => {
                let count = f.u32();
                if count > 32 {
                    return Err(RedirError::TooManyInterfaces(count));
                }
                let n = count as usize;
                let mut column = || f.array::<32>()[..n].to_vec();
                Self::InterfaceInfo(InterfaceInfo {
                    interface: column(),
                    class: column(),
                    subclass: column(),
                    protocol: column(),
                })
            }
            PacketType::EP_INFO => {
                let mut info = EndpointInfo {
                    kind: f.array(),
                    interval: f.array(),
                    interface: f.array(),
                    ..EndpointInfo::default()
                };
                if caps.has(Caps::BULK_STREAMS) || caps.has(Caps::EP_INFO_MAX_PACKET_SIZE) {
                    info.max_packet_size = std::array::from_fn(|_| f.u16());
                }
                if caps.has(Caps::BULK_STREAMS) {
                    info.max_streams = std::array::from_fn(|_| f.u32());
                }
                Self::EpInfo(Box::new(info))
            }
            PacketType::SET_CONFIGURATION => Self::SetConfiguration { configuration: f.u8() },
            PacketType::GET_CONFIGURATION => Self::GetConfiguration,
            PacketType::CONFIGURATION_STATUS => {
                Self::ConfigurationStatus { status: Status(f.u8()), configuration: f.u8() }
            }
            PacketType::SET_ALT_SETTING => Self::SetAltSetting { interface: f.u8(), alt: f.u8() },
            PacketType::GET_ALT_SETTING => Self::GetAltSetting { interface: f.u8() },
            PacketType::ALT_SETTING_STATUS => {
                Self::AltSettingStatus { status: Status(f.u8()), interface: f.u8(), alt: f.u8() }
            }
            PacketType::START_ISO_STREAM => {
                Self::StartIsoStream { endpoint: f.u8(), pkts_per_urb: f.u8(), no_urbs: f.u8() }
            }
            PacketType::STOP_ISO_STREAM => Self::StopIsoStream { endpoint: f.u8() },
            PacketType::ISO_STREAM_STATUS => Self::IsoStreamStatus { status: Status(f.u8()), endpoint: f.u8() },
            PacketType::START_INTERRUPT_RECEIVING => Self::StartInterruptReceiving { endpoint: f.u8() },
            PacketType::STOP_INTERRUPT_RECEIVING => Self::StopInterruptReceiving { endpoint: f.u8() },
            PacketType::INTERRUPT_RECEIVING_STATUS => {
                Self::InterruptReceivingStatus { status: Status(f.u8()), endpoint: f.u8() }
            }
            PacketType::ALLOC_BULK_STREAMS => Self::AllocBulkStreams { endpoints: f.u32(), no_streams: f.u32() },
            PacketType::FREE_BULK_STREAMS => Self::FreeBulkStreams { endpoints: f.u32() },
            PacketType::BULK_STREAMS_STATUS => {
                Self::BulkStreamsStatus { endpoints: f.u32(), no_streams: f.u32(), status: Status(f.u8()) }
            }
            PacketType::CANCEL_DATA_PACKET => Self::CancelDataPacket,
            PacketType::FILTER_REJECT => Self::FilterReject,
            PacketType::FILTER_FILTER => {
                let Some((0, text)) = body.split_last() else { return Err(RedirError::BadFilter) };
                let rules = std::str::from_utf8(text).map_err(|_| RedirError::BadFilter)?;
                return Ok(Self::FilterFilter { rules: rules.to_owned() });
            }
            PacketType::DEVICE_DISCONNECT_ACK => Self::DeviceDisconnectAck,
            PacketType::START_BULK_RECEIVING => Self::StartBulkReceiving {
                stream_id: f.u32(),
                bytes_per_transfer: f.u32(),
                endpoint: f.u8(),
                no_transfers: f.u8(),
            },
            PacketType::STOP_BULK_RECEIVING => Self::StopBulkReceiving { stream_id: f.u32(), endpoint: f.u8() },
            PacketType::BULK_RECEIVING_STATUS => {
                Self::BulkReceivingStatus { stream_id: f.u32(), endpoint: f.u8(), status: Status(f.u8()) }
            }
            PacketType::CONTROL_PACKET => {
                let (endpoint, request, requesttype, status) = (f.u8(), f.u8(), f.u8(), Status(f.u8()));
                let (value, index, length) = (f.u16(), f.u16(), f.u16());
                transfer_data(endpoint, usize::from(length))?;
                return Ok(Self::Control {
                    endpoint,
                    request,
                    requesttype,
                    status,
                    value,
                    index,
                    length,
                    data: NO_DATA,
                });
            }
            PacketType::BULK_PACKET => {
                let (endpoint, status, low, stream_id) = (f.u8(), Status(f.u8()), f.u16(), f.u32());
                let high = if caps.has(Caps::BULK_LENGTH_32) { f.u16() } else { 0 };
                let length = u32::from(high) << 16 | u32::from(low);
                transfer_data(endpoint, length as usize)?;
                return Ok(Self::Bulk { endpoint, status, length, stream_id, data: NO_DATA });
            }
            PacketType::ISO_PACKET | PacketType::INTERRUPT_PACKET => {
                let (endpoint, status, length) = (f.u8(), Status(f.u8()), f.u16());
                transfer_data(endpoint, usize::from(length))?;
                return Ok(if kind == PacketType::ISO_PACKET {
                    Self::Iso { endpoint, status, length, data: NO_DATA }
                } else {
                    Self::Interrupt { endpoint, status, length, data: NO_DATA }
                });
            }
            PacketType::BUFFERED_BULK_PACKET => {
                let (stream_id, length, endpoint, status) = (f.u32(), f.u32(), f.u8(), Status(f.u8()));
                data_must_be(length as usize)?;
                return Ok(Self::BufferedBulk { stream_id, length, endpoint, status, data: NO_DATA });
            }
            other => return Err(RedirError::UnknownType(other.0)),
        };
        data_must_be(0)?;
        Ok(packet)
    }

    /// Gives a parsed packet the data that followed its type header (the
    /// caller checked its size in [`parse`](Self::parse)).
    pub(crate) fn with_data(mut self, bytes: Bytes) -> Result<Self, RedirError> {
        match &mut self {
            Self::Control { data, .. }
            | Self::Bulk { data, .. }
            | Self::Iso { data, .. }
            | Self::Interrupt { data, .. }
            | Self::BufferedBulk { data, .. } => *data = bytes,
            // Hello capabilities and filter rules were taken in `parse`.
            _ => {}
        }
        Ok(self)
    }

    // size-exempt: a per-message match, one arm per packet type.
    /// Writes the type header (and a hello's capabilities) for `caps` in effect.
    pub(crate) fn put_type_header(&self, out: &mut BytesMut, caps: Caps) {
        match self {
            Self::Hello { version, caps: ours } => {
                // At most 63 bytes, cut at a character boundary, and the NUL.
                let mut text = [0u8; 64];
                let n = (0..=version.len().min(63)).rev().find(|&n| version.is_char_boundary(n)).unwrap_or(0);
                text[..n].copy_from_slice(&version.as_bytes()[..n]);
                out.put_slice(&text);
                out.put_u32_le(ours.0);
            }
            Self::DeviceConnect { speed, class, subclass, protocol, vendor_id, product_id, device_version_bcd } => {
                out.put_slice(&[*speed, *class, *subclass, *protocol]);
                out.put_u16_le(*vendor_id);
                out.put_u16_le(*product_id);
                if caps.has(Caps::CONNECT_DEVICE_VERSION) {
                    out.put_u16_le(*device_version_bcd);
                }
            }
            Self::DeviceDisconnect
            | Self::Reset
            | Self::GetConfiguration
            | Self::CancelDataPacket
            | Self::FilterReject
            | Self::DeviceDisconnectAck => {}
            Self::InterfaceInfo(info) => {
                let count = info.interface.len().min(32);
                out.put_u32_le(count as u32);
                for column in [&info.interface, &info.class, &info.subclass, &info.protocol] {
                    let mut padded = [0u8; 32];
                    let n = column.len().min(count);
                    padded[..n].copy_from_slice(&column[..n]);
                    out.put_slice(&padded);
                }
            }
            Self::EpInfo(info) => {
                out.put_slice(&info.kind);
                out.put_slice(&info.interval);
                out.put_slice(&info.interface);
                if caps.has(Caps::BULK_STREAMS) || caps.has(Caps::EP_INFO_MAX_PACKET_SIZE) {
                    info.max_packet_size.iter().for_each(|size| out.put_u16_le(*size));
                }
                if caps.has(Caps::BULK_STREAMS) {
                    info.max_streams.iter().for_each(|streams| out.put_u32_le(*streams));
                }
            }
            Self::SetConfiguration { configuration } => out.put_u8(*configuration),
            Self::ConfigurationStatus { status, configuration } => out.put_slice(&[status.0, *configuration]),
            Self::SetAltSetting { interface, alt } => out.put_slice(&[*interface, *alt]),
            Self::GetAltSetting { interface } => out.put_u8(*interface),
            Self::AltSettingStatus { status, interface, alt } => out.put_slice(&[status.0, *interface, *alt]),
            Self::StartIsoStream { endpoint, pkts_per_urb, no_urbs } => {
                out.put_slice(&[*endpoint, *pkts_per_urb, *no_urbs]);
            }
            Self::StopIsoStream { endpoint }
            | Self::StartInterruptReceiving { endpoint }
            | Self::StopInterruptReceiving { endpoint } => out.put_u8(*endpoint),
            Self::IsoStreamStatus { status, endpoint } | Self::InterruptReceivingStatus { status, endpoint } => {
                out.put_slice(&[status.0, *endpoint]);
            }
            Self::AllocBulkStreams { endpoints, no_streams } => {
                out.put_u32_le(*endpoints);
                out.put_u32_le(*no_streams);
            }
            Self::FreeBulkStreams { endpoints } => out.put_u32_le(*endpoints),
            Self::BulkStreamsStatus { endpoints, no_streams, status } => {
                out.put_u32_le(*endpoints);
                out.put_u32_le(*no_streams);
                out.put_u8(status.0);
            }
            Self::FilterFilter { rules } => {
                out.put_slice(rules.as_bytes());
                out.put_u8(0);
            }
            Self::StartBulkReceiving { stream_id, bytes_per_transfer, endpoint, no_transfers } => {
                out.put_u32_le(*stream_id);
                out.put_u32_le(*bytes_per_transfer);
                out.put_slice(&[*endpoint, *no_transfers]);
            }
            Self::StopBulkReceiving { stream_id, endpoint } => {
                out.put_u32_le(*stream_id);
                out.put_u8(*endpoint);
            }
            Self::BulkReceivingStatus { stream_id, endpoint, status } => {
                out.put_u32_le(*stream_id);
                out.put_slice(&[*endpoint, status.0]);
            }
            Self::Control { endpoint, request, requesttype, status, value, index, length, .. } => {
                out.put_slice(&[*endpoint, *request, *requesttype, status.0]);
                out.put_u16_le(*value);
                out.put_u16_le(*index);
                out.put_u16_le(*length);
            }
            Self::Bulk { endpoint, status, length, stream_id, .. } => {
                out.put_slice(&[*endpoint, status.0]);
                out.put_u16_le(*length as u16);
                out.put_u32_le(*stream_id);
                if caps.has(Caps::BULK_LENGTH_32) {
                    out.put_u16_le((*length >> 16) as u16);
                }
            }
            Self::Iso { endpoint, status, length, .. } | Self::Interrupt { endpoint, status, length, .. } => {
                out.put_slice(&[*endpoint, status.0]);
                out.put_u16_le(*length);
            }
            Self::BufferedBulk { stream_id, length, endpoint, status, .. } => {
                out.put_u32_le(*stream_id);
                out.put_u32_le(*length);
                out.put_slice(&[*endpoint, status.0]);
            }
        }
    }
}

/// `data` as a little-endian field reader for the type headers (lengths checked by the caller).
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn u8(&mut self) -> u8 {
        let value = self.0[0];
        self.0 = &self.0[1..];
        value
    }

    fn u16(&mut self) -> u16 {
        let value = u16::from_le_bytes([self.0[0], self.0[1]]);
        self.0 = &self.0[2..];
        value
    }

    fn u32(&mut self) -> u32 {
        let value = u32::from_le_bytes([self.0[0], self.0[1], self.0[2], self.0[3]]);
        self.0 = &self.0[4..];
        value
    }

    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0; N];
        out.copy_from_slice(&self.0[..N]);
        self.0 = &self.0[N..];
        out
    }
}

/// Data that is not there yet ([`Packet::with_data`] fills it in).
const NO_DATA: Bytes = Bytes::new();
