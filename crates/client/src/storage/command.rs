//! The command in progress and the replies of ours that kernel URBs wait
//! for: the accelerator's bookkeeping of one Bulk-Only command. Not for what
//! is done with them (`storage`).

use std::collections::{HashMap, HashSet};

use usbwire_proto::urb::{CmdSubmit, RetSubmit};
use usbwire_proto::Direction;

use super::pipes::Pipes;

/// A reply one of the kernel's URBs waits for: ours (a status read, a read
/// ahead's data), answered to the kernel's URB that claims it.
#[derive(Debug, Default)]
pub(super) struct Ahead {
    pub(super) seqnum: u32,
    pub(super) result: Option<RetSubmit>,
    /// The kernel's URB waiting for it: (seqnum, buffer length).
    pub(super) claimed: Option<(u32, u32)>,
}

/// A kernel URB that waits for the reply to one of ours: its seqnum, its
/// buffer's length, and the tag its CSW must carry.
#[derive(Clone, Copy, Debug)]
pub(super) struct Claim {
    pub(super) seqnum: u32,
    pub(super) length: u32,
    pub(super) tag: Option<[u8; 4]>,
}

/// The command in progress.
#[derive(Debug)]
pub(super) struct Command {
    pub(super) pipes: Pipes,
    /// The kernel's command block: answered when it came.
    pub(super) cbw: [u8; 31],
    pub(super) cbw_seqnum: u32,
    /// The server's reply to it came (or none will: served from a read ahead).
    pub(super) cbw_replied: bool,
    /// The data stage still expected from the kernel: its direction and bytes left.
    pub(super) expecting: Option<(Direction, u32)>,
    /// The kernel's data URBs sent on.
    pub(super) data_seqnums: Vec<u32>,
    /// Served from a read ahead: its data stage's reply.
    pub(super) data_ahead: Option<Ahead>,
    /// The status read sent ahead (ours, or a read ahead's).
    pub(super) status: Option<Ahead>,
    /// A stage before the status failed: the status read was skipped, or its
    /// CSW is not the one the kernel's own read will get.
    pub(super) void: bool,
}

/// Whether every stage of the command in progress has gone out (or needs
/// none): reads ahead may follow it.
pub(super) fn command_is_sent_whole(command: &Option<Command>) -> bool {
    command.as_ref().is_none_or(|command| command.status.is_some())
}

impl Command {
    /// Where the replies still coming for this command go once it is over:
    /// its CBW's to nobody, its data's and (`with_status`) its status's to
    /// the kernel URB that claims them, or to nobody.
    pub(super) fn hand_over(&self, ignored: &mut HashSet<u32>, answers: &mut HashMap<u32, Claim>, with_status: bool) {
        if !self.cbw_replied {
            ignored.insert(self.cbw_seqnum);
        }
        let tag = [self.cbw[4], self.cbw[5], self.cbw[6], self.cbw[7]];
        let status = if with_status { self.status.as_ref() } else { None };
        for (ahead, tag) in [(self.data_ahead.as_ref(), None), (status, Some(tag))] {
            let Some(ahead) = ahead else { continue };
            match (ahead.claimed, &ahead.result) {
                (Some((seqnum, length)), _) => {
                    answers.insert(ahead.seqnum, Claim { seqnum, length, tag });
                }
                (None, None) => {
                    ignored.insert(ahead.seqnum);
                }
                (None, Some(_)) => {}
            }
        }
    }

    pub(super) fn is_data_pipe(&self, submit: &CmdSubmit) -> bool {
        match submit.direction {
            Direction::Out => submit.ep == self.pipes.bulk_out,
            Direction::In => submit.ep == self.pipes.bulk_in,
        }
    }
}
