//! [`ServerSession`]: the server side of one imported device's URB phase, sans
//! I/O. Fed the bytes a client sent and the completions the device produced,
//! it yields what to ask of the device ([`DeviceCall`]) and the replies to
//! send ([`Outbox`]). It owns the in-flight table, the unlink rules and the
//! memory budget; the caller owns the socket, the device and the clock.
//!
//! Unlink, following the kernel stub (`docs/protocol.md` §4.1): if the
//! target is still in flight, the device is asked to cancel it; when it comes
//! back cancelled, only RET_UNLINK(-ECONNRESET) is sent (vhci gives the URB
//! back on it). If it completed anyway, its RET_SUBMIT goes first and then
//! RET_UNLINK(0), so no data is lost and vhci never sees a RET_SUBMIT for a URB
//! it already gave back. An unlink for a URB not in flight gets RET_UNLINK(0)
//! at once — any RET_SUBMIT for it is already ahead of it in the stream.
//!
//! Memory follows the [`Budget`]: commands are taken only while URBs in flight
//! and reply bytes waiting are under budget ([`wants_input`]); a submit that
//! would overdraw the in-flight bytes waits, decoded, until completions make
//! room; completions should be collected only while [`wants_completions`]. A
//! peer that stops reading its replies thus stops being read, whatever it sends.
//!
//! Resume ([`crate::resume`]): a resumable session keeps every reply it
//! queued until the client acknowledges it, counts the commands it took, and
//! outlives its connection: after [`disconnected`] the device's completions
//! are held (within the budget), and [`resume`] with the client's count of
//! replies received queues again exactly the replies the client lacks and
//! returns the count of commands received, for the client to send the rest.
//!
//! A driver's loop, in order: read into [`input`] while [`wants_input`], call
//! [`handle_input`] and carry out each [`DeviceCall`] from [`poll_device_call`];
//! feed completions to [`complete`] while [`wants_completions`]; write
//! [`outbox`] slices.
//!
//! [`wants_input`]: ServerSession::wants_input
//! [`wants_completions`]: ServerSession::wants_completions
//! [`input`]: ServerSession::input
//! [`handle_input`]: ServerSession::handle_input
//! [`poll_device_call`]: ServerSession::poll_device_call
//! [`complete`]: ServerSession::complete
//! [`outbox`]: ServerSession::outbox
//! [`disconnected`]: ServerSession::disconnected
//! [`resume`]: ServerSession::resume

mod stages;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use stages::{Next, Stages};

use crate::liveness::{self, Due, Link, Liveness};
use crate::outbox::Outbox;
use crate::urb::{self, ClientMessage, CmdSubmit, RetSubmit, RetUnlink, ServerMessage};
use crate::{resume, storage};
use crate::{Budget, BudgetKind, DecodeError, Direction, Limits, RecvBuffer, SeqnumMap, Status};

/// What a read buffer grows by, at least.
const READ_CHUNK: usize = 256 * 1024;
/// Read buffers a session keeps for reuse once the OUT payloads in them are
/// dropped: a few large commands' worth, so a stream of 1 MiB OUT URBs does not
/// fault in a fresh megabyte each, and little memory held by an idle connection.
const SPARE_BYTES: usize = 4 << 20;

/// What the session asks of the device, in order.
#[derive(Debug, PartialEq, Eq)]
pub enum DeviceCall {
    /// Start this URB.
    Submit(CmdSubmit),
    /// Ask the URB with this seqnum to end early; its completion comes back as usual.
    Cancel { seqnum: u32 },
}

/// Why a session must end: the client broke the protocol. The connection is
/// closed (as the kernel stub does); other connections are unaffected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SessionError {
    #[error("malformed message: {0}")]
    Decode(#[from] DecodeError),
    /// A command named another device than the one imported on this connection.
    #[error("devid {got:#x} does not match the imported device ({expected:#x})")]
    DevidMismatch { got: u32, expected: u32 },
    /// A CMD_SUBMIT reused the seqnum of a URB still in flight.
    #[error("seqnum {0} is already in flight")]
    DuplicateSeqnum(u32),
    /// An acknowledgement or resume named a count of replies the session never
    /// sent, or fewer than were already acknowledged.
    #[error("client claims {claimed} replies received; {acked}..={sent} is possible")]
    BadReplyCount { claimed: u64, acked: u64, sent: u64 },
    /// A resume for a session that did not negotiate it.
    #[error("session is not resumable")]
    NotResumable,
    /// Keep-alive: nothing arrived from the client for this long while it
    /// should have pinged. The link is dead though it never said so: a
    /// resumable session parks for the client to come back.
    #[error("nothing heard from the client for {:.1} s", .0.as_secs_f64())]
    Silent(Duration),
}

/// A URB handed to the device and not yet completed.
struct InFlightUrb {
    /// Its `transfer_buffer_length`, counted against the in-flight budget.
    length: usize,
    /// The seqnum of a CMD_UNLINK aimed at it, if any.
    unlink: Option<u32>,
}

/// Replies kept until the client acknowledges them (resumable sessions only).
#[derive(Default)]
struct ReplayLog {
    held: VecDeque<ServerMessage>,
    /// Wire bytes of `held`.
    held_bytes: usize,
    /// Replies acknowledged: the index of `held`'s front.
    acked: u64,
}

