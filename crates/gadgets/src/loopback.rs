//! A gadget-zero-like test device: a source that fills IN URBs with a known
//! pattern, a sink that swallows OUT URBs, a loop pair that hands OUT data
//! back on IN, a noise source (incompressible data, for compression
//! benchmarks) and a periodic interrupt endpoint that completes one URB per
//! 8 ms tick with the device's own timestamp (for jitter measurements).
//!
//! Benchmarks drive it, so the source and the sink never allocate or copy
//! per URB: the source slices one shared pattern buffer and the sink only
//! acknowledges. Loop data is kept as the OUT URBs' own `Bytes`.

use std::collections::VecDeque;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use bytes::Bytes;
use tracing::trace;
use usbwire_device::descriptor::{ConfigurationBuilder, DeviceDescriptor, EndpointSpec};
use usbwire_device::{Completion, CompletionQueue, DescriptorSet, Function, Speed, Status, Urb, VirtualDevice};
use usbwire_proto::Limits;

use crate::identity::{MANUFACTURER, VENDOR_ID};

/// The loopback device's product id.
pub const PRODUCT_ID: u16 = 0x0005;

/// Bulk IN: every URB completes at once with [`pattern_byte`] data.
pub const SOURCE_IN: u8 = 0x81;
/// Bulk OUT: every URB completes at once; the data is dropped.
pub const SINK_OUT: u8 = 0x02;
/// Bulk OUT: data is queued for [`LOOP_IN`].
pub const LOOP_OUT: u8 = 0x03;
/// Bulk IN: returns the data written to [`LOOP_OUT`], oldest first.
pub const LOOP_IN: u8 = 0x83;

/// Interrupt IN: one URB per [`TICK_INTERVAL`], carrying the tick number and
/// the device time in µs (two little-endian u64s).
pub const TICK_IN: u8 = 0x84;
/// Bulk IN: like [`SOURCE_IN`] but pseudo-random bytes that do not compress:
/// consecutive URBs get consecutive slices of a 16 MiB buffer, so not even a
/// compressor that sees several URBs at once finds repeats.
pub const NOISE_IN: u8 = 0x85;
/// Spacing of [`TICK_IN`] completions.
pub const TICK_INTERVAL: std::time::Duration = std::time::Duration::from_millis(8);

/// Loop data held before OUT URBs are left pending (a URB is always taken
/// when nothing is queued, however large).
pub const MAX_QUEUED: usize = 16 * 1024 * 1024;

/// Byte `i` of every source transfer.
pub fn pattern_byte(i: usize) -> u8 {
    (i % 63) as u8
}

/// The source pattern, built once per process at the largest transfer the
/// server accepts by default. Static, so handing out a slice of it per URB
/// costs no reference count (a `Bytes` over static data has none).
fn shared_pattern() -> &'static Bytes {
    static PATTERN: OnceLock<Bytes> = OnceLock::new();
    PATTERN.get_or_init(|| leak(pattern(Limits::default().max_transfer_length as usize)))
}

/// Keeps `data` for the rest of the process as static bytes.
fn leak(data: Vec<u8>) -> Bytes {
    Bytes::from_static(Box::leak(data.into_boxed_slice()))
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(pattern_byte).collect()
}

/// `len` bytes of xorshift noise from `seed` (not 0): incompressible, and the same in
/// every run. The noise source sends it; `usbwire bench --payload random` writes it.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut data = Vec::with_capacity(len + 8);
    while data.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        data.extend_from_slice(&state.to_le_bytes());
    }
    data.truncate(len);
    data
}

/// The noise source's bytes, built once.
fn shared_noise() -> &'static Bytes {
    static NOISE: OnceLock<Bytes> = OnceLock::new();
    NOISE.get_or_init(|| leak(noise(Limits::default().max_transfer_length as usize, 0x2545_f491_4f6c_dd1d)))
}

