//! Read-ahead for the storage accelerator: when the kernel reads a LUN
//! sequentially (READ(10) or READ(16), each starting where the last ended),
//! commands for the next ranges go to the device before the kernel asks. A
//! kernel READ identical to the first of them (the same command block but
//! for the tag) is answered from what they brought, as they bring it; a READ
//! of another size that starts where the last one served stopped is answered
//! from slices of the first ones once every one it needs came back whole and
//! passed (its CSW is theirs, with the kernel's tag). This module owns the
//! queue of those commands, the stream they follow, the window and each
//! LUN's capacity; the accelerator (`storage`) decides when to match, issue
//! and drop them. It is not for writes: anything that is not known to be
//! read-only drops every read ahead before it is sent, so nothing read
//! before it can be served after it.

use std::collections::{HashSet, VecDeque};

use bytes::{Bytes, BytesMut};
use usbwire_proto::storage;
use usbwire_proto::urb::RetSubmit;
use usbwire_proto::Status;

use super::pipes::Pipes;

/// The most a device's reads ahead may hold, sent or arrived, in bytes.
pub(super) const BUDGET_BYTES: u32 = 8 << 20;
/// Commands ahead once a sequential stream is seen; doubles with every hit.
const FIRST_WINDOW: usize = 2;
/// Sequential READs in a row that no read ahead served, past which the
/// stream counts as unpredictable (sizes that vary from READ to READ) and
/// one command at a time is read ahead: a stream opening and a split
/// request's last command miss at most twice in a row.
const PREDICTABLE_MISSES: u32 = 2;
/// Tags of our own command blocks: told apart from the kernel's in captures.
const TAG_BASE: u32 = 0x5a00_0000;

const READ_10: u8 = 0x28;
const READ_16: u8 = 0x88;

/// A READ a command block carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Read {
    lun: u8,
    lba: u64,
    blocks: u32,
}

/// Whether a kernel READ was served by a read ahead, and whether its data
/// was already here then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Served {
    No,
    /// Its data was still on its way: the kernel waited.
    Waited,
    /// Its data was here.
    Ready,
}

/// A read ahead: its command block (with our tag), its three URBs' seqnums
/// (CBW, data, CSW) and their replies as they arrive.
#[derive(Debug)]
pub(super) struct Speculation {
    pub(super) cbw: [u8; 31],
    pub(super) length: u32,
    pub(super) seqnums: [u32; 3],
    pub(super) results: [Option<RetSubmit>; 3],
    /// Its first blocks already served as slices to kernel READs of other sizes.
    pub(super) served_blocks: u32,
}

/// How the reads ahead stand to a kernel READ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cover {
    /// The first read ahead is the kernel's command but for the tag.
    Exact,
    /// The first `count` reads ahead hold the kernel's range, from where the
    /// last READ served stopped; `ready` once each came back whole and passed.
    Slices { count: usize, ready: bool },
    /// The kernel's range starts where the last READ served stopped, but
    /// `blocks` of it from `from` (where the last read ahead ends) are not
    /// asked for yet.
    Short { from: u64, blocks: u32 },
}

/// A kernel READ answered from reads ahead.
#[derive(Debug)]
pub(super) enum Taken {
    /// The first read ahead, whose replies are the kernel's command's.
    Exact(Speculation),
    /// Slices of the first ones, every one of which passed: the data stage's
    /// reply, the CSW (the last of them's), and two seqnums of theirs that
    /// no reply will come for any more.
    Slices { data: RetSubmit, status: RetSubmit, seqnums: [u32; 2] },
}

impl Speculation {
    pub(super) fn new(cbw: [u8; 31], length: u32, seqnums: [u32; 3]) -> Self {
        Self { cbw, length, seqnums, results: Default::default(), served_blocks: 0 }
    }

    /// A command without a data stage: two URBs, the command block's and
    /// the CSW's; its data stage counts as passed, empty.
    pub(super) fn without_data(cbw: [u8; 31], [block, status]: [u32; 2]) -> Self {
        let no_data = RetSubmit::new(block, Status::OK, Bytes::new());
        Self { cbw, length: 0, seqnums: [block, block, status], results: [None, Some(no_data), None], served_blocks: 0 }
    }

