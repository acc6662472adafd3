//! The accelerator against a reference: random sequences of reads, writes and
//! other commands, with stalls injected on chosen stages, run by a kernel
//! that behaves as usb-storage does, through the whole sans-I/O path (the
//! accelerator, a client session, the bytes of a link delivered in random
//! pieces at random moments, the server session's stage gate, a virtual disk).
//! Every run goes twice, with the accelerator and without: the kernel must
//! see the same outcome of every command both ways, and every byte read must
//! be what a reference disk holds.

use std::collections::{HashMap, VecDeque};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use usbwire_device::{Completion, Device, DeviceSummary, Direction, Speed, Status, TransferType, Urb, VirtualDevice};
use usbwire_gadgets::mass_storage::{DiskOptions, MassStorage, BLOCK_SIZE, BULK_IN, BULK_OUT};
use usbwire_proto::client_session::ClientSession;
use usbwire_proto::server_session::{DeviceCall, ServerSession};
use usbwire_proto::urb::{ClientMessage, CmdSubmit, RetSubmit, ServerMessage};
use usbwire_proto::{Budget, Limits, RecvBuffer};

use super::Accelerator;

const DEVID: u32 = 0x0001_0002;
const BLOCKS: u32 = 512;
const BLOCK: usize = BLOCK_SIZE as usize;
const BLOCK_BYTES: u32 = BLOCK_SIZE as u32;
/// usb-storage's GET_MAX_LUN to interface 0.
const GET_MAX_LUN: [u8; 8] = [0xa1, 0xfe, 0, 0, 0, 0, 1, 0];

/// A fault the disk shows on one command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// The CBW is refused with a STALL (the OUT endpoint halts).
    StallCommand,
    /// The data IN stage is refused with a STALL after the device moved on to its status.
    StallData,
}

#[derive(Clone, Debug)]
enum Op {
    Read {
        lba: u32,
        blocks: u16,
    },
    /// `count` READs of `blocks` one after the other from `lba`: a stream to read ahead.
    Run {
        lba: u32,
        blocks: u16,
        count: u8,
    },
    /// READs one after the other from `lba`, of sizes that change from one
    /// to the next (as vhci-hcd's segment limit makes of large requests).
    Ragged {
        lba: u32,
        sizes: Vec<u16>,
    },
    /// A stream, then a write just past its end (where it was read ahead),
    /// then the stream going on over what was written.
    Overwrite {
        lba: u32,
        count: u8,
        past: u8,
        fill: u8,
    },
    Write {
        lba: u32,
        blocks: u16,
        fill: u8,
    },
    TestUnitReady,
    /// A READ(10) whose end is past the disk's: CHECK CONDITION.
    ReadPastEnd,
    /// The kernel sets the configuration again and usb-storage probes the
    /// interface (GET_MAX_LUN): a scan ahead starts.
    Probe,
    /// The commands Linux sends a disk that just appeared, in its order.
    Scan,
    /// Six seconds with nothing sent.
    Idle,
}

/// What the kernel makes of one command.
#[derive(Clone, PartialEq, Eq)]
enum Outcome {
    Done {
        data: Bytes,
        status: u8,
        residue: u32,
    },
    /// A stage failed in a way usb-storage answers with a reset.
    TransportError,
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Done { data, status, residue } => {
                let sum = data.iter().fold(0u32, |sum, &byte| sum.rotate_left(5) ^ u32::from(byte));
                write!(f, "Done({} bytes, sum {sum:08x}, status {status}, residue {residue})", data.len())
            }
            Self::TransportError => write!(f, "TransportError"),
        }
    }
}

/// The virtual disk with faults on chosen commands, keeping the halt a real
/// device keeps until CLEAR_FEATURE(ENDPOINT_HALT).
struct Faulty {
    inner: VirtualDevice<MassStorage>,
    /// The fault of every command (READ(10) or WRITE(10)) whose range holds an LBA, each time.
    faults: HashMap<u32, Fault>,
    halted_in: bool,
    halted_out: bool,
    stall_data: bool,
    stalled: Option<u32>,
    own: VecDeque<Completion>,
}

impl Device for Faulty {
    fn summary(&self) -> DeviceSummary {
        self.inner.summary()
    }

    fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        self.inner.endpoint_type(direction, number)
    }

    fn submit(&mut self, urb: Urb) {
        if urb.endpoint == 0 {
            if urb.setup[..2] == [0x02, 0x01] {
                match urb.setup[4] {
                    BULK_IN => self.halted_in = false,
                    BULK_OUT => self.halted_out = false,
                    _ => {}
                }
            }
        } else if urb.direction == Direction::Out {
            if self.halted_out {
                return self.own.push_back(urb.complete_with(Status::EPIPE));
            }
            if urb.data.len() == 31 && &urb.data[..4] == b"USBC" {
                let lba = u32::from_be_bytes([urb.data[17], urb.data[18], urb.data[19], urb.data[20]]);
                let blocks = u32::from(u16::from_be_bytes([urb.data[22], urb.data[23]]));
                let rw = matches!(urb.data[15], 0x28 | 0x2a);
                let fault = fault_in(&self.faults, lba, blocks).filter(|_| rw).unwrap_or(Fault::None);
                match fault {
                    Fault::StallCommand => {
                        self.halted_out = true;
                        return self.own.push_back(urb.complete_with(Status::EPIPE));
                    }
                    Fault::StallData => self.stall_data = urb.data[12] & 0x80 != 0,
                    Fault::None => {}
                }
            }
        } else {
            if self.halted_in {
                return self.own.push_back(urb.complete_with(Status::EPIPE));
            }
            if std::mem::take(&mut self.stall_data) {
                self.stalled = Some(urb.seqnum);
            }
        }
        self.inner.submit(urb);
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        if let Some(done) = self.own.pop_front() {
            return Poll::Ready(done);
        }
        match self.inner.poll_complete(cx) {
            Poll::Ready(mut done) if Some(done.seqnum) == self.stalled => {
                self.stalled = None;
                self.halted_in = true;
                done.status = Status::EPIPE;
                done.actual_length = 0;
                done.data = Bytes::new();
                Poll::Ready(done)
            }
            other => other,
        }
    }

    fn cancel(&mut self, seqnum: u32) {
        self.inner.cancel(seqnum);
    }

    fn reset(&mut self) {
        self.inner.reset();
    }
}

/// The fault of a command of `blocks` at `lba`: the first faulty LBA's in its range.
fn fault_in(faults: &HashMap<u32, Fault>, lba: u32, blocks: u32) -> Option<Fault> {
    (lba..lba.saturating_add(blocks)).find_map(|at| faults.get(&at).copied())
}

/// Deterministic choices for the schedule (a proptest seed in, no shrinking needed).
struct Schedule(u64);

impl Schedule {
    fn next(&mut self, below: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % below.max(1) as u64) as usize
    }
}

/// The kernel, the client side, the link, the server side and the disk.
struct Rig {
    accelerator: Option<Accelerator>,
    client: ClientSession<()>,
    client_in: RecvBuffer,
    server: ServerSession,
    device: Faulty,
    up: VecDeque<u8>,
    down: VecDeque<u8>,
    replies: Vec<ServerMessage>,
    seqnum: u32,
    tag: u32,
    schedule: Schedule,
    /// The virtual clock: a microsecond a step, from `start`.
    start: Instant,
    ticks: u64,
    _image: tempfile::TempDir,
}

fn to_server(client: &mut ClientSession<()>, message: ClientMessage) {
    match message {
        ClientMessage::Submit(submit) => client.submit(submit, ()),
        ClientMessage::Unlink(unlink) => client.unlink(unlink),
    }
    .expect("the session takes the command");
}

impl Rig {
    fn new(accelerate: bool, faults: HashMap<u32, Fault>, seed: u64, image: &[u8]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("disk.img");
        std::fs::write(&path, image).expect("image");
        let options = DiskOptions { size: None, read_only: false, speed: Speed::HIGH, bad_blocks: None };
        let inner = MassStorage::open(&path, &options).expect("disk");
        let mut server = ServerSession::new(DEVID, BytesMut::new(), Limits::default(), Budget::default());
        if accelerate {
            server = server.storage();
        }
        Self {
            accelerator: accelerate.then(|| Accelerator::new(DEVID)),
            client: ClientSession::new(DEVID, Limits::default(), Budget::default()),
            client_in: RecvBuffer::with_capacity(64 * 1024),
            server,
            device: Faulty {
                inner,
                faults,
                halted_in: false,
                halted_out: false,
                stall_data: false,
                stalled: None,
                own: VecDeque::new(),
            },
            up: VecDeque::new(),
            down: VecDeque::new(),
            replies: Vec::new(),
            seqnum: 0,
            tag: 0,
            schedule: Schedule(seed | 1),
            start: Instant::now(),
            ticks: 0,
            _image: dir,
        }
    }

