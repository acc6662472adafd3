//! The `redir_bridge` harness: the usbredir bridge's whole session, a hostile
//! QEMU (usbredir guest) on one side and a hostile USB/IP server on the
//! other, interleaved as the input says, with the budgets checked after
//! every step.
//!
//! The path is the product's: guest bytes → [`BridgeCore`] (the bridge's
//! sans-I/O core, with its `UsbHost`) → `TransferQueue` → the connection's
//! `ClientSession` (encoded into under its lock, within its budget) → USB/IP
//! bytes, and back, over a
//! [`DrivenConnection`] (the relay's parts, stepped here instead of by a
//! task). Each turn does what one pass of the shell's loop
//! (`usbwire_client::redir`) does, with the same decisions from the core:
//! read the guest only when it [reads_guest](BridgeCore::reads_guest),
//! collect completions only when it
//! [collects](BridgeCore::collects_completions); the guest's socket (bytes
//! written and not read) and the server ([`ModelServer`]) are the
//! harness's. A virtual clock drives keep-alive and the shell's liveness tick.
//!
//! Input: `[caps, budget, flags] ++ ops`. `caps`: the guest's capabilities;
//! `budget`: small in-flight and reply limits (so a few ops reach them);
//! `flags`: bit 0 a resumable session with keep-alive, bits 1–3 the read
//! size, bit 4 no automatic enumeration (the input answers the descriptor
//! reads itself), bit 5 a guest that reads everything after each op, bit 6
//! a server that answers everything in order after each op, bit 7 a bridge
//! that follows its device through re-enumerations. Then ops (see
//! [`Op`]): guest bytes (raw, or a packet built from a few input bytes),
//! server answers (of the command it picks, as it picks) or raw bytes, the
//! guest reading, time passing, either side going away, the server
//! stopping or resuming reading; with bit 7 also the device re-enumerating
//! (END `REENUMERATED` from a resumable server, the connection just ending
//! from a stock one) and coming back (the shell's new import of the bus id,
//! which [`BridgeCore::replace_device`] moves the bridge onto).
//!
//! Invariants, after every step: no panic; a bridge past its budget (URBs or
//! bytes in flight, bytes waiting for the guest) reports it reads no more and
//! collects no more; the URBs it holds never exceed the budget by more than
//! one read of the guest adds; the connection accepts no more than its
//! budget and the session holds no more than it accepted; every URB
//! submitted is collected once (the queue's pending count equals the
//! bridge's URBs in flight, which equal the core's); the heap held stays
//! under a bound derived from the budget; everything sent to the guest
//! decodes as usbredir, everything sent to the server as USB/IP with fresh
//! seqnums. When the device comes back: nothing of the old import is held
//! (its connection accepted nothing more, the bridge has no URB in flight
//! and its new queue none pending). At the end: once the session is over
//! and the connection gone, nothing is held.

use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use usbwire_client::redir::{BridgeCore, BridgeError, Ended};
use usbwire_client::DrivenConnection;
use usbwire_proto::{resume, Budget, Limits, Speed};
use usbwire_redir::{Caps, Codec, Packet, Side, UsbHost, MAX_PACKET_LEN};

use crate::model_server::ModelServer;

mod input;

use self::input::{Input, Op};

/// The guest's socket buffer: a guest writing past it blocks (its bytes wait in QEMU).
const GUEST_SOCKET: usize = 256 * 1024;
/// The shell's liveness tick (`usbwire_client::redir`).
const LIVENESS_TICK: Duration = Duration::from_secs(1);
/// Turns without progress before a step counts as settled; a step that never
/// settles is a busy loop.
const MAX_TURNS: usize = 10_000;
/// The most URBs one guest packet makes the core submit (an isochronous
/// stream start asks for `no_urbs`, a byte).
const URBS_PER_PACKET: usize = 256;
/// The smallest usbredir packet (a header without a type header).
const MIN_PACKET: usize = 12;

/// Answers a server that answers everything gives after each op.
const AUTO_ANSWERS: usize = 64;
/// Read sizes the bridge's reads of the guest socket are cut to.
const READ_SIZES: [usize; 8] = [1, 7, 64, 512, 4096, 65536, 16, 300];

