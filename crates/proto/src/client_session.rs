//! [`ClientSession`]: the client side of one imported device's URB phase,
//! sans I/O. One way in for the server's bytes, one way out for its replies:
//! the driver reads the server into a [`RecvBuffer`] of its own and passes it
//! to [`handle_input`], which decodes every whole reply and hands each one to
//! the driver's `deliver` as an [`Event`] carrying what the caller attached to
//! its command. Commands go in by [`submit`] and [`unlink`]; their bytes come
//! out of the [`outbox`]; time comes in by [`handle_timeout`]`(now)`.
//! It owns the outstanding table and the resume state; it is not for the
//! socket, the clock, the read buffer or whoever waits for the replies (the
//! kernel behind a relay, or a userspace application): those are the driver's.
//!
//! A session can be shared behind a lock between the callers that submit
//! and a driver that does the I/O: a caller checks [`has_room`] (the
//! budget) and submits straight into it; the driver reads into its own
//! buffer without the lock, and holds the lock only to decode
//! ([`handle_input`]) and to take the outbox's bytes ([`Outbox::hand_over`]).
//!
//! Replies may come in any order. A `RET_UNLINK(-ECONNRESET)` ends its target
//! too (the server sends no `RET_SUBMIT` for a URB it cancelled); a
//! `RET_UNLINK(0)` follows its target's `RET_SUBMIT`.
//!
//! Every session keeps, per outstanding seqnum, only what its reply must be
//! checked against (a submit's direction, length and iso packet count; an
//! unlink's target) and the caller's tag: a command's bytes leave with the
//! outbox. Resumable sessions ([`resumable`]) also keep every command whole
//! until its reply arrives, to send it again on a new connection, and
//! acknowledge the replies they received, without a write of
//! their own where they can: the acknowledgement rides in front of the next
//! command, goes out once a read's worth ([`ACK_EVERY_BYTES`]) is unacknowledged,
//! and otherwise when the driver has nothing else to do ([`acknowledge`]).
//! When the connection drops, [`disconnected`]; on a new connection, send
//! [`replies_received`] in the resume request and pass the server's count of
//! commands received to [`resumed`]: the commands the server never got
//! whole are queued again, in their original order. Commands submitted while
//! disconnected wait in the table and go out then too.
//!
//! [`submit`]: ClientSession::submit
//! [`unlink`]: ClientSession::unlink
//! [`outbox`]: ClientSession::outbox
//! [`handle_input`]: ClientSession::handle_input
//! [`handle_timeout`]: ClientSession::handle_timeout
//! [`resumable`]: ClientSession::resumable
//! [`acknowledge`]: ClientSession::acknowledge
//! [`disconnected`]: ClientSession::disconnected
//! [`replies_received`]: ClientSession::replies_received
//! [`resumed`]: ClientSession::resumed
//! [`has_room`]: ClientSession::has_room

mod outstanding;
mod sending;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::liveness::{self, Due, Link, Liveness};
use crate::outbox::Outbox;
use crate::resume;
use crate::urb::{self, CmdSubmit, CmdUnlink, RetSubmit, RetUnlink, ServerMessage};
use crate::{Budget, DecodeError, Limits, RecvBuffer, SeqnumMap, Status};
use outstanding::{shape_of, Command, Kept, Outstanding, Sent};

/// What a driver's read buffer grows by, at least:
/// `RecvBuffer::with_capacity(READ_CHUNK)` is the buffer [`ClientSession::handle_input`] reads best from.
pub const READ_CHUNK: usize = 256 * 1024;

/// Reply bytes a resumable session takes before it acknowledges them even
/// though the driver is busy: far below any server's budget of unacknowledged
/// replies, so the server never waits on an acknowledgement held back here.
pub const ACK_EVERY_BYTES: usize = 1 << 20;

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
    /// The server ended a resumable session (it is shutting down): there is
    /// nothing to resume; replies before the end were delivered.
    #[error("the server ended the session (it is shutting down)")]
    ServerEnded,
    /// The server ended a resumable session because the device re-enumerated
    /// at the same bus id: import that bus id again to follow it. Replies
    /// before the end were delivered.
    #[error("the device re-enumerated at the same bus id (import it again to follow it)")]
    Reenumerated,
    /// Keep-alive: nothing arrived from the server for this long while it
    /// should have pinged. The link is dead though it never said so:
    /// resume on a new connection.
    #[error("nothing heard from the server for {:.1} s", .0.as_secs_f64())]
    Silent(Duration),
    /// [`ClientSession::resumed`] on a session that was never made
    /// [resumable](ClientSession::resumable): it kept no commands to send
    /// again. Import the device anew.
    #[error("the session is not resumable; import the device again")]
    NotResumable,
}