    /// One move of one part, chosen by the schedule; bytes cross the link in random pieces.
    fn step(&mut self) {
        self.ticks += 1;
        match self.schedule.next(5) {
            0 => drain(self.client.outbox(), &mut self.up),
            1 => {
                let take = self.piece(self.up.len());
                let bytes: Vec<u8> = self.up.drain(..take).collect();
                self.server.input(|_, _| false).expect("input").extend_from_slice(&bytes);
                self.server.handle_input(|_, _| false).expect("the server takes the client's bytes");
                while let Some(call) = self.server.poll_device_call() {
                    match call {
                        DeviceCall::Submit(submit) => self.device.submit(Urb::from_submit(submit)),
                        DeviceCall::Cancel { seqnum } => self.device.cancel(seqnum),
                    }
                }
            }
            2 => {
                let mut cx = Context::from_waker(Waker::noop());
                while self.server.wants_completions() {
                    match self.device.poll_complete(&mut cx) {
                        Poll::Ready(done) => self.server.complete(done.into_ret_submit()),
                        Poll::Pending => break,
                    }
                }
                // Stages the gate let through on a completion.
                while let Some(call) = self.server.poll_device_call() {
                    match call {
                        DeviceCall::Submit(submit) => self.device.submit(Urb::from_submit(submit)),
                        DeviceCall::Cancel { seqnum } => self.device.cancel(seqnum),
                    }
                }
            }
            3 => drain(self.server.outbox(), &mut self.down),
            _ => {
                let take = self.piece(self.down.len());
                let bytes: Vec<u8> = self.down.drain(..take).collect();
                self.client_in.extend_from_slice(&bytes);
                let (accelerator, replies) = (&mut self.accelerator, &mut self.replies);
                self.client
                    .handle_input(&mut self.client_in, |event| match accelerator {
                        Some(accelerator) => accelerator.server_sent(event, &mut |reply| replies.push(reply)),
                        None => replies.push(match event {
                            usbwire_proto::client_session::Event::Completed { reply, .. } => {
                                ServerMessage::Submit(reply)
                            }
                            usbwire_proto::client_session::Event::Unlinked { reply, .. } => {
                                ServerMessage::Unlink(reply)
                            }
                        }),
                    })
                    .expect("the client takes the server's bytes");
                if let Some(accelerator) = &mut self.accelerator {
                    let (client, replies) = (&mut self.client, &mut self.replies);
                    let now = self.start + Duration::from_micros(self.ticks);
                    accelerator
                        .release(
                            now,
                            &mut |message| {
                                to_server(client, message);
                                Ok::<_, ()>(())
                            },
                            &mut |reply| replies.push(reply),
                        )
                        .expect("taken");
                }
            }
        }
    }

    /// All of `len` bytes, or (one time in four) a random part of them.
    fn piece(&mut self, len: usize) -> usize {
        if len > 1 && self.schedule.next(4) == 0 {
            1 + self.schedule.next(len - 1)
        } else {
            len
        }
    }

    /// Submits a URB as vhci does and waits for its completion.
    fn urb(&mut self, ep: u8, direction: Direction, setup: [u8; 8], length: u32, data: Bytes) -> RetSubmit {
        let seqnum = self.send(ep, direction, setup, length, data);
        for _ in 0..200_000 {
            if let Some(at) =
                self.replies.iter().position(|r| matches!(r, ServerMessage::Submit(r) if r.seqnum == seqnum))
            {
                let ServerMessage::Submit(reply) = self.replies.remove(at) else { unreachable!() };
                assert!(self.replies.is_empty(), "replies nobody asked for: {:?}", self.replies);
                return reply;
            }
            self.step();
        }
        panic!("URB {seqnum} (ep {ep}, {direction:?}) never completed: the pipeline is stuck");
    }

    fn control(&mut self, setup: [u8; 8]) -> RetSubmit {
        let length = u32::from(u16::from_le_bytes([setup[6], setup[7]]));
        let direction = if setup[0] & 0x80 != 0 { Direction::In } else { Direction::Out };
        self.urb(0, direction, setup, length, Bytes::new())
    }

    fn enumerate(&mut self) {
        let head = self.control([0x80, 6, 0, 2, 0, 0, 9, 0]);
        let total = u16::from_le_bytes([head.data[2], head.data[3]]);
        let [low, high] = total.to_le_bytes();
        assert_eq!(self.control([0x80, 6, 0, 2, 0, 0, low, high]).status, Status::OK);
        assert_eq!(self.control([0x00, 9, 1, 0, 0, 0, 0, 0]).status, Status::OK);
        assert_eq!(self.control(GET_MAX_LUN).status, Status::OK);
        // As usb-storage and the SCSI disk driver do before any READ.
        let capacity = self.command(&[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], Some(8), None);
        assert!(matches!(capacity, Outcome::Done { status: 0, .. }), "{capacity:?}");
    }

