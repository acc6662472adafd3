//! [`BridgeCore`]: one guest's usbredir bridge without its sockets and timers.
//!
//! It owns the decisions between the guest and the imported device: the
//! guest's packets go into a [`UsbHost`], whose URBs it submits on a
//! [`TransferQueue`] (keeping the tag ↔ seqnum map for cancels), whose
//! completions it hands back, and whether the guest may be read or
//! completions collected now, given the [`Budget`]. The async shell in
//! [`super`] moves bytes between it and the guest's socket, and the fuzz
//! harness drives it the same way with bytes of its own (over a
//! [`DrivenConnection`](crate::DrivenConnection)), so both run this code.
//!
//! When the device re-enumerates and the shell imports the same bus id
//! again, [`BridgeCore::replace_device`] moves the bridge onto the new
//! import: the guest is told `device_disconnect`, everything held for the
//! old device (its URBs, streams, their share of the budget) is released,
//! and the new device is announced once the guest acknowledged.
//!
//! Not for: reading or writing sockets, importing the device, or noticing a
//! USB/IP connection that ended (the shell waits for that).

use std::collections::HashMap;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use tracing::{debug, info};
use usbwire_proto::urb::{IsoPacketDescriptor, RetSubmit, TransferFlags};
use usbwire_proto::{Budget, Direction, Limits, Speed, Status};
use usbwire_redir::host::{HostError, HostEvent, Traffic, UrbCommand, UrbRequest, UrbResult};
use usbwire_redir::UsbHost;

use crate::follow::FollowError;
use crate::{ClientError, Transfer, TransferError, TransferQueue};

