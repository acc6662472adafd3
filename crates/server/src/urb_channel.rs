//! The URB phase of one imported device: CMD_SUBMIT / CMD_UNLINK in,
//! RET_SUBMIT / RET_UNLINK out.
//!
//! A single hand-written poll loop reads commands, submits them to the device,
//! collects completions in whatever order the device finishes them, and writes
//! replies — so a long-pending interrupt IN never holds up ep0 or a bulk
//! stream, and nothing is shared with other connections.
//!
//! Unlink, following the kernel stub (strategy A in PROTOCOL.md §4.2): if the
//! target is still in flight, the device is asked to cancel it; when it comes
//! back cancelled, only RET_UNLINK(-ECONNRESET) is sent (vhci gives the URB
//! back on it). If it completed anyway, its RET_SUBMIT goes first and then
//! RET_UNLINK(0), so no data is lost and vhci never sees a RET_SUBMIT for a URB
//! it already gave back. An unlink for a URB not in flight gets RET_UNLINK(0)
//! at once — any RET_SUBMIT for it is already ahead of it in the stream.
//!
//! Memory follows the connection's [`Budget`]: commands are taken (and the
//! socket read) only while URBs in flight and reply bytes waiting are under
//! budget; a submit that would overdraw the in-flight bytes waits, decoded,
//! until completions make room; completions are collected only while the
//! reply queue is under budget. A peer that stops reading its replies thus
//! stops being read, whatever it sends.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::AsyncWrite;
use tokio::sync::watch;
use tokio_util::io::poll_read_buf;
use tracing::{trace, warn};
use usbwire_device::{Completion, Device, TransferType, Urb};
use usbwire_proto::urb::{self, ClientMessage, CmdSubmit, RetUnlink};
use usbwire_proto::{Budget, DecodeError, Limits, SeqnumMap, Status};
use usbwire_transport::PeerStream;

use crate::registry::Lease;
use crate::write_queue::WriteQueue;
use crate::ServerConfig;

/// Read at least this much at a time.
const READ_CHUNK: usize = 256 * 1024;

/// How a URB channel ended without a protocol error.
#[derive(Debug)]
pub(crate) enum End {
    ClientClosed,
    Shutdown,
    /// The device was unplugged; every URB in flight has been answered.
    DeviceGone,
    /// The export was withdrawn (`usbwire unbind`) while imported.
    Withdrawn,
}

/// Why a URB channel was closed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ChannelError {
    #[error("malformed message: {0}")]
    Decode(#[from] DecodeError),
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    #[error("devid {got:#x} does not match the imported device ({expected:#x})")]
    DevidMismatch { got: u32, expected: u32 },
    #[error("seqnum {0} is already in flight")]
    DuplicateSeqnum(u32),
}

pub(crate) async fn run(
    stream: PeerStream,
    leftover: BytesMut,
    lease: &mut Lease,
    config: &ServerConfig,
    mut stop: watch::Receiver<bool>,
) -> Result<End, ChannelError> {
    let mut channel = Channel {
        devid: lease.record().devid(),
        stream,
        unflushed: false,
        inbuf: leftover,
        out: WriteQueue::default(),
        in_flight: InFlight::default(),
        in_flight_bytes: 0,
        waiting_submit: None,
        limits: config.limits.clone(),
        budget: config.budget.clone(),
    };
    let device = lease.device();
    tokio::select! {
        result = std::future::poll_fn(|cx| channel.poll_drive(cx, device)) => result,
        () = crate::stopped(&mut stop) => Ok(End::Shutdown),
    }
}

/// A URB handed to the device and not yet completed.
struct InFlightUrb {
    /// Its `transfer_buffer_length`, counted against the in-flight budget.
    length: usize,
    /// The seqnum of a CMD_UNLINK aimed at it, if any.
    unlink: Option<u32>,
}

type InFlight = SeqnumMap<InFlightUrb>;

struct Channel {
    devid: u32,
    stream: PeerStream,
    /// Written since the last flush (TLS buffers records until flushed).
    unflushed: bool,
    inbuf: BytesMut,
    out: WriteQueue,
    in_flight: InFlight,
    /// `transfer_buffer_length` summed over `in_flight`.
    in_flight_bytes: usize,
    /// A decoded submit the in-flight byte budget had no room for yet.
    waiting_submit: Option<CmdSubmit>,
    limits: Limits,
    budget: Budget,
}

impl Channel {
    fn poll_drive(&mut self, cx: &mut Context<'_>, device: &mut dyn Device) -> Poll<Result<End, ChannelError>> {
        loop {
            let mut progressed = false;

            // Commands: decode what is buffered, then read more while under budget.
            progressed |= self.handle_buffered(device)?;
            if self.takes_commands() {
                self.reserve_for_next(device)?;
                match poll_read_buf(Pin::new(&mut self.stream), cx, &mut self.inbuf) {
                    Poll::Ready(Ok(0)) => return Poll::Ready(Ok(End::ClientClosed)),
                    Poll::Ready(Ok(_)) => {
                        progressed = true;
                        self.handle_buffered(device)?;
                    }
                    Poll::Ready(Err(error)) if is_disconnect(&error) => return Poll::Ready(Ok(End::ClientClosed)),
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error.into())),
                    Poll::Pending => {}
                }
            }

            // Completions, in the order the device finishes them.
            while self.out.queued() < self.budget.queued_reply_bytes {
                match device.poll_complete(cx) {
                    Poll::Ready(done) => {
                        self.complete(done);
                        progressed = true;
                    }
                    Poll::Pending => break,
                }
            }

