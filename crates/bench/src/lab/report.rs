//! What a lab bench run found, per phase: operations, time, latencies and
//! what etcd and this process spent; as JSON and as the table `usbwire bench
//! --registry` prints. No I/O.

use std::collections::BTreeMap;

use serde_json::json;
use usbwire_lab::DEFAULT_TTL;

use super::etcd_metrics::Cost;

/// The etcd methods the table shows, in its order (others still go into `--json`).
const METHODS: [&str; 8] =
    ["Range", "Txn", "Put", "DeleteRange", "LeaseGrant", "LeaseRevoke", "LeaseKeepAlive", "Watch"];

/// One phase: how many operations, how long, their latencies, and what etcd saw.
pub(crate) struct Phase {
    pub(crate) name: &'static str,
    /// What one operation is (`device`, `list`, `reservation`, …).
    pub(crate) unit: &'static str,
    pub(crate) ops: usize,
    pub(crate) seconds: f64,
    /// Milliseconds, one per operation (per server for the registration).
    pub(crate) latencies_ms: Vec<f64>,
    pub(crate) cost: Cost,
}

impl Phase {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.seconds.max(1e-9)
    }

    fn json(&self) -> serde_json::Value {
        let per_op = |x: f64| x / self.ops.max(1) as f64;
        let etcd = self.cost.etcd.as_ref().map(|counters| {
            let requests_per_op: BTreeMap<&String, f64> =
                counters.requests.iter().map(|(method, n)| (method, per_op(*n))).collect();
            json!({
                "requests": counters.requests,
                "requests_per_op": requests_per_op,
                "bytes_sent": counters.sent,
                "bytes_received": counters.received,
                "bytes_sent_per_op": per_op(counters.sent),
                "handling_ms_per_request": counters.handling_ms(),
                "cpu_seconds": counters.cpu,
                "cpu_ms_per_op": per_op(counters.cpu * 1e3),
            })
        });
        json!({
            "unit": self.unit,
            "ops": self.ops,
            "seconds": self.seconds,
            "ops_per_second": self.rate(),
            "latency_ms": latency_json(&self.latencies_ms),
            "etcd": etcd,
            "bench_cpu_seconds": self.cost.bench_cpu,
            "bench_cpu_ms_per_op": per_op(self.cost.bench_cpu * 1e3),
            "waited_for_idle_etcd_seconds": self.cost.waited,
        })
    }
}

/// The outcome of a run: its scale, the reservations' result and each phase.
pub struct Report {
    pub(crate) servers: usize,
    pub(crate) per_server: usize,
    pub(crate) keyboard_every: usize,
    pub(crate) clients: usize,
    /// The prefix the run registered under (deleted afterwards by the caller).
    pub prefix: String,
    pub(crate) want: String,
    pub(crate) matching: usize,
    pub(crate) reserved: usize,
    /// Server and device entries that left the registry while the fleet
    /// registered: leases that ran out under the load (0 in a storm survived).
    pub(crate) registration_lost: usize,
    /// Seconds from the start until the servers had written their last key
    /// (index and free keys follow the device keys the phase waits for).
    pub(crate) settled_seconds: f64,
    /// Milliseconds each successful `reserve` took.
    pub(crate) reserved_ms: Vec<f64>,
    pub(crate) reserve_seconds: f64,
    pub(crate) none_free: usize,
    /// Other failures of `reserve`.
    pub(crate) failed: usize,
    /// How many failed with each error.
    pub(crate) errors: BTreeMap<String, usize>,
    pub(crate) phases: Vec<Phase>,
}

impl Report {
    /// The document `--json` prints (the CLI adds the registry and the keys deleted).
    pub fn json(&self) -> serde_json::Value {
        let phases: serde_json::Map<String, serde_json::Value> =
            self.phases.iter().map(|phase| (phase.name.to_owned(), phase.json())).collect();
        json!({
            "prefix": self.prefix,
            "servers": self.servers,
            "devices_per_server": self.per_server,
            "keyboard_every": self.keyboard_every,
            "devices": self.servers * self.per_server,
            "clients": self.clients,
            "want": self.want,
            "matching": self.matching,
            "reserved": self.reserved,
            "registration_lost": self.registration_lost,
            "settled_seconds": self.settled_seconds,
            "reservations_per_second": self.reserved as f64 / self.reserve_seconds.max(1e-9),
            "reserved_latency_ms": latency_json(&self.reserved_ms),
            "none_free": self.none_free,
            "failed": self.failed,
            "errors": self.errors,
            "phases": phases,
        })
    }

