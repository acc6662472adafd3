//! Time in the server's cores, on a virtual clock: the grace period of a
//! parked session ([`Grace`]) and an import's wait for the previous
//! importer's teardown ([`ImportWait`]).
//!
//! [`Server`] is one exported device's slot as the server's registry keeps
//! it (available, held, being reset, withdrawn) with the imports waiting for
//! it and the grace of its parked session, driven the way the server drives
//! the cores: an import looks at once, again whenever the device is given
//! back or withdrawn, and at its deadline; the grace's timer runs at its
//! deadline; time jumps from one deadline to the next.
//!
//! The grace tests park a session of the pair harness (`crates/proto/tests/pair/mod.rs`) — the
//! connection cut mid-traffic, the device running on — and bring the client
//! back just before or just after the grace ends: in time nothing is lost or
//! repeated; late, the resume is refused and the device released to the
//! next importer. The import tests race an import against the previous
//! importer's teardown. Random schedules (proptest) of imports, hang-ups,
//! teardowns, parked sessions, resumes, withdrawals and time check that a
//! device never has two owners, that a parked session is resumed once or
//! expires once (or is let go), and that every import gets one answer,
//! within its bound.

// The pair harness of the protocol's own tests, so both sides of a session are the real cores.
#[path = "../../proto/tests/pair/mod.rs"]
mod pair;

use std::cell::RefCell;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use pair::Pair;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use usbwire_server::cores::import_slot::{Busy, Claimant, Found, ImportDecision, ImportWait, Presence};
use usbwire_server::cores::park::{Grace, ParkEvent, ResumeRefused};

/// The server's default grace period (`DEFAULT_RESUME_GRACE`).
const GRACE: Duration = Duration::from_secs(30);
/// The server's default bound on an import's wait (`[admission] release_wait`).
const RELEASE_WAIT: Duration = Duration::from_secs(5);
const MS: Duration = Duration::from_millis(1);

/// Who imports: its connection's address and TLS identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Client {
    address: SocketAddr,
    identity: Option<&'static str>,
}

impl Client {
    fn claimant(&self) -> Claimant<'static> {
        Claimant { address: self.address, identity: self.identity }
    }

    /// Whether `other` may take over this client's parked session (the
    /// server's rule: the same TLS identity, or for a plain client the same address).
    fn may_resume(&self, other: &Self) -> bool {
        self.identity == other.identity && (self.identity.is_some() || self.address.ip() == other.address.ip())
    }
}

const fn at(host: u8, port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, host), port))
}

const LAPTOP: Client = Client { address: at(1, 40001), identity: None };
/// The laptop again, on a new connection: a detach and attach.
const LAPTOP_AGAIN: Client = Client { address: at(1, 40002), identity: None };
const DESK: Client = Client { address: at(2, 40001), identity: None };
const TLS: Client = Client { address: at(3, 40001), identity: Some("SHA256:aa") };
/// The same identity from another address (a roaming laptop).
const TLS_ROAMED: Client = Client { address: at(4, 40001), identity: Some("SHA256:aa") };
/// Another identity on the same host.
const TLS_OTHER: Client = Client { address: at(3, 40002), identity: Some("SHA256:bb") };
const CLIENTS: [Client; 6] = [LAPTOP, LAPTOP_AGAIN, DESK, TLS, TLS_ROAMED, TLS_OTHER];

/// The device's slot, as the registry keeps it.
#[derive(Debug)]
enum Slot {
    Available,
    Held {
        /// The import that took it.
        owner: usize,
        client: Client,
        presence: Presence,
        /// While its connection is down: the grace, and the episode it belongs to.
        parked: Option<(Grace, usize)>,
    },
    Releasing {
        done_at: Instant,
    },
    Withdrawn,
}

/// One import: who asked, when, its bound, its core and its answer.
struct Import {
    client: Client,
    asked_at: Instant,
    bound: Duration,
    wait: ImportWait,
    answer: Option<(ImportDecision, Instant)>,
}

/// How a parked session ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Resumed,
    Expired,
    /// Its own client imported the device afresh.
    Reclaimed,
    Withdrawn,
}

/// One stay of a session in the parked state.
struct Episode {
    lost_at: Instant,
    outcome: Option<(Outcome, Instant)>,
}

