//! The storage accelerator: a Bulk-Only mass-storage command in one round
//! trip instead of three, between the kernel's USB/IP and a usbwire server
//! that agreed to the storage extension (`docs/protocol.md` §5.7). Sans I/O:
//! fed the kernel's commands and the server's replies, it says what goes to
//! the server and what goes back to the kernel.
//!
//! usb-storage runs one command at a time and each of its stages waits for
//! the one before: the command block (CBW, bulk OUT), the data, the status
//! (CSW, bulk IN). Here the CBW is answered at once and sent on; the kernel's
//! data URB follows it without waiting; and a read of the status goes out
//! right behind the data, so the CSW is here by the time the kernel asks for
//! it. The server's stage gate runs the stages on the device one at a time,
//! in order, as a local host would, and skips a stage chained to a failed one.
//! So the kernel waits one round trip per command (for its data URB, or for
//! the CSW when there is no data), and:
//!
//! * the CSW the kernel gets is always the device's own, read after the
//!   device finished the command: nothing is reported done before it is;
//! * the data stage's result is the device's own (the kernel's data URB goes
//!   to the device itself);
//! * a CBW the device refused (already reported done) shows as `-EPROTO` on
//!   the next stage, which usb-storage treats as a transport error and
//!   answers with a reset — as it does a failed CBW;
//! * after a failed data stage the status read was skipped on the server, and
//!   the kernel's own CSW read (after its clear-halt) goes to the device.
//!
//! On a sequential stream of READs it also reads ahead ([`ahead`]): the next
//! ranges' commands go to the device behind the kernel's, and a READ the
//! kernel then sends is answered from them (one of them, or slices of those
//! that hold its range), the CSW with the kernel's tag. Whatever is not known to be read-only drops every read
//! ahead before it is sent, and replies still to come for them are ignored:
//! nothing read before a write is served after it.
//!
//! It learns which endpoints carry Bulk-Only from the configuration
//! descriptors the kernel reads and the configuration it sets, as they pass.
//! It is not for the relay's I/O, resume or transforms (the relay's), nor for
//! anything but interfaces of class 08, subclass 06, protocol 50.

mod ahead;
mod command;
mod pipes;
mod replies;
mod scan;
mod sending;
mod unlinks;
mod wrappers;

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use bytes::Bytes;
use usbwire_proto::descriptors::Snapshot;
use usbwire_proto::storage::{AFTER_SUCCESS, STAGE};
use usbwire_proto::urb::{ClientMessage, CmdSubmit, ServerMessage, TransferFlags};
use usbwire_proto::{Direction, Status};

use ahead::{ReadAhead, Served, Speculation, Taken};
use command::{command_is_sent_whole, Ahead, Claim, Command};
use pipes::{Interfaces, Pipes};
use scan::ScanAhead;
use wrappers::{answer, command_block, done, short_as_asked, tag_of, CommandBlock, CBW_LEN, CSW_LEN};

/// How far from the kernel's seqnums ours are: vhci numbers its URBs one by
/// one, so it reaches these only 2^31 URBs later; ours count up from there as
/// the kernel's do, so two of ours never share one.
const OWN_SEQNUM_OFFSET: u32 = 0x8000_0000;
/// How many of the kernel's URBs answered at once are remembered for a late unlink.
const ANSWERED_REMEMBERED: usize = 32;

const READ_CAPACITY_10: u8 = 0x25;
const SERVICE_ACTION_IN_16: u8 = 0x9e;

/// What the accelerator has done, for `usbwire port` and the metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StorageCounters {
    /// Commands whose CBW was answered at once.
    pub commands_pipelined: u64,
    /// CSWs answered from a status read sent ahead.
    pub statuses_ahead: u64,
    /// Status reads sent ahead that could not be used (a failed stage, an
    /// abandoned command): the kernel's own read went to the device.
    pub statuses_wasted: u64,
    /// READs answered from a read ahead.
    pub read_ahead_hits: u64,
    /// Bytes read ahead and served.
    pub bytes_read_ahead: u64,
    /// Bytes read ahead and dropped (a write, a seek, an error).
    pub bytes_wasted: u64,
    /// Requests of the kernel's scan of a new disk (GET_MAX_LUN and SCSI commands) answered from the scan ahead.
    pub scan_hits: u64,
}