    /// Its blocks not yet served, from the first: (LUN, LBA, blocks, block length).
    fn unserved(&self) -> Option<(u8, u64, u32, u32)> {
        let range = read(&self.cbw)?;
        let block_length = self.length.checked_div(range.blocks)?;
        let blocks = range.blocks.checked_sub(self.served_blocks)?;
        Some((range.lun, range.lba + u64::from(self.served_blocks), blocks, block_length))
    }

    /// Whether each reply that came is what a command that passed whole
    /// gives: the block taken, every byte asked for, a CSW with status 0 and
    /// no residue. `None` for a stage still to come.
    fn stages_whole(&self) -> [Option<bool>; 3] {
        let [block, data, csw] = &self.results;
        [
            block.as_ref().map(|block| block.status == Status::OK),
            data.as_ref().map(|data| data.status == Status::OK && data.data.len() == self.length as usize),
            csw.as_ref().map(|csw| {
                csw.status == Status::OK
                    && csw.data.len() == 13
                    && csw.data.starts_with(b"USBS")
                    && csw.data[8..13] == [0; 5]
            }),
        ]
    }

    /// Whether every stage came back and the command passed whole.
    fn passed_whole(&self) -> bool {
        self.stages_whole() == [Some(true); 3]
    }

    /// Whether a reply came that rules it out of serving slices.
    fn spoiled(&self) -> bool {
        self.stages_whole().contains(&Some(false))
    }

    /// Whether a stage of it failed on the device (not merely skipped),
    /// leaving it halted or owing a status.
    pub(super) fn failed(&self) -> bool {
        self.results.iter().flatten().any(|reply| ![Status::OK, storage::SKIPPED].contains(&reply.status))
    }

    /// Whether its command block was refused (or skipped): nothing of it is worth serving.
    fn is_dead(&self) -> bool {
        self.results[0].as_ref().is_some_and(|cbw| cbw.status != Status::OK)
    }
}

/// The stream the reads ahead continue.
#[derive(Debug)]
struct Stream {
    /// The kernel's last READ's command block: the reads ahead are copies with another LBA.
    template: [u8; 31],
    pipes: Pipes,
    /// The kernel's last READ.
    read: Read,
    /// Blocks each read ahead asks for (the template's).
    blocks: u32,
    /// Where the next read ahead starts.
    next_lba: u64,
    /// How the kernel splits its requests, once seen: `longs` READs of
    /// `blocks`, then one of `last` blocks.
    split: Option<Split>,
    /// Reads of `blocks` in a row, since the last shorter one.
    longs_seen: u32,
    /// Where the next read ahead falls in `split`: how many longs of the
    /// current request are already asked for.
    longs_issued: u32,
}

/// A request split into commands: `longs` of the stream's size, then `last`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Split {
    longs: u32,
    last: u32,
}

#[derive(Debug, Default)]
pub(super) struct ReadAhead {
    queue: VecDeque<Speculation>,
    stream: Option<Stream>,
    /// Reads ahead allowed now.
    window: usize,
    /// The last LBA of each LUN, from READ CAPACITY: nothing is read ahead past it.
    last_lba: [Option<u64>; 16],
    tag: u32,
    /// Sequential READs in a row that no read ahead served.
    sequential_misses: u32,
}

impl ReadAhead {
    /// How the reads ahead stand to the kernel's command block `cbw`: the
    /// first is that command but for the tag (and not refused); or the first
    /// ones hold its range from where the last READ served stopped, none of
    /// them spoiled, and it is their command in all but tag and range.
    pub(super) fn cover(&self, cbw: &[u8]) -> Option<Cover> {
        let front = self.queue.front()?;
        if cbw.len() != 31 {
            return None;
        }
        if front.served_blocks == 0 && front.cbw[8..] == cbw[8..] && !front.is_dead() {
            return Some(Cover::Exact);
        }
        let wanted = read(cbw)?;
        let (lun, mut lba, _, _) = front.unserved()?;
        let front_range = read(&front.cbw)?;
        let same_command = with_range(&front.cbw, front_range.blocks, wanted.lba, wanted.blocks)?;
        if same_command[8..] != cbw[8..] || (lun, lba) != (wanted.lun, wanted.lba) {
            return None;
        }
        let (mut held, mut ready) = (0u64, true);
        for (count, speculation) in self.queue.iter().enumerate() {
            let (its_lun, its_lba, blocks, _) = speculation.unserved()?;
            if its_lun != lun || its_lba != lba || speculation.spoiled() {
                return None;
            }
            ready &= speculation.passed_whole();
            held += u64::from(blocks);
            lba += u64::from(blocks);
            if held >= u64::from(wanted.blocks) {
                return Some(Cover::Slices { count: count + 1, ready });
            }
        }
        let blocks = u32::try_from(u64::from(wanted.blocks) - held).ok()?;
        Some(Cover::Short { from: lba, blocks })
    }

