//! What a relay's front runs between its host's URBs and the session when
//! the server agreed to them: the enumeration answered from the import's
//! descriptor snapshot (`enumeration`) and Bulk-Only mass storage in one
//! round trip with read-ahead (`storage`), in that order. Both fronts use it:
//! the kernel's (`kernel_relay`, vhci-hcd's seqnums and replies) and the
//! userspace one (`waiters`, whose callers' replies are routed back to their
//! waiters by seqnum, [`Routed`]). Sans I/O: messages in, messages out. Not
//! for what either accelerator decides (their own modules), nor for the
//! relay's I/O.

use std::collections::HashMap;
use std::time::Instant;

use bytes::Bytes;
use usbwire_proto::client_session::Event;
use usbwire_proto::urb::{ClientMessage, RetSubmit, ServerMessage};

use crate::enumeration::Enumeration;
use crate::relay::Upstream;
use crate::storage::{Accelerator, StorageCounters};

/// The accelerators a relay runs for one imported device.
#[derive(Debug)]
pub(crate) struct Accelerators {
    enumeration: Option<Enumeration>,
    storage: Option<Accelerator>,
}

impl Accelerators {
    /// Those `upstream` asks for (what the server agreed to and the user did
    /// not turn off); `None` when it asks for neither.
    pub(crate) fn new(devid: u32, upstream: &Upstream) -> Option<Self> {
        let storage = upstream.storage.then(|| Accelerator::with_snapshot(devid, upstream.descriptors.as_ref()));
        let enumeration = upstream.descriptors.clone().map(Enumeration::new);
        (storage.is_some() || enumeration.is_some()).then_some(Self { enumeration, storage })
    }

    /// A command from the host at `now`: `server` takes what goes on, `host`
    /// what is answered here.
    pub(crate) fn host_sent<E>(
        &mut self,
        message: ClientMessage,
        now: Instant,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        host: &mut impl FnMut(ServerMessage),
    ) -> Result<(), E> {
        let message = match &mut self.enumeration {
            Some(enumeration) => match enumeration.kernel_sent(message, host) {
                Some(message) => message,
                None => return Ok(()),
            },
            None => message,
        };
        match &mut self.storage {
            Some(storage) => storage.kernel_sent(message, now, server, host),
            None => server(message),
        }
    }

    /// A reply from the server, as the session decoded it: `host` gets what
    /// goes back.
    pub(crate) fn server_sent(&mut self, event: Event<()>, host: &mut impl FnMut(ServerMessage)) {
        if let Some(enumeration) = &mut self.enumeration {
            enumeration.server_sent(&event);
        }
        match (&mut self.storage, event) {
            (Some(storage), event) => storage.server_sent(event, host),
            (None, Event::Completed { reply, .. }) => host(ServerMessage::Submit(reply)),
            (None, Event::Unlinked { reply, .. }) => host(ServerMessage::Unlink(reply)),
        }
    }

    /// Sends on the host's commands that waited for reads ahead to come
    /// back (and the storage accelerator's own that are due); says whether
    /// any of the host's went. Call it after replies were delivered, with the time.
    pub(crate) fn release<E>(
        &mut self,
        now: Instant,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        host: &mut impl FnMut(ServerMessage),
    ) -> Result<bool, E> {
        match &mut self.storage {
            Some(storage) => storage.release(now, server, host),
            None => Ok(false),
        }
    }

    /// What the storage accelerator did, when it runs.
    pub(crate) fn storage_counters(&self) -> Option<StorageCounters> {
        self.storage.as_ref().map(Accelerator::counters)
    }

    /// Logs what they did, as the relay ends.
    pub(crate) fn log_summary(&self) {
        if let Some(enumeration) = &self.enumeration {
            tracing::info!(answered = enumeration.answered(), "enumeration answered from the descriptor snapshot");
        }
        let Some(counters) = self.storage_counters() else { return };
        if counters.commands_pipelined > 0 {
            tracing::info!(
                commands_pipelined = counters.commands_pipelined,
                statuses_ahead = counters.statuses_ahead,
                statuses_wasted = counters.statuses_wasted,
                read_ahead_hits = counters.read_ahead_hits,
                bytes_read_ahead = counters.bytes_read_ahead,
                bytes_wasted = counters.bytes_wasted,
                scan_hits = counters.scan_hits,
                "mass storage accelerated"
            );
        }
    }
}

/// The accelerators on a userspace front: its callers' URBs go in as a
/// kernel's would, and every reply comes back to the caller's waiter `W` by
/// the URB's seqnum (a reply the accelerators made, or the device's). An
/// unlink's answer that finds its target still waiting ends that URB with
/// the unlink's status and no data, as vhci-hcd gives a URB back.
pub(crate) struct Routed<W> {
    accelerators: Accelerators,
    /// The waiter of each caller's URB not answered yet, by seqnum.
    waiters: HashMap<u32, W>,
    /// The target of each unlink not answered yet, by the unlink's seqnum.
    unlinks: HashMap<u32, u32>,
}

