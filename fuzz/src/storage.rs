//! The `storage_accelerator` harness: the client's storage accelerator between a kernel
//! that sends anything a vhci-hcd could (command blocks of any content, data and status
//! URBs of any length, unlinks, control requests) and a server that answers whatever is
//! outstanding in any order, with any status, length and bytes — a hostile or broken
//! server, within what the client session lets through (one reply per command sent).
//!
//! Input: ops, each a selector byte and its arguments:
//!
//! - `0, op, lba, blocks, dir, lun`: a command block on the mass-storage OUT pipe (READ(10),
//!   WRITE(10), TEST UNIT READY or another opcode; data in or out of `blocks` × 512);
//! - `1, hi, lo`: a data URB on the pipe the command's direction names, `hi, lo` bytes;
//! - `2, len`: a read on the IN pipe of `len` bytes (the kernel's CSW URB is 13);
//! - `3, k`: the kernel unlinks the `k`-th of its URBs still unanswered;
//! - `4, k, status, hi, lo, fill, csw`: the server answers the `k`-th command outstanding
//!   there with a status (0 or an error), up to `hi, lo` bytes (`csw`: a CSW-shaped
//!   13 bytes, with status `fill % 3`);
//! - `5`: the accelerator releases what waits (and sends the scan ahead's commands due);
//! - `6`: the kernel asks for the LUNs (GET_MAX_LUN): a scan ahead follows its answer;
//! - `7, t`: `t` tenths of a second pass (the scan ahead's answers age).
//!
//! Invariants: no panic; every reply to the kernel answers one of its URBs still
//! unanswered (a RET_SUBMIT its URB, a RET_UNLINK its unlink), once, never with more
//! bytes than the URB asked for; every command to the server has a seqnum not
//! outstanding there, and every unlink names one that is; the accelerator holds no
//! more than its budget of reads ahead.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use usbwire_client::fuzzing::Accelerator;
use usbwire_device::descriptor::{ConfigurationBuilder, EndpointSpec};
use usbwire_device::Speed;
use usbwire_proto::client_session::Event;
use usbwire_proto::urb::{ClientMessage, CmdSubmit, CmdUnlink, RetSubmit, RetUnlink, ServerMessage};
use usbwire_proto::{Direction, Status};

const DEVID: u32 = 0x0001_0002;
const BULK_IN: u8 = 1;
const BULK_OUT: u8 = 2;
/// Reads ahead hold at most 8 MiB; with each at least a block, this many commands.
const MOST_OUTSTANDING: usize = 3 * 16 * 1024 + 64;

/// What the kernel waits for an answer to.
#[derive(Clone, Copy, Debug)]
enum Waiting {
    /// A URB: its IN length (`None` for OUT).
    Urb(Option<u32>),
    /// An unlink of this URB.
    Unlink(u32),
}

struct Harness {
    accelerator: Accelerator,
    next_seqnum: u32,
    /// The kernel's URBs and unlinks unanswered.
    kernel: HashMap<u32, Waiting>,
    /// What the server has outstanding: seqnum -> (direction, length; unlink target).
    server: Vec<(u32, Direction, u32, Option<u32>)>,
    /// The direction of the last command block's data.
    data_in: bool,
    /// The virtual clock.
    now: Instant,
}

impl Harness {
    fn kernel_sends(&mut self, message: ClientMessage) {
        match &message {
            ClientMessage::Submit(submit) => {
                let length = (submit.direction == Direction::In).then_some(submit.transfer_buffer_length);
                self.kernel.insert(submit.seqnum, Waiting::Urb(length));
            }
            ClientMessage::Unlink(unlink) => {
                self.kernel.insert(unlink.seqnum, Waiting::Unlink(unlink.unlink_seqnum));
            }
        }
        let (kernel, server) = (&mut self.kernel, &mut self.server);
        let result = self
            .accelerator
            .kernel_sent(message, self.now, &mut |message| to_server(server, message), &mut |reply| {
                to_kernel(kernel, reply)
            });
        result.unwrap_or_else(|()| unreachable!());
        assert!(self.server.len() <= MOST_OUTSTANDING, "reads ahead past their budget: {}", self.server.len());
    }

    fn release(&mut self) {
        let (kernel, server) = (&mut self.kernel, &mut self.server);
        let result = self.accelerator.release(self.now, &mut |message| to_server(server, message), &mut |reply| {
            to_kernel(kernel, reply)
        });
        result.unwrap_or_else(|()| unreachable!());
    }

