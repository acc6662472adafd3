//! What the bridge knows of the device and tells the guest: the descriptors `UsbHost` reads
//! through the URB path at start (device, each configuration, the active one), the
//! configuration and alt settings in effect, and the announce built from them (ep_info,
//! interface_info, device_connect), and the device coming and going under the same guest
//! (lost: the guest's pending requests answered, then `device_disconnect`; replaced: the new
//! device's descriptors read and announced). Not here: the guest's requests (`host.rs`) and
//! the host-driven streams (`streams.rs`).

use bytes::Bytes;
use usbwire_device::descriptor::{ConfigurationInfo, DeviceDescriptor};
use usbwire_proto::{Speed, Status as UrbStatus};

use super::state::{DeviceModel, Held};
use super::{redir_speed, HostError, HostEvent, Pending, UrbRequest, UrbResult, UsbHost};
use crate::packet::Packet;
use crate::wire::{Caps, Status};

/// Configurations read at start (a device announcing more is cut to these).
const MAX_CONFIGURATIONS: u8 = 8;
/// Guest requests held while a device re-enumerates on the guest's reset: a
/// kernel's descriptor reads after its reset are a few; past these (or past
/// [`MAX_HELD_BYTES`] of data) requests are refused as for a device not there.
const MAX_HELD: usize = 32;
const MAX_HELD_BYTES: usize = 16 * 1024;

impl UsbHost {
    /// The completion of one of the descriptor reads queued at start; the last one makes the
    /// device ready to announce.
    pub(super) fn descriptor_read(&mut self, read: Pending, result: UrbResult) -> Result<(), HostError> {
        match read {
            Pending::DeviceDescriptor => {
                let descriptor = DeviceDescriptor::parse(&result.data)
                    .filter(|_| result.status == UrbStatus::OK)
                    .ok_or(HostError::Descriptor { what: "device", status: result.status })?;
                let count = descriptor.num_configurations.min(MAX_CONFIGURATIONS);
                self.device.descriptor = Some(descriptor);
                if count == 0 {
                    self.read_active_configuration();
                } else {
                    self.read_configuration_header(0);
                }
            }
            Pending::ConfigurationHeader { index } => {
                if result.status != UrbStatus::OK || result.data.len() < 4 {
                    return Err(HostError::Descriptor { what: "configuration", status: result.status });
                }
                let total = u16::from_le_bytes([result.data[2], result.data[3]]);
                self.submit(
                    Pending::Configuration { index },
                    UrbRequest::control(get_descriptor(0x02, index, total), Bytes::new()),
                );
            }
            Pending::Configuration { index } => {
                let info = ConfigurationInfo::parse(&result.data)
                    .filter(|_| result.status == UrbStatus::OK)
                    .ok_or(HostError::Descriptor { what: "configuration", status: result.status })?;
                self.device.configurations.push((result.data, info));
                let count = self.device.descriptor.as_ref().map_or(0, |d| d.num_configurations.min(MAX_CONFIGURATIONS));
                if index + 1 < count {
                    self.read_configuration_header(index + 1);
                } else {
                    self.read_active_configuration();
                }
            }
            Pending::ActiveConfiguration => {
                self.device.configuration = match (result.status, result.data.first()) {
                    (UrbStatus::OK, Some(&value)) => value,
                    // A device that cannot say: assume its first configuration, as the server set it.
                    _ => self.device.configurations.first().map_or(0, |(_, info)| info.value),
                };
                self.ready = true;
                self.announce();
            }
            // `handle_urb` passes the four reads only.
            _ => {}
        }
        Ok(())
    }

    /// Starts reading the device's descriptors (at start, and for a device
    /// that replaced the one before).
    pub(super) fn read_device_descriptor(&mut self) {
        self.submit(Pending::DeviceDescriptor, UrbRequest::control(get_descriptor(0x01, 0, 18), Bytes::new()));
    }

    fn read_configuration_header(&mut self, index: u8) {
        let urb = UrbRequest::control(get_descriptor(0x02, index, 9), Bytes::new());
        self.submit(Pending::ConfigurationHeader { index }, urb);
    }

