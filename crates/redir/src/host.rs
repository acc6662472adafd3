//! [`UsbHost`]: the usbredir *usb-host* role as a sans-I/O core, for a device
//! reached over USB/IP. Fed with the guest's bytes ([`UsbHost::handle_guest`])
//! and the device's URB completions ([`UsbHost::handle_urb`]), it returns the
//! bytes for the guest ([`UsbHost::to_guest`]) and the URBs to submit or
//! cancel ([`UsbHost::poll_urb`]). No sockets, no clock: the driver (the
//! client crate's `redir` module) moves bytes and URBs.
//!
//! What it owns: the device's descriptors (read once at start through the
//! URB path), the configuration and alt settings the guest chose, the
//! announce (ep_info, interface_info, device_connect, after the guest's
//! hello), the mapping of each guest request to URBs (`docs/protocol.md`
//! §7.3), the host-driven streams (interrupt receiving, isochronous), and
//! cancels. The guest's requests are answered in the order their URBs
//! complete; per endpoint that is the order they came.
//!
//! One guest connection can see several devices in turn: when the device
//! goes ([`UsbHost::device_lost`]) the guest is told `device_disconnect`
//! and everything held for it is dropped; when another device comes back
//! at the same port (a re-enumeration, imported again) [`UsbHost::replace_device`]
//! reads its descriptors and announces it, once the guest has acknowledged
//! the disconnect (as usbredirhost waits for `device_disconnect_ack`).
//!
//! This file has the API, the guest's packets mapped to URBs and the URBs'
//! completions mapped back; [`device`] reads the device's descriptors,
//! announces it and handles it coming and going; [`streams`] the host-driven
//! streams; `state` what those files share below them (the device model,
//! the requests held, each stream's bookkeeping).

mod device;
mod state;
mod streams;

use std::collections::{HashMap, VecDeque};

use bytes::{Bytes, BytesMut};
use usbwire_device::TransferType;
use usbwire_proto::urb::IsoPacketDescriptor;
use usbwire_proto::{Speed, Status as UrbStatus};

use self::state::{DeviceModel, Held, Stream};
use crate::codec::Codec;
use crate::error::RedirError;
use crate::packet::Packet;
use crate::wire::{Caps, Side, Status, MAX_PACKET_LEN};

/// Largest packet we accept from the guest: a 128 MiB bulk OUT and its header.
const MAX_GUEST_PACKET: u32 = MAX_PACKET_LEN;

/// What we announce in our hello: everything usbredirhost does except bulk
/// streams and bulk receiving, which a USB/IP server cannot do.
pub fn host_caps() -> Caps {
    Caps(0)
        .with(Caps::CONNECT_DEVICE_VERSION)
        .with(Caps::FILTER)
        .with(Caps::DEVICE_DISCONNECT_ACK)
        .with(Caps::EP_INFO_MAX_PACKET_SIZE)
        .with(Caps::IDS_64)
        .with(Caps::BULK_LENGTH_32)
}

/// A URB for the USB/IP side of the bridge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UrbRequest {
    /// Endpoint address; bit 7 set for IN (for control, the data stage's direction).
    pub endpoint: u8,
    pub transfer_type: TransferType,
    /// The SETUP packet of a control transfer.
    pub setup: [u8; 8],
    /// IN: bytes wanted. OUT: `data.len()`.
    pub length: u32,
    pub data: Bytes,
    /// Isochronous: the length of each packet.
    pub iso_packet_lengths: Vec<u32>,
}

impl UrbRequest {
    pub fn is_in(&self) -> bool {
        self.endpoint & 0x80 != 0
    }

    fn control(setup: [u8; 8], data: Bytes) -> Self {
        let length = u32::from(u16::from_le_bytes([setup[6], setup[7]]));
        let endpoint = if setup[0] & 0x80 != 0 && length > 0 { 0x80 } else { 0 };
        let length = if endpoint == 0 { data.len() as u32 } else { length };
        Self { endpoint, transfer_type: TransferType::Control, setup, length, data, iso_packet_lengths: Vec::new() }
    }

    fn data(endpoint: u8, transfer_type: TransferType, length: u32, data: Bytes) -> Self {
        let length = if endpoint & 0x80 != 0 { length } else { data.len() as u32 };
        Self { endpoint, transfer_type, setup: [0; 8], length, data, iso_packet_lengths: Vec::new() }
    }
}

/// What the driver must do on the USB/IP side. Tags are ours; the driver
/// maps them to seqnums.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UrbCommand {
    Submit {
        tag: u64,
        urb: UrbRequest,
    },
    /// Unlink the URB submitted with `tag` (its completion still comes).
    Cancel {
        tag: u64,
    },
}

/// A URB's completion, as the USB/IP server returned it.
#[derive(Clone, Debug)]
pub struct UrbResult {
    pub status: UrbStatus,
    pub actual_length: u32,
    /// IN data (compacted for isochronous IN, as in a RET_SUBMIT).
    pub data: Bytes,
    pub iso_packets: Vec<IsoPacketDescriptor>,
}

/// Something the driver should know about (see [`UsbHost::poll_event`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostEvent {
    /// The guest's hello arrived.
    GuestHello { version: String },
    /// The device was announced to the guest.
    Announced,
    /// The guest's filter refuses this device; it was not announced.
    FilteredOut { rules: String },
    /// The guest refused the device (filter_reject).
    GuestRejected,
    /// The guest acknowledged our device_disconnect.
    DisconnectAcknowledged,
    /// The device re-enumerated on the guest's reset and the new one took
    /// its place without an unplug: its ep_info and interface_info were
    /// sent, and the `held` requests the guest made meanwhile went to it.
    ReplacedOnReset { held: usize },
}

/// What one guest moved through the core: transfers completed on the device
/// (isochronous ones in packets), for the bridge's log and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    pub control: u64,
    pub bulk: u64,
    /// Interrupt IN packets sent to the guest (interrupt receiving).
    pub interrupt_in: u64,
    pub interrupt_out: u64,
    /// Isochronous IN packets sent to the guest.
    pub iso_in_packets: u64,
    /// Isochronous OUT packets of the guest's that the device took.
    pub iso_out_packets: u64,
}