/// The loopback function (see [`loopback`]).
#[derive(Debug)]
pub struct Loopback {
    descriptors: DescriptorSet,
    pattern: Bytes,
    /// Loop data in arrival order; one OUT URB's payload per entry.
    queue: VecDeque<Bytes>,
    queued: usize,
    /// Loop OUT URBs waiting for room.
    parked_out: VecDeque<Urb>,
    /// Loop IN URBs waiting for data.
    waiting_in: VecDeque<Urb>,
    /// Tick URBs waiting for their tick, and the clock that paces them.
    waiting_ticks: VecDeque<Urb>,
    ticker: Option<tokio::time::Interval>,
    ticks: u64,
    born: tokio::time::Instant,
    /// Where the next noise URB starts in the noise buffer.
    noise_at: usize,
    done: CompletionQueue,
}

/// A loopback test device (VID 0x1209, PID 0x0005) at `speed`: high speed
/// (512-byte bulk packets) or SuperSpeed (1024, with endpoint companions and
/// a BOS). Full speed is honoured too; low speed and unknown speeds, which
/// have no bulk endpoints, become full speed.
pub fn loopback(speed: Speed) -> VirtualDevice<Loopback> {
    let speed = if speed.is_superspeed() || speed == Speed::HIGH { speed } else { Speed::FULL };
    let configuration = ConfigurationBuilder::new(speed, 100)
        .interface(0, 4, 0xff, 0, 0, 0)
        .endpoint(EndpointSpec::bulk(SOURCE_IN, speed))
        .endpoint(EndpointSpec::bulk(SINK_OUT, speed))
        .endpoint(EndpointSpec::bulk(LOOP_IN, speed))
        .endpoint(EndpointSpec::bulk(LOOP_OUT, speed))
        .endpoint(EndpointSpec::interrupt(TICK_IN, 16, 8, speed))
        .endpoint(EndpointSpec::bulk(NOISE_IN, speed))
        .build();
    let descriptors = DescriptorSet::new(
        speed,
        DeviceDescriptor::for_speed(speed, VENDOR_ID, PRODUCT_ID),
        configuration,
        vec![MANUFACTURER.into(), "usbwire loopback".into(), "00050001".into()],
    );
    VirtualDevice::new(Loopback {
        descriptors,
        pattern: shared_pattern().clone(),
        queue: VecDeque::new(),
        queued: 0,
        parked_out: VecDeque::new(),
        waiting_in: VecDeque::new(),
        waiting_ticks: VecDeque::new(),
        ticker: None,
        ticks: 0,
        born: tokio::time::Instant::now(),
        noise_at: 0,
        done: CompletionQueue::new(),
    })
}

impl Loopback {
    /// Bytes written to the loop OUT endpoint and not yet read back.
    pub fn queued_bytes(&self) -> usize {
        self.queued
    }

    fn source(&mut self, urb: &Urb) -> Completion {
        let len = urb.length as usize;
        if len <= self.pattern.len() {
            // A reference count, no copy: `complete_in` cuts it to the URB length.
            urb.complete_in(self.pattern.clone())
        } else {
            // Only when the server's transfer limit was raised above the default.
            urb.complete_in(pattern(len).into())
        }
    }

    fn has_room_for(&self, len: usize) -> bool {
        self.queued == 0 || self.queued.saturating_add(len) <= MAX_QUEUED
    }

    /// Takes a loop OUT URB's data into the queue.
    fn accept(&mut self, urb: Urb) {
        self.done.push(urb.complete_out());
        if !urb.data.is_empty() {
            self.queued += urb.data.len();
            self.queue.push_back(urb.data);
        }
    }

    /// Completes waiting loop IN URBs from the queue, then lets parked OUT
    /// URBs in as room appears, until neither side can move.
    fn shuffle(&mut self) {
        loop {
            let mut moved = false;
            while !self.waiting_in.is_empty() && !self.queue.is_empty() {
                if let (Some(urb), Some(chunk)) = (self.waiting_in.pop_front(), self.queue.front_mut()) {
                    // An IN URB returns data from one OUT URB at most, so no copy is needed.
                    let len = (urb.length as usize).min(chunk.len());
                    let data = chunk.split_to(len);
                    if chunk.is_empty() {
                        self.queue.pop_front();
                    }
                    self.queued -= data.len();
                    trace!(bytes = data.len(), "loop in");
                    self.done.push(urb.complete_in(data));
                    moved = true;
                }
            }
            while let Some(urb) = self.parked_out.front() {
                if !self.has_room_for(urb.data.len()) {
                    break;
                }
                if let Some(urb) = self.parked_out.pop_front() {
                    self.accept(urb);
                    moved = true;
                }
            }
            if !moved {
                return;
            }
        }
    }
}