#[derive(Debug, Default)]
pub struct Accelerator {
    devid: u32,
    interfaces: Interfaces,
    command: Option<Command>,
    ahead: ReadAhead,
    scan: ScanAhead,
    /// The time the kernel's latest command (or the latest release) came.
    now: Option<Instant>,
    /// Our own URBs (and unlinks) whose replies nobody waits for any more.
    ignored: HashSet<u32>,
    /// The kernel's latest URBs answered here as they came: an unlink of one
    /// of them (sent before the kernel saw the answer) is answered as a
    /// local device answers an unlink of a URB it completed.
    answered_at_once: VecDeque<u32>,
    /// Every URB of ours still outstanding: whatever a server answers, the
    /// kernel never gets a reply to one of these under its seqnum.
    own: HashSet<u32>,
    /// Our own URBs whose replies a kernel URB still waits for, after their
    /// command was dropped: answered to it when they come.
    answers: HashMap<u32, Claim>,
    /// A read ahead failed unserved: the device wants a reset recovery
    /// before the kernel's next stage.
    recover: bool,
    /// A CSW the kernel reads after a served command's failed data stage:
    /// the device's, with the read ahead's tag; the kernel gets its own.
    retag: Option<(u32, [u8; 4])>,
    /// The kernel's messages waiting, in order, for the reads ahead in flight
    /// to finish before a command that drops them: a read ahead that failed
    /// leaves the device wanting a reset recovery first.
    held: VecDeque<ClientMessage>,
    /// The message being taken waited in `held`: a READ served then had to
    /// wait for its reads ahead, as much as one whose data is still coming.
    taking_held: bool,
    /// The kernel's ep0 URBs on their way to the device: a control request
    /// answered here while one is out would overtake it (a device completes
    /// control transfers in order).
    kernel_ep0: HashSet<u32>,
    last_kernel_seqnum: u32,
    own_seqnums: u32,
    counters: StorageCounters,
}

impl Accelerator {
    pub fn new(devid: u32) -> Self {
        Self { devid, ..Self::default() }
    }

    /// The accelerator of a device whose configuration descriptors came with
    /// the import's descriptor snapshot (§5.8): the kernel's requests for them
    /// are answered from it and never pass here.
    pub fn with_snapshot(devid: u32, snapshot: Option<&Snapshot>) -> Self {
        Self { devid, interfaces: Interfaces::from_snapshot(snapshot), ..Self::default() }
    }

    pub fn counters(&self) -> StorageCounters {
        self.counters
    }

