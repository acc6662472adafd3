//! Enumeration without round trips: the kernel's `GET_DESCRIPTOR` requests
//! answered from the descriptor snapshot the server sent with the import
//! (`docs/protocol.md` §5.8), so attaching a device over a long link costs
//! no round trip per descriptor. Every other request, and any descriptor
//! the snapshot does not hold whole, goes to the device as before.
//!
//! A request is answered here only while none of the kernel's requests to
//! ep0 is on its way to the server: a device completes one control transfer
//! after the other, and so does this. Sans I/O, like the relay's other
//! parts; not for the snapshot's bytes (`usbwire_proto::descriptors`) nor for
//! mass storage (`crate::storage`).

use std::collections::{HashSet, VecDeque};

use usbwire_proto::client_session::Event;
use usbwire_proto::descriptors::Snapshot;
use usbwire_proto::urb::{ClientMessage, RetSubmit, RetUnlink, ServerMessage};
use usbwire_proto::{Direction, Status};

/// How many of the kernel's URBs answered here are remembered for a late unlink.
const ANSWERED_REMEMBERED: usize = 64;

/// The snapshot, and the kernel's control requests to the device in flight.
#[derive(Debug)]
pub(crate) struct Enumeration {
    snapshot: Snapshot,
    /// Seqnums of the kernel's ep0 URBs sent to the server and not yet back.
    to_device: HashSet<u32>,
    /// The latest URBs answered here: an unlink of one (sent before the
    /// kernel read the answer) is answered as too late to cancel.
    answered_at_once: VecDeque<u32>,
    answered: u64,
}

impl Enumeration {
    pub(crate) fn new(snapshot: Snapshot) -> Self {
        Self { snapshot, to_device: HashSet::new(), answered_at_once: VecDeque::new(), answered: 0 }
    }

    /// How many of the kernel's requests were answered from the snapshot.
    pub(crate) fn answered(&self) -> u64 {
        self.answered
    }

    /// A command from the kernel: answered here (`kernel` gets the reply and
    /// `None` is returned), or given back to be sent on.
    pub(crate) fn kernel_sent(
        &mut self,
        message: ClientMessage,
        kernel: &mut impl FnMut(ServerMessage),
    ) -> Option<ClientMessage> {
        match &message {
            ClientMessage::Submit(submit) if submit.ep == 0 => {
                let idle = self.to_device.is_empty();
                let answer = (idle && submit.direction == Direction::In)
                    .then(|| self.snapshot.answer(&submit.setup))
                    .flatten()
                    .filter(|data| data.len() <= submit.transfer_buffer_length as usize);
                let Some(data) = answer else {
                    self.to_device.insert(submit.seqnum);
                    return Some(message);
                };
                kernel(ServerMessage::Submit(RetSubmit::new(submit.seqnum, Status::OK, data)));
                self.answered += 1;
                self.answered_at_once.push_back(submit.seqnum);
                if self.answered_at_once.len() > ANSWERED_REMEMBERED {
                    self.answered_at_once.pop_front();
                }
                None
            }
            ClientMessage::Unlink(unlink) if self.answered_at_once.contains(&unlink.unlink_seqnum) => {
                kernel(ServerMessage::Unlink(RetUnlink { seqnum: unlink.seqnum, status: Status::OK }));
                None
            }
            _ => Some(message),
        }
    }