impl Function for Loopback {
    fn descriptors(&self) -> &DescriptorSet {
        &self.descriptors
    }

    fn submit(&mut self, urb: Urb) {
        match urb.endpoint_address() {
            SOURCE_IN => {
                let done = self.source(&urb);
                self.done.push(done);
            }
            SINK_OUT => self.done.push(urb.complete_out()),
            LOOP_OUT => {
                if self.parked_out.is_empty() && self.has_room_for(urb.data.len()) {
                    self.accept(urb);
                } else {
                    self.parked_out.push_back(urb);
                }
                self.shuffle();
            }
            NOISE_IN => {
                let noise = shared_noise();
                let len = urb.length as usize;
                let done = if len <= noise.len() {
                    if self.noise_at + len > noise.len() {
                        self.noise_at = 0;
                    }
                    let slice = noise.slice(self.noise_at..self.noise_at + len);
                    self.noise_at += len;
                    urb.complete_in(slice)
                } else {
                    urb.complete_with(Status::EOVERFLOW)
                };
                self.done.push(done);
            }
            TICK_IN => self.waiting_ticks.push_back(urb),
            LOOP_IN if urb.length == 0 => self.done.push(urb.complete_in(Bytes::new())),
            LOOP_IN => {
                self.waiting_in.push_back(urb);
                self.shuffle();
            }
            _ => self.done.push(urb.complete_with(Status::EPIPE)),
        }
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        if let Poll::Ready(done) = self.done.poll_pop(cx) {
            return Poll::Ready(done);
        }
        let Some(urb) = self.waiting_ticks.pop_front() else {
            return Poll::Pending;
        };
        let ticker = self.ticker.get_or_insert_with(|| {
            let mut ticker = tokio::time::interval(TICK_INTERVAL);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            ticker
        });
        if ticker.poll_tick(cx).is_pending() {
            // Not its time yet: it stays first in line.
            self.waiting_ticks.push_front(urb);
            return Poll::Pending;
        }
        self.ticks += 1;
        let mut report = Vec::with_capacity(16);
        report.extend_from_slice(&self.ticks.to_le_bytes());
        report.extend_from_slice(&(self.born.elapsed().as_micros() as u64).to_le_bytes());
        Poll::Ready(urb.complete_in(report.into()))
    }

    fn cancel(&mut self, seqnum: u32) {
        let urb = if let Some(i) = self.waiting_in.iter().position(|u| u.seqnum == seqnum) {
            self.waiting_in.remove(i)
        } else if let Some(i) = self.waiting_ticks.iter().position(|u| u.seqnum == seqnum) {
            self.waiting_ticks.remove(i)
        } else if let Some(i) = self.parked_out.iter().position(|u| u.seqnum == seqnum) {
            self.parked_out.remove(i)
        } else {
            None
        };
        if let Some(urb) = urb {
            self.done.push(urb.complete_with(Status::ECONNRESET));
        }
    }