    /// The read ahead that completes what the reads ahead hold of the
    /// kernel's READ `cbw`, when they hold its start but not its end (a READ
    /// longer than theirs): its command block (with a fresh tag), length and
    /// pipes. The kernel's READ then waits for it and is served in slices,
    /// rather than dropping what was read ahead for it. Never more than
    /// [`BUDGET_BYTES`] at once.
    pub(super) fn complete(&mut self, cbw: &[u8]) -> Option<([u8; 31], u32, Pipes)> {
        let Some(Cover::Short { from, blocks }) = self.cover(cbw) else { return None };
        let stream = self.stream.as_mut()?;
        let last = self.last_lba[usize::from(stream.read.lun & 0x0f)]?;
        let end = from.checked_add(u64::from(blocks))?;
        if stream.next_lba != from || end - 1 > last {
            return None;
        }
        let cbw = with_range(&stream.template, stream.blocks, from, blocks)?;
        if template_length(&cbw) > BUDGET_BYTES {
            // Larger than a device's reads ahead may hold: the READ goes to the device itself.
            return None;
        }
        stream.next_lba = end;
        let pipes = stream.pipes;
        Some(self.tagged(cbw, pipes))
    }

    /// Whether the reads ahead answer the kernel's command block `cbw` now
    /// (see [`Self::cover`]): the first is that command, or the slices it
    /// needs all came back whole.
    pub(super) fn serves(&self, cbw: &[u8]) -> bool {
        matches!(self.cover(cbw), Some(Cover::Exact | Cover::Slices { ready: true, .. }))
    }

    /// The answer to the kernel's command block `cbw` from the reads ahead,
    /// taking what it used: the first read ahead itself, or slices of the
    /// first ones when all came back whole.
    pub(super) fn take(&mut self, cbw: &[u8]) -> Option<Taken> {
        match self.cover(cbw)? {
            Cover::Exact => self.queue.pop_front().map(Taken::Exact),
            Cover::Slices { ready: false, .. } | Cover::Short { .. } => None,
            Cover::Slices { count, ready: true } => {
                let wanted = read(cbw)?;
                let mut left = wanted.blocks;
                let mut pieces: Vec<Bytes> = Vec::with_capacity(count);
                let mut status = None;
                let mut seqnums = None;
                while left > 0 {
                    let front = self.queue.front_mut()?;
                    let (_, _, blocks, block_length) = front.unserved()?;
                    let [_, Some(data), Some(csw)] = &front.results else { return None };
                    let taken = blocks.min(left);
                    let from = (front.served_blocks * block_length) as usize;
                    pieces.push(data.data.slice(from..from + (taken * block_length) as usize));
                    status = Some(csw.clone());
                    seqnums.get_or_insert([front.seqnums[1], front.seqnums[2]]);
                    front.served_blocks += taken;
                    left -= taken;
                    if taken == blocks {
                        self.queue.pop_front();
                    }
                }
                let data = match pieces.as_slice() {
                    [one] => one.clone(),
                    _ => pieces
                        .iter()
                        .fold(BytesMut::new(), |mut all, piece| {
                            all.extend_from_slice(piece);
                            all
                        })
                        .freeze(),
                };
                Some(Taken::Slices { data: RetSubmit::new(0, Status::OK, data), status: status?, seqnums: seqnums? })
            }
        }
    }

    /// Whether a read ahead failed on the device (not merely skipped).
    pub(super) fn failed(&self) -> bool {
        self.queue.iter().any(Speculation::failed)
    }

