//! Measuring usbwire itself: a userspace client keeps `depth` URBs in flight
//! on a bulk endpoint and counts what completes.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use usbwire_client::{Connection, Transfer};
use usbwire_device::descriptor::ConfigurationInfo;
use usbwire_device::TransferType;

use crate::ceiling::Measured;
use crate::{Direction, Percentiles};

/// The bulk endpoints to measure.
#[derive(Clone, Copy, Debug)]
pub struct Endpoints {
    /// A bulk IN endpoint that always has data (a "source").
    pub source: Option<u8>,
    /// A bulk OUT endpoint that takes anything (a "sink").
    pub sink: Option<u8>,
}

/// Configures the device (SET_CONFIGURATION 1) and finds its first bulk IN and
/// OUT endpoints.
pub async fn prepare(conn: &Connection) -> Result<Endpoints, String> {
    let header = conn.transfer(Transfer::control_in([0x80, 6, 0, 2, 0, 0, 9, 0])).await.map_err(|e| e.to_string())?;
    if header.data.len() < 9 {
        return Err("the device returned no configuration descriptor".into());
    }
    let [lo, hi] = [header.data[2], header.data[3]];
    let config = conn.transfer(Transfer::control_in([0x80, 6, 0, 2, 0, 0, lo, hi])).await.map_err(|e| e.to_string())?;
    let info = ConfigurationInfo::parse(&config.data).ok_or("malformed configuration descriptor")?;
    let set = conn
        .transfer(Transfer::control_out([0, 9, info.value, 0, 0, 0, 0, 0], bytes::Bytes::new()))
        .await
        .map_err(|e| e.to_string())?;
    if !set.status.is_ok() {
        return Err(format!("SET_CONFIGURATION failed: {}", set.status));
    }
    let bulk = |dir_in: bool| {
        info.active_endpoints(|_| 0)
            .find(|e| e.transfer_type == TransferType::Bulk && (e.address & 0x80 != 0) == dir_in)
            .map(|e| e.address)
    };
    Ok(Endpoints { source: bulk(true), sink: bulk(false) })
}

/// What OUT URBs carry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Payload {
    /// One repeated byte: compresses to almost nothing.
    #[default]
    Constant,
    /// Pseudo-random bytes: does not compress at all.
    Random,
}

/// Random bytes enough for 16 MiB of consecutive, never repeated URB payloads.
const RANDOM_POOL: usize = 16 << 20;

impl Payload {
    /// A buffer to take OUT payloads from: one URB's worth, or the random pool.
    fn pool(self, size: usize) -> bytes::Bytes {
        match self {
            Self::Constant => bytes::Bytes::from(vec![0xa5u8; size]),
            Self::Random => usbwire_gadgets::loopback::noise(RANDOM_POOL.max(size), 0x9e37_79b9_7f4a_7c15).into(),
        }
    }
}

/// Keeps `depth` URBs of `size` bytes in flight on `endpoint` for `duration`.
///
/// Like the ceiling's client, one task keeps the window full: it collects
/// every completion that has arrived, reads the clock once for the batch and
/// tops the window up with one batch of submits (a [`usbwire_client::TransferQueue`]).
pub async fn measure(
    conn: &Connection,
    endpoint: u8,
    direction: Direction,
    (size, payload): (usize, Payload),
    depth: usize,
    duration: Duration,
) -> Result<Measured, String> {
    let pool = payload.pool(size);
    let mut at = 0usize;
    // Consecutive OUT URBs take consecutive slices of the pool (zero-copy).
    let mut transfer = || match direction {
        Direction::In => Transfer::bulk_in(endpoint, size as u32),
        Direction::Out => {
            if at + size > pool.len() {
                at = 0;
            }
            at += size;
            Transfer::bulk_out(endpoint, pool.slice(at - size..at))
        }
    };
    let mut queue = conn.queue();
    // Seqnum and submit time of each URB in flight, oldest first.
    let mut submitted: VecDeque<(u32, Instant)> = VecDeque::with_capacity(depth);
    let mut done = 0u64;
    let mut bytes = 0u64;
    let mut latencies = Vec::new();
    let started = Instant::now();
    let stop = started + duration;
    let mut finished = started;
    let mut now = started;
    loop {
        if now < stop {
            while queue.pending() < depth {
                submitted.push_back((queue.submit(transfer()).map_err(|e| e.to_string())?, now));
            }
        }
        let Some(first) = queue.next_complete().await else { break };
        now = Instant::now();
        let mut next = Some(first.map_err(|e| e.to_string())?);
        while let Some(ret) = next {
            if !ret.status.is_ok() {
                return Err(format!("URB failed: {}", ret.status));
            }
            // In order on one endpoint, so the front almost always matches.
            let at = submitted.iter().position(|&(seqnum, _)| seqnum == ret.seqnum);
            if let Some((_, at)) = at.and_then(|i| submitted.remove(i)) {
                latencies.push(now.duration_since(at).as_secs_f64() * 1e6);
            }
            done += 1;
            bytes += u64::from(ret.actual_length);
            next = queue.try_next_complete();
        }
        finished = now;
    }
    let seconds = finished.duration_since(started).as_secs_f64().max(1e-9);
    Ok(Measured {
        mib_per_s: bytes as f64 / seconds / (1024.0 * 1024.0),
        urbs_per_s: done as f64 / seconds,
        latency: Percentiles::of(&mut latencies),
        samples: latencies,
    })
}
