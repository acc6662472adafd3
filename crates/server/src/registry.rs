//! The exported devices: bus ids, what to list, and who holds what.
//!
//! A device is owned by the registry while available and moved out, whole,
//! into the connection that imports it (a [`Lease`]); dropping the lease
//! resets the device and puts it back. The lock here is taken only when a
//! device is listed, imported or released — never per URB.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use tokio::sync::watch;
use tracing::info;
use usbwire_device::{Device, DeviceSummary};
use usbwire_proto::op::{BusId, DeviceRecord, InterfaceRecord, OpStatus};

/// Whether a device can be imported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceState {
    Available,
    /// Imported by `client` since `since`; `identity` is its certificate fingerprint over TLS.
    InUse {
        client: SocketAddr,
        since: SystemTime,
        identity: Option<String>,
    },
}

/// A listed device: its record as USB/IP sends it plus what only we know.
#[derive(Clone, Debug)]
pub struct ExportInfo {
    pub kind: String,
    pub record: DeviceRecord,
    pub summary: DeviceSummary,
    pub state: DeviceState,
}

struct Export {
    kind: String,
    record: DeviceRecord,
    summary: DeviceSummary,
    slot: Mutex<Slot>,
    /// Set when the export is withdrawn (unbind, unplug): the importer's
    /// connection ends and the device is not put back.
    withdrawn: watch::Sender<bool>,
}

enum Slot {
    Available(Box<dyn Device>),
    InUse { client: SocketAddr, since: SystemTime, identity: Option<String> },
    Withdrawn,
}

/// Every exported device. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct Registry {
    exports: Arc<Mutex<Vec<Arc<Export>>>>,
}

impl Registry {
    /// Exports a virtual device under the next free bus id: bus 2 for
    /// SuperSpeed (vhci puts those on its SS hub), bus 1 otherwise.
    pub(crate) fn add(&self, kind: &str, device: Box<dyn Device>) -> BusId {
        let busnum: u32 = if device.summary().speed.is_superspeed() { 2 } else { 1 };
        let mut exports = lock(&self.exports);
        let busid = (1..)
            .map(|devnum| BusId::new(&format!("{busnum}-{devnum}")).expect("short numeric bus ids are valid"))
            .find(|busid| exports.iter().all(|e| &e.record.busid != busid))
            .expect("a free bus id exists");
        let devnum = busid.as_str()[2..].parse().unwrap_or(0);
        let path = format!("/sys/devices/usbwire/{kind}/{busid}");
        Self::insert(&mut exports, kind, busid.clone(), busnum, devnum, path, device);
        busid
    }

    /// Exports a device under a bus id it already has (a real device keeps
    /// its own, as usbipd does). Fails if that bus id is taken.
    pub(crate) fn add_named(
        &self,
        kind: &str,
        busid: BusId,
        (busnum, devnum): (u32, u32),
        path: String,
        device: Box<dyn Device>,
    ) -> Result<(), Box<dyn Device>> {
        let mut exports = lock(&self.exports);
        if exports.iter().any(|e| e.record.busid == busid) {
            return Err(device);
        }
        Self::insert(&mut exports, kind, busid, busnum, devnum, path, device);
        Ok(())
    }

    /// Withdraws an export: gone from the list at once; if imported, the
    /// importer's connection is closed and the device dropped, not put back.
    pub(crate) fn remove(&self, busid: &str) -> bool {
        let mut exports = lock(&self.exports);
        let Some(at) = exports.iter().position(|e| e.record.busid.as_str() == busid) else {
            return false;
        };
        let export = exports.remove(at);
        drop(exports);
        // Mark the slot before telling the importer, so its lease never puts the device back.
        // An available device is dropped here; an imported one when its lease ends.
        let previous = std::mem::replace(&mut *lock(&export.slot), Slot::Withdrawn);
        export.withdrawn.send_replace(true);
        drop(previous);
        info!(busid, "export withdrawn");
        true
    }

    pub(crate) fn contains(&self, busid: &str) -> bool {
        lock(&self.exports).iter().any(|e| e.record.busid.as_str() == busid)
    }

    fn insert(
        exports: &mut Vec<Arc<Export>>,
        kind: &str,
        busid: BusId,
        busnum: u32,
        devnum: u32,
        path: String,
        device: Box<dyn Device>,
    ) {
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
        info!(%busid, kind, vid = format_args!("{:04x}", summary.vendor_id), pid = format_args!("{:04x}", summary.product_id), "exported");
        exports.push(Arc::new(Export {
            kind: kind.to_owned(),
            record,
            summary,
            slot: Mutex::new(Slot::Available(device)),
            withdrawn: watch::Sender::new(false),
        }));
    }

