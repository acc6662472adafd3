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
//! It learns which endpoints carry Bulk-Only from the configuration
//! descriptors the kernel reads and the configuration it sets, as they pass.
//! It is not for the relay's I/O, resume or transforms (the relay's), nor for
//! anything but interfaces of class 08, subclass 06, protocol 50.

#[cfg(test)]
mod model;

use bytes::Bytes;
use usbwire_device::descriptor::ConfigurationInfo;
use usbwire_device::TransferType;
use usbwire_proto::client_session::Event;
use usbwire_proto::storage::{AFTER_SUCCESS, STAGE};
use usbwire_proto::urb::{ClientMessage, CmdSubmit, CmdUnlink, RetSubmit, RetUnlink, ServerMessage, TransferFlags};
use usbwire_proto::{Direction, Status};

/// A Bulk-Only command block wrapper: its length and signature ("USBC").
const CBW_LEN: u32 = 31;
const CBW_SIGNATURE: &[u8; 4] = b"USBC";
/// A command status wrapper's length.
const CSW_LEN: u32 = 13;
/// How far from the kernel's seqnums the status reads' are: vhci numbers its
/// URBs one by one, so it reaches these only 2^31 URBs later.
const OWN_SEQNUM_OFFSET: u32 = 0x8000_0000;

const GET_DESCRIPTOR: u8 = 6;
const SET_CONFIGURATION: u8 = 9;
const CONFIGURATION: u8 = 2;

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
}

/// A Bulk-Only interface's pipes: endpoint numbers, without the direction bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pipes {
    bulk_out: u8,
    bulk_in: u8,
}

/// A control request whose reply teaches us the pipes.
#[derive(Clone, Copy, Debug)]
enum Watched {
    Configuration,
    SetConfiguration(u8),
}

/// The status read sent ahead of the kernel's.
#[derive(Debug)]
enum StatusRead {
    /// Not sent (yet): the kernel's data stage is still coming.
    NotSent,
    Sent {
        seqnum: u32,
        result: Option<RetSubmit>,
        /// The kernel's CSW URB waiting for it: (seqnum, buffer length).
        claimed: Option<(u32, u32)>,
    },
}

/// The command in progress.
#[derive(Debug)]
struct Command {
    pipes: Pipes,
    cbw_seqnum: u32,
    /// The data stage still expected from the kernel: its direction and bytes left.
    expecting: Option<(Direction, u32)>,
    /// The kernel's data URBs sent on.
    data_seqnums: Vec<u32>,
    status: StatusRead,
    /// A data stage failed: the status read was skipped and means nothing.
    void: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Accelerator {
    devid: u32,
    /// Bulk-Only pipes of each configuration whose whole descriptor was read.
    configurations: Vec<(u8, Vec<Pipes>)>,
    /// Those of the configuration set.
    active: Vec<Pipes>,
    watched: Vec<(u32, Watched)>,
    command: Option<Command>,
    /// Our own URBs whose replies nobody waits for any more.
    ignored: Vec<u32>,
    last_kernel_seqnum: u32,
    counters: StorageCounters,
}

impl Accelerator {
    pub(crate) fn new(devid: u32) -> Self {
        Self { devid, ..Self::default() }
    }

    pub(crate) fn counters(&self) -> StorageCounters {
        self.counters
    }