    /// A reply from the server, before it goes on: a control request it ends is no longer in flight.
    pub(crate) fn server_sent<T>(&mut self, event: &Event<T>) {
        match event {
            Event::Completed { reply, .. } => self.to_device.remove(&reply.seqnum),
            Event::Unlinked { cancelled, .. } => {
                cancelled.as_ref().is_some_and(|(seqnum, _)| self.to_device.remove(seqnum))
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use usbwire_proto::descriptors::Entry;
    use usbwire_proto::urb::{CmdSubmit, CmdUnlink};

    use super::*;

    const DEVICE: [u8; 18] = [18, 1, 0, 2, 0, 0, 0, 64, 0x09, 0x12, 0x03, 0, 0, 1, 1, 2, 3, 1];

    fn enumeration() -> Enumeration {
        let mut snapshot = Snapshot::default();
        snapshot.insert(Entry {
            request_type: 0x80,
            value: 0x0100,
            index: 0,
            complete: true,
            data: Bytes::from_static(&DEVICE),
        });
        Enumeration::new(snapshot)
    }

    fn get(seqnum: u32, value: u16, length: u16) -> ClientMessage {
        let [v0, v1] = value.to_le_bytes();
        let [l0, l1] = length.to_le_bytes();
        let setup = [0x80, 6, v0, v1, 0, 0, l0, l1];
        ClientMessage::Submit(CmdSubmit::new(seqnum, 0x10002, Direction::In, 0, u32::from(length), setup, Bytes::new()))
    }

    fn send(enumeration: &mut Enumeration, message: ClientMessage) -> (Option<ClientMessage>, Vec<ServerMessage>) {
        let mut replies = Vec::new();
        let on = enumeration.kernel_sent(message, &mut |reply| replies.push(reply));
        (on, replies)
    }

    fn completed(seqnum: u32) -> Event<()> {
        let reply = RetSubmit::new(seqnum, Status::OK, Bytes::new());
        Event::Completed { reply, tag: () }
    }

    #[test]
    fn the_kernels_first_request_is_answered_with_what_the_device_gave() {
        let mut e = enumeration();
        let (on, replies) = send(&mut e, get(1, 0x0100, 64));
        assert!(on.is_none());
        let [ServerMessage::Submit(reply)] = &replies[..] else { panic!("{replies:?}") };
        assert_eq!((reply.seqnum, reply.status, reply.actual_length), (1, Status::OK, 18));
        assert_eq!(&reply.data[..], &DEVICE[..]);
        assert_eq!(e.answered(), 1);
    }

    #[test]
    fn what_the_snapshot_lacks_goes_on_and_holds_later_answers_until_it_is_back() {
        let mut e = enumeration();
        // A configuration the snapshot does not hold: to the device.
        let (on, replies) = send(&mut e, get(1, 0x0200, 9));
        assert!(on.is_some() && replies.is_empty());
        // Meanwhile the kernel asks for the device descriptor: in order, behind it.
        let (on, replies) = send(&mut e, get(2, 0x0100, 18));
        assert!(on.is_some() && replies.is_empty());
        e.server_sent(&completed(1));
        e.server_sent(&completed(2));
        let (on, replies) = send(&mut e, get(3, 0x0100, 18));
        assert!(on.is_none() && replies.len() == 1);
        // Other endpoints neither wait nor hold ep0 up.
        let bulk = ClientMessage::Submit(CmdSubmit::new(4, 0x10002, Direction::In, 1, 512, [0; 8], Bytes::new()));
        assert!(send(&mut e, bulk).0.is_some());
        assert!(send(&mut e, get(5, 0x0100, 18)).0.is_none());
    }

    #[test]
    fn a_cancelled_request_frees_ep0_and_a_late_unlink_of_an_answer_is_too_late() {
        let mut e = enumeration();
        assert!(send(&mut e, get(1, 0x0300, 255)).0.is_some());
        e.server_sent(&Event::Unlinked {
            reply: RetUnlink { seqnum: 2, status: Status::ECONNRESET },
            target: 1,
            cancelled: Some((1, ())),
        });
        assert!(send(&mut e, get(3, 0x0100, 18)).0.is_none());
        let unlink = ClientMessage::Unlink(CmdUnlink { seqnum: 4, devid: 0x10002, unlink_seqnum: 3 });
        let (on, replies) = send(&mut e, unlink);
        assert!(on.is_none());
        assert!(matches!(&replies[..], [ServerMessage::Unlink(RetUnlink { seqnum: 4, status: Status::OK })]));
        // An unlink of anything else is the server's.
        let other = ClientMessage::Unlink(CmdUnlink { seqnum: 5, devid: 0x10002, unlink_seqnum: 1 });
        assert!(send(&mut e, other).0.is_some());
    }
}
