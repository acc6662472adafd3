//! Compression of frame payloads (zstd or lz4). A frame is compressed only
//! when that makes it clearly smaller; otherwise it travels as it was, so
//! incompressible data (random, already compressed) costs one failed attempt
//! on small frames and nothing on the wire.

use std::io;

use bytes::BytesMut;

use crate::{Frame, Transform, MAX_FRAME_PAYLOAD};

/// Frames smaller than this are not worth compressing.
const MIN_COMPRESS: usize = 256;
/// Bytes tried first on a large frame.
const PROBE: usize = 4096;

/// A compression algorithm.
pub trait Codec: Send + 'static {
    const NAME: &'static str;
    const FLAG: u8;
    fn compress(&mut self, input: &[u8]) -> Option<Vec<u8>>;
    fn decompress(&mut self, input: &[u8], max: usize) -> io::Result<Vec<u8>>;
}

/// zstd at level 1: the best ratio per CPU cycle for bulk USB data.
pub struct Zstd;

impl Codec for Zstd {
    const NAME: &'static str = "zstd";
    const FLAG: u8 = 0x01;

    fn compress(&mut self, input: &[u8]) -> Option<Vec<u8>> {
        zstd::bulk::compress(input, 1).ok()
    }

    fn decompress(&mut self, input: &[u8], max: usize) -> io::Result<Vec<u8>> {
        zstd::bulk::decompress(input, max)
    }
}

/// lz4 (block format with the size prepended): the fastest, for slow CPUs.
pub struct Lz4;

impl Codec for Lz4 {
    const NAME: &'static str = "lz4";
    const FLAG: u8 = 0x02;

    fn compress(&mut self, input: &[u8]) -> Option<Vec<u8>> {
        Some(lz4_flex::block::compress_prepend_size(input))
    }

    fn decompress(&mut self, input: &[u8], max: usize) -> io::Result<Vec<u8>> {
        // The prepended size is the peer's claim: check it before allocating.
        let claimed = input.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize);
        if claimed.is_none_or(|n| n > max) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "lz4 frame too large"));
        }
        lz4_flex::block::decompress_size_prepended(input).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// The compression transform around a codec.
pub struct Compression<C> {
    codec: C,
}

impl<C: Codec> Compression<C> {
    pub fn new(codec: C) -> Self {
        Self { codec }
    }
}

impl<C: Codec> Transform for Compression<C> {
    fn name(&self) -> &'static str {
        C::NAME
    }

    fn flag(&self) -> u8 {
        C::FLAG
    }

    fn encode(&mut self, frame: &mut Frame) {
        if frame.payload.len() < MIN_COMPRESS {
            return;
        }
        // A large frame is probed by its first 4 KiB: incompressible data then
        // costs a small attempt per frame, not a full one.
        if frame.payload.len() > 4 * PROBE {
            let probe = &frame.payload[..PROBE];
            if self.codec.compress(probe).is_none_or(|c| c.len() + PROBE / 16 >= PROBE) {
                return;
            }
        }
        if let Some(compressed) = self.codec.compress(&frame.payload) {
            // Worth it only if it saves at least 1/16.
            if compressed.len() + frame.payload.len() / 16 < frame.payload.len() {
                frame.payload = BytesMut::from(&compressed[..]);
                frame.flags |= C::FLAG;
            }
        }
    }

    fn decode(&mut self, frame: &mut Frame) -> io::Result<()> {
        if frame.flags & C::FLAG != 0 {
            let plain = self.codec.decompress(&frame.payload, MAX_FRAME_PAYLOAD)?;
            frame.payload = BytesMut::from(&plain[..]);
            frame.flags &= !C::FLAG;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip<C: Codec>(codec: C, data: &[u8]) -> (Frame, Frame) {
        let mut transform = Compression::new(codec);
        let mut frame = Frame { flags: 0, sent_at_us: 7, payload: BytesMut::from(data) };
        transform.encode(&mut frame);
        let sent = frame.clone();
        transform.decode(&mut frame).unwrap();
        (sent, frame)
    }

    proptest! {
        #[test]
        fn zstd_round_trips_and_never_grows(data in proptest::collection::vec(any::<u8>(), 0..5000)) {
            let (sent, back) = round_trip(Zstd, &data);
            prop_assert_eq!(&back.payload[..], &data[..]);
            prop_assert!(sent.payload.len() <= data.len());
        }

        #[test]
        fn lz4_round_trips_and_never_grows(data in proptest::collection::vec(any::<u8>(), 0..5000)) {
            let (sent, back) = round_trip(Lz4, &data);
            prop_assert_eq!(&back.payload[..], &data[..]);
            prop_assert!(sent.payload.len() <= data.len());
        }

        #[test]
        fn compressible_runs_do_compress(byte in any::<u8>(), len in 1024usize..20_000) {
            let data = vec![byte; len];
            let (sent, _) = round_trip(Zstd, &data);
            prop_assert!(sent.flags & Zstd::FLAG != 0 && sent.payload.len() < len / 10);
        }
    }

    #[test]
    fn a_bomb_is_refused_before_allocating() {
        let mut transform = Compression::new(Lz4);
        let mut payload = BytesMut::from(&u32::MAX.to_le_bytes()[..]);
        payload.extend_from_slice(&[0u8; 16]);
        let mut frame = Frame { flags: Lz4::FLAG, sent_at_us: 0, payload };
        assert!(transform.decode(&mut frame).is_err());
        let mut zstd = Compression::new(Zstd);
        let huge = zstd::bulk::compress(&vec![0u8; MAX_FRAME_PAYLOAD + 1], 1).unwrap();
        let mut frame = Frame { flags: Zstd::FLAG, sent_at_us: 0, payload: BytesMut::from(&huge[..]) };
        assert!(zstd.decode(&mut frame).is_err(), "more than a frame's worth after decompression");
    }
}