    /// Whether a read ahead still waits for a reply.
    pub(super) fn in_flight(&self) -> bool {
        self.queue.iter().any(|speculation| speculation.results.iter().any(Option::is_none))
    }

    /// The kernel read `read`, served by the first read ahead or not
    /// (`served`): follows the stream, and sizes the window — doubled when
    /// the kernel had to wait for the read ahead that served it, or will for
    /// the next (not enough in flight to cover the round trip), kept when
    /// the data is here ahead of it, opened (or kept) on a sequential read
    /// that missed, closed on a seek. Never more than [`BUDGET_BYTES`] of the stream's longest READs.
    pub(super) fn observe(&mut self, read: Read, cbw: &[u8], pipes: Pipes, served: Served) {
        let hit = served != Served::No;
        let length = u32::from_le_bytes([cbw[8], cbw[9], cbw[10], cbw[11]]);
        let longest = self.stream.as_ref().map_or(0, |stream| template_length(&stream.template)).max(length);
        let most = (BUDGET_BYTES / longest.max(1)).max(1) as usize;
        let sequential = self.stream.as_ref().is_some_and(|stream| {
            stream.read.lun == read.lun && stream.read.lba + u64::from(stream.read.blocks) == read.lba
        });
        // The next read ahead not here yet: the kernel will wait for it.
        let next_late = self.queue.front().is_none_or(|next| next.results[1].is_none());
        self.sequential_misses = if !hit && sequential { self.sequential_misses.saturating_add(1) } else { 0 };
        self.window = match (served, sequential) {
            (Served::Waited, _) => (self.window * 2).clamp(FIRST_WINDOW, most),
            (Served::Ready, _) if next_late => (self.window * 2).clamp(FIRST_WINDOW, most),
            (Served::Ready, _) => self.window.clamp(FIRST_WINDOW, most),
            // Sizes that keep changing: every read ahead would be wasted; one
            // at a time finds out whether the stream settles (a hit doubles it).
            (Served::No, true) if self.sequential_misses > PREDICTABLE_MISSES => 1,
            // The same stream in another size (a split request's last command): as wide as before.
            (Served::No, true) => self.window.max(FIRST_WINDOW).min(most),
            (Served::No, false) => 0,
        };
        // The reads ahead copy the longest READ of the stream. A request the
        // block layer split ends in a shorter READ, and the next request's
        // commands are the long ones again: once seen, that split is what
        // the reads ahead follow, the short one included.
        let mut template = [0u8; 31];
        template.copy_from_slice(&cbw[..31]);
        let previous = self.stream.take().filter(|_| sequential);
        let mut stream = Stream {
            template,
            pipes,
            read,
            blocks: read.blocks,
            next_lba: read.lba + u64::from(read.blocks),
            split: None,
            longs_seen: 1,
            longs_issued: 0,
        };
        if let Some(previous) = previous {
            if hit {
                // The reads ahead go on as they were; the count of longs follows the kernel.
                let longs_seen = if read.blocks == previous.blocks { previous.longs_seen + 1 } else { 0 };
                stream = Stream { read, longs_seen, ..previous };
            } else if read.blocks < previous.blocks {
                let split = Split { longs: previous.longs_seen, last: read.blocks };
                stream = Stream {
                    template: previous.template,
                    blocks: previous.blocks,
                    split: Some(split),
                    longs_seen: 0,
                    longs_issued: 0,
                    ..stream
                };
            } else if read.blocks == previous.blocks {
                stream.split = previous.split;
                stream.longs_seen = previous.longs_seen + 1;
                stream.longs_issued = previous.longs_seen + 1;
            }
        }
        self.stream = Some(stream);
    }

    /// The next read ahead to send, while the window and the LUN's capacity allow:
    /// its command block (with a fresh tag), length and pipes.
    pub(super) fn next(&mut self) -> Option<([u8; 31], u32, Pipes)> {
        if self.queue.len() >= self.window {
            return None;
        }
        let stream = self.stream.as_mut()?;
        let last = self.last_lba[usize::from(stream.read.lun & 0x0f)]?;
        let short = stream.split.filter(|split| stream.longs_issued >= split.longs);
        let blocks = short.map_or(stream.blocks, |split| split.last);
        let end = stream.next_lba.checked_add(u64::from(blocks))?;
        if blocks == 0 || end - 1 > last {
            return None;
        }
        let cbw = with_range(&stream.template, stream.blocks, stream.next_lba, blocks)?;
        stream.next_lba = end;
        stream.longs_issued = if short.is_some() { 0 } else { stream.longs_issued + 1 };
        let pipes = stream.pipes;
        Some(self.tagged(cbw, pipes))
    }

