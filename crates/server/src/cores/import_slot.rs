//! The import slot's decision, sans I/O: what an `OP_REQ_IMPORT` does with
//! the device it names — take it, wait (bounded) for the previous importer's
//! teardown, or answer busy.
//!
//! A device is Available, held by an importer, being reset after its last
//! importer's connection ended (Releasing), or withdrawn. An import that
//! finds it Releasing, or held by a connection whose peer has already hung up
//! (the holder's task has not seen the end of its socket yet), waits — up to
//! a bound — for it to come back instead of answering busy: a client that
//! detaches and at once attaches again (the kernel's `usbip attach` does not
//! retry) must not lose the race with the old connection's teardown. The same
//! host asking again for what it holds is, in practice, a detach and attach
//! too (vhci-hcd closes the old socket 0.1-1 s after `usbip detach` returns),
//! so that is waited for as well. A device held by a live connection on
//! another host is busy at once. A device held for a client that is away
//! (its session parked, waiting to resume, [`super::park`]) is busy for
//! everyone but that client, who takes it back: its parked session is told
//! to let go, and the import waits for the release.
//!
//! [`ImportWait`] is one import's side of it. The caller owns the slot, its
//! lock and the clock: it describes what it finds ([`Found`]) each time it
//! looks, carries out the [`ImportDecision`], looks again whenever the slot
//! is given back or withdrawn, and calls [`ImportWait::handle_timeout`] at
//! [`ImportWait::poll_timeout`]; after the deadline one last look decides.
//! Tests drive it with a virtual clock.
//!
//! Not for the slot itself (who holds the device, the device): that is the
//! registry (`registry.rs`).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Who holds or asks for a device: the connection's address and its TLS
/// identity (none for a plain client).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claimant<'a> {
    pub address: SocketAddr,
    pub identity: Option<&'a str>,
}

impl Claimant<'_> {
    /// Whether `other` is the same host (the same IP address).
    fn same_host(&self, other: &Claimant<'_>) -> bool {
        self.address.ip() == other.address.ip()
    }

    /// Whether `other` is the client this one is: the same TLS identity, or
    /// for plain clients (which have none) the same address.
    fn same_client(&self, other: &Claimant<'_>) -> bool {
        self.identity == other.identity && (self.identity.is_some() || self.same_host(other))
    }
}

/// How the holder of a device is connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presence {
    /// Its connection is up.
    Live,
    /// Its peer has closed or reset the connection; its task will notice.
    HungUp,
    /// Its connection dropped and its session is parked for it to resume.
    Away,
}

/// What an import finds when it looks at the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found<'a> {
    /// Free: nobody holds it.
    Available,
    /// Its last importer's connection ended; it is being reset.
    Releasing,
    /// No longer exported (unbound, unplugged).
    Withdrawn,
    /// Imported by `holder`.
    Held { holder: Claimant<'a>, presence: Presence },
}

/// Why an import is answered busy (`ST_DEV_BUSY`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Busy {
    /// Held by a live connection, or for another client's parked session,
    /// from `holder`.
    Held { holder: SocketAddr },
    /// The previous holder's connection had ended but the device was not
    /// back within the bound the import waited.
    StillReleasing { waited: Duration },
}

/// What to do about an import, after one look at the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportDecision {
    /// Take the device: the import succeeds.
    Take,
    /// Look again when the slot is given back or withdrawn, or at this
    /// instant (then call [`ImportWait::handle_timeout`] first).
    WaitUntil(Instant),
    /// The device is held for this same client's parked session (the client
    /// restarted, or its relay was killed): tell that session to let go,
    /// then wait as for [`WaitUntil`](Self::WaitUntil).
    ReclaimAndWaitUntil(Instant),
    /// Answer busy.
    Busy(Busy),
    /// The device was withdrawn: answer as for an unknown device.
    Withdrawn,
}