    /// Linux's scan of a new disk, as usb-storage sent it to a 64 MiB disk:
    /// each command's outcome, and the READs' ranges (LBA, blocks).
    fn scan(&mut self) -> Vec<(Outcome, Option<(u32, u16)>)> {
        let inquiry = (&[0x12, 0, 0, 0, 36, 0][..], 36);
        let ready = (&[0u8; 6][..], 0);
        let capacity = (&[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0][..], 8);
        let sense = (&[0x1a, 0, 0x3f, 0, 192, 0][..], 192);
        let zero = (&[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0][..], BLOCK_BYTES);
        let revalidate = [ready, capacity, zero, sense, sense];
        let mut script = vec![inquiry];
        script.extend(revalidate);
        script.push(ready);
        script.extend(revalidate);
        script.push((&[0x1e, 0, 0, 0, 1, 0][..], 0));
        let pages: [&[u8]; 3] = [
            &[0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0],
            &[0x28, 0, 0, 0, 0, 8, 0, 0, 8, 0],
            &[0x28, 0, 0, 0, 0, 24, 0, 0, 8, 0],
        ];
        script.extend(pages.map(|page| (page, 8 * BLOCK_BYTES)));
        script.extend([(&[0x1e, 0, 0, 0, 0, 0][..], 0), ready]);
        script
            .into_iter()
            .map(|(cdb, length)| {
                let read =
                    (cdb[0] == 0x28).then(|| (u32::from_be_bytes([cdb[2], cdb[3], cdb[4], cdb[5]]), cdb[8].into()));
                (self.command(cdb, (length > 0).then_some(length), None), read)
            })
            .collect()
    }

    fn clear_halt(&mut self, endpoint: u8) {
        self.control([0x02, 0x01, 0, 0, endpoint, 0, 0, 0]);
    }

    /// usb-storage's reset recovery: the class reset, then both halts cleared.
    fn reset_recovery(&mut self) {
        self.control([0x21, 0xff, 0, 0, 0, 0, 0, 0]);
        self.clear_halt(BULK_IN);
        self.clear_halt(BULK_OUT);
    }

    /// One command as usb-storage's Bulk-Only transport runs it.
    fn command(&mut self, cdb: &[u8], data_in: Option<u32>, data_out: Option<Bytes>) -> Outcome {
        self.tag += 1;
        let length = data_in.unwrap_or_else(|| data_out.as_ref().map_or(0, |data| data.len() as u32));
        let mut cbw = vec![0u8; 31];
        cbw[..4].copy_from_slice(b"USBC");
        cbw[4..8].copy_from_slice(&self.tag.to_le_bytes());
        cbw[8..12].copy_from_slice(&length.to_le_bytes());
        cbw[12] = if data_in.is_some() { 0x80 } else { 0 };
        cbw[14] = cdb.len() as u8;
        cbw[15..15 + cdb.len()].copy_from_slice(cdb);
        if self.urb(BULK_OUT & 0x0f, Direction::Out, [0; 8], 31, Bytes::from(cbw)).status != Status::OK {
            self.reset_recovery();
            return Outcome::TransportError;
        }
        let mut data = Bytes::new();
        if length > 0 {
            let done = match data_out {
                Some(out) => self.urb(BULK_OUT & 0x0f, Direction::Out, [0; 8], length, out),
                None => self.urb(BULK_IN & 0x0f, Direction::In, [0; 8], length, Bytes::new()),
            };
            match done.status {
                Status::OK => data = done.data,
                Status::EPIPE => self.clear_halt(if data_in.is_some() { BULK_IN } else { BULK_OUT }),
                _ => {
                    self.reset_recovery();
                    return Outcome::TransportError;
                }
            }
        }
        let mut csw = self.urb(BULK_IN & 0x0f, Direction::In, [0; 8], 13, Bytes::new());
        if csw.status == Status::EPIPE {
            self.clear_halt(BULK_IN);
            csw = self.urb(BULK_IN & 0x0f, Direction::In, [0; 8], 13, Bytes::new());
        }
        let wrapper = &csw.data;
        if csw.status != Status::OK
            || wrapper.len() != 13
            || &wrapper[..4] != b"USBS"
            || wrapper[4..8] != self.tag.to_le_bytes()
        {
            self.reset_recovery();
            return Outcome::TransportError;
        }
        let residue = u32::from_le_bytes([wrapper[8], wrapper[9], wrapper[10], wrapper[11]]);
        Outcome::Done { data, status: wrapper[12], residue }
    }

    /// One READ(10) or WRITE(10).
    fn read_write(&mut self, write: bool, lba: u32, blocks: u16, fill: u8) -> Outcome {
        let mut cdb = [0u8; 10];
        cdb[0] = if write { 0x2a } else { 0x28 };
        cdb[2..6].copy_from_slice(&lba.to_be_bytes());
        cdb[7..9].copy_from_slice(&blocks.to_be_bytes());
        match write {
            true => self.command(&cdb, None, Some(Bytes::from(pattern(lba, blocks, fill)))),
            false => self.command(&cdb, Some(u32::from(blocks) * BLOCK_BYTES), None),
        }
    }