    fn reset(&mut self) {
        self.queue.clear();
        self.queued = 0;
        self.parked_out.clear();
        self.waiting_in.clear();
        self.waiting_ticks.clear();
        self.ticker = None;
        self.done.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{configure, data_in, data_out, next, request};
    use usbwire_device::descriptor::{self, ConfigurationInfo};
    use usbwire_device::Device;

    fn configured(speed: Speed) -> VirtualDevice<Loopback> {
        let mut dev = loopback(speed);
        configure(&mut dev);
        dev
    }

    #[test]
    fn source_fills_in_urbs_with_the_pattern() {
        let mut dev = configured(Speed::HIGH);
        for (seqnum, len) in [(1, 0u32), (2, 1), (3, 512), (4, 100_000)] {
            dev.submit(data_in(seqnum, SOURCE_IN, len));
            let done = next(&mut dev).unwrap();
            assert_eq!((done.seqnum, done.status, done.actual_length), (seqnum, Status::OK, len));
            assert!(done.data.iter().enumerate().all(|(i, b)| *b == (i % 63) as u8));
        }
        assert_eq!(next(&mut dev), None);
    }

    #[test]
    fn source_does_not_copy_the_pattern() {
        let mut dev = configured(Speed::HIGH);
        dev.submit(data_in(1, SOURCE_IN, 4096));
        let done = next(&mut dev).unwrap();
        assert_eq!(done.data.as_ptr(), shared_pattern().as_ptr());
    }

    #[test]
    fn sink_accepts_everything() {
        let mut dev = configured(Speed::HIGH);
        dev.submit(data_out(1, SINK_OUT, Bytes::from_static(&[7; 1000])));
        let done = next(&mut dev).unwrap();
        assert_eq!((done.status, done.actual_length), (Status::OK, 1000));
        assert_eq!(dev.function().queued_bytes(), 0);
    }

    #[test]
    fn loop_returns_data_in_fifo_order() {
        let mut dev = configured(Speed::HIGH);
        dev.submit(data_out(1, LOOP_OUT, Bytes::from_static(b"first")));
        dev.submit(data_out(2, LOOP_OUT, Bytes::from_static(b"second")));
        assert_eq!(next(&mut dev).unwrap().seqnum, 1);
        assert_eq!(next(&mut dev).unwrap().seqnum, 2);
        dev.submit(data_in(3, LOOP_IN, 3));
        dev.submit(data_in(4, LOOP_IN, 512));
        dev.submit(data_in(5, LOOP_IN, 512));
        dev.submit(data_in(6, LOOP_IN, 512));
        let data: Vec<(u32, Bytes)> = std::iter::from_fn(|| next(&mut dev)).map(|c| (c.seqnum, c.data)).collect();
        assert_eq!(
            data,
            vec![(3, Bytes::from_static(b"fir")), (4, Bytes::from_static(b"st")), (5, Bytes::from_static(b"second"))]
        );
        // The last IN waits for more data.
        dev.submit(data_out(7, LOOP_OUT, Bytes::from_static(b"third")));
        let done: Vec<(u32, Bytes)> = std::iter::from_fn(|| next(&mut dev)).map(|c| (c.seqnum, c.data)).collect();
        assert_eq!(done, vec![(7, Bytes::new()), (6, Bytes::from_static(b"third"))]);
        assert_eq!(dev.function().queued_bytes(), 0);
    }

    #[test]
    fn loop_queue_is_bounded_and_drains() {
        let mut dev = configured(Speed::HIGH);
        let chunk = Bytes::from(vec![0xa5; 4 * 1024 * 1024]);
        for seqnum in 1..=5 {
            dev.submit(data_out(seqnum, LOOP_OUT, chunk.clone()));
        }
        let accepted: Vec<u32> = std::iter::from_fn(|| next(&mut dev)).map(|c| c.seqnum).collect();
        assert_eq!(accepted, vec![1, 2, 3, 4], "the fifth would pass 16 MiB");
        assert_eq!(dev.function().queued_bytes(), MAX_QUEUED);
        dev.submit(data_out(6, LOOP_OUT, Bytes::from_static(b"x")));
        assert!(next(&mut dev).is_none(), "later OUT URBs wait behind the parked one");
        dev.submit(data_in(7, LOOP_IN, 4 * 1024 * 1024));
        let done: Vec<(u32, u32)> =
            std::iter::from_fn(|| next(&mut dev)).map(|c| (c.seqnum, c.actual_length)).collect();
        assert_eq!(done, vec![(7, 4 * 1024 * 1024), (5, 4 * 1024 * 1024)], "one more byte would not fit yet");
        dev.submit(data_in(8, LOOP_IN, 4 * 1024 * 1024));
        let done: Vec<(u32, u32)> =
            std::iter::from_fn(|| next(&mut dev)).map(|c| (c.seqnum, c.actual_length)).collect();
        assert_eq!(done, vec![(8, 4 * 1024 * 1024), (6, 1)]);
        // A parked OUT URB can be cancelled.
        dev.submit(data_out(9, LOOP_OUT, chunk.clone()));
        assert!(next(&mut dev).is_none());
        dev.cancel(9);
        let done = next(&mut dev).unwrap();
        assert_eq!((done.seqnum, done.status, done.actual_length), (9, Status::ECONNRESET, 0));
    }

    #[test]
    fn cancel_and_reset_end_waiting_in_urbs() {
        let mut dev = configured(Speed::HIGH);
        dev.submit(data_in(1, LOOP_IN, 64));
        assert!(next(&mut dev).is_none());
        dev.cancel(1);
        assert_eq!(next(&mut dev).unwrap().status, Status::ECONNRESET);
        dev.submit(data_in(2, LOOP_IN, 64));
        dev.submit(data_out(3, LOOP_OUT, Bytes::from_static(b"a")));
        dev.reset();
        assert!(next(&mut dev).is_none(), "reset abandons everything");
        assert_eq!(dev.function().queued_bytes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn ticks_come_one_per_interval_with_the_device_time() {
        let mut dev = configured(Speed::HIGH);
        for seqnum in 1..=3 {
            dev.submit(data_in(seqnum, TICK_IN, 16));
        }
        let mut times = Vec::new();
        for _ in 0..3 {
            let done = std::future::poll_fn(|cx| dev.poll_complete(cx)).await;
            assert_eq!(done.actual_length, 16);
            times.push(u64::from_le_bytes(done.data[8..16].try_into().unwrap()));
        }
        // Paused time: the clock moves exactly one interval per tick.
        assert!(times[2] - times[1] >= 7_000, "{times:?}");
    }

    #[test]
    fn noise_does_not_compress_and_does_not_copy() {
        let mut dev = configured(Speed::HIGH);
        dev.submit(data_in(1, NOISE_IN, 65536));
        let a = next(&mut dev).unwrap();
        dev.submit(data_in(2, NOISE_IN, 65536));
        let b = next(&mut dev).unwrap();
        assert_eq!(b.data.as_ptr() as usize - a.data.as_ptr() as usize, 65536, "consecutive slices of one buffer");
        let distinct: std::collections::HashSet<u8> = a.data.iter().copied().collect();
        assert!(distinct.len() > 250, "noise uses every byte value");
    }

    #[test]
    fn high_speed_descriptors() {
        let mut dev = loopback(Speed::HIGH);
        let config = request(&mut dev, [0x80, 6, 0, 2, 0, 0, 0xff, 0], &[]);
        let info = ConfigurationInfo::parse(&config).unwrap();
        assert_eq!(info.interfaces.len(), 1);
        assert_eq!((info.interfaces[0].class, info.interfaces[0].subclass), (0xff, 0));
        let eps: Vec<_> = info.active_endpoints(|_| 0).map(|e| (e.address, e.max_packet_size)).collect();
        assert_eq!(eps, vec![(0x81, 512), (0x02, 512), (0x83, 512), (0x03, 512), (0x84, 16), (0x85, 512)]);
        let summary = dev.summary();
        assert_eq!((summary.vendor_id, summary.product_id, summary.speed), (0x1209, 0x0005, Speed::HIGH));
        assert_eq!(summary.product, "usbwire loopback");
    }

    #[test]
    fn superspeed_descriptors() {
        let mut dev = loopback(Speed::SUPER);
        let device = request(&mut dev, [0x80, 6, 0, 1, 0, 0, 18, 0], &[]);
        assert_eq!(&device[2..4], &[0x20, 0x03], "bcdUSB 3.2");
        assert_eq!(device[7], 9, "512-byte ep0");
        let config = request(&mut dev, [0x80, 6, 0, 2, 0, 0, 0xff, 0], &[]);
        assert_eq!(config.len(), 9 + 9 + 6 * (7 + 6));
        let companions = config.windows(2).filter(|w| w == &[6, descriptor::SS_ENDPOINT_COMPANION]).count();
        assert_eq!(companions, 6);
        let info = ConfigurationInfo::parse(&config).unwrap();
        assert!(info.active_endpoints(|_| 0).filter(|e| e.address != TICK_IN).all(|e| e.max_packet_size == 1024));
        let bos = request(&mut dev, [0x80, 6, 0, 0x0f, 0, 0, 0xff, 0], &[]);
        assert_eq!(bos[1], descriptor::BOS);
        // Data still flows at SuperSpeed.
        configure(&mut dev);
        dev.submit(data_in(1, SOURCE_IN, 2048));
        assert_eq!(next(&mut dev).unwrap().actual_length, 2048);
    }
}
