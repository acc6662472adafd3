//! The pair harness: a [`ClientSession`] and a [`ServerSession`] joined by a
//! scripted network, with a model device behind the server, driven by seeded
//! random schedules. The network hands bytes over in random pieces and, for
//! resumable sessions, cuts the connection at random points — mid-header,
//! mid-payload, between a RET_SUBMIT and its RET_UNLINK — losing whatever was
//! in transit; both sides then resume.
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

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use usbwire_proto::client_session::{ClientSession, ClientSessionError, Event};
use usbwire_proto::liveness::{BUSY_SILENCE, IDLE_SILENCE, TICK};
use usbwire_proto::server_session::{DeviceCall, ServerSession, SessionError};
use usbwire_proto::urb::{CmdSubmit, CmdUnlink, RetSubmit, TransferFlags};
use usbwire_proto::{Budget, Direction, Limits, Status};

const DEVID: u32 = 0x0002_0003;

/// xorshift64*: deterministic per seed, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// The bytes a URB carries: OUT data the client sends, IN data the device returns.
fn pattern(seqnum: u32, len: usize) -> Bytes {
    (0..len).map(|i| (seqnum as usize * 31 + i) as u8).collect::<Vec<u8>>().into()
}

/// What the device does: runs URBs, completes them in any order, cancels on request.
#[derive(Default)]
struct ModelDevice {
    running: Vec<CmdSubmit>,
    /// Seqnums in the order the device was given them.
    submitted: Vec<u32>,
}

impl ModelDevice {
    fn call(&mut self, call: DeviceCall, cancelled: &mut VecDeque<RetSubmit>) {
        match call {
            DeviceCall::Submit(submit) => {
                if submit.direction == Direction::Out {
                    assert_eq!(submit.data, pattern(submit.seqnum, submit.transfer_buffer_length as usize));
                }
                self.submitted.push(submit.seqnum);
                self.running.push(submit);
            }
            DeviceCall::Cancel { seqnum } => {
                if let Some(at) = self.running.iter().position(|urb| urb.seqnum == seqnum) {
                    let urb = self.running.remove(at);
                    cancelled.push_back(ret(&urb, Status::ECONNRESET, Bytes::new()));
                }
            }
        }
    }

    fn complete(&mut self, at: usize) -> RetSubmit {
        let urb = self.running.remove(at);
        let data = match urb.direction {
            Direction::In => pattern(urb.seqnum, (urb.seqnum as usize * 7) % (urb.transfer_buffer_length as usize + 1)),
            Direction::Out => Bytes::new(),
        };
        let mut done = ret(&urb, Status::OK, data);
        if urb.direction == Direction::Out {
            done.actual_length = urb.transfer_buffer_length;
        }
        done
    }
}

fn ret(urb: &CmdSubmit, status: Status, data: Bytes) -> RetSubmit {
    RetSubmit {
        seqnum: urb.seqnum,
        status,
        actual_length: data.len() as u32,
        start_frame: 0,
        number_of_packets: 0,
        error_count: 0,
        data,
        iso_packets: vec![],
    }
}

/// What the client has seen of each seqnum.
#[derive(Default)]
struct Ledger {
    /// Submit seqnum -> (direction, length).
    submits: HashMap<u32, (Direction, u32)>,
    /// Unlink seqnum -> target.
    unlinks: HashMap<u32, u32>,
    /// Submits answered (completed or cancelled), with how.
    answered: HashMap<u32, Status>,
    unlinks_answered: HashMap<u32, Status>,
}

struct Pair {
    rng: Rng,
    client: ClientSession<u32>,
    server: ServerSession,
    device: ModelDevice,
    /// Completions the device produced that the server has not taken yet.
    device_done: VecDeque<RetSubmit>,
    c2s: VecDeque<u8>,
    s2c: VecDeque<u8>,
    next_seqnum: u32,
    ledger: Ledger,
    cuts: usize,
    /// The virtual clock of keep-alive schedules.
    now: Instant,
}

