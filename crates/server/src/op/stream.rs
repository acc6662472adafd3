//! The OP phase's side of a connection, as mini-redis's `Connection`: reads
//! whole requests ([`OpStream::read_request`], with the admission deadline and
//! eviction) and writes whole replies ([`write_reply`]: encoded, written,
//! flushed — the one place that does).
//!
//! It knows nothing of what a request means; that is each request's file.

use std::future::Future;
use std::io;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::{debug, warn};
use usbwire_proto::op::{self, OpRequest};
use usbwire_proto::{DecodeError, Limits};
use usbwire_transport::transform::{Pipeline, Side, TransformSpec, TransformedStream};
use usbwire_transport::PeerStream;

use crate::admission::{Dropped, Ticket};
use crate::config::ServerConfig;

/// A connection in its OP phase: the stream, and what was read past the last request.
pub(crate) struct OpStream {
    stream: PeerStream,
    buf: BytesMut,
    limits: Limits,
    request_timeout: Duration,
}

impl OpStream {
    pub(crate) fn new(stream: PeerStream, config: &ServerConfig) -> Self {
        Self {
            stream,
            buf: BytesMut::with_capacity(256),
            limits: config.limits.clone(),
            request_timeout: config.admission.request_timeout,
        }
    }

    /// The next OP request, or `None` (logged, or counted while unauthenticated)
    /// when the client sent garbage, went quiet, hung up or was evicted.
    pub(crate) async fn read_request(&mut self, ticket: &Ticket) -> Option<OpRequest> {
        let deadline = self.request_timeout;
        let read = tokio::time::timeout(deadline, read_request(&mut self.stream, &mut self.buf, &self.limits));
        let outcome = tokio::select! {
            outcome = read => outcome,
            () = ticket.evicted() => return None,
        };
        match outcome {
            Err(_) => {
                if !ticket.dropped(Dropped::TimedOut) {
                    warn!("no request within {deadline:?}; closing");
                }
                None
            }
            Ok(Err(error)) => {
                if ticket.dropped(Dropped::Failed) {
                    debug!(%error, "invalid request; closing");
                } else {
                    warn!(%error, "invalid request; closing");
                }
                None
            }
            Ok(Ok(None)) => {
                debug!("closed before sending a request");
                None
            }
            Ok(Ok(Some(request))) => Some(request),
        }
    }

    /// Encodes a reply with `encode`, then writes and flushes it.
    pub(crate) fn reply(&mut self, encode: impl FnOnce(&mut BytesMut)) -> impl Future<Output = io::Result<()>> + '_ {
        write_reply(&mut self.stream, encode)
    }

    /// Whether the client sent more than its request (before an answer it must wait for).
    pub(crate) fn has_leftover(&self) -> bool {
        !self.buf.is_empty()
    }

    /// The same connection through the agreed stream transforms, decoding at
    /// most `decoded_budget` bytes ahead of what is read.
    pub(crate) fn transformed(self, specs: &[TransformSpec], decoded_budget: usize) -> Self {
        let stream = PeerStream::Transformed(Box::new(
            TransformedStream::new(self.stream, Pipeline::new(specs, Side::Server)).with_decoded_budget(decoded_budget),
        ));
        Self { stream, ..self }
    }

    /// The stream and the bytes read past the last request (the start of the
    /// URB phase, or of a resumed session's).
    pub(crate) fn into_parts(self) -> (PeerStream, BytesMut) {
        (self.stream, self.buf)
    }
}

/// Encodes a reply with `encode` (at once: what it borrows is not held across
/// the write), then writes and flushes it.
pub(crate) fn write_reply(
    stream: &mut PeerStream,
    encode: impl FnOnce(&mut BytesMut),
) -> impl Future<Output = io::Result<()>> + '_ {
    let mut reply = BytesMut::new();
    encode(&mut reply);
    async move {
        stream.write_all(&reply).await?;
        stream.flush().await
    }
}

async fn read_request(
    stream: &mut PeerStream,
    buf: &mut BytesMut,
    limits: &Limits,
) -> Result<Option<OpRequest>, DecodeError> {
    loop {
        if let Some(request) = op::decode_request(buf, limits)? {
            return Ok(Some(request));
        }
        match stream.read_buf(buf).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(_) => {}
        }
    }
}
