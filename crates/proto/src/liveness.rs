//! Liveness (usbwire extension): how both ends of a resumable session tell
//! a live but quiet link from a dead one, sans I/O.
//!
//! A link that dies without a word (a pulled cable, a dropped Wi-Fi, a NAT
//! that forgot the connection: no FIN, no RST) leaves TCP waiting for
//! minutes. With keep-alive negotiated, each side sends a header-only
//! [`PING`] when it has queued nothing for [`TICK`], so a live link is never
//! silent for much more than twice that; and each side declares the link dead
//! when nothing at all has arrived for [`BUSY_SILENCE`] while URBs are
//! outstanding, or [`IDLE_SILENCE`] when none are. The caller then treats the
//! connection as lost: the client resumes on a new one, the server parks the
//! session for its grace period — which must stay well above these bounds
//! (the default grace is 30 s: a busy link is given up and resumed within
//! about 2.5 s, an idle one within about 10.5 s, and the client's reconnect
//! attempts back off to at most 2 s apart, so several fit in the grace).
//!
//! Negotiation rides on the transform offer next to resume: the client adds
//! [`OFFER`], a server that pings answers it back. Pings are not replies or
//! commands: they are never counted, acknowledged or replayed.
//!
//! This module is not for clocks or timers: the caller owns the clock and
//! passes `now` in; [`Liveness`] only says when it next wants to be asked
//! ([`Liveness::deadline`]) and what is due then ([`Liveness::tick`]). Tests
//! drive it with a virtual clock.

use std::time::{Duration, Instant};

use crate::urb::{Command, HEADER_LEN};
use crate::wire::{be_u32, put_u32};

/// What a client adds to its transform offer (beside `resume`), and a server
/// adds to its answer when it agrees.
pub const OFFER: &str = "keepalive";

/// The command word of a keep-alive, either way. Header-only; the devid names
/// the session's device, the rest is zero.
pub const PING: Command = Command(0x8000_0003);

/// How often a session looks at its link: a ping goes out when nothing was
/// queued during the last tick.
pub const TICK: Duration = Duration::from_millis(500);

/// Silence after which a link with URBs outstanding counts as dead. Four
/// ticks: a live peer's pings are at most two ticks apart.
pub const BUSY_SILENCE: Duration = Duration::from_secs(2);

/// Silence after which an idle link (nothing outstanding) counts as dead.
pub const IDLE_SILENCE: Duration = Duration::from_secs(10);

/// A keep-alive for the session of device `devid`.
pub fn ping_header(devid: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    put_u32(&mut h, 0x00, PING.0);
    put_u32(&mut h, 0x08, devid);
    h
}

/// Whether `header` (at least [`HEADER_LEN`] bytes) is a keep-alive.
pub fn is_ping(header: &[u8]) -> bool {
    header.len() >= HEADER_LEN && be_u32(header, 0) == PING.0
}

/// Whether a client's transform offer (or a server's answer) carries keep-alive.
pub fn offered(text: &str) -> bool {
    text.split(',').any(|entry| entry.trim() == OFFER)
}

/// What a [`Liveness::tick`] found due.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    /// Nothing: the link is live and this side has spoken lately.
    Nothing,
    /// Queue a [`PING`]: this side has said nothing for a tick.
    Ping,
    /// Nothing has arrived for this long, beyond the bound: the link is dead.
    Dead(Duration),
}

/// What the caller tells [`Liveness::tick`] of its side of the link.
#[derive(Clone, Copy, Debug, Default)]
pub struct Link {
    /// URBs are outstanding: the shorter bound applies.
    pub busy: bool,
    /// The caller is reading the peer.
    pub listening: bool,
    /// Bytes written to the peer so far.
    pub written: u64,
    /// Bytes wait to be written.
    pub unsent: bool,
}

/// One side's view of the link: when it last heard and spoke, to the
/// precision of a tick.
#[derive(Debug)]
pub struct Liveness {
    /// When the next tick is due.
    next_tick: Instant,
    /// The tick at or after which bytes last arrived.
    heard_at: Instant,
    /// Bytes arrived since the last tick.
    heard: bool,
    /// The caller's count of bytes written at the last tick.
    written_at_tick: u64,
}

impl Liveness {
    /// A link that starts live at `now`.
    pub fn new(now: Instant) -> Self {
        Self { next_tick: now + TICK, heard_at: now, heard: false, written_at_tick: 0 }
    }

    /// When [`tick`](Self::tick) next has something to decide.
    pub fn deadline(&self) -> Instant {
        self.next_tick
    }

    /// Bytes arrived from the peer.
    pub fn heard(&mut self) {
        self.heard = true;
    }

