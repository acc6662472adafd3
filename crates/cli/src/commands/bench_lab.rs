//! `usbwire bench --registry etcd://…`: the lab registry at scale.
//!
//! A simulated fleet registers in a prefix of its own (`PREFIX/bench-PID`):
//! N in-process servers of M virtual devices each, every server with its own
//! publisher task and etcd connection, as N machines would have; nothing
//! connects to their (made-up) addresses. Then, in phases: registration (until
//! a watch has seen every device), list latency (`Lab::fleet`, one client, one
//! call after another), K clients connecting, K clients reserving one device of
//! `label=nucleo` each at once, and the K releases. etcd's own request counters
//! (`/metrics` of every member, summed) are read before and after each phase,
//! so each phase reports what it cost etcd per operation; each phase begins
//! once etcd has no request in progress (one a client gave up on still runs
//! to its end in etcd, and belongs to no later phase). With `etcd --metrics
//! extensive`, etcd's own time per request is shown too. The publishers are
//! stopped and the prefix deleted at the end.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::task::JoinSet;
use usbwire_device::Speed;
use usbwire_lab::publish::Registration;
use usbwire_lab::{Endpoint, Hold, Lab, LabError, Reservation, ServerEntry, Want, DEFAULT_TTL};
use usbwire_server::{Selector, Server, ServerConfig};

use super::common::registry::failure;
use crate::args::BenchArgs;
use crate::exit::Failure;

/// Every this many devices of the fleet (counted across servers) gets the label.
const LABEL_EVERY: usize = 10;
const LABEL: &str = "nucleo";
const LIST_CALLS: usize = 20;
/// Longer than any run: a reservation left behind by a failed run still ends by itself.
const HOLD: Duration = Duration::from_secs(600);
/// How long the whole fleet may take to show up before the bench gives up.
const REGISTRATION_TIMEOUT: Duration = Duration::from_secs(600);
/// The etcd methods the table shows, in its order (others still go into `--json`).
const METHODS: [&str; 8] =
    ["Range", "Txn", "Put", "DeleteRange", "LeaseGrant", "LeaseRevoke", "LeaseKeepAlive", "Watch"];

pub(crate) async fn run(args: &BenchArgs) -> Result<(), Failure> {
    let servers = args.servers.unwrap_or(100);
    let per_server = args.devices_per_server.unwrap_or(10);
    let clients = args.clients.unwrap_or(100);
    if servers == 0 || per_server == 0 || clients == 0 || servers > 250 * 250 {
        return Err(Failure::usage(anyhow!(
            "--servers (1..62500), --devices-per-server and --clients must be at least 1"
        )));
    }
    let mut endpoint = super::common::registry::endpoint(&args.registry)
        .ok_or_else(|| Failure::usage(anyhow!("--registry etcd://HOST:PORT is required")))?;
    let base = endpoint.url.to_string();
    endpoint.url.prefix = format!("{}/bench-{}", endpoint.url.prefix, std::process::id());
    let progress = !args.json && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let metrics = Metrics::new(&endpoint);
    let mut fleet = SimulatedFleet::default();
    let outcome = phases(&endpoint, &metrics, &mut fleet, (servers, per_server, clients), progress).await;
    fleet.stop();
    let deleted = delete_prefix(&endpoint).await;
    let report = outcome?;
    let deleted = deleted.map_err(|e| Failure::unavailable(anyhow!("deleting {}/: {e}", endpoint.url.prefix)))?;
    if args.json {
        let mut document = report.json();
        document["registry"] = json!(base);
        document["keys_deleted"] = json!(deleted);
        super::common::output::print_json(&document, true);
    } else {
        print!("{}", report.table(&base));
        println!("deleted {deleted} keys under {}/", endpoint.url.prefix);
    }
    Ok(())
}

/// The in-process servers and their publishers.
#[derive(Default)]
struct SimulatedFleet {
    /// Kept for as long as their devices are to stay exported.
    servers: Vec<Server>,
    publishers: Vec<tokio::task::JoinHandle<()>>,
}