    fn submit(&mut self, ep: u8, direction: Direction, setup: [u8; 8], length: u32, data: Bytes) {
        self.next_seqnum += 1;
        let submit = CmdSubmit::new(self.next_seqnum, DEVID, direction, ep, length, setup, data);
        self.kernel_sends(ClientMessage::Submit(submit));
    }

    /// The server answers its `k`-th outstanding command.
    fn answer(&mut self, k: usize, status: i32, length: u32, fill: u8, csw: bool) {
        if self.server.is_empty() {
            return;
        }
        let (seqnum, direction, asked, target) = self.server.remove(k % self.server.len());
        let kernel = &mut self.kernel;
        let event = match target {
            // As a server does: a target still outstanding is cancelled (no RET_SUBMIT
            // follows), one answered already gets RET_UNLINK(0) after its RET_SUBMIT.
            Some(target) => {
                let cancelled = self.server.iter().position(|(s, ..)| *s == target).map(|at| self.server.remove(at).0);
                Event::Unlinked {
                    reply: RetUnlink {
                        seqnum,
                        status: if cancelled.is_some() { Status::ECONNRESET } else { Status::OK },
                    },
                    target,
                    cancelled: cancelled.map(|s| (s, ())),
                }
            }
            None => {
                let data = match (direction, csw) {
                    (Direction::In, true) => {
                        let mut wrapper = b"USBS\0\0\0\0\0\0\0\0\0".to_vec();
                        wrapper[12] = fill % 3;
                        wrapper.truncate(asked as usize);
                        Bytes::from(wrapper)
                    }
                    (Direction::In, false) => Bytes::from(vec![fill; length.min(asked) as usize]),
                    (Direction::Out, _) => Bytes::new(),
                };
                let actual_length = if direction == Direction::In { data.len() as u32 } else { length.min(asked) };
                let reply = RetSubmit {
                    seqnum,
                    status: Status(status),
                    actual_length,
                    start_frame: 0,
                    number_of_packets: 0,
                    error_count: 0,
                    data,
                    iso_packets: Vec::new(),
                };
                Event::Completed { reply, tag: () }
            }
        };
        self.accelerator.server_sent(event, &mut |reply| to_kernel(kernel, reply));
    }
}

fn to_server(server: &mut Vec<(u32, Direction, u32, Option<u32>)>, message: ClientMessage) -> Result<(), ()> {
    match message {
        ClientMessage::Submit(submit) => {
            assert!(!server.iter().any(|(s, ..)| *s == submit.seqnum), "seqnum {} sent twice", submit.seqnum);
            server.push((submit.seqnum, submit.direction, submit.transfer_buffer_length, None));
        }
        ClientMessage::Unlink(unlink) => {
            assert!(!server.iter().any(|(s, ..)| *s == unlink.seqnum), "unlink seqnum {} in use", unlink.seqnum);
            server.push((unlink.seqnum, Direction::Out, 0, Some(unlink.unlink_seqnum)));
        }
    }
    Ok(())
}

fn to_kernel(kernel: &mut HashMap<u32, Waiting>, reply: ServerMessage) {
    match reply {
        ServerMessage::Submit(reply) => match kernel.remove(&reply.seqnum) {
            Some(Waiting::Urb(Some(length))) => {
                assert_eq!(reply.data.len(), reply.actual_length as usize);
                assert!(reply.actual_length <= length, "more bytes than the URB holds");
            }
            Some(Waiting::Urb(None)) => assert!(reply.data.is_empty(), "data for an OUT URB"),
            other => panic!("RET_SUBMIT for {} which the kernel is not waiting for ({other:?})", reply.seqnum),
        },
        ServerMessage::Unlink(reply) => match kernel.remove(&reply.seqnum) {
            Some(Waiting::Unlink(target)) => {
                let target_waits = matches!(kernel.get(&target), Some(Waiting::Urb(_)));
                if reply.status == Status::ECONNRESET {
                    assert!(target_waits, "RET_UNLINK(-ECONNRESET) for {target}, already answered");
                    kernel.remove(&target);
                } else {
                    assert!(!target_waits, "RET_UNLINK(0) before {target}'s RET_SUBMIT");
                }
            }
            other => panic!("RET_UNLINK for {} which the kernel is not waiting for ({other:?})", reply.seqnum),
        },
    }
}

