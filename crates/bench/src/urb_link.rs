//! How a Bulk-Only host's URBs reach the device (`storage::Host`): one URB
//! at a time, each completed before the next, as usb-storage runs them.
//! [`Wire`] writes plain USB/IP on a byte stream, as vhci-hcd does on its
//! socket (the kernel relay's end of a socket pair, for the relay and its
//! accelerators); a userspace [`Connection`] is a link too (what a usbredir
//! guest's driver goes through). Not for what the URBs say (`storage`).

use std::future::Future;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use usbwire_client::Connection;
use usbwire_proto::urb::{self, CmdSubmit, ServerMessage, SubmittedShape};
use usbwire_proto::{DecodeError, Direction, Limits};

/// Why a URB got no completion.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// Reading or writing the socket failed.
    #[error("the relay's socket failed: {0}")]
    Io(#[from] std::io::Error),
    /// The other end closed (the relay or the connection ended): nothing more can be sent.
    #[error("the relay closed the socket")]
    Closed,
    /// A reply that is not valid USB/IP, or that answers nothing outstanding.
    #[error("invalid reply: {0}")]
    Protocol(#[from] DecodeError),
    /// A `RET_UNLINK` came back, though the host never unlinks.
    #[error("a RET_UNLINK for seqnum {0}, which was never asked for")]
    UnexpectedUnlink(u32),
}

/// Where a Bulk-Only host's URBs go: one at a time, each completed before the next.
pub trait UrbLink {
    /// Sends one URB and waits for its completion.
    fn transfer(&mut self, urb: Urb) -> impl Future<Output = Result<Transfer, LinkError>>;
}

/// One URB a host sends.
#[derive(Clone, Debug)]
pub struct Urb {
    pub direction: Direction,
    pub ep: u8,
    pub length: u32,
    pub setup: [u8; 8],
    /// OUT: the data sent.
    pub data: Bytes,
}

/// One URB's completion.
#[derive(Clone, Debug)]
pub struct Transfer {
    pub status: i32,
    pub actual_length: u32,
    pub data: Bytes,
}

/// Plain USB/IP on a byte stream, as vhci-hcd writes it: a `CMD_SUBMIT`
/// out, then its `RET_SUBMIT` back.
#[derive(Debug)]
pub struct Wire<S> {
    io: S,
    devid: u32,
    /// The last seqnum used; vhci's count from 1.
    seqnum: u32,
    input: BytesMut,
    limits: Limits,
}

impl<S: AsyncRead + AsyncWrite + Unpin> UrbLink for Wire<S> {
    /// Its `CMD_SUBMIT` out, then its `RET_SUBMIT` back (nothing else is
    /// outstanding, so any other reply is the peer's mistake).
    async fn transfer(&mut self, urb: Urb) -> Result<Transfer, LinkError> {
        self.seqnum = self.seqnum.wrapping_add(1);
        let seqnum = self.seqnum;
        let Urb { direction, ep, length, setup, data } = urb;
        let submit = CmdSubmit::new(seqnum, self.devid, direction, ep, length, setup, data);
        self.io.write_all(&submit.header()).await?;
        if direction == Direction::Out && !submit.data.is_empty() {
            self.io.write_all(&submit.data).await?;
        }
        self.io.flush().await?;
        let shape = SubmittedShape { direction, transfer_buffer_length: length, iso_packets: None };
        loop {
            if let Some(message) =
                urb::decode_return(&mut self.input, &self.limits, |s| (s == seqnum).then_some(shape))?
            {
                return match message {
                    ServerMessage::Submit(ret) => {
                        Ok(Transfer { status: ret.status.0, actual_length: ret.actual_length, data: ret.data })
                    }
                    ServerMessage::Unlink(ret) => Err(LinkError::UnexpectedUnlink(ret.seqnum)),
                };
            }
            self.input.reserve(64 * 1024);
            if self.io.read_buf(&mut self.input).await? == 0 {
                return Err(LinkError::Closed);
            }
        }
    }
}

impl UrbLink for Connection {
    /// Through the connection's relay (and its accelerators, when the server
    /// agreed to them); a connection that went away is [`LinkError::Closed`].
    async fn transfer(&mut self, urb: Urb) -> Result<Transfer, LinkError> {
        let Urb { direction, ep, length, setup, data } = urb;
        let transfer = match (ep, direction) {
            (0, Direction::In) => usbwire_client::Transfer::control_in(setup),
            (0, Direction::Out) => usbwire_client::Transfer::control_out(setup, data),
            (_, Direction::In) => usbwire_client::Transfer::bulk_in(ep, length),
            (_, Direction::Out) => usbwire_client::Transfer::bulk_out(ep, data),
        };
        let ret = Self::transfer(self, transfer).await.map_err(|_| LinkError::Closed)?;
        Ok(Transfer { status: ret.status.0, actual_length: ret.actual_length, data: ret.data })
    }
}

impl<S> Wire<S> {
    /// A link for the device `devid` (what the import's record says) on `io`.
    pub fn new(io: S, devid: u32) -> Self {
        Self { io, devid, seqnum: 0, input: BytesMut::with_capacity(256 * 1024), limits: Limits::default() }
    }

    /// The stream back (to close it: dropping it detaches, as vhci's socket does).
    pub fn into_inner(self) -> S {
        self.io
    }
}
