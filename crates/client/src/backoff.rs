//! [`Backoff`]: the delays between attempts to reach a server again, shared by
//! everything that reconnects (the relay resuming, a device imported again, the
//! usbredir bridge waiting for its device or its guest).

use std::time::Duration;

/// Delays between reconnection attempts: 0, then `first`, doubling up to `cap`.
#[derive(Clone, Debug)]
pub struct Backoff {
    first: Duration,
    cap: Duration,
    next: Option<Duration>,
}

impl Backoff {
    pub fn new(first: Duration, cap: Duration) -> Self {
        Self { first, cap, next: None }
    }

    /// The wait before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next.unwrap_or(Duration::ZERO);
        self.next = Some(match self.next {
            None => self.first,
            Some(previous) => (previous * 2).min(self.cap),
        });
        delay
    }

    /// After a success: the next failure is retried at once again.
    pub fn reset(&mut self) {
        self.next = None;
    }
}

impl Default for Backoff {
    /// At once, then 100 ms doubling to 2 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(2))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_starts_at_once_doubles_and_caps() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<u64> = (0..6).map(|_| backoff.next_delay().as_millis() as u64).collect();
        assert_eq!(delays, [0, 100, 200, 400, 500, 500]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::ZERO);
    }
}