    /// A command from the kernel at `now`: `server` takes what goes on,
    /// `kernel` what is answered here.
    pub fn kernel_sent<E>(
        &mut self,
        message: ClientMessage,
        now: Instant,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Result<(), E> {
        self.now = Some(now);
        if self.cancel_held(&message, kernel) {
            return Ok(());
        }
        if self.held.is_empty() {
            self.complete_reads_ahead(&message, server)?;
        }
        if !self.held.is_empty() || self.waits(&message) {
            self.held.push_back(message);
            return Ok(());
        }
        self.take(message, server, kernel)
    }

    /// Sends the scan ahead's commands when they are due, and the kernel's
    /// messages that waited, once the reads ahead they waited for are all
    /// back. Says whether it sent any of the kernel's. Call it after replies
    /// were delivered, with the time.
    pub fn release<E>(
        &mut self,
        now: Instant,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Result<bool, E> {
        self.now = Some(now);
        self.scan_ahead(server)?;
        let mut released = false;
        while let Some(message) = self.held.pop_front() {
            self.complete_reads_ahead(&message, server)?;
            if self.waits(&message) {
                self.held.push_front(message);
                break;
            }
            self.taking_held = true;
            let taken = self.take(message, server, kernel);
            self.taking_held = false;
            taken?;
            released = true;
        }
        Ok(released)
    }

    /// Whether `message` is a command block the reads ahead do not serve
    /// now while some are in flight, or a SET_CONFIGURATION: it waits for them. So one whose range
    /// they hold in slices is served once those came back whole, and before
    /// any other goes, a read ahead that failed is known (and the device
    /// recovered).
    fn waits(&self, message: &ClientMessage) -> bool {
        let ClientMessage::Submit(submit) = message else { return false };
        if !self.ahead.in_flight() && !self.scan.in_flight() {
            return false;
        }
        if submit.ep == 0 {
            // A new configuration ends our commands: once they are back, not under them.
            return submit.setup[..2] == [0x00, 0x09];
        }
        let Some(pipes) = self.interfaces.pipes_of(submit) else { return false };
        command_block(submit, pipes).is_some()
            && !self.ahead.serves(&submit.data)
            && !self.scan.serves(&submit.data, self.now)
    }

    fn take<E>(
        &mut self,
        message: ClientMessage,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Result<(), E> {
        match message {
            ClientMessage::Submit(submit) => {
                let seqnum = submit.seqnum;
                let mut answered = false;
                let mut watching = |reply: ServerMessage| {
                    answered |= matches!(&reply, ServerMessage::Submit(reply) if reply.seqnum == seqnum);
                    kernel(reply)
                };
                self.submit(submit, server, &mut watching)?;
                if answered {
                    self.answered_at_once.push_back(seqnum);
                    if self.answered_at_once.len() > ANSWERED_REMEMBERED {
                        self.answered_at_once.pop_front();
                    }
                }
                Ok(())
            }
            ClientMessage::Unlink(unlink) => self.unlink(unlink, server, kernel),
        }
    }

    fn submit<E>(
        &mut self,
        mut submit: CmdSubmit,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Result<(), E> {
        self.last_kernel_seqnum = submit.seqnum;
        if submit.ep == 0 {
            self.interfaces.watch(&submit);
            if scan::is_get_max_lun(&submit) {
                let answered_ahead = match self.kernel_ep0.is_empty() {
                    true => self.scan.take_max_lun(&submit, self.now),
                    false => None,
                };
                if let Some(reply) = answered_ahead {
                    self.counters.scan_hits += 1;
                    kernel(ServerMessage::Submit(answer(reply, &submit, None)));
                    return Ok(());
                }
                // usb-storage probes the interface: its scan follows.
                self.scan.asked(&submit, &self.interfaces);
            }
            self.kernel_ep0.insert(submit.seqnum);
            return server(ClientMessage::Submit(submit));
        }
        let Some(pipes) = self.interfaces.pipes_of(&submit) else { return server(ClientMessage::Submit(submit)) };
        submit.transfer_flags.0 |= STAGE;
        if let Some(block) = command_block(&submit, pipes) {
            // A command the scan ahead answers never reaches the device: the reads ahead stay as they are.
            if !self.scan.serves(&submit.data, self.now) {
                self.before_device_command(&submit.data);
            }
            self.recover(pipes, server)?;
            return self.command_block(submit, block, pipes, server, kernel);
        }
        let Some(mut command) = self.command.take() else { return server(ClientMessage::Submit(submit)) };
        match command.expecting {
            Some((direction, left)) if direction == submit.direction && command.is_data_pipe(&submit) => {
                command.expecting = None;
                if let Some(data) = &mut command.data_ahead {
                    // Served from a read ahead: the kernel's data URB never goes out.
                    match data.result.take() {
                        Some(result) => {
                            kernel(ServerMessage::Submit(answer(short_as_asked(result, &submit), &submit, None)))
                        }
                        None => data.claimed = Some((submit.seqnum, submit.transfer_buffer_length)),
                    }
                    self.command = Some(command);
                    return Ok(());
                }
                submit.transfer_flags.0 |= AFTER_SUCCESS;
                let length = submit.transfer_buffer_length;
                command.data_seqnums.push(submit.seqnum);
                server(ClientMessage::Submit(submit))?;
                match left.checked_sub(length) {
                    Some(0) => self.read_status_ahead(&mut command, server)?,
                    Some(left) => command.expecting = Some((direction, left)),
                    // More than the CBW said: the kernel's own status read goes to the device.
                    None => {}
                }
                self.command = Some(command);
                if command_is_sent_whole(&self.command) {
                    self.read_ahead(server)?;
                }
                Ok(())
            }
            _ if submit.direction == Direction::In && submit.ep == command.pipes.bulk_in => {
                self.status_from_kernel(command, submit, server, kernel)
            }
            _ => {
                // Not what usb-storage does next: the command is left to the kernel.
                self.command = Some(command);
                self.abandon();
                server(ClientMessage::Submit(submit))
            }
        }
    }

    /// A command block from the kernel: answered at once, then served from
    /// a read ahead or sent on, and the reads ahead topped up.
    fn command_block<E>(
        &mut self,
        submit: CmdSubmit,
        block: CommandBlock,
        pipes: Pipes,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Result<(), E> {
        self.abandon();
        let mut cbw = [0u8; 31];
        cbw.copy_from_slice(&submit.data[..31]);
        let read = ahead::read(&cbw);
        let seqnum = submit.seqnum;
        kernel(ServerMessage::Submit(done(seqnum, CBW_LEN, submit.number_of_packets)));
        self.counters.commands_pipelined += 1;
        let mut command = Command {
            pipes,
            cbw,
            cbw_seqnum: seqnum,
            cbw_replied: false,
            expecting: (block.length > 0).then_some((block.direction, block.length)),
            data_seqnums: Vec::new(),
            data_ahead: None,
            status: None,
            void: false,
        };
        let scanned = self.scan.take(&cbw, self.now);
        let from_scan = scanned.is_some();
        let served = scanned.map(Taken::Exact).or_else(|| read.and_then(|_| self.ahead.take(&cbw)));
        if let Some(read) = read.filter(|_| !from_scan) {
            let how = match &served {
                None => Served::No,
                Some(Taken::Exact(speculation)) if speculation.results[1].is_none() => Served::Waited,
                Some(_) if self.taking_held => Served::Waited,
                Some(_) => Served::Ready,
            };
            self.ahead.observe(read, &cbw, pipes, how);
        }
        match served {
            Some(Taken::Slices { data, status, seqnums: [data_seqnum, status_seqnum] }) => {
                self.counters.read_ahead_hits += 1;
                self.counters.bytes_read_ahead += u64::from(data.actual_length);
                command.data_ahead = Some(Ahead { seqnum: data_seqnum, result: Some(data), claimed: None });
                command.status = Some(Ahead { seqnum: status_seqnum, result: Some(status), claimed: None });
                command.cbw_replied = true;
                self.command = Some(command);
            }
            Some(Taken::Exact(speculation)) => {
                if from_scan {
                    self.counters.scan_hits += 1;
                } else {
                    self.counters.read_ahead_hits += 1;
                    self.counters.bytes_read_ahead += u64::from(speculation.length);
                }
                let Speculation { seqnums, results: [block, data, status], length, .. } = speculation;
                if let (true, Some(data)) = (matches!(cbw[15], READ_CAPACITY_10 | SERVICE_ACTION_IN_16), &data) {
                    self.ahead.learn_capacity(&cbw, &data.data);
                }
                if block.is_none() {
                    // Its failure, if it fails, shows on the data stage, skipped.
                    self.ignored.insert(seqnums[0]);
                }
                command.data_ahead = (length > 0).then_some(Ahead { seqnum: seqnums[1], result: data, claimed: None });
                command.void =
                    command.data_ahead.as_ref().and_then(|d| d.result.as_ref()).is_some_and(|d| d.status != Status::OK);
                command.status = Some(Ahead { seqnum: seqnums[2], result: status, claimed: None });
                command.cbw_replied = true;
                self.command = Some(command);
            }
            None => {
                server(ClientMessage::Submit(submit))?;
                if command.expecting.is_none() {
                    self.read_status_ahead(&mut command, server)?;
                }
                self.command = Some(command);
                if read.is_none() {
                    return Ok(());
                }
            }
        }
        if command_is_sent_whole(&self.command) && !from_scan {
            self.read_ahead(server)?;
        }
        Ok(())
    }

    /// What a command block `cbw` the device will run ends first: anything
    /// that could change the medium, every read ahead and the scan ahead; a
    /// read-only command off the scan's script, the scan ahead; a READ the
    /// reads ahead do not serve (a seek), or any command after a read ahead
    /// failed (the device wants recovering first), the reads ahead.
    fn before_device_command(&mut self, cbw: &[u8]) {
        let opcode = cbw[15];
        if !ahead::keeps_medium(opcode) {
            return self.drop_reads_ahead();
        }
        if ahead::is_read_only(opcode) || self.scan.failed() {
            self.drop_scan();
        }
        if !self.ahead.serves(cbw) && (ahead::read(cbw).is_some() || self.ahead.failed()) {
            let (wasted, failed) = self.ahead.drop_all(&mut self.ignored);
            self.counters.bytes_wasted += wasted;
            self.recover |= failed;
        }
    }

    /// The kernel reads the CSW: answered from the read sent ahead when it
    /// can be, or when it arrives; sent to the device otherwise.
    fn status_from_kernel<E>(
        &mut self,
        mut command: Command,
        submit: CmdSubmit,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Result<(), E> {
        let tag = tag_of(&command.cbw);
        match &mut command.status {
            Some(status) if !command.void && status.claimed.is_none() => match status.result.take() {
                Some(result) => {
                    self.counters.statuses_ahead += 1;
                    self.finished(&command);
                    self.after_status(&result);
                    kernel(ServerMessage::Submit(answer(result, &submit, Some(tag))));
                    Ok(())
                }
                None => {
                    status.claimed = Some((submit.seqnum, submit.transfer_buffer_length));
                    self.command = Some(command);
                    Ok(())
                }
            },
            _ => {
                if command.data_ahead.is_some() {
                    // The device's CSW carries the read ahead's tag.
                    self.retag = Some((submit.seqnum, tag));
                }
                self.command = Some(command);
                self.abandon();
                server(ClientMessage::Submit(submit))
            }
        }
    }

    fn read_status_ahead<E>(
        &mut self,
        command: &mut Command,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
    ) -> Result<(), E> {
        let seqnum = self.own_seqnum();
        let mut read =
            CmdSubmit::new(seqnum, self.devid, Direction::In, command.pipes.bulk_in, CSW_LEN, [0; 8], Bytes::new());
        read.transfer_flags = TransferFlags(read.transfer_flags.0 | STAGE | AFTER_SUCCESS);
        server(ClientMessage::Submit(read))?;
        command.status = Some(Ahead { seqnum, result: None, claimed: None });
        Ok(())
    }

    fn own_seqnum(&mut self) -> u32 {
        self.own_seqnums = self.own_seqnums.wrapping_add(1);
        let seqnum = self.last_kernel_seqnum.wrapping_add(OWN_SEQNUM_OFFSET).wrapping_add(self.own_seqnums);
        self.own.insert(seqnum);
        seqnum
    }

    /// Drops every read ahead and the stream they followed, and ends the scan ahead.
    fn drop_reads_ahead(&mut self) {
        let (wasted, failed) = self.ahead.drop_all(&mut self.ignored);
        self.ahead.forget_stream();
        self.counters.bytes_wasted += wasted;
        self.recover |= failed;
        self.drop_scan();
    }

    /// Ends the scan ahead.
    fn drop_scan(&mut self) {
        if self.scan.is_on() {
            let (wasted, failed) = self.scan.drop_all(&mut self.ignored);
            self.counters.bytes_wasted += wasted;
            self.recover |= failed;
        }
    }

    /// After a read ahead that failed and was never served: the reset
    /// recovery usb-storage would run (the class reset, then both halts
    /// cleared), as stages, so it reaches the device before what follows.
    fn recover<E>(&mut self, pipes: Pipes, server: &mut impl FnMut(ClientMessage) -> Result<(), E>) -> Result<(), E> {
        if !std::mem::take(&mut self.recover) {
            return Ok(());
        }
        for setup in pipes.reset_recovery() {
            let seqnum = self.own_seqnum();
            let mut request = CmdSubmit::new(seqnum, self.devid, Direction::Out, 0, 0, setup, Bytes::new());
            request.transfer_flags.0 |= STAGE;
            self.ignored.insert(seqnum);
            server(ClientMessage::Submit(request))?;
        }
        Ok(())
    }

    /// A command answered whole: a reply to its CBW still to come (from a
    /// server that answers out of order) is not for anyone, one to its data
    /// still goes to the kernel's data URB.
    fn finished(&mut self, command: &Command) {
        command.hand_over(&mut self.ignored, &mut self.answers, false);
    }

    /// Drops the command in progress: replies still coming for it are not
    /// for anyone, but those a kernel URB waits for still reach it.
    fn abandon(&mut self) {
        let Some(command) = self.command.take() else { return };
        command.hand_over(&mut self.ignored, &mut self.answers, true);
        if command.status.as_ref().is_some_and(|status| status.claimed.is_none()) && !command.void {
            self.counters.statuses_wasted += 1;
        }
    }
}

#[cfg(test)]
mod tests;
