//! Compression of frame payloads (zstd or lz4). A frame is compressed only
//! when that makes it clearly smaller; otherwise it travels as it was. Large
//! frames are probed by their first 4 KiB, and a stream whose probes keep
//! failing (random or already-compressed data) is probed less and less often,
//! so incompressible data costs almost nothing beyond the framing.

use std::io;

use bytes::BytesMut;

use crate::frame::{Frame, Transform, MAX_FRAME_PAYLOAD};

/// Frames smaller than this are not worth compressing.
const MIN_COMPRESS: usize = 256;
/// Bytes tried first on a large frame.
const PROBE: usize = 4096;
/// After this many incompressible frames in a row, frames go out raw untried
/// for a while: 1, 2, 4 … up to this many frames between attempts.
const MAX_SKIP: u32 = 32;

/// A compression algorithm. Implementations keep their contexts between frames.
pub trait Codec: Send + 'static {
    const NAME: &'static str;
    const FLAG: u8;
    fn compress(&mut self, input: &[u8]) -> Option<Vec<u8>>;
    fn decompress(&mut self, input: &[u8], max: usize) -> io::Result<Vec<u8>>;
}

fn invalid(error: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, error.to_string())
}

/// zstd at level 1: the best ratio per CPU cycle for bulk USB data. The
/// contexts are made once (making one costs more than compressing 4 KiB).
///
/// Making a context fails only when memory is exhausted (level 1 is always valid). A context
/// that could not be made is tried again when a frame needs it: until then frames are sent
/// uncompressed (as any frame that would not shrink is), and a compressed frame received ends
/// the stream with an error that says why.
pub struct Zstd {
    compressor: Option<zstd::bulk::Compressor<'static>>,
    decompressor: Option<zstd::bulk::Decompressor<'static>>,
}

impl Default for Zstd {
    fn default() -> Self {
        Self { compressor: zstd::bulk::Compressor::new(1).ok(), decompressor: zstd::bulk::Decompressor::new().ok() }
    }
}

impl Codec for Zstd {
    const NAME: &'static str = "zstd";
    const FLAG: u8 = 0x01;

    fn compress(&mut self, input: &[u8]) -> Option<Vec<u8>> {
        let compressor = match self.compressor.take() {
            Some(compressor) => compressor,
            None => zstd::bulk::Compressor::new(1).ok()?,
        };
        self.compressor.insert(compressor).compress(input).ok()
    }

    fn decompress(&mut self, input: &[u8], max: usize) -> io::Result<Vec<u8>> {
        // Frames we send state their size: allocate exactly that, after checking it.
        let size = zstd::zstd_safe::get_frame_content_size(input)
            .map_err(invalid)?
            .ok_or_else(|| invalid("zstd frame without its size"))?;
        if size > max as u64 {
            return Err(invalid("zstd frame too large"));
        }
        let decompressor = match self.decompressor.take() {
            Some(decompressor) => decompressor,
            None => zstd::bulk::Decompressor::new().map_err(|error| {
                io::Error::new(
                    error.kind(),
                    format!("cannot make a zstd decompression context (out of memory?): {error}"),
                )
            })?,
        };
        let mut plain = Vec::with_capacity(size as usize);
        self.decompressor.insert(decompressor).decompress_to_buffer(input, &mut plain)?;
        if plain.len() as u64 != size {
            return Err(invalid("zstd frame shorter than it said"));
        }
        Ok(plain)
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
            return Err(invalid("lz4 frame too large"));
        }
        lz4_flex::block::decompress_size_prepended(input).map_err(invalid)
    }
}

/// The compression transform around a codec.
pub struct Compression<C> {
    codec: C,
    /// Frames still to send untried, and the pause after the next failure.
    skip_left: u32,
    next_skip: u32,
}

impl<C: Codec> Compression<C> {
    pub fn new(codec: C) -> Self {
        Self { codec, skip_left: 0, next_skip: 1 }
    }

