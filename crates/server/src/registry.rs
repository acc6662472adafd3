//! The exported devices: bus ids, what to list, and who holds what.
//!
//! A device is owned by the registry while available and moved out, whole,
//! into the connection that imports it (a [`Lease`]); releasing the lease
//! (or dropping it) resets the device on a blocking thread — a real device's
//! reset can wait seconds for its URBs — and puts it back. The lock here is
//! taken only when a device is listed, imported or released — never per URB.
//!
//! A device goes Available → InUse → Releasing → Available. An import that
//! finds it Releasing, or InUse by a connection whose peer has already hung up
//! (the holder's task has not seen the end of its socket yet), waits — up to a
//! bound — for it to be Available instead of answering busy: a client that
//! detaches and at once attaches again (the kernel's `usbip attach` does not
//! retry) must not lose the race with the old connection's teardown. Only a
//! device held by a live connection is busy at once. Those rules and the
//! deadline are the sans-I/O [`ImportWait`] (`cores/import_slot.rs`);
//! [`Registry::import`] only looks at the slot, sleeps and wakes.
//!
//! A device that re-enumerates while imported (`Device::enumeration`) ends
//! its import; its release lists the new device under the same bus id
//! without resetting it ([`Release`]).
//!
//! It holds exports, slots, reservations and the change count, nothing else:
//! what the rest of a running server shares (counters, capture, parked
//! sessions) is in [`crate::state`].

mod busid;
mod changes;
mod export;
mod holder;
mod importer;
mod refusal_facts;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{watch, Notify};
use tracing::{debug, info, warn};
use usbwire_device::devstate::ReservedFor;
use usbwire_device::sync::lock;
use usbwire_device::{Device, DeviceSummary};
use usbwire_proto::op::{BusId, DeviceRecord};

use crate::cores::import_slot::{Busy, Claimant, Found, ImportDecision, ImportWait, Presence};
use crate::meter::DeviceMeter;
use crate::reservation;
use export::{Described, Export, Slot};

pub use busid::VIRTUAL_BUS;
use busid::{virtual_busid, Reserved};
use changes::Changes;
pub use export::DeviceState;
pub(crate) use holder::Holder;
pub(crate) use importer::{ImportError, Importer};
pub use refusal_facts::Reservation;
pub(crate) use refusal_facts::Withdrawn;
use refusal_facts::{RecentlyWithdrawn, Withdrawal};

/// A listed device: its record as USB/IP sends it plus what only we know.
#[derive(Clone, Debug)]
pub struct ExportInfo {
    pub kind: String,
    pub record: DeviceRecord,
    pub summary: DeviceSummary,
    pub state: DeviceState,
    pub(crate) meter: Arc<DeviceMeter>,
}

/// Every exported device. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct Registry {
    exports: Arc<Mutex<Vec<Arc<Export>>>>,
    /// Devices reserved in a lab registry (bus id → reservation); imports must carry its token.
    reservations: Arc<Mutex<HashMap<String, Reservation>>>,
    /// Devices withdrawn lately, to say why an import of one is refused.
    withdrawn: Arc<Mutex<RecentlyWithdrawn>>,
    changes: Arc<Changes>,
    /// Bus ids a bind rule names (real devices): the port stays exported
    /// when its device leaves, and what comes back there is exported again.
    followed_ports: Arc<Mutex<HashSet<String>>>,
    reserved: Arc<Mutex<Reserved>>,
}

impl Registry {
    /// Exports a virtual device under the next free bus id on
    /// [`VIRTUAL_BUS`] (`0-1`, `0-2` …), a bus no real controller has, so a
    /// virtual device never takes the bus id of a real one.
    pub(crate) fn add(&self, kind: &str, device: Box<dyn Device>) -> BusId {
        let mut exports = lock(&self.exports);
        let (busid, devnum) = self.free_virtual_busid(&exports);
        let path = format!("/sys/devices/usbwire/{kind}/{busid}");
        Self::insert(&mut exports, kind, busid.clone(), VIRTUAL_BUS, devnum, path, device);
        drop(exports);
        lock(&self.withdrawn).exported_again(busid.as_str());
        self.changes.bump();
        busid
    }

