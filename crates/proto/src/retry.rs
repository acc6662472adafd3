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

    /// The waits of one run of attempts under this policy.
    pub fn backoff(self) -> Backoff {
        Backoff { policy: self, next: None }
    }
}

/// The waits of one run of attempts: 0, then the policy's first wait,
/// doubling up to its cap; [`Backoff::reset`] after a success.
#[derive(Clone, Debug)]
pub struct Backoff {
    policy: Retry,
    next: Option<Duration>,
}

impl Backoff {
    /// The wait before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.upcoming();
        self.next = Some(match self.next {
            None => self.policy.first,
            Some(previous) => (previous * 2).min(self.policy.cap),
        });
        delay
    }

    /// The wait [`Backoff::next_delay`] will return next, without taking it.
    pub fn upcoming(&self) -> Duration {
        self.next.unwrap_or(Duration::ZERO)
    }

    /// After a success: the next failure is retried at once again.
    pub fn reset(&mut self) {
        self.next = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waits(policy: Retry, count: usize) -> Vec<u64> {
        let mut backoff = policy.backoff();
        (0..count).map(|_| backoff.next_delay().as_millis() as u64).collect()
    }

    #[test]
    fn soon_starts_at_once_doubles_and_caps_at_one_second() {
        assert_eq!(waits(Retry::SOON, 8), [0, 50, 100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn patient_starts_at_once_doubles_and_caps_at_five_seconds() {
        assert_eq!(waits(Retry::PATIENT, 7), [0, 250, 500, 1000, 2000, 4000, 5000]);
        assert_eq!(Retry::PATIENT.cap(), Duration::from_secs(5));
    }

    #[test]
    fn reset_retries_at_once_and_upcoming_does_not_advance() {
        let mut backoff = Retry::PATIENT.backoff();
        backoff.next_delay();
        backoff.next_delay();
        assert_eq!(backoff.upcoming(), Duration::from_millis(500));
        assert_eq!(backoff.upcoming(), Duration::from_millis(500));
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::ZERO);
        assert_eq!(backoff.next_delay(), Duration::from_millis(250));
    }
}