    fn read_active_configuration(&mut self) {
        let urb = UrbRequest::control([0x80, 0x08, 0, 0, 0, 0, 1, 0], Bytes::new());
        self.submit(Pending::ActiveConfiguration, urb);
    }

    /// Announces the device once both the descriptors and the guest's hello are in.
    pub(super) fn announce(&mut self) {
        if !self.ready
            || !self.guest_hello
            || self.announced
            || self.gone
            || self.filtered_out
            || self.awaiting_disconnect_ack
        {
            return;
        }
        let Some(descriptor) = self.device.descriptor.clone() else { return };
        if let Some(rules) = self.filter.clone() {
            let interfaces = self.device.active().map(|c| c.interface_classes()).unwrap_or_default();
            if !crate::filter::allows(&rules, &descriptor, &interfaces) {
                self.filtered_out = true;
                // A guest that still sees the device before (its reset) is told it went.
                self.disconnect_guest();
                self.events.push_back(HostEvent::FilteredOut { rules });
                return;
            }
        }
        self.send_device_info();
        if let Some(held) = self.held.take() {
            // The device re-enumerated on the guest's reset: as for a real one, the
            // guest's requests after its reset reach the new device (its kernel then
            // sees other descriptors, and re-enumerates the port itself). QEMU keeps
            // the device attached; the new endpoints and interfaces are all it needs.
            self.announced = true;
            self.events.push_back(HostEvent::ReplacedOnReset { held: held.packets.len() });
            for (id, packet) in held.packets {
                self.handle_packet(id, packet);
            }
            return;
        }
        let connect = Packet::DeviceConnect {
            speed: redir_speed(self.speed),
            class: descriptor.class,
            subclass: descriptor.subclass,
            protocol: descriptor.protocol,
            vendor_id: descriptor.vendor_id,
            product_id: descriptor.product_id,
            device_version_bcd: descriptor.bcd_device,
        };
        self.send(0, &connect);
        self.announced = true;
        self.events.push_back(HostEvent::Announced);
    }

    /// ep_info then interface_info, as the protocol orders them.
    pub(super) fn send_device_info(&mut self) {
        let endpoints = self.device.endpoint_info(self.speed);
        self.send(0, &Packet::EpInfo(Box::new(endpoints)));
        let interfaces = self.device.interface_info();
        self.send(0, &Packet::InterfaceInfo(interfaces));
    }
}

/// A GET_DESCRIPTOR request for descriptor `kind` number `index`.
pub(super) fn get_descriptor(kind: u8, index: u8, length: u16) -> [u8; 8] {
    let [lo, hi] = length.to_le_bytes();
    [0x80, 0x06, index, kind, 0, 0, lo, hi]
}

/// The device coming and going under the same guest.
impl UsbHost {
    /// The same port holds a new device (it re-enumerated and was imported
    /// again), of `speed`: the old one is disconnected if it was not yet,
    /// what the guest chose for it is forgotten, and the new descriptors are
    /// read (their URBs come from [`poll_urb`](Self::poll_urb)). The new
    /// device is announced once they are in and the guest has acknowledged
    /// the disconnect (when it announced `device_disconnect_ack`); requests
    /// before that are refused, as for a device that is not there.
    ///
    /// A device that re-enumerated on the guest's reset is not disconnected
    /// (unless its speed changed): the guest's requests since the reset wait
    /// for the new descriptors, then go to the new device, after its ep_info
    /// and interface_info, as a real device answers a kernel checking it
    /// after a reset (see [`device_lost`](Self::device_lost)).
    pub fn replace_device(&mut self, speed: Speed) {
        self.device_lost();
        if self.held.is_some() && speed != self.speed {
            self.disconnect_guest();
        }
        self.speed = speed;
        self.device = DeviceModel::default();
        self.ready = false;
        self.announced = false;
        self.filtered_out = false;
        self.gone = false;
        self.configured_by_guest = false;
        self.since_reset = false;
        self.read_device_descriptor();
    }