    /// Submits a URB as vhci does, without waiting for it; its seqnum.
    fn send(&mut self, ep: u8, direction: Direction, setup: [u8; 8], length: u32, data: Bytes) -> u32 {
        self.seqnum += 1;
        let submit = CmdSubmit::new(self.seqnum, DEVID, direction, ep, length, setup, data);
        let message = ClientMessage::Submit(submit);
        let (client, replies) = (&mut self.client, &mut self.replies);
        let now = self.start + Duration::from_micros(self.ticks);
        match &mut self.accelerator {
            Some(accelerator) => accelerator
                .kernel_sent(
                    message,
                    now,
                    &mut |message| {
                        to_server(client, message);
                        Ok::<_, ()>(())
                    },
                    &mut |reply| replies.push(reply),
                )
                .expect("taken"),
            None => to_server(client, message),
        }
        self.seqnum
    }

    /// Lets everything in flight arrive; then no reply may be left over.
    fn settle(&mut self) {
        self.settle_taking(0);
    }

    /// Lets everything in flight arrive, leaving `expected` replies for the test to read.
    fn settle_taking(&mut self, expected: usize) {
        for _ in 0..10_000 {
            self.step();
        }
        assert_eq!(self.replies.len(), expected, "replies nobody asked for: {:?}", self.replies);
        assert!(self.up.is_empty() && self.down.is_empty() && self.server.is_idle(), "the link went quiet");
        assert_eq!(self.client.outstanding(), 0, "every URB answered");
    }
}

fn drain(outbox: &mut usbwire_proto::Outbox, to: &mut VecDeque<u8>) {
    while !outbox.is_empty() {
        let mut took = 0;
        for slice in outbox.slices(64) {
            to.extend(slice.iter());
            took += slice.len();
        }
        outbox.advance(took);
    }
}

/// What a write of `blocks` at `lba` puts on the disk: different for every block and fill.
fn pattern(lba: u32, blocks: u16, fill: u8) -> Vec<u8> {
    (0..usize::from(blocks) * BLOCK)
        .map(|at| (at / BLOCK) as u8 ^ (lba as u8).wrapping_mul(31) ^ fill ^ at as u8)
        .collect()
}

/// LBAs in a small region, on 8-block boundaries, so reads, writes, streams
/// and faults meet often.
fn lba() -> impl Strategy<Value = u32> {
    (0..BLOCKS / 8 - 16).prop_map(|at| at * 8)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (lba(), 1u16..24).prop_map(|(lba, blocks)| Op::Read { lba, blocks }),
        4 => (lba(), prop_oneof![Just(8u16), Just(16)], 2u8..8).prop_map(|(lba, blocks, count)| Op::Run { lba, blocks, count }),
        2 => (lba(), proptest::collection::vec(1u16..24, 3..8)).prop_map(|(lba, sizes)| Op::Ragged { lba, sizes }),
        3 => (lba(), 1u16..24, any::<u8>()).prop_map(|(lba, blocks, fill)| Op::Write { lba, blocks, fill }),
        2 => (0..BLOCKS / 8 - 40, 2u8..6, 0u8..3, any::<u8>())
            .prop_map(|(at, count, past, fill)| Op::Overwrite { lba: at * 8, count, past, fill }),
        1 => Just(Op::TestUnitReady),
        1 => Just(Op::ReadPastEnd),
        1 => Just(Op::Probe),
        2 => Just(Op::Scan),
        1 => Just(Op::Idle),
    ]
}

fn faults() -> impl Strategy<Value = HashMap<u32, Fault>> {
    let fault = prop_oneof![Just(Fault::StallCommand), Just(Fault::StallData)];
    proptest::collection::hash_map(lba(), fault, 0..3)
}

