//! The grace period of a parked session, sans I/O: how long a resumable
//! session whose connection broke is held for its client to come back
//! (`usbwire_proto::resume`), and whether a client that presents the session's
//! token is in time.
//!
//! When the connection is lost the server parks the session (the device
//! keeps running, its completions are held) and starts a [`Grace`]. A client
//! that comes back with the token before the grace ends takes the session
//! back ([`ParkEvent::Resumed`]); past it, the session is over
//! ([`ParkEvent::Expired`]): the server releases the device, and a late
//! resume is refused (`ST_NODEV`). Each grace ends in exactly one of the two,
//! unless the server lets the session go first (the same client imported the
//! device afresh, the device was unplugged, the server shuts down).
//!
//! Taking a session back has two steps, since the answer to the resume
//! request can be lost with the new connection: [`Grace::resume`] says
//! whether the client is in time, and [`Grace::answered`] that it got
//! `OP_REP_RESUME`. If the new connection breaks before that
//! ([`Grace::answer_lost`]) the session is parked again, within the same
//! grace: it counts from the first loss, so a client cannot stretch it.
//!
//! This module is not for the token, who may resume, or the session's
//! replay: those are `usbwire_proto::resume`, the server's parked-session table
//! (`resumable.rs`) and `ServerSession::resume`. The caller owns the
//! clock: it sleeps until [`Grace::poll_timeout`] and then calls
//! [`Grace::handle_timeout`]. Tests drive it with a virtual clock.

use std::time::{Duration, Instant};

/// What became of a parked session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParkEvent {
    /// The client came back in time and was answered; it had been away this long.
    Resumed { outage: Duration },
    /// Nobody came back within the grace period (this long): release the device.
    Expired { grace: Duration },
}

/// Why a resume was refused by the grace period.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResumeRefused {
    /// The grace period was over when the client came back.
    #[error("the grace period of {} s was over", .grace.as_secs_f64())]
    Expired { grace: Duration },
    /// Another connection has already taken the session back.
    #[error("the session was already taken back")]
    Taken,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Parked: waiting for the client.
    Waiting,
    /// A client came back in time; its answer is being written.
    Answering,
    Resumed,
    Expired,
}

/// One parked session's grace period.
#[derive(Debug)]
pub struct Grace {
    grace: Duration,
    lost_at: Instant,
    state: State,
    /// The event not yet polled (there is at most one).
    event: Option<ParkEvent>,
}

impl Grace {
    /// The connection was lost at `now`: the session is held for `grace`.
    pub fn start(now: Instant, grace: Duration) -> Self {
        Self { grace, lost_at: now, state: State::Waiting, event: None }
    }

    /// When the grace period ends, while the session waits for its client.
    pub fn poll_timeout(&self) -> Option<Instant> {
        (self.state == State::Waiting).then_some(self.lost_at + self.grace)
    }

    /// Time passes: at the end of the grace period a waiting session expires
    /// ([`ParkEvent::Expired`]).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state == State::Waiting && now >= self.lost_at + self.grace {
            self.expire();
        }
    }

    /// A client presents the session's token at `now`. In time, its answer
    /// is to be written (then [`answered`](Self::answered) or
    /// [`answer_lost`](Self::answer_lost)); at or past the end of the grace
    /// period the session expires instead, and the client is refused.
    pub fn resume(&mut self, now: Instant) -> Result<(), ResumeRefused> {
        self.handle_timeout(now);
        match self.state {
            State::Waiting => {
                self.state = State::Answering;
                Ok(())
            }
            State::Expired => Err(ResumeRefused::Expired { grace: self.grace }),
            State::Answering | State::Resumed => Err(ResumeRefused::Taken),
        }
    }

    /// The resuming client got its answer at `now`: the session carries on
    /// ([`ParkEvent::Resumed`]).
    pub fn answered(&mut self, now: Instant) {
        if self.state == State::Answering {
            self.state = State::Resumed;
            self.event = Some(ParkEvent::Resumed { outage: now.saturating_duration_since(self.lost_at) });
        }
    }

    /// The resuming connection broke before its answer: the session waits
    /// again, for what is left of the same grace period.
    pub fn answer_lost(&mut self) {
        if self.state == State::Answering {
            self.state = State::Waiting;
        }
    }

    /// What became of the session, once: [`ParkEvent::Resumed`] after
    /// [`answered`](Self::answered), [`ParkEvent::Expired`] after the grace.
    pub fn poll_event(&mut self) -> Option<ParkEvent> {
        self.event.take()
    }

    /// Whether the grace period has ended without the client.
    pub fn is_expired(&self) -> bool {
        self.state == State::Expired
    }

    fn expire(&mut self) {
        self.state = State::Expired;
        self.event = Some(ParkEvent::Expired { grace: self.grace });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(30);
    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_client_back_just_before_the_end_resumes_once() {
        let lost = Instant::now();
        let mut grace = Grace::start(lost, GRACE);
        assert_eq!(grace.poll_timeout(), Some(lost + GRACE));
        grace.handle_timeout(lost + GRACE - MS);
        assert_eq!(grace.poll_event(), None, "not over yet");
        assert_eq!(grace.resume(lost + GRACE - MS), Ok(()));
        assert_eq!(grace.poll_timeout(), None, "answering: no longer waiting");
        assert_eq!(grace.resume(lost + GRACE - MS), Err(ResumeRefused::Taken), "one at a time");
        // The answer may take past the end: the client was in time.
        grace.answered(lost + GRACE + MS);
        assert_eq!(grace.poll_event(), Some(ParkEvent::Resumed { outage: GRACE + MS }));
        assert_eq!(grace.poll_event(), None, "once");
        grace.handle_timeout(lost + 2 * GRACE);
        assert_eq!(grace.poll_event(), None, "a resumed session does not expire");
        assert_eq!(grace.resume(lost + GRACE), Err(ResumeRefused::Taken));
    }

    #[test]
    fn a_client_back_at_the_end_or_after_is_refused_and_the_session_expires_once() {
        for late in [Duration::ZERO, MS, GRACE] {
            let lost = Instant::now();
            let mut grace = Grace::start(lost, GRACE);
            assert_eq!(grace.resume(lost + GRACE + late), Err(ResumeRefused::Expired { grace: GRACE }), "{late:?}");
            assert_eq!(grace.poll_event(), Some(ParkEvent::Expired { grace: GRACE }));
            grace.handle_timeout(lost + GRACE + late);
            assert_eq!(grace.poll_event(), None, "once");
            assert!(grace.is_expired());
            assert_eq!(grace.poll_timeout(), None);
        }
    }

    #[test]
    fn a_lost_answer_parks_again_within_the_same_grace() {
        let lost = Instant::now();
        let mut grace = Grace::start(lost, GRACE);
        assert_eq!(grace.resume(lost + GRACE / 2), Ok(()));
        grace.answer_lost();
        assert_eq!(grace.poll_timeout(), Some(lost + GRACE), "the grace counts from the first loss");
        grace.handle_timeout(lost + GRACE);
        assert_eq!(grace.poll_event(), Some(ParkEvent::Expired { grace: GRACE }));
        assert_eq!(grace.resume(lost + GRACE), Err(ResumeRefused::Expired { grace: GRACE }));
        assert_eq!(grace.poll_event(), None);
    }

    #[test]
    fn refusals_say_what_to_expect() {
        assert_eq!(ResumeRefused::Expired { grace: GRACE }.to_string(), "the grace period of 30 s was over");
    }
}