    /// The table printed without `--json`; `registry` is the URL as given.
    pub fn table(&self, registry: &str) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let devices = self.servers * self.per_server;
        let _ = writeln!(
            out,
            "lab registry {registry} (this run under {}/): {} servers x {} devices = {devices} (a keyboard every {}), {} clients reserving {} ({} match)",
            self.prefix, self.servers, self.per_server, self.keyboard_every, self.clients, self.want, self.matching
        );
        let mut reserved_ms = self.reserved_ms.clone();
        reserved_ms.sort_by(f64::total_cmp);
        let ms = |q: f64| percentile(&reserved_ms, q).map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
        let _ = writeln!(
            out,
            "reserved {} in {:.2} s = {:.1}/s (p50 {} ms, p99 {} ms, max {} ms), none free {}, failed {}",
            self.reserved,
            self.reserve_seconds,
            self.reserved as f64 / self.reserve_seconds.max(1e-9),
            ms(0.50),
            ms(0.99),
            ms(1.0),
            self.none_free,
            self.failed,
        );
        for (error, count) in &self.errors {
            let _ = writeln!(out, "  {count} x {error}");
        }
        let _ = writeln!(
            out,
            "while registering, {} server and device entries left the registry (leases that ran out) and were put again",
            self.registration_lost
        );
        let _ = writeln!(
            out,
            "the servers wrote their last keys (index, free devices) {:.2} s after the start; the phases below began then",
            self.settled_seconds
        );
        let _ = writeln!(
            out,
            "\n{:<16} {:>7} {:<12} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8}",
            "phase", "ops", "unit", "time s", "ops/s", "p50 ms", "p95 ms", "p99 ms", "max ms"
        );
        for phase in &self.phases {
            let mut latencies = phase.latencies_ms.clone();
            latencies.sort_by(f64::total_cmp);
            let ms = |q: f64| percentile(&latencies, q).map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
            let _ = writeln!(
                out,
                "{:<16} {:>7} {:<12} {:>8.2} {:>9.1} {:>8} {:>8} {:>8} {:>8}",
                phase.name,
                phase.ops,
                phase.unit,
                phase.seconds,
                phase.rate(),
                ms(0.50),
                ms(0.95),
                ms(0.99),
                ms(1.0)
            );
        }
        for phase in self.phases.iter().filter(|phase| phase.cost.waited >= 0.5) {
            let _ = writeln!(
                out,
                "(before {}: {:.1} s waiting for etcd to finish requests already abandoned by their clients)",
                phase.name, phase.cost.waited
            );
        }
        self.etcd_requests(&mut out);
        self.etcd_timing(&mut out);
        out
    }

    /// etcd's requests per operation, per phase (when its /metrics was readable).
    fn etcd_requests(&self, out: &mut String) {
        use std::fmt::Write as _;
        if self.phases.iter().all(|phase| phase.cost.etcd.is_none()) {
            let _ = writeln!(out, "\netcd request counts not read (its /metrics was not reachable over plain HTTP)");
            return;
        }
        let _ = writeln!(out, "\netcd requests per operation (gRPC messages received, all members)");
        let _ = write!(out, "{:<16}", "phase");
        for method in METHODS {
            let _ = write!(out, " {:>8}", short(method));
        }
        let _ = writeln!(out, " {:>9} {:>9} {:>9}", "KiB out", "etcd CPU", "bench CPU");
        for phase in &self.phases {
            let Some(counters) = &phase.cost.etcd else { continue };
            let per_op = |n: f64| n / phase.ops.max(1) as f64;
            let _ = write!(out, "{:<16}", phase.name);
            for method in METHODS {
                let n = counters.requests.get(method).copied().unwrap_or(0.0);
                let _ = write!(out, " {:>8}", if n == 0.0 { "-".to_owned() } else { format!("{:.3}", per_op(n)) });
            }
            let _ = writeln!(
                out,
                " {:>9.1} {:>9.3} {:>9.3}",
                per_op(counters.sent) / 1024.0,
                per_op(counters.cpu * 1e3),
                per_op(phase.cost.bench_cpu * 1e3)
            );
        }
        let _ = writeln!(
            out,
            "(KeepAl: lease renewals, about one per server every {:.1} s in the background; KiB out: etcd's gRPC bytes sent; CPU: ms of CPU time)",
            DEFAULT_TTL.as_secs_f64() / 3.0
        );
    }

    /// etcd's own time per request, per phase (when it reported any).
    fn etcd_timing(&self, out: &mut String) {
        use std::fmt::Write as _;
        let timed = ["Range", "Txn", "Put", "LeaseGrant", "LeaseRevoke"];
        if self.phases.iter().any(|phase| phase.cost.etcd.as_ref().is_some_and(|c| !c.handling.is_empty())) {
            let _ = write!(out, "\netcd's time per request, mean ms (server side)\n{:<16}", "phase");
            for method in timed {
                let _ = write!(out, " {:>8}", short(method));
            }
            let _ = writeln!(out);
            for phase in &self.phases {
                let Some(counters) = &phase.cost.etcd else { continue };
                let handling = counters.handling_ms();
                let _ = write!(out, "{:<16}", phase.name);
                for method in timed {
                    let ms = handling.get(method).map_or_else(|| "-".to_owned(), |ms| format!("{ms:.2}"));
                    let _ = write!(out, " {ms:>8}");
                }
                let _ = writeln!(out);
            }
        }
    }
}

