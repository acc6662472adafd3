//! The Bulk-Only wrappers as the accelerator reads and answers them: a
//! command block's data stage, and replies of ours made into answers to the
//! kernel's URBs (its seqnum, its buffer, its tag in a CSW). Not for the
//! SCSI commands inside.

use bytes::Bytes;
use usbwire_proto::storage::{AFTER_SUCCESS, STAGE};
use usbwire_proto::urb::{CmdSubmit, RetSubmit, TransferFlags};
use usbwire_proto::{Direction, Status};

use super::pipes::Pipes;

/// A Bulk-Only command block wrapper: its length and signature ("USBC").
pub(super) const CBW_LEN: u32 = 31;
const CBW_SIGNATURE: &[u8; 4] = b"USBC";
/// A command status wrapper's length.
pub(super) const CSW_LEN: u32 = 13;

/// What a CBW says of its data stage.
pub(super) struct CommandBlock {
    pub(super) direction: Direction,
    pub(super) length: u32,
}

/// The command block a URB carries, when it is one: 31 bytes out on the
/// interface's bulk OUT, "USBC", a CB length of 1 to 16.
pub(super) fn command_block(submit: &CmdSubmit, pipes: Pipes) -> Option<CommandBlock> {
    let data = &submit.data;
    let is_cbw = submit.direction == Direction::Out
        && submit.ep == pipes.bulk_out
        && submit.transfer_buffer_length == CBW_LEN
        && data.len() == CBW_LEN as usize
        && &data[..4] == CBW_SIGNATURE
        && (1..=16).contains(&data[14]);
    is_cbw.then(|| CommandBlock {
        direction: if data[12] & 0x80 != 0 { Direction::In } else { Direction::Out },
        length: u32::from_le_bytes([data[8], data[9], data[10], data[11]]),
    })
}

/// The kernel's CBW URB, done: every byte sent.
pub(super) fn done(seqnum: u32, actual_length: u32, number_of_packets: i32) -> RetSubmit {
    RetSubmit {
        seqnum,
        status: Status::OK,
        actual_length,
        start_frame: 0,
        number_of_packets,
        error_count: 0,
        data: Bytes::new(),
        iso_packets: Vec::new(),
    }
}

pub(super) fn tag_of(cbw: &[u8; 31]) -> [u8; 4] {
    [cbw[4], cbw[5], cbw[6], cbw[7]]
}

/// A reply of ours as the answer to the kernel's URB `submit`.
pub(super) fn answer(reply: RetSubmit, submit: &CmdSubmit, tag: Option<[u8; 4]>) -> RetSubmit {
    answer_to(reply, submit.seqnum, submit.transfer_buffer_length, tag)
}

/// A reply of ours as the answer to the kernel's URB `seqnum` with room for
/// `length` bytes; a CSW (`tag`) carries the kernel's tag.
pub(super) fn answer_to(mut reply: RetSubmit, seqnum: u32, length: u32, tag: Option<[u8; 4]>) -> RetSubmit {
    reply.seqnum = seqnum;
    if reply.actual_length > length {
        // More than its buffer holds: what a device's babble looks like.
        reply.status = Status::EOVERFLOW;
        reply.actual_length = length;
        reply.data.truncate(length as usize);
    }
    if let Some(tag) = tag {
        retag(&mut reply, tag);
    }
    reply
}

/// A reply of ours to an IN data stage as the host controller gives it to
/// the kernel's URB `submit`: a short read is `-EREMOTEIO` exactly when that
/// URB asks for it (`URB_SHORT_NOT_OK`). Ours never ask, so that the status
/// read behind a short data stage still runs.
pub(super) fn short_as_asked(mut reply: RetSubmit, submit: &CmdSubmit) -> RetSubmit {
    let short = reply.actual_length < submit.transfer_buffer_length;
    if submit.direction == Direction::In && short && matches!(reply.status, Status::OK | Status::EREMOTEIO) {
        let asked = submit.transfer_flags.contains(TransferFlags::SHORT_NOT_OK);
        reply.status = if asked { Status::EREMOTEIO } else { Status::OK };
    }
    reply
}

/// Puts the kernel's tag in a CSW read for it.
pub(super) fn retag(reply: &mut RetSubmit, tag: [u8; 4]) {
    if reply.data.len() == CSW_LEN as usize && reply.data.starts_with(b"USBS") && reply.data[4..8] != tag {
        let mut csw = reply.data.to_vec();
        csw[4..8].copy_from_slice(&tag);
        reply.data = Bytes::from(csw);
    }
}

/// A read ahead's three stages — its command block, its data, its status —
/// each run only after the one before succeeded.
pub(super) fn read_ahead_stages(
    seqnums: [u32; 3],
    devid: u32,
    pipes: Pipes,
    cbw: &[u8; 31],
    length: u32,
) -> [CmdSubmit; 3] {
    let [block, data, status] = seqnums;
    let mut stages = [
        CmdSubmit::new(block, devid, Direction::Out, pipes.bulk_out, CBW_LEN, [0; 8], Bytes::copy_from_slice(cbw)),
        CmdSubmit::new(data, devid, Direction::In, pipes.bulk_in, length, [0; 8], Bytes::new()),
        CmdSubmit::new(status, devid, Direction::In, pipes.bulk_in, CSW_LEN, [0; 8], Bytes::new()),
    ];
    for stage in &mut stages {
        stage.transfer_flags.0 |= STAGE | AFTER_SUCCESS;
    }
    stages
}

/// A command of ours as its stages: the command block, the data (none
/// when `length` is 0) and the status, each run only after the one before
/// succeeded. `seqnums` are the three stages' (the data's unused without one).
pub(super) fn command_stages(
    seqnums: [u32; 3],
    devid: u32,
    pipes: Pipes,
    cbw: &[u8; 31],
    length: u32,
) -> impl Iterator<Item = CmdSubmit> {
    let [block, data, status] = read_ahead_stages(seqnums, devid, pipes, cbw, length);
    [Some(block), (length > 0).then_some(data), Some(status)].into_iter().flatten()
}
