//! The throughput and latency matrix `usbwire bench` and `usbwire demo` run:
//! per emulated RTT, direction, URB size and queue depth, usbwire next to raw
//! TCP over the same path, each point the median of its runs ([`execute`]),
//! and what it found ([`Report`]: a table, JSON, CSV). Not for taking the
//! plan from a command line or printing (the CLI's), nor for the one point's
//! measuring ([`measure`](crate::measure), [`ceiling`](crate::ceiling)).

mod report;

use std::net::SocketAddr;
use std::time::Duration;

use usbwire_client::{Connection, Security, TransformSpec};
use usbwire_proto::op::BusId;
use usbwire_transport::transform::TransformStats;

pub use report::Report;

use crate::measure::Payload;
use crate::{ceiling, cipher_speed, measure, model, openssl_speed, plot, proxy, BenchError, Direction, Record};

/// What the matrix covers.
#[derive(Clone, Debug)]
pub struct Plan {
    pub sizes: Vec<usize>,
    pub depths: Vec<usize>,
    pub rtts_ms: Vec<f64>,
    pub jitter_ms: f64,
    pub seconds: f64,
    /// Runs per point (the median is reported).
    pub repeat: usize,
    /// Stream transforms offered to the server.
    pub transforms: Vec<TransformSpec>,
    pub payload: Payload,
    /// Import resumably: the URBs go through the resuming relay.
    pub resume: bool,
}

/// How a run reports its progress, point by point (a progress bar, or
/// [`Quiet`]). Called from the run's own thread.
pub trait Progress: Send + Sync {
    /// The run begins: `points` points to go.
    fn begin(&self, points: usize);
    /// A point begins: what it is (`rtt 0 ms In 512 B x8`).
    fn point(&self, what: String);
    /// `points` more points are done (measured, or skipped: a direction with no endpoint).
    fn advance(&self, points: usize);
    /// The run is over.
    fn finish(&self);
}

/// Reports nothing.
pub struct Quiet;

impl Progress for Quiet {
    fn begin(&self, _points: usize) {}
    fn point(&self, _what: String) {}
    fn advance(&self, _points: usize) {}
    fn finish(&self) {}
}

/// How long the cipher's own speed is measured for (`Report::cipher`).
const CIPHER_SECONDS: f64 = 0.3;

/// Runs the matrix against `busid` at `target`, from a client thread of its own
/// (see [`crate::client_thread`]). `endpoints` (IN, OUT) overrides the bulk
/// endpoints found on the device.
pub async fn execute(
    plan: &Plan,
    target: SocketAddr,
    busid: &BusId,
    security: &Security,
    endpoints: (Option<u8>, Option<u8>),
    progress: impl Progress + 'static,
) -> Result<Report, BenchError> {
    let (plan, busid, security) = (plan.clone(), busid.clone(), security.clone());
    let matrix = move || async move {
        let (plan, busid, security) = (&plan, &busid, &security);
        let ideal = ceiling::start_server()?;
        let cipher = match security {
            Security::Tls(_) => Some(
                cipher_speed::measure(Duration::from_secs_f64(CIPHER_SECONDS))
                    .map_err(|e| BenchError::Internal(e.into()))?,
            ),
            Security::Plain => None,
        };
        let openssl = cipher.is_some().then(openssl_speed::measure);
        progress.begin(plan.rtts_ms.len() * 2 * plan.sizes.len() * plan.depths.len());
        let mut found = Found::default();
        for &rtt_ms in &plan.rtts_ms {
            let path = Path { target, ideal, rtt_ms, endpoints };
            measure_rtt(plan, &path, busid, security, &progress, &mut found).await?;
        }
        progress.finish();
        let Found { records, latencies, fits } = found;
        Ok(Report { records, latencies, fits, cipher, openssl })
    };
    crate::client_thread("usbwire-bench", matrix).await.map_err(|e| BenchError::Internal(e.into()))?
}

/// Where one RTT's points go: usbwire's server, the ideal server, the RTT to
/// emulate in front of both, and the endpoints asked for.
struct Path {
    target: SocketAddr,
    ideal: SocketAddr,
    rtt_ms: f64,
    endpoints: (Option<u8>, Option<u8>),
}

/// What the points measured so far found.
#[derive(Default)]
struct Found {
    records: Vec<Record>,
    latencies: Vec<plot::LatencySamples>,
    fits: Vec<(f64, Direction, model::Fit)>,
}

