//! [`Pace`]: how long a server waits before its next write to the registry,
//! so that a storm of writes (a lab's servers all registering at once after
//! a power cut) does not put etcd so far behind that lease renewals fail.
//!
//! etcd answers a write once it has applied it, so the time a write takes
//! is how far behind its applying is. It renews a lease only once it has
//! applied what was committed before, and gives up after a second ("waiting
//! for the applied index took too long"): a backlog of more than a second
//! stops every renewal, leases run out, their keys are deleted, and each
//! server puts everything again. A write answered later than [`TARGET`]
//! doubles the server's pause (at least to the time it took), one answered
//! sooner halves it; many servers pacing so keep the backlog near the target
//! while etcd still applies all it can. The pause is jittered so that
//! servers that slowed down together do not write again together.
//!
//! A server also starts small, as TCP does: its first transaction holds
//! [`FIRST_WINDOW`] operations, each answered in time doubles the next, and
//! each answered late halves it. A lab's 1 000 servers starting at once so
//! send 4 000 operations first, not 25 000, which alone were seconds of
//! backlog on three members sharing two vCPUs, every renewal failing
//! meanwhile.
//!
//! Sans I/O: the caller measures and sleeps. Not for retries after a failure
//! (`usbwire_proto::retry`), which a failed write takes instead.

use std::time::Duration;

use rand::{Rng as _, SeedableRng as _};

/// The answer time above which a server slows down.
pub(crate) const TARGET: Duration = Duration::from_millis(400);
/// The longest pause between two writes: 1 000 servers at this pause and
/// the smallest window send 500 operations a second (at 2 s, up to 12 500
/// with full transactions, more than three members on two vCPUs apply).
pub(crate) const MOST: Duration = Duration::from_secs(8);
/// The operations of a server's first transaction, and the fewest of any.
pub(crate) const FIRST_WINDOW: usize = 4;
/// The most operations the window grows to (etcd's default limit a
/// transaction).
const LARGEST_WINDOW: usize = 128;
/// A pause shorter than this is none.
const LEAST: Duration = Duration::from_millis(5);

/// One server's pace of writes.
#[derive(Debug)]
pub(crate) struct Pace {
    pause: Duration,
    /// Operations the next transaction may hold.
    window: usize,
    random: rand::rngs::StdRng,
}

impl Pace {
    /// No pause until a write is slow, a small first transaction; jittered
    /// from this process's randomness.
    pub(crate) fn new() -> Self {
        Self::seeded(rand::random())
    }

    /// The same, jittered from `seed` (for simulations).
    pub(crate) fn seeded(seed: u64) -> Self {
        Self { pause: Duration::ZERO, window: FIRST_WINDOW, random: rand::rngs::StdRng::seed_from_u64(seed) }
    }

    /// How long to wait before the next write: between half the pause and
    /// all of it.
    pub(crate) fn wait(&mut self) -> Duration {
        if self.pause.is_zero() {
            return Duration::ZERO;
        }
        let half = self.pause / 2;
        half + self.random.gen_range(Duration::ZERO..=half)
    }

    /// How many operations the next transaction may hold, at most `most`.
    pub(crate) fn window(&self, most: usize) -> usize {
        self.window.min(most).max(1)
    }

    /// Takes in how long a write took to be answered.
    pub(crate) fn answered_in(&mut self, took: Duration) {
        self.window =
            if took > TARGET { (self.window / 2).max(FIRST_WINDOW) } else { (self.window * 2).min(LARGEST_WINDOW) };
        self.pause = if took > TARGET {
            (self.pause * 2).max(took).min(MOST)
        } else if self.pause / 2 < LEAST {
            Duration::ZERO
        } else {
            self.pause / 2
        };
    }
}

#[cfg(test)]
mod tests;
