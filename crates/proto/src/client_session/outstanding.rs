//! What a [`ClientSession`](super::ClientSession) keeps per outstanding
//! seqnum: the command's shape its reply is checked against and the caller's
//! tag ([`Outstanding`]), and, in a resumable session, the whole command until
//! its reply ([`Kept`]). Matching replies to them is the session's.

use crate::urb::{CmdSubmit, CmdUnlink, SubmittedShape};

pub(super) enum Command {
    Submit(CmdSubmit),
    Unlink(CmdUnlink),
}

impl Command {
    pub(super) fn seqnum(&self) -> u32 {
        match self {
            Self::Submit(submit) => submit.seqnum,
            Self::Unlink(unlink) => unlink.seqnum,
        }
    }
}

/// What an outstanding seqnum's reply is checked against, and the caller's tag.
pub(super) struct Outstanding<T> {
    pub(super) sent: Sent,
    /// `Some` for a submit.
    pub(super) tag: Option<T>,
}

/// What was sent under a seqnum, as far as its reply is concerned.
#[derive(Clone, Copy)]
pub(super) enum Sent {
    Submit(SubmittedShape),
    Unlink { target: u32 },
}

/// What a submit's reply is checked against.
pub(super) fn shape_of(submit: &CmdSubmit) -> SubmittedShape {
    SubmittedShape {
        direction: submit.direction,
        transfer_buffer_length: submit.transfer_buffer_length,
        iso_packets: (!submit.iso_packets.is_empty()).then_some(submit.number_of_packets),
    }
}

/// A command a resumable session keeps whole until its reply, to send again.
pub(super) struct Kept {
    /// Position in the order commands were sent (counts submits and unlinks).
    pub(super) index: u64,
    pub(super) command: Command,
}