impl ReplayLog {
    fn sent(&self) -> u64 {
        self.acked + self.held.len() as u64
    }

    /// Drops what the client has received: `received` replies in all.
    fn acknowledge(&mut self, received: u64) -> Result<(), SessionError> {
        let sent = self.sent();
        if received < self.acked || received > sent {
            return Err(SessionError::BadReplyCount { claimed: received, acked: self.acked, sent });
        }
        while self.acked < received {
            if let Some(message) = self.held.pop_front() {
                self.held_bytes -= wire_len(&message);
            }
            self.acked += 1;
        }
        Ok(())
    }
}

fn wire_len(message: &ServerMessage) -> usize {
    match message {
        ServerMessage::Submit(ret) => {
            urb::HEADER_LEN + ret.data.len() + ret.iso_packets.len() * urb::ISO_DESCRIPTOR_LEN
        }
        ServerMessage::Unlink(_) => urb::HEADER_LEN,
    }
}

pub struct ServerSession {
    devid: u32,
    limits: Limits,
    budget: Budget,
    /// Reused once the OUT payloads decoded from it are dropped.
    inbuf: RecvBuffer,
    in_flight: SeqnumMap<InFlightUrb>,
    /// `transfer_buffer_length` summed over `in_flight`.
    in_flight_bytes: usize,
    /// A decoded submit the in-flight byte budget had no room for yet.
    waiting_submit: Option<CmdSubmit>,
    calls: VecDeque<DeviceCall>,
    outbox: Outbox,
    /// Commands (submits and unlinks) decoded whole since the import.
    commands_received: u64,
    /// `Some` for a resumable session.
    replay: Option<ReplayLog>,
    /// Whether a connection is attached (always, unless resumable and between connections).
    connected: bool,
    /// The client ended the session (a resumable client's last message).
    ended: bool,
    /// `Some` when keep-alive was negotiated ([`crate::liveness`]).
    liveness: Option<Liveness>,
    /// Input buffered after the last [`handle_input`](Self::handle_input):
    /// more at the next call means the client said something.
    input_seen: usize,
    /// `Some` when the storage extension was agreed: the stage gate.
    stages: Option<Stages>,
}

impl ServerSession {
    /// A session for the device `devid`; `leftover` is what was read past the
    /// import request (URB traffic that came with it).
    pub fn new(devid: u32, leftover: BytesMut, limits: Limits, budget: Budget) -> Self {
        Self {
            devid,
            limits,
            budget,
            inbuf: RecvBuffer::holding(leftover, READ_CHUNK, SPARE_BYTES),
            in_flight: SeqnumMap::default(),
            in_flight_bytes: 0,
            waiting_submit: None,
            calls: VecDeque::new(),
            outbox: Outbox::default(),
            commands_received: 0,
            replay: None,
            connected: true,
            ended: false,
            liveness: None,
            input_seen: 0,
            stages: None,
        }
    }

    /// Runs URBs flagged as mass-storage stages one at a time, in order, and
    /// skips one chained to a failed stage ([`crate::storage`]; the client
    /// asked for it).
    pub fn storage(mut self) -> Self {
        self.stages = Some(Stages::default());
        self
    }

    /// Sends keep-alives and watches for silence ([`crate::liveness`]; the
    /// client asked for it; resumable sessions only), from `now` on. Drive it
    /// with [`poll_timeout`](Self::poll_timeout) and [`handle_timeout`](Self::handle_timeout).
    pub fn keepalive(mut self, now: Instant) -> Self {
        if self.replay.is_some() {
            self.liveness = Some(Liveness::new(now));
        }
        self
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next, if ever
    /// (keep-alive sessions, while connected).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.liveness.as_ref().filter(|_| self.connected && !self.ended).map(Liveness::deadline)
    }