impl SimulatedFleet {
    /// Builds N servers of M loopback devices; returns their registrations
    /// (labelled devices by bus id) and how many devices carry the label.
    fn build(&mut self, endpoint: &Endpoint, servers: usize, per_server: usize) -> (Vec<Registration>, usize) {
        let mut registrations = Vec::with_capacity(servers);
        let mut labelled = 0;
        for i in 0..servers {
            let mut server = Server::new(ServerConfig::default());
            let mut labels = Vec::new();
            for j in 0..per_server {
                let busid = server.export("loopback", Box::new(usbwire_gadgets::loopback(Speed::HIGH)));
                if (i * per_server + j).is_multiple_of(LABEL_EVERY) {
                    labels.push((Selector::BusId(busid.as_str().to_owned()), vec![LABEL.to_owned()]));
                    labelled += 1;
                }
            }
            registrations.push(Registration {
                endpoint: endpoint.clone(),
                ttl: DEFAULT_TTL,
                server: ServerEntry {
                    schema_version: usbwire_lab::entry::SCHEMA_VERSION,
                    address: format!("10.99.{}.{}:3240", i / 250, i % 250),
                    tls_fingerprint: None,
                    plain: true,
                    implementation: "usbwire".to_owned(),
                    version: crate::args::VERSION.to_owned(),
                    started_at: usbwire_lab::entry::timestamp(std::time::SystemTime::now()),
                },
                labels,
            });
            self.servers.push(server);
        }
        (registrations, labelled)
    }

    fn start(&mut self, registrations: Vec<Registration>) {
        for (registration, server) in registrations.into_iter().zip(&self.servers) {
            let registry = server.registry().clone();
            // Stopped by aborting (see `stop`): no revocation per server.
            let publishing = usbwire_lab::publish::publish(registration, registry, std::future::pending());
            self.publishers.push(tokio::spawn(publishing));
        }
    }

    /// Stops publishing; the registrations' leases are left to expire (the prefix is deleted anyway).
    fn stop(&mut self) {
        for task in self.publishers.drain(..) {
            task.abort();
        }
        self.servers.clear();
    }
}

/// One phase: how many operations, how long, their latencies, and what etcd saw.
struct Phase {
    name: &'static str,
    /// What one operation is (`device`, `list`, `reservation`, …).
    unit: &'static str,
    ops: usize,
    seconds: f64,
    /// Milliseconds, one per operation (per server for the registration).
    latencies_ms: Vec<f64>,
    cost: Cost,
}

/// What a phase cost, and how long it waited for etcd to be idle before it began.
struct Cost {
    /// etcd's counters over the phase; `None` when they could not be read.
    etcd: Option<Counters>,
    /// CPU seconds of this process (the simulated servers and clients).
    bench_cpu: f64,
    waited: f64,
}

/// Where a phase began.
struct Mark {
    etcd: Option<Counters>,
    bench_cpu: f64,
    waited: f64,
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

struct Report {
    servers: usize,
    per_server: usize,
    clients: usize,
    prefix: String,
    want: String,
    matching: usize,
    reserved: usize,
    /// Milliseconds each successful `reserve` took.
    reserved_ms: Vec<f64>,
    reserve_seconds: f64,
    none_free: usize,
    /// Other failures of `reserve`.
    failed: usize,
    /// How many failed with each error.
    errors: BTreeMap<String, usize>,
    phases: Vec<Phase>,
}

impl Report {
    fn json(&self) -> serde_json::Value {
        let phases: serde_json::Map<String, serde_json::Value> =
            self.phases.iter().map(|phase| (phase.name.to_owned(), phase.json())).collect();
        json!({
            "prefix": self.prefix,
            "servers": self.servers,
            "devices_per_server": self.per_server,
            "devices": self.servers * self.per_server,
            "clients": self.clients,
            "want": self.want,
            "matching": self.matching,
            "reserved": self.reserved,
            "reservations_per_second": self.reserved as f64 / self.reserve_seconds.max(1e-9),
            "reserved_latency_ms": latency_json(&self.reserved_ms),
            "none_free": self.none_free,
            "failed": self.failed,
            "errors": self.errors,
            "phases": phases,
        })
    }

