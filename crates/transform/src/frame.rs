//! One frame between the two transform pipelines: its header on the wire,
//! taking a whole frame off the front of the bytes read, the size bounds, and
//! the [`Transform`] trait every transformation module implements on frames.
//!
//! It sits below the transforms (`compress`, `jitter`), the `pipeline` that
//! chains them and the stream that reads and writes frames. It is not for
//! choosing or ordering transforms, nor for any I/O.

use std::io;
use std::time::Instant;

use bytes::{Buf, BytesMut};

/// Frame header length.
pub const FRAME_HEADER_LEN: usize = 13;
/// Largest payload a frame carries before transforms (writes are cut to this).
pub const MAX_FRAME_PAYLOAD: usize = 1 << 20;
/// Largest payload accepted from the wire (room for incompressible growth).
pub const MAX_WIRE_PAYLOAD: usize = MAX_FRAME_PAYLOAD + (MAX_FRAME_PAYLOAD / 64) + 1024;

/// One frame between the two transform pipelines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// One bit per transform that changed this frame (see [`Transform::flag`]).
    pub flags: u8,
    pub sent_at_us: u64,
    pub payload: BytesMut,
}

impl Frame {
    /// The header that goes before the payload on the wire.
    pub fn header(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut header = [0; FRAME_HEADER_LEN];
        header[..4].copy_from_slice(&(self.payload.len() as u32).to_be_bytes());
        header[4] = self.flags;
        header[5..].copy_from_slice(&self.sent_at_us.to_be_bytes());
        header
    }

    /// Takes the first whole frame off the front of `raw`. `Ok(None)` consumes nothing
    /// (more bytes are needed; `raw` has reserved room for them); a length beyond
    /// [`MAX_WIRE_PAYLOAD`] is an error before anything is allocated for it.
    pub fn decode(raw: &mut BytesMut) -> io::Result<Option<Self>> {
        let Some(&[l0, l1, l2, l3, flags, sent_at @ ..]) = raw.first_chunk::<FRAME_HEADER_LEN>() else {
            return Ok(None);
        };
        let len = u32::from_be_bytes([l0, l1, l2, l3]) as usize;
        if len > MAX_WIRE_PAYLOAD {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("transform frame of {len} bytes")));
        }
        if raw.len() < FRAME_HEADER_LEN + len {
            raw.reserve(FRAME_HEADER_LEN + len - raw.len());
            return Ok(None);
        }
        let sent_at_us = u64::from_be_bytes(sent_at);
        raw.advance(FRAME_HEADER_LEN);
        Ok(Some(Self { flags, sent_at_us, payload: raw.split_to(len) }))
    }
}

/// One transformation module.
pub trait Transform: Send + 'static {
    /// The name both sides negotiate (`zstd`, `lz4`, `jitter`).
    fn name(&self) -> &'static str;
    /// The flag bit this transform sets on frames it changed (0 if it never changes payloads).
    fn flag(&self) -> u8;
    /// Sending side: may rewrite the payload; sets `flag()` in `frame.flags` if it did.
    fn encode(&mut self, frame: &mut Frame);
    /// Receiving side: undoes `encode` when the frame carries `flag()`.
    fn decode(&mut self, frame: &mut Frame) -> io::Result<()>;
    /// Receiving side: the earliest time the frame may be handed on (default: when it arrived).
    fn release_at(&mut self, _frame: &Frame, arrived: Instant) -> Instant {
        arrived
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_decode_only_when_whole_and_round_trip() {
        let frame = Frame { flags: 0x01, sent_at_us: 0x0102_0304_0506_0708, payload: BytesMut::from(&b"payload"[..]) };
        let mut wire = BytesMut::from(&frame.header()[..]);
        assert_eq!(&wire[..], &[0, 0, 0, 7, 0x01, 1, 2, 3, 4, 5, 6, 7, 8]);
        wire.extend_from_slice(&frame.payload);
        wire.extend_from_slice(&[0, 0]);
        let mut partial = BytesMut::from(&wire[..FRAME_HEADER_LEN + 3]);
        assert_eq!(Frame::decode(&mut partial).unwrap(), None);
        assert_eq!(partial.len(), FRAME_HEADER_LEN + 3, "nothing consumed");
        assert_eq!(Frame::decode(&mut wire).unwrap(), Some(frame));
        assert_eq!(&wire[..], &[0, 0], "the next frame's bytes stay");
    }
}
