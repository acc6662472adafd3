//! Spacing of periodic (interrupt) completions as the client sees them,
//! against the spacing the device made them at — what a jitter buffer is
//! for. The device must stamp its completions: the loopback device's tick
//! endpoint puts its own time (µs, little-endian u64) in bytes 8..16.

use std::time::Instant;

use futures_util::stream::{FuturesUnordered, StreamExt};
use serde::Serialize;
use usbwire_client::{Connection, Transfer};

use crate::Percentiles;

/// Completions ignored at the start (the jitter buffer settles on the network's base delay).
const WARM_UP: usize = 16;

#[derive(Clone, Debug, Serialize)]
pub struct Spacing {
    pub completions: usize,
    /// The device's spacing, median, µs.
    pub device_interval_us: f64,
    /// |client spacing − device spacing| per consecutive pair, µs.
    pub error_us: Percentiles,
    /// Client-side spacing itself, µs.
    pub client_interval_us: Percentiles,
}

/// Keeps `depth` interrupt IN URBs on `endpoint` in flight until `count`
/// stamped completions have arrived, and compares their spacing.
pub async fn measure(conn: &Connection, endpoint: u8, count: usize, depth: usize) -> Result<Spacing, String> {
    let transfer = || Transfer::bulk_in(endpoint, 16);
    let mut in_flight = FuturesUnordered::new();
    for _ in 0..depth {
        let (_, reply) = conn.submit(transfer()).await.map_err(|e| e.to_string())?;
        in_flight.push(reply);
    }
    let mut stamps: Vec<(Instant, u64)> = Vec::with_capacity(count + WARM_UP);
    while let Some(reply) = in_flight.next().await {
        let ret = reply.map_err(|e| e.to_string())?;
        // The device's own time is bytes 8..16 of the report.
        let device_stamp = ret.data.get(8..).and_then(<[u8]>::first_chunk::<8>).filter(|_| ret.status.is_ok());
        let Some(&device_stamp) = device_stamp else {
            return Err(format!("interrupt URB ended with {} and {} bytes", ret.status, ret.data.len()));
        };
        let device_us = u64::from_le_bytes(device_stamp);
        stamps.push((Instant::now(), device_us));
        if stamps.len() >= count + WARM_UP {
            break;
        }
        let (_, reply) = conn.submit(transfer()).await.map_err(|e| e.to_string())?;
        in_flight.push(reply);
    }
    // Let the URBs still in flight finish rather than leave them dangling.
    while in_flight.next().await.is_some() {}
    Ok(spacing(&stamps[WARM_UP.min(stamps.len())..]))
}

/// The statistics of (arrival, device time) pairs in arrival order.
pub fn spacing(stamps: &[(Instant, u64)]) -> Spacing {
    let mut device = Vec::new();
    let mut client = Vec::new();
    let mut errors = Vec::new();
    for pair in stamps.windows(2) {
        let client_us = pair[1].0.duration_since(pair[0].0).as_secs_f64() * 1e6;
        let device_us = pair[1].1.saturating_sub(pair[0].1) as f64;
        device.push(device_us);
        client.push(client_us);
        errors.push((client_us - device_us).abs());
    }
    Spacing {
        completions: stamps.len(),
        device_interval_us: Percentiles::of(&mut device).p50,
        error_us: Percentiles::of(&mut errors),
        client_interval_us: Percentiles::of(&mut client),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn spacing_error_is_the_difference_of_intervals() {
        let start = Instant::now();
        let arrivals = [0u64, 8, 16, 30, 32, 40, 48];
        let stamps: Vec<_> =
            arrivals.iter().enumerate().map(|(i, ms)| (start + Duration::from_millis(*ms), i as u64 * 8000)).collect();
        let s = spacing(&stamps);
        assert_eq!(s.device_interval_us, 8000.0);
        assert!((s.error_us.max - 6000.0).abs() < 1.0, "{s:?}");
        assert!(s.error_us.p50 < 1.0, "{s:?}");
    }
}