    /// Sets aside the next free virtual bus id (and its devnum) for a device
    /// that is exported later, and again whenever it comes back ([`add_named`](Self::add_named)).
    pub(crate) fn reserve(&self) -> (BusId, u32) {
        let exports = lock(&self.exports);
        let (busid, devnum) = self.free_virtual_busid(&exports);
        lock(&self.reserved).0.insert(busid.as_str().to_owned());
        (busid, devnum)
    }

    fn free_virtual_busid(&self, exports: &[Arc<Export>]) -> (BusId, u32) {
        let reserved = lock(&self.reserved);
        virtual_busid(|busid| exports.iter().any(|e| e.busid.as_str() == busid) || reserved.0.contains(busid))
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
        if exports.iter().any(|e| e.busid == busid) {
            return Err(device);
        }
        lock(&self.withdrawn).exported_again(busid.as_str());
        Self::insert(&mut exports, kind, busid, busnum, devnum, path, device);
        drop(exports);
        self.changes.bump();
        Ok(())
    }

    /// Withdraws an export: gone from the list at once; if imported, the
    /// importer's connection is closed and the device dropped, not put back.
    pub(crate) fn remove(&self, busid: &str) -> bool {
        self.withdraw(|e| e.busid.as_str() == busid, false)
    }

    /// [`remove`](Self::remove) for a device unplugged from its port: an
    /// importer is told it re-enumerated if a bind rule names the port.
    pub(crate) fn unplugged(&self, busid: &str) -> bool {
        self.withdraw(|e| e.busid.as_str() == busid, true)
    }

    /// Withdraws the export `which` picks (by bus id, or one export itself: a
    /// lease's release must not withdraw a newer export under the same bus id).
    fn withdraw(&self, which: impl Fn(&Export) -> bool, unplugged: bool) -> bool {
        let mut exports = lock(&self.exports);
        let Some(at) = exports.iter().position(|e| which(e)) else {
            return false;
        };
        let busid = exports[at].busid.as_str().to_owned();
        let busid = busid.as_str();
        let export = exports.remove(at);
        drop(exports);
        {
            let described = export.described();
            let why = if unplugged { Withdrawal::Unplugged } else { Withdrawal::Unbound };
            lock(&self.withdrawn).note(&export.kind, described.record.clone(), described.summary.serial.clone(), why);
        }
        export.unplugged.store(unplugged, std::sync::atomic::Ordering::Relaxed);
        // Mark the slot before telling the importer, so its lease never puts the device back.
        // An available device is dropped here; an imported one when its lease ends.
        let previous = std::mem::replace(&mut *lock(&export.slot), Slot::Withdrawn);
        export.withdrawn.send_replace(true);
        export.released.notify_waiters();
        drop(previous);
        info!(busid, "export withdrawn");
        self.changes.bump();
        true
    }

    pub(crate) fn contains(&self, busid: &str) -> bool {
        lock(&self.exports).iter().any(|e| e.busid.as_str() == busid)
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
        let described = Described::of(busid.clone(), busnum, devnum, path, device.as_ref());
        let (vid, pid) = (described.summary.vendor_id, described.summary.product_id);
        info!(%busid, kind, vid = format_args!("{vid:04x}"), pid = format_args!("{pid:04x}"), "exported");
        exports.push(Arc::new(Export {
            kind: kind.to_owned(),
            busid,
            described: Mutex::new(described),
            meter: Arc::default(),
            slot: Mutex::new(Slot::Available(device)),
            released: Notify::new(),
            withdrawn: watch::Sender::new(false),
            abandoned: Notify::new(),
            unplugged: std::sync::atomic::AtomicBool::new(false),
        }));
    }

    /// The bus ids bind rules name now (see [`Holder::left_a_followed_port`]).
    pub(crate) fn set_followed_ports(&self, ports: HashSet<String>) {
        *lock(&self.followed_ports) = ports;
    }

