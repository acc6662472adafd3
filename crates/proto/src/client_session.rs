//! [`ClientSession`]: the client side of one imported device's URB phase,
//! sans I/O. Given the commands to send ([`submit`], [`unlink`]) and the bytes
//! the server sent, it queues the commands' bytes ([`outbox`]) and yields
//! each reply with what the caller attached to its command ([`poll_event`]).
//! It owns the outstanding table and the resume state; the caller owns the
//! socket, the clock and whoever waits for the replies (the kernel behind a
//! relay, or a userspace application).
//!
//! Replies may come in any order. A `RET_UNLINK(-ECONNRESET)` ends its target
//! too (the server sends no `RET_SUBMIT` for a URB it cancelled); a
//! `RET_UNLINK(0)` follows its target's `RET_SUBMIT`.
//!
//! Resumable sessions ([`resumable`]) acknowledge the replies they received
//! after each [`handle_input`] and keep every command until its reply arrives.
//! When the connection drops, [`disconnected`]; on a new connection, send
//! [`replies_received`] in the resume request and pass the server's count of
//! commands received to [`resumed`]: the commands the server never got
//! whole are queued again, in their original order. Commands submitted while
//! disconnected wait in the table and go out then too.
//!
//! [`submit`]: ClientSession::submit
//! [`unlink`]: ClientSession::unlink
//! [`outbox`]: ClientSession::outbox
//! [`poll_event`]: ClientSession::poll_event
//! [`resumable`]: ClientSession::resumable
//! [`handle_input`]: ClientSession::handle_input
//! [`disconnected`]: ClientSession::disconnected
//! [`replies_received`]: ClientSession::replies_received
//! [`resumed`]: ClientSession::resumed

use std::collections::VecDeque;

use bytes::BytesMut;

use crate::outbox::Outbox;
use crate::resume;
use crate::urb::{self, CmdSubmit, CmdUnlink, RetSubmit, RetUnlink, ServerMessage, SubmittedShape};
use crate::{Budget, DecodeError, Limits, SeqnumMap, Status};

/// Read at least this much at a time.
const READ_CHUNK: usize = 256 * 1024;

/// What the server's replies mean for the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Event<T> {
    /// A URB finished; `tag` is what [`ClientSession::submit`] was given.
    Completed { reply: RetSubmit, tag: T },
    /// An unlink was answered. `cancelled` is its target's seqnum and tag when
    /// the server cancelled it (`-ECONNRESET`: no `RET_SUBMIT` will come).
    Unlinked { reply: RetUnlink, target: u32, cancelled: Option<(u32, T)> },
}

/// Why a client session must end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientSessionError {
    /// The server's bytes are not valid USB/IP (or answer nothing we sent).
    #[error("malformed reply: {0}")]
    Decode(#[from] DecodeError),
    /// The caller reused the seqnum of a command still outstanding.
    #[error("seqnum {0} is already outstanding")]
    DuplicateSeqnum(u32),
    /// The server's resume answer claims more commands than were ever sent.
    #[error("server claims {claimed} commands received; only {sent} were sent")]
    BadCommandCount { claimed: u64, sent: u64 },
}

enum Command {
    Submit(CmdSubmit),
    Unlink(CmdUnlink),
}

struct Outstanding<T> {
    /// Position in the order commands were sent (counts submits and unlinks).
    index: u64,
    command: Command,
    /// `Some` for a submit.
    tag: Option<T>,
}

pub struct ClientSession<T> {
    devid: u32,
    limits: Limits,
    budget: Budget,
    inbuf: BytesMut,
    outstanding: SeqnumMap<Outstanding<T>>,
    /// `transfer_buffer_length` summed over outstanding submits.
    outstanding_bytes: usize,
    commands_sent: u64,
    replies_received: u64,
    replies_acked: u64,
    resumable: bool,
    connected: bool,
    outbox: Outbox,
    events: VecDeque<Event<T>>,
}

impl<T> ClientSession<T> {
    /// A session for the imported device `devid`; `leftover` is anything read
    /// past the import reply.
    pub fn new(devid: u32, leftover: BytesMut, limits: Limits, budget: Budget) -> Self {
        Self {
            devid,
            limits,
            budget,
            inbuf: leftover,
            outstanding: SeqnumMap::default(),
            outstanding_bytes: 0,
            commands_sent: 0,
            replies_received: 0,
            replies_acked: 0,
            resumable: false,
            connected: true,
            outbox: Outbox::default(),
            events: VecDeque::new(),
        }
    }

