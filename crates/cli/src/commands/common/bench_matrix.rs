//! The throughput and latency matrix `usbwire bench` and `usbwire demo`
//! run: per URB size, queue depth and emulated RTT, each as a ratio to raw
//! TCP over the same path, against a server of their choosing or an
//! in-process loopback device.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use serde_json::json;
use usbwire_bench::measure::Payload;
use usbwire_bench::{ceiling, measure, model, openssl_speed, plot, proxy, Direction, Record};
use usbwire_client::{Connection, Security, TransformSpec};
use usbwire_device::Speed;
use usbwire_proto::op::BusId;
use usbwire_server::{Server, ServerConfig};
use usbwire_transport::transform::TransformStats;

use crate::exit::Failure;

/// What the matrix covers.
#[derive(Clone)]
pub(crate) struct Plan {
    pub(crate) sizes: Vec<usize>,
    pub(crate) depths: Vec<usize>,
    pub(crate) rtts_ms: Vec<f64>,
    pub(crate) jitter_ms: f64,
    pub(crate) seconds: f64,
    /// Runs per point (the median is reported).
    pub(crate) repeat: usize,
    /// Stream transforms offered to the server.
    pub(crate) transforms: Vec<TransformSpec>,
    pub(crate) payload: Payload,
    /// Import resumably: the URBs go through the resuming relay.
    pub(crate) resume: bool,
}

/// Imports the device to measure, resumably with `--resume` (then the wire
/// counters of the transforms are inside the relay, out of reach).
pub(crate) async fn open(
    plan: &Plan,
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
) -> Result<(Connection, Option<Arc<TransformStats>>), Failure> {
    if plan.resume {
        let (conn, _) = Connection::import_resumable(addr, busid, security, &plan.transforms).await?;
        if !conn.is_resumable() {
            return Err(Failure::unavailable(anyhow!(
                "{addr} did not grant resume (not usbwire, or --resume-grace 0)"
            )));
        }
        return Ok((conn, None));
    }
    let (stream, record) = usbwire_client::import_with(addr, busid, security, &plan.transforms).await?;
    let wire = stream.transform_stats();
    Ok((Connection::new(stream, &record), wire))
}

/// An in-process server with one loopback device on 127.0.0.1, on a thread of
/// its own like the ceiling's ideal server (see [`usbwire_bench::server_thread`]).
pub(crate) async fn local_loopback() -> Result<(SocketAddr, BusId), Failure> {
    let (busid_tx, busid_rx) = std::sync::mpsc::channel();
    let addr = usbwire_bench::server_thread("usbwire-server", move || async move {
        let config = ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            control_path: None,
            ..ServerConfig::default()
        };
        let mut server = Server::new(config);
        let _ = busid_tx.send(server.export("loopback", Box::new(usbwire_gadgets::loopback(Speed::HIGH))));
        let bound = server.bind().await.map_err(std::io::Error::other)?;
        let addr = bound.local_addr();
        tokio::spawn(bound.run(std::future::pending()));
        Ok(addr)
    })
    .map_err(|e| Failure::unavailable(e.into()))?;
    let busid = busid_rx.recv().map_err(|e| Failure::software(e.into()))?;
    Ok((addr, busid))
}

pub(crate) struct Report {
    pub(crate) records: Vec<Record>,
    pub(crate) latencies: Vec<plot::LatencySamples>,
    fits: Vec<(f64, Direction, model::Fit)>,
    /// Over TLS: one core's AES-GCM in the same run, to put each rate in proportion.
    cipher: Option<usbwire_transport::CipherSpeed>,
    /// Over TLS: `openssl speed`'s one-core AES-256-GCM in the same run (the TLS
    /// target's reference), or why there is none.
    openssl: Option<Result<openssl_speed::OpensslSpeed, String>>,
}

/// How long the cipher's own speed is measured for (`Report::cipher`).
const CIPHER_SECONDS: f64 = 0.3;

