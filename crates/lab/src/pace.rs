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
//! Sans I/O: the caller measures and sleeps. Not for retries after a failure
//! (`usbwire_proto::retry`), which a failed write takes instead.

use std::time::Duration;

use rand::{Rng as _, SeedableRng as _};

/// The answer time above which a server slows down.
pub(crate) const TARGET: Duration = Duration::from_millis(400);
/// The longest pause between two writes.
pub(crate) const MOST: Duration = Duration::from_secs(2);
/// A pause shorter than this is none.
const LEAST: Duration = Duration::from_millis(5);

/// One server's pace of writes.
#[derive(Debug)]
pub(crate) struct Pace {
    pause: Duration,
    random: rand::rngs::StdRng,
}

impl Pace {
    /// No pause until a write is slow; jittered from this process's randomness.
    pub(crate) fn new() -> Self {
        Self::seeded(rand::random())
    }

    /// The same, jittered from `seed` (for simulations).
    pub(crate) fn seeded(seed: u64) -> Self {
        Self { pause: Duration::ZERO, random: rand::rngs::StdRng::seed_from_u64(seed) }
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

    /// Takes in how long a write took to be answered.
    pub(crate) fn answered_in(&mut self, took: Duration) {
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
