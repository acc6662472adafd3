//! The pair harness: a [`ClientSession`] and a [`ServerSession`] joined by a
//! scripted network, with a model device behind the server, driven by seeded
//! random schedules. The network hands bytes over in random pieces and, for
//! resumable sessions, cuts the connection at random points — mid-header,
//! mid-payload, between a RET_SUBMIT and its RET_UNLINK — losing whatever was
//! in transit; both sides then resume ([`Pair::cut`], or
//! [`Pair::drop_connection`] and later [`Pair::reconnect`] when the outage
//! itself is under test).
//!
//! Keep-alive schedules add a virtual clock ([`Pair::now`], [`Pair::advance`]):
//! time passes in steps and both sides' timers run.
//!
//! [`Pair::check`] verifies the ledger: every URB the client submitted
//! reached the device exactly once, in the order submitted; every submit was
//! answered exactly once (completed with the right data, or cancelled by an
//! unlink); every unlink was answered exactly once, a `RET_UNLINK(0)` only
//! after its target's RET_SUBMIT; and nothing is left outstanding or held.
//!
//! Shared by the test files that `mod pair;` it; each uses part of it.
#![allow(dead_code)] // each test file that includes the harness uses only part of it

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use usbwire_proto::client_session::{ClientSession, ClientSessionError, Event, READ_CHUNK};
use usbwire_proto::server_session::{DeviceCall, ServerSession, SessionError};
use usbwire_proto::urb::{CmdSubmit, CmdUnlink, RetSubmit, TransferFlags};
use usbwire_proto::{Budget, Direction, Limits, RecvBuffer, Status};

pub(crate) const DEVID: u32 = 0x0002_0003;

/// xorshift64*: deterministic per seed, no dependency.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// The bytes a URB carries: OUT data the client sends, IN data the device returns.
pub(crate) fn pattern(seqnum: u32, len: usize) -> Bytes {
    (0..len).map(|i| (seqnum as usize * 31 + i) as u8).collect::<Vec<u8>>().into()
}

/// What the device does: runs URBs, completes them in any order, cancels on request.
#[derive(Default)]
pub(crate) struct ModelDevice {
    pub(crate) running: Vec<CmdSubmit>,
    /// Seqnums in the order the device was given them.
    pub(crate) submitted: Vec<u32>,
}

