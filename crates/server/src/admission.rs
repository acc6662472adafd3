//! Who gets a connection: a small pool for strangers, room for everyone else.
//!
//! A connection is *unauthenticated* from its accept until it has proved it is
//! a client: its TLS handshake named an admitted identity, or (plain USB/IP)
//! its OP request has been read — a transform offer is still part of the
//! handshake. Unauthenticated connections live in a pool of their own
//! ([`AdmissionLimits::unauthenticated_max`]), at most
//! [`AdmissionLimits::per_address_max`] from one address, and each stage has a
//! short deadline. An authenticated connection moves out of that pool into the
//! `max_connections` budget and is never evicted or refused because of later
//! arrivals.
//!
//! So one address holding hundreds of half-open connections (and re-opening
//! each as it is closed) holds at most `per_address_max` pool entries; the rest
//! are refused at accept, at the cost of an `accept` and a reset. When many
//! addresses fill the pool, a newcomer from a less represented address evicts
//! the oldest pending connection of the most represented one, so no single
//! address can keep the others out.
//!
//! Refusals, evictions and connections dropped before they authenticated are
//! not logged one line each (a flood would flood the log): they are counted,
//! and one summary line per [`AdmissionLimits::log_interval`] gives the counts
//! and the address seen most. Each one is at debug level.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tracing::{debug, warn};

/// Limits for connections that have not yet authenticated, and the deadlines
/// they have for each step. `usbwire serve` reads them from `[admission]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Unauthenticated connections at once, from all addresses (default 64).
    pub unauthenticated_max: usize,
    /// Unauthenticated connections at once from one address — an IPv4 address
    /// or an IPv6 /64 (default 8).
    pub per_address_max: usize,
    /// Time from accept to the first byte (default 3 s).
    pub first_byte_timeout: Duration,
    /// Time for the TLS handshake (default 3 s).
    pub handshake_timeout: Duration,
    /// Time for each OP request (default 3 s).
    pub request_timeout: Duration,
    /// How long an import waits for a device its previous importer is still
    /// giving back (its connection closed, its teardown not finished) before
    /// answering busy (default 5 s).
    pub release_wait: Duration,
    /// At most one summary line of refused and dropped connections per this
    /// interval (default 10 s).
    pub log_interval: Duration,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        Self {
            unauthenticated_max: 64,
            per_address_max: 8,
            first_byte_timeout: Duration::from_secs(3),
            handshake_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(3),
            release_wait: Duration::from_secs(5),
            log_interval: Duration::from_secs(10),
        }
    }
}

/// What the per-address limits count by: an IPv4 address, or the /64 an IPv6
/// address is in (one host commonly owns a whole /64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    V4(std::net::Ipv4Addr),
    V6Prefix(u64),
}

impl Source {
    pub(crate) fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => Self::V4(v4),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Self::V4(v4),
                None => Self::V6Prefix((u128::from(v6) >> 64) as u64),
            },
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::V4(v4) => write!(f, "{v4}"),
            Self::V6Prefix(prefix) => write!(f, "{}/64", Ipv6Addr::from(u128::from(*prefix) << 64)),
        }
    }
}

/// Why an unauthenticated connection was refused or closed (counted for the summary).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dropped {
    /// Refused at accept: its address already had `per_address_max` pending.
    PerAddress,
    /// Refused at accept, or after authenticating: no room left.
    Full,
    /// Closed to make room for a connection from a less represented address.
    Evicted,
    /// Sent nothing, or did not finish its handshake or request, in time.
    TimedOut,
    /// Sent something that is not a request, failed its TLS handshake, or
    /// spoke plain USB/IP to a server that requires TLS.
    Failed,
}

const KINDS: usize = 5;

impl Dropped {
    const ALL: [Self; KINDS] = [Self::PerAddress, Self::Full, Self::Evicted, Self::TimedOut, Self::Failed];

    fn index(self) -> usize {
        self as usize
    }

    /// The metrics label.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::PerAddress => "per_address",
            Self::Full => "full",
            Self::Evicted => "evicted",
            Self::TimedOut => "timed_out",
            Self::Failed => "failed",
        }
    }
}

/// The server's admission state, shared by the accept loop and every
/// connection that has not authenticated yet.
#[derive(Clone)]
pub(crate) struct Gate {
    shared: Arc<Shared>,
}

