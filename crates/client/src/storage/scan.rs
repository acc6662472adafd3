//! Scan ahead: the requests Linux sends a Bulk-Only disk that just appeared
//! (usb-storage's GET_MAX_LUN; the SCSI scan's INQUIRY; the disk driver's TEST UNIT READY, READ
//! CAPACITY(10), block-zero READ and MODE SENSE, twice; the partition scan's
//! first pages), sent to LUN 0 by the accelerator as soon as the kernel set
//! a configuration with a Bulk-Only interface (or, for an interface a host
//! may drive with UAS, once usb-storage's GET_MAX_LUN came back: then that
//! one is not asked ahead). usb-storage waits (`delay_use`, 1 s by default)
//! before it asks for the LUNs and scans, so by the time each of those
//! requests comes it is answered at once instead of a round trip later. The
//! GET_MAX_LUN ahead answers the kernel's when the device answered it with
//! its one byte, at most [`FRESH`] before, for the same interface, with no
//! new configuration since; a device that stalls it (one LUN) stalls the kernel's own.
//!
//! A kernel command is answered from one of them only if it is that command
//! but for the tag; the device passed it whole (every byte, a CSW with status
//! 0 and no residue: a failure is never replayed, its sense data would be
//! gone); it was sent at most [`FRESH`] ago; and only commands that leave
//! the medium as it is reached the device since. Each answers one command.
//! The first of the kernel's read-only commands that none of them answers
//! ends the scan ahead (the kernel is off the script), as does any command
//! that could change the medium, a reply of ours that did not pass, or a new
//! configuration. What the device then holds for the kernel is what a local
//! host would find, with one exception: a UNIT ATTENTION the scan ahead met
//! (a reset the device reports once) is not reported again; Linux retries
//! on one at scan time and does nothing else with it.
//!
//! This module owns the script, its commands' replies and when they may be
//! used; the accelerator (`storage`) sends them and serves from them. Not
//! for reads of a stream (`ahead`), nor for another host's scan (its
//! commands miss, and cost nothing but the device's time).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use usbwire_proto::urb::{CmdSubmit, RetSubmit};
use usbwire_proto::Status;

use super::ahead::{self, Speculation};
use super::pipes::{Interfaces, Pipes};

/// How long after they were sent the scan's answers may be used: past
/// usb-storage's default `delay_use` of 1 s and a slow guest's scan.
pub(super) const FRESH: Duration = Duration::from_secs(5);
/// Tags of the scan's command blocks: told apart from the kernel's and the reads ahead's in captures.
const TAG_BASE: u32 = 0x5b00_0000;
/// The Bulk-Only GET_MAX_LUN request: class, to the interface, IN, one byte.
const GET_MAX_LUN: [u8; 2] = [0xa1, 0xfe];

const INQUIRY: &[u8] = &[0x12, 0, 0, 0, 36, 0];
const TEST_UNIT_READY: &[u8] = &[0; 6];
const READ_CAPACITY_10: &[u8] = &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// MODE SENSE(6) of every page, 192 bytes: the disk driver's write-protect
/// and cache probes (usb-storage asks for 192 bytes, as Windows does).
const MODE_SENSE_ALL: &[u8] = &[0x1a, 0, 0x3f, 0, 192, 0];
/// The page the block layer reads a partition table through, in bytes.
const PAGE: u32 = 4096;
/// The pages Linux's partition scan reads of a disk without a partition
/// table (the MBR and GPT headers in page 0; Amiga's and Ultrix's labels in 1 and 3).
const PARTITION_PAGES: [u32; 3] = [0, 1, 3];

/// Where the scan ahead stands.
#[derive(Clone, Copy, Debug, Default)]
enum Phase {
    #[default]
    Off,
    /// The kernel's GET_MAX_LUN (its seqnum) is out.
    Asked(u32, Pipes),
    /// It came back, or (`ask_luns`) the kernel set the configuration: the
    /// first commands go out next, and the GET_MAX_LUN ahead with them if asked.
    Wanted { pipes: Pipes, ask_luns: bool },
    /// The first commands went out at `at`; those that need the block
    /// length follow once READ CAPACITY passed.
    First { pipes: Pipes, at: Instant },
    /// Every command went out, the first at `at`.
    Second { at: Instant },
}

