//! The registry's change count: bumped on every export, withdrawal, import,
//! release and resuming mark, and watched by whoever mirrors the list (the
//! lab registry publisher).

use tokio::sync::watch;

/// Counts changes to the list and to devices' states (export, withdraw,
/// import, release, resuming): what a lab registry publisher follows.
pub(super) struct Changes(pub(super) watch::Sender<u64>);

impl Default for Changes {
    fn default() -> Self {
        Self(watch::Sender::new(0))
    }
}

impl Changes {
    pub(super) fn bump(&self) {
        self.0.send_modify(|count| *count = count.wrapping_add(1));
    }
}