/// One import's wait for a device: when it gives up, and whether it has
/// been answered.
#[derive(Debug)]
pub struct ImportWait {
    /// The bound on the wait.
    wait: Duration,
    deadline: Instant,
    /// The deadline has passed: the next look decides.
    last_look: bool,
    answered: bool,
}

impl ImportWait {
    /// An import asked at `now`, waiting at most `wait` for a teardown.
    pub fn new(now: Instant, wait: Duration) -> Self {
        Self { wait, deadline: now + wait, last_look: false, answered: false }
    }

    /// Decides after one look at the slot, which found `found`, for `importer`.
    /// Once it has answered ([`Take`](ImportDecision::Take),
    /// [`Busy`](ImportDecision::Busy), [`Withdrawn`](ImportDecision::Withdrawn))
    /// the import is over; the caller does not ask again.
    pub fn decide(&mut self, importer: &Claimant<'_>, found: Found<'_>) -> ImportDecision {
        let decision = match found {
            Found::Available => ImportDecision::Take,
            Found::Withdrawn => ImportDecision::Withdrawn,
            Found::Held { holder, presence: Presence::Away } => {
                if holder.same_client(importer) && !self.last_look {
                    ImportDecision::ReclaimAndWaitUntil(self.deadline)
                } else {
                    ImportDecision::Busy(Busy::Held { holder: holder.address })
                }
            }
            Found::Held { holder, presence: Presence::Live } if !holder.same_host(importer) || self.last_look => {
                ImportDecision::Busy(Busy::Held { holder: holder.address })
            }
            // Hung up (its task will notice), on the same host (a detach and
            // attach), or resetting the device.
            Found::Held { .. } | Found::Releasing if self.last_look => {
                ImportDecision::Busy(Busy::StillReleasing { waited: self.wait })
            }
            Found::Held { .. } | Found::Releasing => ImportDecision::WaitUntil(self.deadline),
        };
        self.answered = !matches!(decision, ImportDecision::WaitUntil(_) | ImportDecision::ReclaimAndWaitUntil(_));
        decision
    }

    /// When to call [`handle_timeout`](Self::handle_timeout): the deadline,
    /// while the import waits.
    pub fn poll_timeout(&self) -> Option<Instant> {
        (!self.answered && !self.last_look).then_some(self.deadline)
    }

    /// Time passes: once `now` is past the deadline, the next
    /// [`decide`](Self::decide) is the last and answers.
    pub fn handle_timeout(&mut self, now: Instant) {
        if now >= self.deadline {
            self.last_look = true;
        }
    }

    /// Whether [`decide`](Self::decide) has answered.
    pub fn is_answered(&self) -> bool {
        self.answered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    fn plain(last: u8) -> Claimant<'static> {
        Claimant { address: ([10, 0, 0, last], 40000).into(), identity: None }
    }