/// Runs `ops` and checks every byte read against the reference disk; the
/// kernel's outcome of every command, in order.
fn run(accelerate: bool, ops: &[Op], faults: &HashMap<u32, Fault>, seed: u64) -> (Vec<Outcome>, StorageTally) {
    let image: Vec<u8> = (0..BLOCKS as usize * BLOCK).map(|at| (at * 7 / 3) as u8).collect();
    let mut reference = image.clone();
    let mut rig = Rig::new(accelerate, faults.clone(), seed, &image);
    rig.enumerate();
    let mut outcomes = Vec::new();
    let mut check = |outcome: &Outcome, write: Option<u8>, lba: u32, blocks: u16| {
        let at = lba as usize * BLOCK;
        let range = at..at + usize::from(blocks) * BLOCK;
        match (write, outcome) {
            (Some(fill), Outcome::Done { status: 0, residue: 0, .. }) => {
                reference[range].copy_from_slice(&pattern(lba, blocks, fill));
            }
            (None, Outcome::Done { data, status: 0, residue: 0 }) if fault_in(faults, lba, blocks.into()).is_none() => {
                assert!(data[..] == reference[range], "read of {blocks} blocks at {lba}: stale or wrong bytes");
            }
            _ => {}
        }
    };
    for op in ops {
        match *op {
            Op::Read { lba, blocks } => {
                let outcome = rig.read_write(false, lba, blocks, 0);
                check(&outcome, None, lba, blocks);
                outcomes.push(outcome);
            }
            Op::Run { lba, blocks, count } => {
                for n in 0..u32::from(count) {
                    let at = lba + n * u32::from(blocks);
                    let outcome = rig.read_write(false, at, blocks, 0);
                    check(&outcome, None, at, blocks);
                    outcomes.push(outcome);
                }
            }
            Op::Ragged { lba, ref sizes } => {
                let mut at = lba;
                for &blocks in sizes {
                    let outcome = rig.read_write(false, at, blocks, 0);
                    check(&outcome, None, at, blocks);
                    outcomes.push(outcome);
                    at += u32::from(blocks);
                }
            }
            Op::Write { lba, blocks, fill } => {
                let outcome = rig.read_write(true, lba, blocks, fill);
                check(&outcome, Some(fill), lba, blocks);
                outcomes.push(outcome);
            }
            Op::Overwrite { lba, count, past, fill } => {
                let mut steps: Vec<(Option<u8>, u32)> = (0..u32::from(count)).map(|n| (None, lba + n * 8)).collect();
                steps.push((Some(fill), lba + (u32::from(count) + u32::from(past)) * 8));
                steps.extend((u32::from(count)..u32::from(count) + 4).map(|n| (None, lba + n * 8)));
                for (write, at) in steps {
                    let outcome = rig.read_write(write.is_some(), at, 8, write.unwrap_or(0));
                    check(&outcome, write, at, 8);
                    outcomes.push(outcome);
                }
            }
            Op::TestUnitReady => outcomes.push(rig.command(&[0; 6], None, None)),
            Op::Probe => {
                assert_eq!(rig.control([0x00, 9, 1, 0, 0, 0, 0, 0]).status, Status::OK);
                // usb-storage's `delay_use`: what went out meanwhile comes back.
                rig.settle();
                rig.ticks += 1_000_000;
                let luns = rig.control(GET_MAX_LUN);
                assert_eq!((luns.status, luns.data.as_ref()), (Status::OK, &[0][..]), "one LUN");
            }
            Op::Idle => rig.ticks += 6_000_000,
            Op::Scan => {
                for (outcome, read) in rig.scan() {
                    if let Some((lba, blocks)) = read {
                        check(&outcome, None, lba, blocks);
                    }
                    outcomes.push(outcome);
                }
            }
            Op::ReadPastEnd => outcomes.push(rig.read_write(false, BLOCKS - 1, 2, 0)),
        }
    }
    rig.settle();
    let tally = rig.accelerator.as_ref().map(|a| a.counters()).unwrap_or_default();
    (outcomes, tally)
}

type StorageTally = super::StorageCounters;

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn the_kernel_sees_what_it_sees_without_the_accelerator_and_never_a_stale_byte(
        ops in proptest::collection::vec(op(), 1..30),
        faults in faults(),
        seed in any::<u64>(),
    ) {
        let (plain, _) = run(false, &ops, &faults, seed);
        let (accelerated, tally) = run(true, &ops, &faults, seed.rotate_left(17));
        prop_assert_eq!(&accelerated, &plain);
        prop_assert_eq!(tally.commands_pipelined, plain.len() as u64 + 1, "and READ CAPACITY");
    }
}

#[test]
fn a_clean_command_costs_the_kernel_no_wait_for_its_cbw_and_its_csw_is_read_ahead() {
    let ops = [Op::Write { lba: 3, blocks: 8, fill: 1 }, Op::Read { lba: 3, blocks: 8 }, Op::TestUnitReady];
    let (outcomes, tally) = run(true, &ops, &HashMap::new(), 7);
    assert!(outcomes.iter().all(|o| matches!(o, Outcome::Done { status: 0, residue: 0, .. })), "{outcomes:?}");
    assert_eq!(tally.commands_pipelined, 4, "READ CAPACITY and the three");
    assert_eq!(tally.statuses_ahead, 4, "every CSW came from the read sent ahead");
    assert_eq!(tally.statuses_wasted, 0);
}

#[test]
fn a_stream_is_read_ahead_and_a_write_into_it_is_never_served_stale() {
    let ops = [
        Op::Run { lba: 0, blocks: 8, count: 12 },
        Op::Write { lba: 104, blocks: 8, fill: 9 },
        Op::Run { lba: 96, blocks: 8, count: 4 },
    ];
    let (plain, _) = run(false, &ops, &HashMap::new(), 3);
    let (accelerated, tally) = run(true, &ops, &HashMap::new(), 5);
    assert_eq!(accelerated, plain);
    assert!(tally.read_ahead_hits >= 10, "the stream was served from reads ahead: {tally:?}");
    assert!(tally.bytes_wasted > 0, "the write dropped what was read ahead past it: {tally:?}");
}