    fn table(&self, registry: &str) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let devices = self.servers * self.per_server;
        let _ = writeln!(
            out,
            "lab registry {registry} (this run under {}/): {} servers x {} devices = {devices}, {} clients reserving {} ({} match)",
            self.prefix, self.servers, self.per_server, self.clients, self.want, self.matching
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
            "\n{:<13} {:>7} {:<12} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8}",
            "phase", "ops", "unit", "time s", "ops/s", "p50 ms", "p95 ms", "p99 ms", "max ms"
        );
        for phase in &self.phases {
            let mut latencies = phase.latencies_ms.clone();
            latencies.sort_by(f64::total_cmp);
            let ms = |q: f64| percentile(&latencies, q).map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
            let _ = writeln!(
                out,
                "{:<13} {:>7} {:<12} {:>8.2} {:>9.1} {:>8} {:>8} {:>8} {:>8}",
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
        if self.phases.iter().all(|phase| phase.cost.etcd.is_none()) {
            let _ = writeln!(out, "\netcd request counts not read (its /metrics was not reachable over plain HTTP)");
            return out;
        }
        let _ = writeln!(out, "\netcd requests per operation (gRPC messages received, all members)");
        let _ = write!(out, "{:<13}", "phase");
        for method in METHODS {
            let _ = write!(out, " {:>8}", short(method));
        }
        let _ = writeln!(out, " {:>9} {:>9} {:>9}", "KiB out", "etcd CPU", "bench CPU");
        for phase in &self.phases {
            let Some(counters) = &phase.cost.etcd else { continue };
            let per_op = |n: f64| n / phase.ops.max(1) as f64;
            let _ = write!(out, "{:<13}", phase.name);
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
        let timed = ["Range", "Txn", "Put", "LeaseGrant", "LeaseRevoke"];
        if self.phases.iter().any(|phase| phase.cost.etcd.as_ref().is_some_and(|c| !c.handling.is_empty())) {
            let _ = write!(out, "\netcd's time per request, mean ms (server side)\n{:<13}", "phase");
            for method in timed {
                let _ = write!(out, " {:>8}", short(method));
            }
            let _ = writeln!(out);
            for phase in &self.phases {
                let Some(counters) = &phase.cost.etcd else { continue };
                let handling = counters.handling_ms();
                let _ = write!(out, "{:<13}", phase.name);
                for method in timed {
                    let ms = handling.get(method).map_or_else(|| "-".to_owned(), |ms| format!("{ms:.2}"));
                    let _ = write!(out, " {ms:>8}");
                }
                let _ = writeln!(out);
            }
        }
        out
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

fn millis(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn progress_bar(progress: bool, len: usize, message: &'static str) -> indicatif::ProgressBar {
    if !progress {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg} ({elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(message);
    bar
}

async fn phases(
    endpoint: &Endpoint,
    metrics: &Metrics,
    fleet: &mut SimulatedFleet,
    (servers, per_server, clients): (usize, usize, usize),
    progress: bool,
) -> Result<Report, Failure> {
    let devices = servers * per_server;
    let mut observer = Lab::connect(endpoint.clone()).await.map_err(failure)?;
    let mut phases = Vec::new();

    // Registration: from spawning every publisher at once until a watch has
    // seen each server and each of its devices (event-driven, so the bench
    // adds no polling load to what it measures).
    let (registrations, matching) = fleet.build(endpoint, servers, per_server);
    let start_revision = observer.fleet().await.map_err(failure)?.revision;
    let mut watch = observer.watch(start_revision).await.map_err(failure)?;
    let before = metrics.begin().await;
    let started = Instant::now();
    fleet.start(registrations);
    let bar = progress_bar(progress, devices, "devices registered");
    let mut registered: HashSet<String> = HashSet::new();
    let mut seen: HashSet<(String, String)> = HashSet::new();
    let mut per_server_seen: HashMap<String, usize> = HashMap::new();
    let mut server_done_ms = Vec::with_capacity(servers);
    while seen.len() < devices || registered.len() < servers {
        let next = tokio::time::timeout(REGISTRATION_TIMEOUT.saturating_sub(started.elapsed()), watch.next()).await;
        let batch = match next {
            Ok(batch) => batch.map_err(failure)?,
            Err(_) => {
                return Err(Failure::unavailable(anyhow!(
                "only {} of {devices} devices and {} of {servers} servers registered within {REGISTRATION_TIMEOUT:?}",
                seen.len(),
                registered.len()
            )))
            }
        };
        let Some(batch) = batch else {
            return Err(Failure::unavailable(anyhow!("the lab registry ended the watch during registration")));
        };
        for change in batch.into_iter().filter(|change| change.entry.is_some()) {
            match change.what {
                "server" => {
                    registered.insert(change.server);
                }
                "device" => {
                    let Some(busid) = change.busid else { continue };
                    // A server that registers again puts its devices again: count each once.
                    if !seen.insert((change.server.clone(), busid)) {
                        continue;
                    }
                    bar.inc(1);
                    let count = per_server_seen.entry(change.server).or_default();
                    *count += 1;
                    if *count == per_server {
                        server_done_ms.push(millis(started));
                    }
                }
                _ => {}
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    // A publisher sets up its reservation watch after its devices are listed:
    // count that too (not in the time), one watch each.
    metrics.settle(before.etcd.as_ref(), "Watch", servers).await;
    phases.push(Phase {
        name: "registration",
        unit: "device",
        ops: devices,
        seconds,
        latencies_ms: server_done_ms,
        cost: metrics.end(before).await,
    });
    drop(watch);

    let listed = observer.fleet().await.map_err(failure)?;
    if listed.devices.len() != devices || listed.servers.len() != servers {
        return Err(Failure::software(anyhow!(
            "the fleet lists {} servers and {} devices, registered were {servers} and {devices}",
            listed.servers.len(),
            listed.devices.len()
        )));
    }

    // List latency: one client, one call after another.
    let before = metrics.begin().await;
    let started = Instant::now();
    let mut list_ms = Vec::with_capacity(LIST_CALLS);
    for _ in 0..LIST_CALLS {
        let call = Instant::now();
        let listed = observer.fleet().await.map_err(failure)?;
        list_ms.push(millis(call));
        std::hint::black_box(listed);
    }
    phases.push(Phase {
        name: "list",
        unit: "list",
        ops: LIST_CALLS,
        seconds: started.elapsed().as_secs_f64(),
        latencies_ms: list_ms,
        cost: metrics.end(before).await,
    });

    // K clients, each with its own connection, as K machines would have.
    let before = metrics.begin().await;
    let started = Instant::now();
    let bar = progress_bar(progress, clients, "clients connected");
    let mut connecting = JoinSet::new();
    for _ in 0..clients {
        let endpoint = endpoint.clone();
        connecting.spawn(async move {
            let call = Instant::now();
            Lab::connect(endpoint).await.map(|lab| (lab, millis(call)))
        });
    }
    let mut labs = Vec::with_capacity(clients);
    let mut connect_ms = Vec::with_capacity(clients);
    while let Some(joined) = connecting.join_next().await {
        let (lab, ms) = joined.map_err(|e| Failure::software(e.into()))?.map_err(failure)?;
        labs.push(lab);
        connect_ms.push(ms);
        bar.inc(1);
    }
    bar.finish_and_clear();
    phases.push(Phase {
        name: "connect",
        unit: "client",
        ops: clients,
        seconds: started.elapsed().as_secs_f64(),
        latencies_ms: connect_ms,
        cost: metrics.end(before).await,
    });

    // Every client reserves one matching device at once.
    let want: Want =
        format!("label={LABEL}").parse().map_err(|e: usbwire_lab::WantError| Failure::software(e.into()))?;
    let before = metrics.begin().await;
    let started = Instant::now();
    let bar = progress_bar(progress, clients, "reservations tried");
    let mut reserving = JoinSet::new();
    for mut lab in labs {
        let want = want.clone();
        reserving.spawn(async move {
            let call = Instant::now();
            let result = lab.reserve(&want, Hold::For(HOLD), "usbwire bench").await;
            (lab, result, millis(call))
        });
    }
    let mut held: Vec<Reservation> = Vec::new();
    let mut attempt_ms = Vec::with_capacity(clients);
    let mut reserved_ms = Vec::new();
    let (mut none_free, mut failed, mut errors) = (0, 0, BTreeMap::new());
    let mut labs = Vec::with_capacity(clients);
    while let Some(joined) = reserving.join_next().await {
        let (lab, result, ms) = joined.map_err(|e| Failure::software(e.into()))?;
        labs.push(lab);
        bar.inc(1);
        attempt_ms.push(ms);
        match result {
            Ok(reservation) => {
                reserved_ms.push(ms);
                held.push(reservation);
            }
            Err(LabError::NoneFree { .. }) => none_free += 1,
            Err(error) => {
                failed += 1;
                *errors.entry(error.to_string()).or_insert(0) += 1;
            }
        }
    }
    let reserve_seconds = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    // Per attempt: a client that finds none free has paid its read, lease and transactions too.
    phases.push(Phase {
        name: "reserve",
        unit: "attempt",
        ops: clients,
        seconds: reserve_seconds,
        latencies_ms: attempt_ms,
        cost: metrics.end(before).await,
    });

    // Exclusivity, twice: no device in two successes, and etcd holds as many reservations.
    let distinct: HashSet<(&str, &str)> =
        held.iter().map(|r| (r.device.server.as_str(), r.device.busid.as_str())).collect();
    if distinct.len() != held.len() {
        return Err(Failure::software(anyhow!(
            "{} reservations succeeded for only {} distinct devices: a device was reserved twice",
            held.len(),
            distinct.len()
        )));
    }
    let shown = observer.fleet().await.map_err(failure)?.devices.iter().filter(|d| d.reservation.is_some()).count();
    if shown != held.len() {
        return Err(Failure::software(anyhow!("{} reservations succeeded but the fleet shows {shown}", held.len())));
    }
    let reserved = held.len();

    // The holders let go, all at once.
    let before = metrics.begin().await;
    let started = Instant::now();
    let bar = progress_bar(progress, reserved, "reservations released");
    let mut releasing = JoinSet::new();
    for reservation in held {
        releasing.spawn(async move {
            let call = Instant::now();
            reservation.release().await.map(|()| millis(call))
        });
    }
    let mut release_ms = Vec::with_capacity(reserved);
    while let Some(joined) = releasing.join_next().await {
        release_ms.push(joined.map_err(|e| Failure::software(e.into()))?.map_err(failure)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    phases.push(Phase {
        name: "release",
        unit: "reservation",
        ops: reserved,
        seconds: started.elapsed().as_secs_f64(),
        latencies_ms: release_ms,
        cost: metrics.end(before).await,
    });
    drop(labs);

    Ok(Report {
        servers,
        per_server,
        clients,
        prefix: endpoint.url.prefix.clone(),
        want: want.to_string(),
        matching,
        reserved,
        reserved_ms,
        reserve_seconds,
        none_free,
        failed,
        errors,
        phases,
    })
}

/// etcd's request and byte counters, summed over the members.
#[derive(Clone, Debug, Default)]
struct Counters {
    /// gRPC messages received per method: one per unary call, one per
    /// message on a stream (a lease renewal, a watch created).
    requests: BTreeMap<String, f64>,
    /// Seconds etcd spent handling each method (only with `etcd --metrics extensive`).
    handling: BTreeMap<String, f64>,
    sent: f64,
    received: f64,
    /// etcd's CPU seconds (`process_cpu_seconds_total`).
    cpu: f64,
    /// Unary requests started and finished, for [`Counters::in_flight`]; not differences.
    started: f64,
    handled: f64,
}

impl Counters {
    fn in_flight(&self) -> f64 {
        self.started - self.handled
    }

    /// Milliseconds etcd spent on one request of each method, on average (unary methods only:
    /// a stream's time is its whole life).
    fn handling_ms(&self) -> BTreeMap<&str, f64> {
        self.handling
            .iter()
            .filter(|(method, _)| !matches!(method.as_str(), "Watch" | "LeaseKeepAlive"))
            .filter_map(|(method, seconds)| {
                let n = self.requests.get(method).copied().filter(|n| *n > 0.0)?;
                Some((method.as_str(), seconds * 1e3 / n))
            })
            .collect()
    }
}

/// Reads etcd's Prometheus metrics, which etcd 3.4 serves on its client URLs.
struct Metrics {
    /// `HOST:PORT` of each member; none with TLS (this reader speaks plain HTTP only).
    members: Vec<String>,
}

impl Metrics {
    fn new(endpoint: &Endpoint) -> Self {
        let members = if endpoint.tls.is_some() { Vec::new() } else { endpoint.url.endpoints.clone() };
        Self { members }
    }

    /// The counters now; `None` when a member did not answer (then no phase gets counts).
    async fn read(&self) -> Option<Counters> {
        if self.members.is_empty() {
            return None;
        }
        let mut counters = Counters::default();
        for member in &self.members {
            match scrape(member).await {
                Ok(text) => parse_counters(&text, &mut counters),
                Err(error) => {
                    tracing::warn!(%member, %error, "etcd metrics not read; the bench reports no request counts");
                    return None;
                }
            }
        }
        Some(counters)
    }

    /// Waits (up to 10 s) until etcd has received `count` more `method` requests than `before`.
    async fn settle(&self, before: Option<&Counters>, method: &str, count: usize) {
        let Some(before) = before else { return };
        let wanted = before.requests.get(method).copied().unwrap_or(0.0) + count as f64;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match self.read().await {
                Some(now) if now.requests.get(method).copied().unwrap_or(0.0) < wanted => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                _ => return,
            }
        }
    }

    /// Marks the start of a phase, once etcd has finished what earlier ones left it.
    async fn begin(&self) -> Mark {
        let waited = self.quiesce().await;
        Mark { etcd: self.read().await, bench_cpu: own_cpu_seconds(), waited }
    }

    async fn end(&self, mark: Mark) -> Cost {
        let bench_cpu = own_cpu_seconds() - mark.bench_cpu;
        Cost { etcd: self.since(mark.etcd).await, bench_cpu, waited: mark.waited }
    }

    /// Waits (up to 2 minutes) until etcd has no unary request in progress:
    /// a client that gives up on a request (its timeout) does not stop etcd
    /// working on it, and that work belongs to no later phase. Seconds waited.
    async fn quiesce(&self) -> f64 {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            match self.read().await {
                Some(now) if now.in_flight() > 0.0 => tokio::time::sleep(Duration::from_millis(100)).await,
                _ => break,
            }
        }
        started.elapsed().as_secs_f64()
    }

    /// What happened since `before`.
    async fn since(&self, before: Option<Counters>) -> Option<Counters> {
        let before = before?;
        let after = self.read().await?;
        let requests = after
            .requests
            .iter()
            .map(|(method, n)| (method.clone(), n - before.requests.get(method).copied().unwrap_or(0.0)))
            .filter(|(_, n)| *n > 0.0)
            .collect();
        let handling = after
            .handling
            .iter()
            .map(|(method, s)| (method.clone(), s - before.handling.get(method).copied().unwrap_or(0.0)))
            .filter(|(_, s)| *s > 0.0)
            .collect();
        Some(Counters {
            requests,
            handling,
            sent: after.sent - before.sent,
            received: after.received - before.received,
            cpu: after.cpu - before.cpu,
            started: after.started,
            handled: after.handled,
        })
    }
}

/// `GET /metrics` over HTTP/1.0, so the answer is neither chunked nor kept open.
async fn scrape(member: &str) -> std::io::Result<String> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(member).await?;
        stream.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {member}\r\n\r\n").as_bytes()).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer within 10 s"))??;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(std::io::Error::other(format!("/metrics answered {status:?}")));
    }
    Ok(body.to_owned())
}

/// Adds the lines that matter of a Prometheus text exposition to `into`.
fn parse_counters(text: &str, into: &mut Counters) {
    for line in text.lines() {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        let (family, labels) = name.split_once('{').unwrap_or((name, ""));
        // The health service has a `Watch` too; only etcd's own API counts.
        let etcd_api = labels.contains("grpc_service=\"etcdserverpb.");
        let unary = etcd_api && labels.contains("grpc_type=\"unary\"");
        let counter = match family {
            "grpc_server_msg_received_total" if etcd_api => &mut into.requests,
            "grpc_server_handling_seconds_sum" if etcd_api => &mut into.handling,
            "grpc_server_started_total" if unary => {
                into.started += value;
                continue;
            }
            "grpc_server_handled_total" if unary => {
                into.handled += value;
                continue;
            }
            "etcd_network_client_grpc_sent_bytes_total" => {
                into.sent += value;
                continue;
            }
            "etcd_network_client_grpc_received_bytes_total" => {
                into.received += value;
                continue;
            }
            "process_cpu_seconds_total" => {
                into.cpu += value;
                continue;
            }
            _ => continue,
        };
        let Some(method) = labels.split(',').find_map(|label| label.strip_prefix("grpc_method=\"")) else {
            continue;
        };
        let method = method.trim_end_matches('}').trim_end_matches('"');
        *counter.entry(method.to_owned()).or_default() += value;
    }
}

/// User and system CPU time of this process so far.
fn own_cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage only writes the struct it is given, which is large enough.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } != 0 {
        return 0.0;
    }
    // SAFETY: initialised by the successful call above (and zeroed before).
    let usage = unsafe { usage.assume_init() };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Deletes everything under the run's prefix (what the leases have not taken yet); the number of keys.
async fn delete_prefix(endpoint: &Endpoint) -> Result<i64, etcd_client::Error> {
    let mut options = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(30));
    if let Some(tls) = &endpoint.tls {
        let mut tls_options = etcd_client::TlsOptions::new();
        if let Some(ca) = &tls.ca {
            let pem = std::fs::read(ca).map_err(etcd_client::Error::IoError)?;
            tls_options = tls_options.ca_certificate(etcd_client::Certificate::from_pem(pem));
        }
        if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
            let cert = std::fs::read(cert).map_err(etcd_client::Error::IoError)?;
            let key = std::fs::read(key).map_err(etcd_client::Error::IoError)?;
            tls_options = tls_options.identity(etcd_client::Identity::from_pem(cert, key));
        }
        options = options.with_tls(tls_options);
    }
    let urls = endpoint.url.endpoint_urls(endpoint.tls.is_some());
    let mut client = etcd_client::Client::connect(urls, Some(options)).await?;
    let prefix = usbwire_lab::entry::Keys::new(&endpoint.url.prefix).all();
    let deleted = client.delete(prefix, Some(etcd_client::DeleteOptions::new().with_prefix())).await?;
    Ok(deleted.deleted())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_etcd_request_counters() {
        let text = "\
# TYPE grpc_server_msg_received_total counter
grpc_server_msg_received_total{grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 12
grpc_server_msg_received_total{grpc_method=\"Watch\",grpc_service=\"etcdserverpb.Watch\",grpc_type=\"bidi_stream\"} 3
grpc_server_msg_received_total{grpc_method=\"Watch\",grpc_service=\"grpc.health.v1.Health\",grpc_type=\"server_stream\"} 9
grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 12
grpc_server_handling_seconds_sum{grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 0.006
grpc_server_handling_seconds_count{grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 12
grpc_server_started_total{grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 14
grpc_server_started_total{grpc_method=\"Watch\",grpc_service=\"etcdserverpb.Watch\",grpc_type=\"bidi_stream\"} 3
process_cpu_seconds_total 1.5
etcd_network_client_grpc_sent_bytes_total 4096
etcd_network_client_grpc_received_bytes_total 1e+03
";
        let mut counters = Counters::default();
        parse_counters(text, &mut counters);
        parse_counters(text, &mut counters);
        assert_eq!(counters.requests.get("Range"), Some(&24.0));
        assert_eq!(counters.requests.get("Watch"), Some(&6.0), "the health service's Watch is not etcd's");
        assert_eq!(counters.requests.len(), 2);
        assert_eq!((counters.sent, counters.received), (8192.0, 2000.0));
        assert_eq!(counters.handling_ms().get("Range").map(|ms| (ms * 1e3).round()), Some(500.0));
        assert!(!counters.handling_ms().contains_key("Watch"), "a stream's time is not per request");
        assert_eq!(counters.in_flight(), 4.0, "two Range requests in progress per reading; streams do not count");
        assert_eq!(counters.cpu, 3.0);
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.50), Some(50.0));
        assert_eq!(percentile(&values, 0.99), Some(99.0));
        assert_eq!(percentile(&values, 1.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 0.95), Some(7.0));
        assert_eq!(percentile(&[], 0.5), None);
    }
}