/// How a session ended.
#[derive(Debug)]
enum Over {
    Ended(Ended),
    Failed(String),
}

/// The budget the harness's bridge and connection keep to: small limits, so
/// a few ops fill them.
fn budget_from(byte: u8) -> Budget {
    const BYTES: [usize; 4] = [512, 4096, 64 * 1024, 1 << 20];
    Budget {
        in_flight_urbs: [1, 2, 4, 16][usize::from(byte & 3)],
        in_flight_bytes: BYTES[usize::from(byte >> 2 & 3)],
        queued_reply_bytes: [256, 4096, 64 * 1024, 1 << 20][usize::from(byte >> 4 & 3)],
        ..Budget::default()
    }
}

/// The heap the session (bridge, connection, and the harness's own buffers
/// for the guest's socket and the server) may hold above where it started.
fn memory_bound(budget: &Budget) -> usize {
    2 * (budget.in_flight_bytes.max(crate::model_server::MAX_IN) + budget.queued_reply_bytes)
        + 4 * GUEST_SOCKET
        + ONE_READ_URBS
        + (2 << 20)
}

/// What the URBs one read of the guest adds past the budget may hold (not
/// their data, which waits for room): the model device's two isochronous
/// endpoints each started with 255 URBs of 255 packets, each packet kept as a
/// length by the core, a descriptor in the queue's transfer and one on the wire.
const ONE_READ_URBS: usize = 2 * 255 * 255 * (4 + 2 * 16 + 12);

/// One session between a guest, the bridge and the server.
struct Session {
    core: Option<BridgeCore>,
    connection: DrivenConnection,
    server: ModelServer,
    /// The guest's end: what it wrote and the bridge has not read, and its codec.
    guest_socket: BytesMut,
    guest: Codec,
    /// What the guest read and has not decoded (a partial packet).
    guest_received: BytesMut,
    guest_hung_up: bool,
    /// The shell's read buffer.
    inbuf: BytesMut,
    read_size: usize,
    server_reads: bool,
    start: Instant,
    now: Instant,
    over: Option<Over>,
    /// The most URBs one read of the guest added to those in flight.
    most_per_read: usize,
    heap_before: Option<usize>,
    /// The bridge follows its device (flags bit 7), and the session is resumable (bit 0).
    follows: bool,
    resumable: bool,
    /// Following: the device went away and is not imported again yet.
    away: bool,
}

/// The imported device's devid (the same port after a re-enumeration).
const DEVID: u32 = 0x0001_0002;

pub fn redir_bridge(data: &[u8]) {
    let Some((&[caps, budget, flags], ops)) = crate::split_control::<3>(data) else { return };
    let budget = budget_from(budget);
    let heap_before = crate::session::live_bytes();
    let start = Instant::now();
    let mut connection = DrivenConnection::new(DEVID, budget.clone());
    if flags & 1 != 0 {
        connection = connection.resumable_with_keepalive(start);
    }
    let core = BridgeCore::new(UsbHost::new("usbwire fuzz", Speed::HIGH), connection.queue(), budget);
    let guest = Codec::new(Side::Guest, Caps(u32::from(caps)), MAX_PACKET_LEN);
    let mut session = Session {
        core: Some(core),
        connection,
        server: ModelServer::default(),
        guest_socket: BytesMut::new(),
        guest,
        guest_received: BytesMut::new(),
        guest_hung_up: false,
        inbuf: BytesMut::new(),
        read_size: READ_SIZES[usize::from(flags >> 1 & 7)],
        server_reads: true,
        start,
        now: start,
        over: None,
        most_per_read: 0,
        heap_before,
        follows: flags & 0x80 != 0,
        resumable: flags & 1 != 0,
        away: false,
    };
    let hello = session.guest.hello("fuzz");
    session.guest_writes(0, &hello);
    if flags & 0x10 == 0 {
        session.enumerate();
    }
    let mut input = Input(ops);
    while session.over.is_none() {
        let Some(op) = input.op(session.follows) else { break };
        session.step(op);
        if flags & 0x20 != 0 {
            session.step(Op::GuestReads(0));
        }
        if flags & 0x40 != 0 {
            // Streams resubmit as they complete: a bounded number of answers per op.
            for _ in 0..AUTO_ANSWERS {
                if !session.server.answer(0, 3) {
                    break;
                }
                session.turn();
            }
        }
    }
    session.tear_down();
}

