//! [`TransformedStream`]: an `AsyncRead + AsyncWrite` over another stream
//! that carries frames through a [`Pipeline`]. Each write becomes one frame
//! (vectored writes are gathered into one); reads hand out decoded frames in
//! order, each once its release time has come (the jitter buffer's doing).
//!
//! Memory is bounded both ways: writes push back once [`OUT_HIGH_WATER`]
//! encoded bytes wait, and reading from the inner stream stops while the
//! decoded bytes not yet taken reach the decode budget, so a peer's
//! compression bomb costs at most the budget plus one frame
//! ([`MAX_FRAME_PAYLOAD`]) plus one partial frame of raw input.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::io::poll_read_buf;

use crate::frame::{Frame, FRAME_HEADER_LEN, MAX_FRAME_PAYLOAD};
use crate::pipeline::Pipeline;
use crate::timer::PreciseTimer;

/// Bytes asked of the inner stream per read, at least.
const READ_CHUNK: usize = 256 * 1024;
/// Encoded bytes held before `poll_write` pushes back.
const OUT_HIGH_WATER: usize = 4 * MAX_FRAME_PAYLOAD;
/// Decoded bytes held for the reader before reading stops, unless told otherwise.
const DEFAULT_DECODED_BUDGET: usize = 8 * MAX_FRAME_PAYLOAD;

/// Bytes before and after the transforms, both ways (shared with whoever asked).
#[derive(Debug, Default)]
pub struct TransformStats {
    pub plain_sent: AtomicU64,
    pub wire_sent: AtomicU64,
    pub wire_received: AtomicU64,
    pub plain_received: AtomicU64,
}

impl TransformStats {
    /// Plain bytes per wire byte, sent and received (1.0 when nothing moved).
    pub fn ratios(&self) -> (f64, f64) {
        let ratio = |plain: &AtomicU64, wire: &AtomicU64| {
            let wire = wire.load(Ordering::Relaxed);
            if wire == 0 {
                1.0
            } else {
                plain.load(Ordering::Relaxed) as f64 / wire as f64
            }
        };
        (ratio(&self.plain_sent, &self.wire_sent), ratio(&self.plain_received, &self.wire_received))
    }
}

pub struct TransformedStream<S> {
    inner: S,
    stats: Arc<TransformStats>,
    pipeline: Pipeline,
    epoch: Instant,
    /// Encoded frames (headers and payloads, uncopied) not yet written to `inner`.
    out: VecDeque<Bytes>,
    out_len: usize,
    /// Bytes read from `inner`, not yet a whole frame.
    raw: BytesMut,
    /// Decoded frames waiting for their release time.
    waiting: VecDeque<(Instant, Bytes)>,
    /// The frame being read out.
    current: Bytes,
    /// Bytes in `waiting` and `current`.
    decoded_held: usize,
    /// No frame is decoded (and nothing read) while `decoded_held` is at least this.
    decoded_budget: usize,
    /// Made on first use (it needs the runtime), kept for the stream's life.
    timer: Option<PreciseTimer>,
    inner_eof: bool,
}

impl<S> TransformedStream<S> {
    pub fn new(inner: S, pipeline: Pipeline) -> Self {
        Self {
            inner,
            stats: Arc::default(),
            pipeline,
            epoch: Instant::now(),
            out: VecDeque::new(),
            out_len: 0,
            raw: BytesMut::new(),
            waiting: VecDeque::new(),
            current: Bytes::new(),
            decoded_held: 0,
            decoded_budget: DEFAULT_DECODED_BUDGET,
            timer: None,
            inner_eof: false,
        }
    }

    /// Decoded bytes the reader may leave untaken before this stream stops
    /// reading from its peer (at least one frame is always decoded).
    pub fn with_decoded_budget(mut self, bytes: usize) -> Self {
        self.decoded_budget = bytes;
        self
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    pub fn transforms(&self) -> Vec<&'static str> {
        self.pipeline.names()
    }

    /// Byte counters, live for as long as the caller keeps them.
    pub fn stats(&self) -> Arc<TransformStats> {
        self.stats.clone()
    }

    fn encode(&mut self, payload: BytesMut) {
        let plain_len = payload.len();
        let mut frame = Frame { flags: 0, sent_at_us: self.epoch.elapsed().as_micros() as u64, payload };
        self.pipeline.encode(&mut frame);
        self.stats.plain_sent.fetch_add(plain_len as u64, Ordering::Relaxed);
        self.stats.wire_sent.fetch_add((FRAME_HEADER_LEN + frame.payload.len()) as u64, Ordering::Relaxed);
        self.out_len += FRAME_HEADER_LEN + frame.payload.len();
        self.out.push_back(Bytes::copy_from_slice(&frame.header()));
        self.out.push_back(frame.payload.freeze());
    }

    /// Whether decoding another frame stays within the decode budget.
    fn has_decode_room(&self) -> bool {
        self.decoded_held == 0 || self.decoded_held < self.decoded_budget
    }

