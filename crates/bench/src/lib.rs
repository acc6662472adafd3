//! Benchmarks for USB/IP links, in the shape of the USB/IP paper's analysis:
//! throughput per URB size and queue depth in both directions, small-URB
//! latency, each next to the **ceiling** — raw TCP over the same path with the
//! same message shapes and the same number in flight, against an ideal server
//! that does no work ([`ceiling`]). A userspace [`proxy`] adds RTT and jitter
//! (this kernel has no netem). [`model`] fits time-per-URB = a·size + RTT and
//! gives the queue depth a periodic stream needs. [`resume_time`] cuts a
//! resumable connection and times the stall each cut causes. [`matrix`] runs
//! the whole matrix `usbwire bench` prints, against the device [`target`]
//! imports (or its in-process loopback server); over TLS it puts the rates in
//! proportion to one core's sealing of records ([`cipher_speed`]) and
//! `openssl speed` ([`openssl_speed`]). [`storage_rate`] measures a disk's
//! READ(10) and WRITE(10) through the kernel relay, its storage accelerator
//! off and on, with the Bulk-Only host of [`storage`]. `lab` (feature `lab`)
//! measures the lab registry on etcd with a simulated fleet.
//!
//! Benchmarks are not tests: nothing here asserts on timings.

pub mod ceiling;
pub mod cipher_speed;
mod error;
#[cfg(feature = "lab")]
pub mod lab;
pub mod matrix;
pub mod measure;
pub mod model;
pub mod openssl_speed;
pub mod periodic;
pub mod plot;
pub mod proxy;
pub mod resume_time;
pub mod storage;
pub mod storage_rate;
pub mod target;
pub mod urb_link;

use std::future::Future;
use std::net::SocketAddr;

use serde::Serialize;

pub use error::BenchError;

/// Runs a server on a thread of its own with a single-threaded runtime, as if
/// it were another process: `start` binds and spawns its tasks and returns the
/// address; the thread then serves until the process exits.
///
/// Why: client and server sharing one multi-threaded runtime on a small
/// machine measure tokio's cross-worker wake-ups more than either side. Both
/// usbwire's server and the ideal server run this way, so the comparison
/// stays like for like.
pub fn server_thread<F, Fut>(name: &str, start: F) -> std::io::Result<SocketAddr>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = std::io::Result<SocketAddr>>,
{
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new().name(name.into()).spawn(move || {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(runtime) => runtime,
            Err(error) => {
                let _ = tx.send(Err(error));
                return;
            }
        };
        runtime.block_on(async move {
            let _ = tx.send(start().await);
            std::future::pending::<()>().await;
        });
    })?;
    rx.recv().map_err(|_| std::io::Error::other("the server thread ended before it started"))?
}

/// Runs a benchmark's clients to completion on a thread of their own with a
/// single-threaded runtime, like the servers ([`server_thread`]); the caller
/// awaits the result without blocking its runtime.
///
/// Why: on a multi-threaded runtime the measuring loop (in `block_on`, on the
/// main thread) and the connection's reader and writer tasks (on workers)
/// wake each other across threads for every batch, and the ceiling's client
/// pays a cross-thread wake from the I/O driver for every read; both measure
/// the runtime more than the protocol. A client process of its own with one
/// thread is the setup every party then shares: the ceiling's client and
/// usbwire's run on this same thread.
///
/// The work runs as a task, not as the `block_on` future: when a task wakes
/// the `block_on` future, the runtime polls the I/O driver (an `epoll_wait`)
/// before polling it, where a woken task simply runs next. The measuring loop
/// is woken by usbwire's reader task once per batch of completions.
pub async fn client_thread<F, Fut, T>(name: &str, work: F) -> std::io::Result<T>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name(name.into()).spawn(move || {
        let outcome = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .and_then(|runtime| runtime.block_on(runtime.spawn(work())).map_err(std::io::Error::other));
        let _ = tx.send(outcome);
    })?;
    rx.await.map_err(|_| std::io::Error::other("the client thread ended without a result"))?
}

/// Transfer direction, as a benchmark sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Device to host (bulk IN, "source").
    In,
    /// Host to device (bulk OUT, "sink").
    Out,
}

/// Latency percentiles in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    /// From samples in microseconds (sorted in place).
    pub fn of(samples: &mut [f64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
        Self { p50: at(0.50), p90: at(0.90), p99: at(0.99), max: samples[samples.len() - 1] }
    }
}

/// One measured point: usbwire and the ceiling side by side.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    pub direction: Direction,
    pub urb_size: usize,
    pub depth: usize,
    pub rtt_ms: f64,
    pub mib_per_s: f64,
    pub raw_tcp_mib_per_s: f64,
    pub ratio_to_raw_tcp: f64,
    /// Round trips per second.
    pub urbs_per_s: f64,
    /// Per-URB latency (submit to completion) at this point.
    pub latency_us: Percentiles,
    pub raw_tcp_latency_us: Percentiles,
    /// With compression negotiated: payload bytes per byte on the wire in this direction.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compression_ratio: Option<f64>,
    /// The runs behind the medians (MiB/s), in the order they ran.
    pub runs_mib_per_s: Vec<f64>,
    pub raw_tcp_runs_mib_per_s: Vec<f64>,
}

/// Above this ratio to the raw-TCP ceiling a point is a measurement problem,
/// not a result: nothing over the same path beats plain TCP by more than noise.
pub const MAX_PLAUSIBLE_RATIO: f64 = 1.05;

impl Record {
    /// Why this point should not be trusted, if it should not.
    pub fn measurement_problem(&self) -> Option<String> {
        (self.ratio_to_raw_tcp > MAX_PLAUSIBLE_RATIO).then(|| {
            format!(
                "{:.2} of the raw-TCP ceiling is above {MAX_PLAUSIBLE_RATIO}: the ceiling's runs were disturbed \
                 (the machine was busy); measure again with more --repeat",
                self.ratio_to_raw_tcp
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_point_above_the_ceiling_is_a_measurement_problem_not_a_result() {
        let mut record = Record {
            direction: Direction::In,
            urb_size: 512,
            depth: 8,
            rtt_ms: 0.0,
            mib_per_s: 124.0,
            raw_tcp_mib_per_s: 100.0,
            ratio_to_raw_tcp: 1.24,
            urbs_per_s: 0.0,
            latency_us: Percentiles::default(),
            raw_tcp_latency_us: Percentiles::default(),
            compression_ratio: None,
            runs_mib_per_s: vec![120.0, 124.0, 130.0],
            raw_tcp_runs_mib_per_s: vec![90.0, 100.0, 140.0],
        };
        assert!(record.measurement_problem().is_some_and(|why| why.contains("1.24")));
        record.ratio_to_raw_tcp = 1.05;
        assert_eq!(record.measurement_problem(), None, "within noise");
    }
}
