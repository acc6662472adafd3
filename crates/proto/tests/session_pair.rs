//! Random schedules and cuts on the pair harness (`pair/mod.rs`): a
//! [`ClientSession`] and a [`ServerSession`] joined by a scripted network that
//! hands bytes over in random pieces and, for resumable sessions, cuts the
//! connection at random points — mid-header, mid-payload, between a
//! RET_SUBMIT and its RET_UNLINK — losing whatever was in transit; both sides
//! then resume.
//!
//! Keep-alive schedules add a virtual clock: time passes in steps, both
//! sides' timers run, and the network stays live (what was written arrives
//! within the step), so neither side may ever call the link dead; other
//! tests black-hole one direction and check that silence is noticed within
//! the bound, and that the session then resumes with nothing lost.
//!
//! Checked after every schedule: every URB the client submitted reached the
//! device exactly once, in the order submitted; every submit was answered
//! exactly once (completed with the right data, or cancelled by an unlink);
//! every unlink was answered exactly once, a `RET_UNLINK(0)` only after its
//! target's RET_SUBMIT; and nothing is left outstanding or held.
//!
//! [`ClientSession`]: usbwire_proto::client_session::ClientSession
//! [`ServerSession`]: usbwire_proto::server_session::ServerSession

mod pair;

use std::time::Duration;

use bytes::BytesMut;
use pair::{Pair, Silence, DEVID};
use usbwire_proto::client_session::{ClientSession, ClientSessionError};
use usbwire_proto::liveness::{BUSY_SILENCE, IDLE_SILENCE, TICK};
use usbwire_proto::server_session::{ServerSession, SessionError};
use usbwire_proto::{Budget, Limits};

fn run(seed: u64, resumable: bool) -> usize {
    let mut pair = Pair::new(seed, resumable);
    let steps = 100 + pair.rng.below(400);
    for _ in 0..steps {
        pair.step(resumable);
    }
    pair.drain();
    // The last ack goes out with the last read; deliver it.
    pair.client_writes(usize::MAX);
    pair.deliver_to_server(usize::MAX);
    pair.check();
    pair.cuts
}

#[test]
fn every_urb_answered_once_without_cuts() {
    for seed in 0..500 {
        run(seed, false);
    }
}

#[test]
fn every_urb_answered_once_across_random_cuts() {
    let mut cuts = 0;
    for seed in 0..2000 {
        cuts += run(seed, true);
    }
    assert!(cuts > 2000, "the schedules cut the connection {cuts} times");
}

/// A cut right after every single byte of a short exchange: header, OUT
/// payload, RET_SUBMIT, RET_UNLINK and the ack all get cut in the middle.
#[test]
fn a_cut_at_every_byte_offset_loses_and_repeats_nothing() {
    let mut pair = Pair::new(7, true);
    for _ in 0..6 {
        pair.submit();
    }
    pair.unlink();
    let total = {
        let mut probe = Pair::new(7, true);
        for _ in 0..6 {
            probe.submit();
        }
        probe.unlink();
        probe.client.outbox().queued()
    };
    for offset in 0..total {
        let mut pair = Pair::new(7, true);
        for _ in 0..6 {
            pair.submit();
        }
        pair.unlink();
        pair.client_writes(offset);
        pair.deliver_to_server(offset);
        pair.device_completes();
        pair.server_writes(offset % 200);
        pair.deliver_to_client(offset % 200);
        pair.cut();
        pair.drain();
        pair.client_writes(usize::MAX);
        pair.deliver_to_server(usize::MAX);
        pair.check();
    }
    drop(pair);
}

/// Random schedules with keep-alive and a virtual clock: pings interleave with
/// commands, replies, acknowledgements and cuts; the link stays live (every
/// step of time delivers what was written), so it is never called dead, and
/// every URB is still answered exactly once.
#[test]
fn keepalives_interleave_with_everything_and_a_live_link_is_never_called_dead() {
    let mut cuts = 0;
    for seed in 0..500 {
        let mut pair = Pair::with_keepalive(seed);
        let steps = 100 + pair.rng.below(400);
        for _ in 0..steps {
            if pair.rng.chance(15) {
                let by = Duration::from_millis(pair.rng.below(TICK.as_millis() as usize + 1) as u64);
                pair.advance(by).unwrap_or_else(|silence| panic!("seed {seed}: live link called dead: {silence:?}"));
                pair.exchange();
            } else {
                pair.step(true);
            }
        }
        pair.finish();
        cuts += pair.cuts;
    }
    assert!(cuts > 300, "the schedules cut the connection {cuts} times");
}

/// A URB that stays pending for a minute (an interrupt IN with nothing to
/// say) over a quiet link: both sides ping, neither gives up.
#[test]
fn a_quiet_link_with_a_pending_urb_stays_up_on_keepalives() {
    let mut pair = Pair::with_keepalive(1);
    pair.submit();
    pair.exchange();
    assert_eq!(pair.device.running.len(), 1);
    let (mut to_server, mut to_client) = (0, 0);
    for _ in 0..600 {
        pair.advance(Duration::from_millis(100)).unwrap();
        to_server += pair.client.outbox().queued();
        to_client += pair.server.outbox().queued();
        pair.exchange();
    }
    // A 48-byte ping every other tick each way (a ping is itself something said).
    let pings = (Duration::from_secs(60).as_millis() / (2 * TICK.as_millis())) as usize;
    assert!((pings - 1..=pings + 1).contains(&(to_server / 48)), "client sent {to_server} bytes of pings");
    assert!((pings - 1..=pings + 1).contains(&(to_client / 48)), "server sent {to_client} bytes of pings");
    pair.finish();
}