impl Session {
    /// Answers every command with what the model device has until the core
    /// has announced the device (or gives up), then the guest reads.
    fn enumerate(&mut self) {
        for _ in 0..16 {
            self.turn();
            if self.core.as_ref().is_none_or(|core| core.host().is_announced()) {
                break;
            }
            while self.server.answer(0, 3) {}
        }
        self.step(Op::GuestReads(0));
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::GuestRaw(bytes) => {
                if self.guest_socket.len() + bytes.len() <= GUEST_SOCKET && !self.guest_hung_up {
                    self.guest_socket.extend_from_slice(&bytes);
                }
            }
            Op::GuestPacket(id, packet) => self.guest_writes(id, &packet),
            Op::ServerAnswers { pick, how } => {
                self.server.answer(pick, how);
            }
            Op::ServerRaw(bytes) => self.server.to_client.extend_from_slice(&bytes),
            Op::GuestReads(amount) => self.guest_reads(amount),
            Op::TimePasses(elapsed) => self.time_passes(elapsed),
            Op::ServerGone => self.connection.end(),
            Op::GuestHangsUp => self.guest_hung_up = true,
            Op::ServerReading(reads) => self.server_reads = reads,
            Op::Reenumerates => self.reenumerates(),
            Op::ImportedAgain => self.imported_again(),
        }
        self.turn();
    }

    /// The device re-enumerates: a resumable session's server says so (END
    /// `REENUMERATED`, after what it already sent), a stock one just closes.
    fn reenumerates(&mut self) {
        if self.connection.is_closed() {
            return;
        }
        if self.resumable {
            let end = resume::end_header_for(DEVID, resume::EndReason::REENUMERATED);
            self.server.to_client.extend_from_slice(&end);
        } else {
            self.connection.end();
        }
    }

    /// The shell's new import of the same bus id, once the bridge noticed
    /// the device went: a new connection (and server), the bridge moved onto
    /// it, the new device enumerated as far as the ops let it.
    fn imported_again(&mut self) {
        if !self.away || self.over.is_some() {
            return;
        }
        let Some(core) = self.core.as_mut() else { return };
        assert_eq!(self.connection.accepted(), (0, 0), "the old connection still holds commands");
        let budget = self.connection.budget().clone();
        let mut connection = DrivenConnection::new(DEVID, budget);
        if self.resumable {
            connection = connection.resumable_with_keepalive(self.now);
        }
        core.replace_device(Speed::FULL, connection.queue());
        assert_eq!(core.in_flight(), (0, 0), "URBs of the old device carried over");
        assert_eq!(core.pending(), 0, "the new queue starts with the old device's URBs");
        self.connection = connection;
        self.server = ModelServer::default();
        self.away = false;
        self.enumerate();
    }

    /// A guest packet onto the guest's socket (one a guest cannot encode is not sent).
    fn guest_writes(&mut self, id: u64, packet: &Packet) {
        let mut wire = BytesMut::new();
        if self.guest.encode(id, packet, &mut wire).is_ok() {
            self.step(Op::GuestRaw(wire.to_vec()));
        }
    }

    /// The guest reads (and decodes) up to `amount` bytes of what the bridge sent.
    fn guest_reads(&mut self, amount: usize) {
        let Some(core) = self.core.as_mut() else { return };
        let to_guest = core.to_guest();
        let amount = if amount == 0 { to_guest.len() } else { amount.min(to_guest.len()) };
        let mut read = to_guest.split_to(amount);
        self.guest_decodes(&mut read);
    }

    /// Every whole packet in what the guest read must be valid usbredir.
    fn guest_decodes(&mut self, read: &mut BytesMut) {
        self.guest_received.extend_from_slice(read);
        while let Some(_packet) =
            self.guest.decode(&mut self.guest_received).expect("the bridge sent the guest a malformed packet")
        {}
    }

    /// Passes of the bridge and the relay until nothing moves, checking the
    /// invariants after each.
    fn turn(&mut self) {
        // Reading the guest's socket a few bytes at a time takes a pass per read.
        let reads = self.guest_socket.len() / self.read_size + 1;
        for _ in 0..MAX_TURNS + reads {
            let moved = self.bridge_pass() | self.relay_pass();
            self.check();
            if !moved {
                return;
            }
        }
        panic!("the bridge and its connection never settle: a busy loop");
    }

    /// One pass of the shell's loop (`usbwire_client::redir::run_bridge`):
    /// whether anything moved.
    fn bridge_pass(&mut self) -> bool {
        let Some(core) = self.core.as_mut().filter(|_| self.over.is_none()) else { return false };
        if self.follows && !self.away && self.connection.is_closed() {
            // The shell waits for the connection's end: noticed at once, the guest told.
            core.device_lost();
            self.away = true;
            return true;
        }
        if let Some(ended) = core.poll_ended() {
            self.over = Some(Over::Ended(ended));
            return true;
        }
        if let Err(error) = core.issue_commands() {
            self.over = Some(Over::Failed(error.to_string()));
            return true;
        }
        let mut moved = false;
        if core.reads_guest() {
            if self.guest_socket.is_empty() && self.guest_hung_up {
                self.over = Some(Over::Ended(Ended::GuestLeft));
                return true;
            }
            if !self.guest_socket.is_empty() {
                let read = self.guest_socket.split_to(self.read_size.min(self.guest_socket.len()));
                self.inbuf.extend_from_slice(&read);
                // Whole packets this read completes, at most.
                let packets = self.inbuf.len() / MIN_PACKET;
                let before = core.host().urbs_in_flight();
                if let Err(error) = core.handle_guest(&mut self.inbuf) {
                    self.over = Some(Over::Failed(error.to_string()));
                    return true;
                }
                let added = core.host().urbs_in_flight().saturating_sub(before);
                assert!(added <= packets * URBS_PER_PACKET, "{added} URBs from {packets} packets at most");
                self.most_per_read = self.most_per_read.max(added);
                moved = true;
            }
        } else if self.guest_hung_up {
            // Gone with bytes the bridge had no room for: it sees the hang-up without reading them.
            self.over = Some(Over::Ended(Ended::GuestLeft));
            return true;
        }
        if core.collects_completions() && !self.away {
            let mut cx = Context::from_waker(Waker::noop());
            if let Poll::Ready(completion) = core.poll_next_complete(&mut cx) {
                match core.handle_completion(completion) {
                    Ok(()) => {}
                    Err(BridgeError::DeviceLost) if self.follows => self.away = true,
                    Err(error) => self.over = Some(Over::Failed(error.to_string())),
                }
                moved = true;
            }
        }
        moved
    }

    /// One pass of the relay (`usbwire_client::relay`'s loop) while the link
    /// is up: commands into the session, its bytes to the server (when the
    /// server reads), the server's bytes back; idle, an acknowledgement.
    fn relay_pass(&mut self) -> bool {
        if self.connection.is_closed() {
            return false;
        }
        let mut moved = match self.connection.take_commands() {
            Ok(took) => took,
            Err(_) => {
                self.connection.end();
                return true;
            }
        };
        if self.server_reads {
            let outbox = self.connection.to_server();
            while !outbox.is_empty() {
                let bytes: Vec<u8> = outbox.slices(64).iter().flat_map(|slice| slice.iter().copied()).collect();
                outbox.advance(bytes.len());
                self.server.receive(&bytes);
                moved = true;
            }
        }
        if !self.server.to_client.is_empty() {
            let bytes = self.server.to_client.split();
            if self.connection.handle_server(&bytes).is_err() {
                // A malformed reply, or the server ending the session: the relay ends.
                self.connection.end();
            }
            moved = true;
        }
        if !moved && self.connection.acknowledge() {
            moved = true;
        }
        moved
    }

    /// The virtual clock moves on: keep-alive runs, and the shell's liveness
    /// tick notices a connection that is gone.
    fn time_passes(&mut self, elapsed: Duration) {
        let tick = |at: Instant| (at - self.start).as_millis() / LIVENESS_TICK.as_millis();
        let ticked = tick(self.now + elapsed) > tick(self.now);
        self.now += elapsed;
        let mut due = 0;
        while let Some(deadline) = self.connection.poll_timeout().filter(|&deadline| deadline <= self.now) {
            due += 1;
            assert!(due < 64, "keep-alive stays due at {deadline:?}: the relay would spin");
            if self.connection.handle_timeout(self.now).is_err() {
                // Silent for too long: the link is lost (and, here, not resumed).
                self.connection.end();
            }
        }
        if ticked && self.connection.is_closed() && !self.follows {
            if let Some(core) = self.core.as_mut().filter(|_| self.over.is_none()) {
                self.over = Some(Over::Failed(core.device_lost().to_string()));
            }
        }
    }

    /// The budgets and bookkeeping; see the module docs.
    fn check(&mut self) {
        let budget = self.connection.budget().clone();
        let connected = !self.connection.is_closed();
        if let Some(core) = self.core.as_mut() {
            let (urbs, bytes) = core.in_flight();
            let to_guest = core.to_guest().len();
            let guest_full = to_guest >= budget.queued_reply_bytes;
            let full = urbs >= budget.in_flight_urbs || (bytes > 0 && bytes >= budget.in_flight_bytes) || guest_full;
            assert!(
                !full || !core.reads_guest(),
                "a full bridge reads its guest: {urbs} URBs, {bytes} bytes in flight, {to_guest} for the guest"
            );
            assert!(!guest_full || !core.collects_completions(), "collects completions with {to_guest} bytes unread");
            assert!(
                urbs <= budget.in_flight_urbs + self.most_per_read,
                "{urbs} URBs in flight: past the budget ({}) by more than one read adds ({})",
                budget.in_flight_urbs,
                self.most_per_read
            );
            if connected {
                assert_eq!(core.pending(), urbs, "the queue's pending URBs and the bridge's differ");
            }
        }
        // Once the connection is gone nothing is accepted; the session's table is dropped with it.
        if connected && self.core.is_some() {
            let (accepted, accepted_bytes) = self.connection.accepted();
            assert!(accepted <= budget.in_flight_urbs, "the connection accepted {accepted} commands");
            // One URB of any size gets through while no bytes are held (zero-length ones may be).
            let most_bytes = budget.in_flight_bytes + Limits::default().max_transfer_length as usize;
            assert!(
                accepted_bytes <= most_bytes,
                "the connection accepted {accepted_bytes} bytes in {accepted} commands"
            );
            assert!(self.connection.outstanding() <= accepted, "the session holds more than was accepted");
            let queued = self.connection.to_server().queued();
            let most = budget.queued_reply_bytes + accepted_bytes + (accepted + 4) * (48 + 16 * 256);
            assert!(queued <= most, "{queued} bytes wait for the server (bound {most})");
        }
        if let (Some(before), Some(now)) = (self.heap_before, crate::session::live_bytes()) {
            let held = now.saturating_sub(before);
            let bound = memory_bound(&budget);
            assert!(held <= bound, "the session holds {held} bytes of heap (bound {bound})");
        }
    }

    /// The shell's end of a session: what the core said last reaches the
    /// guest, the bridge goes (its queue hands over what it submitted), and
    /// the connection closes once the relay took it.
    fn tear_down(&mut self) {
        let Some(mut core) = self.core.take() else { return };
        let lost = matches!(&self.over, Some(Over::Failed(why)) if why.contains("lost"));
        if lost || self.away {
            assert_eq!(core.host().urbs_in_flight(), 0, "URBs in flight on a lost device");
        }
        if std::env::var_os("USBWIRE_FUZZ_LOG").is_some() {
            eprintln!("announced {}, traffic {:?}", core.host().is_announced(), core.traffic());
        }
        let mut last = core.to_guest().split();
        self.guest_decodes(&mut last);
        drop(core);
        for _ in 0..MAX_TURNS {
            if !self.relay_pass() {
                break;
            }
        }
        self.connection.end();
        assert_eq!(self.connection.accepted(), (0, 0), "a closed connection holds commands");
        if std::env::var_os("USBWIRE_FUZZ_LOG").is_some() {
            match &self.over {
                Some(Over::Ended(ended)) => eprintln!("session ended: {ended:?}"),
                Some(Over::Failed(why)) => eprintln!("session failed: {why}"),
                None => eprintln!("the input ran out"),
            }
        }
    }
}
