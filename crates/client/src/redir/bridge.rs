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
//! Not for: reading or writing sockets, importing the device, or noticing a
//! USB/IP connection that went quiet (the shell's liveness tick does).

use std::collections::HashMap;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use tracing::{debug, info};
use usbwire_proto::urb::{IsoPacketDescriptor, RetSubmit, TransferFlags};
use usbwire_proto::{Budget, Direction, Limits, Status};
use usbwire_redir::host::{HostError, HostEvent, Traffic, UrbCommand, UrbRequest, UrbResult};
use usbwire_redir::UsbHost;

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

    /// The USB/IP side is gone: the core tells the guest the device went.
    pub fn device_lost(&mut self) -> BridgeError {
        self.host.device_lost();
        BridgeError::DeviceLost
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
