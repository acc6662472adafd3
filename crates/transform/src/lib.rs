//! Paired stream transforms (the transformation modules of Taylor & Pasquale's
//! networked device driver): after the OP-phase negotiation both sides wrap
//! the connection in a [`TransformedStream`], which cuts what is written into
//! frames, passes each frame through the agreed [`Transform`]s in order, and
//! on the far side undoes them in reverse order — automatically, from the
//! same list. A transform that would not gain anything on a frame leaves it
//! alone and says so in the frame's flags, so compression never costs more
//! than it saves.
//!
//! Frame on the wire: `u32 length | u8 flags | u64 sent_at_us | payload`
//! (big-endian; `sent_at_us` is microseconds on the sender's clock since the
//! stream began, which the jitter buffer uses to restore spacing).

mod compress;
mod framed;
mod jitter;
mod timer;

use std::io;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};

pub use compress::{Compression, Lz4, Zstd};
pub use framed::{TransformStats, TransformedStream};
pub use jitter::JitterBuffer;

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

/// Which end of the connection a pipeline is on: the jitter buffer only
/// re-times what the client receives (the device's completions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// What can be asked for in the negotiation, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransformSpec {
    Zstd,
    Lz4,
    /// Jitter buffer with this playout delay.
    Jitter(Duration),
}

impl TransformSpec {
    /// `zstd`, `lz4`, `jitter=MS`.
    pub fn parse(text: &str) -> Option<Self> {
        match text.split_once('=') {
            None if text == "zstd" => Some(Self::Zstd),
            None if text == "lz4" => Some(Self::Lz4),
            Some(("jitter", ms)) => {
                ms.parse::<u64>().ok().filter(|ms| *ms <= 10_000).map(|ms| Self::Jitter(Duration::from_millis(ms)))
            }
            _ => None,
        }
    }

    pub fn to_text(&self) -> String {
        match self {
            Self::Zstd => "zstd".into(),
            Self::Lz4 => "lz4".into(),
            Self::Jitter(playout) => format!("jitter={}", playout.as_millis()),
        }
    }

    /// A comma-separated list, as negotiated: unknown entries are dropped (the
    /// peer may be newer), and so is a second compressor.
    pub fn parse_list(text: &str) -> Vec<Self> {
        let mut specs: Vec<Self> = Vec::new();
        for spec in text.split(',').filter_map(|t| Self::parse(t.trim())) {
            let compressor = |s: &Self| matches!(s, Self::Zstd | Self::Lz4);
            if specs.iter().any(|s| std::mem::discriminant(s) == std::mem::discriminant(&spec))
                || (compressor(&spec) && specs.iter().any(compressor))
            {
                continue;
            }
            specs.push(spec);
        }
        specs
    }

    pub fn list_text(specs: &[Self]) -> String {
        specs.iter().map(Self::to_text).collect::<Vec<_>>().join(",")
    }

    fn build(&self, side: Side) -> Box<dyn Transform> {
        match self {
            Self::Zstd => Box::new(Compression::new(Zstd::default())),
            Self::Lz4 => Box::new(Compression::new(Lz4)),
            Self::Jitter(playout) => {
                Box::new(JitterBuffer::new(if side == Side::Client { Some(*playout) } else { None }))
            }
        }
    }
}

/// The agreed transforms, applied in order on send and in reverse on receive.
pub struct Pipeline {
    transforms: Vec<Box<dyn Transform>>,
}

impl Pipeline {
    pub fn new(specs: &[TransformSpec], side: Side) -> Self {
        Self { transforms: specs.iter().map(|s| s.build(side)).collect() }
    }

    pub fn encode(&mut self, frame: &mut Frame) {
        for transform in &mut self.transforms {
            transform.encode(frame);
        }
    }

    /// Undoes the sender's transforms. A frame that names a transform not negotiated, or
    /// decodes to more than a sender ever puts in one frame, is refused.
    pub fn decode(&mut self, frame: &mut Frame) -> io::Result<()> {
        let known = self.transforms.iter().fold(0, |flags, t| flags | t.flag());
        if frame.flags & !known != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("frame flags {:#x} not negotiated", frame.flags),
            ));
        }
        for transform in self.transforms.iter_mut().rev() {
            transform.decode(frame)?;
        }
        if frame.payload.len() > MAX_FRAME_PAYLOAD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("transform frame of {} bytes after decoding", frame.payload.len()),
            ));
        }
        Ok(())
    }

    pub fn release_at(&mut self, frame: &Frame, arrived: Instant) -> Instant {
        self.transforms.iter_mut().map(|t| t.release_at(frame, arrived)).max().unwrap_or(arrived)
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.transforms.iter().map(|t| t.name()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_negotiate() {
        assert_eq!(
            TransformSpec::parse_list("zstd, jitter=40,lz4,brotli,jitter=5"),
            vec![TransformSpec::Zstd, TransformSpec::Jitter(Duration::from_millis(40))]
        );
        assert_eq!(TransformSpec::list_text(&TransformSpec::parse_list("lz4,jitter=8")), "lz4,jitter=8");
        assert_eq!(TransformSpec::parse("jitter=99999"), None);
        assert!(TransformSpec::parse_list("").is_empty());
    }

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

    #[test]
    fn oversized_frames_are_refused_before_allocation() {
        let mut wire = BytesMut::from(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0][..]);
        assert!(Frame::decode(&mut wire).is_err());
        assert!(wire.capacity() < 1024);
        let mut pipeline = Pipeline::new(&[], Side::Client);
        let mut frame = Frame { flags: 0, sent_at_us: 0, payload: BytesMut::zeroed(MAX_FRAME_PAYLOAD + 1) };
        assert!(pipeline.decode(&mut frame).is_err(), "no sender puts more than MAX_FRAME_PAYLOAD in a frame");
    }

    #[test]
    fn pipeline_rejects_flags_that_were_not_negotiated() {
        let mut pipeline = Pipeline::new(&[TransformSpec::Lz4], Side::Server);
        let mut frame = Frame { flags: 0x80, sent_at_us: 0, payload: BytesMut::from(&b"x"[..]) };
        assert!(pipeline.decode(&mut frame).is_err());
    }
}
