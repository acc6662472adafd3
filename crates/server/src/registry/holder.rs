//! What a lease's holder (the connection that imported a device) is told
//! and tells: withdrawal, a parked session's absence and abandonment, and
//! whether the device left a port a bind rule follows. Not the lease itself
//! (release and reset are the `Lease`'s).

use std::collections::HashSet;
use std::future::Future as _;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio::sync::Notify;
use usbwire_device::sync::lock;

use super::changes::Changes;
use super::export::{Export, Slot};

/// What the server shows about a lease's holder.
pub(crate) struct Holder {
    export: Arc<Export>,
    changes: Arc<Changes>,
    /// The bus ids bind rules name now (the registry's, shared).
    followed_ports: Arc<Mutex<HashSet<String>>>,
}

impl Holder {
    pub(super) fn new(export: Arc<Export>, changes: Arc<Changes>, followed_ports: Arc<Mutex<HashSet<String>>>) -> Self {
        Self { export, changes, followed_ports }
    }

    /// The holder's connection dropped at `since` (`Some`), or it is back (`None`).
    ///
    /// A new absence starts clean: a notice that the session should give up
    /// (see [`Holder::abandoned`]) left from an earlier absence — sent while the
    /// session was busy resuming, so nobody took it — is dropped first, before
    /// the slot says "parked", so a notice for this absence is never lost.
    pub(crate) fn set_resuming(&self, since: Option<SystemTime>) {
        if since.is_some() {
            drop_stale_notice(&self.export.abandoned);
        }
        if let Slot::InUse { resuming_since, .. } = &mut *lock(&self.export.slot) {
            *resuming_since = since;
        }
        self.changes.bump();
    }

    /// Resolves when the client a parked session waits for imports the device
    /// afresh (see [`Registry::import`]).
    pub(crate) async fn abandoned(&self) {
        self.export.abandoned.notified().await;
    }

    /// Resolves when the export is withdrawn (unbind or unplug).
    pub(crate) async fn withdrawn(&self) {
        let mut withdrawn = self.export.withdrawn.subscribe();
        let _ = withdrawn.wait_for(|withdrawn| *withdrawn).await;
    }

    /// Whether the export was withdrawn because its device was unplugged
    /// (not unbound): the device answers what it had in flight by itself.
    pub(crate) fn was_unplugged(&self) -> bool {
        self.export.unplugged.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the device left its port (it is gone, `device_gone`, or its
    /// export was withdrawn because it was unplugged) and a bind rule names
    /// that port: what comes back there is exported under the same bus id,
    /// so its importer is told the device re-enumerated, not that it was removed.
    pub(crate) fn left_a_followed_port(&self, device_gone: bool) -> bool {
        (device_gone || self.was_unplugged()) && lock(&self.followed_ports).contains(self.export.busid.as_str())
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