    fn held(holder: Claimant<'_>, presence: Presence) -> Found<'_> {
        Found::Held { holder, presence }
    }

    #[test]
    fn an_available_device_is_taken_and_a_withdrawn_one_is_gone() {
        let start = Instant::now();
        let mut wait = ImportWait::new(start, WAIT);
        assert_eq!(wait.decide(&plain(1), Found::Available), ImportDecision::Take);
        assert!(wait.is_answered());
        assert_eq!(wait.poll_timeout(), None, "answered: nothing more to wait for");
        let mut wait = ImportWait::new(start, WAIT);
        assert_eq!(wait.decide(&plain(1), Found::Withdrawn), ImportDecision::Withdrawn);
    }

    #[test]
    fn a_live_holder_on_another_host_is_busy_at_once_on_the_same_host_after_the_wait() {
        let start = Instant::now();
        let mut elsewhere = ImportWait::new(start, WAIT);
        let holder = plain(1).address;
        assert_eq!(
            elsewhere.decide(&plain(2), held(plain(1), Presence::Live)),
            ImportDecision::Busy(Busy::Held { holder })
        );
        let mut same_host = ImportWait::new(start, WAIT);
        let found = held(plain(1), Presence::Live);
        // Another port of the same host: a detach and attach.
        let again = Claimant { address: ([10, 0, 0, 1], 40001).into(), identity: None };
        assert_eq!(same_host.decide(&again, found), ImportDecision::WaitUntil(start + WAIT));
        assert_eq!(same_host.poll_timeout(), Some(start + WAIT));
        same_host.handle_timeout(start + WAIT - Duration::from_millis(1));
        assert_eq!(same_host.decide(&again, found), ImportDecision::WaitUntil(start + WAIT), "not yet");
        same_host.handle_timeout(start + WAIT);
        assert_eq!(same_host.poll_timeout(), None, "the next look is the last");
        assert_eq!(same_host.decide(&again, found), ImportDecision::Busy(Busy::Held { holder }));
    }

    #[test]
    fn a_hung_up_or_resetting_holder_is_waited_for_then_busy_still_releasing() {
        let start = Instant::now();
        for found in [held(plain(1), Presence::HungUp), Found::Releasing] {
            let mut wait = ImportWait::new(start, WAIT);
            assert_eq!(wait.decide(&plain(2), found), ImportDecision::WaitUntil(start + WAIT), "{found:?}");
            wait.handle_timeout(start + WAIT);
            assert_eq!(wait.decide(&plain(2), found), ImportDecision::Busy(Busy::StillReleasing { waited: WAIT }));
            let mut wait = ImportWait::new(start, WAIT);
            assert_eq!(wait.decide(&plain(2), found), ImportDecision::WaitUntil(start + WAIT));
            assert_eq!(wait.decide(&plain(2), Found::Available), ImportDecision::Take, "given back in time");
        }
    }

    #[test]
    fn a_parked_session_is_reclaimed_by_its_own_client_only() {
        let start = Instant::now();
        let laptop = Claimant { address: ([10, 0, 0, 1], 40000).into(), identity: Some("SHA256:laptop") };
        let roamed = Claimant { address: ([10, 0, 0, 9], 40000).into(), identity: Some("SHA256:laptop") };
        let other = Claimant { address: ([10, 0, 0, 1], 40000).into(), identity: Some("SHA256:desk") };
        let parked = held(laptop, Presence::Away);
        let held_by = |holder: Claimant<'_>| ImportDecision::Busy(Busy::Held { holder: holder.address });
        let mut wait = ImportWait::new(start, WAIT);
        assert_eq!(wait.decide(&roamed, parked), ImportDecision::ReclaimAndWaitUntil(start + WAIT), "same identity");
        assert!(!wait.is_answered());
        wait.handle_timeout(start + WAIT);
        assert_eq!(wait.decide(&roamed, parked), held_by(laptop), "never let go");
        assert_eq!(ImportWait::new(start, WAIT).decide(&other, parked), held_by(laptop));
        // Plain clients are told apart by address only.
        let parked = held(plain(1), Presence::Away);
        assert_eq!(
            ImportWait::new(start, WAIT).decide(&plain(1), parked),
            ImportDecision::ReclaimAndWaitUntil(start + WAIT)
        );
        assert_eq!(ImportWait::new(start, WAIT).decide(&plain(2), parked), held_by(plain(1)));
        let tls_on_the_same_host = Claimant { address: ([10, 0, 0, 1], 40000).into(), identity: Some("SHA256:laptop") };
        assert_eq!(ImportWait::new(start, WAIT).decide(&tls_on_the_same_host, parked), held_by(plain(1)));
    }

    #[test]
    fn no_wait_at_all_answers_at_the_first_look_after_the_timeout() {
        let start = Instant::now();
        let mut wait = ImportWait::new(start, Duration::ZERO);
        assert_eq!(wait.decide(&plain(1), Found::Releasing), ImportDecision::WaitUntil(start));
        wait.handle_timeout(start);
        assert_eq!(
            wait.decide(&plain(1), Found::Releasing),
            ImportDecision::Busy(Busy::StillReleasing { waited: Duration::ZERO })
        );
    }
}