impl Pair {
    fn new(seed: u64, resumable: bool) -> Self {
        let mut rng = Rng::new(seed);
        let budget = if rng.chance(50) {
            Budget {
                in_flight_urbs: 4,
                in_flight_bytes: 6000,
                queued_reply_bytes: 4096,
                unacked_reply_bytes: 9000,
                ..Budget::default()
            }
        } else {
            Budget::default()
        };
        let mut client = ClientSession::new(DEVID, BytesMut::new(), Limits::default(), budget.clone());
        let mut server = ServerSession::new(DEVID, BytesMut::new(), Limits::default(), budget);
        if resumable {
            client = client.resumable();
            server = server.resumable();
        }
        Self {
            rng,
            client,
            server,
            device: ModelDevice::default(),
            device_done: VecDeque::new(),
            c2s: VecDeque::new(),
            s2c: VecDeque::new(),
            next_seqnum: 1,
            ledger: Ledger::default(),
            cuts: 0,
            now: Instant::now(),
        }
    }

    /// A resumable pair with keep-alive on both sides.
    fn with_keepalive(seed: u64) -> Self {
        let mut pair = Self::new(seed, true);
        let now = pair.now;
        let budget = Budget::default();
        pair.client =
            ClientSession::new(DEVID, BytesMut::new(), Limits::default(), budget.clone()).resumable().keepalive(now);
        pair.server = ServerSession::new(DEVID, BytesMut::new(), Limits::default(), budget).resumable().keepalive(now);
        pair
    }

    /// Time passes; both sides' timers run at every deadline on the way.
    fn advance(&mut self, by: Duration) -> Result<(), Silence> {
        let until = self.now + by;
        loop {
            let next = [self.client.poll_timeout(), self.server.poll_timeout()].into_iter().flatten().min();
            match next {
                Some(at) if at <= until => {
                    self.now = self.now.max(at);
                    self.client.handle_timeout(self.now, true).map_err(Silence::Client)?;
                    self.server.handle_timeout(self.now).map_err(Silence::Server)?;
                }
                _ => break,
            }
        }
        self.now = until;
        Ok(())
    }

    /// Runs to the end, delivers the last acknowledgement, checks the ledger.
    fn finish(&mut self) {
        self.drain();
        self.client_writes(usize::MAX);
        self.deliver_to_server(usize::MAX);
        self.check();
    }

    /// A live network: everything written arrives.
    fn exchange(&mut self) {
        self.client_writes(usize::MAX);
        self.deliver_to_server(usize::MAX);
        self.server_writes(usize::MAX);
        self.deliver_to_client(usize::MAX);
    }

    fn submit(&mut self) {
        if !self.client.wants_commands() {
            return;
        }
        let seqnum = self.next_seqnum;
        self.next_seqnum += 1;
        let direction = if self.rng.chance(50) { Direction::In } else { Direction::Out };
        let length = [0, 8, 512, 3000][self.rng.below(4)];
        let submit = CmdSubmit {
            seqnum,
            devid: DEVID,
            direction,
            ep: 1 + self.rng.below(3) as u8,
            transfer_flags: TransferFlags::default(),
            transfer_buffer_length: length,
            start_frame: 0,
            number_of_packets: 0,
            interval: 0,
            setup: [0; 8],
            data: if direction == Direction::Out { pattern(seqnum, length as usize) } else { Bytes::new() },
            iso_packets: vec![],
        };
        self.ledger.submits.insert(seqnum, (direction, length));
        self.client.submit(submit, seqnum).unwrap();
    }