#[derive(Debug, Default)]
pub(super) struct ScanAhead {
    phase: Phase,
    entries: Vec<Speculation>,
    /// The GET_MAX_LUN ahead: its seqnum, its interface and the device's reply once here.
    max_lun: Option<MaxLunAhead>,
    tag: u32,
}

#[derive(Debug)]
struct MaxLunAhead {
    seqnum: u32,
    interface: u8,
    reply: Option<RetSubmit>,
}

/// What the scan ahead sends now: its command blocks to `pipes`, and with the
/// first of them the GET_MAX_LUN ahead (its setup packet) when it is asked.
pub(super) struct Due {
    pub(super) pipes: Pipes,
    pub(super) commands: Vec<[u8; 31]>,
    pub(super) max_lun: Option<[u8; 8]>,
}

/// Whether a control request is usb-storage's GET_MAX_LUN.
pub(super) fn is_get_max_lun(submit: &CmdSubmit) -> bool {
    submit.setup[..2] == GET_MAX_LUN && submit.setup[6..8] == [1, 0]
}

impl ScanAhead {
    /// The kernel set a configuration whose Bulk-Only interface `pipes`
    /// usb-storage will drive: it waits (`delay_use`), asks for the LUNs,
    /// then scans. The scan ahead starts now. Call it with nothing left of an
    /// earlier scan.
    pub(super) fn configured(&mut self, pipes: Pipes) {
        self.phase = Phase::Wanted { pipes, ask_luns: true };
    }

    /// The kernel asked a Bulk-Only interface for its LUNs (`submit`) with
    /// no scan ahead on (usb-storage probing again, without a new
    /// configuration): its scan follows the reply.
    pub(super) fn asked(&mut self, submit: &CmdSubmit, interfaces: &Interfaces) {
        if self.is_on() {
            return;
        }
        self.phase = match interfaces.active_interface(submit.setup[4]) {
            Some(pipes) => Phase::Asked(submit.seqnum, pipes),
            None => Phase::Off,
        };
    }

    /// A reply on its way to the kernel: the GET_MAX_LUN's starts the scan ahead.
    pub(super) fn learn(&mut self, reply: &RetSubmit) {
        if let Phase::Asked(seqnum, pipes) = self.phase {
            if reply.seqnum == seqnum {
                let answered = reply.status == Status::OK && reply.data.len() == 1;
                self.phase = if answered { Phase::Wanted { pipes, ask_luns: false } } else { Phase::Off };
            }
        }
    }

    /// What to send now: the first command blocks (and the GET_MAX_LUN
    /// ahead) once the configuration was set or the kernel's GET_MAX_LUN came
    /// back, the rest once READ CAPACITY passed.
    pub(super) fn due(&mut self, now: Instant) -> Option<Due> {
        match self.phase {
            Phase::Wanted { pipes, ask_luns } => {
                self.phase = Phase::First { pipes, at: now };
                let mut commands = vec![self.command(INQUIRY, 36)];
                commands.extend((0..4).map(|_| self.command(TEST_UNIT_READY, 0)));
                commands.extend((0..2).map(|_| self.command(READ_CAPACITY_10, 8)));
                commands.extend((0..4).map(|_| self.command(MODE_SENSE_ALL, 192)));
                let [interface_low, interface_high] = u16::from(pipes.interface).to_le_bytes();
                let max_lun =
                    ask_luns.then_some([GET_MAX_LUN[0], GET_MAX_LUN[1], 0, 0, interface_low, interface_high, 1, 0]);
                Some(Due { pipes, commands, max_lun })
            }
            Phase::First { pipes, at } => {
                let capacity = self.entries.iter().find(|entry| entry.cbw[15] == 0x25 && passed(entry))?;
                let data = capacity.results[1].as_ref().map(|reply| reply.data.clone())?;
                self.phase = Phase::Second { at };
                Some(Due { pipes, commands: self.reads(&data), max_lun: None })
            }
            _ => None,
        }
    }