/// Why the bridge gave up on this guest connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostError {
    /// The guest sent bytes that are not usbredir (see [`RedirError`]).
    #[error("the guest sent a malformed usbredir packet: {0}")]
    Guest(#[from] RedirError),
    /// The device did not answer a descriptor request the bridge needs.
    #[error("the device did not return its {what} descriptor (status {status})")]
    Descriptor { what: &'static str, status: UrbStatus },
}

/// What a submitted URB was for.
#[derive(Clone, Debug)]
enum Pending {
    DeviceDescriptor,
    ConfigurationHeader { index: u8 },
    Configuration { index: u8 },
    ActiveConfiguration,
    SetConfiguration { id: u64, configuration: u8 },
    SetAltSetting { id: u64, interface: u8, alt: u8 },
    Control { id: u64, endpoint: u8, request: u8, requesttype: u8, value: u16, index: u16 },
    Bulk { id: u64, endpoint: u8, stream_id: u32 },
    InterruptOut { id: u64, endpoint: u8 },
    InterruptIn { endpoint: u8 },
    IsoIn { endpoint: u8 },
    IsoOut { endpoint: u8, packets: u32 },
    Reset,
}

/// The usbredir speed number of a USB/IP speed.
pub fn redir_speed(speed: Speed) -> u8 {
    match speed {
        Speed::LOW => 0,
        Speed::FULL => 1,
        Speed::HIGH | Speed::WIRELESS => 2,
        s if s.is_superspeed() => 3,
        _ => 255,
    }
}

/// The usbredir status of a URB's errno status.
pub fn redir_status(status: UrbStatus) -> Status {
    match status {
        UrbStatus::OK => Status::SUCCESS,
        UrbStatus::ECONNRESET | UrbStatus::ENOENT => Status::CANCELLED,
        UrbStatus::EPIPE => Status::STALL,
        UrbStatus::ETIME | UrbStatus::ETIMEDOUT => Status::TIMEOUT,
        UrbStatus::EOVERFLOW => Status::BABBLE,
        UrbStatus::EINVAL => Status::INVAL,
        UrbStatus(-90) => Status::INVAL, // EMSGSIZE
        _ => Status::IOERROR,
    }
}

/// The usbredir usb-host side of one guest connection (see the module docs).
pub struct UsbHost {
    codec: Codec,
    speed: Speed,
    device: DeviceModel,
    /// Descriptors read; the device can be announced once the guest said hello.
    ready: bool,
    guest_hello: bool,
    announced: bool,
    /// The guest's filter refused the device.
    filtered_out: bool,
    /// The device is gone (USB/IP side lost); nothing more is submitted.
    gone: bool,
    /// We told the guest `device_disconnect` and it announced
    /// `device_disconnect_ack`: the next device waits for that ack.
    awaiting_disconnect_ack: bool,
    /// The guest set a configuration since the announce; resets before that are
    /// the guest's enumeration and skipped, as usbredirhost does.
    configured_by_guest: bool,
    /// The guest's reset went to the device and nothing it did since showed
    /// it is the same device: if it goes now, it re-enumerates on that reset.
    since_reset: bool,
    /// The device re-enumerates on the guest's reset: the guest still sees
    /// it, and its requests wait here for the new device.
    held: Option<Held>,
    filter: Option<String>,
    pending: HashMap<u64, Pending>,
    /// Guest data-packet id → tag of its URB (for cancel).
    by_guest_id: HashMap<u64, u64>,
    /// Streams by endpoint address.
    streams: HashMap<u8, Stream>,
    next_tag: u64,
    commands: VecDeque<UrbCommand>,
    events: VecDeque<HostEvent>,
    out: BytesMut,
    traffic: Traffic,
}

impl UsbHost {
    /// The host side for a device of `speed` (from the USB/IP import): our
    /// hello is ready to send at once, and the descriptor reads are queued.
    pub fn new(version: &str, speed: Speed) -> Self {
        let mut host = Self {
            codec: Codec::new(Side::Host, host_caps(), MAX_GUEST_PACKET),
            speed,
            device: DeviceModel::default(),
            ready: false,
            guest_hello: false,
            announced: false,
            filtered_out: false,
            gone: false,
            awaiting_disconnect_ack: false,
            configured_by_guest: false,
            since_reset: false,
            held: None,
            filter: None,
            pending: HashMap::new(),
            by_guest_id: HashMap::new(),
            streams: HashMap::new(),
            next_tag: 1,
            commands: VecDeque::new(),
            events: VecDeque::new(),
            out: BytesMut::new(),
            traffic: Traffic::default(),
        };
        let hello = host.codec.hello(version);
        host.send(0, &hello);
        host.read_device_descriptor();
        host
    }

    /// Bytes for the guest, to write in order; the driver takes them (`split`).
    pub fn to_guest(&mut self) -> &mut BytesMut {
        &mut self.out
    }

    /// The next URB to submit or cancel.
    pub fn poll_urb(&mut self) -> Option<UrbCommand> {
        self.commands.pop_front()
    }

    /// The next event for the driver (log it; `FilteredOut` and
    /// `GuestRejected` mean this guest will not use the device).
    pub fn poll_event(&mut self) -> Option<HostEvent> {
        self.events.pop_front()
    }

    /// Whether the device has been announced to the guest.
    pub fn is_announced(&self) -> bool {
        self.announced
    }

    /// URBs submitted and not completed.
    pub fn urbs_in_flight(&self) -> usize {
        self.pending.len()
    }

    /// What this guest has moved so far.
    pub fn traffic(&self) -> Traffic {
        self.traffic
    }

    /// Takes every whole packet the guest sent from `buf` and acts on it.
    pub fn handle_guest(&mut self, buf: &mut BytesMut) -> Result<(), HostError> {
        while let Some((id, packet)) = self.codec.decode(buf)? {
            self.handle_packet(id, packet);
        }
        Ok(())
    }

    /// The completion of the URB submitted with `tag`.
    pub fn handle_urb(&mut self, tag: u64, result: UrbResult) -> Result<(), HostError> {
        let Some(pending) = self.pending.remove(&tag) else { return Ok(()) };
        let status = redir_status(result.status);
        if status == Status::SUCCESS && !matches!(pending, Pending::Reset) {
            // The device answered after the reset: it is the same one.
            self.since_reset = false;
        }
        match pending {
            read @ (Pending::DeviceDescriptor
            | Pending::ConfigurationHeader { .. }
            | Pending::Configuration { .. }
            | Pending::ActiveConfiguration) => self.descriptor_read(read, result)?,
            Pending::SetConfiguration { id, configuration } => {
                if status == Status::SUCCESS {
                    self.device.configuration = configuration;
                    self.device.alt.clear();
                    self.configured_by_guest = true;
                    self.send_device_info();
                }
                let configuration = self.device.configuration;
                self.send(id, &Packet::ConfigurationStatus { status, configuration });
            }
            Pending::SetAltSetting { id, interface, alt } => {
                if status == Status::SUCCESS {
                    self.device.alt.insert(interface, alt);
                    self.send_device_info();
                }
                let alt = self.device.alt_of(interface);
                self.send(id, &Packet::AltSettingStatus { status, interface, alt });
            }
            Pending::Control { id, endpoint, request, requesttype, value, index } => {
                self.by_guest_id.remove(&id);
                self.traffic.control += u64::from(status == Status::SUCCESS);
                let length = result.actual_length.min(0xffff) as u16;
                let data = if endpoint & 0x80 != 0 {
                    result.data.slice(..usize::from(length).min(result.data.len()))
                } else {
                    Bytes::new()
                };
                let length = if endpoint & 0x80 != 0 { data.len() as u16 } else { length };
                self.send(id, &Packet::Control { endpoint, request, requesttype, status, value, index, length, data });
            }
            Pending::Bulk { id, endpoint, stream_id } => {
                self.by_guest_id.remove(&id);
                self.traffic.bulk += u64::from(status == Status::SUCCESS);
                let data = if endpoint & 0x80 != 0 { result.data } else { Bytes::new() };
                let length = if endpoint & 0x80 != 0 { data.len() as u32 } else { result.actual_length };
                self.send(id, &Packet::Bulk { endpoint, status, length, stream_id, data });
            }
            Pending::InterruptOut { id, endpoint } => {
                self.by_guest_id.remove(&id);
                self.traffic.interrupt_out += u64::from(status == Status::SUCCESS);
                let length = result.actual_length.min(0xffff) as u16;
                self.send(id, &Packet::Interrupt { endpoint, status, length, data: Bytes::new() });
            }
            Pending::InterruptIn { endpoint } => self.interrupt_in_done(tag, endpoint, status, result),
            Pending::IsoIn { endpoint } => self.iso_in_done(tag, endpoint, status, result),
            Pending::IsoOut { endpoint, packets } => {
                if status == Status::SUCCESS {
                    self.traffic.iso_out_packets += u64::from(packets);
                }
                let stopped = self.streams.get_mut(&endpoint).is_none_or(|s| !s.in_flight.remove(&tag));
                if status != Status::SUCCESS && status != Status::CANCELLED && !stopped {
                    self.send(0, &Packet::IsoStreamStatus { status, endpoint });
                }
            }
            Pending::Reset => {
                if status != Status::SUCCESS {
                    self.device_lost();
                }
            }
        }
        Ok(())
    }

    // size-exempt: a per-message match, one arm per packet a guest sends.
    fn handle_packet(&mut self, id: u64, packet: Packet) {
        match packet {
            Packet::Hello { version, .. } => {
                self.guest_hello = true;
                self.events.push_back(HostEvent::GuestHello { version });
                self.announce();
            }
            Packet::FilterFilter { rules } => {
                self.filter = Some(rules);
                // Before the announce: checked then. After it: the device stays (as usbredirhost).
            }
            Packet::FilterReject => {
                self.events.push_back(HostEvent::GuestRejected);
            }
            Packet::DeviceDisconnectAck => {
                self.events.push_back(HostEvent::DisconnectAcknowledged);
                self.awaiting_disconnect_ack = false;
                // A device that came back meanwhile waited for this.
                self.announce();
            }
            _ if self.held.is_some() => self.hold(id, packet),
            _ if self.gone || !self.announced => {
                // A request for a device that is not (or no longer) there.
                self.refuse(id, &packet);
            }
            Packet::Reset => {
                if self.configured_by_guest {
                    self.stop_all_streams();
                    self.since_reset = true;
                    self.submit(Pending::Reset, UrbRequest::control([0x23, 0x03, 0x04, 0, 0, 0, 0, 0], Bytes::new()));
                }
            }
            Packet::SetConfiguration { configuration } => {
                self.stop_all_streams();
                let setup = [0x00, 0x09, configuration, 0, 0, 0, 0, 0];
                self.submit(Pending::SetConfiguration { id, configuration }, UrbRequest::control(setup, Bytes::new()));
            }
            Packet::GetConfiguration => {
                let configuration = self.device.configuration;
                self.send(id, &Packet::ConfigurationStatus { status: Status::SUCCESS, configuration });
            }
            Packet::SetAltSetting { interface, alt } => {
                self.stop_streams_of(interface);
                let setup = [0x01, 0x0b, alt, 0, interface, 0, 0, 0];
                self.submit(Pending::SetAltSetting { id, interface, alt }, UrbRequest::control(setup, Bytes::new()));
            }
            Packet::GetAltSetting { interface } => {
                let known = self.device.active().is_some_and(|c| c.interfaces.iter().any(|i| i.number == interface));
                let (status, alt) =
                    if known { (Status::SUCCESS, self.device.alt_of(interface)) } else { (Status::INVAL, 0xff) };
                self.send(id, &Packet::AltSettingStatus { status, interface, alt });
            }
            Packet::StartIsoStream { endpoint, pkts_per_urb, no_urbs } => {
                let status = self.start_iso(endpoint, pkts_per_urb, no_urbs);
                self.send(id, &Packet::IsoStreamStatus { status, endpoint });
            }
            Packet::StopIsoStream { endpoint } => {
                self.stop_stream(endpoint);
                self.send(id, &Packet::IsoStreamStatus { status: Status::SUCCESS, endpoint });
            }
            Packet::StartInterruptReceiving { endpoint } => {
                let status = self.start_interrupt_receiving(endpoint);
                self.send(id, &Packet::InterruptReceivingStatus { status, endpoint });
            }
            Packet::StopInterruptReceiving { endpoint } => {
                self.stop_stream(endpoint);
                self.send(id, &Packet::InterruptReceivingStatus { status: Status::SUCCESS, endpoint });
            }
            Packet::AllocBulkStreams { endpoints, no_streams } => {
                // Not announced (USB/IP has no bulk streams); a guest that asks anyway is told no.
                self.send(id, &Packet::BulkStreamsStatus { endpoints, no_streams, status: Status::INVAL });
            }
            Packet::FreeBulkStreams { endpoints } => {
                self.send(id, &Packet::BulkStreamsStatus { endpoints, no_streams: 0, status: Status::INVAL });
            }
            Packet::StartBulkReceiving { stream_id, endpoint, .. }
            | Packet::StopBulkReceiving { stream_id, endpoint } => {
                self.send(id, &Packet::BulkReceivingStatus { stream_id, endpoint, status: Status::INVAL });
            }
            Packet::CancelDataPacket => {
                if let Some(&tag) = self.by_guest_id.get(&id) {
                    self.commands.push_back(UrbCommand::Cancel { tag });
                }
            }
            Packet::Control { endpoint, request, requesttype, value, index, length, data, .. } => {
                let mut setup = [requesttype, request, 0, 0, 0, 0, 0, 0];
                setup[2..4].copy_from_slice(&value.to_le_bytes());
                setup[4..6].copy_from_slice(&index.to_le_bytes());
                setup[6..8].copy_from_slice(&length.to_le_bytes());
                let urb = UrbRequest::control(setup, data);
                let pending = Pending::Control { id, endpoint, request, requesttype, value, index };
                let tag = self.submit(pending, urb);
                self.by_guest_id.insert(id, tag);
            }
            Packet::Bulk { endpoint, length, stream_id, data, .. } => {
                let urb = UrbRequest::data(endpoint, TransferType::Bulk, length, data);
                let tag = self.submit(Pending::Bulk { id, endpoint, stream_id }, urb);
                self.by_guest_id.insert(id, tag);
            }
            Packet::Interrupt { endpoint, data, .. } if endpoint & 0x80 == 0 => {
                let urb = UrbRequest::data(endpoint, TransferType::Interrupt, 0, data);
                let tag = self.submit(Pending::InterruptOut { id, endpoint }, urb);
                self.by_guest_id.insert(id, tag);
            }
            Packet::Iso { endpoint, data, .. } if endpoint & 0x80 == 0 => self.iso_out_packet(endpoint, data),
            other => {
                tracing::debug!(target: "usbwire::redir", kind = other.kind().0, "ignored a packet a guest does not send");
            }
        }
    }

    /// Answers a request the device cannot take (not announced, or gone) with
    /// an error, so the guest does not wait for it.
    fn refuse(&mut self, id: u64, packet: &Packet) {
        let status = Status::IOERROR;
        let reply = match packet.clone() {
            Packet::SetConfiguration { .. } | Packet::GetConfiguration => {
                Packet::ConfigurationStatus { status, configuration: self.device.configuration }
            }
            Packet::SetAltSetting { interface, .. } | Packet::GetAltSetting { interface } => {
                Packet::AltSettingStatus { status, interface, alt: 0xff }
            }
            Packet::StartIsoStream { endpoint, .. } | Packet::StopIsoStream { endpoint } => {
                Packet::IsoStreamStatus { status, endpoint }
            }
            Packet::StartInterruptReceiving { endpoint } | Packet::StopInterruptReceiving { endpoint } => {
                Packet::InterruptReceivingStatus { status, endpoint }
            }
            Packet::Control { endpoint, request, requesttype, value, index, .. } => {
                Packet::Control { endpoint, request, requesttype, status, value, index, length: 0, data: Bytes::new() }
            }
            Packet::Bulk { endpoint, stream_id, .. } => {
                Packet::Bulk { endpoint, status, length: 0, stream_id, data: Bytes::new() }
            }
            Packet::Interrupt { endpoint, .. } if endpoint & 0x80 == 0 => {
                Packet::Interrupt { endpoint, status, length: 0, data: Bytes::new() }
            }
            _ => return,
        };
        self.send(id, &reply);
    }

    fn submit(&mut self, pending: Pending, urb: UrbRequest) -> u64 {
        let tag = self.next_tag;
        self.next_tag += 1;
        if self.gone {
            return tag;
        }
        self.pending.insert(tag, pending);
        self.commands.push_back(UrbCommand::Submit { tag, urb });
        tag
    }

    fn send(&mut self, id: u64, packet: &Packet) {
        if let Err(error) = self.codec.encode(id, packet, &mut self.out) {
            // Our own packets are built to fit the caps in effect; this is a bug, not the peer's fault.
            tracing::error!(target: "usbwire::redir", %error, kind = packet.kind().0, "could not encode a packet for the guest");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::streams::INTERRUPT_URBS;
    use super::*;
    use crate::EndpointInfo;
    use crate::PacketType;

    /// The one packet the host sent.
    fn one(mut packets: Vec<(u64, Packet)>) -> (u64, Packet) {
        assert_eq!(packets.len(), 1, "{packets:?}");
        packets.remove(0)
    }

    /// A full-speed device: configuration 1 with a keyboard-like interface 0
    /// (interrupt IN 0x81, 8 bytes) and an audio-like interface 1 whose alt 1
    /// has isochronous IN 0x82 and OUT 0x03 (192 bytes each).
    const DEVICE: [u8; 18] = [18, 1, 0x00, 0x02, 0, 0, 0, 64, 0x34, 0x12, 0x78, 0x56, 0x00, 0x01, 1, 2, 3, 1];
    const CONFIGURATION: [u8; 57] = [
        9, 2, 57, 0, 2, 1, 0, 0x80, 50, //
        9, 4, 0, 0, 1, 3, 1, 1, 0, //
        7, 5, 0x81, 3, 8, 0, 10, //
        9, 4, 1, 0, 0, 1, 2, 0, 0, //
        9, 4, 1, 1, 2, 1, 2, 0, 0, //
        7, 5, 0x82, 5, 192, 0, 1, //
        7, 5, 0x03, 5, 192, 0, 1,
    ];

    /// The bridge's core, a guest codec, and what each side has not read yet.
    struct Rig {
        host: UsbHost,
        guest: Codec,
        next_id: u64,
    }

    fn ok(data: &[u8]) -> UrbResult {
        UrbResult {
            status: UrbStatus::OK,
            actual_length: data.len() as u32,
            data: Bytes::copy_from_slice(data),
            iso_packets: Vec::new(),
        }
    }

    fn failed(status: UrbStatus) -> UrbResult {
        UrbResult { status, actual_length: 0, data: Bytes::new(), iso_packets: Vec::new() }
    }

    /// What QEMU announces (usb-redir.c), bulk streams and receiving aside.
    fn guest_caps() -> Caps {
        [
            Caps::CONNECT_DEVICE_VERSION,
            Caps::FILTER,
            Caps::DEVICE_DISCONNECT_ACK,
            Caps::EP_INFO_MAX_PACKET_SIZE,
            Caps::IDS_64,
            Caps::BULK_LENGTH_32,
        ]
        .into_iter()
        .fold(Caps(0), Caps::with)
    }

    impl Rig {
        /// A host whose device answered its descriptor reads, and a guest that has read our hello.
        fn new() -> Self {
            let mut rig = Self {
                host: UsbHost::new("usbwire test", Speed::FULL),
                guest: Codec::new(Side::Guest, guest_caps(), MAX_GUEST_PACKET),
                next_id: 1,
            };
            rig.answer_descriptor_reads();
            let hello = rig.guest_receives();
            assert!(matches!(hello.as_slice(), [(0, Packet::Hello { .. })]), "{hello:?}");
            rig
        }

        /// Plays the device for the enumeration reads, as a USB/IP server returns them.
        fn answer_descriptor_reads(&mut self) {
            while let Some(UrbCommand::Submit { tag, urb }) = self.host.poll_urb() {
                assert_eq!(urb.transfer_type, TransferType::Control);
                let wanted = usize::from(u16::from_le_bytes([urb.setup[6], urb.setup[7]]));
                let reply: &[u8] = match (urb.setup[1], urb.setup[3]) {
                    (0x06, 0x01) => &DEVICE,
                    (0x06, 0x02) => &CONFIGURATION,
                    (0x08, _) => &[1],
                    other => panic!("unexpected request {other:?}"),
                };
                self.host.handle_urb(tag, ok(&reply[..wanted.min(reply.len())])).unwrap();
            }
        }

        fn guest_sends(&mut self, packet: Packet) -> u64 {
            let id = self.next_id;
            self.next_id += 1;
            self.guest_sends_with_id(id, packet);
            id
        }

        fn guest_sends_with_id(&mut self, id: u64, packet: Packet) {
            let mut wire = BytesMut::new();
            self.guest.encode(id, &packet, &mut wire).unwrap();
            self.host.handle_guest(&mut wire).unwrap();
            assert!(wire.is_empty());
        }

        fn hello(&mut self) {
            let hello = self.guest.hello("qemu test");
            self.guest_sends_with_id(0, hello);
        }

        /// Everything the host has sent the guest since the last call.
        fn guest_receives(&mut self) -> Vec<(u64, Packet)> {
            let mut wire = self.host.to_guest().split();
            let mut packets = Vec::new();
            while let Some(packet) = self.guest.decode(&mut wire).unwrap() {
                packets.push(packet);
            }
            assert!(wire.is_empty(), "a partial packet for the guest");
            packets
        }

        fn submits(&mut self) -> Vec<(u64, UrbRequest)> {
            let mut submits = Vec::new();
            while let Some(command) = self.host.poll_urb() {
                match command {
                    UrbCommand::Submit { tag, urb } => submits.push((tag, urb)),
                    other => panic!("expected submits only, got {other:?}"),
                }
            }
            submits
        }

        fn announced() -> Self {
            let mut rig = Self::new();
            rig.hello();
            assert_eq!(rig.guest_receives().len(), 3);
            rig
        }
    }

    #[test]
    fn announces_after_the_guests_hello_in_protocol_order() {
        let mut rig = Rig::new();
        assert!(!rig.host.is_announced(), "announced before the guest said hello");
        rig.hello();
        assert_eq!(rig.host.poll_event(), Some(HostEvent::GuestHello { version: "qemu test".into() }));
        assert_eq!(rig.host.poll_event(), Some(HostEvent::Announced));
        let packets = rig.guest_receives();
        let [(0, Packet::EpInfo(endpoints)), (0, Packet::InterfaceInfo(interfaces)), (0, connect)] = packets.as_slice()
        else {
            panic!("expected ep_info, interface_info, device_connect: {packets:?}")
        };
        assert_eq!(endpoints.kind[EndpointInfo::index(0x81)], 3, "0x81 is interrupt");
        assert_eq!(endpoints.max_packet_size[EndpointInfo::index(0x81)], 8);
        assert_eq!(endpoints.interval[EndpointInfo::index(0x81)], 10);
        assert_eq!(endpoints.max_packet_size[0], 64, "ep0 from bMaxPacketSize0");
        assert_eq!(interfaces.interface, vec![0, 1]);
        assert_eq!(interfaces.class, vec![3, 1]);
        assert_eq!(
            connect,
            &Packet::DeviceConnect {
                speed: 1,
                class: 0,
                subclass: 0,
                protocol: 0,
                vendor_id: 0x1234,
                product_id: 0x5678,
                device_version_bcd: 0x0100
            }
        );
    }

    #[test]
    fn a_hello_before_the_descriptors_waits_for_them() {
        let mut host = UsbHost::new("t", Speed::HIGH);
        let guest = Codec::new(Side::Guest, Caps(0).with(Caps::IDS_64), MAX_GUEST_PACKET);
        let mut wire = BytesMut::new();
        guest.encode(0, &guest.hello("q"), &mut wire).unwrap();
        host.handle_guest(&mut wire).unwrap();
        assert!(!host.is_announced());
        let mut rig = Rig { host, guest, next_id: 1 };
        rig.answer_descriptor_reads();
        assert!(rig.host.is_announced());
        let kinds: Vec<PacketType> = rig.guest_receives().iter().map(|(_, p)| p.kind()).collect();
        assert_eq!(
            kinds,
            [PacketType::HELLO, PacketType::EP_INFO, PacketType::INTERFACE_INFO, PacketType::DEVICE_CONNECT]
        );
    }

    #[test]
    fn set_configuration_runs_on_the_device_and_reports_the_new_endpoints_first() {
        let mut rig = Rig::announced();
        let id = rig.guest_sends(Packet::SetConfiguration { configuration: 1 });
        let [(tag, urb)] = rig.submits().try_into().unwrap();
        assert_eq!(urb.setup, [0x00, 0x09, 1, 0, 0, 0, 0, 0]);
        assert!(rig.guest_receives().is_empty(), "answered before the device did");
        rig.host.handle_urb(tag, ok(&[])).unwrap();
        let kinds: Vec<(u64, PacketType)> = rig.guest_receives().iter().map(|(id, p)| (*id, p.kind())).collect();
        assert_eq!(
            kinds,
            [(0, PacketType::EP_INFO), (0, PacketType::INTERFACE_INFO), (id, PacketType::CONFIGURATION_STATUS)]
        );
        // Asked again, the answer comes from what the device took, without a URB.
        let id = rig.guest_sends(Packet::GetConfiguration);
        assert!(rig.submits().is_empty());
        assert_eq!(
            rig.guest_receives(),
            [(id, Packet::ConfigurationStatus { status: Status::SUCCESS, configuration: 1 })]
        );
    }

    #[test]
    fn a_stalled_set_alt_setting_keeps_the_old_one() {
        let mut rig = Rig::announced();
        let id = rig.guest_sends(Packet::SetAltSetting { interface: 1, alt: 1 });
        let [(tag, urb)] = rig.submits().try_into().unwrap();
        assert_eq!(urb.setup, [0x01, 0x0b, 1, 0, 1, 0, 0, 0]);
        rig.host.handle_urb(tag, failed(UrbStatus::EPIPE)).unwrap();
        assert_eq!(
            rig.guest_receives(),
            [(id, Packet::AltSettingStatus { status: Status::STALL, interface: 1, alt: 0 })]
        );
    }

    #[test]
    fn control_transfers_map_both_ways_and_cancel_by_the_guests_id() {
        let mut rig = Rig::announced();
        let data = Bytes::new();
        let id = rig.guest_sends(Packet::Control {
            endpoint: 0x80,
            request: 6,
            requesttype: 0x80,
            status: Status::SUCCESS,
            value: 0x0300,
            index: 0,
            length: 255,
            data,
        });
        let [(tag, urb)] = rig.submits().try_into().unwrap();
        assert_eq!((urb.endpoint, urb.length, urb.setup), (0x80, 255, [0x80, 6, 0, 3, 0, 0, 255, 0]));
        rig.host.handle_urb(tag, ok(&[4, 3, 9, 4])).unwrap();
        let (reply_id, Packet::Control { status, length, data, .. }) = one(rig.guest_receives()) else { panic!() };
        assert_eq!((reply_id, status, length, &data[..]), (id, Status::SUCCESS, 4, &[4u8, 3, 9, 4][..]));

        // OUT: the data goes to the device, the reply says how much went.
        let id = rig.guest_sends(Packet::Control {
            endpoint: 0,
            request: 9,
            requesttype: 0x21,
            status: Status::SUCCESS,
            value: 0x0200,
            index: 0,
            length: 1,
            data: Bytes::from_static(&[7]),
        });
        let [(tag, urb)] = rig.submits().try_into().unwrap();
        assert_eq!((urb.endpoint, urb.length, &urb.data[..]), (0, 1, &[7u8][..]));
        // Cancelled by the guest: an unlink, and the completion answers the request.
        rig.guest_sends_with_id(id, Packet::CancelDataPacket);
        assert_eq!(rig.host.poll_urb(), Some(UrbCommand::Cancel { tag }));
        rig.host.handle_urb(tag, failed(UrbStatus::ECONNRESET)).unwrap();
        let (reply_id, Packet::Control { status, data, .. }) = one(rig.guest_receives()) else { panic!() };
        assert_eq!((reply_id, status, data.len()), (id, Status::CANCELLED, 0));
        // A cancel for a request already answered does nothing.
        rig.guest_sends_with_id(id, Packet::CancelDataPacket);
        assert_eq!(rig.host.poll_urb(), None);
    }

    #[test]
    fn interrupt_receiving_keeps_urbs_queued_and_stops_on_an_error() {
        let mut rig = Rig::announced();
        let id = rig.guest_sends(Packet::StartInterruptReceiving { endpoint: 0x81 });
        assert_eq!(
            rig.guest_receives(),
            [(id, Packet::InterruptReceivingStatus { status: Status::SUCCESS, endpoint: 0x81 })]
        );
        let urbs = rig.submits();
        assert_eq!(urbs.len(), INTERRUPT_URBS);
        assert!(urbs
            .iter()
            .all(|(_, u)| u.endpoint == 0x81 && u.length == 8 && u.transfer_type == TransferType::Interrupt));

        let report = [0, 0, 4, 0, 0, 0, 0, 0];
        rig.host.handle_urb(urbs[0].0, ok(&report)).unwrap();
        rig.host.handle_urb(urbs[1].0, ok(&[0; 8])).unwrap();
        let packets = rig.guest_receives();
        let ids: Vec<u64> = packets.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [0, 1], "unsolicited packets are numbered from 0");
        assert_eq!(
            packets[0].1,
            Packet::Interrupt {
                endpoint: 0x81,
                status: Status::SUCCESS,
                length: 8,
                data: Bytes::copy_from_slice(&report)
            }
        );
        assert_eq!(rig.submits().len(), 2, "each completion is replaced");
        assert_eq!(rig.host.urbs_in_flight(), INTERRUPT_URBS);
        assert_eq!(rig.host.traffic(), Traffic { interrupt_in: 2, ..Traffic::default() });

        rig.host.handle_urb(urbs[2].0, failed(UrbStatus::EPROTO)).unwrap();
        assert_eq!(
            rig.guest_receives(),
            [(0, Packet::InterruptReceivingStatus { status: Status::IOERROR, endpoint: 0x81 })]
        );
        let mut cancelled = 0;
        while let Some(command) = rig.host.poll_urb() {
            assert!(matches!(command, UrbCommand::Cancel { .. }), "{command:?}");
            cancelled += 1;
        }
        assert_eq!(cancelled, INTERRUPT_URBS - 1, "the rest of the stream is unlinked");
        rig.host.handle_urb(urbs[3].0, ok(&report)).unwrap();
        assert!(rig.guest_receives().is_empty(), "a late completion of a stopped stream is dropped");
    }

    #[test]
    fn interrupt_receiving_on_a_bulk_or_unknown_endpoint_is_refused() {
        let mut rig = Rig::announced();
        let id = rig.guest_sends(Packet::StartInterruptReceiving { endpoint: 0x85 });
        assert_eq!(
            rig.guest_receives(),
            [(id, Packet::InterruptReceivingStatus { status: Status::INVAL, endpoint: 0x85 })]
        );
        assert!(rig.submits().is_empty());
    }

    #[test]
    fn isochronous_in_splits_each_urb_into_packets() {
        let mut rig = Rig::announced();
        rig.guest_sends(Packet::SetAltSetting { interface: 1, alt: 1 });
        let [(tag, _)] = rig.submits().try_into().unwrap();
        rig.host.handle_urb(tag, ok(&[])).unwrap();
        let packets = rig.guest_receives();
        let Packet::EpInfo(endpoints) = &packets[0].1 else { panic!("{packets:?}") };
        assert_eq!(endpoints.kind[EndpointInfo::index(0x82)], 1, "the new alt setting's iso endpoint is announced");

        let id = rig.guest_sends(Packet::StartIsoStream { endpoint: 0x82, pkts_per_urb: 4, no_urbs: 2 });
        assert_eq!(rig.guest_receives(), [(id, Packet::IsoStreamStatus { status: Status::SUCCESS, endpoint: 0x82 })]);
        let urbs = rig.submits();
        assert_eq!(urbs.len(), 2);
        assert_eq!(urbs[0].1.iso_packet_lengths, vec![192; 4]);
        assert_eq!(urbs[0].1.length, 4 * 192);

        // A RET_SUBMIT's compacted data: the packets' actual bytes back to back.
        let actual = [10u32, 0, 192, 5];
        let data: Vec<u8> = actual.iter().enumerate().flat_map(|(i, &n)| vec![i as u8; n as usize]).collect();
        let iso_packets = actual
            .iter()
            .enumerate()
            .map(|(i, &n)| IsoPacketDescriptor {
                offset: i as u32 * 192,
                length: 192,
                actual_length: n,
                status: UrbStatus::OK,
            })
            .collect();
        let result =
            UrbResult { status: UrbStatus::OK, actual_length: data.len() as u32, data: data.into(), iso_packets };
        rig.host.handle_urb(urbs[0].0, result).unwrap();
        let packets = rig.guest_receives();
        let got: Vec<(u64, usize, Option<u8>)> = packets
            .iter()
            .map(|(id, p)| match p {
                Packet::Iso { endpoint: 0x82, status: Status::SUCCESS, data, .. } => {
                    (*id, data.len(), data.first().copied())
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(got, [(0, 10, Some(0)), (1, 0, None), (2, 192, Some(2)), (3, 5, Some(3))]);
        assert_eq!(rig.submits().len(), 1, "the stream keeps its URBs queued");
        assert_eq!(rig.host.traffic().iso_in_packets, 4);

        let id = rig.guest_sends(Packet::StopIsoStream { endpoint: 0x82 });
        assert_eq!(rig.guest_receives(), [(id, Packet::IsoStreamStatus { status: Status::SUCCESS, endpoint: 0x82 })]);
        let cancels =
            std::iter::from_fn(|| rig.host.poll_urb()).filter(|c| matches!(c, UrbCommand::Cancel { .. })).count();
        assert_eq!(cancels, 2);
    }

    #[test]
    fn isochronous_out_packets_are_gathered_into_urbs() {
        let mut rig = Rig::announced();
        rig.guest_sends(Packet::SetAltSetting { interface: 1, alt: 1 });
        let [(tag, _)] = rig.submits().try_into().unwrap();
        rig.host.handle_urb(tag, ok(&[])).unwrap();
        rig.guest_receives();
        let id = rig.guest_sends(Packet::StartIsoStream { endpoint: 0x03, pkts_per_urb: 3, no_urbs: 2 });
        assert_eq!(rig.guest_receives(), [(id, Packet::IsoStreamStatus { status: Status::SUCCESS, endpoint: 0x03 })]);
        assert!(rig.submits().is_empty(), "OUT streams wait for the guest's data");
        for n in [100usize, 0] {
            rig.guest_sends(Packet::Iso {
                endpoint: 0x03,
                status: Status::SUCCESS,
                length: n as u16,
                data: vec![1; n].into(),
            });
        }
        assert!(rig.submits().is_empty());
        rig.guest_sends(Packet::Iso {
            endpoint: 0x03,
            status: Status::SUCCESS,
            length: 192,
            data: vec![2; 192].into(),
        });
        let [(tag, urb)] = rig.submits().try_into().unwrap();
        assert_eq!(urb.iso_packet_lengths, vec![100, 0, 192]);
        assert_eq!(urb.data.len(), 292);
        rig.host.handle_urb(tag, ok(&[])).unwrap();
        assert_eq!(rig.host.traffic().iso_out_packets, 3, "counted when the device took them");
        for n in [1usize, 2, 3] {
            rig.guest_sends(Packet::Iso {
                endpoint: 0x03,
                status: Status::SUCCESS,
                length: n as u16,
                data: vec![3; n].into(),
            });
        }
        let [(tag, _)] = rig.submits().try_into().unwrap();
        rig.host.handle_urb(tag, failed(UrbStatus::EPROTO)).unwrap();
        assert_eq!(rig.guest_receives(), [(0, Packet::IsoStreamStatus { status: Status::IOERROR, endpoint: 0x03 })]);
    }

    #[test]
    fn a_lost_device_is_disconnected_and_later_requests_refused_at_once() {
        let mut rig = Rig::announced();
        rig.guest_sends(Packet::Bulk {
            endpoint: 0x02,
            status: Status::SUCCESS,
            length: 3,
            stream_id: 0,
            data: Bytes::from_static(b"abc"),
        });
        assert_eq!(rig.submits().len(), 1);
        rig.host.device_lost();
        assert_eq!(
            rig.guest_receives(),
            [
                (
                    1,
                    Packet::Bulk {
                        endpoint: 0x02,
                        status: Status::IOERROR,
                        length: 0,
                        stream_id: 0,
                        data: Bytes::new()
                    }
                ),
                (0, Packet::DeviceDisconnect)
            ],
            "the pending request answered, then the disconnect"
        );
        assert_eq!(rig.host.urbs_in_flight(), 0);
        let id = rig.guest_sends(Packet::Bulk {
            endpoint: 0x82,
            status: Status::SUCCESS,
            length: 64,
            stream_id: 0,
            data: Bytes::new(),
        });
        assert!(rig.submits().is_empty());
        assert_eq!(
            rig.guest_receives(),
            [(
                id,
                Packet::Bulk { endpoint: 0x82, status: Status::IOERROR, length: 0, stream_id: 0, data: Bytes::new() }
            )]
        );
        rig.guest_sends_with_id(0, Packet::DeviceDisconnectAck);
        assert_eq!(std::iter::from_fn(|| rig.host.poll_event()).last(), Some(HostEvent::DisconnectAcknowledged));
    }

    /// A bootloader the device re-enumerates as: 1209:0007, one DFU interface, no endpoints.
    const BOOTLOADER: [u8; 18] = [18, 1, 0x00, 0x02, 0, 0, 0, 64, 0x09, 0x12, 0x07, 0x00, 0x00, 0x02, 1, 2, 3, 1];
    const BOOTLOADER_CONFIGURATION: [u8; 18] = [
        9, 2, 18, 0, 1, 1, 0, 0x80, 50, //
        9, 4, 0, 0, 0, 0xfe, 1, 2, 0,
    ];

    #[test]
    fn a_replaced_device_is_announced_anew_after_the_guest_acknowledged_the_disconnect() {
        let mut rig = Rig::announced();
        // The old device is busy: interrupt receiving and a control transfer pending.
        rig.guest_sends(Packet::StartInterruptReceiving { endpoint: 0x81 });
        let control = rig.guest_sends(Packet::Control {
            endpoint: 0x80,
            request: 6,
            requesttype: 0x80,
            status: Status::SUCCESS,
            value: 0x0300,
            index: 0,
            length: 255,
            data: Bytes::new(),
        });
        let old = rig.submits();
        assert_eq!(old.len(), INTERRUPT_URBS + 1);
        rig.guest_receives();

        rig.host.replace_device(Speed::HIGH);
        let gone = Packet::Control {
            endpoint: 0x80,
            request: 6,
            requesttype: 0x80,
            status: Status::IOERROR,
            value: 0x0300,
            index: 0,
            length: 0,
            data: Bytes::new(),
        };
        assert_eq!(
            rig.guest_receives(),
            [(control, gone), (0, Packet::DeviceDisconnect)],
            "the old device's pending request is answered, then it goes; its streams are not answered"
        );
        assert!(rig.host.awaits_disconnect_ack());
        let reads = rig.submits();
        assert_eq!(reads.len(), 1, "only the new device's descriptor read: nothing of the old device's streams");
        assert_eq!(rig.host.urbs_in_flight(), 1);
        // Late completions of the old device's URBs are nobody's.
        for (tag, _) in &old {
            rig.host.handle_urb(*tag, ok(&[1, 2, 3])).unwrap();
        }
        assert!(rig.guest_receives().is_empty(), "nothing answered for the old device after its disconnect");
        // The new device's descriptors.
        let mut pending = reads;
        while let Some((tag, urb)) = pending.pop() {
            let wanted = usize::from(u16::from_le_bytes([urb.setup[6], urb.setup[7]]));
            let reply: &[u8] = match (urb.setup[1], urb.setup[3]) {
                (0x06, 0x01) => &BOOTLOADER,
                (0x06, 0x02) => &BOOTLOADER_CONFIGURATION,
                (0x08, _) => &[1],
                other => panic!("unexpected request {other:?}"),
            };
            rig.host.handle_urb(tag, ok(&reply[..wanted.min(reply.len())])).unwrap();
            pending.extend(rig.submits());
        }
        assert!(!rig.host.is_announced(), "announced before the guest acknowledged the disconnect");
        assert!(rig.guest_receives().is_empty());
        // A request the guest sent for the old device before it read the disconnect is refused.
        rig.guest_sends_with_id(control, Packet::GetConfiguration);
        assert_eq!(
            rig.guest_receives(),
            [(control, Packet::ConfigurationStatus { status: Status::IOERROR, configuration: 1 })]
        );
        assert!(rig.submits().is_empty());

        rig.guest_sends_with_id(0, Packet::DeviceDisconnectAck);
        assert!(!rig.host.awaits_disconnect_ack());
        let packets = rig.guest_receives();
        let [(0, Packet::EpInfo(endpoints)), (0, Packet::InterfaceInfo(interfaces)), (0, connect)] = packets.as_slice()
        else {
            panic!("expected ep_info, interface_info, device_connect: {packets:?}")
        };
        assert_eq!(endpoints.kind[EndpointInfo::index(0x81)], 255, "the old device's interrupt endpoint is gone");
        assert_eq!((interfaces.interface.clone(), interfaces.class.clone()), (vec![0], vec![0xfe]));
        assert_eq!(
            connect,
            &Packet::DeviceConnect {
                speed: 2,
                class: 0,
                subclass: 0,
                protocol: 0,
                vendor_id: 0x1209,
                product_id: 0x0007,
                device_version_bcd: 0x0200
            }
        );
        // The new device takes requests.
        rig.guest_sends(Packet::SetConfiguration { configuration: 1 });
        assert_eq!(rig.submits().len(), 1);
    }

    #[test]
    fn a_guest_without_disconnect_acks_gets_the_new_device_at_once() {
        let caps = Caps(0).with(Caps::IDS_64).with(Caps::EP_INFO_MAX_PACKET_SIZE);
        let mut rig = Rig {
            host: UsbHost::new("t", Speed::FULL),
            guest: Codec::new(Side::Guest, caps, MAX_GUEST_PACKET),
            next_id: 1,
        };
        rig.answer_descriptor_reads();
        rig.guest_receives();
        rig.hello();
        assert_eq!(rig.guest_receives().len(), 3);
        rig.host.replace_device(Speed::FULL);
        assert!(!rig.host.awaits_disconnect_ack());
        rig.answer_descriptor_reads();
        let kinds: Vec<PacketType> = rig.guest_receives().iter().map(|(_, p)| p.kind()).collect();
        assert_eq!(
            kinds,
            [
                PacketType::DEVICE_DISCONNECT,
                PacketType::EP_INFO,
                PacketType::INTERFACE_INFO,
                PacketType::DEVICE_CONNECT
            ]
        );
    }

    /// Answers the descriptor reads the host submitted with the bootloader's descriptors.
    fn answer_bootloader_reads(rig: &mut Rig) {
        let mut pending = rig.submits();
        while let Some((tag, urb)) = pending.pop() {
            let wanted = usize::from(u16::from_le_bytes([urb.setup[6], urb.setup[7]]));
            let reply: &[u8] = match (urb.setup[1], urb.setup[3]) {
                (0x06, 0x01) => &BOOTLOADER,
                (0x06, 0x02) => &BOOTLOADER_CONFIGURATION,
                (0x08, _) => &[1],
                other => panic!("unexpected request {other:?}"),
            };
            rig.host.handle_urb(tag, ok(&reply[..wanted.min(reply.len())])).unwrap();
            pending.extend(rig.submits());
        }
    }

    /// A configured device, and the guest's reset of it on the way to the device.
    fn reset_by_the_guest() -> Rig {
        let mut rig = Rig::announced();
        rig.guest_sends(Packet::SetConfiguration { configuration: 1 });
        let [(tag, _)] = rig.submits().try_into().unwrap();
        rig.host.handle_urb(tag, ok(&[])).unwrap();
        rig.guest_receives();
        rig.guest_sends(Packet::Reset);
        let [(_, reset)] = rig.submits().try_into().unwrap();
        assert_eq!(reset.setup, [0x23, 0x03, 0x04, 0, 0, 0, 0, 0]);
        rig
    }

    fn get_device_descriptor(length: u16) -> Packet {
        Packet::Control {
            endpoint: 0x80,
            request: 6,
            requesttype: 0x80,
            status: Status::SUCCESS,
            value: 0x0100,
            index: 0,
            length,
            data: Bytes::new(),
        }
    }

    #[test]
    fn a_device_that_reenumerates_on_the_guests_reset_answers_the_guest_as_the_new_device() {
        let mut rig = reset_by_the_guest();
        // The device re-enumerates on the reset: the guest, inside its reset, is not told.
        rig.host.device_lost();
        assert!(rig.guest_receives().is_empty(), "the guest was told the device went during its reset");
        // Its kernel checks the device after the reset: held until the new device is there.
        let read = rig.guest_sends(get_device_descriptor(64));
        assert!(rig.guest_receives().is_empty() && rig.submits().is_empty());
        rig.host.replace_device(Speed::FULL);
        // The new device's descriptors; the held read reaches it once they are in.
        answer_bootloader_reads(&mut rig);
        let packets = rig.guest_receives();
        let [(0, Packet::EpInfo(endpoints)), (0, Packet::InterfaceInfo(interfaces)), (id, Packet::Control { status, data, .. })] =
            packets.as_slice()
        else {
            panic!("expected ep_info, interface_info and the read's answer, no unplug and no plug: {packets:?}")
        };
        assert_eq!(endpoints.kind[EndpointInfo::index(0x81)], 255);
        assert_eq!(interfaces.class, vec![0xfe]);
        assert_eq!((*id, *status, data.as_ref()), (read, Status::SUCCESS, &BOOTLOADER[..]));
        assert!(rig.host.is_announced());
        assert_eq!(std::iter::from_fn(|| rig.host.poll_event()).last(), Some(HostEvent::ReplacedOnReset { held: 1 }));
        // The new device is unconfigured: the kernel's reset of it as it enumerates is skipped.
        rig.guest_sends(Packet::Reset);
        assert!(rig.submits().is_empty());
    }

    #[test]
    fn a_device_that_answered_after_the_reset_goes_with_a_disconnect() {
        let mut rig = reset_by_the_guest();
        let read = rig.guest_sends(get_device_descriptor(18));
        let [(tag, _)] = rig.submits().try_into().unwrap();
        rig.host.handle_urb(tag, ok(&DEVICE)).unwrap();
        rig.guest_receives();
        rig.host.device_lost();
        assert_eq!(rig.guest_receives(), [(0, Packet::DeviceDisconnect)]);
        assert_ne!(read, 0);
    }

    #[test]
    fn a_device_back_at_another_speed_after_the_reset_is_unplugged_and_plugged() {
        let mut rig = reset_by_the_guest();
        rig.host.device_lost();
        let read = rig.guest_sends(get_device_descriptor(64));
        rig.host.replace_device(Speed::HIGH);
        let packets = rig.guest_receives();
        let [(id, Packet::Control { status: Status::IOERROR, .. }), (0, Packet::DeviceDisconnect)] = packets.as_slice()
        else {
            panic!("expected the held read refused, then device_disconnect: {packets:?}")
        };
        assert_eq!(*id, read);
        answer_bootloader_reads(&mut rig);
        assert!(rig.guest_receives().is_empty(), "announced before the guest acknowledged the disconnect");
        rig.guest_sends_with_id(0, Packet::DeviceDisconnectAck);
        let kinds: Vec<PacketType> = rig.guest_receives().iter().map(|(_, p)| p.kind()).collect();
        assert_eq!(kinds, [PacketType::EP_INFO, PacketType::INTERFACE_INFO, PacketType::DEVICE_CONNECT]);
    }

    #[test]
    fn requests_held_past_the_bound_are_refused() {
        let mut rig = reset_by_the_guest();
        rig.host.device_lost();
        let ids: Vec<u64> = (0..40).map(|_| rig.guest_sends(get_device_descriptor(18))).collect();
        let refused: Vec<u64> = rig.guest_receives().iter().map(|(id, _)| *id).collect();
        assert_eq!(refused, ids[32..], "the first 32 are held, the rest refused");
        // Gone again before its descriptors are in: the held ones are refused, then the disconnect.
        rig.host.replace_device(Speed::FULL);
        rig.host.device_lost();
        let packets = rig.guest_receives();
        assert_eq!(packets.len(), 33);
        assert_eq!(packets.last(), Some(&(0, Packet::DeviceDisconnect)));
    }

    #[test]
    fn a_guest_filter_that_refuses_the_device_stops_the_announce() {
        // QEMU sends its filter right after its hello, before our descriptor reads are done.
        let mut host = UsbHost::new("t", Speed::FULL);
        let guest = Codec::new(Side::Guest, guest_caps(), MAX_GUEST_PACKET);
        let mut wire = BytesMut::new();
        guest.encode(0, &guest.hello("q"), &mut wire).unwrap();
        host.handle_guest(&mut wire).unwrap();
        let mut rig = Rig { host, guest, next_id: 1 };
        rig.guest_receives();
        rig.guest_sends_with_id(0, Packet::FilterFilter { rules: "0x03,-1,-1,-1,0|-1,-1,-1,-1,1".into() });
        rig.answer_descriptor_reads();
        assert!(!rig.host.is_announced());
        let events: Vec<HostEvent> = std::iter::from_fn(|| rig.host.poll_event()).collect();
        assert!(events.iter().any(|e| matches!(e, HostEvent::FilteredOut { .. })), "{events:?}");
        assert!(rig.guest_receives().is_empty(), "nothing announced");
    }

    #[test]
    fn a_device_without_its_descriptor_is_an_error() {
        let mut host = UsbHost::new("t", Speed::FULL);
        let Some(UrbCommand::Submit { tag, .. }) = host.poll_urb() else { panic!() };
        let error = host.handle_urb(tag, failed(UrbStatus::EPIPE)).unwrap_err();
        assert!(matches!(error, HostError::Descriptor { what: "device", .. }), "{error}");
    }

    #[test]
    fn bytes_that_are_not_usbredir_end_the_guest() {
        let mut host = UsbHost::new("t", Speed::FULL);
        let mut garbage = BytesMut::from(&[0xffu8; 64][..]);
        assert!(matches!(host.handle_guest(&mut garbage), Err(HostError::Guest(_))));
    }
}