#[test]
fn a_split_request_pattern_keeps_being_read_ahead() {
    // What `dd bs=1M iflag=direct` makes of a high-speed disk (8 commands of
    // 240 blocks and one of 64, request after request), scaled to this disk.
    let mut ops = Vec::new();
    for request in 0..4u32 {
        let start = request * (8 * 12 + 4);
        ops.push(Op::Run { lba: start, blocks: 12, count: 8 });
        ops.push(Op::Read { lba: start + 8 * 12, blocks: 4 });
    }
    let (plain, _) = run(false, &ops, &HashMap::new(), 21);
    let (accelerated, tally) = run(true, &ops, &HashMap::new(), 23);
    assert_eq!(accelerated, plain);
    assert_eq!(tally.read_ahead_hits, 34, "all but the first request's first two reads: {tally:?}");
}

#[test]
fn reads_of_changing_sizes_are_served_from_slices_of_the_reads_ahead() {
    // What vhci-hcd's 32 segments make of `dd bs=1M iflag=direct` once the
    // command size cap is raised (READs of 256, 296, 272, 264, 448 sectors…),
    // scaled to this disk: no two in a row of one size.
    let sizes: Vec<u16> = [8u16, 9, 7, 12, 8, 10, 9, 11, 8, 7, 12, 9, 10, 8, 11, 7].repeat(3);
    let ops = [Op::Ragged { lba: 16, sizes: sizes.clone() }];
    let (plain, _) = run(false, &ops, &HashMap::new(), 31);
    let (accelerated, tally) = run(true, &ops, &HashMap::new(), 37);
    assert_eq!(accelerated, plain);
    assert!(tally.read_ahead_hits >= sizes.len() as u64 - 3, "all but the stream's opening: {tally:?}");
    let read = sizes.iter().map(|&blocks| u64::from(blocks)).sum::<u64>() * u64::from(BLOCK_BYTES);
    assert!(tally.bytes_wasted <= read / 8, "read {read} bytes, wasted {}: {tally:?}", tally.bytes_wasted);
}

#[test]
fn a_read_that_waited_for_its_slices_widens_the_window_as_one_that_waited_for_its_read_ahead() {
    // Sizes that never repeat: every READ is served in slices, after
    // waiting for the reads ahead that hold it (nothing arrives before the
    // kernel asks here). The window must grow as the kernel keeps waiting.
    let image: Vec<u8> = (0..BLOCKS as usize * BLOCK).map(|at| at as u8).collect();
    let mut rig = Rig::new(true, HashMap::new(), 57, &image);
    rig.enumerate();
    let (mut lba, mut widest) = (8u32, 0);
    for blocks in [8u16, 9, 7, 12, 8, 10, 9, 11, 8, 7, 12, 9, 10, 8, 11, 7] {
        let outcome = rig.read_write(false, lba, blocks, 0);
        assert!(matches!(outcome, Outcome::Done { status: 0, residue: 0, .. }), "{outcome:?}");
        lba += u32::from(blocks);
        widest = widest.max(rig.accelerator.as_ref().map_or(0, |a| a.ahead.window()));
    }
    assert!(widest >= 8, "the window stayed at {widest}");
}

#[test]
fn a_read_longer_than_what_is_read_ahead_waits_for_the_rest_instead_of_dropping_it() {
    // READs that grow past what the reads ahead (of the stream's first
    // size) hold: the rest is read ahead for each, nothing is dropped.
    let sizes = vec![4u16, 4, 16, 24, 8, 24, 4, 20, 12, 24, 24, 6];
    let ops = [Op::Ragged { lba: 40, sizes: sizes.clone() }];
    let (plain, _) = run(false, &ops, &HashMap::new(), 41);
    let (accelerated, tally) = run(true, &ops, &HashMap::new(), 43);
    assert_eq!(accelerated, plain);
    assert_eq!(tally.read_ahead_hits, sizes.len() as u64 - 2, "all but the stream's first two: {tally:?}");
    let served = sizes[2..].iter().map(|&blocks| u64::from(blocks) * u64::from(BLOCK_BYTES)).sum::<u64>();
    assert_eq!(tally.bytes_read_ahead, served, "{tally:?}");
}

#[test]
fn stalls_show_as_they_do_without_the_accelerator() {
    let ops = [
        Op::Read { lba: 0, blocks: 4 },
        Op::Read { lba: 8, blocks: 4 },
        Op::TestUnitReady,
        Op::Write { lba: 9, blocks: 1, fill: 3 },
        Op::Read { lba: 9, blocks: 1 },
        // A stream whose read ahead meets a faulty LBA the kernel never reads.
        Op::Run { lba: 16, blocks: 8, count: 3 },
        Op::Write { lba: 200, blocks: 8, fill: 4 },
        Op::Read { lba: 200, blocks: 8 },
    ];
    let faults = HashMap::from([
        (0, Fault::StallData),
        (8, Fault::StallCommand),
        (48, Fault::StallData),
        (56, Fault::StallCommand),
    ]);
    let (plain, _) = run(false, &ops, &faults, 11);
    let (accelerated, tally) = run(true, &ops, &faults, 13);
    assert_eq!(accelerated, plain);
    assert!(matches!(plain[0], Outcome::Done { ref data, status: 0, .. } if data.is_empty()), "{:?}", plain[0]);
    assert_eq!(plain[1], Outcome::TransportError);
    assert!(plain[2..].iter().all(|o| matches!(o, Outcome::Done { status: 0, .. })), "{plain:?}");
    assert!(tally.statuses_wasted >= 2, "the status reads behind the stalls were not used: {tally:?}");
}