impl ModelDevice {
    pub(crate) fn call(&mut self, call: DeviceCall, cancelled: &mut VecDeque<RetSubmit>) {
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

    pub(crate) fn complete(&mut self, at: usize) -> RetSubmit {
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

pub(crate) fn ret(urb: &CmdSubmit, status: Status, data: Bytes) -> RetSubmit {
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
pub(crate) struct Ledger {
    /// Submit seqnum -> (direction, length).
    pub(crate) submits: HashMap<u32, (Direction, u32)>,
    /// Unlink seqnum -> target.
    pub(crate) unlinks: HashMap<u32, u32>,
    /// Submits answered (completed or cancelled), with how.
    pub(crate) answered: HashMap<u32, Status>,
    pub(crate) unlinks_answered: HashMap<u32, Status>,
}

pub(crate) struct Pair {
    pub(crate) rng: Rng,
    pub(crate) client: ClientSession<u32>,
    /// The client driver's read buffer: the server's bytes not decoded yet.
    pub(crate) client_input: RecvBuffer,
    pub(crate) server: ServerSession,
    pub(crate) device: ModelDevice,
    /// Completions the device produced that the server has not taken yet.
    pub(crate) device_done: VecDeque<RetSubmit>,
    pub(crate) c2s: VecDeque<u8>,
    pub(crate) s2c: VecDeque<u8>,
    pub(crate) next_seqnum: u32,
    pub(crate) ledger: Ledger,
    pub(crate) cuts: usize,
    /// The virtual clock of keep-alive schedules.
    pub(crate) now: Instant,
}

impl Pair {
    pub(crate) fn new(seed: u64, resumable: bool) -> Self {
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
        let mut client = ClientSession::new(DEVID, Limits::default(), budget.clone());
        let mut server = ServerSession::new(DEVID, BytesMut::new(), Limits::default(), budget);
        if resumable {
            client = client.resumable();
            server = server.resumable();
        }
        Self {
            rng,
            client,
            client_input: RecvBuffer::with_capacity(READ_CHUNK),
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
    pub(crate) fn with_keepalive(seed: u64) -> Self {
        let mut pair = Self::new(seed, true);
        let now = pair.now;
        let budget = Budget::default();
        pair.client = ClientSession::new(DEVID, Limits::default(), budget.clone()).resumable().keepalive(now);
        pair.server = ServerSession::new(DEVID, BytesMut::new(), Limits::default(), budget).resumable().keepalive(now);
        pair
    }

    /// Time passes; both sides' timers run at every deadline on the way.
    pub(crate) fn advance(&mut self, by: Duration) -> Result<(), Silence> {
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
    pub(crate) fn finish(&mut self) {
        self.drain();
        self.client_writes(usize::MAX);
        self.deliver_to_server(usize::MAX);
        self.check();
    }

    /// A live network: everything written arrives.
    pub(crate) fn exchange(&mut self) {
        self.client_writes(usize::MAX);
        self.deliver_to_server(usize::MAX);
        self.server_writes(usize::MAX);
        self.deliver_to_client(usize::MAX);
    }

    pub(crate) fn submit(&mut self) {
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
    pub(crate) fn unlink(&mut self) {
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

    pub(crate) fn client_writes(&mut self, max: usize) {
        if self.client.is_connected() {
            // A driver acknowledges when it has nothing else to write.
            if self.client.outbox().is_empty() {
                self.client.acknowledge();
            }
            Self::write(self.client.outbox(), &mut self.c2s, max);
        }
    }

    pub(crate) fn server_writes(&mut self, max: usize) {
        if self.server.is_connected() {
            Self::write(self.server.outbox(), &mut self.s2c, max);
        }
    }

    pub(crate) fn deliver_to_server(&mut self, max: usize) {
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

    pub(crate) fn deliver_to_client(&mut self, max: usize) {
        let n = max.min(self.s2c.len());
        let bytes: Vec<u8> = self.s2c.drain(..n).collect();
        self.client_input.extend_from_slice(&bytes);
        let mut events = Vec::new();
        self.client.handle_input(&mut self.client_input, |event| events.push(event)).unwrap();
        for event in events {
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

    pub(crate) fn device_completes(&mut self) {
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

    /// The connection drops and the session is resumed on a new one.
    pub(crate) fn cut(&mut self) {
        self.drop_connection();
        self.reconnect();
    }

    /// The connection drops: part of what was in transit arrives, the rest is
    /// lost. Life goes on during the outage: the device completes, the client
    /// submits.
    pub(crate) fn drop_connection(&mut self) {
        let partial = self.rng.below(self.c2s.len() + 1);
        self.deliver_to_server(partial);
        let partial = self.rng.below(self.s2c.len() + 1);
        self.deliver_to_client(partial);
        self.c2s.clear();
        self.s2c.clear();
        self.client.disconnected();
        self.client_input.clear();
        self.server.disconnected();
        self.cuts += 1;
        for _ in 0..self.rng.below(4) {
            self.device_completes();
            self.submit();
        }
    }

    /// The client resumes the session on a new connection: each side learns
    /// what the other has.
    pub(crate) fn reconnect(&mut self) {
        let received = self.client.replies_received();
        let commands = self.server.resume(received, BytesMut::new()).unwrap();
        self.client.resumed(commands).unwrap();
    }

    pub(crate) fn step(&mut self, cuts: bool) {
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
    pub(crate) fn drain(&mut self) {
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

    pub(crate) fn check(&self) {
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
pub(crate) enum Silence {
    Client(ClientSessionError),
    Server(SessionError),
}
