//! The accelerator's own commands going out: the reads ahead the window
//! allows behind a command, the one that completes a READ longer than what
//! was read ahead for it, and the scan ahead's (with its GET_MAX_LUN). Not for what is read or
//! scanned ahead (`ahead`, `scan`) nor for serving them (`storage`).

use bytes::Bytes;
use usbwire_proto::urb::{ClientMessage, CmdSubmit};
use usbwire_proto::Direction;

use super::ahead::Speculation;
use super::command::command_is_sent_whole;
use super::pipes::Pipes;
use super::scan;
use super::wrappers::{self, command_block, command_stages};
use super::Accelerator;

impl Accelerator {
    /// Sends the reads ahead the window allows, behind everything sent so far.
    pub(super) fn read_ahead<E>(&mut self, server: &mut impl FnMut(ClientMessage) -> Result<(), E>) -> Result<(), E> {
        while let Some((cbw, length, pipes)) = self.ahead.next() {
            self.send_read_ahead(cbw, length, pipes, server)?;
        }
        Ok(())
    }

    fn send_read_ahead<E>(
        &mut self,
        cbw: [u8; 31],
        length: u32,
        pipes: Pipes,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
    ) -> Result<(), E> {
        let seqnums = [self.own_seqnum(), self.own_seqnum(), self.own_seqnum()];
        for stage in wrappers::read_ahead_stages(seqnums, self.devid, pipes, &cbw, length) {
            server(ClientMessage::Submit(stage))?;
        }
        self.ahead.issued(Speculation::new(cbw, length, seqnums));
        Ok(())
    }

    /// Sends the scan ahead's commands that are due, between the kernel's commands.
    pub(super) fn scan_ahead<E>(&mut self, server: &mut impl FnMut(ClientMessage) -> Result<(), E>) -> Result<(), E> {
        let Some(now) = self.now else { return Ok(()) };
        if !command_is_sent_whole(&self.command) {
            return Ok(());
        }
        let Some(scan::Due { pipes, commands, max_lun }) = self.scan.due(now) else { return Ok(()) };
        self.recover(pipes, server)?;
        if let Some(setup) = max_lun {
            let seqnum = self.own_seqnum();
            server(ClientMessage::Submit(CmdSubmit::new(
                seqnum,
                self.devid,
                Direction::In,
                0,
                1,
                setup,
                Bytes::new(),
            )))?;
            self.scan.asked_luns(seqnum, pipes.interface);
        }
        for cbw in commands {
            let length = u32::from_le_bytes([cbw[8], cbw[9], cbw[10], cbw[11]]);
            let block = self.own_seqnum();
            let data = if length > 0 { self.own_seqnum() } else { block };
            let seqnums = [block, data, self.own_seqnum()];
            for stage in command_stages(seqnums, self.devid, pipes, &cbw, length) {
                server(ClientMessage::Submit(stage))?;
            }
            self.scan.issued(match length {
                0 => Speculation::without_data(cbw, [block, seqnums[2]]),
                _ => Speculation::new(cbw, length, seqnums),
            });
        }
        Ok(())
    }

    /// A READ whose start the reads ahead hold but not its end: the read
    /// ahead of the rest goes out, and the READ waits for it (see
    /// [`ReadAhead::complete`]). Only between commands: every stage of the
    /// last one has gone out.
    pub(super) fn complete_reads_ahead<E>(
        &mut self,
        message: &ClientMessage,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
    ) -> Result<(), E> {
        let ClientMessage::Submit(submit) = message else { return Ok(()) };
        let is_command = self.interfaces.pipes_of(submit).is_some_and(|pipes| command_block(submit, pipes).is_some());
        if !is_command || !command_is_sent_whole(&self.command) {
            return Ok(());
        }
        if let Some((cbw, length, pipes)) = self.ahead.complete(&submit.data) {
            self.send_read_ahead(cbw, length, pipes, server)?;
        }
        Ok(())
    }
}
