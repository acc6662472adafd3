//! The server's half of the device protocol, as a state machine with no I/O:
//! URBs in ([`Core::submit`], [`Core::cancel`], [`Core::reset`]), frames out
//! ([`Core::poll_transmit`]); the device process's frames in
//! ([`Core::handle`]), completions out ([`Core::poll_complete`]). Time is
//! input too: [`Core::poll_timeout`] says when a request's answer is due and
//! [`Core::handle_timeout`] is called then.
//!
//! The rules it enforces (`docs/protocol.md` §9.3):
//! * every request gets a first answer within the reply timeout: an IN or OUT
//!   request may be NAKed (then it waits as long as the device likes, as a
//!   HID interrupt IN does), a control request must be finished; a device
//!   process that misses one is hung, and is dropped (that URB ends
//!   `-ETIMEDOUT`, the others `-ESHUTDOWN`);
//! * final answers on one endpoint come in request order;
//! * an answer for a request the server cancelled or abandoned (a reset) is
//!   ignored; one for an id never issued is a protocol error, which drops the
//!   device process.
//!
//! Not for sockets or descriptors: the shell in `device.rs` moves the bytes
//! and `enumerate.rs` reads the descriptors.

use std::collections::VecDeque;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tracing::{debug, trace};
use usbwire_device::control::{feature, request, SetupPacket};
use usbwire_device::descriptor::ConfigurationInfo;
use usbwire_device::{Completion, CompletionQueue, Direction, Status, TransferType, Urb};

use crate::codec::{Message, MessageType};

/// The most requests a device process holds at once. The server's own budget
/// (`in_flight_urbs`, 1024 by default) keeps an importer well under it.
pub const MAX_PENDING: usize = 4096;

/// `-ENOMEM`: what a URB past [`MAX_PENDING`] ends with.
const ENOMEM: Status = Status(-12);

/// Why a device process is no longer the device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Gone {
    /// It closed its socket (exited, or disconnected the device).
    #[error("the device process disconnected")]
    Closed,
    /// It broke the protocol; the message says how.
    #[error("the device process broke the protocol: {0}")]
    Protocol(#[from] ProtocolError),
    /// It left request `id` unanswered past the reply timeout.
    #[error("the device process left request {id} unanswered for {after:?}; it is taken as hung")]
    TimedOut { id: u32, after: Duration },
    /// The server let go of the device (stopping, or the export withdrawn).
    #[error("the server dropped the device")]
    Dropped,
}

/// A frame the device process may not send then.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// Bytes that are not a frame.
    #[error("{0}")]
    Codec(#[from] crate::codec::CodecError),
    /// A message only the server sends, or a second hello.
    #[error("message type {:#04x} is not one a device process sends now", .0.0)]
    Unexpected(MessageType),
    /// An answer for an id the server never gave out.
    #[error("answer for request {0}, which was never sent")]
    NeverIssued(u32),
    /// A final answer that skips an older request on the same endpoint.
    #[error("answer for request {id} before the older request {oldest} on the same endpoint")]
    OutOfOrder { id: u32, oldest: u32 },
    /// IN data for a request that carries OUT data (or none).
    #[error("DATA answering request {0}, which expects ACK, NAK or STALL")]
    DataForOut(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Control(SetupPacket),
    In,
    Out,
}

#[derive(Debug)]
struct Pending {
    id: u32,
    urb: Urb,
    kind: Kind,
    /// When its first (for control: final) answer is due; `None` once NAKed.
    deadline: Option<Instant>,
}

impl Pending {
    /// Requests on one endpoint finish in order; ep0 is one queue both ways.
    fn queue(&self) -> (u8, Option<Direction>) {
        match self.kind {
            Kind::Control(_) => (self.urb.endpoint, None),
            _ => (self.urb.endpoint, Some(self.urb.direction)),
        }
    }
}

/// The configurations the device described, and which one (and which alt
/// settings) the host chose, for `Device::endpoint_type`.
#[derive(Debug, Default, Clone)]
pub struct Layout {
    pub configurations: Vec<ConfigurationInfo>,
    value: u8,
    alt_settings: Vec<(u8, u8)>,
}

impl Layout {
    pub fn new(configurations: Vec<ConfigurationInfo>) -> Self {
        Self { configurations, value: 0, alt_settings: Vec::new() }
    }

    /// The endpoint's type in the current configuration and alt settings.
    pub fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        if number == 0 {
            return Some(TransferType::Control);
        }
        let address = match direction {
            Direction::In => number | 0x80,
            Direction::Out => number,
        };
        let alt_of = |interface| self.alt_settings.iter().find(|(i, _)| *i == interface).map_or(0, |(_, a)| *a);
        self.configurations
            .iter()
            .find(|c| self.value != 0 && c.value == self.value)?
            .active_endpoints(alt_of)
            .find(|e| e.address == address)
            .map(|e| e.transfer_type)
    }

    /// What a finished standard request changes (SET_CONFIGURATION, SET_INTERFACE).
    fn apply(&mut self, setup: &SetupPacket) {
        match (setup.request_type, setup.request) {
            (0x00, request::SET_CONFIGURATION) => {
                self.value = (setup.value & 0xff) as u8;
                self.alt_settings.clear();
            }
            (0x01, request::SET_INTERFACE) => {
                let (interface, alt) = ((setup.index & 0xff) as u8, (setup.value & 0xff) as u8);
                self.alt_settings.retain(|(i, _)| *i != interface);
                self.alt_settings.push((interface, alt));
            }
            _ => {}
        }
    }

    fn unconfigure(&mut self) {
        self.value = 0;
        self.alt_settings.clear();
    }
}