    /// A read ahead's command block with a tag of ours, its length, its pipes.
    fn tagged(&mut self, mut cbw: [u8; 31], pipes: Pipes) -> ([u8; 31], u32, Pipes) {
        self.tag = self.tag.wrapping_add(1);
        cbw[4..8].copy_from_slice(&(TAG_BASE | (self.tag & 0x00ff_ffff)).to_le_bytes());
        (cbw, template_length(&cbw), pipes)
    }

    /// Reads ahead allowed now.
    #[cfg(test)]
    pub(super) fn window(&self) -> usize {
        self.window
    }

    pub(super) fn issued(&mut self, speculation: Speculation) {
        self.queue.push_back(speculation);
    }

    /// Keeps a reply to one of the reads ahead; `Err` if it is not one of theirs.
    pub(super) fn store(&mut self, reply: RetSubmit) -> Result<(), RetSubmit> {
        store_reply(&mut self.queue, reply)
    }

    /// Drops every read ahead: replies still to come go to `ignored`. Returns
    /// the bytes they read (or would have) for nothing, and whether one of
    /// them failed on the device (not merely skipped), leaving it halted or
    /// owing a status: then it wants a reset recovery.
    pub(super) fn drop_all(&mut self, ignored: &mut HashSet<u32>) -> (u64, bool) {
        let (mut wasted, mut failed) = (0, false);
        for speculation in self.queue.drain(..) {
            wasted += speculation.unserved().map_or(u64::from(speculation.length), |(_, _, blocks, block_length)| {
                u64::from(blocks) * u64::from(block_length)
            });
            for (seqnum, result) in speculation.seqnums.iter().zip(&speculation.results) {
                if result.is_none() {
                    ignored.insert(*seqnum);
                }
            }
            failed |= speculation.failed();
        }
        (wasted, failed)
    }

    /// Forgets the stream: nothing is read ahead until the kernel reads
    /// sequentially again.
    pub(super) fn forget_stream(&mut self) {
        self.window = 0;
        self.stream = None;
    }

    /// Learns a LUN's capacity from the data of a READ CAPACITY the kernel sent.
    pub(super) fn learn_capacity(&mut self, cbw: &[u8], data: &[u8]) {
        let lun = usize::from(cbw[13] & 0x0f);
        let last = match (cbw[15], cbw[16] & 0x1f) {
            (0x25, _) if data.len() >= 8 => u64::from(u32::from_be_bytes([data[0], data[1], data[2], data[3]])),
            (0x9e, 0x10) if data.len() >= 12 => u64::from_be_bytes(data[..8].try_into().unwrap_or([0xff; 8])),
            _ => return,
        };
        self.last_lba[lun] = Some(last);
    }
}

/// Keeps a reply to one of `speculations`' URBs with it; `Err` if it is none of theirs.
pub(super) fn store_reply<'a>(
    speculations: impl IntoIterator<Item = &'a mut Speculation>,
    reply: RetSubmit,
) -> Result<(), RetSubmit> {
    for speculation in speculations {
        if let Some(at) = speculation.seqnums.iter().position(|&seqnum| seqnum == reply.seqnum) {
            speculation.results[at] = Some(reply);
            return Ok(());
        }
    }
    Err(reply)
}

/// The READ a command block asks for: READ(10) or READ(16), data in.
pub(super) fn read(cbw: &[u8]) -> Option<Read> {
    let cdb = &cbw[15..31];
    let lun = cbw[13] & 0x0f;
    let data_in = cbw[12] & 0x80 != 0;
    let (lba, blocks) = match (cdb[0], cbw[14]) {
        (READ_10, 10) => (
            u64::from(u32::from_be_bytes([cdb[2], cdb[3], cdb[4], cdb[5]])),
            u32::from(u16::from_be_bytes([cdb[7], cdb[8]])),
        ),
        (READ_16, 16) => (
            u64::from_be_bytes([cdb[2], cdb[3], cdb[4], cdb[5], cdb[6], cdb[7], cdb[8], cdb[9]]),
            u32::from_be_bytes([cdb[10], cdb[11], cdb[12], cdb[13]]),
        ),
        _ => return None,
    };
    (data_in && blocks > 0).then_some(Read { lun, lba, blocks })
}

