//! [`Pace`] against a model of etcd under a registration storm: one queue
//! that applies writes in order at a fixed rate and answers each once it is
//! applied, fed by many servers that each write their transactions one
//! after another.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use super::{Pace, FIRST_WINDOW, MOST, TARGET};

/// How long etcd waits for its applying to catch up before it fails a
/// lease renewal.
const RENEWAL_GIVES_UP: Duration = Duration::from_secs(1);

/// What a storm did to the model's queue.
#[derive(Debug)]
struct Storm {
    /// From the first write to the last answer.
    took: Duration,
    /// The longest backlog a write found after `settle`: how long etcd
    /// would make a lease renewal wait then.
    worst_backlog_after_settle: Duration,
    /// The longest stretch in which every write found more than a second
    /// of backlog: no lease could be renewed then, and one that stretch
    /// outlasts its time to live is lost.
    longest_behind: Duration,
}

/// `servers` each write `txns` transactions' worth of `ops` operations,
/// all starting at once, to a queue that applies `ops_per_sec`; paced
/// (`paced`), each server pauses and sizes its transactions as its [`Pace`]
/// says, else writes `ops` at a time again at once.
fn storm(servers: u64, txns: u32, ops: u32, ops_per_sec: u32, paced: bool, settle: Duration) -> Storm {
    let per_op = Duration::from_secs(1) / ops_per_sec;
    let mut paces: Vec<Pace> = (0..servers).map(Pace::seeded).collect();
    let mut left: Vec<u32> = vec![txns * ops; servers as usize];
    // (When a server writes next, which server), earliest first.
    let mut next: BinaryHeap<Reverse<(Duration, u64)>> = (0..servers).map(|s| Reverse((Duration::ZERO, s))).collect();
    let mut applied_until = Duration::ZERO;
    let (mut worst, mut longest_behind, mut behind_since) = (Duration::ZERO, Duration::ZERO, None);
    let mut last_answer = Duration::ZERO;
    while let Some(Reverse((at, server))) = next.pop() {
        let backlog = applied_until.saturating_sub(at);
        if at >= settle {
            worst = worst.max(backlog);
        }
        if backlog > RENEWAL_GIVES_UP {
            longest_behind = longest_behind.max(at - *behind_since.get_or_insert(at));
        } else {
            behind_since = None;
        }
        let (index, size) =
            (server as usize, if paced { paces[server as usize].window(ops as usize) } else { ops as usize });
        let size = u32::try_from(size).unwrap().min(left[index]);
        applied_until = applied_until.max(at) + per_op * size;
        let answered = applied_until;
        last_answer = last_answer.max(answered);
        left[index] -= size;
        if left[index] == 0 {
            continue;
        }
        let pace = &mut paces[index];
        pace.answered_in(answered - at);
        let wait = if paced { pace.wait() } else { Duration::ZERO };
        next.push(Reverse((answered + wait, server)));
    }
    Storm { took: last_answer, worst_backlog_after_settle: worst, longest_behind }
}

/// 1 000 servers writing 40 transactions of 25 operations at once, etcd
/// applying 25 000 operations a second: unpaced, every write waits a
/// second behind the others' for the whole storm, as long as etcd waits
/// for a renewal before failing it. Paced, the backlog falls under the
/// renewals' limit within seconds and stays there, and the storm
/// takes hardly longer than etcd needs to apply it.
#[test]
fn paced_servers_keep_the_backlog_near_the_target_and_lose_little_time() {
    let settle = Duration::from_secs(5);
    let ideal = Duration::from_secs(40);
    let unpaced = storm(1000, 40, 25, 25_000, false, settle);
    assert!(unpaced.worst_backlog_after_settle >= RENEWAL_GIVES_UP * 99 / 100, "{unpaced:?}");
    let paced = storm(1000, 40, 25, 25_000, true, settle);
    assert!(paced.worst_backlog_after_settle <= RENEWAL_GIVES_UP * 4 / 5, "{paced:?}");
    assert!(paced.took <= ideal + ideal / 10, "{paced:?}");
}