    /// Compresses `payload` if that saves at least 1/16 of it.
    fn smaller(&mut self, payload: &[u8]) -> Option<Vec<u8>> {
        // A large frame is probed by its first 4 KiB: incompressible data then
        // costs a small attempt, not a full one.
        if payload.len() > 4 * PROBE {
            let probe = &payload[..PROBE];
            if self.codec.compress(probe).is_none_or(|c| c.len() + PROBE / 16 >= PROBE) {
                return None;
            }
        }
        self.codec.compress(payload).filter(|c| c.len() + payload.len() / 16 < payload.len())
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
        if self.skip_left > 0 {
            self.skip_left -= 1;
            return;
        }
        match self.smaller(&frame.payload) {
            Some(compressed) => {
                frame.payload = BytesMut::from(&compressed[..]);
                frame.flags |= C::FLAG;
                self.next_skip = 1;
            }
            None => {
                self.skip_left = self.next_skip;
                self.next_skip = (self.next_skip * 2).min(MAX_SKIP);
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
            let (sent, back) = round_trip(Zstd::default(), &data);
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
            let (sent, _) = round_trip(Zstd::default(), &data);
            prop_assert!(sent.flags & Zstd::FLAG != 0 && sent.payload.len() < len / 10);
        }
    }

    /// A codec that counts its compression attempts.
    struct Counting {
        inner: Zstd,
        attempts: usize,
    }

    impl Codec for Counting {
        const NAME: &'static str = "counting";
        const FLAG: u8 = Zstd::FLAG;
        fn compress(&mut self, input: &[u8]) -> Option<Vec<u8>> {
            self.attempts += 1;
            self.inner.compress(input)
        }
        fn decompress(&mut self, input: &[u8], max: usize) -> io::Result<Vec<u8>> {
            self.inner.decompress(input, max)
        }
    }

    #[test]
    fn incompressible_streams_are_tried_less_often_and_compressible_data_is_caught_again() {
        let mut transform = Compression::new(Counting { inner: Zstd::default(), attempts: 0 });
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut noise = || {
            let bytes: Vec<u8> = (0..65536)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            Frame { flags: 0, sent_at_us: 0, payload: BytesMut::from(&bytes[..]) }
        };
        for _ in 0..200 {
            let mut frame = noise();
            transform.encode(&mut frame);
            assert_eq!(frame.flags, 0, "noise is sent raw");
        }
        // Probes after 1, 2, 4 … 32 skipped frames: 6 to reach the cap, then one per 33 frames.
        let attempts = transform.codec.attempts;
        assert!((6..=12).contains(&attempts), "{attempts} probes for 200 incompressible frames");
        // Compressible data again: caught within one pause, then every frame is compressed.
        let zeros = || Frame { flags: 0, sent_at_us: 0, payload: BytesMut::zeroed(65536) };
        let first = (0..=MAX_SKIP as usize)
            .position(|_| {
                let mut frame = zeros();
                transform.encode(&mut frame);
                frame.flags != 0
            })
            .expect("compressible data compressed again within a pause");
        assert!(first <= MAX_SKIP as usize);
        for _ in 0..10 {
            let mut frame = zeros();
            transform.encode(&mut frame);
            assert_ne!(frame.flags, 0);
            transform.decode(&mut frame).unwrap();
            assert_eq!(frame.payload, BytesMut::zeroed(65536));
        }
    }

    #[test]
    fn a_bomb_is_refused_before_allocating() {
        let mut transform = Compression::new(Lz4);
        let mut payload = BytesMut::from(&u32::MAX.to_le_bytes()[..]);
        payload.extend_from_slice(&[0u8; 16]);
        let mut frame = Frame { flags: Lz4::FLAG, sent_at_us: 0, payload };
        assert!(transform.decode(&mut frame).is_err());
        let mut zstd = Compression::new(Zstd::default());
        let huge = zstd::bulk::compress(&vec![0u8; MAX_FRAME_PAYLOAD + 1], 1).unwrap();
        let mut frame = Frame { flags: Zstd::FLAG, sent_at_us: 0, payload: BytesMut::from(&huge[..]) };
        assert!(zstd.decode(&mut frame).is_err(), "more than a frame's worth after decompression");
    }
}