    /// A count that changes whenever a device is exported, withdrawn,
    /// imported, released or starts or stops waiting for its client to resume.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.0.subscribe()
    }

    /// The devices reserved in a lab registry now (bus id → the digest of the
    /// reservation's token, [`reservation::digest`](crate::reservation::digest), and for whom): an import
    /// of one of them must carry that token. A device whose reservation ended
    /// while its importer is away (its session parked, waiting to resume) is let go.
    pub fn set_reservations(&self, reservations: HashMap<String, Reservation>) {
        let ended: Vec<String> = {
            let mut held = lock(&self.reservations);
            let ended = held.keys().filter(|busid| !reservations.contains_key(*busid)).cloned().collect();
            *held = reservations;
            ended
        };
        for busid in ended {
            let export = lock(&self.exports).iter().find(|e| e.busid.as_str() == busid).cloned();
            let Some(export) = export else { continue };
            let parked = matches!(&*lock(&export.slot), Slot::InUse { resuming_since: Some(_), .. });
            if parked {
                info!(%busid, "reservation ended while its importer was away; releasing the device");
                export.abandoned.notify_one();
            }
        }
    }

    /// Stops enforcing reservations (the lab registry cannot be read): every
    /// device can be imported directly again. Sessions are left alone.
    pub fn forget_reservations(&self) {
        lock(&self.reservations).clear();
    }

    /// Whether `busid` is reserved in a lab registry.
    pub fn is_reserved(&self, busid: &str) -> bool {
        lock(&self.reservations).contains_key(busid)
    }

    /// For whom `busid` is reserved in a lab registry, if it is.
    pub fn reserved_for(&self, busid: &str) -> Option<ReservedFor> {
        lock(&self.reservations).get(busid).map(|r| r.reserved_for.clone())
    }

    /// The devices withdrawn lately and not exported again, newest first.
    pub(crate) fn recently_withdrawn(&self) -> Vec<Withdrawn> {
        lock(&self.withdrawn).list()
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
            .map(|e| {
                let (record, summary) = {
                    let described = e.described();
                    (described.record.clone(), described.summary.clone())
                };
                ExportInfo { kind: e.kind.clone(), record, summary, meter: e.meter.clone(), state: e.state() }
            })
            .collect()
    }

    /// What `OP_REP_DEVLIST` carries: like usbipd, only devices that can be imported.
    /// `visible(kind, record, serial)` says what this client may see.
    pub(crate) fn devlist(&self, visible: impl Fn(&str, &DeviceRecord, &str) -> bool) -> Vec<DeviceRecord> {
        self.list()
            .into_iter()
            .filter(|e| e.state == DeviceState::Available && visible(&e.kind, &e.record, &e.summary.serial))
            .map(|e| e.record)
            .collect()
    }

    /// Takes a device for exclusive use by `importer`. A device this client may
    /// not see (`visible(kind, record, serial)`) does not exist for it. A device still
    /// being given back by a connection that has ended is waited for, up to `wait`.
    pub(crate) async fn import(
        &self,
        busid: &BusId,
        importer: Importer,
        visible: impl Fn(&str, &DeviceRecord, &str) -> bool,
        wait: Duration,
    ) -> Result<Lease, ImportError> {
        let export = lock(&self.exports)
            .iter()
            .find(|e| {
                &e.busid == busid && {
                    let described = e.described();
                    visible(&e.kind, &described.record, &described.summary.serial)
                }
            })
            .cloned()
            .ok_or(ImportError::NoDevice)?;
        if let Some(reserved) = lock(&self.reservations).get(busid.as_str()) {
            let carried = importer.reservation.as_ref().map(reservation::digest);
            if carried.is_none_or(|digest| !reservation::digests_match(&digest, &reserved.digest)) {
                return Err(ImportError::Reserved);
            }
        }
        // What to do is decided by the sans-I/O core; this loop looks, sleeps and wakes.
        let mut decider = ImportWait::new(Instant::now(), wait);
        let asking = Claimant { address: importer.client, identity: importer.identity.as_deref() };
        let watched = export.clone();
        loop {
            // Registered before looking, so a release between the look and the wait is not missed.
            let released = watched.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            let until = {
                let mut slot = lock(&export.slot);
                match decider.decide(&asking, look(&slot)) {
                    ImportDecision::Take => {
                        let Importer { client, identity, probe, .. } = importer;
                        let taken = std::mem::replace(
                            &mut *slot,
                            Slot::InUse { client, since: SystemTime::now(), identity, probe, resuming_since: None },
                        );
                        drop(slot);
                        let Slot::Available(device) = taken else { unreachable!("decided Take only on Available") };
                        export.meter.imported();
                        self.changes.bump();
                        return Ok(Lease::new(export, device, self.clone()));
                    }
                    ImportDecision::Withdrawn => return Err(ImportError::NoDevice),
                    ImportDecision::Busy(Busy::Held { holder }) => return Err(ImportError::InUse { holder }),
                    ImportDecision::Busy(Busy::StillReleasing { waited }) => {
                        return Err(ImportError::StillReleasing { waited })
                    }
                    ImportDecision::WaitUntil(until) => until,
                    ImportDecision::ReclaimAndWaitUntil(until) => {
                        info!(%busid, client = %importer.client, "imported afresh by the client its parked session waits for; ending that session");
                        export.abandoned.notify_one();
                        until
                    }
                }
            };
            let until = tokio::time::Instant::from_std(until);
            if tokio::time::timeout_at(until, released).await.is_err() {
                decider.handle_timeout(Instant::now());
            }
        }
    }
}