    /// A command from the kernel: `server` takes what goes on, `kernel` what
    /// is answered here.
    pub(crate) fn kernel_sent<E>(
        &mut self,
        message: ClientMessage,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Result<(), E> {
        match message {
            ClientMessage::Submit(submit) => self.submit(submit, server, kernel),
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
            self.watch_control(&submit);
            return server(ClientMessage::Submit(submit));
        }
        let Some(pipes) = self.pipes_of(&submit) else { return server(ClientMessage::Submit(submit)) };
        submit.transfer_flags.0 |= STAGE;
        if let Some(cbw) = command_block(&submit, pipes) {
            self.abandon();
            let seqnum = submit.seqnum;
            let number_of_packets = submit.number_of_packets;
            server(ClientMessage::Submit(submit))?;
            // Done here: the server runs it on the device before anything after it.
            kernel(ServerMessage::Submit(done(seqnum, CBW_LEN, number_of_packets)));
            self.counters.commands_pipelined += 1;
            let mut command = Command {
                pipes,
                cbw_seqnum: seqnum,
                expecting: (cbw.length > 0).then_some((cbw.direction, cbw.length)),
                data_seqnums: Vec::new(),
                status: StatusRead::NotSent,
                void: false,
            };
            if command.expecting.is_none() {
                self.read_status_ahead(&mut command, server)?;
            }
            self.command = Some(command);
            return Ok(());
        }
        let Some(mut command) = self.command.take() else { return server(ClientMessage::Submit(submit)) };
        match command.expecting {
            Some((direction, left)) if direction == submit.direction && command.is_data_pipe(&submit) => {
                submit.transfer_flags.0 |= AFTER_SUCCESS;
                let length = submit.transfer_buffer_length;
                command.data_seqnums.push(submit.seqnum);
                server(ClientMessage::Submit(submit))?;
                command.expecting = match left.checked_sub(length) {
                    Some(0) => {
                        self.read_status_ahead(&mut command, server)?;
                        None
                    }
                    Some(left) => Some((direction, left)),
                    // More than the CBW said: the kernel's own status read goes to the device.
                    None => None,
                };
                self.command = Some(command);
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

    /// The kernel reads the CSW: answered from the read sent ahead when it
    /// can be, or when it arrives; sent to the device otherwise.
    fn status_from_kernel<E>(
        &mut self,
        mut command: Command,
        submit: CmdSubmit,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Result<(), E> {
        match &mut command.status {
            StatusRead::Sent { result, claimed, .. } if !command.void => match result.take() {
                Some(result) => {
                    self.counters.statuses_ahead += 1;
                    kernel(ServerMessage::Submit(answer(result, submit.seqnum, submit.transfer_buffer_length)));
                    Ok(())
                }
                None => {
                    *claimed = Some((submit.seqnum, submit.transfer_buffer_length));
                    self.command = Some(command);
                    Ok(())
                }
            },
            _ => {
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
        let seqnum = self.last_kernel_seqnum.wrapping_add(OWN_SEQNUM_OFFSET);
        let mut read =
            CmdSubmit::new(seqnum, self.devid, Direction::In, command.pipes.bulk_in, CSW_LEN, [0; 8], Bytes::new());
        read.transfer_flags = TransferFlags(read.transfer_flags.0 | STAGE | AFTER_SUCCESS);
        server(ClientMessage::Submit(read))?;
        command.status = StatusRead::Sent { seqnum, result: None, claimed: None };
        Ok(())
    }

    fn unlink<E>(
        &mut self,
        unlink: CmdUnlink,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Result<(), E> {
        self.last_kernel_seqnum = unlink.seqnum;
        if let Some(Command { status: StatusRead::Sent { seqnum, claimed: Some((claimer, _)), .. }, .. }) =
            &self.command
        {
            if *claimer == unlink.unlink_seqnum {
                // The kernel gives up its CSW read (its timeout): cancelled here,
                // and the read ahead stops holding the server's gate.
                let read = *seqnum;
                self.command = None;
                kernel(ServerMessage::Unlink(RetUnlink { seqnum: unlink.seqnum, status: Status::ECONNRESET }));
                self.ignored.extend([read, unlink.seqnum]);
                self.counters.statuses_wasted += 1;
                return server(ClientMessage::Unlink(CmdUnlink { unlink_seqnum: read, ..unlink }));
            }
        }
        server(ClientMessage::Unlink(unlink))
    }

    /// A reply from the server, as the session decoded it.
    pub(crate) fn server_sent(&mut self, event: Event<()>, kernel: &mut impl FnMut(ServerMessage)) {
        match event {
            Event::Completed { reply, .. } => self.completed(reply, kernel),
            Event::Unlinked { reply, cancelled, .. } => {
                if self.take_ignored(reply.seqnum) {
                    return;
                }
                if let (Some((target, ())), Some(command)) = (cancelled, &mut self.command) {
                    if command.data_seqnums.contains(&target) {
                        command.void = true;
                    }
                }
                kernel(ServerMessage::Unlink(reply));
            }
        }
    }

    fn completed(&mut self, reply: RetSubmit, kernel: &mut impl FnMut(ServerMessage)) {
        if self.take_ignored(reply.seqnum) {
            return;
        }
        if let Some(at) = self.watched.iter().position(|(seqnum, _)| *seqnum == reply.seqnum) {
            let (_, watched) = self.watched.swap_remove(at);
            self.learn(watched, &reply);
        }
        let Some(command) = &mut self.command else { return kernel(ServerMessage::Submit(reply)) };
        if reply.seqnum == command.cbw_seqnum {
            // Answered when it was sent; a failure shows on the stage after it.
            return;
        }
        if command.data_seqnums.contains(&reply.seqnum) {
            if reply.status != Status::OK {
                command.void = true;
            }
            return kernel(ServerMessage::Submit(reply));
        }
        match &mut command.status {
            StatusRead::Sent { seqnum, result, claimed } if *seqnum == reply.seqnum => {
                if command.void {
                    self.counters.statuses_wasted += 1;
                    *result = Some(reply);
                } else if let Some((claimer, length)) = claimed.take() {
                    self.counters.statuses_ahead += 1;
                    self.command = None;
                    kernel(ServerMessage::Submit(answer(reply, claimer, length)));
                } else {
                    *result = Some(reply);
                }
            }
            _ => kernel(ServerMessage::Submit(reply)),
        }
    }

    /// Drops the command in progress: its status read's reply, if one is
    /// still coming, is not for anyone.
    fn abandon(&mut self) {
        let Some(command) = self.command.take() else { return };
        if let StatusRead::Sent { seqnum, result, .. } = command.status {
            if !command.void {
                self.counters.statuses_wasted += 1;
            }
            if result.is_none() {
                self.ignored.push(seqnum);
            }
        }
    }

    fn take_ignored(&mut self, seqnum: u32) -> bool {
        match self.ignored.iter().position(|&ignored| ignored == seqnum) {
            Some(at) => {
                self.ignored.swap_remove(at);
                true
            }
            None => false,
        }
    }

    /// The Bulk-Only pipes a URB is on, if any.
    fn pipes_of(&self, submit: &CmdSubmit) -> Option<Pipes> {
        self.active.iter().copied().find(|pipes| match submit.direction {
            Direction::Out => pipes.bulk_out == submit.ep,
            Direction::In => pipes.bulk_in == submit.ep,
        })
    }

    fn watch_control(&mut self, submit: &CmdSubmit) {
        let [request_type, request, value_low, value_high, ..] = submit.setup;
        let watched = match (request_type, request) {
            (0x80, GET_DESCRIPTOR) if value_high == CONFIGURATION => Watched::Configuration,
            (0x00, SET_CONFIGURATION) => Watched::SetConfiguration(value_low),
            _ => return,
        };
        self.watched.push((submit.seqnum, watched));
    }

    fn learn(&mut self, watched: Watched, reply: &RetSubmit) {
        if reply.status != Status::OK {
            return;
        }
        match watched {
            Watched::Configuration => {
                let Some(total) = reply.data.get(2..4).map(|b| u16::from_le_bytes([b[0], b[1]])) else { return };
                if reply.data.len() < usize::from(total) {
                    return; // the first 9 bytes only
                }
                let Some(info) = ConfigurationInfo::parse(&reply.data) else { return };
                let pipes = bulk_only_pipes(&info);
                self.configurations.retain(|(value, _)| *value != info.value);
                self.configurations.push((info.value, pipes));
            }
            Watched::SetConfiguration(value) => {
                self.abandon();
                self.active = self
                    .configurations
                    .iter()
                    .find(|(known, _)| *known == value)
                    .map(|(_, pipes)| pipes.clone())
                    .unwrap_or_default();
            }
        }
    }
}

impl Command {
    fn is_data_pipe(&self, submit: &CmdSubmit) -> bool {
        match submit.direction {
            Direction::Out => submit.ep == self.pipes.bulk_out,
            Direction::In => submit.ep == self.pipes.bulk_in,
        }
    }
}

/// What a CBW says of its data stage.
struct CommandBlock {
    direction: Direction,
    length: u32,
}

/// The command block a URB carries, when it is one: 31 bytes out on the
/// interface's bulk OUT, "USBC", a CB length of 1 to 16.
fn command_block(submit: &CmdSubmit, pipes: Pipes) -> Option<CommandBlock> {
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

/// Each Bulk-Only interface's first bulk OUT and IN endpoints (alt setting 0).
fn bulk_only_pipes(info: &ConfigurationInfo) -> Vec<Pipes> {
    let bulk = |interface: &usbwire_device::descriptor::InterfaceInfo, direction_in: bool| {
        interface
            .endpoints
            .iter()
            .find(|ep| ep.transfer_type == TransferType::Bulk && (ep.address & 0x80 != 0) == direction_in)
            .map(|ep| ep.address & 0x0f)
    };
    info.interfaces
        .iter()
        .filter(|i| i.alt_setting == 0 && (i.class, i.subclass, i.protocol) == (0x08, 0x06, 0x50))
        .filter_map(|i| Some(Pipes { bulk_out: bulk(i, false)?, bulk_in: bulk(i, true)? }))
        .collect()
}

/// The kernel's CBW URB, done: every byte sent.
fn done(seqnum: u32, actual_length: u32, number_of_packets: i32) -> RetSubmit {
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

/// The status read's reply as the answer to the kernel's URB `seqnum` with
/// room for `length` bytes (usb-storage's is 13 bytes, as ours).
fn answer(mut reply: RetSubmit, seqnum: u32, length: u32) -> RetSubmit {
    reply.seqnum = seqnum;
    if reply.actual_length > length {
        // More than its buffer holds: what a device's babble looks like.
        reply.status = Status::EOVERFLOW;
        reply.actual_length = length;
        reply.data.truncate(length as usize);
    }
    reply
}