/// Why the server refused a resume.
#[derive(Debug, PartialEq, Eq)]
enum ResumeError {
    /// No session parked under that token, or another client's (`ST_NODEV`).
    Unknown,
    /// The grace refused it (`ST_NODEV`).
    Grace(ResumeRefused),
}

/// One exported device on a virtual clock.
struct Server {
    now: Instant,
    /// How long resetting the device takes once its importer is gone.
    reset: Duration,
    slot: Slot,
    imports: Vec<Import>,
    episodes: Vec<Episode>,
}

impl Server {
    fn new(reset: Duration) -> Self {
        Self { now: Instant::now(), reset, slot: Slot::Available, imports: Vec::new(), episodes: Vec::new() }
    }

    /// `client` asks for the device, waiting at most `bound` for a teardown.
    /// Returns the import's number.
    fn import(&mut self, client: Client, bound: Duration) -> usize {
        let id = self.imports.len();
        self.imports.push(Import {
            client,
            asked_at: self.now,
            bound,
            wait: ImportWait::new(self.now, bound),
            answer: None,
        });
        self.look(id);
        self.advance(Duration::ZERO);
        id
    }

    fn answer(&self, id: usize) -> Option<(ImportDecision, Instant)> {
        self.imports[id].answer
    }

    fn found(&self) -> Found<'static> {
        match &self.slot {
            Slot::Available => Found::Available,
            Slot::Releasing { .. } => Found::Releasing,
            Slot::Withdrawn => Found::Withdrawn,
            Slot::Held { client, presence, .. } => Found::Held { holder: client.claimant(), presence: *presence },
        }
    }

    /// Import `id` looks at the slot and does what its core decides.
    fn look(&mut self, id: usize) {
        let found = self.found();
        let now = self.now;
        let import = &mut self.imports[id];
        assert!(import.answer.is_none(), "import {id} asked again after its answer");
        let deadline = import.asked_at + import.bound;
        let decision = import.wait.decide(&import.client.claimant(), found);
        let client = import.client;
        match decision {
            ImportDecision::WaitUntil(until) | ImportDecision::ReclaimAndWaitUntil(until) => {
                assert_eq!(until, deadline, "import {id} waits until its own deadline");
                assert!(!import.wait.is_answered());
                assert_eq!(import.wait.poll_timeout(), Some(deadline), "import {id} is asked again at its deadline");
                if matches!(decision, ImportDecision::ReclaimAndWaitUntil(_)) {
                    let Slot::Held { client: holding, presence: Presence::Away, .. } = &self.slot else {
                        panic!("import {id} reclaims a device not parked: {:?}", self.slot)
                    };
                    assert!(holding.may_resume(&client), "import {id} reclaims another client's session");
                    self.end_episode(Outcome::Reclaimed);
                    self.release();
                }
                return;
            }
            ImportDecision::Take => {
                assert!(
                    matches!(self.slot, Slot::Available),
                    "import {id} took a device already held: {:?}",
                    self.slot
                );
                self.slot = Slot::Held { owner: id, client, presence: Presence::Live, parked: None };
            }
            ImportDecision::Busy(Busy::Held { holder }) => {
                let Slot::Held { client: holding, presence, .. } = &self.slot else {
                    panic!("import {id} told the device is held, but it is {:?}", self.slot)
                };
                assert_eq!(holder, holding.address, "busy names the holder");
                if *presence == Presence::Live && holder.ip() == client.address.ip() {
                    assert_eq!(now, deadline, "the holder's own host is refused only after the wait");
                }
            }
            ImportDecision::Busy(Busy::StillReleasing { waited }) => {
                assert_eq!(waited, self.imports[id].bound);
                assert_eq!(now, deadline, "still releasing is said only at the deadline");
                assert!(!matches!(self.slot, Slot::Available), "busy while the device was free");
            }
            ImportDecision::Withdrawn => assert!(matches!(self.slot, Slot::Withdrawn)),
        }
        let import = &mut self.imports[id];
        assert!(now <= deadline, "import {id} answered {:?} after its deadline", now - deadline);
        assert!(import.wait.is_answered() && import.wait.poll_timeout().is_none());
        import.answer = Some((decision, now));
    }

    /// Every import still waiting looks again (the slot was given back or withdrawn).
    fn wake_waiting(&mut self) {
        for id in 0..self.imports.len() {
            if self.imports[id].answer.is_none() {
                self.look(id);
            }
        }
    }

    /// The holder's lease ends: the device is reset, then available.
    fn release(&mut self) {
        if let Slot::Held { parked, .. } = &self.slot {
            assert!(parked.is_none(), "a parked session let go without an outcome");
            self.slot = Slot::Releasing { done_at: self.now + self.reset };
        }
    }

    /// The holder's client hangs up; its task has not noticed yet.
    fn hang_up(&mut self) {
        if let Slot::Held { presence: presence @ Presence::Live, .. } = &mut self.slot {
            *presence = Presence::HungUp;
        }
    }

    /// The holder's task sees its connection end: a resumable session parks
    /// for its grace, another one lets the device go.
    fn connection_ends(&mut self, resumable: bool) {
        let Slot::Held { presence, parked: parked @ None, .. } = &mut self.slot else { return };
        if !resumable {
            self.release();
            return;
        }
        *presence = Presence::Away;
        *parked = Some((Grace::start(self.now, GRACE), self.episodes.len()));
        self.episodes.push(Episode { lost_at: self.now, outcome: None });
    }

    /// `client` comes back with the session's token. A connected session
    /// (its old connection not yet seen to drop) parks and resumes at once.
    fn resume(&mut self, client: Client) -> Result<(), ResumeError> {
        let now = self.now;
        let Slot::Held { client: owner, presence, parked, .. } = &mut self.slot else {
            return Err(ResumeError::Unknown);
        };
        if !owner.may_resume(&client) {
            return Err(ResumeError::Unknown);
        }
        if parked.is_none() {
            *parked = Some((Grace::start(now, GRACE), self.episodes.len()));
            self.episodes.push(Episode { lost_at: now, outcome: None });
        }
        let Some((grace, episode)) = parked else { unreachable!("parked above") };
        let lost_at = self.episodes[*episode].lost_at;
        match grace.resume(now) {
            Ok(()) => {
                assert!(now < lost_at + GRACE, "resumed {:?} after the grace ended", now - lost_at - GRACE);
                grace.answered(now);
                assert_eq!(grace.poll_event(), Some(ParkEvent::Resumed { outage: now - lost_at }));
                *presence = Presence::Live;
                self.end_episode(Outcome::Resumed);
                Ok(())
            }
            Err(refused) => {
                assert_eq!(refused, ResumeRefused::Expired { grace: GRACE });
                assert!(now >= lost_at + GRACE, "refused within the grace");
                assert_eq!(grace.poll_event(), Some(ParkEvent::Expired { grace: GRACE }));
                self.end_episode(Outcome::Expired);
                self.release();
                Err(ResumeError::Grace(refused))
            }
        }
    }

    /// The export is withdrawn (unbind, unplug).
    fn withdraw(&mut self) {
        if matches!(&self.slot, Slot::Held { parked: Some(_), .. }) {
            self.end_episode(Outcome::Withdrawn);
        }
        self.slot = Slot::Withdrawn;
        self.wake_waiting();
    }

    /// The parked session ends with `outcome`: its grace has nothing more to say.
    fn end_episode(&mut self, outcome: Outcome) {
        let Slot::Held { parked, .. } = &mut self.slot else { panic!("no parked session to end") };
        let Some((mut grace, episode)) = parked.take() else { panic!("no parked session to end") };
        if matches!(outcome, Outcome::Resumed | Outcome::Expired) {
            // Over: time changes nothing any more. (A session let go is simply dropped.)
            grace.handle_timeout(self.now + 10 * GRACE);
        }
        assert_eq!(grace.poll_event(), None, "episode {episode}: a second event after {outcome:?}");
        let ended = &mut self.episodes[episode].outcome;
        assert!(ended.is_none(), "episode {episode} ended twice: {ended:?}, then {outcome:?}");
        *ended = Some((outcome, self.now));
    }

    /// The earliest deadline: an import's, the grace's, or the end of a reset.
    fn next_due(&self) -> Option<Instant> {
        let slot = match &self.slot {
            Slot::Held { parked: Some((grace, _)), .. } => grace.poll_timeout(),
            Slot::Releasing { done_at } => Some(*done_at),
            _ => None,
        };
        self.imports.iter().filter_map(|import| import.wait.poll_timeout()).chain(slot).min()
    }

    /// Time passes; every deadline on the way is met at its instant.
    fn advance(&mut self, by: Duration) {
        let until = self.now + by;
        let mut rounds = 0;
        while let Some(due) = self.next_due().filter(|due| *due <= until) {
            rounds += 1;
            assert!(rounds < 10_000, "timers due at {due:?} never run out");
            self.now = self.now.max(due);
            self.run_timers();
        }
        self.now = until;
        self.check();
    }

    fn run_timers(&mut self) {
        let now = self.now;
        if let Slot::Held { parked: Some((grace, _)), .. } = &mut self.slot {
            grace.handle_timeout(now);
            if let Some(event) = grace.poll_event() {
                assert_eq!(event, ParkEvent::Expired { grace: GRACE });
                self.end_episode(Outcome::Expired);
                self.release();
            }
        }
        if matches!(self.slot, Slot::Releasing { done_at } if done_at <= now) {
            self.slot = Slot::Available;
            self.wake_waiting();
        }
        for id in 0..self.imports.len() {
            if self.imports[id].wait.poll_timeout().is_some_and(|due| due <= now) {
                self.imports[id].wait.handle_timeout(now);
                self.look(id);
            }
        }
    }

    /// What holds at every instant.
    fn check(&self) {
        let waiting: Vec<usize> = (0..self.imports.len()).filter(|id| self.imports[*id].answer.is_none()).collect();
        if matches!(self.slot, Slot::Available) {
            assert!(waiting.is_empty(), "imports {waiting:?} wait for a device that is free");
        }
        for id in waiting {
            let import = &self.imports[id];
            assert!(import.asked_at + import.bound > self.now, "import {id} left waiting past its deadline");
        }
    }

    /// After everything has settled: every import answered, every parked session ended once.
    fn check_settled(&self) {
        for (id, import) in self.imports.iter().enumerate() {
            assert!(import.answer.is_some(), "import {id} never answered");
        }
        for (number, episode) in self.episodes.iter().enumerate() {
            let Some((outcome, at)) = episode.outcome else { panic!("parked session {number} never ended") };
            if outcome == Outcome::Expired {
                assert_eq!(at, episode.lost_at + GRACE, "parked session {number} expired off its deadline");
            }
        }
    }

    fn holder(&self) -> Option<usize> {
        match self.slot {
            Slot::Held { owner, .. } => Some(owner),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The grace period, with a session of the pair harness parked

/// Time passes while the client is away, in random steps up to `by`: the
/// device completes URBs and the kernel submits more, until the session is
/// resumed or released.
fn away(server: &mut Server, pair: &mut Pair, by: Duration) {
    let until = server.now + by;
    while server.now < until && matches!(server.slot, Slot::Held { parked: Some(_), .. }) {
        let step = Duration::from_millis(1 + pair.rng.below(3000) as u64);
        server.advance(step.min(until - server.now));
        pair.device_completes();
        if pair.rng.chance(30) {
            pair.submit();
        }
    }
    server.advance(until - server.now);
}

/// A resumable pair that imported the device from `LAPTOP`, ran a while,
/// and lost its connection mid-traffic.
fn parked_pair(seed: u64, server: &mut Server) -> Pair {
    let mut pair = Pair::new(seed, true);
    let import = server.import(LAPTOP, RELEASE_WAIT);
    assert_eq!(server.answer(import).map(|(decision, _)| decision), Some(ImportDecision::Take));
    for _ in 0..pair.rng.below(300) {
        pair.step(false);
    }
    pair.drop_connection();
    server.connection_ends(true);
    pair
}

#[test]
fn a_client_back_just_before_the_grace_ends_resumes_with_nothing_lost() {
    for seed in 0..300 {
        let mut server = Server::new(Duration::from_millis(400));
        let mut pair = parked_pair(seed, &mut server);
        away(&mut server, &mut pair, GRACE - MS);
        assert_eq!(server.resume(LAPTOP), Ok(()), "seed {seed}");
        pair.reconnect();
        assert_eq!(server.episodes[0].outcome, Some((Outcome::Resumed, server.episodes[0].lost_at + GRACE - MS)));
        pair.finish();
        assert_eq!(server.holder(), Some(0), "still the laptop's");
        server.advance(2 * GRACE);
        server.check_settled();
    }
}

#[test]
fn a_client_back_at_or_after_the_end_of_the_grace_is_refused_and_the_device_released() {
    for seed in 0..300 {
        let mut server = Server::new(Duration::from_millis(400));
        let mut pair = parked_pair(seed, &mut server);
        let lost_at = server.now;
        // Meanwhile another host is refused at once: the device is held for the laptop.
        let desk = server.import(DESK, RELEASE_WAIT);
        assert_eq!(server.answer(desk), Some((ImportDecision::Busy(Busy::Held { holder: LAPTOP.address }), lost_at)));
        let refused = match seed % 3 {
            // The client and the end of the grace arrive at the same instant, the client first.
            0 => {
                away(&mut server, &mut pair, GRACE - MS);
                server.now += MS;
                server.resume(LAPTOP)
            }
            late => {
                away(&mut server, &mut pair, GRACE + MS * (7 * (late as u32 - 1)));
                server.resume(LAPTOP)
            }
        };
        assert!(
            matches!(refused, Err(ResumeError::Unknown | ResumeError::Grace(ResumeRefused::Expired { .. }))),
            "seed {seed}: {refused:?}"
        );
        assert_eq!(server.episodes[0].outcome, Some((Outcome::Expired, lost_at + GRACE)), "seed {seed}");
        // Released: the device is reset (what ran on it is dropped) and goes to the next importer.
        pair.device.running.clear();
        let desk = server.import(DESK, RELEASE_WAIT);
        server.advance(RELEASE_WAIT);
        let (decision, at) = server.answer(desk).expect("answered");
        assert_eq!(decision, ImportDecision::Take, "seed {seed}");
        assert!(at <= lost_at + GRACE + 400 * MS, "seed {seed}: got it {:?} after the grace", at - lost_at - GRACE);
        assert_eq!(server.resume(LAPTOP), Err(ResumeError::Unknown), "the old token names nothing now");
        server.check_settled();
    }
}

/// The new connection breaks before `OP_REP_RESUME` reaches the client: the
/// session is parked again, within the same grace, and a second try in time
/// still loses nothing; one after the first loss's grace is refused.
#[test]
fn a_resume_whose_answer_is_lost_waits_again_within_the_same_grace() {
    for (seed, in_time) in (0..200).map(|seed| (seed, seed % 2 == 0)) {
        let mut server = Server::new(Duration::from_millis(400));
        let mut pair = parked_pair(seed, &mut server);
        let lost_at = server.now;
        away(&mut server, &mut pair, GRACE / 2);
        {
            let Slot::Held { parked: Some((grace, _)), .. } = &mut server.slot else { panic!("not parked") };
            assert_eq!(grace.resume(server.now), Ok(()));
            // The server queued its replay; then the new connection broke.
            let received = pair.client.replies_received();
            pair.server.resume(received, bytes::BytesMut::new()).unwrap();
            pair.server.disconnected();
            grace.answer_lost();
            assert_eq!(grace.poll_timeout(), Some(lost_at + GRACE), "the grace counts from the first loss");
        }
        let back = if in_time { GRACE / 2 - MS } else { GRACE / 2 };
        away(&mut server, &mut pair, back);
        let resumed = server.resume(LAPTOP);
        if in_time {
            assert_eq!(resumed, Ok(()), "seed {seed}");
            pair.reconnect();
            pair.finish();
        } else {
            assert!(resumed.is_err(), "seed {seed}: {resumed:?}");
            assert_eq!(server.episodes[0].outcome, Some((Outcome::Expired, lost_at + GRACE)));
        }
        server.advance(2 * GRACE);
        server.check_settled();
    }
}

// ---------------------------------------------------------------------------------------
// An import racing the previous importer's teardown

/// The laptop holds the device, hangs up, and its task notices `noticed`
/// later; resetting the device takes `reset`. Another import asks right after
/// the hang-up. Returns that import's answer and how long it waited.
fn race_teardown(importer: Client, noticed: Duration, reset: Duration) -> (Server, ImportDecision, Duration) {
    let mut server = Server::new(reset);
    server.import(LAPTOP, Duration::ZERO);
    server.hang_up();
    let asked_at = server.now;
    let racing = server.import(importer, RELEASE_WAIT);
    assert_eq!(server.answer(racing), None, "waits for the teardown");
    server.advance(noticed);
    server.connection_ends(false);
    server.advance(RELEASE_WAIT + reset);
    let (decision, at) = server.answer(racing).expect("answered");
    server.check_settled();
    (server, decision, at - asked_at)
}

#[test]
fn an_import_racing_a_teardown_gets_the_device_when_the_teardown_ends_before_its_deadline() {
    for importer in [LAPTOP_AGAIN, DESK, TLS] {
        let (server, decision, waited) =
            race_teardown(importer, Duration::from_millis(300), Duration::from_millis(400));
        assert_eq!(decision, ImportDecision::Take, "{importer:?}");
        assert_eq!(waited, Duration::from_millis(700), "as soon as the reset is done");
        assert_eq!(server.holder(), Some(1));
    }
    // At the last instant.
    let (_, decision, waited) = race_teardown(DESK, Duration::from_secs(1), RELEASE_WAIT - Duration::from_secs(1));
    assert_eq!((decision, waited), (ImportDecision::Take, RELEASE_WAIT));
}

#[test]
fn an_import_racing_a_teardown_is_busy_when_the_teardown_ends_after_its_deadline() {
    for (noticed, reset) in [(Duration::from_millis(300), Duration::from_secs(6)), (Duration::from_secs(6), MS)] {
        let (mut server, decision, waited) = race_teardown(DESK, noticed, reset);
        assert_eq!(decision, ImportDecision::Busy(Busy::StillReleasing { waited: RELEASE_WAIT }));
        assert_eq!(waited, RELEASE_WAIT, "answered at its deadline, not later");
        // The refused import took nothing: the device is free for the next one once reset.
        assert_eq!(server.holder(), None);
        let next = server.import(DESK, RELEASE_WAIT);
        server.advance(RELEASE_WAIT);
        assert_eq!(server.answer(next).map(|(decision, _)| decision), Some(ImportDecision::Take));
    }
}

#[test]
fn a_live_holder_is_busy_at_once_for_another_host_and_after_the_wait_for_its_own() {
    let mut server = Server::new(MS);
    server.import(LAPTOP, Duration::ZERO);
    let asked_at = server.now;
    let desk = server.import(DESK, RELEASE_WAIT);
    assert_eq!(server.answer(desk), Some((ImportDecision::Busy(Busy::Held { holder: LAPTOP.address }), asked_at)));
    let again = server.import(LAPTOP_AGAIN, RELEASE_WAIT);
    server.advance(RELEASE_WAIT);
    assert_eq!(
        server.answer(again),
        Some((ImportDecision::Busy(Busy::Held { holder: LAPTOP.address }), asked_at + RELEASE_WAIT))
    );
    server.check_settled();
}

#[test]
fn the_client_of_a_parked_session_reclaims_the_device_and_others_are_refused() {
    for (holder, reclaimer) in [(LAPTOP, LAPTOP_AGAIN), (TLS, TLS_ROAMED)] {
        let mut server = Server::new(Duration::from_millis(400));
        server.import(holder, Duration::ZERO);
        server.connection_ends(true);
        for other in CLIENTS.into_iter().filter(|other| !holder.may_resume(other)) {
            let refused = server.import(other, RELEASE_WAIT);
            assert_eq!(
                server.answer(refused).map(|(decision, _)| decision),
                Some(ImportDecision::Busy(Busy::Held { holder: holder.address })),
                "{other:?}"
            );
        }
        let asked_at = server.now;
        let reclaim = server.import(reclaimer, RELEASE_WAIT);
        assert_eq!(server.episodes[0].outcome, Some((Outcome::Reclaimed, asked_at)));
        server.advance(RELEASE_WAIT);
        assert_eq!(server.answer(reclaim), Some((ImportDecision::Take, asked_at + Duration::from_millis(400))));
        server.check_settled();
    }
}

#[test]
fn withdrawing_the_device_answers_every_waiting_import() {
    let mut server = Server::new(Duration::from_secs(60));
    server.import(LAPTOP, Duration::ZERO);
    server.connection_ends(false);
    let waiting: Vec<usize> = [DESK, TLS].into_iter().map(|client| server.import(client, RELEASE_WAIT)).collect();
    server.advance(Duration::from_secs(1));
    server.withdraw();
    for id in waiting {
        assert_eq!(server.answer(id).map(|(decision, _)| decision), Some(ImportDecision::Withdrawn));
    }
    server.check_settled();
}

// ---------------------------------------------------------------------------------------
// Random schedules

#[derive(Clone, Debug)]
enum Op {
    Import { client: usize, bound: Duration },
    HangUp,
    ConnectionEnds { resumable: bool },
    Resume { client: usize },
    Withdraw,
    Advance(Duration),
}

fn op() -> impl Strategy<Value = Op> {
    let millis = |range: std::ops::Range<u64>| range.prop_map(Duration::from_millis);
    prop_oneof![
        8 => (0..CLIENTS.len(), prop_oneof![Just(Duration::ZERO), millis(0..6_000), Just(RELEASE_WAIT)])
            .prop_map(|(client, bound)| Op::Import { client, bound }),
        4 => Just(Op::HangUp),
        4 => any::<bool>().prop_map(|resumable| Op::ConnectionEnds { resumable }),
        4 => (0..CLIENTS.len()).prop_map(|client| Op::Resume { client }),
        1 => Just(Op::Withdraw),
        10 => prop_oneof![millis(0..1_000), millis(0..10_000), millis(29_000..31_000)].prop_map(Op::Advance),
    ]
}

/// What the schedules reached, so a run that never races or parks is noticed.
#[derive(Debug, Default)]
struct Reached {
    taken_after_waiting: usize,
    still_releasing: usize,
    held: usize,
    reclaimed: usize,
    resumed: usize,
    expired: usize,
}

fn run_schedule(reset: Duration, ops: &[Op], reached: &mut Reached) {
    let mut server = Server::new(reset);
    for op in ops {
        match *op {
            Op::Import { client, bound } => {
                server.import(CLIENTS[client], bound);
            }
            Op::HangUp => server.hang_up(),
            Op::ConnectionEnds { resumable } => server.connection_ends(resumable),
            Op::Resume { client } => {
                let _ = server.resume(CLIENTS[client]);
            }
            Op::Withdraw => server.withdraw(),
            Op::Advance(by) => server.advance(by),
        }
        server.advance(Duration::ZERO);
    }
    server.advance(GRACE + RELEASE_WAIT + reset + Duration::from_secs(10));
    server.check_settled();
    for import in &server.imports {
        match import.answer {
            Some((ImportDecision::Take, at)) if at > import.asked_at => reached.taken_after_waiting += 1,
            Some((ImportDecision::Busy(Busy::StillReleasing { .. }), _)) => reached.still_releasing += 1,
            Some((ImportDecision::Busy(Busy::Held { .. }), _)) => reached.held += 1,
            _ => {}
        }
    }
    for episode in &server.episodes {
        match episode.outcome {
            Some((Outcome::Reclaimed, _)) => reached.reclaimed += 1,
            Some((Outcome::Resumed, _)) => reached.resumed += 1,
            Some((Outcome::Expired, _)) => reached.expired += 1,
            _ => {}
        }
    }
}

/// Imports, hang-ups, teardowns, parked sessions, resumes, withdrawals and
/// time in random order: a device never has two owners, an import is answered
/// once and never after its deadline, a waiting import is never left waiting
/// for a free device, and a parked session ends once — resumed within its
/// grace, expired exactly at its end, or let go.
#[test]
fn random_schedules_keep_one_owner_one_answer_and_one_end() {
    let reached = RefCell::new(Reached::default());
    let schedule = (
        prop_oneof![Just(Duration::ZERO), (0..2_000u64).prop_map(Duration::from_millis)],
        prop::collection::vec(op(), 1..80),
    );
    let mut runner = TestRunner::new(Config { cases: 1000, ..Config::default() });
    let result = runner.run(&schedule, |(reset, ops)| {
        run_schedule(reset, &ops, &mut reached.borrow_mut());
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
    let reached = reached.into_inner();
    let all = [
        reached.taken_after_waiting,
        reached.still_releasing,
        reached.held,
        reached.reclaimed,
        reached.resumed,
        reached.expired,
    ];
    assert!(all.iter().all(|count| *count >= 10), "the schedules reached too little: {reached:?}");
}
