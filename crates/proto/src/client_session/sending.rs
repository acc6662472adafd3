//! How a [`ClientSession`]'s commands become bytes: the seqnum check, the
//! server's table's admission, the commands held for room in it, and each
//! command queued in the outbox, made outstanding and (in a resumable
//! session) kept whole until its reply. Not the replies' side (the session's
//! `decode_replies`) and not the budget's check ([`ClientSession::has_room`]).

use super::outstanding::{shape_of, Command, Kept, Outstanding, Sent};
use super::{ClientSession, ClientSessionError};
use crate::urb::CmdSubmit;

impl<T> ClientSession<T> {
    pub(super) fn check_fresh(&self, seqnum: u32) -> Result<(), ClientSessionError> {
        let held = !self.held.is_empty() && self.held.iter().any(|(command, _)| command.seqnum() == seqnum);
        if held || self.outstanding.contains_key(seqnum) {
            return Err(ClientSessionError::DuplicateSeqnum(seqnum));
        }
        Ok(())
    }

    /// Whether the server's table takes `command` now: a submit while its URBs
    /// and bytes admit one more (as the server counts; our outstanding submits
    /// are never fewer than its URBs in flight), an unlink always.
    pub(super) fn admitted(&self, command: &Command) -> bool {
        match command {
            Command::Submit(submit) => self.server_admits(submit.transfer_buffer_length),
            Command::Unlink(_) => true,
        }
    }

    /// Whether the server's table takes one more submit of `length` bytes now.
    pub(super) fn server_admits(&self, length: u32) -> bool {
        let Some((urbs, bytes)) = self.server_in_flight else { return true };
        self.outstanding_submits < urbs
            && (self.outstanding_bytes == 0 || self.outstanding_bytes.saturating_add(length as usize) <= bytes)
    }

    /// Sends the commands held for room in the server's table, in order, while it takes them.
    pub(super) fn send_held(&mut self) {
        while self.held.front().is_some_and(|(command, _)| self.admitted(command)) {
            let Some((command, tag)) = self.held.pop_front() else { return };
            self.send(command, tag);
        }
    }

    /// Queues `command`'s bytes (while connected) and makes it outstanding. Only
    /// a resumable session keeps the command itself, to send it again.
    pub(super) fn send(&mut self, command: Command, tag: Option<T>) {
        match command {
            Command::Submit(submit) => self.send_submit(submit, tag),
            Command::Unlink(unlink) => {
                if self.connected {
                    self.acknowledge();
                    self.outbox.push_header(&unlink.header());
                }
                let sent = Sent::Unlink { target: unlink.unlink_seqnum };
                self.outstanding.insert(unlink.seqnum, Outstanding { sent, tag });
                self.keep(Command::Unlink(unlink));
            }
        }
    }

    pub(super) fn send_submit(&mut self, submit: CmdSubmit, tag: Option<T>) {
        let entry = Outstanding { sent: Sent::Submit(shape_of(&submit)), tag };
        self.outstanding.insert(submit.seqnum, entry);
        self.write_submit(submit);
    }

    /// Queues the bytes of `submit`, already outstanding (while connected), and
    /// counts it; a resumable session keeps it whole until its reply.
    // Inlined, so the caller's command is encoded where it lies instead of
    // being copied once more for the call (it is dropped here unless kept).
    #[inline(always)]
    pub(super) fn write_submit(&mut self, submit: CmdSubmit) {
        self.queue_submit(&submit);
        if self.resumable {
            self.keep_submit(submit);
        }
        self.commands_sent += 1;
    }

    /// Keeps `submit` whole until its reply (a resumable session), as the
    /// command just counted. Out of line, so a stock session's submit moves
    /// no command.
    #[inline(never)]
    pub(super) fn keep_submit(&mut self, submit: CmdSubmit) {
        self.kept.insert(submit.seqnum, Kept { index: self.commands_sent, command: Command::Submit(submit) });
    }

    #[inline(always)]
    pub(super) fn queue_submit(&mut self, submit: &CmdSubmit) {
        if self.connected {
            self.acknowledge();
            self.outbox.push_cmd_submit(submit);
        }
        self.outstanding_bytes += submit.transfer_buffer_length as usize;
        self.outstanding_submits += 1;
    }

    /// Counts a command sent; a resumable session keeps it whole until its reply.
    pub(super) fn keep(&mut self, command: Command) {
        if self.resumable {
            self.kept.insert(command.seqnum(), Kept { index: self.commands_sent, command });
        }
        self.commands_sent += 1;
    }
}
