//! [`Retry`]: how every loop that reaches for a peer again spaces its
//! attempts — the client's relay resuming a session, a followed device
//! imported again, an auto-attach or a `usbwire client` rule waiting for its
//! server, the usbredir bridge waiting for its device or its guest, a
//! userspace device re-attached, a server registering in the lab again. The
//! first retry is at once; the waits then double up to a cap.
//!
//! Two policies, named by how soon the peer is expected back, so that no loop
//! writes its own numbers: [`Retry::SOON`] for a gap (a network blip, a device
//! re-enumerating), [`Retry::PATIENT`] for a wait with no end in sight (a
//! server that is down, a guest not started yet).
//!
//! Every wait after the first is jittered: drawn between half the doubled
//! wait and all of it ("equal jitter"), so that many peers that failed at the
//! same moment (a lab's servers after a power cut, every client of a server
//! that restarted) do not all come back at the same moments. Jitter only
//! shortens a wait, so a peer is still retried within the cap.
//!
//! Sans I/O like the rest of this crate: [`Backoff`] says how long to wait,
//! the caller sleeps. Not for deciding *whether* to go on (a refusal that
//! waiting cannot fix, a window that ran out): each loop knows its own end.

use std::time::Duration;

/// A retry policy: at once, then `first`, doubling up to `cap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retry {
    first: Duration,
    cap: Duration,
}

impl Retry {
    /// The peer is expected back shortly: at once, then 50 ms doubling to 1 s.
    /// A session resuming, a device that re-enumerated imported again, a
    /// userspace device re-attached.
    pub const SOON: Self = Self { first: Duration::from_millis(50), cap: Duration::from_secs(1) };

    /// No end in sight: at once, then 250 ms doubling to 5 s, so a peer that
    /// comes back is reached within 5 s and one that stays away costs an
    /// attempt every 5 s. Auto-attach, `usbwire client` rules, the usbredir
    /// bridge waiting for its device or its guest, the lab registry.
    pub const PATIENT: Self = Self { first: Duration::from_millis(250), cap: Duration::from_secs(5) };

    /// The longest wait between two attempts.
    pub const fn cap(self) -> Duration {
        self.cap
    }

    /// The waits of one run of attempts under this policy, jittered from a
    /// seed of this process's randomness (each run its own).
    pub fn backoff(self) -> Backoff {
        use std::hash::{BuildHasher as _, Hasher as _};
        let seed = std::collections::hash_map::RandomState::new().build_hasher().finish();
        self.backoff_seeded(seed)
    }

    /// The waits of one run of attempts, jittered from `seed`: the same seed
    /// gives the same waits (for tests and simulations with a virtual clock).
    pub fn backoff_seeded(self, seed: u64) -> Backoff {
        Backoff { policy: self, base: None, upcoming: Duration::ZERO, random: seed }
    }
}

/// The waits of one run of attempts: 0, then the policy's first wait,
/// doubling up to its cap, each drawn in its upper half;
/// [`Backoff::reset`] after a success.
#[derive(Clone, Debug)]
pub struct Backoff {
    policy: Retry,
    /// The wait before jitter that `upcoming` was drawn from; `None` before the first retry.
    base: Option<Duration>,
    upcoming: Duration,
    /// splitmix64's state.
    random: u64,
}

impl Backoff {
    /// The wait before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.upcoming;
        let base = match self.base {
            None => self.policy.first,
            Some(previous) => (previous * 2).min(self.policy.cap),
        };
        self.base = Some(base);
        self.upcoming = self.jittered(base);
        delay
    }

    /// The wait [`Backoff::next_delay`] will return next, without taking it.
    pub fn upcoming(&self) -> Duration {
        self.upcoming
    }

    /// After a success: the next failure is retried at once again.
    pub fn reset(&mut self) {
        self.base = None;
        self.upcoming = Duration::ZERO;
    }

    /// Between half of `base` and all of it, uniformly (to the microsecond).
    fn jittered(&mut self, base: Duration) -> Duration {
        let half = base / 2;
        let spread = u64::try_from((base - half).as_micros()).unwrap_or(u64::MAX);
        half + Duration::from_micros(self.next_random() % spread.saturating_add(1))
    }

    /// splitmix64: enough to spread waits, not for anything secret.
    fn next_random(&mut self) -> u64 {
        self.random = self.random.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.random;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waits(backoff: &mut Backoff, count: usize) -> Vec<Duration> {
        (0..count).map(|_| backoff.next_delay()).collect()
    }

    /// Each wait in the upper half of the doubled wait, the first at once.
    fn assert_within(waits: &[Duration], bases_ms: &[u64]) {
        assert_eq!(waits[0], Duration::ZERO);
        for (wait, base) in waits[1..].iter().zip(bases_ms) {
            let base = Duration::from_millis(*base);
            assert!(*wait >= base / 2 && *wait <= base, "{wait:?} not within [{:?}, {base:?}]", base / 2);
        }
    }

    #[test]
    fn soon_starts_at_once_doubles_and_caps_at_one_second() {
        for seed in 0..200 {
            let waits = waits(&mut Retry::SOON.backoff_seeded(seed), 8);
            assert_within(&waits, &[50, 100, 200, 400, 800, 1000, 1000]);
        }
    }

    #[test]
    fn patient_starts_at_once_doubles_and_caps_at_five_seconds() {
        for seed in 0..200 {
            let waits = waits(&mut Retry::PATIENT.backoff_seeded(seed), 7);
            assert_within(&waits, &[250, 500, 1000, 2000, 4000, 5000]);
        }
        assert_eq!(Retry::PATIENT.cap(), Duration::from_secs(5));
    }

    #[test]
    fn peers_that_failed_together_spread_their_retries_over_the_window() {
        // A thousand servers back after a power cut, at their fourth attempt (2 s doubled wait).
        let fourth: Vec<Duration> = (0..1000)
            .map(|_| {
                let mut backoff = Retry::PATIENT.backoff();
                waits(&mut backoff, 5)[4]
            })
            .collect();
        // In ten slices of the [1 s, 2 s] window, none is empty and none holds a third.
        let mut slices = [0usize; 10];
        for wait in &fourth {
            let slice = ((wait.as_micros() - 1_000_000) * 10 / 1_000_001) as usize;
            slices[slice] += 1;
        }
        assert!(slices.iter().all(|&n| n > 0 && n < 333), "{slices:?}");
    }

    #[test]
    fn the_same_seed_gives_the_same_waits() {
        let a = waits(&mut Retry::PATIENT.backoff_seeded(7), 10);
        let b = waits(&mut Retry::PATIENT.backoff_seeded(7), 10);
        let c = waits(&mut Retry::PATIENT.backoff_seeded(8), 10);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn reset_retries_at_once_and_upcoming_does_not_advance() {
        let mut backoff = Retry::PATIENT.backoff_seeded(1);
        backoff.next_delay();
        backoff.next_delay();
        let upcoming = backoff.upcoming();
        assert_eq!(backoff.upcoming(), upcoming);
        assert_eq!(backoff.next_delay(), upcoming);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::ZERO);
        let first = backoff.next_delay();
        assert!(first >= Duration::from_millis(125) && first <= Duration::from_millis(250), "{first:?}");
    }
}