/// What an import finds in `slot`, for [`ImportWait::decide`].
fn look(slot: &Slot) -> Found<'_> {
    match slot {
        Slot::Available(_) => Found::Available,
        Slot::Releasing => Found::Releasing,
        Slot::Withdrawn => Found::Withdrawn,
        Slot::InUse { client, identity, probe, resuming_since, .. } => {
            let presence = if resuming_since.is_some() {
                Presence::Away
            } else if probe.peer_gone() {
                Presence::HungUp
            } else {
                Presence::Live
            };
            Found::Held { holder: Claimant { address: *client, identity: identity.as_deref() }, presence }
        }
    }
}

/// A device imported by one connection. [`Lease::release`] resets the device
/// and lists it as available again; dropping the lease does too (not awaited)
/// when the connection task panics or is cancelled.
pub(crate) struct Lease {
    export: Arc<Export>,
    /// The record the import was answered with (the device as it was then).
    record: DeviceRecord,
    device: Option<Box<dyn Device>>,
    registry: Registry,
    /// When the URB channel saw the device re-enumerate, if it did.
    reenumerated_at: Option<Instant>,
}

impl Lease {
    fn new(export: Arc<Export>, device: Box<dyn Device>, registry: Registry) -> Self {
        let record = export.described().record.clone();
        Self { export, record, device: Some(device), registry, reenumerated_at: None }
    }

    pub(crate) fn record(&self) -> &DeviceRecord {
        &self.record
    }

    pub(crate) fn device(&mut self) -> &mut dyn Device {
        self.device.as_deref_mut().expect("the device is present until the lease drops")
    }

    /// The device's counters.
    pub(crate) fn meter(&self) -> Arc<DeviceMeter> {
        self.export.meter.clone()
    }

    /// A handle that marks the holder as away (resuming) or back, for `state`.
    pub(crate) fn holder(&self) -> Holder {
        Holder::new(self.export.clone(), self.registry.changes.clone(), self.registry.followed_ports.clone())
    }

    /// The import ended because the device re-enumerated, seen `at`: the
    /// release lists the new device, and logs how long that took from `at`.
    pub(crate) fn reenumerated(&mut self, at: Instant) {
        self.reenumerated_at = Some(at);
    }
}