    /// The GET_MAX_LUN ahead went out as `seqnum` to `interface`.
    pub(super) fn asked_luns(&mut self, seqnum: u32, interface: u8) {
        self.max_lun = Some(MaxLunAhead { seqnum, interface, reply: None });
    }

    /// The device's answer to the GET_MAX_LUN ahead that answers the kernel's
    /// `submit` now, taken: one byte, fresh, for the same interface.
    pub(super) fn take_max_lun(&mut self, submit: &CmdSubmit, now: Option<Instant>) -> Option<RetSubmit> {
        let (Phase::First { at: sent, .. } | Phase::Second { at: sent }) = self.phase else { return None };
        if now?.saturating_duration_since(sent) > FRESH || !is_get_max_lun(submit) {
            return None;
        }
        let asked = self.max_lun.as_ref()?;
        let reply = asked.reply.as_ref()?;
        let answers = asked.interface == submit.setup[4]
            && submit.setup[2..6] == [0, 0, asked.interface, 0]
            && reply.status == Status::OK
            && reply.data.len() == 1;
        answers.then(|| self.max_lun.take().and_then(|asked| asked.reply))?
    }

    /// The READs that need the block length (from READ CAPACITY(10)'s
    /// `capacity`): block zero, twice, and the partition scan's pages.
    fn reads(&mut self, capacity: &[u8]) -> Vec<[u8; 31]> {
        let Some(&[a, b, c, d, e, f, g, h]) = capacity.get(..8).and_then(|bytes| <&[u8; 8]>::try_from(bytes).ok())
        else {
            return Vec::new();
        };
        let last_lba = u32::from_be_bytes([a, b, c, d]);
        let block_length = u32::from_be_bytes([e, f, g, h]);
        if ![512, 1024, 2048, 4096].contains(&block_length) {
            return Vec::new();
        }
        let per_page = PAGE / block_length;
        let mut reads = Vec::new();
        for _ in 0..2 {
            reads.push(self.command(&read_10(0, 1), block_length));
        }
        for page in PARTITION_PAGES {
            let lba = page * per_page;
            if lba + per_page - 1 <= last_lba {
                reads.push(self.command(&read_10(lba, per_page), PAGE));
            }
        }
        reads
    }

    /// A command block of ours to LUN 0: `cdb`, `length` bytes in (or none).
    fn command(&mut self, cdb: &[u8], length: u32) -> [u8; 31] {
        self.tag = self.tag.wrapping_add(1);
        let mut cbw = [0u8; 31];
        cbw[..4].copy_from_slice(b"USBC");
        cbw[4..8].copy_from_slice(&(TAG_BASE | (self.tag & 0x00ff_ffff)).to_le_bytes());
        cbw[8..12].copy_from_slice(&length.to_le_bytes());
        cbw[12] = if length > 0 { 0x80 } else { 0 };
        cbw[14] = cdb.len() as u8;
        cbw[15..15 + cdb.len()].copy_from_slice(cdb);
        cbw
    }

    pub(super) fn issued(&mut self, speculation: Speculation) {
        self.entries.push(speculation);
    }

    /// Keeps a reply to one of the scan's requests; `Err` if it is not one of theirs.
    pub(super) fn store(&mut self, reply: RetSubmit) -> Result<(), RetSubmit> {
        if let Some(asked) = self.max_lun.as_mut().filter(|asked| asked.seqnum == reply.seqnum) {
            asked.reply = Some(reply);
            return Ok(());
        }
        ahead::store_reply(&mut self.entries, reply)
    }

    /// Whether a reply came that did not pass: the scan ahead must end.
    pub(super) fn spoiled(&self) -> bool {
        self.entries.iter().any(|entry| stages_passed(entry).contains(&Some(false)))
    }

    /// Whether a command of the scan failed on the device (not merely skipped).
    pub(super) fn failed(&self) -> bool {
        self.entries.iter().any(Speculation::failed)
    }