/// Runs the ops in `data` (see the module docs).
pub fn storage_accelerator(data: &[u8]) {
    let mut harness = Harness {
        accelerator: Accelerator::new(DEVID),
        next_seqnum: 0,
        kernel: HashMap::new(),
        server: Vec::new(),
        data_in: true,
        now: Instant::now(),
    };
    enumerate(&mut harness);
    let mut bytes = data.iter().copied();
    let mut next = || bytes.next();
    while let Some(op) = next() {
        match op % 8 {
            0 => {
                let (Some(opcode), Some(lba), Some(blocks), Some(dir), Some(lun)) =
                    (next(), next(), next(), next(), next())
                else {
                    break;
                };
                let opcode = [0x28, 0x2a, 0x00, 0x25, 0x03, opcode][usize::from(opcode % 6)];
                harness.data_in = dir & 1 == 1;
                let mut cbw = vec![0u8; 31];
                cbw[..4].copy_from_slice(b"USBC");
                cbw[4..8].copy_from_slice(&harness.next_seqnum.to_le_bytes());
                cbw[8..12].copy_from_slice(&(u32::from(blocks) * 512).to_le_bytes());
                cbw[12] = if harness.data_in { 0x80 } else { 0 };
                cbw[13] = lun & 0x0f;
                // Six-byte commands as the SCSI scan sends them (the scan ahead matches whole blocks).
                cbw[14] = if matches!(opcode, 0x00 | 0x03 | 0x12 | 0x1a) { 6 } else { 10 };
                cbw[15] = opcode;
                cbw[17..21].copy_from_slice(&u32::from(lba).to_be_bytes());
                cbw[22..24].copy_from_slice(&u16::from(blocks).to_be_bytes());
                harness.submit(BULK_OUT, Direction::Out, [0; 8], 31, Bytes::from(cbw));
            }
            1 => {
                let (Some(hi), Some(lo)) = (next(), next()) else { break };
                let length = u32::from(u16::from_be_bytes([hi, lo]));
                match harness.data_in {
                    true => harness.submit(BULK_IN, Direction::In, [0; 8], length, Bytes::new()),
                    false => harness.submit(
                        BULK_OUT,
                        Direction::Out,
                        [0; 8],
                        length,
                        Bytes::from(vec![0xa5; length as usize]),
                    ),
                }
            }
            2 => {
                let Some(length) = next() else { break };
                harness.submit(BULK_IN, Direction::In, [0; 8], u32::from(length), Bytes::new());
            }
            3 => {
                let Some(k) = next() else { break };
                let mut waiting: Vec<u32> =
                    harness.kernel.iter().filter(|(_, w)| matches!(w, Waiting::Urb(_))).map(|(s, _)| *s).collect();
                waiting.sort_unstable();
                if let Some(&target) = waiting.get(usize::from(k) % waiting.len().max(1)) {
                    harness.next_seqnum += 1;
                    let unlink = CmdUnlink { seqnum: harness.next_seqnum, devid: DEVID, unlink_seqnum: target };
                    harness.kernel_sends(ClientMessage::Unlink(unlink));
                }
            }
            4 => {
                let (Some(k), Some(status), Some(hi), Some(lo), Some(fill), Some(csw)) =
                    (next(), next(), next(), next(), next(), next())
                else {
                    break;
                };
                let status = [0, -32, -71, -104, -75, 0][usize::from(status % 6)];
                let length = u32::from(u16::from_be_bytes([hi, lo]));
                harness.answer(usize::from(k), status, length, fill, csw & 1 == 1);
            }
            5 => harness.release(),
            6 => harness.submit(0, Direction::In, [0xa1, 0xfe, 0, 0, 0, 0, 1, 0], 1, Bytes::new()),
            _ => {
                let Some(tenths) = next() else { break };
                harness.now += Duration::from_millis(100 * u64::from(tenths));
            }
        }
    }
    // The server answers everything left: then every URB of the kernel has its answer.
    harness.release();
    while !harness.server.is_empty() {
        harness.answer(0, 0, 13, 0, true);
        harness.release();
    }
    assert!(harness.kernel.is_empty(), "the kernel still waits for {:?}", harness.kernel);
}

