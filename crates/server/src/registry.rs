//! The exported devices: bus ids, what to list, and who holds what.
//!
//! A device is owned by the registry while available and moved out, whole,
//! into the connection that imports it (a [`Lease`]); dropping the lease
//! resets the device and puts it back. The lock here is taken only when a
//! device is listed, imported or released — never per URB.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use tracing::info;
use usbwire_device::{Device, DeviceSummary};
use usbwire_proto::op::{BusId, DeviceRecord, InterfaceRecord, OpStatus};

/// Whether a device can be imported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceState {
    Available,
    InUse { client: SocketAddr, since: SystemTime },
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
}

enum Slot {
    Available(Box<dyn Device>),
    InUse { client: SocketAddr, since: SystemTime },
}

/// Every exported device. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct Registry {
    exports: Arc<Mutex<Vec<Arc<Export>>>>,
}

impl Registry {
    pub(crate) fn add(&self, kind: &str, device: Box<dyn Device>) -> BusId {
        let summary = device.summary();
        let mut exports = lock(&self.exports);
        // vhci puts SuperSpeed devices on its SS hub; mirror that in the bus number.
        let busnum: u32 = if summary.speed.is_superspeed() { 2 } else { 1 };
        let devnum = exports.iter().filter(|e| e.record.busnum == busnum).count() as u32 + 1;
        let busid = BusId::new(&format!("{busnum}-{devnum}")).expect("short numeric bus ids are valid");
        let record = DeviceRecord {
            path: format!("/sys/devices/usbwire/{kind}/{busid}"),
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
        }));
        busid
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
                    Slot::Available(_) => DeviceState::Available,
                    Slot::InUse { client, since } => DeviceState::InUse { client: *client, since: *since },
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
        visible: impl Fn(&str, &str) -> bool,
    ) -> Result<Lease, OpStatus> {
        let export = lock(&self.exports)
            .iter()
            .find(|e| &e.record.busid == busid && visible(&e.kind, busid.as_str()))
            .cloned()
            .ok_or(OpStatus::NODEV)?;
        let mut slot = lock(&export.slot);
        match std::mem::replace(&mut *slot, Slot::InUse { client, since: SystemTime::now() }) {
            Slot::Available(device) => {
                drop(slot);
                Ok(Lease { export, device: Some(device) })
            }
            busy @ Slot::InUse { .. } => {
                *slot = busy;
                Err(OpStatus::DEV_BUSY)
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
}

impl Lease {
    pub(crate) fn record(&self) -> &DeviceRecord {
        &self.export.record
    }

    pub(crate) fn device(&mut self) -> &mut dyn Device {
        self.device.as_deref_mut().expect("the device is present until the lease drops")
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(mut device) = self.device.take() {
            device.reset();
            *lock(&self.export.slot) = Slot::Available(device);
            info!(busid = %self.export.record.busid, "device reset and available again");
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves plain data behind; keep serving.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