/// Every point at one emulated RTT, both directions, over one import.
async fn measure_rtt(
    plan: &Plan,
    path: &Path,
    busid: &BusId,
    security: &Security,
    progress: &dyn Progress,
    found: &mut Found,
) -> Result<(), BenchError> {
    let rtt_ms = path.rtt_ms;
    let smallest = plan.sizes.iter().copied().min().unwrap_or(512);
    let duration = Duration::from_secs_f64(plan.seconds);
    let rtt = Duration::from_secs_f64(rtt_ms / 1000.0);
    let jitter = Duration::from_secs_f64(plan.jitter_ms / 1000.0);
    let delayed = !rtt.is_zero() || !jitter.is_zero();
    let via = |addr| async move {
        if delayed {
            proxy::start(addr, rtt, jitter).await
        } else {
            Ok(addr)
        }
    };
    let usbwire_addr = via(path.target).await?;
    let ideal_addr = via(path.ideal).await?;
    let (conn, wire) = crate::target::open(usbwire_addr, busid, security, &plan.transforms, plan.resume).await?;
    let endpoints = measure::prepare(&conn).await.map_err(BenchError::Unavailable)?;
    let source = path.endpoints.0.or(endpoints.source);
    let sink = path.endpoints.1.or(endpoints.sink);
    if source.is_none() && sink.is_none() {
        return Err(BenchError::Unavailable(format!(
            "{busid} has no bulk endpoint to measure (name one with --in-ep / --out-ep)"
        )));
    }
    for (direction, endpoint) in [(Direction::In, source), (Direction::Out, sink)] {
        let Some(endpoint) = endpoint else {
            progress.advance(plan.sizes.len() * plan.depths.len());
            continue;
        };
        let mut depth_one = Vec::new();
        for &size in &plan.sizes {
            for &depth in &plan.depths {
                progress.point(format!("rtt {rtt_ms} ms {direction:?} {size} B x{depth}"));
                let point = Point { endpoint, direction, size, depth, duration, rtt_ms };
                let (record, ours, raw) =
                    measure_point(plan, &conn, wire.as_deref(), ideal_addr, busid, &point).await?;
                if depth == 1 {
                    depth_one.push((size, 1.0 / ours.urbs_per_s.max(1e-9)));
                    if size == smallest {
                        found.latencies.push(plot::LatencySamples {
                            rtt_ms,
                            direction,
                            urb_size: size,
                            ours: ours.samples.clone(),
                            raw: raw.samples.clone(),
                        });
                    }
                }
                found.records.push(record);
                progress.advance(1);
            }
        }
        if let Some(fit) = model::fit(&depth_one) {
            found.fits.push((rtt_ms, direction, fit));
        }
    }
    conn.close().await;
    Ok(())
}

/// One point of the matrix: where and how much.
struct Point {
    endpoint: u8,
    direction: Direction,
    size: usize,
    depth: usize,
    duration: Duration,
    rtt_ms: f64,
}

/// Measures one point `plan.repeat` times, alternating ours and the raw-TCP
/// ceiling and keeping the median of each: on a small machine a single run is
/// at the mercy of the scheduler.
async fn measure_point(
    plan: &Plan,
    conn: &Connection,
    wire: Option<&TransformStats>,
    ideal_addr: SocketAddr,
    busid: &BusId,
    point: &Point,
) -> Result<(Record, ceiling::Measured, ceiling::Measured), BenchError> {
    let Point { endpoint, direction, size, depth, duration, rtt_ms } = *point;
    let mut ours_runs = Vec::new();
    let mut raw_runs = Vec::new();
    let before = wire.map(counters);
    for _ in 0..plan.repeat {
        let ours = measure::measure(conn, endpoint, direction, (size, plan.payload), depth, duration).await;
        ours_runs.push(
            ours.map_err(|e| BenchError::Unavailable(format!("{busid} {direction:?} {size} B depth {depth}: {e}")))?,
        );
        raw_runs.push(ceiling::measure(ideal_addr, direction, size, depth, duration).await?);
    }
    let runs_mib_per_s: Vec<f64> = ours_runs.iter().map(|r| r.mib_per_s).collect();
    let raw_tcp_runs_mib_per_s: Vec<f64> = raw_runs.iter().map(|r| r.mib_per_s).collect();
    let ours = median(ours_runs);
    let raw = median(raw_runs);
    let compression_ratio = before.zip(wire.map(counters)).map(|(a, b)| {
        // [plain sent, wire sent, wire received, plain received]
        let delta = |i: usize| (b[i] - a[i]) as f64;
        match direction {
            Direction::Out => delta(0) / delta(1).max(1.0),
            Direction::In => delta(3) / delta(2).max(1.0),
        }
    });
    let record = Record {
        direction,
        urb_size: size,
        depth,
        rtt_ms,
        mib_per_s: ours.mib_per_s,
        raw_tcp_mib_per_s: raw.mib_per_s,
        ratio_to_raw_tcp: if raw.mib_per_s > 0.0 { ours.mib_per_s / raw.mib_per_s } else { 0.0 },
        urbs_per_s: ours.urbs_per_s,
        latency_us: ours.latency,
        raw_tcp_latency_us: raw.latency,
        compression_ratio,
        runs_mib_per_s,
        raw_tcp_runs_mib_per_s,
    };
    Ok((record, ours, raw))
}

fn counters(stats: &TransformStats) -> [u64; 4] {
    use std::sync::atomic::Ordering::Relaxed;
    [
        stats.plain_sent.load(Relaxed),
        stats.wire_sent.load(Relaxed),
        stats.wire_received.load(Relaxed),
        stats.plain_received.load(Relaxed),
    ]
}

/// The run with the median throughput (of an even number, the upper middle one).
/// `runs` is never empty: a point runs at least once.
fn median(mut runs: Vec<ceiling::Measured>) -> ceiling::Measured {
    runs.sort_by(|a, b| a.mib_per_s.total_cmp(&b.mib_per_s));
    let middle = runs.len() / 2;
    runs.swap_remove(middle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Percentiles;

    fn run(mib_per_s: f64) -> ceiling::Measured {
        ceiling::Measured { mib_per_s, urbs_per_s: 0.0, latency: Percentiles::default(), samples: Vec::new() }
    }

    #[test]
    fn a_point_keeps_the_run_with_the_median_throughput() {
        assert_eq!(median(vec![run(30.0), run(10.0), run(20.0)]).mib_per_s, 20.0);
        assert_eq!(median(vec![run(7.0)]).mib_per_s, 7.0);
        assert_eq!(median(vec![run(40.0), run(10.0)]).mib_per_s, 40.0, "the upper middle of two");
    }
}