    /// A new connection carries the session on: it is live from here.
    pub fn reconnected(&mut self) {
        self.heard = true;
    }

    /// Decides what is due at `now`. While the caller is not
    /// [`listening`](Link::listening) (it stopped reading to keep within its
    /// budget) it cannot tell silence from its own backlog, so that time
    /// does not count.
    /// `written`: the caller's count of bytes written to the peer so far;
    /// `unsent`: bytes wait to be written (no ping needed on top of them).
    pub fn tick(&mut self, now: Instant, link: Link) -> Due {
        let Link { busy, listening, written, unsent } = link;
        if now < self.next_tick {
            return Due::Nothing;
        }
        self.next_tick = now + TICK;
        if self.heard || !listening {
            self.heard_at = now;
            self.heard = false;
        }
        let silent = now.saturating_duration_since(self.heard_at);
        let bound = if busy { BUSY_SILENCE } else { IDLE_SILENCE };
        if silent >= bound {
            return Due::Dead(silent);
        }
        let spoke = written != self.written_at_tick || unsent;
        self.written_at_tick = written;
        if spoke {
            Due::Nothing
        } else {
            Due::Ping
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_golden_bytes() {
        let h = ping_header(0x0001_0002);
        let mut expected = [0u8; HEADER_LEN];
        expected[..12].copy_from_slice(&[0x80, 0, 0, 3, 0, 0, 0, 0, 0, 1, 0, 2]);
        assert_eq!(h, expected);
        assert!(is_ping(&h));
        assert!(!is_ping(&[0u8; HEADER_LEN]));
        assert!(!is_ping(&h[..HEADER_LEN - 1]));
    }

    #[test]
    fn a_quiet_side_pings_every_tick_and_a_talking_one_does_not() {
        let start = Instant::now();
        let mut live = Liveness::new(start);
        let quiet = Link { listening: true, ..Link::default() };
        assert_eq!(live.tick(start + TICK / 2, quiet), Due::Nothing, "not due yet");
        live.heard();
        assert_eq!(live.tick(start + TICK, quiet), Due::Ping);
        live.heard();
        assert_eq!(live.tick(start + 2 * TICK, Link { written: 48, ..quiet }), Due::Nothing, "it wrote something");
        live.heard();
        assert_eq!(
            live.tick(start + 3 * TICK, Link { written: 48, unsent: true, ..quiet }),
            Due::Nothing,
            "bytes wait"
        );
        live.heard();
        assert_eq!(live.tick(start + 4 * TICK, Link { written: 48, ..quiet }), Due::Ping, "nothing since");
    }

    #[test]
    fn silence_is_dead_after_the_busy_bound_and_later_when_idle() {
        let start = Instant::now();
        let mut busy = Liveness::new(start);
        let mut idle = Liveness::new(start);
        let mut now = start;
        let mut busy_dead = None;
        let mut idle_dead = None;
        while idle_dead.is_none() {
            now += TICK;
            if busy_dead.is_none() {
                if let Due::Dead(silent) = busy.tick(now, Link { busy: true, listening: true, ..Link::default() }) {
                    busy_dead = Some((now - start, silent));
                }
            }
            if let Due::Dead(silent) = idle.tick(now, Link { listening: true, ..Link::default() }) {
                idle_dead = Some((now - start, silent));
            }
        }
        assert_eq!(busy_dead, Some((BUSY_SILENCE, BUSY_SILENCE)));
        assert_eq!(idle_dead, Some((IDLE_SILENCE, IDLE_SILENCE)));
    }

    #[test]
    fn time_not_listening_does_not_count_as_silence() {
        let start = Instant::now();
        let mut live = Liveness::new(start);
        let mut now = start;
        for _ in 0..100 {
            now += TICK;
            assert!(!matches!(live.tick(now, Link { busy: true, ..Link::default() }), Due::Dead(_)));
        }
        // Listening again: the bound counts from the last tick spent not listening.
        now += BUSY_SILENCE;
        assert_eq!(live.tick(now, Link { busy: true, listening: true, ..Link::default() }), Due::Dead(BUSY_SILENCE));
    }

    #[test]
    fn a_reconnected_link_starts_live() {
        let start = Instant::now();
        let mut live = Liveness::new(start);
        let later = start + Duration::from_secs(60);
        live.reconnected();
        let busy = Link { busy: true, listening: true, ..Link::default() };
        assert_eq!(live.tick(later, busy), Due::Ping, "heard at once, so not dead");
        assert!(matches!(live.tick(later + BUSY_SILENCE, busy), Due::Dead(_)));
    }
}
