//! The progress bar on stderr of the bench modes that measure points
//! (the matrix, `--storage`): [`Bar`], drawn from the first point on.

use std::sync::OnceLock;

use usbwire_bench::matrix;

/// A progress bar on stderr, drawn from the first point on.
pub(super) struct Bar(OnceLock<indicatif::ProgressBar>);

impl Bar {
    pub(super) fn new() -> Self {
        Self(OnceLock::new())
    }
}

impl matrix::Progress for Bar {
    fn begin(&self, points: usize) {
        let bar = indicatif::ProgressBar::new(points as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        let _ = self.0.set(bar);
    }

    fn point(&self, what: String) {
        if let Some(bar) = self.0.get() {
            bar.set_message(what);
        }
    }

    fn advance(&self, points: usize) {
        if let Some(bar) = self.0.get() {
            bar.inc(points as u64);
        }
    }

    fn finish(&self) {
        if let Some(bar) = self.0.get() {
            bar.finish_and_clear();
        }
    }
}