    /// Whether a request of the scan still waits for a reply.
    pub(super) fn in_flight(&self) -> bool {
        self.max_lun.as_ref().is_some_and(|asked| asked.reply.is_none())
            || self.entries.iter().any(|entry| entry.results.iter().any(Option::is_none))
    }

    /// Whether the scan ahead is under way (asked for, or holding commands).
    pub(super) fn is_on(&self) -> bool {
        !self.entries.is_empty() || !matches!(self.phase, Phase::Off)
    }

    /// Whether one of the scan's commands answers the kernel's command block `cbw` now.
    pub(super) fn serves(&self, cbw: &[u8], now: Option<Instant>) -> bool {
        self.usable(cbw, now).is_some()
    }

    /// The command that answers the kernel's command block `cbw` now, taken.
    pub(super) fn take(&mut self, cbw: &[u8], now: Option<Instant>) -> Option<Speculation> {
        let at = self.usable(cbw, now)?;
        Some(self.entries.remove(at))
    }

    fn usable(&self, cbw: &[u8], now: Option<Instant>) -> Option<usize> {
        let (Phase::First { at: sent, .. } | Phase::Second { at: sent }) = self.phase else { return None };
        if now?.saturating_duration_since(sent) > FRESH || self.spoiled() {
            return None;
        }
        let wanted = cbw.get(8..)?;
        self.entries.iter().position(|entry| entry.cbw[8..] == *wanted && passed(entry))
    }

    /// Ends the scan ahead: replies still to come go to `ignored`. Returns
    /// the bytes read for nothing, and whether a command failed on the
    /// device (it then wants a reset recovery).
    pub(super) fn drop_all(&mut self, ignored: &mut HashSet<u32>) -> (u64, bool) {
        self.phase = Phase::Off;
        if let Some(asked) = self.max_lun.take().filter(|asked| asked.reply.is_none()) {
            ignored.insert(asked.seqnum);
        }
        let (mut wasted, mut failed) = (0, false);
        for entry in self.entries.drain(..) {
            wasted += u64::from(entry.length);
            for (seqnum, result) in entry.seqnums.iter().zip(&entry.results) {
                if result.is_none() {
                    ignored.insert(*seqnum);
                }
            }
            failed |= entry.failed();
        }
        (wasted, failed)
    }
}

/// Whether each reply that came is what a command that passed gives: the
/// block taken; the data stage done, short or not (MODE SENSE answers less
/// than the 192 bytes asked); a CSW with status 0 whose residue is what the
/// data stage left. The CSW's `None` until the data stage is here.
fn stages_passed(entry: &Speculation) -> [Option<bool>; 3] {
    let [block, data, csw] = &entry.results;
    let moved = data.as_ref().map(|data| data.data.len() as u32);
    [
        block.as_ref().map(|block| block.status == Status::OK),
        data.as_ref().map(|data| data.status == Status::OK && data.data.len() as u32 <= entry.length),
        csw.as_ref().zip(moved).map(|(csw, moved)| {
            let residue = csw.data.get(8..12).map(|r| u32::from_le_bytes([r[0], r[1], r[2], r[3]]));
            csw.status == Status::OK
                && csw.data.len() == 13
                && csw.data.starts_with(b"USBS")
                && csw.data[12] == 0
                && residue == Some(entry.length - moved)
        }),
    ]
}

/// Whether every stage came back and the command passed.
fn passed(entry: &Speculation) -> bool {
    stages_passed(entry) == [Some(true); 3]
}