    /// Parses whole frames in `raw` while the decode budget has room, decodes
    /// each and queues it with its release time.
    fn decode_available(&mut self) -> io::Result<()> {
        let arrived = Instant::now();
        while self.has_decode_room() {
            let Some(mut frame) = Frame::decode(&mut self.raw)? else { break };
            self.stats.wire_received.fetch_add((FRAME_HEADER_LEN + frame.payload.len()) as u64, Ordering::Relaxed);
            self.pipeline.decode(&mut frame)?;
            self.stats.plain_received.fetch_add(frame.payload.len() as u64, Ordering::Relaxed);
            let release = self.pipeline.release_at(&frame, arrived);
            self.decoded_held += frame.payload.len();
            self.waiting.push_back((release, frame.payload.freeze()));
        }
        Ok(())
    }
}

impl<S: AsyncWrite + Unpin> TransformedStream<S> {
    /// Writes encoded frames to `inner` until it would block or all are out.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.out_len > 0 {
            let slices: Vec<io::IoSlice<'_>> =
                self.out.iter().take(64).filter(|b| !b.is_empty()).map(|b| io::IoSlice::new(b)).collect();
            match Pin::new(&mut self.inner).poll_write_vectored(cx, &slices) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(mut n)) => {
                    self.out_len -= n;
                    // The writer took at most what was queued: the queue runs out no sooner than `n`.
                    while n > 0 {
                        let Some(front) = self.out.front_mut() else { break };
                        if front.len() <= n {
                            n -= front.len();
                            self.out.pop_front();
                        } else {
                            front.advance(n);
                            n = 0;
                        }
                    }
                    while self.out.front().is_some_and(Bytes::is_empty) {
                        self.out.pop_front();
                    }
                }
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for TransformedStream<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.current.is_empty() {
                let n = this.current.len().min(buf.remaining());
                buf.put_slice(&this.current.split_to(n));
                this.decoded_held -= n;
                return Poll::Ready(Ok(()));
            }
            // Frames that arrived while the budget was full.
            this.decode_available()?;
            // Take in whatever has arrived, so arrival times are when frames came,
            // until the decode budget is full: then the peer waits (backpressure).
            while !this.inner_eof && this.has_decode_room() {
                // Room for many frames per read (an empty BytesMut would read 64 bytes at a time).
                if this.raw.capacity() - this.raw.len() < READ_CHUNK / 4 {
                    this.raw.reserve(READ_CHUNK);
                }
                match poll_read_buf(Pin::new(&mut this.inner), cx, &mut this.raw) {
                    Poll::Ready(Ok(0)) => this.inner_eof = true,
                    Poll::Ready(Ok(_)) => this.decode_available()?,
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                    Poll::Pending => break,
                }
            }
            match this.waiting.pop_front() {
                Some((release, decoded)) if release <= Instant::now() => this.current = decoded,
                Some(held) => {
                    // Not its time yet: it stays first in line.
                    let release = held.0;
                    this.waiting.push_front(held);
                    let timer = this.timer.get_or_insert_with(PreciseTimer::new);
                    if timer.poll_until(cx, release).is_pending() {
                        return Poll::Pending;
                    }
                }
                None if this.inner_eof => {
                    return if this.raw.is_empty() {
                        Poll::Ready(Ok(()))
                    } else {
                        Poll::Ready(Err(io::Error::new(io::ErrorKind::UnexpectedEof, "stream ended inside a frame")))
                    };
                }
                None => return Poll::Pending,
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for TransformedStream<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.out_len >= OUT_HIGH_WATER {
            if let Poll::Ready(Err(error)) = this.poll_drain(cx) {
                return Poll::Ready(Err(error));
            }
            if this.out_len >= OUT_HIGH_WATER {
                return Poll::Pending;
            }
        }
        // Gather the slices into one frame (compression wants contiguous input anyway): the one copy.
        let total: usize = bufs.iter().map(|b| b.len()).sum::<usize>().min(MAX_FRAME_PAYLOAD);
        let mut gathered = BytesMut::with_capacity(total);
        for slice in bufs {
            let room = total - gathered.len();
            if room == 0 {
                break;
            }
            gathered.extend_from_slice(&slice[..slice.len().min(room)]);
        }
        this.encode(gathered);
        if let Poll::Ready(Err(error)) = this.poll_drain(cx) {
            return Poll::Ready(Err(error));
        }
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.poll_drain(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut this.inner).poll_flush(cx),
            other => other,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.poll_drain(cx) {
            Poll::Ready(Ok(())) => Pin::new(&mut this.inner).poll_shutdown(cx),
            other => other,
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for TransformedStream<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransformedStream").field("inner", &self.inner).field("transforms", &self.transforms()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::{Side, TransformSpec};
    use bytes::BufMut;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn pair(
        specs: &[TransformSpec],
    ) -> (TransformedStream<tokio::io::DuplexStream>, TransformedStream<tokio::io::DuplexStream>) {
        let (a, b) = tokio::io::duplex(1 << 20);
        (
            TransformedStream::new(a, Pipeline::new(specs, Side::Client)),
            TransformedStream::new(b, Pipeline::new(specs, Side::Server)),
        )
    }

    #[tokio::test]
    async fn bytes_come_out_as_they_went_in_both_ways() {
        for specs in [
            vec![],
            vec![TransformSpec::Zstd],
            vec![TransformSpec::Lz4, TransformSpec::Jitter(std::time::Duration::from_millis(5))],
        ] {
            let (mut client, mut server) = pair(&specs).await;
            let compressible = vec![0x5au8; 300_000];
            let random: Vec<u8> = (0..70_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
            let writer = async {
                server.write_all(&compressible).await.unwrap();
                server.write_all(&random).await.unwrap();
                server.flush().await.unwrap();
                server.shutdown().await.unwrap();
                server
            };
            let reader = async {
                let mut got = Vec::new();
                client.read_to_end(&mut got).await.unwrap();
                got
            };
            let (_server, got) = tokio::join!(writer, reader);
            assert_eq!(got.len(), compressible.len() + random.len(), "{specs:?}");
            assert_eq!(&got[..compressible.len()], &compressible[..]);
            assert_eq!(&got[compressible.len()..], &random[..]);
            client.write_all(b"and back").await.unwrap();
            client.flush().await.unwrap();
        }
    }

    proptest::proptest! {
        /// Whatever a peer sends, the decoder yields frames or an error, never a panic,
        /// and never a payload larger than a frame may be.
        #[test]
        fn arbitrary_bytes_never_panic(raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4096), pick in 0u8..3) {
            let specs = match pick {
                0 => vec![],
                1 => vec![TransformSpec::Zstd, TransformSpec::Jitter(std::time::Duration::from_millis(5))],
                _ => vec![TransformSpec::Lz4],
            };
            let (a, _b) = tokio::io::duplex(16);
            let mut stream = TransformedStream::new(a, Pipeline::new(&specs, Side::Client));
            stream.raw.extend_from_slice(&raw);
            let result = stream.decode_available();
            for (_, payload) in &stream.waiting {
                proptest::prop_assert!(payload.len() <= MAX_FRAME_PAYLOAD);
            }
            let _ = result;
        }
    }

    /// A compression bomb (frames of 1 MiB of zeros, ~100 bytes each on the wire)
    /// is decoded only as fast as the reader takes it: what is held stays within
    /// the decode budget plus one frame, and nothing is lost.
    #[tokio::test]
    async fn a_compression_bomb_is_decoded_only_as_fast_as_it_is_read() {
        const FRAMES: usize = 200;
        let (a, mut raw) = tokio::io::duplex(64 << 20);
        let budget = 2 * MAX_FRAME_PAYLOAD;
        let mut client =
            TransformedStream::new(a, Pipeline::new(&[TransformSpec::Zstd], Side::Client)).with_decoded_budget(budget);
        let mut sender = Pipeline::new(&[TransformSpec::Zstd], Side::Server);
        let mut wire = BytesMut::new();
        for _ in 0..FRAMES {
            let mut frame = Frame { flags: 0, sent_at_us: 0, payload: BytesMut::zeroed(MAX_FRAME_PAYLOAD) };
            sender.encode(&mut frame);
            wire.extend_from_slice(&frame.header());
            wire.extend_from_slice(&frame.payload);
        }
        assert!(wire.len() < FRAMES * 1024, "the bomb is small on the wire ({} bytes)", wire.len());
        raw.write_all(&wire).await.unwrap();
        raw.shutdown().await.unwrap();

        let mut byte = [0u8; 1];
        client.read_exact(&mut byte).await.unwrap();
        assert!(
            client.decoded_held <= budget + MAX_FRAME_PAYLOAD,
            "{} decoded bytes held against a budget of {budget}",
            client.decoded_held
        );
        assert!(client.raw.len() <= wire.len());

        let mut total = 1;
        let mut chunk = vec![0u8; 1 << 16];
        let mut peak = client.decoded_held;
        loop {
            let n = client.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            assert!(chunk[..n].iter().all(|&b| b == 0));
            total += n;
            peak = peak.max(client.decoded_held);
        }
        assert_eq!(total, FRAMES * MAX_FRAME_PAYLOAD, "every decoded byte reached the reader");
        assert!(peak <= budget + MAX_FRAME_PAYLOAD, "peak {peak} held against a budget of {budget}");
    }

    #[tokio::test]
    async fn altered_or_oversized_frames_are_errors_not_data() {
        let (a, mut raw) = tokio::io::duplex(1 << 16);
        let mut client = TransformedStream::new(a, Pipeline::new(&[TransformSpec::Zstd], Side::Client));
        // A frame claiming zstd whose payload is not zstd.
        let mut frame = BytesMut::new();
        frame.put_u32(4);
        frame.put_u8(0x01);
        frame.put_u64(0);
        frame.extend_from_slice(b"junk");
        raw.write_all(&frame).await.unwrap();
        let mut buf = [0u8; 16];
        assert!(client.read(&mut buf).await.is_err());

        let (a, mut raw) = tokio::io::duplex(1 << 16);
        let mut client = TransformedStream::new(a, Pipeline::new(&[], Side::Client));
        raw.write_all(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0]).await.unwrap();
        assert!(client.read(&mut buf).await.is_err(), "a 4 GiB frame is refused before allocating");
    }
}