/// A lone server's writes are answered at once: it never pauses.
#[test]
fn a_server_alone_never_pauses() {
    let alone = storm(1, 400, 25, 25_000, true, Duration::ZERO);
    assert!(alone.worst_backlog_after_settle.is_zero());
    assert_eq!(alone.took, Duration::from_secs(1) / 25_000 * 25 * 400);
}

/// Slow answers double the pause up to [`MOST`]; quick ones halve it to none.
#[test]
fn the_pause_doubles_on_slow_answers_and_halves_on_quick_ones() {
    let mut pace = Pace::seeded(7);
    assert_eq!(pace.wait(), Duration::ZERO);
    pace.answered_in(TARGET * 2);
    assert_eq!(pace.pause, TARGET * 2);
    let wait = pace.wait();
    assert!(wait >= TARGET && wait <= TARGET * 2, "{wait:?}");
    pace.answered_in(TARGET * 2);
    assert_eq!(pace.pause, TARGET * 4);
    for _ in 0..10 {
        pace.answered_in(TARGET * 2);
    }
    assert_eq!(pace.pause, MOST);
    let mut halvings = 0;
    while !pace.pause.is_zero() {
        let before = pace.pause;
        pace.answered_in(TARGET / 2);
        assert!(pace.pause == before / 2 || pace.pause.is_zero(), "{before:?} then {:?}", pace.pause);
        halvings += 1;
    }
    assert!(halvings <= 11, "{MOST:?} took {halvings} halvings to none: 8 s is under 5 ms after 11");
    assert_eq!(pace.wait(), Duration::ZERO);
}

/// 1 000 servers registering 100 devices each (30 transactions' worth of
/// 25 operations) at once, to an etcd of three members on two vCPUs that
/// applies 6 000 or 3 000 operations a second. Without slow starts the
/// first transactions alone are 25 000 operations, four to eight seconds
/// of backlog; every renewal fails for that long, and at 2 s the longest
/// pause still lets 1 000 servers send 12 500 a second, so it never ends.
/// Starting with small transactions, no stretch without renewals lasts
/// near a third of a lease's ten seconds to live.
#[test]
fn a_storm_larger_than_etcd_applies_starts_small_and_leaves_room_for_renewals() {
    for ops_per_sec in [6_000, 3_000] {
        let unpaced = storm(1000, 30, 25, ops_per_sec, false, Duration::ZERO);
        assert!(unpaced.longest_behind >= Duration::from_secs(10), "{ops_per_sec}: {unpaced:?}");
        let paced = storm(1000, 30, 25, ops_per_sec, true, Duration::ZERO);
        assert!(paced.longest_behind < Duration::from_secs(3), "{ops_per_sec}: {paced:?}");
        let ideal = Duration::from_secs(1000 * 30 * 25 / u64::from(ops_per_sec));
        assert!(paced.took <= ideal + ideal / 5, "{ops_per_sec}: {paced:?}");
    }
}

/// The window starts at [`FIRST_WINDOW`], doubles on quick answers up to
/// what the write allows, and halves on slow ones, never below where it began.
#[test]
fn the_window_starts_small_doubles_on_quick_answers_and_halves_on_slow_ones() {
    let mut pace = Pace::seeded(7);
    assert_eq!(pace.window(25), FIRST_WINDOW);
    let mut windows = Vec::new();
    for _ in 0..4 {
        pace.answered_in(TARGET / 2);
        windows.push((pace.window(25), pace.window(100)));
    }
    assert_eq!(windows, [(8, 8), (16, 16), (25, 32), (25, 64)]);
    pace.answered_in(TARGET * 2);
    assert_eq!(pace.window(100), 32);
    for _ in 0..10 {
        pace.answered_in(TARGET * 2);
    }
    assert_eq!(pace.window(100), FIRST_WINDOW);
}
