//! [`Pace`] against a model of etcd under a registration storm: one queue
//! that applies writes in order at a fixed rate and answers each once it is
//! applied, fed by many servers that each write their transactions one
//! after another.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use super::{Pace, MOST, TARGET};

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
}

/// `servers` each write `txns` transactions of `ops` operations, all
/// starting at once, to a queue that applies `ops_per_sec`; each server
/// paces with `paced` (or writes again at once without).
fn storm(servers: u64, txns: u32, ops: u32, ops_per_sec: u32, paced: bool, settle: Duration) -> Storm {
    let apply = Duration::from_secs(1) / ops_per_sec * ops;
    let mut paces: Vec<Pace> = (0..servers).map(Pace::seeded).collect();
    let mut left: Vec<u32> = vec![txns; servers as usize];
    // (When a server writes next, which server), earliest first.
    let mut next: BinaryHeap<Reverse<(Duration, u64)>> = (0..servers).map(|s| Reverse((Duration::ZERO, s))).collect();
    let mut applied_until = Duration::ZERO;
    let mut worst = Duration::ZERO;
    let mut last_answer = Duration::ZERO;
    while let Some(Reverse((at, server))) = next.pop() {
        let backlog = applied_until.saturating_sub(at);
        if at >= settle {
            worst = worst.max(backlog);
        }
        applied_until = applied_until.max(at) + apply;
        let answered = applied_until;
        last_answer = last_answer.max(answered);
        let index = server as usize;
        left[index] -= 1;
        if left[index] == 0 {
            continue;
        }
        let pace = &mut paces[index];
        pace.answered_in(answered - at);
        let wait = if paced { pace.wait() } else { Duration::ZERO };
        next.push(Reverse((answered + wait, server)));
    }
    Storm { took: last_answer, worst_backlog_after_settle: worst }
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
    assert!(halvings <= 10, "{MOST:?} took {halvings} halvings to none");
    assert_eq!(pace.wait(), Duration::ZERO);
}