    pub fn len(&self) -> usize {
        lock(&self.exports).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every exported device with its state.
    pub fn list(&self) -> Vec<ExportInfo> {
        lock(&self.exports)
            .iter()
            .map(|e| ExportInfo {
                kind: e.kind.clone(),
                record: e.record.clone(),
                summary: e.summary.clone(),
                state: match &*lock(&e.slot) {
                    Slot::Available(_) | Slot::Withdrawn => DeviceState::Available,
                    Slot::InUse { client, since, identity } => {
                        DeviceState::InUse { client: *client, since: *since, identity: identity.clone() }
                    }
                },
            })
            .collect()
    }

    /// What `OP_REP_DEVLIST` carries: like usbipd, only devices that can be imported.
    /// `visible(kind, busid)` says what this client may see.
    pub(crate) fn devlist(&self, visible: impl Fn(&str, &str) -> bool) -> Vec<DeviceRecord> {
        self.list()
            .into_iter()
            .filter(|e| e.state == DeviceState::Available && visible(&e.kind, e.record.busid.as_str()))
            .map(|e| e.record)
            .collect()
    }

    /// Takes a device for exclusive use by `client`. A device this client may
    /// not see (`visible(kind, busid)`) does not exist for it: `ST_NODEV`.
    pub(crate) fn import(
        &self,
        busid: &BusId,
        client: SocketAddr,
        identity: Option<String>,
        visible: impl Fn(&str, &str) -> bool,
    ) -> Result<Lease, OpStatus> {
        let export = lock(&self.exports)
            .iter()
            .find(|e| &e.record.busid == busid && visible(&e.kind, busid.as_str()))
            .cloned()
            .ok_or(OpStatus::NODEV)?;
        let mut slot = lock(&export.slot);
        match std::mem::replace(&mut *slot, Slot::InUse { client, since: SystemTime::now(), identity }) {
            Slot::Available(device) => {
                drop(slot);
                Ok(Lease { export, device: Some(device), registry: self.clone() })
            }
            busy @ Slot::InUse { .. } => {
                *slot = busy;
                Err(OpStatus::DEV_BUSY)
            }
            Slot::Withdrawn => {
                *slot = Slot::Withdrawn;
                Err(OpStatus::NODEV)
            }
        }
    }
}

/// A device imported by one connection. Dropping it resets the device and
/// lists it as available again — also when the connection task panics or is
/// cancelled.
pub(crate) struct Lease {
    export: Arc<Export>,
    device: Option<Box<dyn Device>>,
    registry: Registry,
}

impl Lease {
    pub(crate) fn record(&self) -> &DeviceRecord {
        &self.export.record
    }

    pub(crate) fn device(&mut self) -> &mut dyn Device {
        self.device.as_deref_mut().expect("the device is present until the lease drops")
    }

    /// Resolves when the export is withdrawn (unbind or unplug).
    pub(crate) fn withdrawn(&self) -> watch::Receiver<bool> {
        self.export.withdrawn.subscribe()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(mut device) = self.device.take() else { return };
        let busid = &self.export.record.busid;
        if device.is_gone() {
            // Unplugged: nothing to give back, nothing to list.
            drop(device);
            self.registry.remove(busid.as_str());
            return;
        }
        let mut slot = lock(&self.export.slot);
        if matches!(*slot, Slot::Withdrawn) {
            drop(slot);
            // Dropping a real device gives its interfaces back to the kernel.
            drop(device);
            info!(%busid, "device released (no longer exported)");
            return;
        }
        device.reset();
        *slot = Slot::Available(device);
        info!(%busid, "device reset and available again");
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> SocketAddr {
        "127.0.0.1:5000".parse().unwrap()
    }

    fn loopback() -> Box<dyn Device> {
        Box::new(usbwire_gadgets::loopback(usbwire_device::Speed::HIGH))
    }

    #[test]
    fn named_exports_keep_their_bus_id_and_virtual_ones_avoid_it() {
        let registry = Registry::default();
        let busid = BusId::new("1-1").unwrap();
        assert!(registry.add_named("host", busid.clone(), (1, 4), "/sys/devices/x/1-1".into(), loopback()).is_ok());
        assert!(registry.add_named("host", busid, (1, 4), String::new(), loopback()).is_err(), "taken");
        assert_eq!(registry.add("loopback", loopback()).as_str(), "1-2");
        let listed = registry.list();
        assert_eq!((listed[0].record.busnum, listed[0].record.devnum), (1, 4));
        assert_eq!(listed[0].record.path, "/sys/devices/x/1-1");
    }

    #[test]
    fn withdrawing_an_imported_device_signals_its_importer_and_does_not_put_it_back() {
        let registry = Registry::default();
        let busid = registry.add("loopback", loopback());
        let lease = registry.import(&busid, peer(), None, |_, _| true).unwrap();
        let withdrawn = lease.withdrawn();
        assert!(!*withdrawn.borrow());
        assert!(registry.remove(busid.as_str()));
        assert!(*withdrawn.borrow(), "the importer is told");
        assert!(registry.list().is_empty());
        drop(lease);
        assert!(registry.list().is_empty(), "not put back after the import ends");
        assert!(matches!(registry.import(&busid, peer(), None, |_, _| true), Err(OpStatus::NODEV)));
        assert!(!registry.remove(busid.as_str()));
    }
}