/// The server's side of one device process's connection.
#[derive(Debug)]
pub struct Core {
    pending: VecDeque<Pending>,
    next_id: u32,
    outbox: VecDeque<Bytes>,
    ready: CompletionQueue,
    reply_timeout: Duration,
    layout: Layout,
    gone: Option<Gone>,
}

impl Core {
    pub fn new(reply_timeout: Duration) -> Self {
        Self {
            pending: VecDeque::new(),
            next_id: 1,
            outbox: VecDeque::new(),
            ready: CompletionQueue::new(),
            reply_timeout,
            layout: Layout::default(),
            gone: None,
        }
    }

    /// The device's configurations, once read (the endpoints URBs may name).
    pub fn set_layout(&mut self, layout: Layout) {
        self.layout = layout;
    }

    pub fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        self.layout.endpoint_type(direction, number)
    }

    /// Starts a URB: a request frame for the device process, or a completion
    /// at once when it cannot be sent (no such endpoint, isochronous, gone).
    pub fn submit(&mut self, urb: Urb, now: Instant) {
        if self.gone.is_some() {
            return self.ready.push(urb.complete_with(Status::ESHUTDOWN));
        }
        let kind = match self.layout.endpoint_type(urb.direction, urb.endpoint) {
            Some(TransferType::Control) if urb.endpoint == 0 => Kind::Control(SetupPacket::parse(&urb.setup)),
            Some(TransferType::Bulk | TransferType::Interrupt) if urb.is_in() => Kind::In,
            Some(TransferType::Bulk | TransferType::Interrupt) => Kind::Out,
            // Not carried by this protocol revision (docs/protocol.md §9.3).
            Some(TransferType::Isochronous | TransferType::Control) => {
                return self.ready.push(urb.complete_with(Status::EXDEV))
            }
            None => return self.ready.push(urb.complete_with(Status::EPIPE)),
        };
        if let Kind::Control(setup) = kind {
            if setup.request_type == 0x23 && setup.request == request::SET_FEATURE && setup.value == feature::PORT_RESET
            {
                // The port reset usbip-win clients send; the Linux stub resets the device.
                self.reset();
                return self.ready.push(urb.complete_out());
            }
        }
        if self.pending.len() >= MAX_PENDING {
            return self.ready.push(urb.complete_with(ENOMEM));
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let message = match kind {
            Kind::Control(_) => Message::Setup { id, setup: urb.setup, data: urb.data.clone() },
            Kind::In => Message::In { id, endpoint: urb.endpoint, length: urb.length },
            Kind::Out => Message::Out { id, endpoint: urb.endpoint, data: urb.data.clone() },
        };
        trace!(id, seqnum = urb.seqnum, ?kind, "request to the device process");
        self.send(&message);
        self.pending.push_back(Pending { id, urb, kind, deadline: Some(now + self.reply_timeout) });
    }

    /// Ends the URB with `seqnum` now (`-ECONNRESET`) and tells the device
    /// process to drop it. A URB already finished is left alone.
    pub fn cancel(&mut self, seqnum: u32) {
        let Some(at) = self.pending.iter().position(|p| p.urb.seqnum == seqnum) else { return };
        if let Some(pending) = self.pending.remove(at) {
            self.send(&Message::Cancel { id: pending.id });
            self.ready.push(pending.urb.complete_with(Status::ECONNRESET));
        }
    }

    /// A USB reset: every URB is abandoned (no completions, collected or
    /// not), the device unconfigured, and the device process told.
    pub fn reset(&mut self) {
        self.pending.clear();
        self.ready.clear();
        self.layout.unconfigure();
        if self.gone.is_none() {
            self.send(&Message::Reset);
        }
    }

    /// A frame from the device process. An error means it must be dropped
    /// ([`close`](Self::close) with it).
    pub fn handle(&mut self, message: Message) -> Result<(), ProtocolError> {
        let id = match &message {
            Message::Data { id, .. } | Message::Ack { id } | Message::Nak { id } | Message::Stall { id } => *id,
            other => return Err(ProtocolError::Unexpected(other.kind())),
        };
        let Some(at) = self.pending.iter().position(|p| p.id == id) else {
            // Issued within the last 2^31 ids: cancelled or abandoned, and answered meanwhile.
            let age = self.next_id.wrapping_sub(id);
            if id != 0 && (1..=1 << 31).contains(&age) {
                trace!(id, "answer for a request no longer pending; ignored");
                return Ok(());
            }
            return Err(ProtocolError::NeverIssued(id));
        };
        if let Message::Nak { .. } = message {
            let pending = &mut self.pending[at];
            if !matches!(pending.kind, Kind::Control(_)) {
                pending.deadline = None;
            }
            return Ok(());
        }
        if matches!(message, Message::Data { .. }) && !self.pending[at].urb.is_in() {
            // Checked before it leaves the table, so closing still completes its URB.
            return Err(ProtocolError::DataForOut(id));
        }
        let queue = self.pending[at].queue();
        if let Some(oldest) = self.pending.iter().find(|p| p.queue() == queue).filter(|p| p.id != id) {
            return Err(ProtocolError::OutOfOrder { id, oldest: oldest.id });
        }
        let Some(pending) = self.pending.remove(at) else { return Ok(()) };
        let completion = self.finish(pending, message);
        self.ready.push(completion);
        Ok(())
    }

    /// The completion a final answer makes (a DATA for an OUT request is refused before).
    fn finish(&mut self, pending: Pending, message: Message) -> Completion {
        let urb = &pending.urb;
        match (message, pending.kind) {
            (Message::Stall { .. }, _) => urb.complete_with(Status::EPIPE),
            (Message::Data { data, .. }, Kind::In) if data.len() > urb.length as usize => {
                // Babble: more than the buffer holds, as a host controller reports it.
                let mut done = urb.complete_in(data);
                done.status = Status::EOVERFLOW;
                done
            }
            (Message::Data { data, .. }, _) => urb.complete_in(data),
            (_, Kind::Control(setup)) => {
                self.layout.apply(&setup);
                if urb.is_in() {
                    urb.complete_in(Bytes::new())
                } else {
                    urb.complete_out()
                }
            }
            (_, Kind::In) => urb.complete_in(Bytes::new()),
            (_, Kind::Out) => urb.complete_out(),
        }
    }

    /// When the oldest unanswered request's answer is due, if one is.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.pending.iter().filter_map(|p| p.deadline).min()
    }

    /// Past a deadline, the device process is taken as hung and dropped.
    pub fn handle_timeout(&mut self, now: Instant) {
        let late = self.pending.iter().find(|p| p.deadline.is_some_and(|d| d <= now)).map(|p| p.id);
        if let Some(id) = late {
            self.close(Gone::TimedOut { id, after: self.reply_timeout });
        }
    }

    /// The device process is gone: every URB ends now (`-ETIMEDOUT` for the
    /// one it left unanswered, `-ESHUTDOWN` for the rest) and so do later ones.
    pub fn close(&mut self, why: Gone) {
        if self.gone.is_some() {
            return;
        }
        debug!(%why, pending = self.pending.len(), "device process gone");
        let late = match &why {
            Gone::TimedOut { id, .. } => Some(*id),
            _ => None,
        };
        for pending in std::mem::take(&mut self.pending) {
            let status = if Some(pending.id) == late { Status::ETIMEDOUT } else { Status::ESHUTDOWN };
            self.ready.push(pending.urb.complete_with(status));
        }
        self.outbox.clear();
        self.gone = Some(why);
    }

    pub fn gone(&self) -> Option<&Gone> {
        self.gone.as_ref()
    }

    /// The next piece of bytes to write to the device process.
    pub fn poll_transmit(&mut self) -> Option<Bytes> {
        self.outbox.pop_front()
    }

    pub fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        self.ready.poll_pop(cx)
    }

    /// How many requests wait for the device process.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Queues a frame: its head, then its payload as its own slice (OUT data is not copied).
    pub(crate) fn send(&mut self, message: &Message) {
        let mut head = BytesMut::with_capacity(16);
        message.encode_head(&mut head);
        self.outbox.push_back(head.freeze());
        let payload = message.payload();
        if !payload.is_empty() {
            self.outbox.push_back(payload);
        }
    }
}

#[cfg(test)]
mod tests;