    /// Makes the session resumable (the server granted resume).
    pub fn resumable(mut self) -> Self {
        self.resumable = true;
        self
    }

    pub fn devid(&self) -> u32 {
        self.devid
    }

    /// Whether to take more commands from the caller: outstanding URBs and
    /// bytes, and commands waiting to be written, are under budget. Keeps the
    /// server's in-flight table (the same budget) from filling, so its
    /// acknowledgements are always read.
    pub fn wants_commands(&self) -> bool {
        self.outstanding.len() < self.budget.in_flight_urbs
            && (self.outstanding_bytes == 0 || self.outstanding_bytes < self.budget.in_flight_bytes)
            && self.outbox.queued() < self.budget.queued_reply_bytes
    }

    /// Queues a `CMD_SUBMIT`; its reply comes back as [`Event::Completed`] with `tag`.
    pub fn submit(&mut self, command: CmdSubmit, tag: T) -> Result<(), ClientSessionError> {
        if self.outstanding.contains_key(command.seqnum) {
            return Err(ClientSessionError::DuplicateSeqnum(command.seqnum));
        }
        if self.connected {
            self.outbox.push_cmd_submit(&command);
        }
        self.outstanding_bytes += command.transfer_buffer_length as usize;
        let outstanding = Outstanding { index: self.commands_sent, command: Command::Submit(command), tag: Some(tag) };
        let seqnum = match &outstanding.command {
            Command::Submit(submit) => submit.seqnum,
            Command::Unlink(unlink) => unlink.seqnum,
        };
        self.outstanding.insert(seqnum, outstanding);
        self.commands_sent += 1;
        Ok(())
    }

    /// Queues a `CMD_UNLINK`; its answer comes back as [`Event::Unlinked`].
    pub fn unlink(&mut self, command: CmdUnlink) -> Result<(), ClientSessionError> {
        if self.outstanding.contains_key(command.seqnum) {
            return Err(ClientSessionError::DuplicateSeqnum(command.seqnum));
        }
        if self.connected {
            self.outbox.push_header(&command.header());
        }
        let outstanding = Outstanding { index: self.commands_sent, command: Command::Unlink(command), tag: None };
        self.outstanding.insert(command.seqnum, outstanding);
        self.commands_sent += 1;
        Ok(())
    }

    /// The buffer to read server bytes into, with room for the whole next reply.
    pub fn input(&mut self) -> &mut BytesMut {
        let wanted = self.next_reply_len().unwrap_or(urb::HEADER_LEN).saturating_sub(self.inbuf.len()).max(READ_CHUNK);
        self.inbuf.reserve(wanted);
        &mut self.inbuf
    }