    /// Unlinks an open submit, once at most (vhci never unlinks a URB twice; the
    /// kernel stub, and so the server, would answer only the second).
    fn unlink(&mut self) {
        let unlinked: Vec<u32> = self.ledger.unlinks.values().copied().collect();
        let mut open: Vec<u32> = self
            .ledger
            .submits
            .keys()
            .filter(|s| !self.ledger.answered.contains_key(s) && !unlinked.contains(s))
            .copied()
            .collect();
        open.sort_unstable();
        if open.is_empty() || !self.client.wants_commands() {
            return;
        }
        let target = open[self.rng.below(open.len())];
        let seqnum = self.next_seqnum;
        self.next_seqnum += 1;
        self.ledger.unlinks.insert(seqnum, target);
        self.client.unlink(CmdUnlink { seqnum, devid: DEVID, unlink_seqnum: target }).unwrap();
    }

    /// Moves up to `max` bytes from an outbox into the network.
    fn write(outbox: &mut usbwire_proto::Outbox, wire: &mut VecDeque<u8>, max: usize) {
        let mut took = 0;
        for slice in outbox.slices(8) {
            let n = slice.len().min(max - took);
            wire.extend(&slice[..n]);
            took += n;
            if took == max {
                break;
            }
        }
        outbox.advance(took);
    }

    fn client_writes(&mut self, max: usize) {
        if self.client.is_connected() {
            // A driver acknowledges when it has nothing else to write.
            if self.client.outbox().is_empty() {
                self.client.acknowledge();
            }
            Self::write(self.client.outbox(), &mut self.c2s, max);
        }
    }

    fn server_writes(&mut self, max: usize) {
        if self.server.is_connected() {
            Self::write(self.server.outbox(), &mut self.s2c, max);
        }
    }

    fn deliver_to_server(&mut self, max: usize) {
        let n = max.min(self.c2s.len());
        if self.server.wants_input() && n > 0 {
            let bytes: Vec<u8> = self.c2s.drain(..n).collect();
            self.server.input(|_, _| false).unwrap().extend_from_slice(&bytes);
        }
        self.server.handle_input(|_, _| false).unwrap();
        while let Some(call) = self.server.poll_device_call() {
            self.device.call(call, &mut self.device_done);
        }
    }

    fn deliver_to_client(&mut self, max: usize) {
        let n = max.min(self.s2c.len());
        let bytes: Vec<u8> = self.s2c.drain(..n).collect();
        self.client.input().extend_from_slice(&bytes);
        self.client.handle_input().unwrap();
        while let Some(event) = self.client.poll_event() {
            self.record(event);
        }
    }

    fn record(&mut self, event: Event<u32>) {
        let ledger = &mut self.ledger;
        match event {
            Event::Completed { reply, tag } => {
                assert_eq!(tag, reply.seqnum);
                let (direction, length) = ledger.submits[&reply.seqnum];
                if direction == Direction::In {
                    assert_eq!(reply.data, pattern(reply.seqnum, (reply.seqnum as usize * 7) % (length as usize + 1)));
                }
                assert!(
                    ledger.answered.insert(reply.seqnum, reply.status).is_none(),
                    "{} answered twice",
                    reply.seqnum
                );
            }
            Event::Unlinked { reply, target, cancelled } => {
                assert_eq!(ledger.unlinks[&reply.seqnum], target);
                assert!(ledger.unlinks_answered.insert(reply.seqnum, reply.status).is_none(), "unlink answered twice");
                match cancelled {
                    Some((cancelled, tag)) => {
                        assert_eq!((cancelled, tag), (target, target));
                        assert_eq!(reply.status, Status::ECONNRESET);
                        assert!(
                            ledger.answered.insert(target, Status::ECONNRESET).is_none(),
                            "{target} answered twice"
                        );
                    }
                    None => {
                        assert_eq!(reply.status, Status::OK);
                        assert!(ledger.answered.contains_key(&target), "RET_UNLINK(0) before its target's RET_SUBMIT");
                    }
                }
            }
        }
    }

    fn device_completes(&mut self) {
        if !self.device.running.is_empty() && self.rng.chance(70) {
            let at = self.rng.below(self.device.running.len());
            let done = self.device.complete(at);
            self.device_done.push_back(done);
        }
        while self.server.wants_completions() {
            let Some(done) = self.device_done.pop_front() else { break };
            self.server.complete(done);
        }
    }