            // Replies.
            if !self.out.is_empty() {
                let before = self.out.queued();
                match self.out.poll_flush(cx, &mut self.stream) {
                    Poll::Ready(Err(error)) if is_disconnect(&error) => return Poll::Ready(Ok(End::ClientClosed)),
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error.into())),
                    Poll::Ready(Ok(())) | Poll::Pending => {
                        let wrote = self.out.queued() != before;
                        progressed |= wrote;
                        self.unflushed |= wrote;
                    }
                }
            }
            if self.unflushed && self.out.is_empty() {
                match Pin::new(&mut self.stream).poll_flush(cx) {
                    Poll::Ready(Ok(())) => self.unflushed = false,
                    Poll::Ready(Err(error)) if is_disconnect(&error) => return Poll::Ready(Ok(End::ClientClosed)),
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error.into())),
                    Poll::Pending => {}
                }
            }

            if device.is_gone() && self.in_flight.is_empty() && self.out.is_empty() && !self.unflushed {
                return Poll::Ready(Ok(End::DeviceGone));
            }
            if !progressed {
                return Poll::Pending;
            }
        }
    }

    /// Makes room for the whole next message, so a large OUT payload is read
    /// into one buffer (and handed to the device without a copy).
    fn reserve_for_next(&mut self, device: &dyn Device) -> Result<(), ChannelError> {
        let next = urb::command_frame_len(&self.inbuf, &self.limits, |d, ep| is_iso(device, d, ep))?;
        let wanted = next.unwrap_or(urb::HEADER_LEN).saturating_sub(self.inbuf.len()).max(READ_CHUNK);
        self.inbuf.reserve(wanted);
        Ok(())
    }

    /// Whether another command may be taken: URBs in flight and replies waiting
    /// are under budget and no submit is waiting for in-flight room.
    fn takes_commands(&self) -> bool {
        self.waiting_submit.is_none()
            && self.in_flight.len() < self.budget.in_flight_urbs
            && self.out.queued() < self.budget.queued_reply_bytes
    }

    fn handle_buffered(&mut self, device: &mut dyn Device) -> Result<bool, ChannelError> {
        let mut handled = false;
        if let Some(submit) = self.waiting_submit.take() {
            if !self.budget.admits(self.in_flight_bytes, submit.transfer_buffer_length as usize) {
                self.waiting_submit = Some(submit);
                return Ok(false);
            }
            self.submit(submit, device);
            handled = true;
        }
        while self.takes_commands() {
            let decoded = urb::decode_command(&mut self.inbuf, &self.limits, |d, ep| is_iso(device, d, ep))?;
            let Some(message) = decoded else { break };
            handled = true;
            match message {
                ClientMessage::Submit(submit) => {
                    self.check_devid(submit.devid)?;
                    if self.in_flight.contains_key(submit.seqnum) {
                        return Err(ChannelError::DuplicateSeqnum(submit.seqnum));
                    }
                    if self.budget.admits(self.in_flight_bytes, submit.transfer_buffer_length as usize) {
                        self.submit(submit, device);
                    } else {
                        trace!(
                            seqnum = submit.seqnum,
                            in_flight_bytes = self.in_flight_bytes,
                            "submit waits for in-flight room"
                        );
                        self.waiting_submit = Some(submit);
                    }
                }
                ClientMessage::Unlink(unlink) => {
                    self.check_devid(unlink.devid)?;
                    trace!(seqnum = unlink.seqnum, target = unlink.unlink_seqnum, "unlink");
                    match self.in_flight.get_mut(unlink.unlink_seqnum) {
                        Some(pending) => {
                            pending.unlink = Some(unlink.seqnum);
                            device.cancel(unlink.unlink_seqnum);
                        }
                        None => self.out.push_ret_unlink(&RetUnlink { seqnum: unlink.seqnum, status: Status::OK }),
                    }
                }
            }
        }
        Ok(handled)
    }

    fn submit(&mut self, submit: CmdSubmit, device: &mut dyn Device) {
        trace!(seqnum = submit.seqnum, ep = submit.ep, dir = ?submit.direction, len = submit.transfer_buffer_length, "submit");
        let length = submit.transfer_buffer_length as usize;
        self.in_flight.insert(submit.seqnum, InFlightUrb { length, unlink: None });
        self.in_flight_bytes += length;
        device.submit(Urb::from_submit(submit));
    }

    fn complete(&mut self, done: Completion) {
        let Some(urb) = self.in_flight.remove(done.seqnum) else {
            warn!(seqnum = done.seqnum, "device completed a URB that is not in flight; dropped");
            return;
        };
        self.in_flight_bytes -= urb.length;
        trace!(seqnum = done.seqnum, status = ?done.status, len = done.actual_length, "complete");
        match urb.unlink {
            Some(unlink_seqnum) if done.status == Status::ECONNRESET => {
                self.out.push_ret_unlink(&RetUnlink { seqnum: unlink_seqnum, status: Status::ECONNRESET });
            }
            Some(unlink_seqnum) => {
                self.out.push_ret_submit(&done.into_ret_submit());
                self.out.push_ret_unlink(&RetUnlink { seqnum: unlink_seqnum, status: Status::OK });
            }
            None => self.out.push_ret_submit(&done.into_ret_submit()),
        }
    }

    fn check_devid(&self, devid: u32) -> Result<(), ChannelError> {
        // The kernel stub tears the connection down on a mismatch; so do we.
        if devid == self.devid {
            Ok(())
        } else {
            Err(ChannelError::DevidMismatch { got: devid, expected: self.devid })
        }
    }
}

fn is_iso(device: &dyn Device, direction: usbwire_proto::Direction, ep: u8) -> bool {
    device.endpoint_type(direction, ep) == Some(TransferType::Isochronous)
}

fn is_disconnect(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionAborted
    )
}