/// Runs the matrix from a client thread of its own (see [`usbwire_bench::client_thread`]).
pub(crate) async fn execute(
    plan: &Plan,
    target: SocketAddr,
    busid: &BusId,
    security: &Security,
    endpoints: (Option<u8>, Option<u8>),
    progress: bool,
) -> Result<Report, Failure> {
    let (plan, busid, security) = (plan.clone(), busid.clone(), security.clone());
    let matrix = move || async move {
        let (plan, busid, security) = (&plan, &busid, &security);
        let ideal = ceiling::start_server().map_err(|e| Failure::io(e.into()))?;
        let cipher = match security {
            Security::Tls(_) => Some(
                usbwire_transport::cipher_speed(Duration::from_secs_f64(CIPHER_SECONDS))
                    .map_err(|e| Failure::software(e.into()))?,
            ),
            Security::Plain => None,
        };
        let openssl = cipher.is_some().then(openssl_speed::measure);
        let points = plan.rtts_ms.len() * 2 * plan.sizes.len() * plan.depths.len();
        let bar = if progress {
            let bar = indicatif::ProgressBar::new(points as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar
        } else {
            indicatif::ProgressBar::hidden()
        };
        let mut records = Vec::new();
        let mut latencies = Vec::new();
        let mut fits = Vec::new();
        let smallest = plan.sizes.iter().copied().min().unwrap_or(512);
        let duration = Duration::from_secs_f64(plan.seconds);
        for &rtt_ms in &plan.rtts_ms {
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
            let usbwire_addr = via(target).await.map_err(|e| Failure::io(e.into()))?;
            let ideal_addr = via(ideal).await.map_err(|e| Failure::io(e.into()))?;
            let (conn, wire) = open(plan, usbwire_addr, busid, security).await?;
            let found = measure::prepare(&conn).await.map_err(|e| Failure::unavailable(anyhow!(e)))?;
            let source = endpoints.0.or(found.source);
            let sink = endpoints.1.or(found.sink);
            if source.is_none() && sink.is_none() {
                return Err(Failure::unavailable(anyhow!(
                    "{busid} has no bulk endpoint to measure (name one with --in-ep / --out-ep)"
                )));
            }
            for (direction, endpoint) in [(Direction::In, source), (Direction::Out, sink)] {
                let Some(endpoint) = endpoint else {
                    bar.inc((plan.sizes.len() * plan.depths.len()) as u64);
                    continue;
                };
                let mut depth_one = Vec::new();
                for &size in &plan.sizes {
                    for &depth in &plan.depths {
                        bar.set_message(format!("rtt {rtt_ms} ms {direction:?} {size} B x{depth}"));
                        let point = Point { endpoint, direction, size, depth, duration, rtt_ms };
                        let (record, ours, raw) =
                            measure_point(plan, &conn, wire.as_deref(), ideal_addr, busid, &point).await?;
                        if depth == 1 {
                            depth_one.push((size, 1.0 / ours.urbs_per_s.max(1e-9)));
                            if size == smallest {
                                latencies.push(plot::LatencySamples {
                                    rtt_ms,
                                    direction,
                                    urb_size: size,
                                    ours: ours.samples.clone(),
                                    raw: raw.samples.clone(),
                                });
                            }
                        }
                        records.push(record);
                        bar.inc(1);
                    }
                }
                if let Some(fit) = model::fit(&depth_one) {
                    fits.push((rtt_ms, direction, fit));
                }
            }
            conn.close().await;
        }
        bar.finish_and_clear();
        Ok(Report { records, latencies, fits, cipher, openssl })
    };
    usbwire_bench::client_thread("usbwire-bench", matrix).await.map_err(|e| Failure::software(e.into()))?
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
) -> Result<(Record, ceiling::Measured, ceiling::Measured), Failure> {
    let Point { endpoint, direction, size, depth, duration, rtt_ms } = *point;
    let mut ours_runs = Vec::new();
    let mut raw_runs = Vec::new();
    let before = wire.map(counters);
    for _ in 0..plan.repeat {
        let ours = measure::measure(conn, endpoint, direction, (size, plan.payload), depth, duration).await;
        ours_runs.push(
            ours.map_err(|e| Failure::unavailable(anyhow!("{busid} {direction:?} {size} B depth {depth}: {e}")))?,
        );
        let raw = ceiling::measure(ideal_addr, direction, size, depth, duration).await;
        raw_runs.push(raw.map_err(|e| Failure::io(e.into()))?);
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

impl Report {
    pub(crate) fn json(&self) -> serde_json::Value {
        let fits: Vec<_> = self
            .fits
            .iter()
            .map(|(rtt_ms, direction, fit)| {
                if !fit.is_physical() {
                    return json!({
                        "rtt_ms": rtt_ms,
                        "direction": direction,
                        "unfitted": "the depth-1 times do not grow with URB size (noise on a fast path): no model",
                    });
                }
                json!({
                    "rtt_ms": rtt_ms,
                    "direction": direction,
                    "a_us_per_kib": fit.a_us_per_kib,
                    "round_trip_us": fit.rtt_us,
                    "advised_depth_1ms": model::advised_depth(fit.rtt_us, 1000.0),
                    "advised_depth_8ms": model::advised_depth(fit.rtt_us, 8000.0),
                })
            })
            .collect();
        let records: Vec<_> = self
            .records
            .iter()
            .map(|r| {
                let mut value = serde_json::to_value(r).unwrap_or_default();
                if let (Some(problem), Some(object)) = (r.measurement_problem(), value.as_object_mut()) {
                    object.insert("measurement_problem".into(), problem.into());
                }
                if let (Some(cipher), Some(object)) = (self.cipher, value.as_object_mut()) {
                    object.insert("ratio_to_cipher".into(), (r.mib_per_s / cipher.mib_per_s).into());
                }
                if let (Some(openssl), Some(object)) = (self.openssl_mib_per_s(), value.as_object_mut()) {
                    object.insert("ratio_to_openssl".into(), (r.mib_per_s / openssl).into());
                }
                value
            })
            .collect();
        let openssl = self.openssl.as_ref().map(|measured| match measured {
            Ok(speed) => json!(speed),
            Err(why) => json!({ "error": why }),
        });
        json!({ "records": records, "model": fits, "cipher_one_core": self.cipher, "openssl_aes_256_gcm": openssl })
    }

    /// `openssl speed`'s figure, when it was measured.
    fn openssl_mib_per_s(&self) -> Option<f64> {
        self.openssl.as_ref().and_then(|measured| measured.as_ref().ok()).map(|speed| speed.mib_per_s)
    }

    pub(crate) fn table(&self) -> String {
        let mut out = String::new();
        if let Some(cipher) = self.cipher {
            let _ = writeln!(
                out,
                "one core {}, 16 KiB records: {:.0} MiB/s (the `cipher` column: MiB/s over it)",
                cipher.cipher, cipher.mib_per_s
            );
        }
        match &self.openssl {
            Some(Ok(speed)) => {
                let _ = writeln!(
                    out,
                    "`{}`: {:.0} MiB/s (the `openssl` column: MiB/s over it)",
                    speed.command, speed.mib_per_s
                );
            }
            Some(Err(why)) => {
                let _ = writeln!(out, "no `openssl speed` figure: {why}");
            }
            None => {}
        }
        let openssl = self.openssl_mib_per_s();
        let _ = writeln!(
            out,
            "{:>6} {:>4} {:>9} {:>5} {:>10} {:>13} {:>10} {:>6} {:>9} {:>9} {:>9} {:>6} {:>7}",
            "rtt_ms",
            "dir",
            "urb_size",
            "depth",
            "MiB/s",
            "runs",
            "raw MiB/s",
            "ratio",
            "p50 us",
            "raw p50",
            "compress",
            if self.cipher.is_some() { "cipher" } else { "" },
            if openssl.is_some() { "openssl" } else { "" }
        );
        let mut problems = Vec::new();
        for r in &self.records {
            let problem = r.measurement_problem();
            let ratio = format!("{:.2}{}", r.ratio_to_raw_tcp, if problem.is_some() { "!" } else { "" });
            let _ = writeln!(
                out,
                "{:>6} {:>4} {:>9} {:>5} {:>10.1} {:>13} {:>10.1} {:>6} {:>9.0} {:>9.0} {:>9} {:>6} {:>7}",
                r.rtt_ms,
                format!("{:?}", r.direction).to_lowercase(),
                r.urb_size,
                r.depth,
                r.mib_per_s,
                spread(&r.runs_mib_per_s),
                r.raw_tcp_mib_per_s,
                ratio,
                r.latency_us.p50,
                r.raw_tcp_latency_us.p50,
                r.compression_ratio.map_or("-".to_owned(), |c| format!("{c:.1}x")),
                self.cipher.map_or(String::new(), |c| format!("{:.2}", r.mib_per_s / c.mib_per_s)),
                openssl.map_or(String::new(), |o| format!("{:.2}", r.mib_per_s / o))
            );
            problems.extend(problem);
        }
        if let Some(problem) = problems.first() {
            let _ = writeln!(out, "\n! {} point(s) not trusted: {problem}", problems.len());
        }
        for (rtt_ms, direction, fit) in &self.fits {
            if !fit.is_physical() {
                let _ = writeln!(
                    out,
                    "\nmodel (rtt {rtt_ms} ms, {direction:?}): not fitted: the depth-1 times do not grow with URB size \
                     (noise on a fast path); measure with --rtt-ms or more sizes"
                );
                continue;
            }
            let _ = writeln!(
                out,
                "\nmodel (rtt {rtt_ms} ms, {direction:?}): time per URB = {:.3} us/KiB x size + {:.0} us; a periodic stream needs depth > RTT/x + 1: {} URBs at 1 ms, {} at 8 ms",
                fit.a_us_per_kib,
                fit.rtt_us,
                model::advised_depth(fit.rtt_us, 1000.0),
                model::advised_depth(fit.rtt_us, 8000.0)
            );
        }
        out
    }
}

fn counters(stats: &usbwire_transport::transform::TransformStats) -> [u64; 4] {
    use std::sync::atomic::Ordering::Relaxed;
    [
        stats.plain_sent.load(Relaxed),
        stats.wire_sent.load(Relaxed),
        stats.wire_received.load(Relaxed),
        stats.plain_received.load(Relaxed),
    ]
}

/// The runs' range, `min–max` (one run: its value).
fn spread(runs: &[f64]) -> String {
    let min = runs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = runs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    match runs.len() {
        0 => "-".into(),
        1 => format!("{min:.1}"),
        _ => format!("{min:.0}–{max:.0}"),
    }
}

/// The run with the median throughput.
fn median(mut runs: Vec<ceiling::Measured>) -> ceiling::Measured {
    runs.sort_by(|a, b| a.mib_per_s.total_cmp(&b.mib_per_s));
    let middle = runs.len() / 2;
    runs.swap_remove(middle)
}

pub(crate) fn csv(records: &[Record]) -> String {
    let mut out = String::from("direction,urb_size,depth,rtt_ms,mib_per_s,raw_tcp_mib_per_s,ratio_to_raw_tcp,urbs_per_s,p50_us,p90_us,p99_us,max_us,raw_p50_us,raw_p99_us\n");
    for r in records {
        let _ = writeln!(
            out,
            "{},{},{},{},{:.3},{:.3},{:.4},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1}",
            format!("{:?}", r.direction).to_lowercase(),
            r.urb_size,
            r.depth,
            r.rtt_ms,
            r.mib_per_s,
            r.raw_tcp_mib_per_s,
            r.ratio_to_raw_tcp,
            r.urbs_per_s,
            r.latency_us.p50,
            r.latency_us.p90,
            r.latency_us.p99,
            r.latency_us.max,
            r.raw_tcp_latency_us.p50,
            r.raw_tcp_latency_us.p99
        );
    }
    out
}
