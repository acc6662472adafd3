//! What [`UsbHost`](super::UsbHost) keeps between calls and its files share:
//! the [`DeviceModel`] (what the descriptors say, the configuration and alt
//! settings in effect, and the ep_info and interface_info built from them),
//! the guest's requests [`Held`] while a device re-enumerates on its reset,
//! and each host-driven [`Stream`]'s bookkeeping.
//!
//! It sits below the usb-host core's files (`host.rs`, `device.rs`,
//! `streams.rs`), which change it. It is not for deciding anything: reading
//! descriptors, announcing, holding and streaming are theirs.

use std::collections::{HashMap, HashSet, VecDeque};

use bytes::Bytes;
use usbwire_device::descriptor::{ConfigurationInfo, DeviceDescriptor};
use usbwire_device::TransferType;
use usbwire_proto::Speed;

use crate::packet::{EndpointInfo, InterfaceInfo, Packet};

/// The guest's requests waiting for the device that re-enumerates on its reset.
#[derive(Debug, Default)]
pub(super) struct Held {
    pub(super) packets: VecDeque<(u64, Packet)>,
    /// Data the packets carry.
    pub(super) bytes: usize,
}

/// What the descriptors say and what the guest chose.
#[derive(Debug, Default)]
pub(super) struct DeviceModel {
    pub(super) descriptor: Option<DeviceDescriptor>,
    /// Each configuration descriptor, in index order.
    pub(super) configurations: Vec<(Bytes, ConfigurationInfo)>,
    /// bConfigurationValue in effect (0: unconfigured).
    pub(super) configuration: u8,
    /// Alt setting per interface number.
    pub(super) alt: HashMap<u8, u8>,
}

impl DeviceModel {
    pub(super) fn active(&self) -> Option<&ConfigurationInfo> {
        self.configurations.iter().map(|(_, info)| info).find(|info| info.value == self.configuration)
    }

    pub(super) fn alt_of(&self, interface: u8) -> u8 {
        self.alt.get(&interface).copied().unwrap_or(0)
    }

    /// ep_info for the configuration and alt settings in effect.
    pub(super) fn endpoint_info(&self, speed: Speed) -> EndpointInfo {
        let mut info = EndpointInfo::default();
        for index in [0, 16] {
            info.kind[index] = 0;
            info.max_packet_size[index] = self.descriptor.as_ref().map_or(64, |d| match d.max_packet_size0 {
                9 if speed.is_superspeed() => 512,
                size => u16::from(size),
            });
        }
        let Some(config) = self.active() else { return info };
        for interface in config.interfaces.iter().filter(|i| i.alt_setting == self.alt_of(i.number)) {
            for ep in &interface.endpoints {
                let index = EndpointInfo::index(ep.address);
                info.kind[index] = match ep.transfer_type {
                    TransferType::Control => 0,
                    TransferType::Isochronous => 1,
                    TransferType::Bulk => 2,
                    TransferType::Interrupt => 3,
                };
                info.interval[index] = ep.interval;
                info.interface[index] = interface.number;
                info.max_packet_size[index] = max_packet_bytes(ep.max_packet_size, speed, ep.transfer_type);
            }
        }
        info
    }

    /// interface_info for the configuration and alt settings in effect.
    pub(super) fn interface_info(&self) -> InterfaceInfo {
        let mut info = InterfaceInfo::default();
        let Some(config) = self.active() else { return info };
        for interface in config.interfaces.iter().filter(|i| i.alt_setting == self.alt_of(i.number)).take(32) {
            info.interface.push(interface.number);
            info.class.push(interface.class);
            info.subclass.push(interface.subclass);
            info.protocol.push(interface.protocol);
        }
        info
    }

    /// The endpoint's transfer type and max packet bytes in the current setting.
    pub(super) fn endpoint(&self, address: u8, speed: Speed) -> Option<(TransferType, u32)> {
        let config = self.active()?;
        config
            .active_endpoints(|i| self.alt_of(i))
            .find(|ep| ep.address == address)
            .map(|ep| (ep.transfer_type, u32::from(max_packet_bytes(ep.max_packet_size, speed, ep.transfer_type))))
    }

    /// The interface an endpoint belongs to in the current setting.
    pub(super) fn interface_of(&self, address: u8) -> Option<u8> {
        let config = self.active()?;
        config
            .interfaces
            .iter()
            .filter(|i| i.alt_setting == self.alt_of(i.number))
            .find(|i| i.endpoints.iter().any(|ep| ep.address == address))
            .map(|i| i.number)
    }
}

/// Bytes per packet: wMaxPacketSize's size times its high-bandwidth
/// multiplier, which counts for high-speed periodic endpoints only.
fn max_packet_bytes(w_max_packet_size: u16, speed: Speed, kind: TransferType) -> u16 {
    let size = w_max_packet_size & 0x7ff;
    let periodic = matches!(kind, TransferType::Isochronous | TransferType::Interrupt);
    if speed == Speed::HIGH && periodic {
        size * (1 + ((w_max_packet_size >> 11) & 3)).min(3)
    } else {
        size
    }
}

/// A host-driven stream on one endpoint (interrupt receiving, or isochronous).
#[derive(Debug, Default)]
pub(super) struct Stream {
    /// Tags of its URBs in flight.
    pub(super) in_flight: HashSet<u64>,
    /// The id of the next unsolicited packet (restarts at 0 on each start).
    pub(super) next_id: u64,
    /// Isochronous: packets per URB.
    pub(super) pkts_per_urb: u8,
    /// Isochronous OUT: the guest's packets not submitted yet.
    pub(super) out_packets: Vec<Bytes>,
}
