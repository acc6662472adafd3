//! The server's replies as the accelerator takes them: each to the kernel
//! URB it answers (the kernel's own, or one that claimed a reply of ours),
//! kept for later (a read or scan ahead, a status read ahead), or to nobody
//! (ours that nobody waits for). Not for what the kernel sends (`storage`).

use usbwire_proto::client_session::Event;
use usbwire_proto::urb::{RetSubmit, ServerMessage};
use usbwire_proto::Status;

use super::wrappers::{answer_to, retag, tag_of};
use super::{Accelerator, READ_CAPACITY_10, SERVICE_ACTION_IN_16};

impl Accelerator {
    /// A reply from the server, as the session decoded it.
    pub fn server_sent(&mut self, event: Event<()>, kernel: &mut impl FnMut(ServerMessage)) {
        match event {
            Event::Completed { reply, .. } => self.completed(reply, kernel),
            Event::Unlinked { reply, cancelled, .. } => {
                if self.ignored.remove(&reply.seqnum) {
                    return;
                }
                if let Some((target, ())) = cancelled {
                    self.kernel_ep0.remove(&target);
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

    fn completed(&mut self, mut reply: RetSubmit, kernel: &mut impl FnMut(ServerMessage)) {
        // A reply to a URB of the kernel's goes to it; one to ours only as an answer.
        let ours = self.own.remove(&reply.seqnum);
        self.kernel_ep0.remove(&reply.seqnum);
        if self.ignored.remove(&reply.seqnum) {
            return;
        }
        if let Some(claim) = self.answers.remove(&reply.seqnum) {
            return kernel(ServerMessage::Submit(answer_to(reply, claim.seqnum, claim.length, claim.tag)));
        }
        self.scan.learn(&reply);
        if self.interfaces.learn(&reply) {
            // A configuration was set: the device starts afresh.
            self.abandon();
            self.drop_reads_ahead();
            if let Some(pipes) = self.interfaces.bulk_only_alone() {
                // usb-storage scans the disk after its `delay_use`: the scan ahead starts now.
                self.scan.configured(pipes);
            }
        }
        if let Some((seqnum, tag)) = self.retag {
            if seqnum == reply.seqnum {
                self.retag = None;
                retag(&mut reply, tag);
                return kernel(ServerMessage::Submit(reply));
            }
        }
        let reply = match self.scan.store(reply) {
            Ok(()) => {
                if self.scan.spoiled() && !self.scan.in_flight() {
                    // Not what a command that passed gives: nothing of the scan is
                    // served, and once all is back, whether the device wants recovering is known.
                    self.drop_scan();
                }
                return;
            }
            Err(reply) => reply,
        };
        let reply = match self.ahead.store(reply) {
            Ok(()) => return,
            Err(reply) => reply,
        };
        let Some(command) = self.command.as_mut() else {
            if !ours {
                kernel(ServerMessage::Submit(reply));
            }
            return;
        };
        if reply.seqnum == command.cbw_seqnum && !command.cbw_replied {
            // Answered when it was sent; a failure shows on the stage after it.
            command.cbw_replied = true;
            return;
        }
        if command.data_seqnums.contains(&reply.seqnum) {
            if reply.status != Status::OK {
                command.void = true;
            } else if matches!(command.cbw[15], READ_CAPACITY_10 | SERVICE_ACTION_IN_16) {
                self.ahead.learn_capacity(&command.cbw, &reply.data);
            }
            return kernel(ServerMessage::Submit(reply));
        }
        if let Some(data) = command.data_ahead.as_mut().filter(|data| data.seqnum == reply.seqnum) {
            if reply.status != Status::OK {
                command.void = true;
            }
            match data.claimed.take() {
                Some((claimer, length)) => kernel(ServerMessage::Submit(answer_to(reply, claimer, length, None))),
                None => data.result = Some(reply),
            }
            return;
        }
        let tag = tag_of(&command.cbw);
        let Some(status) = command.status.as_mut().filter(|status| status.seqnum == reply.seqnum) else {
            if !ours {
                kernel(ServerMessage::Submit(reply));
            }
            return;
        };
        if let (true, None) = (command.void, status.claimed) {
            self.counters.statuses_wasted += 1;
            status.result = Some(reply);
        } else if let Some((claimer, length)) = status.claimed.take() {
            self.counters.statuses_ahead += 1;
            if let Some(command) = self.command.take() {
                self.finished(&command);
            }
            self.after_status(&reply);
            kernel(ServerMessage::Submit(answer_to(reply, claimer, length, Some(tag))));
        } else {
            status.result = Some(reply);
        }
    }

    /// A command's CSW reached the kernel: after a failed command the reads
    /// ahead behind it were skipped on the server.
    pub(super) fn after_status(&mut self, csw: &RetSubmit) {
        if csw.status != Status::OK || csw.data.get(12).is_some_and(|&status| status != 0) {
            self.drop_reads_ahead();
        }
    }
}