/// Why one guest's session ended badly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BridgeError {
    /// The device could not be imported (see [`ClientError`]).
    #[error("importing the device failed: {0}")]
    Import(#[from] ClientError),
    /// The guest broke the protocol, or the device's descriptors could not be read.
    #[error(transparent)]
    Host(#[from] HostError),
    /// The guest's socket failed.
    #[error("the guest connection failed: {0}")]
    Guest(#[from] std::io::Error),
    /// The USB/IP connection ended while the guest used the device.
    #[error("the USB/IP connection to the device was lost")]
    DeviceLost,
    /// The bridge follows the device, and it did not come back at its bus
    /// id in time after it went (see [`FollowError::NotBack`]).
    #[error(transparent)]
    NotBack(Box<FollowError>),
}

/// How a guest's session ended without an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// The guest closed the connection.
    GuestLeft,
    /// The guest's filter refuses this device, or it rejected it.
    Refused(String),
}

/// A completion as the queue hands it over: `None` when nothing is pending,
/// an error once the connection is gone.
pub type Completion = Option<Result<RetSubmit, TransferError>>;

/// The running bridge of one guest: the usb-host core and the URB bookkeeping.
pub struct BridgeCore {
    host: UsbHost,
    queue: TransferQueue,
    /// Core tag → USB/IP seqnum, for cancels (until cancelled or completed).
    seqnums: HashMap<u64, u32>,
    /// USB/IP seqnum → core tag and `transfer_buffer_length`: the URBs in flight.
    urbs: HashMap<u32, (u64, u32)>,
    /// `transfer_buffer_length` summed over `urbs`.
    in_flight_bytes: usize,
    budget: Budget,
}

impl BridgeCore {
    /// A bridge submitting `host`'s URBs on `queue`, reading the guest only
    /// while `budget`'s in-flight limits and `queued_reply_bytes` have room.
    pub fn new(host: UsbHost, queue: TransferQueue, budget: Budget) -> Self {
        Self { host, queue, seqnums: HashMap::new(), urbs: HashMap::new(), in_flight_bytes: 0, budget }
    }

    /// Takes every whole packet the guest sent from `inbuf`; call
    /// [`issue_commands`](Self::issue_commands) after it.
    pub fn handle_guest(&mut self, inbuf: &mut BytesMut) -> Result<(), HostError> {
        self.host.handle_guest(inbuf)
    }

    /// Logs the core's events; `Some` when the guest will not use the device
    /// (the session ends).
    pub fn poll_ended(&mut self) -> Option<Ended> {
        while let Some(event) = self.host.poll_event() {
            match event {
                HostEvent::GuestHello { version } => info!(target: "usbwire::redir", %version, "guest said hello"),
                HostEvent::Announced => info!(target: "usbwire::redir", "device announced to the guest"),
                HostEvent::FilteredOut { rules } => {
                    return Some(Ended::Refused(format!("its usbredir filter ({rules}) refuses the device")));
                }
                HostEvent::GuestRejected => return Some(Ended::Refused("it rejected the device".into())),
                HostEvent::ReplacedOnReset { held } => info!(target: "usbwire::redir", held,
                    "the device re-enumerated on the guest's reset; the guest's requests since go to the new one"),
                HostEvent::DisconnectAcknowledged => {
                    debug!(target: "usbwire::redir", "guest acknowledged the disconnect")
                }
                other => debug!(target: "usbwire::redir", ?other, "bridge event"),
            }
        }
        None
    }

    /// Submits and cancels what the core asks for. Submitted URBs go out when
    /// the queue next waits for a completion. A transfer longer than a USB/IP
    /// server takes fails at once (as `INVAL`) instead; an error is the core's
    /// (a descriptor read refused that way).
    pub fn issue_commands(&mut self) -> Result<(), HostError> {
        while let Some(command) = self.host.poll_urb() {
            match command {
                UrbCommand::Submit { tag, urb } if urb.length > Limits::default().max_transfer_length => {
                    // A USB/IP server takes a longer command for a broken client and closes the
                    // connection, which would cost this guest the device: the request fails alone.
                    debug!(target: "usbwire::redir", length = urb.length, "transfer too long for USB/IP; refused");
                    let refused = UrbResult {
                        status: Status::EINVAL,
                        actual_length: 0,
                        data: Bytes::new(),
                        iso_packets: Vec::new(),
                    };
                    self.host.handle_urb(tag, refused)?;
                }
                UrbCommand::Submit { tag, urb } => {
                    let transfer = transfer_of(urb);
                    let length = match transfer.direction {
                        Direction::Out => transfer.data.len() as u32,
                        Direction::In => transfer.length,
                    };
                    match self.queue.submit(transfer) {
                        Ok(seqnum) => {
                            self.seqnums.insert(tag, seqnum);
                            self.urbs.insert(seqnum, (tag, length));
                            self.in_flight_bytes += length as usize;
                        }
                        // The connection is gone; the liveness check ends the session.
                        Err(TransferError::Disconnected) => {}
                        Err(error) => debug!(target: "usbwire::redir", %error, "submit failed"),
                    }
                }
                UrbCommand::Cancel { tag } => {
                    // Once per URB: its completion (cancelled or not) follows.
                    if let Some(seqnum) = self.seqnums.remove(&tag) {
                        let _ = self.queue.unlink(seqnum);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether the guest reads what we send: past `queued_reply_bytes`
    /// waiting for it, the bridge neither reads it nor collects completions
    /// (a guest that does not read slows the device down instead of growing us).
    fn guest_keeps_up(&mut self) -> bool {
        self.host.to_guest().len() < self.budget.queued_reply_bytes
    }

    /// Whether to read the guest now: it keeps up, and the URBs in flight and
    /// their bytes leave room in the budget (one read may still add a few
    /// URBs past it).
    pub fn reads_guest(&mut self) -> bool {
        self.guest_keeps_up()
            && self.urbs.len() < self.budget.in_flight_urbs
            && (self.in_flight_bytes == 0 || self.in_flight_bytes < self.budget.in_flight_bytes)
    }

    /// Whether to wait for completions now: something is pending and the
    /// guest keeps up. (Waiting is also what sends submitted URBs.)
    pub fn collects_completions(&mut self) -> bool {
        self.guest_keeps_up() && self.queue.pending() > 0
    }

    /// Bytes for the guest, to write in order; the writer advances past what it wrote.
    pub fn to_guest(&mut self) -> &mut BytesMut {
        self.host.to_guest()
    }

    /// Sends what was submitted and waits for the next completion (see
    /// [`TransferQueue::next_complete`]); give it to
    /// [`handle_completion`](Self::handle_completion).
    pub async fn next_complete(&mut self) -> Completion {
        self.queue.next_complete().await
    }

    /// The poll form of [`next_complete`](Self::next_complete).
    pub fn poll_next_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        self.queue.poll_next_complete(cx)
    }

    /// Hands a completion, and every other one already arrived, to the core.
    /// A lost connection ends the session ([`BridgeError::DeviceLost`]) after
    /// the core told the guest the device went.
    pub fn handle_completion(&mut self, completion: Completion) -> Result<(), BridgeError> {
        match completion {
            Some(Ok(ret)) => {
                self.complete(ret)?;
                while let Some(ret) = self.queue.try_next_complete() {
                    self.complete(ret)?;
                }
                Ok(())
            }
            Some(Err(_)) | None => Err(self.device_lost()),
        }
    }

    fn complete(&mut self, ret: RetSubmit) -> Result<(), HostError> {
        let Some((tag, length)) = self.urbs.remove(&ret.seqnum) else { return Ok(()) };
        self.in_flight_bytes -= length as usize;
        self.seqnums.remove(&tag);
        let result = UrbResult {
            status: ret.status,
            actual_length: ret.actual_length,
            data: ret.data,
            iso_packets: ret.iso_packets,
        };
        self.host.handle_urb(tag, result)
    }

    /// The USB/IP side is gone: the core tells the guest the device went,
    /// after the replies that arrived before the end (a DFU_DETACH's, which
    /// the guest must get), and what was in flight on it holds nothing of
    /// the budget any more.
    pub fn device_lost(&mut self) -> BridgeError {
        while let Some(ret) = self.queue.try_next_complete() {
            if let Err(error) = self.complete(ret) {
                debug!(target: "usbwire::redir", %error, "a reply before the device went");
                break;
            }
        }
        self.host.device_lost();
        self.release_urbs();
        BridgeError::DeviceLost
    }

    /// The device came back at its port (it re-enumerated) and was imported
    /// again, at `speed`, with URBs to go on `queue` (the new connection's):
    /// the guest is told the old device disconnected, if it was not yet,
    /// everything held for it is released (its URBs in flight, streams and
    /// their budget; its queue is dropped), and the new device's descriptors
    /// are read, to announce it once the guest acknowledged the disconnect.
    pub fn replace_device(&mut self, speed: Speed, queue: TransferQueue) {
        self.host.replace_device(speed);
        self.release_urbs();
        self.queue = queue;
    }

    /// Forgets the URBs in flight: their device is gone, and whatever
    /// completes for them later is nobody's.
    fn release_urbs(&mut self) {
        self.seqnums.clear();
        self.urbs.clear();
        self.in_flight_bytes = 0;
    }

    /// What the guest has moved so far.
    pub fn traffic(&self) -> Traffic {
        self.host.traffic()
    }

    /// URBs submitted and not completed (their seqnums), and their
    /// `transfer_buffer_length` summed: what the budget's in-flight limits hold.
    pub fn in_flight(&self) -> (usize, usize) {
        (self.urbs.len(), self.in_flight_bytes)
    }

    /// URBs submitted on the queue and not yet collected (sent or not).
    pub fn pending(&self) -> usize {
        self.queue.pending()
    }

    /// Whether the URB submitted as `seqnum` is in flight.
    pub fn is_in_flight(&self, seqnum: u32) -> bool {
        self.urbs.contains_key(&seqnum)
    }

    /// The usb-host core (for what it holds: its URBs in flight, its events).
    pub fn host(&self) -> &UsbHost {
        &self.host
    }

    /// The budget the bridge keeps to.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }
}

/// The client's [`Transfer`] for a core's URB.
fn transfer_of(urb: UrbRequest) -> Transfer {
    let direction = if urb.is_in() { Direction::In } else { Direction::Out };
    let mut flags = if urb.is_in() { TransferFlags::DIR_IN } else { 0 };
    let iso_packets = (!urb.iso_packet_lengths.is_empty()).then(|| {
        flags |= TransferFlags::ISO_ASAP;
        let mut offset = 0;
        urb.iso_packet_lengths
            .iter()
            .map(|&length| {
                let descriptor = IsoPacketDescriptor { offset, length, actual_length: 0, status: Status::OK };
                offset += length;
                descriptor
            })
            .collect()
    });
    let interval = if iso_packets.is_some() { 1 } else { 0 };
    Transfer {
        endpoint: urb.endpoint & 0x0f,
        direction,
        setup: urb.setup,
        flags,
        length: urb.length,
        data: urb.data,
        interval,
        iso_packets,
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;
    use std::time::Instant;

    use usbwire_proto::urb::{self, ClientMessage};
    use usbwire_proto::{liveness, resume};
    use usbwire_redir::{Caps, Codec, Packet, Side, Status as RedirStatus};

    use super::*;
    use crate::DrivenConnection;

    const DEVID: u32 = 0x0001_0002;
    /// The board in its runtime mode: 1209:0006, a vendor interface with interrupt IN 0x81.
    const RUNTIME: [u8; 18] = [18, 1, 0x00, 0x02, 0, 0, 0, 64, 0x09, 0x12, 0x06, 0x00, 0x00, 0x01, 1, 2, 3, 1];
    const RUNTIME_CONFIGURATION: [u8; 25] = [
        9, 2, 25, 0, 1, 1, 0, 0x80, 50, //
        9, 4, 0, 0, 1, 0xff, 0, 0, 0, //
        7, 5, 0x81, 3, 8, 0, 10,
    ];
    /// Its bootloader: 1209:0007, one DFU interface, no endpoints.
    const BOOTLOADER: [u8; 18] = [18, 1, 0x00, 0x02, 0, 0, 0, 64, 0x09, 0x12, 0x07, 0x00, 0x00, 0x02, 1, 2, 3, 1];
    const BOOTLOADER_CONFIGURATION: [u8; 18] = [9, 2, 18, 0, 1, 1, 0, 0x80, 50, 9, 4, 0, 0, 0, 0xfe, 1, 2, 0];

    /// A guest (QEMU's caps), the bridge, and the connection of the current import.
    struct Rig {
        guest: Codec,
        core: BridgeCore,
        connection: DrivenConnection,
        /// Commands the "server" received and has not answered.
        held: Vec<urb::CmdSubmit>,
        next_id: u64,
    }

    fn budget() -> Budget {
        Budget { in_flight_urbs: 8, in_flight_bytes: 4096, ..Budget::default() }
    }

    impl Rig {
        fn new() -> Self {
            let connection = DrivenConnection::new(DEVID, budget()).resumable_with_keepalive(Instant::now());
            let core = BridgeCore::new(UsbHost::new("usbwire test", Speed::FULL), connection.queue(), budget());
            let caps = [Caps::CONNECT_DEVICE_VERSION, Caps::FILTER, Caps::DEVICE_DISCONNECT_ACK, Caps::IDS_64]
                .into_iter()
                .fold(Caps(0), Caps::with);
            let guest = Codec::new(Side::Guest, caps, usbwire_redir::MAX_PACKET_LEN);
            let mut rig = Self { guest, core, connection, held: Vec::new(), next_id: 1 };
            let hello = rig.guest.hello("qemu test");
            rig.guest_sends_with_id(0, &hello);
            rig
        }

        fn guest_sends_with_id(&mut self, id: u64, packet: &Packet) {
            let mut wire = BytesMut::new();
            self.guest.encode(id, packet, &mut wire).unwrap();
            self.core.handle_guest(&mut wire).unwrap();
        }

        fn guest_sends(&mut self, packet: &Packet) -> u64 {
            let id = self.next_id;
            self.next_id += 1;
            self.guest_sends_with_id(id, packet);
            id
        }

        fn guest_receives(&mut self) -> Vec<Packet> {
            let mut wire = self.core.to_guest().split();
            std::iter::from_fn(|| self.guest.decode(&mut wire).unwrap()).map(|(_, packet)| packet).collect()
        }

        /// Moves URBs and replies until nothing moves; the server answers
        /// control transfers with `device`'s descriptors and holds the rest.
        fn pump(&mut self, device: &[u8], configuration: &[u8]) {
            for _ in 0..100 {
                self.core.issue_commands().unwrap();
                let mut moved = false;
                if self.core.collects_completions() {
                    let mut cx = Context::from_waker(Waker::noop());
                    if let Poll::Ready(completion) = self.core.poll_next_complete(&mut cx) {
                        self.core.handle_completion(completion).unwrap();
                        moved = true;
                    }
                }
                if !self.connection.is_closed() {
                    moved |= self.connection.take_commands().unwrap();
                    let replies = self.serve(device, configuration);
                    if !replies.is_empty() {
                        self.connection.handle_server(&replies).unwrap();
                        moved = true;
                    }
                }
                if !moved {
                    return;
                }
            }
            panic!("the bridge never settles");
        }

        /// What the server makes of the client's bytes: control transfers answered, the rest held.
        fn serve(&mut self, device: &[u8], configuration: &[u8]) -> BytesMut {
            let outbox = self.connection.to_server();
            let mut wire = BytesMut::new();
            while !outbox.is_empty() {
                let bytes: Vec<u8> = outbox.slices(64).iter().flat_map(|slice| slice.iter().copied()).collect();
                outbox.advance(bytes.len());
                wire.extend_from_slice(&bytes);
            }
            let mut replies = BytesMut::new();
            while wire.len() >= urb::HEADER_LEN {
                if liveness::is_ping(&wire) || resume::parse_ack(&wire).is_some() {
                    let _ = wire.split_to(urb::HEADER_LEN);
                    continue;
                }
                let Some(ClientMessage::Submit(submit)) =
                    urb::decode_command(&mut wire, &Limits::default(), |_, _| false).unwrap()
                else {
                    panic!("only submits expected")
                };
                if submit.ep != 0 {
                    self.held.push(submit);
                    continue;
                }
                let wanted = submit.transfer_buffer_length as usize;
                let data: &[u8] = match (submit.setup[1], submit.setup[3]) {
                    (0x06, 0x01) => device,
                    (0x06, 0x02) => configuration,
                    (0x08, _) => &[1],
                    _ => &[],
                };
                let data = Bytes::copy_from_slice(&data[..wanted.min(data.len())]);
                let ret = RetSubmit::new(submit.seqnum, Status::OK, data);
                ret.encode(&mut replies);
            }
            replies
        }
    }

    #[test]
    fn a_reenumerated_device_is_disconnected_then_connected_with_its_new_descriptors() {
        let mut rig = Rig::new();
        rig.pump(&RUNTIME, &RUNTIME_CONFIGURATION);
        assert!(rig.core.host().is_announced());
        let connect = rig.guest_receives().into_iter().find(|p| matches!(p, Packet::DeviceConnect { .. }));
        assert!(matches!(connect, Some(Packet::DeviceConnect { vendor_id: 0x1209, product_id: 0x0006, .. })));

        // The guest keeps the old device busy: interrupt receiving, and a control transfer the server holds.
        rig.guest_sends(&Packet::StartInterruptReceiving { endpoint: 0x81 });
        rig.pump(&RUNTIME, &RUNTIME_CONFIGURATION);
        let (urbs, bytes) = rig.core.in_flight();
        assert_eq!((urbs, bytes), (4, 32), "four interrupt URBs of 8 bytes in flight");
        assert_eq!(rig.connection.accepted(), (4, 32));
        rig.guest_receives();

        // The server answers one interrupt URB, then ends the session: the device re-enumerated.
        let report = rig.held.remove(0);
        let mut wire = BytesMut::new();
        let data = Bytes::from_static(&[1, 2, 3, 4, 5, 6, 7, 8]);
        RetSubmit {
            seqnum: report.seqnum,
            status: Status::OK,
            actual_length: 8,
            start_frame: 0,
            number_of_packets: 0,
            error_count: 0,
            data,
            iso_packets: Vec::new(),
        }
        .encode(&mut wire);
        wire.extend_from_slice(&resume::end_header_for(DEVID, resume::EndReason::REENUMERATED));
        assert!(rig.connection.handle_server(&wire).is_err(), "the session ends on END(REENUMERATED)");
        rig.connection.end();
        // The shell notices the end before it collected the reply: the reply still comes first.
        assert!(matches!(rig.core.device_lost(), BridgeError::DeviceLost));
        let packets = rig.guest_receives();
        assert!(
            matches!(packets.as_slice(), [Packet::Interrupt { endpoint: 0x81, .. }, Packet::DeviceDisconnect]),
            "the reply that arrived before the end, then the disconnect: {packets:?}"
        );
        let mut cx = Context::from_waker(Waker::noop());
        let Poll::Ready(completion) = rig.core.poll_next_complete(&mut cx) else { panic!("the loss is pending") };
        assert!(matches!(rig.core.handle_completion(completion), Err(BridgeError::DeviceLost)));
        assert!(rig.guest_receives().is_empty(), "one disconnect");
        assert_eq!(rig.core.in_flight(), (0, 0), "nothing of the old device holds the budget");
        assert_eq!(rig.core.host().urbs_in_flight(), 0);
        assert_eq!(rig.connection.accepted(), (0, 0), "the old connection holds nothing");

        // The same bus id, imported again: the bootloader.
        let old = std::mem::replace(
            &mut rig.connection,
            DrivenConnection::new(DEVID, budget()).resumable_with_keepalive(Instant::now()),
        );
        rig.held.clear();
        rig.core.replace_device(Speed::HIGH, rig.connection.queue());
        assert_eq!((rig.core.pending(), rig.core.in_flight()), (0, (0, 0)), "the new import starts empty");
        assert!(rig.guest_receives().is_empty(), "one disconnect only");
        rig.pump(&BOOTLOADER, &BOOTLOADER_CONFIGURATION);
        assert!(!rig.core.host().is_announced(), "announced before the guest acknowledged the disconnect");
        assert!(rig.guest_receives().is_empty());
        rig.guest_sends_with_id(0, &Packet::DeviceDisconnectAck);
        let packets = rig.guest_receives();
        let kinds: Vec<_> = packets.iter().map(Packet::kind).collect();
        assert_eq!(
            kinds,
            [
                usbwire_redir::PacketType::EP_INFO,
                usbwire_redir::PacketType::INTERFACE_INFO,
                usbwire_redir::PacketType::DEVICE_CONNECT
            ]
        );
        assert!(
            matches!(packets[2], Packet::DeviceConnect { speed: 2, vendor_id: 0x1209, product_id: 0x0007, .. }),
            "{packets:?}"
        );
        let Packet::InterfaceInfo(interfaces) = &packets[1] else { panic!() };
        assert_eq!(interfaces.class, vec![0xfe], "the bootloader's DFU interface");
        assert_eq!(rig.core.in_flight(), (0, 0), "the descriptor reads are done");

        // The new device works, and the old one's stream did not come along.
        rig.guest_sends(&Packet::GetConfiguration);
        assert_eq!(
            rig.guest_receives(),
            [Packet::ConfigurationStatus { status: RedirStatus::SUCCESS, configuration: 1 }]
        );
        rig.pump(&BOOTLOADER, &BOOTLOADER_CONFIGURATION);
        assert!(rig.held.is_empty(), "no interrupt URB for the old device's endpoint went to the new import");
        assert_eq!(old.accepted(), (0, 0));
    }
}