/// What the kernel does first: reads the configuration (a Bulk-Only interface on
/// endpoints 0x81 and 0x02) and sets it.
fn enumerate(harness: &mut Harness) {
    let configuration = ConfigurationBuilder::new(Speed::HIGH, 100)
        .interface(0, 2, 0x08, 0x06, 0x50, 0)
        .endpoint(EndpointSpec::bulk(0x80 | BULK_IN, Speed::HIGH))
        .endpoint(EndpointSpec::bulk(BULK_OUT, Speed::HIGH))
        .build();
    let length = configuration.len() as u16;
    let [low, high] = length.to_le_bytes();
    harness.submit(0, Direction::In, [0x80, 6, 0, 2, 0, 0, low, high], u32::from(length), Bytes::new());
    let get = harness.next_seqnum;
    let reply = RetSubmit {
        seqnum: get,
        status: Status::OK,
        actual_length: u32::from(length),
        start_frame: 0,
        number_of_packets: 0,
        error_count: 0,
        data: Bytes::from(configuration),
        iso_packets: Vec::new(),
    };
    harness.server.retain(|(s, ..)| *s != get);
    let kernel = &mut harness.kernel;
    harness.accelerator.server_sent(Event::Completed { reply, tag: () }, &mut |r| to_kernel(kernel, r));
    harness.submit(0, Direction::Out, [0x00, 9, 1, 0, 0, 0, 0, 0], 0, Bytes::new());
    let set = harness.next_seqnum;
    harness.server.retain(|(s, ..)| *s != set);
    let reply = RetSubmit { seqnum: set, actual_length: 0, data: Bytes::new(), ..reply_template() };
    let kernel = &mut harness.kernel;
    harness.accelerator.server_sent(Event::Completed { reply, tag: () }, &mut |r| to_kernel(kernel, r));
}

fn reply_template() -> RetSubmit {
    RetSubmit::new(0, Status::OK, Bytes::new())
}