fn short(method: &str) -> &str {
    match method {
        "DeleteRange" => "DelRange",
        "LeaseGrant" => "Grant",
        "LeaseRevoke" => "Revoke",
        "LeaseKeepAlive" => "KeepAl",
        other => other,
    }
}

fn latency_json(ms: &[f64]) -> serde_json::Value {
    let mut sorted = ms.to_vec();
    sorted.sort_by(f64::total_cmp);
    json!({
        "n": sorted.len(),
        "p50": percentile(&sorted, 0.50),
        "p95": percentile(&sorted, 0.95),
        "p99": percentile(&sorted, 0.99),
        "max": sorted.last(),
    })
}

/// Nearest rank, of sorted values.
fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::etcd_metrics::Counters;

    #[test]
    fn percentiles_by_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.50), Some(50.0));
        assert_eq!(percentile(&values, 0.99), Some(99.0));
        assert_eq!(percentile(&values, 1.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 0.95), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    fn report(etcd: Option<Counters>) -> Report {
        let phase = |name, etcd| Phase {
            name,
            unit: "device",
            ops: 4,
            seconds: 2.0,
            latencies_ms: vec![1.0, 2.0, 3.0, 4.0],
            cost: Cost { etcd, bench_cpu: 0.008, waited: 0.0 },
        };
        Report {
            servers: 2,
            per_server: 2,
            keyboard_every: 10,
            clients: 1,
            prefix: "/bench/1".to_owned(),
            want: "class=03".to_owned(),
            matching: 4,
            reserved: 1,
            registration_lost: 0,
            settled_seconds: 2.5,
            reserved_ms: vec![5.0],
            reserve_seconds: 0.5,
            none_free: 0,
            failed: 0,
            errors: BTreeMap::new(),
            phases: vec![phase("register", etcd.clone()), phase("list", etcd)],
        }
    }

    #[test]
    fn the_table_has_a_row_per_phase_and_etcd_sections_only_when_etcd_was_read() {
        let unread = report(None).table("etcd://127.0.0.1:2379/lab");
        assert!(unread.starts_with("lab registry etcd://127.0.0.1:2379/lab (this run under /bench/1/): 2 servers x 2 devices = 4 (a keyboard every 10), 1 clients reserving class=03 (4 match)\n"));
        assert!(unread.contains("\nregister               4 device           2.00       2.0"), "{unread}");
        assert!(unread.contains("\nlist                   4 device"), "{unread}");
        assert!(unread.ends_with("etcd request counts not read (its /metrics was not reachable over plain HTTP)\n"));
        assert!(!unread.contains("time per request"));

        let mut counters = Counters::default();
        counters.requests.insert("Range".to_owned(), 8.0);
        counters.handling.insert("Range".to_owned(), 0.004);
        counters.sent = 4096.0;
        let read = report(Some(counters)).table("etcd://127.0.0.1:2379/lab");
        assert!(read.contains("etcd requests per operation"), "{read}");
        let row = read.lines().find(|l| l.starts_with("register") && l.contains("2.000")).expect("Range per op row");
        assert!(row.contains(" 1.0 "), "1 KiB out per op: {row}");
        assert!(read.contains("etcd's time per request, mean ms (server side)"), "{read}");
        assert!(read.lines().any(|l| l.starts_with("list") && l.contains(" 0.50 ")), "0.5 ms per Range: {read}");
    }
}