struct Shared {
    limits: AdmissionLimits,
    max_authenticated: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    /// Pending (unauthenticated) connections, oldest first.
    pending: BTreeMap<u64, PendingEntry>,
    pending_by_source: HashMap<Source, usize>,
    authenticated: usize,
    log: DropLog,
}

struct PendingEntry {
    source: Source,
    evict: Arc<Notify>,
}

impl State {
    fn remove_pending(&mut self, id: u64) -> Option<PendingEntry> {
        let entry = self.pending.remove(&id)?;
        if let Some(count) = self.pending_by_source.get_mut(&entry.source) {
            *count -= 1;
            if *count == 0 {
                self.pending_by_source.remove(&entry.source);
            }
        }
        Some(entry)
    }
}

impl Gate {
    /// `max_authenticated` bounds connections past authentication (`ServerConfig::max_connections`).
    pub(crate) fn new(limits: AdmissionLimits, max_authenticated: usize) -> Self {
        Self { shared: Arc::new(Shared { limits, max_authenticated, state: Mutex::new(State::default()) }) }
    }

    /// Connections refused or closed before authenticating since the start, by reason.
    pub(crate) fn dropped_totals(&self) -> Vec<(&'static str, u64)> {
        let totals = self.state().log.totals;
        Dropped::ALL.iter().map(|why| (why.name(), totals[why.index()])).collect()
    }

    /// A place in the unauthenticated pool for a connection from `ip`, or the
    /// reason there is none (already counted for the summary).
    pub(crate) fn admit(&self, ip: IpAddr) -> Result<Ticket, Dropped> {
        let source = Source::of(ip);
        let limits = &self.shared.limits;
        let mut state = self.state();
        let mine = state.pending_by_source.get(&source).copied().unwrap_or(0);
        if mine >= limits.per_address_max {
            state.log.count(Dropped::PerAddress, source);
            return Err(Dropped::PerAddress);
        }
        if state.pending.len() >= limits.unauthenticated_max {
            // Make room at the expense of the most represented address, if that is not this one.
            let top = state.pending_by_source.iter().max_by_key(|(_, count)| **count).map(|(s, c)| (*s, *c));
            let victim = match top {
                Some((top, count)) if count > mine + 1 => {
                    state.pending.iter().find(|(_, entry)| entry.source == top).map(|(id, _)| *id)
                }
                _ => None,
            };
            let Some(victim) = victim else {
                state.log.count(Dropped::Full, source);
                return Err(Dropped::Full);
            };
            if let Some(entry) = state.remove_pending(victim) {
                entry.evict.notify_one();
                state.log.count(Dropped::Evicted, entry.source);
            }
        }
        let id = state.next_id;
        state.next_id += 1;
        let evict = Arc::new(Notify::new());
        state.pending.insert(id, PendingEntry { source, evict: evict.clone() });
        *state.pending_by_source.entry(source).or_default() += 1;
        drop(state);
        Ok(Ticket { stage: Stage::Pending { gate: self.clone(), id, source, evict } })
    }

    /// Logs the summary of refused and dropped connections if one is due.
    /// The first after a quiet interval is logged at once.
    pub(crate) fn log_summary(&self) {
        let interval = self.shared.limits.log_interval;
        let summary = self.state().log.take_if_due(Instant::now(), interval);
        if let Some(summary) = summary {
            let [per_address, full, evicted, timed_out, failed] = summary.counts;
            warn!(
                refused_per_address = per_address,
                refused_full = full,
                evicted,
                timed_out,
                failed,
                top_address = %summary.top.map_or_else(String::new, |(source, _)| source.to_string()),
                top_count = summary.top.map_or(0, |(_, count)| count),
                "{} unauthenticated connection(s) refused or closed before authenticating{} (limits: [admission] \
                 in the config file; each one at debug level)",
                summary.counts.iter().sum::<u64>(),
                if summary.window.is_zero() {
                    String::new()
                } else {
                    format!(" in the last {} s", summary.window.as_secs())
                },
            );
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        usbwire_device::sync::lock(&self.shared.state)
    }
}

/// A connection's place in the admission budgets; dropping it gives the place back.
pub(crate) struct Ticket {
    stage: Stage,
}

enum Stage {
    Pending {
        gate: Gate,
        id: u64,
        source: Source,
        evict: Arc<Notify>,
    },
    Authenticated {
        gate: Gate,
    },
    /// In-process sessions: outside every budget.
    Unlimited,
    /// Refused on authentication; nothing to give back.
    Spent,
}

impl Ticket {
    /// For sessions made inside the process, which no pool counts.
    pub(crate) fn unlimited() -> Self {
        Self { stage: Stage::Unlimited }
    }