/// A READ(10) of `blocks` at `lba`.
fn read_10(lba: u32, blocks: u32) -> [u8; 10] {
    let mut cdb = [0x28, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    cdb[7..9].copy_from_slice(&(blocks as u16).to_be_bytes());
    cdb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_is_the_command_blocks_linux_sends_a_new_disk() {
        // As Linux 6.1's usb-storage sent them to a 64 MiB disk (from a server's trace).
        let mut scan = ScanAhead::default();
        let inquiry = scan.command(INQUIRY, 36);
        assert_eq!(inquiry[8..], [36, 0, 0, 0, 0x80, 0, 6, 0x12, 0, 0, 0, 36, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let reads = scan.reads(&[0, 1, 0xff, 0xff, 0, 0, 2, 0]);
        let cdbs: Vec<&[u8]> = reads.iter().map(|cbw| &cbw[15..25]).collect();
        assert_eq!(
            cdbs,
            [
                &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0][..],
                &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0],
                &[0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0],
                &[0x28, 0, 0, 0, 0, 8, 0, 0, 8, 0],
                &[0x28, 0, 0, 0, 0, 24, 0, 0, 8, 0],
            ]
        );
        assert_eq!(u32::from_le_bytes([reads[0][8], reads[0][9], reads[0][10], reads[0][11]]), 512);
        assert_eq!(u32::from_le_bytes([reads[2][8], reads[2][9], reads[2][10], reads[2][11]]), 4096);
        assert_eq!(scan.reads(&[0, 0, 0, 7, 0, 0, 2, 0]).len(), 3, "an 8-block disk: block zero and its first page");
        assert_eq!(scan.reads(&[0, 0, 0, 6, 0, 0, 2, 0]).len(), 2, "7 blocks: block zero alone");
        assert!(scan.reads(&[0, 1, 0xff, 0xff, 0, 0, 2, 1]).is_empty(), "513-byte blocks: nothing guessed");
    }

    #[test]
    fn the_get_max_lun_ahead_answers_the_kernels_once_when_the_device_gave_its_byte_in_time() {
        let pipes = Pipes { interface: 2, bulk_out: 1, bulk_in: 2 };
        let kernels = |interface: u8| {
            CmdSubmit::new(
                9,
                1,
                usbwire_proto::Direction::In,
                0,
                1,
                [0xa1, 0xfe, 0, 0, interface, 0, 1, 0],
                bytes::Bytes::new(),
            )
        };
        let start = Instant::now();
        let asked = |reply: RetSubmit| {
            let mut scan = ScanAhead::default();
            scan.configured(pipes);
            let due = scan.due(start).expect("the first requests are due at the configuration");
            assert_eq!(due.max_lun, Some([0xa1, 0xfe, 0, 0, 2, 0, 1, 0]), "to the Bulk-Only interface");
            scan.asked_luns(reply.seqnum, pipes.interface);
            assert!(scan.in_flight());
            assert_eq!(scan.store(reply), Ok(()));
            scan
        };
        let byte = RetSubmit::new(0x8000_0001, Status::OK, bytes::Bytes::from_static(&[3]));
        let second = Some(start + Duration::from_secs(1));

        let mut scan = asked(byte.clone());
        assert_eq!(scan.take_max_lun(&kernels(0), second), None, "another interface's");
        assert_eq!(scan.take_max_lun(&kernels(2), second).map(|reply| reply.data), Some(byte.data.clone()));
        assert_eq!(scan.take_max_lun(&kernels(2), second), None, "used once");

        let mut scan = asked(byte.clone());
        assert_eq!(scan.take_max_lun(&kernels(2), Some(start + FRESH + Duration::from_millis(1))), None, "too old");

        let stalled = RetSubmit::new(0x8000_0001, Status::EPIPE, bytes::Bytes::new());
        assert_eq!(asked(stalled).take_max_lun(&kernels(2), second), None, "a stall goes to the device again");

        let mut scan = asked(byte);
        scan.drop_all(&mut HashSet::new());
        assert_eq!(scan.take_max_lun(&kernels(2), second), None, "the scan ahead ended (a new configuration)");
    }

    #[test]
    fn get_max_lun_is_known_by_its_setup_packet() {
        let mut submit = CmdSubmit::new(
            7,
            1,
            usbwire_proto::Direction::In,
            0,
            1,
            [0xa1, 0xfe, 0, 0, 0, 0, 1, 0],
            bytes::Bytes::new(),
        );
        assert!(is_get_max_lun(&submit));
        submit.setup = [0x21, 0xff, 0, 0, 0, 0, 0, 0];
        assert!(!is_get_max_lun(&submit), "the Bulk-Only reset is not");
    }
}