    /// The connection drops: part of what was in transit arrives, the rest is lost.
    fn cut(&mut self) {
        let partial = self.rng.below(self.c2s.len() + 1);
        self.deliver_to_server(partial);
        let partial = self.rng.below(self.s2c.len() + 1);
        self.deliver_to_client(partial);
        self.c2s.clear();
        self.s2c.clear();
        self.client.disconnected();
        self.server.disconnected();
        self.cuts += 1;
        // Life goes on during the outage: the device completes, the client submits.
        for _ in 0..self.rng.below(4) {
            self.device_completes();
            self.submit();
        }
        let received = self.client.replies_received();
        let commands = self.server.resume(received, BytesMut::new()).unwrap();
        self.client.resumed(commands, BytesMut::new()).unwrap();
    }

    fn step(&mut self, cuts: bool) {
        let max = [1, 7, 48, 100, 4096][self.rng.below(5)];
        match self.rng.below(12) {
            0..=2 => self.submit(),
            3 => self.unlink(),
            4 | 5 => self.client_writes(max),
            6 | 7 => self.deliver_to_server(max),
            8 => self.device_completes(),
            9 => self.server_writes(max),
            10 => self.deliver_to_client(max),
            _ if cuts && self.rng.chance(10) => self.cut(),
            _ => {}
        }
    }

    /// Runs everything to the end: no new commands, every URB completes.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            if self.client.outstanding() == 0 && self.server.is_idle() {
                return;
            }
            self.client_writes(usize::MAX);
            self.deliver_to_server(usize::MAX);
            while !self.device.running.is_empty() {
                let done = self.device.complete(0);
                self.device_done.push_back(done);
            }
            while self.server.wants_completions() {
                let Some(done) = self.device_done.pop_front() else { break };
                self.server.complete(done);
            }
            self.server_writes(usize::MAX);
            self.deliver_to_client(usize::MAX);
        }
        let open: Vec<_> = self.ledger.submits.keys().filter(|s| !self.ledger.answered.contains_key(s)).collect();
        let unlinks: Vec<_> =
            self.ledger.unlinks.iter().filter(|(s, _)| !self.ledger.unlinks_answered.contains_key(s)).collect();
        panic!(
            "no progress: {} outstanding: submits {open:?}, unlinks {unlinks:?}; device got {:?}; server idle {}, in c2s {}",
            self.client.outstanding(),
            self.device.submitted,
            self.server.is_idle(),
            self.c2s.len()
        );
    }

    fn check(&self) {
        let ledger = &self.ledger;
        for seqnum in ledger.submits.keys() {
            assert!(ledger.answered.contains_key(seqnum), "submit {seqnum} never answered");
            let runs = self.device.submitted.iter().filter(|s| *s == seqnum).count();
            assert_eq!(runs, 1, "submit {seqnum} reached the device {runs} times");
        }
        for seqnum in ledger.unlinks.keys() {
            assert!(ledger.unlinks_answered.contains_key(seqnum), "unlink {seqnum} never answered");
        }
        assert!(self.device.submitted.windows(2).all(|w| w[0] < w[1]), "device saw URBs out of order");
        assert_eq!(self.server.replies().map_or(0, |(_, held)| held), 0, "replies still held after the last ack");
    }
}

/// Which side called the link dead.
#[derive(Debug)]
enum Silence {
    Client(ClientSessionError),
    Server(SessionError),
}

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
        pair.client = ClientSession::new(DEVID, BytesMut::new(), Limits::default(), client_budget);
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
    ClientSession::new(DEVID, BytesMut::new(), Limits::default(), Budget::default())
}

fn placeholder_server() -> ServerSession {
    ServerSession::new(DEVID, BytesMut::new(), Limits::default(), Budget::default())
}
