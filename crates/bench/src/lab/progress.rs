//! How a lab bench run reports its progress through the long phases
//! ([`Progress`], one stage at a time), and [`Quiet`], which reports nothing.
//! Not for the report itself (`report`).

/// How a run reports its progress through the long phases (registration,
/// connecting, reserving, releasing): one stage at a time.
pub trait Progress: Send + Sync {
    /// A stage of `len` steps begins.
    fn begin(&self, len: usize, message: &'static str);
    /// One more step of the stage is done.
    fn advance(&self);
    /// The stage is over.
    fn finish(&self);
}

/// Reports nothing.
pub struct Quiet;

impl Progress for Quiet {
    fn begin(&self, _len: usize, _message: &'static str) {}
    fn advance(&self) {}
    fn finish(&self) {}
}
