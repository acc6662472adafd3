//! etcd's own counters around each phase of a lab bench run: its
//! Prometheus `/metrics` (requests per gRPC method, bytes, CPU, time per
//! request), read over plain HTTP from every member and summed, and this
//! process's CPU time. Not for TLS-only clusters (no counts then).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use usbwire_lab::Endpoint;

/// What a phase cost, and how long it waited for etcd to be idle before it began.
pub(crate) struct Cost {
    /// etcd's counters over the phase; `None` when they could not be read.
    pub(crate) etcd: Option<Counters>,
    /// CPU seconds of this process (the simulated servers and clients).
    pub(crate) bench_cpu: f64,
    pub(crate) waited: f64,
}

/// Where a phase began.
pub(crate) struct Mark {
    pub(crate) etcd: Option<Counters>,
    bench_cpu: f64,
    waited: f64,
}

/// etcd's request and byte counters, summed over the members.
#[derive(Clone, Debug, Default)]
pub(crate) struct Counters {
    /// gRPC messages received per method: one per unary call, one per
    /// message on a stream (a lease renewal, a watch created).
    pub(crate) requests: BTreeMap<String, f64>,
    /// Seconds etcd spent handling each method (only with `etcd --metrics extensive`).
    pub(crate) handling: BTreeMap<String, f64>,
    pub(crate) sent: f64,
    pub(crate) received: f64,
    /// etcd's CPU seconds (`process_cpu_seconds_total`).
    pub(crate) cpu: f64,
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
    pub(crate) fn handling_ms(&self) -> BTreeMap<&str, f64> {
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
pub(crate) struct Metrics {
    /// `HOST:PORT` of each member; none with TLS (this reader speaks plain HTTP only).
    members: Vec<String>,
}

impl Metrics {
    pub(crate) fn new(endpoint: &Endpoint) -> Self {
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
    pub(crate) async fn settle(&self, before: Option<&Counters>, method: &str, count: usize) {
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
    pub(crate) async fn begin(&self) -> Mark {
        let waited = self.quiesce().await;
        Mark { etcd: self.read().await, bench_cpu: own_cpu_seconds(), waited }
    }

    pub(crate) async fn end(&self, mark: Mark) -> Cost {
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
}