    /// Queues a keep-alive when this side has been quiet, or says the link
    /// is dead: nothing heard for [`liveness::BUSY_SILENCE`] with URBs in
    /// flight, [`liveness::IDLE_SILENCE`] without. Time spent not reading
    /// the client (its input held by the budget) does not count as silence.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), SessionError> {
        if !self.connected || self.ended {
            return Ok(());
        }
        let listening = self.wants_input();
        let Some(liveness) = self.liveness.as_mut() else { return Ok(()) };
        let link = Link {
            busy: !self.in_flight.is_empty() || self.waiting_submit.is_some(),
            listening,
            written: self.outbox.written(),
            unsent: !self.outbox.is_empty(),
        };
        match liveness.tick(now, link) {
            Due::Nothing => Ok(()),
            Due::Ping => {
                self.outbox.push_header(&liveness::ping_header(self.devid));
                Ok(())
            }
            Due::Dead(silent) => Err(SessionError::Silent(silent)),
        }
    }

    /// Makes the session resumable: replies are kept until acknowledged and
    /// the client's acknowledgements are understood.
    pub fn resumable(mut self) -> Self {
        self.replay = Some(ReplayLog::default());
        self
    }

    pub fn is_resumable(&self) -> bool {
        self.replay.is_some()
    }

    /// The connection is gone. Partial input and unwritten replies are dropped
    /// (a resumable session holds every reply until acknowledged); URBs in
    /// flight go on, and their completions are held for [`resume`](Self::resume).
    pub fn disconnected(&mut self) {
        self.inbuf.clear();
        self.input_seen = 0;
        self.outbox.clear();
        self.connected = false;
    }

    /// A new connection takes the session over. `replies_received` is what the
    /// client got whole of this session's replies; every later one is queued
    /// again. `leftover` is what was read past the resume request. Returns the
    /// number of commands received whole, for the client to send the rest.
    pub fn resume(&mut self, replies_received: u64, leftover: BytesMut) -> Result<u64, SessionError> {
        let replay = self.replay.as_mut().ok_or(SessionError::NotResumable)?;
        replay.acknowledge(replies_received)?;
        self.outbox.clear();
        for message in &replay.held {
            match message {
                ServerMessage::Submit(ret) => self.outbox.push_ret_submit(ret),
                ServerMessage::Unlink(ret) => self.outbox.push_ret_unlink(ret),
            }
        }
        self.inbuf = RecvBuffer::holding(leftover, READ_CHUNK, SPARE_BYTES);
        self.input_seen = 0;
        if let Some(liveness) = &mut self.liveness {
            liveness.reconnected();
        }
        self.connected = true;
        Ok(self.commands_received)
    }

    /// Replies sent so far (resumable sessions), for logs: `(sent, unacknowledged)`.
    pub fn replies(&self) -> Option<(u64, usize)> {
        self.replay.as_ref().map(|replay| (replay.sent(), replay.held.len()))
    }

    /// Whether to read more from the client: URBs in flight and replies waiting
    /// are under budget and no submit is waiting for in-flight room.
    pub fn wants_input(&self) -> bool {
        self.input_held_by().is_none()
    }

    /// The full budget that keeps [`wants_input`](Self::wants_input) false, if one does.
    pub fn input_held_by(&self) -> Option<BudgetKind> {
        if self.waiting_submit.is_some() {
            Some(BudgetKind::InFlightBytes)
        } else if self.in_flight.len() >= self.budget.in_flight_urbs {
            Some(BudgetKind::InFlightUrbs)
        } else if self.outbox.queued() >= self.budget.queued_reply_bytes {
            Some(BudgetKind::QueuedReplyBytes)
        } else {
            None
        }
    }

    /// The buffer to read client bytes into, with room for the whole next
    /// message (so a large OUT payload lands in one buffer and reaches the
    /// device without a copy). `is_iso` tells isochronous endpoints apart.
    pub fn input(&mut self, is_iso: impl Fn(Direction, u8) -> bool) -> Result<&mut BytesMut, SessionError> {
        // Acknowledgements (one after each read the client makes) come between
        // commands: size the read for the command behind them, so a large OUT
        // payload still lands in one buffer.
        let mut at = 0;
        while self.extension_at(at).is_some() {
            at += urb::HEADER_LEN;
        }
        let next = urb::command_frame_len(&self.inbuf[at..], &self.limits, is_iso)?.map(|len| at + len);
        self.inbuf.reserve_for_next(next.unwrap_or(at + urb::HEADER_LEN).saturating_sub(self.inbuf.len()));
        Ok(&mut self.inbuf)
    }

    /// Decodes buffered commands while [`wants_input`](Self::wants_input) and
    /// queues what they ask of the device. Returns whether anything was taken.
    pub fn handle_input(&mut self, is_iso: impl Fn(Direction, u8) -> bool) -> Result<bool, SessionError> {
        if let Some(liveness) = self.liveness.as_mut().filter(|_| self.inbuf.len() > self.input_seen) {
            liveness.heard();
        }
        let handled = self.take_commands(is_iso);
        self.input_seen = self.inbuf.len();
        handled
    }

    fn take_commands(&mut self, is_iso: impl Fn(Direction, u8) -> bool) -> Result<bool, SessionError> {
        let mut handled = false;
        if let Some(submit) = self.waiting_submit.take() {
            if !self.budget.admits(self.in_flight_bytes, submit.transfer_buffer_length as usize) {
                self.waiting_submit = Some(submit);
                return Ok(false);
            }
            self.submit(submit);
            handled = true;
        }
        while self.wants_input() && !self.ended {
            match self.extension_in_front() {
                Some(resume::ACK) => {
                    // Read and advanced past, not split off: a split would turn the
                    // buffer into a shared one that cannot grow in place.
                    let received = resume::parse_ack(&self.inbuf[..urb::HEADER_LEN]);
                    bytes::Buf::advance(&mut *self.inbuf, urb::HEADER_LEN);
                    if let (Some(replay), Some(received)) = (self.replay.as_mut(), received) {
                        replay.acknowledge(received)?;
                    }
                    handled = true;
                    continue;
                }
                Some(liveness::PING) => {
                    bytes::Buf::advance(&mut *self.inbuf, urb::HEADER_LEN);
                    handled = true;
                    continue;
                }
                Some(_) => {
                    tracing::debug!("the client ended the session");
                    self.inbuf.clear();
                    self.ended = true;
                    return Ok(true);
                }
                None => {}
            }
            let Some(message) = urb::decode_command(&mut self.inbuf, &self.limits, &is_iso)? else { break };
            handled = true;
            self.commands_received += 1;
            match message {
                ClientMessage::Submit(submit) => {
                    self.check_devid(submit.devid)?;
                    if self.in_flight.contains_key(submit.seqnum) {
                        return Err(SessionError::DuplicateSeqnum(submit.seqnum));
                    }
                    if self.budget.admits(self.in_flight_bytes, submit.transfer_buffer_length as usize) {
                        self.submit(submit);
                    } else {
                        tracing::trace!(
                            seqnum = submit.seqnum,
                            in_flight_bytes = self.in_flight_bytes,
                            "submit waits for in-flight room"
                        );
                        self.waiting_submit = Some(submit);
                    }
                }
                ClientMessage::Unlink(unlink) => {
                    self.check_devid(unlink.devid)?;
                    tracing::trace!(seqnum = unlink.seqnum, target = unlink.unlink_seqnum, "unlink");
                    if self.stages.as_mut().is_some_and(|stages| stages.withdraw(unlink.unlink_seqnum)) {
                        // Never reached the device: it ends here, cancelled.
                        if let Some(urb) = self.in_flight.remove(unlink.unlink_seqnum) {
                            self.in_flight_bytes -= urb.length;
                        }
                        self.reply_unlink(RetUnlink { seqnum: unlink.seqnum, status: Status::ECONNRESET });
                        self.release_stages();
                        continue;
                    }
                    match self.in_flight.get_mut(unlink.unlink_seqnum) {
                        Some(pending) => {
                            pending.unlink = Some(unlink.seqnum);
                            self.calls.push_back(DeviceCall::Cancel { seqnum: unlink.unlink_seqnum });
                        }
                        None => self.reply_unlink(RetUnlink { seqnum: unlink.seqnum, status: Status::OK }),
                    }
                }
            }
        }
        Ok(handled)
    }

    /// The next thing to ask of the device, in the order the client asked.
    pub fn poll_device_call(&mut self) -> Option<DeviceCall> {
        self.calls.pop_front()
    }

    /// Whether to collect more completions from the device: replies waiting to
    /// be written, and replies not yet acknowledged, are under budget.
    ///
    /// Input is not gated on unacknowledged replies: the acknowledgements that
    /// free them come in the input.
    pub fn wants_completions(&self) -> bool {
        self.completions_held_by().is_none()
    }

    /// The full budget that keeps [`wants_completions`](Self::wants_completions) false, if one does.
    pub fn completions_held_by(&self) -> Option<BudgetKind> {
        if self.outbox.queued() >= self.budget.queued_reply_bytes {
            Some(BudgetKind::QueuedReplyBytes)
        } else if self.replay.as_ref().is_some_and(|replay| replay.held_bytes >= self.budget.unacked_reply_bytes) {
            Some(BudgetKind::UnackedReplyBytes)
        } else {
            None
        }
    }

    /// A URB the device finished, as its RET_SUBMIT; queues the replies it calls for.
    pub fn complete(&mut self, done: RetSubmit) {
        if let Some(stages) = &mut self.stages {
            stages.completed(done.seqnum, stages::succeeded(&done));
        }
        self.finish(done);
        self.release_stages();
    }

    /// Hands the device the next stage the gate lets through, skipping (and
    /// answering) those chained to a failed one.
    fn release_stages(&mut self) {
        while let Some(next) = self.stages.as_mut().and_then(Stages::next) {
            match next {
                Next::Run(submit) => self.calls.push_back(DeviceCall::Submit(submit)),
                Next::Skip(seqnum) => {
                    tracing::trace!(seqnum, "stage skipped: the one before it failed");
                    if let Some(stages) = &mut self.stages {
                        stages.skipped();
                    }
                    self.finish(stages::skipped(seqnum));
                }
            }
        }
    }

    /// Takes a finished URB out of the in-flight table and queues its replies.
    fn finish(&mut self, done: RetSubmit) {
        let Some(urb) = self.in_flight.remove(done.seqnum) else {
            tracing::warn!(seqnum = done.seqnum, "device completed a URB that is not in flight; dropped");
            return;
        };
        self.in_flight_bytes -= urb.length;
        tracing::trace!(seqnum = done.seqnum, status = ?done.status, len = done.actual_length, "complete");
        match urb.unlink {
            Some(unlink_seqnum) if done.status == Status::ECONNRESET => {
                self.reply_unlink(RetUnlink { seqnum: unlink_seqnum, status: Status::ECONNRESET });
            }
            Some(unlink_seqnum) => {
                self.reply_submit(done);
                self.reply_unlink(RetUnlink { seqnum: unlink_seqnum, status: Status::OK });
            }
            None => self.reply_submit(done),
        }
    }

    fn reply_submit(&mut self, ret: RetSubmit) {
        if self.connected {
            self.outbox.push_ret_submit(&ret);
        }
        if let Some(replay) = &mut self.replay {
            let message = ServerMessage::Submit(ret);
            replay.held_bytes += wire_len(&message);
            replay.held.push_back(message);
        }
    }

    fn reply_unlink(&mut self, ret: RetUnlink) {
        if self.connected {
            self.outbox.push_ret_unlink(&ret);
        }
        if let Some(replay) = &mut self.replay {
            replay.held_bytes += urb::HEADER_LEN;
            replay.held.push_back(ServerMessage::Unlink(ret));
        }
    }

    /// A resumable session's next input, when it is one of our own messages
    /// (an acknowledgement, a keep-alive or the end) and whole.
    fn extension_in_front(&self) -> Option<urb::Command> {
        self.extension_at(0)
    }

    /// The same, for the whole message at offset `at` of the input.
    fn extension_at(&self, at: usize) -> Option<urb::Command> {
        if self.replay.is_none() || self.inbuf.len() < at + urb::HEADER_LEN {
            return None;
        }
        let word = &self.inbuf[at..at + 4];
        let command = urb::Command(u32::from_be_bytes([word[0], word[1], word[2], word[3]]));
        let ours =
            [resume::ACK, resume::END].contains(&command) || (self.liveness.is_some() && command == liveness::PING);
        ours.then_some(command)
    }

    /// Replies waiting to be written.
    pub fn outbox(&mut self) -> &mut Outbox {
        &mut self.outbox
    }

    /// Ends a resumable session from this side (the server shuts down): its
    /// last message, after every reply queued, tells the client not to try to
    /// resume. Write the outbox out, then close. Stock sessions get nothing.
    pub fn end(&mut self) {
        self.end_for(resume::EndReason::DONE);
    }

    /// Ends a resumable session saying why (the device re-enumerated:
    /// [`resume::EndReason::REENUMERATED`]), after every reply queued. Stock
    /// sessions get nothing: their client sees the connection close.
    pub fn end_for(&mut self, reason: resume::EndReason) {
        if self.replay.is_some() && self.connected {
            self.outbox.push_header(&resume::end_header_for(self.devid, reason));
        }
    }

    /// Whether the client ended the session: release the device, do not wait for a resume.
    pub fn client_ended(&self) -> bool {
        self.ended
    }

    /// Whether a connection is attached.
    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// No URB in flight and nothing left to write.
    pub fn is_idle(&self) -> bool {
        self.in_flight.is_empty() && self.outbox.is_empty()
    }

    fn submit(&mut self, submit: CmdSubmit) {
        tracing::trace!(seqnum = submit.seqnum, ep = submit.ep, dir = ?submit.direction, len = submit.transfer_buffer_length, "submit");
        let length = submit.transfer_buffer_length as usize;
        self.in_flight.insert(submit.seqnum, InFlightUrb { length, unlink: None });
        self.in_flight_bytes += length;
        match &mut self.stages {
            Some(stages) if storage::is_stage(submit.transfer_flags) => {
                stages.hold(submit);
                self.release_stages();
            }
            _ => self.calls.push_back(DeviceCall::Submit(submit)),
        }
    }

    fn check_devid(&self, devid: u32) -> Result<(), SessionError> {
        // The kernel stub tears the connection down on a mismatch; so do we.
        if devid == self.devid {
            Ok(())
        } else {
            Err(SessionError::DevidMismatch { got: devid, expected: self.devid })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::urb::{CmdUnlink, TransferFlags};
    use bytes::Bytes;

    const DEVID: u32 = 0x0001_0002;

    fn submit(seqnum: u32, direction: Direction, length: u32) -> CmdSubmit {
        CmdSubmit {
            seqnum,
            devid: DEVID,
            direction,
            ep: 1,
            transfer_flags: TransferFlags::default(),
            transfer_buffer_length: length,
            start_frame: 0,
            number_of_packets: 0,
            interval: 0,
            setup: [0; 8],
            data: if direction == Direction::Out { Bytes::from(vec![0xa5; length as usize]) } else { Bytes::new() },
            iso_packets: vec![],
        }
    }

    fn submit_bytes(seqnum: u32, direction: Direction, length: u32) -> BytesMut {
        let mut out = BytesMut::new();
        submit(seqnum, direction, length).encode(&mut out);
        out
    }

    fn unlink_bytes(seqnum: u32, target: u32) -> BytesMut {
        BytesMut::from(&CmdUnlink { seqnum, devid: DEVID, unlink_seqnum: target }.header()[..])
    }

    fn done(seqnum: u32, status: Status, data: &[u8]) -> RetSubmit {
        RetSubmit {
            seqnum,
            status,
            actual_length: data.len() as u32,
            start_frame: 0,
            number_of_packets: 0,
            error_count: 0,
            data: Bytes::copy_from_slice(data),
            iso_packets: vec![],
        }
    }

    fn session(budget: Budget) -> ServerSession {
        ServerSession::new(DEVID, BytesMut::new(), Limits::default(), budget)
    }

    /// Feeds `bytes` as if read from the socket and returns the device calls.
    fn feed(session: &mut ServerSession, bytes: &[u8]) -> Vec<DeviceCall> {
        session.input(|_, _| false).unwrap().extend_from_slice(bytes);
        session.handle_input(|_, _| false).unwrap();
        std::iter::from_fn(|| session.poll_device_call()).collect()
    }

    /// (command, seqnum, status) of every reply written so far, and empties the outbox.
    fn replies(session: &mut ServerSession) -> Vec<(u32, u32, i32)> {
        let outbox = session.outbox();
        let mut wire = Vec::new();
        while !outbox.is_empty() {
            let mut took = 0;
            for slice in outbox.slices(64) {
                wire.extend_from_slice(&slice);
                took += slice.len();
            }
            outbox.advance(took);
        }
        let mut out = Vec::new();
        let mut at = 0;
        while at < wire.len() {
            let word = |i: usize| u32::from_be_bytes(wire[at + i..at + i + 4].try_into().unwrap());
            let (command, seqnum, status) = (word(0), word(4), word(20) as i32);
            let payload = if command == 3 { word(24) as usize } else { 0 };
            out.push((command, seqnum, status));
            at += urb::HEADER_LEN + payload;
        }
        out
    }

    const RET_SUBMIT: u32 = 3;
    const RET_UNLINK: u32 = 4;

    #[test]
    fn unlink_of_a_urb_that_comes_back_cancelled_answers_only_the_unlink() {
        let mut session = session(Budget::default());
        assert_eq!(
            feed(&mut session, &submit_bytes(1, Direction::In, 64)),
            vec![DeviceCall::Submit(submit(1, Direction::In, 64))]
        );
        assert_eq!(feed(&mut session, &unlink_bytes(2, 1)), vec![DeviceCall::Cancel { seqnum: 1 }]);
        assert!(replies(&mut session).is_empty(), "nothing is answered before the device gives the URB back");
        session.complete(done(1, Status::ECONNRESET, &[]));
        assert_eq!(replies(&mut session), vec![(RET_UNLINK, 2, Status::ECONNRESET.0)]);
        assert!(session.is_idle());
    }

    #[test]
    fn unlink_of_a_urb_that_completed_anyway_sends_its_data_then_unlink_zero() {
        let mut session = session(Budget::default());
        feed(&mut session, &submit_bytes(1, Direction::In, 64));
        feed(&mut session, &unlink_bytes(2, 1));
        session.complete(done(1, Status::OK, b"data"));
        assert_eq!(replies(&mut session), vec![(RET_SUBMIT, 1, 0), (RET_UNLINK, 2, 0)]);
    }

    #[test]
    fn unlink_of_a_urb_not_in_flight_is_answered_at_once() {
        let mut session = session(Budget::default());
        feed(&mut session, &submit_bytes(1, Direction::In, 64));
        session.complete(done(1, Status::OK, b"x"));
        assert_eq!(feed(&mut session, &unlink_bytes(2, 1)), vec![], "the device is not asked");
        assert_eq!(replies(&mut session), vec![(RET_SUBMIT, 1, 0), (RET_UNLINK, 2, 0)]);
        feed(&mut session, &unlink_bytes(3, 999));
        assert_eq!(replies(&mut session), vec![(RET_UNLINK, 3, 0)]);
    }

    #[test]
    fn a_completion_for_a_urb_not_in_flight_is_dropped() {
        let mut session = session(Budget::default());
        session.complete(done(7, Status::OK, b"stray"));
        assert!(replies(&mut session).is_empty());
    }

    #[test]
    fn a_submit_beyond_the_in_flight_bytes_waits_for_room_and_keeps_its_place() {
        let mut session = session(Budget { in_flight_bytes: 1000, ..Budget::default() });
        let mut wire = submit_bytes(1, Direction::Out, 600);
        wire.extend_from_slice(&submit_bytes(2, Direction::Out, 600));
        wire.extend_from_slice(&unlink_bytes(3, 999));
        let calls = feed(&mut session, &wire);
        assert_eq!(calls, vec![DeviceCall::Submit(submit(1, Direction::Out, 600))]);
        assert!(!session.wants_input(), "reading stops while a submit waits");
        assert_eq!(session.input_held_by(), Some(BudgetKind::InFlightBytes));
        assert_eq!(session.completions_held_by(), None);
        assert!(replies(&mut session).is_empty(), "the unlink behind it waits too");
        session.complete(done(1, Status::OK, &[]));
        assert!(session.handle_input(|_, _| false).unwrap());
        let calls: Vec<DeviceCall> = std::iter::from_fn(|| session.poll_device_call()).collect();
        assert_eq!(calls, vec![DeviceCall::Submit(submit(2, Direction::Out, 600))]);
        assert_eq!(replies(&mut session), vec![(RET_SUBMIT, 1, 0), (RET_UNLINK, 3, 0)]);
    }

    #[test]
    fn one_urb_larger_than_the_whole_budget_still_goes_through() {
        let mut session = session(Budget { in_flight_bytes: 100, ..Budget::default() });
        assert_eq!(feed(&mut session, &submit_bytes(1, Direction::Out, 4096)).len(), 1);
    }

    #[test]
    fn replies_over_budget_stop_input_and_completions_until_written() {
        let mut session = session(Budget { queued_reply_bytes: 4 * urb::HEADER_LEN, ..Budget::default() });
        let mut wire = BytesMut::new();
        for seqnum in 1..=10 {
            wire.extend_from_slice(&unlink_bytes(seqnum, 1000 + seqnum));
        }
        feed(&mut session, &wire);
        assert!(!session.wants_input() && !session.wants_completions());
        assert_eq!(session.input_held_by(), Some(BudgetKind::QueuedReplyBytes));
        assert_eq!(session.completions_held_by(), Some(BudgetKind::QueuedReplyBytes));
        assert_eq!(replies(&mut session).len(), 4, "four answers fit the budget; the rest wait unread");
        session.handle_input(|_, _| false).unwrap();
        assert_eq!(replies(&mut session).len(), 4);
        session.handle_input(|_, _| false).unwrap();
        assert_eq!(replies(&mut session).len(), 2, "nothing lost");
    }

    #[test]
    fn in_flight_urbs_over_budget_stop_input() {
        let mut session = session(Budget { in_flight_urbs: 2, ..Budget::default() });
        let mut wire = BytesMut::new();
        for seqnum in 1..=3 {
            wire.extend_from_slice(&submit_bytes(seqnum, Direction::In, 8));
        }
        assert_eq!(feed(&mut session, &wire).len(), 2);
        assert_eq!(session.input_held_by(), Some(BudgetKind::InFlightUrbs));
        session.complete(done(1, Status::OK, b"a"));
        assert_eq!(session.input_held_by(), None);
        session.handle_input(|_, _| false).unwrap();
        assert_eq!(session.poll_device_call(), Some(DeviceCall::Submit(submit(3, Direction::In, 8))));
    }

    #[test]
    fn protocol_violations_end_the_session() {
        let mut s = session(Budget::default());
        feed(&mut s, &submit_bytes(1, Direction::In, 8));
        s.input(|_, _| false).unwrap().extend_from_slice(&submit_bytes(1, Direction::In, 8));
        assert!(matches!(s.handle_input(|_, _| false), Err(SessionError::DuplicateSeqnum(1))));

        let mut s = session(Budget::default());
        let mut wrong = submit(1, Direction::In, 8);
        wrong.devid = DEVID + 1;
        let mut wire = BytesMut::new();
        wrong.encode(&mut wire);
        s.input(|_, _| false).unwrap().extend_from_slice(&wire);
        assert!(matches!(s.handle_input(|_, _| false), Err(SessionError::DevidMismatch { .. })));
    }

    #[test]
    fn a_resumable_clients_end_is_taken_after_the_commands_before_it() {
        let mut session = session(Budget::default()).resumable();
        let mut wire = submit_bytes(1, Direction::Out, 8);
        wire.extend_from_slice(&resume::end_header(DEVID));
        wire.extend_from_slice(&submit_bytes(2, Direction::Out, 8));
        assert_eq!(feed(&mut session, &wire), vec![DeviceCall::Submit(submit(1, Direction::Out, 8))]);
        assert!(session.client_ended(), "nothing after the end is taken");
        // A stock session knows no such command.
        let mut stock = session_stock();
        stock.input(|_, _| false).unwrap().extend_from_slice(&resume::end_header(DEVID));
        assert!(stock.handle_input(|_, _| false).is_err());
    }

    #[test]
    fn a_shutting_down_server_ends_only_resumable_sessions_after_their_replies() {
        let mut session = session(Budget::default()).resumable();
        feed(&mut session, &submit_bytes(1, Direction::In, 8));
        session.complete(done(1, Status::OK, &[1; 8]));
        session.end();
        let outbox = session.outbox();
        let wire: Vec<u8> = outbox.slices(16).iter().flat_map(|slice| slice.to_vec()).collect();
        assert_eq!(wire.len(), 2 * urb::HEADER_LEN + 8, "the reply, then the end");
        assert_eq!(wire[urb::HEADER_LEN + 8..], resume::end_header(DEVID));
        // Stock clients (vhci-hcd) never see the extension.
        let mut stock = session_stock();
        stock.end();
        assert!(stock.outbox().is_empty());
    }

    #[test]
    fn a_reenumerated_device_ends_a_resumable_session_with_its_reason_after_the_replies() {
        let mut session = session(Budget::default()).resumable();
        feed(&mut session, &submit_bytes(1, Direction::In, 8));
        session.complete(done(1, Status::OK, &[1; 8]));
        session.end_for(resume::EndReason::REENUMERATED);
        let wire: Vec<u8> = session.outbox().slices(16).iter().flat_map(|slice| slice.to_vec()).collect();
        assert_eq!(wire.len(), 2 * urb::HEADER_LEN + 8, "the reply, then the end");
        assert_eq!(resume::parse_end(&wire[urb::HEADER_LEN + 8..]), Some(resume::EndReason::REENUMERATED));
        let mut stock = session_stock();
        stock.end_for(resume::EndReason::REENUMERATED);
        assert!(stock.outbox().is_empty(), "a stock client sees the connection close, nothing else");
    }

    fn session_stock() -> ServerSession {
        session(Budget::default())
    }

    #[test]
    fn every_split_of_the_input_gives_the_same_device_calls() {
        let mut wire = submit_bytes(1, Direction::Out, 100);
        wire.extend_from_slice(&submit_bytes(2, Direction::In, 50));
        wire.extend_from_slice(&unlink_bytes(3, 2));
        let mut whole = session(Budget::default());
        let expected = feed(&mut whole, &wire);
        assert_eq!(expected.len(), 3);
        for at in 0..=wire.len() {
            let mut split = session(Budget::default());
            let mut calls = feed(&mut split, &wire[..at]);
            calls.extend(feed(&mut split, &wire[at..]));
            assert_eq!(calls, expected, "split at {at}");
        }
    }

    fn stage(seqnum: u32, direction: Direction, length: u32, after_success: bool) -> BytesMut {
        let mut command = submit(seqnum, direction, length);
        command.transfer_flags.0 |= storage::STAGE | if after_success { storage::AFTER_SUCCESS } else { 0 };
        let mut out = BytesMut::new();
        command.encode(&mut out);
        out
    }

    fn submitted(calls: &[DeviceCall]) -> Vec<u32> {
        calls
            .iter()
            .map(|call| match call {
                DeviceCall::Submit(submit) => {
                    assert_eq!(
                        storage::device_flags(submit.transfer_flags),
                        submit.transfer_flags,
                        "the device never sees our bits"
                    );
                    submit.seqnum
                }
                DeviceCall::Cancel { seqnum } => panic!("unexpected cancel of {seqnum}"),
            })
            .collect()
    }

    #[test]
    fn stages_reach_the_device_one_at_a_time_in_order_and_others_pass() {
        let mut session = session(Budget::default()).storage();
        let mut wire = stage(1, Direction::Out, 31, false);
        wire.extend_from_slice(&stage(2, Direction::In, 512, true));
        wire.extend_from_slice(&submit_bytes(9, Direction::In, 8));
        wire.extend_from_slice(&stage(3, Direction::In, 13, true));
        assert_eq!(submitted(&feed(&mut session, &wire)), [1, 9], "the first stage and the unflagged URB");
        session.complete(done(1, Status::OK, &[]));
        assert_eq!(submitted(&std::iter::from_fn(|| session.poll_device_call()).collect::<Vec<_>>()), [2]);
        session.complete(done(2, Status::OK, &[7; 100]));
        assert_eq!(submitted(&std::iter::from_fn(|| session.poll_device_call()).collect::<Vec<_>>()), [3]);
        session.complete(done(3, Status::OK, &[1; 13]));
        assert!(session.poll_device_call().is_none());
        assert_eq!(replies(&mut session), [(RET_SUBMIT, 1, 0), (RET_SUBMIT, 2, 0), (RET_SUBMIT, 3, 0)]);
    }

    #[test]
    fn a_failed_stage_skips_what_is_chained_to_it_but_not_the_next_command() {
        let mut session = session(Budget::default()).storage();
        let mut wire = stage(1, Direction::Out, 31, false);
        wire.extend_from_slice(&stage(2, Direction::In, 512, true));
        wire.extend_from_slice(&stage(3, Direction::In, 13, true));
        wire.extend_from_slice(&stage(4, Direction::In, 13, false));
        assert_eq!(submitted(&feed(&mut session, &wire)), [1]);
        session.complete(done(1, Status::EPIPE, &[]));
        // 2 and 3 never reach the device; 4 (not chained) does.
        assert_eq!(submitted(&std::iter::from_fn(|| session.poll_device_call()).collect::<Vec<_>>()), [4]);
        assert_eq!(replies(&mut session), [(RET_SUBMIT, 1, -32), (RET_SUBMIT, 2, -71), (RET_SUBMIT, 3, -71)]);
        session.complete(done(4, Status::OK, &[0; 13]));
        assert_eq!(replies(&mut session), [(RET_SUBMIT, 4, 0)]);
        assert!(session.is_idle());
    }

    #[test]
    fn a_status_wrapper_reporting_a_failed_command_stops_the_chain_too() {
        let mut session = session(Budget::default()).storage();
        let mut wire = stage(1, Direction::In, 13, false);
        wire.extend_from_slice(&stage(2, Direction::Out, 31, true));
        wire.extend_from_slice(&stage(3, Direction::Out, 31, false));
        assert_eq!(submitted(&feed(&mut session, &wire)), [1]);
        let mut failed = *b"USBS\x01\0\0\0\0\0\0\0\x01";
        session.complete(done(1, Status::OK, &failed));
        assert_eq!(submitted(&std::iter::from_fn(|| session.poll_device_call()).collect::<Vec<_>>()), [3]);
        assert_eq!(replies(&mut session)[1], (RET_SUBMIT, 2, -71), "the chained command never reached the device");
        failed[12] = 0;
        let mut passed = session_stock().storage();
        feed(&mut passed, &wire);
        passed.complete(done(1, Status::OK, &failed));
        assert_eq!(submitted(&std::iter::from_fn(|| passed.poll_device_call()).collect::<Vec<_>>()), [2]);
    }

    #[test]
    fn an_unlinked_stage_that_never_ran_is_cancelled_and_counts_as_failed() {
        let mut session = session(Budget::default()).storage();
        let mut wire = stage(1, Direction::Out, 31, false);
        wire.extend_from_slice(&stage(2, Direction::In, 512, true));
        wire.extend_from_slice(&stage(3, Direction::In, 13, true));
        wire.extend_from_slice(&unlink_bytes(4, 2));
        assert_eq!(submitted(&feed(&mut session, &wire)), [1]);
        assert_eq!(
            replies(&mut session),
            [(RET_UNLINK, 4, -104)],
            "RET_UNLINK(-ECONNRESET) alone: no RET_SUBMIT follows for 2"
        );
        session.complete(done(1, Status::OK, &[]));
        assert!(session.poll_device_call().is_none(), "3 was chained to the cancelled 2");
        assert_eq!(replies(&mut session), [(RET_SUBMIT, 1, 0), (RET_SUBMIT, 3, -71)]);
        assert!(session.is_idle());
    }

    #[test]
    fn without_the_extension_the_bits_change_nothing() {
        let mut session = session(Budget::default());
        let mut wire = stage(1, Direction::Out, 31, false);
        wire.extend_from_slice(&stage(2, Direction::In, 512, true));
        let calls = feed(&mut session, &wire);
        assert_eq!(calls.len(), 2, "both reach the device at once, as for a stock client");
    }
}