/// The data length a command block asks for.
fn template_length(cbw: &[u8; 31]) -> u32 {
    u32::from_le_bytes([cbw[8], cbw[9], cbw[10], cbw[11]])
}

/// `template` (a READ of `template_blocks`) asking for `blocks` at `lba`
/// instead; `None` if that does not fit the command.
fn with_range(template: &[u8; 31], template_blocks: u32, lba: u64, blocks: u32) -> Option<[u8; 31]> {
    let mut cbw = *template;
    let template_length = u32::from_le_bytes([cbw[8], cbw[9], cbw[10], cbw[11]]);
    let block_length = template_length.checked_div(template_blocks)?;
    cbw[8..12].copy_from_slice(&block_length.checked_mul(blocks)?.to_le_bytes());
    match cbw[15] {
        READ_10 => {
            cbw[17..21].copy_from_slice(&u32::try_from(lba).ok()?.to_be_bytes());
            cbw[22..24].copy_from_slice(&u16::try_from(blocks).ok()?.to_be_bytes());
        }
        READ_16 => {
            cbw[17..25].copy_from_slice(&lba.to_be_bytes());
            cbw[25..29].copy_from_slice(&blocks.to_be_bytes());
        }
        _ => return None,
    }
    Some(cbw)
}

/// Whether a SCSI command leaves the medium and everything read ahead as it
/// was, though it reads nothing: PREVENT ALLOW MEDIUM REMOVAL locks or
/// unlocks the medium where it is (Linux sends it around a partition scan).
pub(super) fn keeps_medium(opcode: u8) -> bool {
    is_read_only(opcode) || opcode == 0x1e
}