#[test]
fn the_scan_of_a_new_disk_is_answered_from_the_scan_ahead() {
    let ops = [Op::Probe, Op::Scan];
    let (plain, _) = run(false, &ops, &HashMap::new(), 41);
    let (accelerated, tally) = run(true, &ops, &HashMap::new(), 43);
    assert_eq!(accelerated, plain);
    assert!(plain.iter().all(|o| matches!(o, Outcome::Done { status: 0, .. })), "{plain:?}");
    // All but PREVENT and ALLOW MEDIUM REMOVAL, which go to the device; the
    // GET_MAX_LUN; and the rig's READ CAPACITY, from the scan ahead of its enumeration.
    assert_eq!(tally.scan_hits, 16 + 1 + 1, "{tally:?}");
}

#[test]
fn the_get_max_lun_ahead_never_overtakes_a_control_request_of_the_kernels_on_its_way() {
    // Another driver's GET_STATUS to the device is out when usb-storage asks
    // for the LUNs: a device completes control transfers in order, so the
    // answer ahead is not used, and the kernel's GET_MAX_LUN goes to the device behind it.
    let mut rig = Rig::new(true, HashMap::new(), 81, &vec![0; BLOCKS as usize * BLOCK]);
    rig.enumerate();
    assert_eq!(rig.control([0x00, 9, 1, 0, 0, 0, 0, 0]).status, Status::OK);
    rig.settle();
    rig.ticks += 1_000_000;
    let status = rig.send(0, Direction::In, [0x80, 0, 0, 0, 0, 0, 2, 0], 2, Bytes::new());
    let luns = rig.send(0, Direction::In, GET_MAX_LUN, 1, Bytes::new());
    assert!(rig.replies.is_empty(), "nothing answered before the GET_STATUS came back: {:?}", rig.replies);
    rig.settle_taking(2);
    let order: Vec<u32> = rig
        .replies
        .iter()
        .filter_map(|r| if let ServerMessage::Submit(r) = r { Some(r.seqnum) } else { None })
        .collect();
    assert_eq!(order, [status, luns]);
    let hits = rig.accelerator.as_ref().map(|a| a.counters().scan_hits);
    assert_eq!(hits, Some(1), "the enumeration's READ CAPACITY alone");
}

#[test]
fn a_write_before_the_scan_sends_its_reads_to_the_device_and_they_see_the_new_bytes() {
    // `run` checks every READ's bytes against the reference disk, written here.
    let ops = [Op::Probe, Op::Write { lba: 0, blocks: 32, fill: 5 }, Op::Scan];
    let (plain, _) = run(false, &ops, &HashMap::new(), 51);
    let (accelerated, tally) = run(true, &ops, &HashMap::new(), 53);
    assert_eq!(accelerated, plain);
    assert_eq!(
        tally.scan_hits, 2,
        "the enumeration's READ CAPACITY and the GET_MAX_LUN: the write ended the scan ahead: {tally:?}"
    );
}

#[test]
fn answers_older_than_their_time_are_not_served() {
    let ops = [Op::Probe, Op::Idle, Op::Scan];
    let (plain, _) = run(false, &ops, &HashMap::new(), 61);
    let (accelerated, tally) = run(true, &ops, &HashMap::new(), 63);
    assert_eq!(accelerated, plain);
    assert_eq!(
        tally.scan_hits, 2,
        "the enumeration's READ CAPACITY and the GET_MAX_LUN: the rest sent seven seconds before: {tally:?}"
    );
}

#[test]
fn a_scan_command_that_fails_on_the_device_ends_the_scan_ahead_after_a_recovery() {
    // Block zero's READ stalls its command block: the scan's later commands
    // are skipped, the device recovered before the kernel's next command,
    // which then sees what it sees without the accelerator.
    let faults = HashMap::from([(0, Fault::StallCommand)]);
    let ops = [Op::Probe, Op::Scan, Op::Read { lba: 40, blocks: 8 }];
    let (plain, _) = run(false, &ops, &faults, 71);
    let (accelerated, tally) = run(true, &ops, &faults, 73);
    assert_eq!(accelerated, plain);
    assert!(tally.scan_hits < 16 + 1 + 1, "{tally:?}");
}
