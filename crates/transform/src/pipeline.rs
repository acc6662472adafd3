//! The negotiated transforms: what each side may ask for ([`TransformSpec`],
//! parsed from and written to the negotiation's text), which end a pipeline
//! is on ([`Side`]), and the [`Pipeline`] that applies the agreed transforms
//! in order on send and in reverse on receive.
//!
//! It sits above the frame and the transforms it builds, and below the stream
//! that drives it. It is not for framing bytes or for any I/O.

use std::io;
use std::time::{Duration, Instant};

use crate::compress::{Compression, Lz4, Zstd};
use crate::frame::{Frame, Transform, MAX_FRAME_PAYLOAD};
use crate::jitter::JitterBuffer;

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
    use bytes::BytesMut;

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
