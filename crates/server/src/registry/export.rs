//! One exported device as the registry keeps it: what it lists
//! ([`Described`], replaced when the device re-enumerates), who holds it
//! ([`Slot`]), and the signals its importers and waiters follow.
//!
//! Plain data with its accessors; the rules for importing and giving back
//! are the registry's (`registry.rs`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::{watch, Notify};
use usbwire_device::sync::lock;
use usbwire_device::{Device, DeviceSummary};
use usbwire_proto::op::{BusId, DeviceRecord, InterfaceRecord};

use crate::meter::DeviceMeter;
use crate::peer::PeerProbe;

/// Whether a device can be imported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceState {
    Available,
    /// Imported by `client` since `since`; `identity` is its certificate fingerprint over TLS.
    InUse {
        client: SocketAddr,
        since: SystemTime,
        identity: Option<String>,
        /// The client's connection dropped then; its session waits for it to resume.
        resuming_since: Option<SystemTime>,
    },
}

pub(super) struct Export {
    pub(super) kind: String,
    /// Fixed for the export's life, so lookups need no lock.
    pub(super) busid: BusId,
    /// What the device is now: replaced when it re-enumerates.
    pub(super) described: Mutex<Described>,
    /// Its traffic since the server started, across imports.
    pub(super) meter: Arc<DeviceMeter>,
    pub(super) slot: Mutex<Slot>,
    /// Woken when the slot leaves Releasing (or InUse) for Available or Withdrawn.
    pub(super) released: Notify,
    /// Set when the export is withdrawn (unbind, unplug): the importer's
    /// connection ends and the device is not put back.
    pub(super) withdrawn: watch::Sender<bool>,
    /// Tells a parked session (its client away, resuming) that the same client
    /// imported the device afresh: it gives the device up instead of holding
    /// it for a resume that will not come.
    pub(super) abandoned: Notify,
    /// Set (before `withdrawn`) when it was withdrawn because the device left its port.
    pub(super) unplugged: std::sync::atomic::AtomicBool,
}

/// What an export lists: the record USB/IP sends, the device's own summary,
/// and which enumeration of the device they describe.
pub(super) struct Described {
    pub(super) record: DeviceRecord,
    pub(super) summary: DeviceSummary,
    pub(super) enumeration: u32,
}

impl Described {
    pub(super) fn of(busid: BusId, busnum: u32, devnum: u32, path: String, device: &dyn Device) -> Self {
        let summary = device.summary();
        let record = DeviceRecord {
            path,
            busid: busid.clone(),
            busnum,
            devnum,
            speed: summary.speed.for_vhci(),
            id_vendor: summary.vendor_id,
            id_product: summary.product_id,
            bcd_device: summary.bcd_device,
            b_device_class: summary.class,
            b_device_sub_class: summary.subclass,
            b_device_protocol: summary.protocol,
            b_configuration_value: summary.configuration_value,
            b_num_configurations: summary.num_configurations,
            b_num_interfaces: summary.interfaces.len().min(255) as u8,
            interfaces: summary
                .interfaces
                .iter()
                .map(|&(class, subclass, protocol)| InterfaceRecord {
                    b_interface_class: class,
                    b_interface_sub_class: subclass,
                    b_interface_protocol: protocol,
                })
                .collect(),
        };
        Self { record, summary, enumeration: device.enumeration() }
    }
}

impl Export {
    pub(super) fn described(&self) -> std::sync::MutexGuard<'_, Described> {
        lock(&self.described)
    }

    pub(super) fn state(&self) -> DeviceState {
        match &*lock(&self.slot) {
            // A releasing device is free for the next import, which waits for its reset.
            Slot::Available(_) | Slot::Releasing | Slot::Withdrawn => DeviceState::Available,
            Slot::InUse { client, since, identity, resuming_since, .. } => DeviceState::InUse {
                client: *client,
                since: *since,
                identity: identity.clone(),
                resuming_since: *resuming_since,
            },
        }
    }

    /// Describes the device anew (it re-enumerated): the same bus id, numbers
    /// and path, the new device's descriptors.
    pub(super) fn redescribe(&self, device: &dyn Device) {
        let mut described = self.described();
        let record = &described.record;
        let (busnum, devnum, path) = (record.busnum, record.devnum, record.path.clone());
        *described = Described::of(self.busid.clone(), busnum, devnum, path, device);
    }
}

pub(super) enum Slot {
    Available(Box<dyn Device>),
    InUse {
        client: SocketAddr,
        since: SystemTime,
        identity: Option<String>,
        probe: PeerProbe,
        resuming_since: Option<SystemTime>,
    },
    /// The holder's connection has ended; the device is being reset.
    Releasing,
    Withdrawn,
}