impl<W> Routed<W> {
    pub(crate) fn new(accelerators: Accelerators) -> Self {
        Self { accelerators, waiters: HashMap::new(), unlinks: HashMap::new() }
    }

    /// A caller's command (a submit comes with its waiter): `server` takes
    /// what goes on, `deliver` each reply answered at once.
    pub(crate) fn caller_sent<E>(
        &mut self,
        message: ClientMessage,
        waiter: Option<W>,
        now: Instant,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        deliver: &mut impl FnMut(W, RetSubmit),
    ) -> Result<(), E> {
        match (&message, waiter) {
            (ClientMessage::Submit(submit), Some(waiter)) => {
                self.waiters.insert(submit.seqnum, waiter);
            }
            (ClientMessage::Unlink(unlink), _) => {
                self.unlinks.insert(unlink.seqnum, unlink.unlink_seqnum);
            }
            (ClientMessage::Submit(_), None) => {}
        }
        let Self { accelerators, waiters, unlinks } = self;
        accelerators.host_sent(message, now, server, &mut |reply| route(waiters, unlinks, deliver, reply))
    }

    /// A reply from the server; the session's tags are not used.
    pub(crate) fn server_sent<T>(&mut self, event: Event<T>, deliver: &mut impl FnMut(W, RetSubmit)) {
        let event = match event {
            Event::Completed { reply, .. } => Event::Completed { reply, tag: () },
            Event::Unlinked { reply, target, cancelled } => {
                Event::Unlinked { reply, target, cancelled: cancelled.map(|(seqnum, _)| (seqnum, ())) }
            }
        };
        let Self { accelerators, waiters, unlinks } = self;
        accelerators.server_sent(event, &mut |reply| route(waiters, unlinks, deliver, reply));
    }

    /// [`Accelerators::release`], replies routed.
    pub(crate) fn release<E>(
        &mut self,
        now: Instant,
        server: &mut impl FnMut(ClientMessage) -> Result<(), E>,
        deliver: &mut impl FnMut(W, RetSubmit),
    ) -> Result<bool, E> {
        let Self { accelerators, waiters, unlinks } = self;
        accelerators.release(now, server, &mut |reply| route(waiters, unlinks, deliver, reply))
    }

    pub(crate) fn accelerators(&self) -> &Accelerators {
        &self.accelerators
    }

    /// Callers' URBs and unlinks waiting for an answer.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> (usize, usize) {
        (self.waiters.len(), self.unlinks.len())
    }
}