/// Whether a SCSI command only reads: it leaves the medium and everything
/// read ahead as it was. Anything else that does not [`keeps_medium`] drops
/// the reads ahead before it is sent.
pub(super) fn is_read_only(opcode: u8) -> bool {
    matches!(
        opcode,
        0x00 // TEST UNIT READY
        | 0x03 // REQUEST SENSE
        | 0x08 // READ(6)
        | 0x12 // INQUIRY
        | 0x1a // MODE SENSE(6)
        | 0x23 // READ FORMAT CAPACITIES
        | 0x25 // READ CAPACITY(10)
        | 0x28 // READ(10)
        | 0x5a // MODE SENSE(10)
        | 0x88 // READ(16)
        | 0x9e // SERVICE ACTION IN(16): READ CAPACITY(16)
        | 0xa0 // REPORT LUNS
        | 0xa8 // READ(12)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cbw(opcode: u8, lba: u32, blocks: u16) -> [u8; 31] {
        let mut cbw = [0u8; 31];
        cbw[..4].copy_from_slice(b"USBC");
        cbw[8..12].copy_from_slice(&(u32::from(blocks) * 512).to_le_bytes());
        cbw[12] = 0x80;
        cbw[14] = 10;
        cbw[15] = opcode;
        cbw[17..21].copy_from_slice(&lba.to_be_bytes());
        cbw[22..24].copy_from_slice(&blocks.to_be_bytes());
        cbw
    }

    const PIPES: Pipes = Pipes { interface: 0, bulk_out: 2, bulk_in: 1 };

    #[test]
    fn a_second_sequential_read_opens_the_window_within_the_capacity() {
        let mut ahead = ReadAhead::default();
        let mut capacity = cbw(0x25, 0, 0);
        capacity[14] = 10;
        ahead.learn_capacity(&capacity, &[0, 0, 0, 159, 0, 0, 2, 0]);
        let first = cbw(READ_10, 0, 40);
        ahead.observe(read(&first).expect("a read"), &first, PIPES, Served::No);
        assert!(ahead.next().is_none(), "one read is not a stream");
        let second = cbw(READ_10, 40, 40);
        ahead.observe(read(&second).expect("a read"), &second, PIPES, Served::No);
        let (next, length, _) = ahead.next().expect("reads ahead from 80");
        assert_eq!((read(&next).map(|r| (r.lba, r.blocks)), length), (Some((80, 40)), 40 * 512));
        ahead.issued(Speculation::new(next, length, [1, 2, 3]));
        let (second, ..) = ahead.next().expect("and from 120, the window being 2");
        ahead.issued(Speculation::new(second, length, [4, 5, 6]));
        assert!(ahead.next().is_none(), "the window is full");
        ahead.observe(read(&next).expect("a read"), &next, PIPES, Served::Waited);
        assert!(ahead.next().is_none(), "160..200 is past the last LBA, 159");
        assert!(
            matches!(ahead.take(&cbw(READ_10, 80, 40)), Some(Taken::Exact(_))),
            "the same command block but for the tag"
        );
    }

    /// Issues reads ahead while the window allows; how many.
    fn issue_all(ahead: &mut ReadAhead, seqnum: &mut u32) -> usize {
        let mut issued = 0;
        while let Some((cbw, length, _)) = ahead.next() {
            *seqnum += 3;
            ahead.issued(Speculation::new(cbw, length, [*seqnum - 2, *seqnum - 1, *seqnum]));
            issued += 1;
        }
        issued
    }

    #[test]
    fn a_stream_whose_sizes_keep_changing_is_read_ahead_one_command_at_a_time() {
        let mut ahead = ReadAhead::default();
        let mut capacity = cbw(0x25, 0, 0);
        capacity[14] = 10;
        ahead.learn_capacity(&capacity, &[0, 0x01, 0, 0, 0, 0, 2, 0]);
        let mut ignored = HashSet::new();
        let (mut lba, mut seqnum, mut wasted) = (0u32, 0u32, 0u64);
        // What vhci-hcd's 32 segments make of O_DIRECT reads of 1 MiB: sizes
        // that change from command to command, none as predicted.
        let mut issued_per_read = Vec::new();
        for blocks in [256u16, 296, 272, 264, 448, 256, 296, 264, 272, 448, 296, 256] {
            let kernel = cbw(READ_10, lba, blocks);
            assert!(ahead.take(&kernel).is_none(), "no read ahead came back to serve it");
            wasted += ahead.drop_all(&mut ignored).0;
            ahead.observe(read(&kernel).expect("a read"), &kernel, PIPES, Served::No);
            issued_per_read.push(issue_all(&mut ahead, &mut seqnum));
            lba += u32::from(blocks);
        }
        assert_eq!(issued_per_read[..4], [0, 2, 2, 1], "opened at 2, then one at a time");
        assert!(issued_per_read[4..].iter().all(|&n| n == 1), "{issued_per_read:?}");
        assert!(wasted <= 24 * 448 * 512, "wasted {wasted} bytes for {lba} blocks read");
        // The stream settles: a hit opens the window again.
        let (next, ..) = ahead.queue.front().map(|s| (s.cbw, s.length)).expect("one read ahead");
        let Some(Taken::Exact(served)) = ahead.take(&next) else { panic!("the kernel asks for it") };
        ahead.observe(read(&served.cbw).expect("a read"), &served.cbw, PIPES, Served::Waited);
        assert_eq!(issue_all(&mut ahead, &mut seqnum), 2, "a hit doubles the window again");
    }

    #[test]
    fn only_reads_and_inquiries_are_read_only() {
        for opcode in [0x2a, 0x8a, 0xaa, 0x2e, 0x35, 0x42, 0x04, 0x15, 0x55, 0x1b, 0x1e, 0x91, 0x93] {
            assert!(!is_read_only(opcode), "{opcode:#04x}");
        }
        assert!(read(&cbw(0x2a, 0, 8)).is_none(), "a WRITE(10) is not a read");
        assert!(with_range(&cbw(READ_10, 0, 1), 1, 1 << 32, 1).is_none(), "READ(10) cannot reach past 2^32");
        let four = with_range(&cbw(READ_10, 0, 8), 8, 100, 4).expect("a READ(10) of 4 blocks at 100");
        assert_eq!(four, cbw(READ_10, 100, 4));
    }
}