/// storage_accelerator: a sequential stream of READs served by reads ahead, a write
/// into it, a stalled data stage, an unlinked status read.
pub(crate) fn storage_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    // READ CAPACITY (its 8 bytes, a CSW), then READs of 8 blocks, each: CBW, data, CSW.
    let mut stream = vec![0, 3, 0, 0, 1, 0, 1, 0, 8, 4, 0, 0, 0, 8, 0, 0, 4, 0, 0, 0, 13, 0, 1];
    for lba in [0u8, 8, 16, 24, 32, 40] {
        stream.extend_from_slice(&[0, 0, lba, 8, 1, 0, 1, 0x10, 0, 2, 13, 5]);
        stream.extend_from_slice(&[4, 0, 0, 0x10, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5]);
    }
    add("storage_accelerator", "stream", &[], stream.clone());
    add(
        "storage_accelerator",
        "stream_then_write",
        &[],
        [&stream[..], &[0, 1, 48, 8, 0, 0, 1, 0x10, 0, 5, 4, 0, 0, 0, 0, 0, 0]].concat(),
    );
    // Inputs that once broke an invariant (a server answering out of order, a kernel
    // unlinking what was already answered), kept as regressions.
    add(
        "storage_accelerator",
        "a_second_claim_on_the_status_read",
        &[],
        vec![
            0, 3, 0, 0, 1, 0, 1, 0, 8, 4, 0, 0, 0, 8, 0, 0, 4, 0, 0, 0, 13, 0, 1, 0, 0, 0, 8, 1, 0, 1, 16, 0, 2, 13, 5,
            4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 8, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7,
            0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 16, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0,
            13, 0, 1, 5, 0, 0, 24, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0,
            32, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 40, 8, 1, 0, 1,
            16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5,
        ],
    );
    add(
        "storage_accelerator",
        "a_cbw_answered_after_its_status",
        &[],
        vec![
            0, 3, 0, 0, 0, 0, 4, 1, 8, 4, 0, 0, 0, 8, 0, 0, 4, 0, 0, 0, 13, 0, 1, 0, 0, 0, 8, 1, 0, 1, 16, 0, 2, 13, 5,
            4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 8, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7,
            0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 16, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0,
            13, 0, 1, 5, 0, 0, 24, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0,
            32, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 40, 8, 1, 0, 1,
            16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 1, 48, 8, 0, 0, 1, 16, 0, 5, 4, 0, 0,
            0, 0, 0, 0, 8, 1, 0, 1, 255, 255, 255, 255, 1, 0, 0, 16, 0, 2, 13, 3, 0, 4, 0, 3, 0, 0, 0, 0, 5,
        ],
    );
    add(
        "storage_accelerator",
        "a_status_before_the_data_of_a_read_ahead",
        &[],
        vec![
            0, 3, 0, 72, 1, 0, 1, 0, 8, 4, 0, 0, 0, 8, 0, 0, 4, 0, 0, 0, 13, 0, 1, 0, 0, 0, 8, 1, 0, 1, 16, 0, 2, 13,
            5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 38, 241, 0, 13, 0, 1, 5, 0, 0, 8, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0,
            0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 5, 0, 0, 16, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 77, 102, 32, 228,
            208, 162, 132, 207, 37, 112, 140, 83, 216, 4, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 24, 8, 1, 0, 1,
            16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 32, 8, 1, 0, 1, 16, 0, 2, 13, 5,
            4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 40, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7,
            0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 1, 48, 8, 0, 0, 1, 16, 0, 5, 4, 0, 0, 0, 0, 0, 0, 8, 1, 0, 1, 16, 0, 4,
            1, 1, 0, 0, 0, 0, 2, 13, 3, 0, 4, 0, 3, 0, 0, 0, 0, 5,
        ],
    );
    add(
        "storage_accelerator",
        "an_unlink_held_behind_its_answered_urb",
        &[],
        vec![
            0, 3, 0, 72, 1, 0, 1, 0, 8, 4, 0, 0, 0, 8, 0, 0, 4, 0, 0, 0, 13, 0, 1, 0, 0, 0, 8, 1, 0, 1, 16, 0, 2, 13,
            5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 38, 241, 0, 13, 0, 1, 5, 0, 0, 8, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0,
            0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 5, 0, 0, 16, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 77, 102, 32, 228,
            208, 162, 132, 207, 37, 112, 140, 83, 216, 4, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 24, 8, 1, 0, 1,
            16, 0, 2, 13, 5, 4, 55, 244, 211, 113, 0, 144, 65, 97, 124, 128, 184, 7, 163, 29, 229, 208, 70, 201, 114,
            74, 116, 8, 181, 58, 149, 121, 241, 40, 15, 164, 50, 0, 0, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0,
            0, 13, 0, 1, 5, 0, 0, 0, 4, 0, 0, 1, 16, 0, 5, 4, 0, 0, 0, 0, 0, 0, 8, 1, 0, 1, 16, 0, 4, 1, 1, 0, 0, 0, 0,
            2, 13, 3, 0, 4, 0, 3, 0, 0, 0, 0, 5, 0, 1, 0, 1, 0, 8, 4, 0, 0, 0, 8, 0, 0, 4, 0, 0, 0, 13, 0, 1, 0, 0, 0,
            8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 8, 8, 1, 0, 1, 16, 0,
            2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 16, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0,
            16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 24, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0,
            0, 0, 0, 13, 0, 1, 5, 0, 0, 32, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1,
            5, 0, 0, 40, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 72, 1, 0, 1, 0,
            8, 4, 0, 0, 0, 8, 0, 0, 4, 0, 0, 0, 13, 0, 1, 0, 0, 0, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0,
            4, 0, 0, 0, 38, 241, 0, 13, 0, 1, 5, 0, 0, 8, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0,
            0, 0, 13, 5, 0, 0, 16, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 77, 102, 32, 228, 208, 162, 132, 207, 37,
            112, 140, 83, 216, 4, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 24, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0,
            16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1, 5, 0, 0, 32, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0,
            0, 0, 0, 13, 0, 1, 5, 0, 0, 40, 8, 1, 0, 1, 16, 0, 2, 13, 5, 4, 0, 0, 16, 0, 7, 0, 4, 0, 0, 0, 0, 13, 0, 1,
            5, 0, 1, 48, 8, 0, 0, 1, 16, 0, 5, 4, 0, 0, 0, 0, 0, 0, 8, 1, 0, 1, 16, 0, 4, 1, 1, 0, 0, 0, 0, 2, 13, 3,
            0, 4, 0, 3, 0, 0, 0, 0, 5,
        ],
    );
    add(
        "storage_accelerator",
        "stall_and_unlink",
        &[],
        vec![0, 0, 0, 8, 1, 0, 1, 0x10, 0, 4, 1, 1, 0, 0, 0, 0, 2, 13, 3, 0, 4, 0, 3, 0, 0, 0, 0, 5],
    );
}
