//! A device while imported: the [`Lease`] a connection holds (the device
//! itself, moved out of the registry), what the server shows of its holder
//! ([`Holder`]), and the [`Release`] that resets it on a blocking thread and
//! puts it back (or, after a re-enumeration, lists the new device under the
//! same bus id). Deciding who may import is the registry's, not this file's.

use std::future::Future as _;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use tokio::sync::Notify;
use tracing::{debug, info, warn};
use usbwire_device::Device;
use usbwire_proto::op::DeviceRecord;
use usbwire_proto::sync::lock;

use super::export::{Export, Slot};
use super::{Changes, Registry};
use crate::meter::DeviceMeter;

/// What the server shows about a lease's holder.
pub(crate) struct Holder(Arc<Export>, Arc<Changes>, Registry);

impl Holder {
    /// The holder's connection dropped at `since` (`Some`), or it is back (`None`).
    ///
    /// A new absence starts clean: a notice that the session should give up
    /// (see [`Holder::abandoned`]) left from an earlier absence — sent while the
    /// session was busy resuming, so nobody took it — is dropped first, before
    /// the slot says "parked", so a notice for this absence is never lost.
    pub(crate) fn set_resuming(&self, since: Option<SystemTime>) {
        if since.is_some() {
            drop_stale_notice(&self.0.abandoned);
        }
        if let Slot::InUse { resuming_since, .. } = &mut *lock(&self.0.slot) {
            *resuming_since = since;
        }
        self.1.bump();
    }

    /// Resolves when the client a parked session waits for imports the device
    /// afresh (see [`Registry::import`]).
    pub(crate) async fn abandoned(&self) {
        self.0.abandoned.notified().await;
    }

    /// Resolves when the export is withdrawn (unbind or unplug).
    pub(crate) async fn withdrawn(&self) {
        let mut withdrawn = self.0.withdrawn.subscribe();
        let _ = withdrawn.wait_for(|withdrawn| *withdrawn).await;
    }

    /// Whether the device left its port (it is gone, `device_gone`, or its
    /// export was withdrawn because it was unplugged) and a bind rule names
    /// that port: what comes back there is exported under the same bus id,
    /// so its importer is told the device re-enumerated, not that it was removed.
    pub(crate) fn left_a_followed_port(&self, device_gone: bool) -> bool {
        let unplugged = device_gone || self.0.unplugged.load(std::sync::atomic::Ordering::Relaxed);
        unplugged && self.2.follows_port(self.0.busid.as_str())
    }
}

/// Takes a permit `notify_one` stored while nobody waited, if there is one.
fn drop_stale_notice(notify: &Notify) {
    let notified = std::pin::pin!(notify.notified());
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    // Ready only by consuming a stored permit; Pending registers nothing lasting,
    // as the future is dropped here.
    let _ = notified.poll(&mut cx);
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
    pub(super) fn new(export: Arc<Export>, device: Box<dyn Device>, registry: Registry) -> Self {
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
        Holder(self.export.clone(), self.registry.changes.clone(), self.registry.clone())
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
            self.registry.unplugged(busid.as_str());
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