    /// Resolves if the connection is evicted from the unauthenticated pool
    /// (never, once it has authenticated).
    pub(crate) async fn evicted(&self) {
        match &self.stage {
            Stage::Pending { evict, .. } => evict.notified().await,
            _ => std::future::pending().await,
        }
    }

    /// Moves the connection out of the unauthenticated pool. `false` when the
    /// server has no room for another authenticated connection (counted).
    pub(crate) fn authenticate(&mut self) -> bool {
        let Stage::Pending { gate, id, source, .. } = &self.stage else {
            return !matches!(self.stage, Stage::Spent);
        };
        let gate = gate.clone();
        let source = *source;
        let mut state = gate.state();
        if state.remove_pending(*id).is_none() {
            // Evicted a moment ago (and counted then).
            drop(state);
            self.stage = Stage::Spent;
            return false;
        }
        if state.authenticated >= gate.shared.max_authenticated {
            state.log.count(Dropped::Full, source);
            drop(state);
            debug!(%source, "connection limit reached; closing an authenticated connection");
            self.stage = Stage::Spent;
            return false;
        }
        state.authenticated += 1;
        drop(state);
        self.stage = Stage::Authenticated { gate };
        true
    }

    /// Counts a connection dropped before it authenticated, for the summary;
    /// `false` (nothing counted) once it has authenticated — log it then.
    pub(crate) fn dropped(&self, why: Dropped) -> bool {
        let Stage::Pending { gate, source, .. } = &self.stage else { return false };
        gate.state().log.count(why, *source);
        true
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        match &self.stage {
            Stage::Pending { gate, id, .. } => {
                gate.state().remove_pending(*id);
            }
            Stage::Authenticated { gate } => gate.state().authenticated -= 1,
            Stage::Unlimited | Stage::Spent => {}
        }
    }
}

/// Counts since the last summary line, and since the start.
#[derive(Default)]
struct DropLog {
    last: Option<Instant>,
    counts: [u64; KINDS],
    totals: [u64; KINDS],
    by_source: HashMap<Source, u64>,
}

struct Summary {
    counts: [u64; KINDS],
    top: Option<(Source, u64)>,
    window: Duration,
}

/// Distinct addresses tracked per summary (IPv6 offers many); the rest still count in the totals.
const MAX_TRACKED_SOURCES: usize = 4096;

impl DropLog {
    fn count(&mut self, why: Dropped, source: Source) {
        debug!(%source, reason = ?why, "unauthenticated connection refused or closed");
        self.counts[why.index()] += 1;
        self.totals[why.index()] += 1;
        if self.by_source.len() < MAX_TRACKED_SOURCES || self.by_source.contains_key(&source) {
            *self.by_source.entry(source).or_default() += 1;
        }
    }