pub struct ClientSession<T> {
    devid: u32,
    limits: Limits,
    budget: Budget,
    outstanding: SeqnumMap<Outstanding<T>>,
    /// Resumable sessions: the commands of `outstanding`, whole, by seqnum.
    kept: SeqnumMap<Kept>,
    /// `transfer_buffer_length` summed over outstanding submits.
    outstanding_bytes: usize,
    /// Submits among `outstanding`.
    outstanding_submits: usize,
    /// What the server's in-flight table takes (URBs, bytes), when it said so:
    /// commands it would not take at once wait here, unsent, so the server
    /// never stops reading (and so always reads our acknowledgements).
    server_in_flight: Option<(usize, usize)>,
    /// Commands taken from the caller that wait for room in the server's table, in order.
    held: VecDeque<(Command, Option<T>)>,
    commands_sent: u64,
    replies_received: u64,
    replies_acked: u64,
    /// Wire bytes of the replies received and not acknowledged yet.
    unacked_bytes: usize,
    resumable: bool,
    connected: bool,
    outbox: Outbox,
    /// `Some` when keep-alive was negotiated ([`crate::liveness`]).
    liveness: Option<Liveness>,
    /// Input left buffered by the last [`handle_input`](Self::handle_input):
    /// more at the next call means the server said something.
    input_seen: usize,
}

impl<T> ClientSession<T> {
    /// A session for the imported device `devid` (what was read past the
    /// import reply goes into the driver's read buffer).
    pub fn new(devid: u32, limits: Limits, budget: Budget) -> Self {
        Self {
            devid,
            limits,
            budget,
            outstanding: SeqnumMap::default(),
            kept: SeqnumMap::default(),
            outstanding_bytes: 0,
            outstanding_submits: 0,
            server_in_flight: None,
            held: VecDeque::new(),
            commands_sent: 0,
            replies_received: 0,
            replies_acked: 0,
            unacked_bytes: 0,
            resumable: false,
            connected: true,
            outbox: Outbox::default(),
            liveness: None,
            input_seen: 0,
        }
    }

    /// Sends keep-alives and watches for silence ([`crate::liveness`]; the
    /// server agreed to it), from `now` on. Drive it with
    /// [`poll_timeout`](Self::poll_timeout) and [`handle_timeout`](Self::handle_timeout).
    pub fn keepalive(mut self, now: Instant) -> Self {
        self.liveness = Some(Liveness::new(now));
        self
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next, if ever
    /// (keep-alive sessions, while connected).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.liveness.as_ref().filter(|_| self.connected).map(Liveness::deadline)
    }

    /// Queues a keep-alive when this side has been quiet (an acknowledgement
    /// that is due serves as one), or says the link is dead: nothing heard
    /// for [`liveness::BUSY_SILENCE`] with URBs outstanding,
    /// [`liveness::IDLE_SILENCE`] without. `listening`: the caller reads the
    /// server now (a caller whose own side is backed up, and so stopped
    /// reading, does not count that time as the server's silence).
    pub fn handle_timeout(&mut self, now: Instant, listening: bool) -> Result<(), ClientSessionError> {
        if !self.connected {
            return Ok(());
        }
        let Some(liveness) = self.liveness.as_mut() else { return Ok(()) };
        let link = Link {
            busy: !self.outstanding.is_empty(),
            listening,
            written: self.outbox.written(),
            unsent: !self.outbox.is_empty(),
        };
        match liveness.tick(now, link) {
            Due::Nothing => {}
            Due::Ping => {
                if !self.acknowledge() {
                    self.outbox.push_header(&liveness::ping_header(self.devid));
                }
            }
            Due::Dead(silent) => return Err(ClientSessionError::Silent(silent)),
        }
        Ok(())
    }

    /// Makes the session resumable (the server granted resume).
    pub fn resumable(mut self) -> Self {
        self.resumable = true;
        self
    }

    pub fn devid(&self) -> u32 {
        self.devid
    }