/// The network stops carrying one direction without a word. The side that
/// hears nothing calls the link dead within the bound (busy: a URB is
/// pending), both resume, and nothing is lost or repeated.
#[test]
fn a_silent_peer_is_noticed_within_the_bound_then_resumed_with_nothing_lost() {
    for (blackhole_to_client, bound) in [(true, BUSY_SILENCE), (false, BUSY_SILENCE)] {
        let mut pair = Pair::with_keepalive(3);
        for _ in 0..3 {
            pair.submit();
        }
        pair.exchange();
        pair.advance(Duration::from_secs(1)).unwrap();
        pair.exchange();
        let last_heard = pair.now;
        let silence = loop {
            if let Err(silence) = pair.advance(Duration::from_millis(50)) {
                break silence;
            }
            // Only one direction carries.
            if blackhole_to_client {
                pair.client_writes(usize::MAX);
                pair.deliver_to_server(usize::MAX);
                pair.server_writes(usize::MAX);
                pair.s2c.clear();
            } else {
                pair.server_writes(usize::MAX);
                pair.deliver_to_client(usize::MAX);
                pair.client_writes(usize::MAX);
                pair.c2s.clear();
            }
            assert!(pair.now - last_heard < bound + 2 * TICK, "silence not noticed after {:?}", pair.now - last_heard);
        };
        let noticed = pair.now - last_heard;
        match (&silence, blackhole_to_client) {
            (Silence::Client(ClientSessionError::Silent(_)), true)
            | (Silence::Server(SessionError::Silent(_)), false) => {}
            other => panic!("the wrong side noticed: {other:?}"),
        }
        assert!(noticed >= bound && noticed <= bound + TICK, "noticed after {noticed:?}, bound {bound:?}");
        // The device finishes meanwhile; then the session is resumed on a new connection.
        pair.device_completes();
        pair.cut();
        pair.finish();
    }
}

/// With nothing outstanding the longer bound applies.
#[test]
fn an_idle_silent_link_is_called_dead_only_after_the_idle_bound() {
    let mut pair = Pair::with_keepalive(5);
    pair.exchange();
    let start = pair.now;
    let silence = loop {
        if let Err(silence) = pair.advance(Duration::from_millis(100)) {
            break silence;
        }
        pair.client_writes(usize::MAX);
        pair.server_writes(usize::MAX);
        pair.c2s.clear();
        pair.s2c.clear();
    };
    let noticed = pair.now - start;
    assert!(matches!(silence, Silence::Client(_) | Silence::Server(_)));
    assert!(noticed >= IDLE_SILENCE && noticed <= IDLE_SILENCE + TICK, "noticed after {noticed:?}");
}

/// A server that stopped reading the client (its in-flight table is full and
/// the device is slow) does not call the client's unread pings silence.
#[test]
fn a_server_holding_its_input_does_not_call_the_client_silent() {
    let mut pair = Pair::with_keepalive(9);
    let budget = Budget { in_flight_urbs: 1, ..Budget::default() };
    let now = pair.now;
    pair.server = ServerSession::new(DEVID, BytesMut::new(), Limits::default(), budget).resumable().keepalive(now);
    for _ in 0..3 {
        pair.submit();
    }
    pair.exchange();
    assert!(!pair.server.wants_input(), "the server's table is full");
    for _ in 0..300 {
        pair.advance(Duration::from_millis(100)).unwrap();
        pair.exchange();
    }
    pair.finish();
}

/// Client and server with different budgets, both ways, down to one URB in
/// flight. A resumable server says what its table takes when it grants
/// resume, and the client sends no more than that: the server never stops
/// reading, so it always reads the acknowledgements its completions wait for.
#[test]
fn unequal_budgets_never_stall() {
    for seed in 0..1000 {
        let mut pair = Pair::new(seed, true);
        let resumable = seed % 4 != 0;
        let small = Budget {
            in_flight_urbs: 1 + pair.rng.below(4),
            in_flight_bytes: [512, 6000, 1 << 20][pair.rng.below(3)],
            queued_reply_bytes: 4096,
            unacked_reply_bytes: [100, 9000][pair.rng.below(2)],
            ..Budget::default()
        };
        let (client_budget, server_budget) =
            if seed % 2 == 0 { (Budget::default(), small) } else { (small, Budget::default()) };
        let (urbs, bytes) = (server_budget.in_flight_urbs, server_budget.in_flight_bytes);
        pair.client = ClientSession::new(DEVID, Limits::default(), client_budget);
        pair.server = ServerSession::new(DEVID, BytesMut::new(), Limits::default(), server_budget);
        if resumable {
            let client = std::mem::replace(&mut pair.client, placeholder_client());
            pair.client = client.resumable().server_takes(urbs, bytes);
            let server = std::mem::replace(&mut pair.server, placeholder_server());
            pair.server = server.resumable();
        }
        let steps = 100 + pair.rng.below(400);
        for _ in 0..steps {
            pair.step(resumable);
        }
        pair.finish();
    }
}

fn placeholder_client() -> ClientSession<u32> {
    ClientSession::new(DEVID, Limits::default(), Budget::default())
}

fn placeholder_server() -> ServerSession {
    ServerSession::new(DEVID, BytesMut::new(), Limits::default(), Budget::default())
}