impl Lease {
    /// Gives the device back ([`Release`]) on a blocking thread, and resolves
    /// once it is listed again (or dropped, if unplugged or withdrawn): a real
    /// device's reset waits up to seconds for its URBs, which must not stall a
    /// runtime worker. Imports arriving meanwhile wait for it (`Releasing`).
    pub(crate) async fn release(mut self) {
        let Some(release) = self.start_release() else { return };
        // Its log lines keep the connection's span.
        let span = tracing::Span::current();
        if let Err(error) = tokio::task::spawn_blocking(move || span.in_scope(|| drop(release))).await {
            warn!(busid = %self.export.busid, %error, "device release failed");
        }
    }

    /// Marks the slot `Releasing` (unless the device is unplugged or the
    /// export withdrawn) and hands what is left to do to a [`Release`].
    fn start_release(&mut self) -> Option<Release> {
        let device = self.device.take()?;
        if !device.is_gone() {
            let mut slot = lock(&self.export.slot);
            if !matches!(*slot, Slot::Withdrawn) {
                // Imports arriving during the reset wait for it rather than answer busy.
                let holder = std::mem::replace(&mut *slot, Slot::Releasing);
                drop(slot);
                drop(holder);
            }
        }
        Some(Release {
            device: Some(device),
            export: self.export.clone(),
            registry: self.registry.clone(),
            reenumerated_at: self.reenumerated_at,
        })
    }
}

impl Drop for Lease {
    /// A lease dropped without [`Lease::release`] (its task cancelled or
    /// panicking): the release runs on a blocking thread all the same, not
    /// awaited; without a runtime, here.
    fn drop(&mut self) {
        let Some(release) = self.start_release() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let span = tracing::Span::current();
                drop(runtime.spawn_blocking(move || span.in_scope(|| drop(release))));
            }
            Err(_) => drop(release),
        }
    }
}

/// A device on its way back from a lease: reset and listed again, or
/// dropped if unplugged or withdrawn (a real device then goes back to its
/// kernel drivers). The work is done when this is dropped, wherever that is:
/// on the blocking thread it was sent to, or where the runtime drops a
/// blocking task it never ran (shutting down) — never left `Releasing`.
struct Release {
    device: Option<Box<dyn Device>>,
    export: Arc<Export>,
    registry: Registry,
    reenumerated_at: Option<Instant>,
}

impl Drop for Release {
    fn drop(&mut self) {
        let Some(mut device) = self.device.take() else { return };
        let busid = &self.export.busid;
        if device.is_gone() {
            // Unplugged: nothing to give back, nothing to list.
            drop(device);
            self.registry.withdraw(|e| std::ptr::eq(e, &*self.export), true);
            return;
        }
        if matches!(*lock(&self.export.slot), Slot::Withdrawn) {
            // Dropping a real device gives its interfaces back to the kernel.
            drop(device);
            info!(%busid, "device released (no longer exported)");
            return;
        }
        let listed = self.export.described().enumeration;
        // A device that re-enumerated is new and unconfigured: a reset could
        // make it re-enumerate again (a DFU bootloader leaving for its firmware).
        if device.enumeration() == listed {
            device.reset();
        }
        // A reset can re-enumerate a device too (DFU mode left on a USB reset).
        let reenumerated = device.enumeration() != listed;
        if reenumerated {
            self.export.redescribe(device.as_ref());
        }
        let mut slot = lock(&self.export.slot);
        if matches!(*slot, Slot::Withdrawn) {
            drop(slot);
            drop(device);
            info!(%busid, "device released (no longer exported)");
            return;
        }
        *slot = Slot::Available(device);
        drop(slot);
        self.export.released.notify_waiters();
        self.registry.changes.bump();
        if !reenumerated {
            info!(%busid, "device reset and available again");
            return;
        }
        let record = self.export.described().record.clone();
        info!(
            %busid,
            vid = format_args!("{:04x}", record.id_vendor),
            pid = format_args!("{:04x}", record.id_product),
            "device re-enumerated; exported again under the same bus id"
        );
        if let Some(at) = self.reenumerated_at {
            debug!(%busid, reexport_us = at.elapsed().as_micros() as u64, "re-export time since the device switched");
        }
    }
}

#[cfg(test)]
mod tests;