    /// The length of the reply at the front of the input, once its header is
    /// there and it answers an outstanding submit within what was asked (a
    /// reply that claims more is refused when decoded, so it sizes nothing).
    fn next_reply_len(&self) -> Option<usize> {
        let header = self.inbuf.get(..urb::HEADER_LEN)?;
        let word = |at: usize| u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]);
        if urb::Command(word(0)) != urb::Command::RET_SUBMIT {
            return Some(urb::HEADER_LEN);
        }
        let Some(Outstanding { command: Command::Submit(submit), .. }) = self.outstanding.get(word(4)) else {
            return None;
        };
        let actual = word(0x18);
        let payload = if submit.direction == crate::Direction::In && actual <= submit.transfer_buffer_length {
            actual as usize
        } else {
            0
        };
        Some(urb::HEADER_LEN + payload + submit.iso_packets.len() * urb::ISO_DESCRIPTOR_LEN)
    }

    /// Decodes every whole reply buffered and queues its [`Event`]; a
    /// resumable session then acknowledges them.
    pub fn handle_input(&mut self) -> Result<(), ClientSessionError> {
        let received_before = self.replies_received;
        loop {
            let outstanding = &self.outstanding;
            let shape = |seqnum: u32| match outstanding.get(seqnum) {
                Some(Outstanding { command: Command::Submit(submit), .. }) => Some(SubmittedShape {
                    direction: submit.direction,
                    transfer_buffer_length: submit.transfer_buffer_length,
                    iso_packets: (!submit.iso_packets.is_empty()).then_some(submit.number_of_packets),
                }),
                _ => None,
            };
            let Some(message) = urb::decode_return(&mut self.inbuf, &self.limits, shape)? else { break };
            self.replies_received += 1;
            match message {
                ServerMessage::Submit(reply) => {
                    // decode_return found it outstanding, as a submit.
                    if let Some(done) = self.outstanding.remove(reply.seqnum) {
                        self.forget(&done);
                        if let Some(tag) = done.tag {
                            self.events.push_back(Event::Completed { reply, tag });
                        }
                    }
                }
                ServerMessage::Unlink(reply) => match self.outstanding.remove(reply.seqnum) {
                    Some(Outstanding { command: Command::Unlink(unlink), .. }) => {
                        let target = unlink.unlink_seqnum;
                        let cancelled = if reply.status == Status::ECONNRESET {
                            self.outstanding.remove(target).and_then(|done| {
                                self.forget(&done);
                                done.tag.map(|tag| (target, tag))
                            })
                        } else {
                            None
                        };
                        self.events.push_back(Event::Unlinked { reply, target, cancelled });
                    }
                    Some(other) => {
                        // A RET_UNLINK naming a submit: the kernel's vhci logs and ignores it.
                        tracing::debug!(seqnum = reply.seqnum, "RET_UNLINK for a submit; ignored");
                        self.outstanding.insert(reply.seqnum, other);
                    }
                    None => tracing::debug!(seqnum = reply.seqnum, "RET_UNLINK for nothing outstanding; ignored"),
                },
            }
        }
        if self.resumable && self.connected && self.replies_received != received_before {
            self.outbox.push_header(&resume::ack_header(self.devid, self.replies_received));
            self.replies_acked = self.replies_received;
        }
        Ok(())
    }

    /// The next reply, in the order they arrived.
    pub fn poll_event(&mut self) -> Option<Event<T>> {
        self.events.pop_front()
    }

    /// Ends a resumable session: its last message, after every command queued,
    /// tells the server to release the device now rather than hold it for a
    /// resume. Write the outbox out, then close.
    pub fn end(&mut self) {
        if self.resumable && self.connected {
            self.outbox.push_header(&resume::end_header(self.devid));
        }
    }

    /// Commands (and acknowledgements) waiting to be written.
    pub fn outbox(&mut self) -> &mut Outbox {
        &mut self.outbox
    }

    /// Seqnums outstanding (submitted or unlinking, no answer yet).
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// The connection is gone: partial replies and unwritten commands are
    /// dropped; every command stays outstanding, to be sent again by
    /// [`resumed`](Self::resumed) if the server never got it.
    pub fn disconnected(&mut self) {
        self.inbuf.clear();
        self.outbox.clear();
        self.connected = false;
    }

    /// Server messages received whole so far: what a resume request carries.
    pub fn replies_received(&self) -> u64 {
        self.replies_received
    }

    /// The server took the session over on a new connection, having received
    /// `commands_received` commands whole; `leftover` is what was read past its
    /// answer. Queues every later command again, in order.
    pub fn resumed(&mut self, commands_received: u64, leftover: BytesMut) -> Result<usize, ClientSessionError> {
        if commands_received > self.commands_sent {
            return Err(ClientSessionError::BadCommandCount { claimed: commands_received, sent: self.commands_sent });
        }
        let mut again: Vec<&Outstanding<T>> =
            self.outstanding.values().filter(|pending| pending.index >= commands_received).collect();
        again.sort_by_key(|pending| pending.index);
        self.outbox.clear();
        for pending in &again {
            match &pending.command {
                Command::Submit(submit) => self.outbox.push_cmd_submit(submit),
                Command::Unlink(unlink) => self.outbox.push_header(&unlink.header()),
            }
        }
        self.inbuf = leftover;
        self.replies_acked = self.replies_received;
        self.connected = true;
        Ok(again.len())
    }

    fn forget(&mut self, done: &Outstanding<T>) {
        if let Command::Submit(submit) = &done.command {
            self.outstanding_bytes -= submit.transfer_buffer_length as usize;
        }
    }
}