    /// The server's in-flight table takes `urbs` URBs and `bytes` bytes (it
    /// said so when it granted resume): commands are sent only while it would
    /// take them at once, so it never stops reading while its acknowledgements
    /// are what its completions wait for. Our own budget still applies.
    pub fn server_takes(mut self, urbs: usize, bytes: usize) -> Self {
        self.server_in_flight = Some((urbs.max(1), bytes));
        self
    }

    /// Whether to take more commands from the caller: outstanding URBs and
    /// bytes, and commands waiting to be written, are under budget, and none
    /// waits for room in the server's table. Keeps the server's in-flight
    /// table from filling, so its acknowledgements are always read.
    pub fn wants_commands(&self) -> bool {
        self.held.is_empty()
            && self.outstanding.len() < self.budget.in_flight_urbs
            && (self.outstanding_bytes == 0 || self.outstanding_bytes < self.budget.in_flight_bytes)
            && self.outbox.queued() < self.budget.queued_reply_bytes
    }

    /// Whether a command of `length` bytes (`transfer_buffer_length`; 0 for
    /// an unlink) fits the budget now: outstanding URBs and bytes leave room
    /// for it ([`Budget::admits`]: a submit of any size when no bytes are
    /// outstanding), the outbox is under the budget's queued bytes, and no
    /// command waits for room in the server's table. A caller that submits
    /// straight into a session shared with its driver checks this first and,
    /// when it fails, waits for replies to make room; so the session, its
    /// outbox and the server's table stay within the budget however fast
    /// callers submit.
    #[inline]
    pub fn has_room(&self, length: usize) -> bool {
        self.held.is_empty()
            && self.outstanding.len() < self.budget.in_flight_urbs
            && self.budget.admits(self.outstanding_bytes, length)
            && self.outbox.queued() < self.budget.queued_reply_bytes
    }

    /// Queues a `CMD_SUBMIT`; its reply comes back as [`Event::Completed`] with `tag`.
    /// The command's bytes go into the [`outbox`](Self::outbox) at once when
    /// nothing is held before it and the server's table takes it.
    // Inlined, so a caller's command is encoded where it lies.
    #[inline(always)]
    pub fn submit(&mut self, command: CmdSubmit, tag: T) -> Result<(), ClientSessionError> {
        if self.held.is_empty() && self.server_admits(command.transfer_buffer_length) {
            // The usual case, straight to the outbox: nothing is held, so a
            // seqnum the table takes is fresh.
            let entry = Outstanding { sent: Sent::Submit(shape_of(&command)), tag: Some(tag) };
            if self.outstanding.insert_new(command.seqnum, entry).is_err() {
                return Err(ClientSessionError::DuplicateSeqnum(command.seqnum));
            }
            // Encoded where it lies; only a resumable session moves it on.
            self.queue_submit(&command);
            if self.resumable {
                self.keep_submit(command);
            }
            self.commands_sent += 1;
        } else {
            self.check_fresh(command.seqnum)?;
            self.held.push_back((Command::Submit(command), Some(tag)));
            self.send_held();
        }
        Ok(())
    }

    /// Queues a `CMD_UNLINK`; its answer comes back as [`Event::Unlinked`].
    pub fn unlink(&mut self, command: CmdUnlink) -> Result<(), ClientSessionError> {
        self.check_fresh(command.seqnum)?;
        self.held.push_back((Command::Unlink(command), None));
        self.send_held();
        Ok(())
    }

