//! The accelerator's reads ahead going out: those the window allows behind
//! a command, and the one that completes a READ longer than what was read
//! ahead for it. Not for what is read ahead (`ahead`) nor for serving them
//! (`storage`).

use usbwire_proto::urb::ClientMessage;

use super::ahead::Speculation;
use super::command::command_is_sent_whole;
use super::pipes::Pipes;
use super::wrappers::{self, command_block};
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