    /// The USB/IP side is gone: the guest's requests still pending are
    /// answered with an I/O error (in the order they came), then the guest
    /// is told the device disconnected, as usbredirhost does when libusb
    /// fails a device's transfers before it notices the unplug. (QEMU drops
    /// its bookkeeping of a device on `device_disconnect`: a request left
    /// without an answer before it would leave the guest's transfer hanging,
    /// as a guest resetting a board that re-enumerates on the reset found.)
    ///
    /// Except when the device goes on the reset the guest asked for (nothing
    /// answered since): a real device that re-enumerates on a bus reset is
    /// still at the port after it, so the guest is not told; its requests
    /// are held until the device is back ([`replace_device`](Self::replace_device)).
    /// A guest told `device_disconnect` then would wait seconds per descriptor
    /// read of the old device's reset it is still inside (its kernel does).
    pub fn device_lost(&mut self) {
        if self.gone {
            return;
        }
        self.gone = true;
        let mut pending: Vec<(u64, Pending)> = self.pending.drain().collect();
        pending.sort_unstable_by_key(|(tag, _)| *tag);
        for (_, pending) in pending {
            self.answer_gone(pending);
        }
        self.by_guest_id.clear();
        self.streams.clear();
        self.commands.clear();
        if self.announced && self.since_reset && self.held.is_none() {
            self.held = Some(Held::default());
            return;
        }
        self.disconnect_guest();
    }

    /// Tells the guest the device it sees went: requests held for a device
    /// re-enumerating on a reset are refused first, then `device_disconnect`.
    fn disconnect_guest(&mut self) {
        let held = self.held.take();
        let sees_device = self.announced || held.is_some();
        for (id, packet) in held.into_iter().flat_map(|held| held.packets) {
            self.refuse(id, &packet);
        }
        if sees_device {
            self.send(0, &Packet::DeviceDisconnect);
            self.awaiting_disconnect_ack = self.codec.caps().has(Caps::DEVICE_DISCONNECT_ACK);
        }
    }

    /// Holds a guest's request for the device re-enumerating on its reset
    /// (refused past the bounds, as for a device that is not there).
    pub(super) fn hold(&mut self, id: u64, packet: Packet) {
        let bytes = match &packet {
            Packet::Control { data, .. }
            | Packet::Bulk { data, .. }
            | Packet::Iso { data, .. }
            | Packet::Interrupt { data, .. }
            | Packet::BufferedBulk { data, .. } => data.len(),
            _ => 0,
        };
        match self.held.as_mut() {
            Some(held) if held.packets.len() < MAX_HELD && held.bytes + bytes <= MAX_HELD_BYTES => {
                held.bytes += bytes;
                held.packets.push_back((id, packet));
            }
            _ => self.refuse(id, &packet),
        }
    }

    /// The I/O error a guest's request gets when its device went (host-driven
    /// streams and our own descriptor reads have no request to answer).
    fn answer_gone(&mut self, pending: Pending) {
        let status = Status::IOERROR;
        let (id, reply) = match pending {
            Pending::Control { id, endpoint, request, requesttype, value, index } => {
                let data = Bytes::new();
                (id, Packet::Control { endpoint, request, requesttype, status, value, index, length: 0, data })
            }
            Pending::Bulk { id, endpoint, stream_id } => {
                (id, Packet::Bulk { endpoint, status, length: 0, stream_id, data: Bytes::new() })
            }
            Pending::InterruptOut { id, endpoint } => {
                (id, Packet::Interrupt { endpoint, status, length: 0, data: Bytes::new() })
            }
            Pending::SetConfiguration { id, .. } => {
                (id, Packet::ConfigurationStatus { status, configuration: self.device.configuration })
            }
            Pending::SetAltSetting { id, interface, .. } => {
                (id, Packet::AltSettingStatus { status, interface, alt: self.device.alt_of(interface) })
            }
            _ => return,
        };
        self.send(id, &reply);
    }

    /// Whether a `device_disconnect` we sent is not acknowledged yet (the
    /// next device waits for it).
    pub fn awaits_disconnect_ack(&self) -> bool {
        self.awaiting_disconnect_ack
    }
}