    /// The length of the reply at the front of the input, once its header is
    /// there and it answers an outstanding submit within what was asked (a
    /// reply that claims more is refused when decoded, so it sizes nothing).
    fn next_reply_len(&self, input: &[u8]) -> Option<usize> {
        let header = input.get(..urb::HEADER_LEN)?;
        let word = |at: usize| u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]);
        if urb::Command(word(0)) != urb::Command::RET_SUBMIT {
            return Some(urb::HEADER_LEN);
        }
        let Some(Outstanding { sent: Sent::Submit(shape), .. }) = self.outstanding.get(word(4)) else {
            return None;
        };
        let actual = word(0x18);
        let payload = if shape.direction == crate::Direction::In && actual <= shape.transfer_buffer_length {
            actual as usize
        } else {
            0
        };
        let iso_count = shape.iso_packets.map_or(0, |count| count.clamp(0, self.limits.max_iso_packets as i32));
        Some(urb::HEADER_LEN + payload + iso_count as usize * urb::ISO_DESCRIPTOR_LEN)
    }

    /// Decodes every whole reply in `input` (the server's bytes, read by the
    /// driver into its own buffer) and hands each one to `deliver` as an
    /// [`Event`], as it is decoded; the events before an error are handed
    /// over too. Then makes room in `input` for the whole next reply, so the
    /// driver's next read can take it in one go. A resumable session
    /// acknowledges the replies with its next command, or at once past
    /// [`ACK_EVERY_BYTES`]; a driver with nothing more to write calls
    /// [`acknowledge`](Self::acknowledge).
    pub fn handle_input(
        &mut self,
        input: &mut RecvBuffer,
        deliver: impl FnMut(Event<T>),
    ) -> Result<(), ClientSessionError> {
        let buffered = input.len();
        if let Some(liveness) = self.liveness.as_mut().filter(|_| buffered > self.input_seen) {
            liveness.heard();
        }
        let decoded = self.decode_replies(input, deliver);
        self.input_seen = input.len();
        self.send_held();
        if self.resumable {
            self.unacked_bytes += buffered - input.len();
            if self.unacked_bytes >= ACK_EVERY_BYTES {
                self.acknowledge();
            }
        }
        let rest = self.next_reply_len(input).unwrap_or(urb::HEADER_LEN).saturating_sub(input.len());
        input.reserve_for_next(rest);
        decoded
    }

    fn decode_replies(
        &mut self,
        input: &mut RecvBuffer,
        mut deliver: impl FnMut(Event<T>),
    ) -> Result<(), ClientSessionError> {
        loop {
            if let Some(reason) = self.resumable.then(|| resume::parse_end(input)).flatten() {
                return Err(match reason {
                    resume::EndReason::REENUMERATED => ClientSessionError::Reenumerated,
                    _ => ClientSessionError::ServerEnded,
                });
            }
            if self.liveness.is_some() && liveness::is_ping(input) {
                bytes::Buf::advance(&mut **input, urb::HEADER_LEN);
                continue;
            }
            let outstanding = &self.outstanding;
            let shape = |seqnum: u32| match outstanding.get(seqnum) {
                Some(Outstanding { sent: Sent::Submit(shape), .. }) => Some(*shape),
                _ => None,
            };
            let Some(message) = urb::decode_return(input, &self.limits, shape)? else { break };
            self.replies_received += 1;
            // One call of `deliver` (so the driver's handler is inlined here).
            let event = match message {
                ServerMessage::Submit(reply) => {
                    // decode_return found it outstanding, as a submit.
                    let Some(done) = self.outstanding.remove(reply.seqnum) else { continue };
                    self.forget(reply.seqnum, done.sent);
                    let Some(tag) = done.tag else { continue };
                    Event::Completed { reply, tag }
                }
                ServerMessage::Unlink(reply) => match self.unlink_answered(reply) {
                    Some(event) => event,
                    None => continue,
                },
            };
            deliver(event);
        }
        Ok(())
    }

    /// The event of a `RET_UNLINK`, if it answers an unlink outstanding
    /// (its target ends too when the server cancelled it).
    #[inline(never)]
    fn unlink_answered(&mut self, reply: RetUnlink) -> Option<Event<T>> {
        match self.outstanding.remove(reply.seqnum) {
            Some(Outstanding { sent: sent @ Sent::Unlink { target }, .. }) => {
                self.forget(reply.seqnum, sent);
                let cancelled = if reply.status == Status::ECONNRESET {
                    self.outstanding.remove(target).and_then(|done| {
                        self.forget(target, done.sent);
                        done.tag.map(|tag| (target, tag))
                    })
                } else {
                    None
                };
                Some(Event::Unlinked { reply, target, cancelled })
            }
            Some(other) => {
                // A RET_UNLINK naming a submit: the kernel's vhci logs and ignores it.
                tracing::debug!(seqnum = reply.seqnum, "RET_UNLINK for a submit; ignored");
                self.outstanding.insert(reply.seqnum, other);
                None
            }
            None => {
                tracing::debug!(seqnum = reply.seqnum, "RET_UNLINK for nothing outstanding; ignored");
                None
            }
        }
    }

    /// Queues the acknowledgement of every reply received, if one is due
    /// (resumable sessions). Returns whether it queued one.
    pub fn acknowledge(&mut self) -> bool {
        if !self.resumable || !self.connected || self.replies_received == self.replies_acked {
            return false;
        }
        self.outbox.push_header(&resume::ack_header(self.devid, self.replies_received));
        self.replies_acked = self.replies_received;
        self.unacked_bytes = 0;
        true
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

    /// Seqnums outstanding (submitted or unlinking, no answer yet), with
    /// those still waiting for room in the server's table.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len() + self.held.len()
    }

    /// Seqnums outstanding (as [`outstanding`](Self::outstanding)) and the
    /// `transfer_buffer_length` of their submits: what they hold of the
    /// budget's in-flight limits.
    pub fn in_flight(&self) -> (usize, usize) {
        let held: usize = self
            .held
            .iter()
            .map(|(command, _)| match command {
                Command::Submit(submit) => submit.transfer_buffer_length as usize,
                Command::Unlink(_) => 0,
            })
            .sum();
        (self.outstanding(), self.outstanding_bytes + held)
    }

    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// The connection is gone: unwritten commands are dropped (and the
    /// driver drops what it read and did not decode); every command stays outstanding, to be sent again by
    /// [`resumed`](Self::resumed) if the server never got it (a session that
    /// is not resumable cannot resume: its caller ends it).
    pub fn disconnected(&mut self) {
        self.input_seen = 0;
        self.outbox.clear();
        self.connected = false;
    }

    /// Server messages received whole so far: what a resume request carries.
    pub fn replies_received(&self) -> u64 {
        self.replies_received
    }

    /// The server took the session over on a new connection, having received
    /// `commands_received` commands whole (the driver reads the new connection
    /// into an emptied buffer, past the server's answer). Queues every later
    /// command again, in order. Only for a
    /// [resumable](Self::resumable) session ([`ClientSessionError::NotResumable`]).
    pub fn resumed(&mut self, commands_received: u64) -> Result<usize, ClientSessionError> {
        if !self.resumable {
            return Err(ClientSessionError::NotResumable);
        }
        if commands_received > self.commands_sent {
            return Err(ClientSessionError::BadCommandCount { claimed: commands_received, sent: self.commands_sent });
        }
        let mut again: Vec<&Kept> = self.kept.values().filter(|pending| pending.index >= commands_received).collect();
        again.sort_by_key(|pending| pending.index);
        self.outbox.clear();
        for pending in &again {
            match &pending.command {
                Command::Submit(submit) => self.outbox.push_cmd_submit(submit),
                Command::Unlink(unlink) => self.outbox.push_header(&unlink.header()),
            }
        }
        self.input_seen = 0;
        if let Some(liveness) = &mut self.liveness {
            liveness.reconnected();
        }
        // The resume request carried the count.
        self.replies_acked = self.replies_received;
        self.unacked_bytes = 0;
        self.connected = true;
        Ok(again.len())
    }

    /// `seqnum`, which was `sent`, is answered: it no longer counts, and is no longer kept.
    #[inline]
    fn forget(&mut self, seqnum: u32, sent: Sent) {
        if let Sent::Submit(shape) = sent {
            self.outstanding_bytes -= shape.transfer_buffer_length as usize;
            self.outstanding_submits -= 1;
        }
        if self.resumable {
            self.kept.remove(seqnum);
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::{Bytes, BytesMut};

    use super::*;
    use crate::urb::TransferFlags;
    use crate::Direction;

    const DEVID: u32 = 0x0001_0002;

    fn bulk_in(seqnum: u32, length: u32) -> CmdSubmit {
        CmdSubmit {
            seqnum,
            devid: DEVID,
            direction: Direction::In,
            ep: 1,
            transfer_flags: TransferFlags::default(),
            transfer_buffer_length: length,
            start_frame: 0,
            number_of_packets: 0,
            interval: 0,
            setup: [0; 8],
            data: Bytes::new(),
            iso_packets: vec![],
        }
    }

    fn reply(seqnum: u32, length: usize) -> BytesMut {
        let ret = RetSubmit {
            seqnum,
            status: Status::OK,
            actual_length: length as u32,
            start_frame: 0,
            number_of_packets: 0,
            error_count: 0,
            data: Bytes::from(vec![7; length]),
            iso_packets: vec![],
        };
        let mut out = BytesMut::new();
        ret.encode(&mut out);
        out
    }

    /// Everything queued, as the bytes a driver would write.
    fn written(session: &mut ClientSession<u32>) -> Vec<u8> {
        let outbox = session.outbox();
        let bytes: Vec<u8> = outbox.slices(64).iter().flat_map(|slice| slice.to_vec()).collect();
        outbox.advance(bytes.len());
        bytes
    }

    /// The server's `bytes`, read into a fresh buffer and passed in as a
    /// driver does: the events delivered, and the session's verdict.
    fn feed(session: &mut ClientSession<u32>, bytes: &[u8]) -> (Vec<Event<u32>>, Result<(), ClientSessionError>) {
        let mut input = RecvBuffer::with_capacity(READ_CHUNK);
        input.extend_from_slice(bytes);
        let mut events = Vec::new();
        let handled = session.handle_input(&mut input, |event| events.push(event));
        (events, handled)
    }

    fn acks_in(bytes: &[u8]) -> Vec<u64> {
        bytes.chunks(urb::HEADER_LEN).filter_map(resume::parse_ack).collect()
    }

    fn session_with(outstanding: u32, length: u32) -> ClientSession<u32> {
        let mut session = ClientSession::new(DEVID, Limits::default(), Budget::default()).resumable();
        for seqnum in 1..=outstanding {
            session.submit(bulk_in(seqnum, length), seqnum).unwrap();
        }
        written(&mut session);
        session
    }

    #[test]
    fn an_acknowledgement_rides_in_front_of_the_next_command() {
        let mut session = session_with(2, 512);
        feed(&mut session, &reply(1, 512)).1.unwrap();
        assert!(session.outbox().is_empty(), "a small read is not acknowledged by a write of its own");
        session.submit(bulk_in(3, 512), 3).unwrap();
        let bytes = written(&mut session);
        assert_eq!(acks_in(&bytes[..urb::HEADER_LEN]), vec![1], "the ack comes first");
        assert_eq!(bytes.len(), 2 * urb::HEADER_LEN, "then the command");
        assert!(!session.acknowledge(), "nothing more is due");
    }

    #[test]
    fn an_idle_driver_acknowledges_what_was_received() {
        let mut session = session_with(2, 512);
        assert!(!session.acknowledge(), "nothing received yet");
        let mut both = reply(1, 512);
        both.extend_from_slice(&reply(2, 0));
        feed(&mut session, &both).1.unwrap();
        assert!(session.acknowledge());
        assert_eq!(acks_in(&written(&mut session)), vec![2]);
        assert!(!session.acknowledge());
    }

    #[test]
    fn a_busy_session_acknowledges_once_a_read_worth_is_unacknowledged() {
        let length = 64 * 1024;
        let count = (ACK_EVERY_BYTES / length + 1) as u32;
        let mut session = session_with(count, length as u32);
        for seqnum in 1..=count {
            feed(&mut session, &reply(seqnum, length)).1.unwrap();
            let acks = acks_in(&written(&mut session));
            if (seqnum as usize) * (length + urb::HEADER_LEN) < ACK_EVERY_BYTES {
                assert!(acks.is_empty(), "acknowledged after {seqnum} replies");
            } else {
                assert_eq!(acks, vec![u64::from(seqnum)], "not acknowledged past ACK_EVERY_BYTES");
                return;
            }
        }
        panic!("never acknowledged");
    }

    #[test]
    fn the_servers_end_comes_after_the_replies_before_it() {
        let mut session = session_with(2, 512);
        let mut bytes = reply(1, 512);
        bytes.extend_from_slice(&resume::end_header(DEVID));
        let (events, handled) = feed(&mut session, &bytes);
        assert!(matches!(handled, Err(ClientSessionError::ServerEnded)));
        assert!(matches!(events.as_slice(), [Event::Completed { tag: 1, .. }]));
    }

    #[test]
    fn an_end_saying_the_device_reenumerated_comes_after_the_replies_before_it() {
        let mut session = session_with(2, 512);
        let mut bytes = reply(1, 512);
        bytes.extend_from_slice(&resume::end_header_for(DEVID, resume::EndReason::REENUMERATED));
        let (events, handled) = feed(&mut session, &bytes);
        assert!(matches!(handled, Err(ClientSessionError::Reenumerated)));
        assert!(matches!(events.as_slice(), [Event::Completed { tag: 1, .. }]));
        // A reason this client does not know is an ordinary end.
        let mut session = session_with(1, 512);
        let (_, handled) = feed(&mut session, &resume::end_header_for(DEVID, resume::EndReason(7)));
        assert!(matches!(handled, Err(ClientSessionError::ServerEnded)));
    }

    #[test]
    fn a_stock_session_takes_an_end_for_garbage() {
        let mut session = ClientSession::new(DEVID, Limits::default(), Budget::default());
        session.submit(bulk_in(1, 512), 1).unwrap();
        let (_, handled) = feed(&mut session, &resume::end_header(DEVID));
        assert!(matches!(handled, Err(ClientSessionError::Decode(_))));
    }

    fn bulk_out(seqnum: u32, data: Bytes) -> CmdSubmit {
        CmdSubmit {
            direction: Direction::Out,
            ep: 2,
            transfer_buffer_length: data.len() as u32,
            data,
            ..bulk_in(seqnum, 0)
        }
    }

    #[test]
    fn a_stock_session_keeps_no_command_once_its_bytes_are_written() {
        // Above the outbox's copy threshold, so the outbox holds the payload itself until written.
        let payload = Bytes::from(vec![0xa5; 4096]);
        let mut session = ClientSession::new(DEVID, Limits::default(), Budget::default());
        session.submit(bulk_out(1, payload.clone()), 1).unwrap();
        session.unlink(CmdUnlink { seqnum: 2, devid: DEVID, unlink_seqnum: 1 }).unwrap();
        assert!(!payload.is_unique(), "queued for writing");
        assert_eq!(written(&mut session).len(), 2 * urb::HEADER_LEN + payload.len());
        assert!(payload.is_unique(), "written: nothing in the session still holds the OUT data");
        assert_eq!((session.kept.len(), session.outstanding()), (0, 2), "both outstanding, neither kept whole");
        // The replies are still checked against what was sent: a RET_SUBMIT
        // claiming more than the 4096 bytes submitted is refused.
        let mut too_long = reply(1, 0);
        too_long[0x18..0x1c].copy_from_slice(&4097u32.to_be_bytes());
        let (_, handled) = feed(&mut session, &too_long);
        assert!(matches!(handled, Err(ClientSessionError::Decode(_))));
    }

    #[test]
    fn a_resumable_session_keeps_each_command_until_its_reply() {
        let payload = Bytes::from(vec![0xa5; 4096]);
        let mut session = ClientSession::new(DEVID, Limits::default(), Budget::default()).resumable();
        session.submit(bulk_out(1, payload.clone()), 1).unwrap();
        written(&mut session);
        assert!(!payload.is_unique(), "kept to send again after a cut");
        let mut answer = reply(1, 0);
        answer[0x18..0x1c].copy_from_slice(&4096u32.to_be_bytes());
        let (events, handled) = feed(&mut session, &answer);
        handled.unwrap();
        assert!(matches!(events.as_slice(), [Event::Completed { tag: 1, .. }]));
        assert!(payload.is_unique(), "answered: let go");
        assert_eq!(session.kept.len(), 0);
    }

    #[test]
    fn a_stock_session_keeps_to_its_budget_and_cannot_resume() {
        let budget = Budget { in_flight_urbs: 2, in_flight_bytes: 1024, ..Budget::default() };
        let mut session = ClientSession::new(DEVID, Limits::default(), budget);
        session.submit(bulk_in(1, 512), 1).unwrap();
        assert!(session.wants_commands());
        session.submit(bulk_in(2, 512), 2).unwrap();
        assert!(!session.wants_commands(), "two URBs and 1024 bytes in flight: full");
        written(&mut session);
        feed(&mut session, &reply(1, 512)).1.unwrap();
        assert!(session.wants_commands(), "one answered: room again");
        session.submit(bulk_in(3, 2048), 3).unwrap();
        assert!(!session.wants_commands(), "bytes over budget");
        assert!(matches!(session.submit(bulk_in(2, 8), 9), Err(ClientSessionError::DuplicateSeqnum(2))));
        session.disconnected();
        assert!(matches!(session.resumed(0), Err(ClientSessionError::NotResumable)));
    }

    #[test]
    fn a_stock_session_never_acknowledges() {
        let mut session = ClientSession::new(DEVID, Limits::default(), Budget::default());
        session.submit(bulk_in(1, 512), 1).unwrap();
        written(&mut session);
        feed(&mut session, &reply(1, 512)).1.unwrap();
        assert!(!session.acknowledge());
        assert!(session.outbox().is_empty());
    }
}