/// A reply for the host, to the waiter of the URB it answers.
fn route<W>(
    waiters: &mut HashMap<u32, W>,
    unlinks: &mut HashMap<u32, u32>,
    deliver: &mut impl FnMut(W, RetSubmit),
    reply: ServerMessage,
) {
    match reply {
        ServerMessage::Submit(reply) => match waiters.remove(&reply.seqnum) {
            Some(waiter) => deliver(waiter, reply),
            None => tracing::debug!(seqnum = reply.seqnum, "a reply nobody waits for"),
        },
        ServerMessage::Unlink(reply) => {
            let Some(target) = unlinks.remove(&reply.seqnum) else { return };
            tracing::debug!(seqnum = reply.seqnum, target, status = ?reply.status, "unlink answered");
            if let Some(waiter) = waiters.remove(&target) {
                deliver(waiter, RetSubmit::new(target, reply.status, Bytes::new()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use usbwire_proto::descriptors::{Entry, Snapshot};
    use usbwire_proto::urb::{CmdSubmit, CmdUnlink, RetUnlink};
    use usbwire_proto::{Direction, Status};

    use super::*;

    const DEVICE: [u8; 18] = [18, 1, 0, 2, 0, 0, 0, 64, 0x09, 0x12, 0x03, 0, 0, 1, 1, 2, 3, 1];

    /// The accelerators of a device whose snapshot holds its device descriptor.
    fn routed() -> Routed<&'static str> {
        let mut snapshot = Snapshot::default();
        let data = Bytes::from_static(&DEVICE);
        snapshot.insert(Entry { request_type: 0x80, value: 0x0100, index: 0, complete: true, data });
        let upstream = Upstream {
            addr: ([127, 0, 0, 1], 3240).into(),
            security: crate::Security::Plain,
            transforms: Vec::new(),
            resume: None,
            give_up_after: Duration::ZERO,
            storage: true,
            descriptors: Some(snapshot),
        };
        Routed::new(Accelerators::new(7, &upstream).unwrap())
    }

    fn get_descriptor(seqnum: u32, value: u16) -> ClientMessage {
        let [v0, v1] = value.to_le_bytes();
        let setup = [0x80, 6, v0, v1, 0, 0, 18, 0];
        ClientMessage::Submit(CmdSubmit::new(seqnum, 7, Direction::In, 0, 18, setup, Bytes::new()))
    }

    /// Sends `message` from the caller `waiter`: what went to the server, and who got which reply.
    fn send(
        routed: &mut Routed<&'static str>,
        message: ClientMessage,
        waiter: Option<&'static str>,
    ) -> (Vec<ClientMessage>, Vec<(&'static str, RetSubmit)>) {
        let (mut sent, mut got) = (Vec::new(), Vec::new());
        routed
            .caller_sent(
                message,
                waiter,
                Instant::now(),
                &mut |message| {
                    sent.push(message);
                    Ok::<(), ()>(())
                },
                &mut |waiter, reply| got.push((waiter, reply)),
            )
            .unwrap();
        (sent, got)
    }

    fn from_server(routed: &mut Routed<&'static str>, event: Event<u8>) -> Vec<(&'static str, RetSubmit)> {
        let mut got = Vec::new();
        routed.server_sent(event, &mut |waiter, reply| got.push((waiter, reply)));
        got
    }

    #[test]
    fn a_reply_reaches_the_waiter_of_its_urb_whoever_answered_it() {
        let mut routed = routed();
        // Answered from the snapshot, at once.
        let (sent, got) = send(&mut routed, get_descriptor(1, 0x0100), Some("first"));
        assert!(sent.is_empty());
        let [("first", reply)] = &got[..] else { panic!("{got:?}") };
        assert_eq!((reply.seqnum, &reply.data[..]), (1, &DEVICE[..]));
        // A string the snapshot lacks goes to the device; its reply comes back to its waiter.
        let (sent, got) = send(&mut routed, get_descriptor(2, 0x0301), Some("second"));
        assert!(matches!(&sent[..], [ClientMessage::Submit(submit)] if submit.seqnum == 2) && got.is_empty());
        assert_eq!(routed.waiting(), (1, 0));
        let reply = RetSubmit::new(2, Status::OK, Bytes::from_static(b"\x04\x03a\0"));
        let got = from_server(&mut routed, Event::Completed { reply, tag: 0 });
        assert!(matches!(&got[..], [("second", reply)] if reply.seqnum == 2 && reply.data.len() == 4));
        assert_eq!(routed.waiting(), (0, 0), "nothing left waiting");
    }

    #[test]
    fn an_unlink_the_server_answers_ends_its_urb_with_the_unlinks_status() {
        let mut routed = routed();
        send(&mut routed, get_descriptor(1, 0x0302), Some("urb"));
        let unlink = ClientMessage::Unlink(CmdUnlink { seqnum: 2, devid: 7, unlink_seqnum: 1 });
        let (sent, got) = send(&mut routed, unlink, None);
        assert!(matches!(&sent[..], [ClientMessage::Unlink(_)]) && got.is_empty());
        assert_eq!(routed.waiting(), (1, 1));
        let reply = RetUnlink { seqnum: 2, status: Status::ECONNRESET };
        let got = from_server(&mut routed, Event::Unlinked { reply, target: 1, cancelled: Some((1, 0)) });
        let [("urb", reply)] = &got[..] else { panic!("{got:?}") };
        assert_eq!((reply.seqnum, reply.status, reply.actual_length), (1, Status::ECONNRESET, 0));
        assert_eq!(routed.waiting(), (0, 0));
    }

    #[test]
    fn an_unlink_too_late_leaves_the_urbs_reply_as_it_came() {
        let mut routed = routed();
        send(&mut routed, get_descriptor(1, 0x0302), Some("urb"));
        let got = from_server(
            &mut routed,
            Event::Completed { reply: RetSubmit::new(1, Status::OK, Bytes::from_static(b"\x02\x03")), tag: 0 },
        );
        assert_eq!(got.len(), 1);
        // The caller unlinks before it saw the reply; the server finds nothing to cancel.
        send(&mut routed, ClientMessage::Unlink(CmdUnlink { seqnum: 2, devid: 7, unlink_seqnum: 1 }), None);
        let reply = RetUnlink { seqnum: 2, status: Status::OK };
        assert!(from_server(&mut routed, Event::Unlinked { reply, target: 1, cancelled: None }).is_empty());
        // An unlink of an answer made here is answered here, too late as well.
        send(&mut routed, get_descriptor(3, 0x0100), Some("answered"));
        let unlink = ClientMessage::Unlink(CmdUnlink { seqnum: 4, devid: 7, unlink_seqnum: 3 });
        let (sent, got) = send(&mut routed, unlink, None);
        assert!(sent.is_empty() && got.is_empty());
        assert_eq!(routed.waiting(), (0, 0));
    }
}
