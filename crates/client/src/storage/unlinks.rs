//! The kernel's unlinks, as the accelerator answers them: of a URB it never
//! sent (held behind reads ahead), of one it already answered, of one it
//! answers for from its own read; any other goes to the server. Not for the
//! server's unlink replies (`Accelerator::server_sent`).

use usbwire_proto::urb::{ClientMessage, CmdUnlink, RetUnlink, ServerMessage};
use usbwire_proto::Status;

use super::Accelerator;

impl Accelerator {
    /// An unlink of a URB still held here (never sent): cancelled at once, as
    /// a server cancels what it has not started. Says whether it was one.
    pub(super) fn cancel_held(&mut self, message: &ClientMessage, kernel: &mut impl FnMut(ServerMessage)) -> bool {
        let ClientMessage::Unlink(unlink) = message else { return false };
        let target = unlink.unlink_seqnum;
        let held = self.held.iter().position(|h| matches!(h, ClientMessage::Submit(s) if s.seqnum == target));
        let Some(at) = held else { return false };
        self.held.remove(at);
        kernel(ServerMessage::Unlink(RetUnlink { seqnum: unlink.seqnum, status: Status::ECONNRESET }));
        true
    }

    pub(super) fn unlink<E>(
        &mut self,
        unlink: CmdUnlink,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Result<(), E> {
        self.last_kernel_seqnum = unlink.seqnum;
        if self.answered_at_once.contains(&unlink.unlink_seqnum) {
            kernel(ServerMessage::Unlink(RetUnlink { seqnum: unlink.seqnum, status: Status::OK }));
            return Ok(());
        }
        let waiting = self.command.as_ref().and_then(|command| {
            [&command.data_ahead, &command.status]
                .into_iter()
                .flatten()
                .find(|ahead| ahead.claimed.is_some_and(|(claimer, _)| claimer == unlink.unlink_seqnum))
                .map(|ahead| ahead.seqnum)
        });
        let orphan =
            || self.answers.iter().find(|(_, claim)| claim.seqnum == unlink.unlink_seqnum).map(|(ours, _)| *ours);
        let Some(ours) = waiting.or_else(orphan) else { return server(ClientMessage::Unlink(unlink)) };
        // The kernel gives up a URB we answer for (its timeout): cancelled here,
        // and ours stops holding the server's gate.
        kernel(ServerMessage::Unlink(RetUnlink { seqnum: unlink.seqnum, status: Status::ECONNRESET }));
        if waiting.is_some() {
            self.abandon();
        }
        self.answers.remove(&ours);
        self.drop_reads_ahead();
        self.ignored.extend([ours, unlink.seqnum]);
        server(ClientMessage::Unlink(CmdUnlink { unlink_seqnum: ours, ..unlink }))
    }
}
