//! Which endpoints of the imported device carry Bulk-Only mass storage: read
//! from the configuration descriptors (those the kernel fetches as their
//! replies pass the accelerator, and those of the import's descriptor
//! snapshot, which the kernel's requests may never fetch from the device)
//! and the configuration the kernel sets. Not for
//! anything the device's other interfaces do.

use usbwire_device::descriptor::{ConfigurationInfo, InterfaceInfo};
use usbwire_device::TransferType;
use usbwire_proto::descriptors::{self, Snapshot};
use usbwire_proto::urb::{CmdSubmit, RetSubmit};
use usbwire_proto::{Direction, Status};

const GET_DESCRIPTOR: u8 = 6;
const SET_CONFIGURATION: u8 = 9;
const CONFIGURATION: u8 = 2;

/// A Bulk-Only interface's pipes: endpoint numbers, without the direction bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Pipes {
    pub(super) interface: u8,
    pub(super) bulk_out: u8,
    pub(super) bulk_in: u8,
}

impl Pipes {
    /// The setup packets of usb-storage's reset recovery: the Bulk-Only Mass
    /// Storage Reset, then CLEAR_FEATURE(ENDPOINT_HALT) on the IN and the OUT pipe.
    pub(super) fn reset_recovery(self) -> [[u8; 8]; 3] {
        let [interface_low, interface_high] = u16::from(self.interface).to_le_bytes();
        [
            [0x21, 0xff, 0, 0, interface_low, interface_high, 0, 0],
            [0x02, 0x01, 0, 0, 0x80 | self.bulk_in, 0, 0, 0],
            [0x02, 0x01, 0, 0, self.bulk_out, 0, 0, 0],
        ]
    }
}

/// A control request whose reply teaches us the pipes.
#[derive(Clone, Copy, Debug)]
enum Watched {
    Configuration,
    SetConfiguration(u8),
}

/// The Bulk-Only pipes of each configuration seen, and of the one set.
#[derive(Debug, Default)]
pub(super) struct Interfaces {
    /// Bulk-Only pipes of each configuration whose whole descriptor was read.
    configurations: Vec<(u8, Vec<Pipes>)>,
    /// Those of the configuration set.
    active: Vec<Pipes>,
    /// Interfaces (by configuration) with a UAS alternate setting: a host may
    /// drive them with UAS, not Bulk-Only.
    uas: Vec<(u8, u8)>,
    watched: Vec<(u32, Watched)>,
    /// The configuration set.
    active_value: Option<u8>,
}

impl Interfaces {
    /// What the configuration descriptors of an import's snapshot teach.
    pub(super) fn from_snapshot(snapshot: Option<&Snapshot>) -> Self {
        let mut interfaces = Self::default();
        let configurations = snapshot.into_iter().flat_map(Snapshot::entries).filter(|entry| {
            entry.request_type == descriptors::TO_HOST_DEVICE && (entry.value >> 8) as u8 == descriptors::CONFIGURATION
        });
        for entry in configurations {
            interfaces.learn_configuration(&entry.data);
        }
        interfaces
    }

    /// The Bulk-Only pipes a URB is on, if any.
    pub(super) fn pipes_of(&self, submit: &CmdSubmit) -> Option<Pipes> {
        self.active.iter().copied().find(|pipes| match submit.direction {
            Direction::Out => pipes.bulk_out == submit.ep,
            Direction::In => pipes.bulk_in == submit.ep,
        })
    }

    /// The active configuration's first Bulk-Only interface that only
    /// Bulk-Only drives (no UAS alternate): what usb-storage will scan.
    pub(super) fn bulk_only_alone(&self) -> Option<Pipes> {
        let value = self.active_value?;
        self.active.iter().copied().find(|pipes| !self.uas.contains(&(value, pipes.interface)))
    }

    /// The pipes of the active configuration's Bulk-Only interface `number`.
    pub(super) fn active_interface(&self, number: u8) -> Option<Pipes> {
        self.active.iter().copied().find(|pipes| pipes.interface == number)
    }

    /// Notes a control request whose reply says something of the pipes.
    pub(super) fn watch(&mut self, submit: &CmdSubmit) {
        let [request_type, request, value_low, value_high, ..] = submit.setup;
        let watched = match (request_type, request) {
            (0x80, GET_DESCRIPTOR) if value_high == CONFIGURATION => Watched::Configuration,
            (0x00, SET_CONFIGURATION) => Watched::SetConfiguration(value_low),
            _ => return,
        };
        self.watched.push((submit.seqnum, watched));
    }

    /// A whole configuration descriptor, as the device gave it (to the
    /// kernel, or to the server's descriptor snapshot); its first 9 bytes
    /// alone teach nothing.
    pub(super) fn learn_configuration(&mut self, descriptor: &[u8]) {
        let Some(total) = descriptor.get(2..4).map(|b| u16::from_le_bytes([b[0], b[1]])) else { return };
        if descriptor.len() < usize::from(total) {
            return;
        }
        let Some(info) = ConfigurationInfo::parse(descriptor) else { return };
        let pipes = bulk_only_pipes(&info);
        self.configurations.retain(|(value, _)| *value != info.value);
        self.configurations.push((info.value, pipes));
        self.uas.retain(|(value, _)| *value != info.value);
        let uas = info.interfaces.iter().filter(|i| (i.class, i.subclass, i.protocol) == (0x08, 0x06, 0x62));
        self.uas.extend(uas.map(|i| (info.value, i.number)));
    }

    /// Reads a reply to a watched request; `true` when a configuration was set.
    pub(super) fn learn(&mut self, reply: &RetSubmit) -> bool {
        let Some(at) = self.watched.iter().position(|(seqnum, _)| *seqnum == reply.seqnum) else { return false };
        let (_, watched) = self.watched.swap_remove(at);
        if reply.status != Status::OK {
            return false;
        }
        match watched {
            Watched::Configuration => {
                self.learn_configuration(&reply.data);
                false
            }
            Watched::SetConfiguration(value) => {
                self.active_value = Some(value);
                self.active = self
                    .configurations
                    .iter()
                    .find(|(known, _)| *known == value)
                    .map(|(_, pipes)| pipes.clone())
                    .unwrap_or_default();
                true
            }
        }
    }
}

/// Each Bulk-Only interface's first bulk OUT and IN endpoints (alt setting 0).
fn bulk_only_pipes(info: &ConfigurationInfo) -> Vec<Pipes> {
    let bulk = |interface: &InterfaceInfo, direction_in: bool| {
        interface
            .endpoints
            .iter()
            .find(|ep| ep.transfer_type == TransferType::Bulk && (ep.address & 0x80 != 0) == direction_in)
            .map(|ep| ep.address & 0x0f)
    };
    info.interfaces
        .iter()
        .filter(|i| i.alt_setting == 0 && (i.class, i.subclass, i.protocol) == (0x08, 0x06, 0x50))
        .filter_map(|i| Some(Pipes { interface: i.number, bulk_out: bulk(i, false)?, bulk_in: bulk(i, true)? }))
        .collect()
}