    fn take_if_due(&mut self, now: Instant, interval: Duration) -> Option<Summary> {
        if self.counts.iter().all(|&c| c == 0) {
            return None;
        }
        let window = match self.last {
            Some(last) if now.duration_since(last) < interval => return None,
            Some(last) => now.duration_since(last),
            None => Duration::ZERO,
        };
        self.last = Some(now);
        let top = self.by_source.drain().max_by_key(|(_, count)| *count);
        Some(Summary { counts: std::mem::take(&mut self.counts), top, window })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(unauthenticated_max: usize, per_address_max: usize, max_authenticated: usize) -> Gate {
        Gate::new(
            AdmissionLimits { unauthenticated_max, per_address_max, ..AdmissionLimits::default() },
            max_authenticated,
        )
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn pending(gate: &Gate) -> usize {
        gate.state().pending.len()
    }

    #[test]
    fn one_address_gets_at_most_its_share_and_others_still_get_in() {
        let gate = gate(64, 8, 256);
        let flood: Vec<Ticket> = (0..8).map(|_| gate.admit(ip("10.0.0.2")).unwrap()).collect();
        for _ in 0..100 {
            assert_eq!(gate.admit(ip("10.0.0.2")).err(), Some(Dropped::PerAddress));
        }
        assert!(gate.admit(ip("10.0.0.1")).is_ok(), "another address is served");
        drop(flood);
        assert_eq!(pending(&gate), 0, "every place is given back");
        assert!(gate.admit(ip("10.0.0.2")).is_ok());
    }

    #[test]
    fn ipv6_addresses_count_by_their_64() {
        let gate = gate(64, 2, 256);
        let _a = gate.admit(ip("2001:db8::1")).unwrap();
        let _b = gate.admit(ip("2001:db8::2")).unwrap();
        assert_eq!(gate.admit(ip("2001:db8::ffff:3")).err(), Some(Dropped::PerAddress));
        assert!(gate.admit(ip("2001:db8:0:1::1")).is_ok(), "another /64");
        assert_eq!(Source::of(ip("2001:db8::1")).to_string(), "2001:db8::/64");
        assert_eq!(Source::of(ip("::ffff:10.1.2.3")), Source::of(ip("10.1.2.3")));
    }

    #[tokio::test]
    async fn a_full_pool_evicts_the_oldest_of_the_most_represented_address() {
        let gate = gate(4, 3, 256);
        let oldest = gate.admit(ip("10.0.0.2")).unwrap();
        let _second = gate.admit(ip("10.0.0.2")).unwrap();
        let _third = gate.admit(ip("10.0.0.2")).unwrap();
        let _other = gate.admit(ip("10.0.0.3")).unwrap();
        let newcomer = gate.admit(ip("10.0.0.4")).unwrap();
        tokio::time::timeout(Duration::from_secs(5), oldest.evicted()).await.expect("the oldest of 10.0.0.2 is told");
        assert_eq!(pending(&gate), 4);
        let _fifth = gate.admit(ip("10.0.0.5")).unwrap();
        // Every address has one now: nobody is more represented, so the next is refused.
        assert_eq!(gate.admit(ip("10.0.0.6")).err(), Some(Dropped::Full));
        assert_eq!(gate.admit(ip("10.0.0.2")).err(), Some(Dropped::Full));
        drop(newcomer);
        assert!(gate.admit(ip("10.0.0.6")).is_ok());
    }

    #[tokio::test]
    async fn an_authenticated_connection_is_never_evicted_and_counts_against_the_connection_limit() {
        let gate = gate(2, 2, 1);
        let mut client = gate.admit(ip("10.0.0.1")).unwrap();
        assert!(client.authenticate());
        assert!(client.authenticate(), "authenticating twice is harmless");
        let mut flood: Vec<Ticket> = (0..2).map(|_| gate.admit(ip("10.0.0.2")).unwrap()).collect();
        // A third address evicts the oldest 10.0.0.2 connection, never the authenticated one.
        let _third = gate.admit(ip("10.0.0.3")).unwrap();
        let evicted = tokio::time::timeout(Duration::from_millis(200), client.evicted()).await;
        assert!(evicted.is_err(), "the authenticated connection stays");
        tokio::time::timeout(Duration::from_secs(5), flood[0].evicted()).await.expect("the oldest pending one goes");
        assert!(!flood[0].authenticate(), "an evicted connection does not get in");
        // The connection limit is reached: another connection cannot authenticate.
        assert!(!flood[1].authenticate());
        drop(client);
        let mut third = gate.admit(ip("10.0.0.4")).unwrap();
        assert!(third.authenticate(), "the authenticated place was given back");
    }

    #[test]
    fn refusals_are_summarised_once_per_interval() {
        let mut log = DropLog::default();
        let start = Instant::now();
        let interval = Duration::from_secs(10);
        assert!(log.take_if_due(start, interval).is_none(), "nothing to say");
        log.count(Dropped::PerAddress, Source::of(ip("10.0.0.2")));
        let first = log.take_if_due(start, interval).expect("the first refusal is reported at once");
        assert_eq!(first.counts, [1, 0, 0, 0, 0]);
        for _ in 0..1000 {
            log.count(Dropped::PerAddress, Source::of(ip("10.0.0.2")));
            log.count(Dropped::TimedOut, Source::of(ip("10.0.0.9")));
            assert!(log.take_if_due(start + Duration::from_secs(5), interval).is_none());
        }
        let next = log.take_if_due(start + Duration::from_secs(11), interval).expect("due");
        assert_eq!(next.counts, [1000, 0, 0, 1000, 0]);
        assert_eq!(next.window, Duration::from_secs(11));
        assert!(log.take_if_due(start + Duration::from_secs(30), interval).is_none(), "all reported");
    }
}
