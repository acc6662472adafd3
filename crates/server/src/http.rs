//! The HTTP responder: Prometheus text on `--metrics ADDR:PORT` (`GET
//! /metrics`) and the status page on `--http ADDR:PORT` (`/`: one embedded
//! HTML file; `/status.json`; `/events`, the same document every second as
//! server-sent events; `/metrics`). What it shows is counted elsewhere
//! ([`crate::meter`], the registry, the admission gate); this module answers,
//! and `http/prometheus.rs` renders the counters as `/metrics`.
//!
//! It is a door like the USB/IP port, so every resource it holds is bounded:
//! open connections overall ([`HttpLimits::max_connections`], from the file
//! descriptor limit: HTTP never takes the descriptors USB/IP imports need;
//! past it no connection is accepted until one ends) and per address (more
//! are answered 503 and closed at once); a request must arrive within 5 s
//! and every write finish within 10 s; `/events` streams are bounded overall
//! and per address. A browser reaches the page only by a name we know: the
//! `Host` header must be an IP literal, `localhost` or a name in
//! `http_hosts`, else 421 — a web page that rebinds its own name to this
//! address (DNS rebinding) cannot read `/status.json`.

mod prometheus;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info, warn};
use usbwire_device::devstate::CountedDevice;
use usbwire_device::record::JSON_SCHEMA_VERSION;
use usbwire_device::sync::lock;
use usbwire_device::usb_ids::UsbIds;

use crate::devstate;
use crate::state::ServerState;
use prometheus::render;

/// The most a request may send before the server answers or closes.
const MAX_REQUEST: usize = 8 * 1024;
/// How long a client may take to send its request (idle connections end then).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one response (or one event) may take to be written.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// The status page (no framework: one file, built in).
const STATUS_PAGE: &str = include_str!("status.html");
/// How often `/events` sends the device state.
const EVENT_INTERVAL: Duration = Duration::from_secs(1);
/// Browsers following `/events` at once; more get 503.
const MAX_EVENT_STREAMS: usize = 16;
/// `/events` streams one address may hold (a browser with two tabs).
const EVENT_STREAMS_PER_ADDRESS: usize = 4;
/// Open HTTP connections one address may hold.
const CONNECTIONS_PER_ADDRESS: usize = 8;
/// Bounds of the share of file descriptors HTTP may hold (an eighth of the limit).
const MIN_CONNECTIONS: usize = 4;
const MAX_CONNECTIONS: usize = 64;

/// What an HTTP listener serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Site {
    /// `/metrics` only (`--metrics`).
    Metrics,
    /// The status page, its JSON and events, and `/metrics` (`--http`).
    StatusPage,
}

/// Bounds of the HTTP responder (both listeners together).
#[derive(Clone, Debug)]
pub(crate) struct HttpLimits {
    /// Open connections, both listeners together.
    pub(crate) max_connections: usize,
    pub(crate) per_address: usize,
    pub(crate) event_streams: usize,
    pub(crate) event_streams_per_address: usize,
    /// Names besides IP literals and `localhost` that a request's `Host` may carry (`http_hosts`).
    pub(crate) hosts: Vec<String>,
}

impl HttpLimits {
    /// The defaults, with `hosts` allowed and an eighth of this process's
    /// file descriptor limit (4 to 64) for open connections.
    pub(crate) fn new(hosts: Vec<String>) -> Self {
        let max_connections = (open_files_limit() / 8).clamp(MIN_CONNECTIONS, MAX_CONNECTIONS);
        Self {
            max_connections,
            per_address: CONNECTIONS_PER_ADDRESS,
            event_streams: MAX_EVENT_STREAMS,
            event_streams_per_address: EVENT_STREAMS_PER_ADDRESS,
            hosts: hosts.into_iter().map(|h| h.trim_end_matches('.').to_ascii_lowercase()).collect(),
        }
    }
}

/// `RLIMIT_NOFILE`'s soft limit (1024, the usual default, if it cannot be read).
fn open_files_limit() -> usize {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into the struct we pass and reads nothing else.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    if ok {
        usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
    } else {
        1024
    }
}

/// What both HTTP listeners share: the connection and stream budgets.
pub(crate) struct Responder {
    limits: HttpLimits,
    connections: Arc<Semaphore>,
    streams: Semaphore,
    /// Open connections and event streams per address.
    per_address: Mutex<HashMap<IpAddr, (usize, usize)>>,
    /// This machine's usb.ids, read when the status page first shows devices.
    names: OnceLock<UsbIds>,
}

impl Responder {
    pub(crate) fn new(limits: HttpLimits) -> Arc<Self> {
        Arc::new(Self {
            connections: Arc::new(Semaphore::new(limits.max_connections)),
            streams: Semaphore::new(limits.event_streams),
            per_address: Mutex::new(HashMap::new()),
            names: OnceLock::new(),
            limits,
        })
    }

    /// What names the devices of `/status.json`, as the CLI names them (docs/json.md).
    fn names(&self) -> &UsbIds {
        self.names.get_or_init(UsbIds::load)
    }

    /// Counts a connection from `ip`, unless it holds its share already.
    fn enter(self: &Arc<Self>, ip: IpAddr) -> Option<AddressGuard> {
        let mut table = lock(&self.per_address);
        let entry = table.entry(ip).or_default();
        if entry.0 >= self.limits.per_address {
            return None;
        }
        entry.0 += 1;
        Some(AddressGuard { responder: self.clone(), ip, stream: false })
    }

    /// Whether `host` (a `Host` header's value) names this server.
    fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host).trim_end_matches('.').to_ascii_lowercase();
        name.parse::<Ipv4Addr>().is_ok()
            || name.strip_prefix('[').and_then(|n| n.strip_suffix(']')).is_some_and(|n| n.parse::<Ipv6Addr>().is_ok())
            || name == "localhost"
            || self.limits.hosts.contains(&name)
    }
}

/// One connection of an address (and its event stream, if it became one).
struct AddressGuard {
    responder: Arc<Responder>,
    ip: IpAddr,
    stream: bool,
}

impl AddressGuard {
    /// Makes this connection an event stream, if its address holds fewer than its share.
    fn start_stream(&mut self) -> bool {
        let mut table = lock(&self.responder.per_address);
        let entry = table.entry(self.ip).or_default();
        if entry.1 >= self.responder.limits.event_streams_per_address {
            return false;
        }
        entry.1 += 1;
        self.stream = true;
        true
    }
}

impl Drop for AddressGuard {
    fn drop(&mut self) {
        let mut table = lock(&self.responder.per_address);
        if let Some(entry) = table.get_mut(&self.ip) {
            entry.0 = entry.0.saturating_sub(1);
            if self.stream {
                entry.1 = entry.1.saturating_sub(1);
            }
            if *entry == (0, 0) {
                table.remove(&self.ip);
            }
        }
    }
}

/// The host part of a `Host` value: `name`, `name:port`, `[v6]`, `[v6]:port`.
fn host_name(value: &str) -> &str {
    let value = value.trim();
    if value.starts_with('[') {
        return value.find(']').map_or(value, |end| &value[..=end]);
    }
    match value.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => value,
    }
}

/// Serves `site` on `listener` until `stop`, within `responder`'s bounds.
/// An unknown path is a 404; a request larger than 8 KiB or slower than 5 s
/// is dropped.
pub(crate) async fn serve(
    listener: TcpListener,
    state: Arc<ServerState>,
    mut stop: watch::Receiver<bool>,
    site: Site,
    responder: Arc<Responder>,
) {
    if let Ok(addr) = listener.local_addr() {
        match site {
            Site::Metrics => info!(%addr, "metrics on http://{addr}/metrics"),
            Site::StatusPage => info!(%addr, "status page on http://{addr}/"),
        }
    }
    loop {
        // A free place first: past the bound, connections wait in the
        // kernel's queue and hold none of our file descriptors.
        let permit = tokio::select! {
            () = crate::shutdown::stopped(&mut stop) => return,
            permit = responder.connections.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        let accepted = tokio::select! {
            () = crate::shutdown::stopped(&mut stop) => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(error) => {
                // EMFILE and friends: back off instead of spinning.
                warn!(%error, "HTTP: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(guard) = responder.enter(peer.ip()) else {
            refuse_busy(stream, peer);
            continue;
        };
        let state = state.clone();
        let stop = stop.clone();
        let responder = responder.clone();
        tokio::spawn(async move {
            if let Err(error) = answer(stream, peer, &state, site, stop, &responder, guard, permit).await {
                debug!(%peer, %error, "HTTP request failed");
            }
        });
    }
}

/// An address holding its share of connections: a 503 if the socket takes
/// it without waiting, then a reset (no `TIME_WAIT` kept per refusal).
fn refuse_busy(stream: TcpStream, peer: SocketAddr) {
    debug!(%peer, "HTTP: too many connections from this address");
    let _ = stream.try_write(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 5\r\nConnection: close\r\n\r\n",
    );
    let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
}

/// The devices (their records, docs/json.md, named from `names`) and
/// counters, as `/status.json` and each `/events` message carry them, with
/// the time they were read (`time_ms`, for rates between messages;
/// `time_at` for people).
fn status_json(state: &ServerState, names: &UsbIds) -> String {
    let now = std::time::SystemTime::now();
    let time_ms = now.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    let devices: Vec<CountedDevice> = devstate::entries(&state.registry, |_, _, _| true)
        .iter()
        .map(|entry| {
            let mut device = CountedDevice::from(entry);
            device.device.fill_names(names);
            device
        })
        .collect();
    serde_json::json!({
        "schema_version": JSON_SCHEMA_VERSION,
        "version": env!("CARGO_PKG_VERSION"),
        "time_ms": time_ms as u64,
        "time_at": humantime::format_rfc3339_seconds(now).to_string(),
        "devices": devices,
    })
    .to_string()
}

/// Writes `bytes`, or fails once [`WRITE_TIMEOUT`] passes (a reader that stopped reading).
async fn write_in_time(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    match tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(bytes)).await {
        Ok(result) => result,
        Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the client did not read in time")),
    }
}

/// `/events`: the status every [`EVENT_INTERVAL`] until the browser goes or the server stops.
async fn event_stream(
    mut stream: TcpStream,
    state: &ServerState,
    names: &UsbIds,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n\
                Connection: close\r\n\r\n";
    write_in_time(&mut stream, head.as_bytes()).await?;
    let mut tick = tokio::time::interval(EVENT_INTERVAL);
    loop {
        tokio::select! {
            () = crate::shutdown::stopped(&mut stop) => return Ok(()),
            _ = tick.tick() => {
                let message = format!("data: {}\n\n", status_json(state, names));
                write_in_time(&mut stream, message.as_bytes()).await?;
            }
        }
    }
}

/// The request line and `Host` of a request's head.
fn parse_head(request: &[u8]) -> (String, String, Option<String>) {
    let text = String::from_utf8_lossy(request);
    let mut lines = text.lines();
    let mut parts = lines.next().unwrap_or_default().split_whitespace();
    let (method, path) = (parts.next().unwrap_or("").to_owned(), parts.next().unwrap_or("").to_owned());
    let host = lines
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("host"))
        .map(|(_, value)| value.trim().to_owned());
    (method, path, host)
}

#[allow(clippy::too_many_arguments)] // each is one thing the answer needs; a struct would only rename them
async fn answer(
    mut stream: TcpStream,
    peer: SocketAddr,
    state: &ServerState,
    site: Site,
    stop: watch::Receiver<bool>,
    responder: &Responder,
    mut guard: AddressGuard,
    _permit: OwnedSemaphorePermit,
) -> std::io::Result<()> {
    let mut request = Vec::new();
    let read = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let mut buf = [0u8; 1024];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") && !request.windows(2).any(|w| w == b"\n\n") {
            let n = stream.read(&mut buf).await?;
            if n == 0 || request.len() + n > MAX_REQUEST {
                return Err(std::io::Error::other("request too large or cut short"));
            }
            request.extend_from_slice(&buf[..n]);
        }
        Ok(())
    })
    .await;
    match read {
        Ok(Ok(())) => {}
        Ok(Err(error)) => return Err(error),
        Err(_) => return Err(std::io::Error::other("request not sent in time")),
    }
    let (method, path, host) = parse_head(&request);
    let path = path.split('?').next().unwrap_or("");
    let page = site == Site::StatusPage;
    // A request without Host is no browser's (HTTP/1.0 tools): nothing to rebind.
    let foreign_host = host.as_deref().filter(|host| !responder.host_allowed(host));
    let (status, content_type, body) = match (method.as_str(), path) {
        _ if foreign_host.is_some() => (
            "421 Misdirected Request",
            "text/plain; charset=utf-8",
            format!(
                "this server does not answer to the name {:?}: use its IP address or localhost, or add the name \
                 to http_hosts in the server's config\n",
                host_name(foreign_host.unwrap_or_default())
            ),
        ),
        ("GET" | "HEAD", "/metrics") => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", render(state)),
        ("GET" | "HEAD", "/") if page => ("200 OK", "text/html; charset=utf-8", STATUS_PAGE.to_owned()),
        ("GET" | "HEAD", "/status.json") if page => {
            ("200 OK", "application/json", status_json(state, responder.names()))
        }
        ("GET", "/events") if page => match responder.streams.try_acquire() {
            Ok(_stream) if guard.start_stream() => return event_stream(stream, state, responder.names(), stop).await,
            Ok(_) => (
                "503 Service Unavailable",
                "text/plain; charset=utf-8",
                "too many event streams from your address\n".into(),
            ),
            Err(_) => ("503 Service Unavailable", "text/plain; charset=utf-8", "too many event streams\n".into()),
        },
        ("GET" | "HEAD", _) if page => {
            ("404 Not Found", "text/plain; charset=utf-8", "/, /status.json, /events, /metrics\n".into())
        }
        ("GET" | "HEAD", _) => ("404 Not Found", "text/plain; charset=utf-8", "usbwire serves /metrics only\n".into()),
        _ => ("405 Method Not Allowed", "text/plain; charset=utf-8", "GET only\n".into()),
    };
    if foreign_host.is_some() {
        info!(%peer, host = host.as_deref().unwrap_or(""), "HTTP: refused a request for a name this server does not know (http_hosts)");
    }
    debug!(%peer, method, path, status, "HTTP request");
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    write_in_time(&mut stream, head.as_bytes()).await?;
    if method != "HEAD" {
        write_in_time(&mut stream, body.as_bytes()).await?;
    }
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_allowed_are_ip_literals_localhost_and_configured_names() {
        let responder = Responder::new(HttpLimits::new(vec!["USB.example.org.".into()]));
        for host in [
            "127.0.0.1",
            "127.0.0.1:8324",
            "[::1]",
            "[::1]:8324",
            "localhost",
            "LOCALHOST:80",
            "localhost.",
            "usb.example.org",
            "usb.example.org:8324",
        ] {
            assert!(responder.host_allowed(host), "{host} should be allowed");
        }
        for host in ["evil.example", "evil.example:8324", "127.0.0.1.evil.example", "localhost.evil", "[::1", ""] {
            assert!(!responder.host_allowed(host), "{host} should be refused");
        }
    }

    #[test]
    fn an_address_holds_its_share_of_connections_and_streams() {
        let mut limits = HttpLimits::new(Vec::new());
        limits.per_address = 2;
        limits.event_streams_per_address = 1;
        let responder = Responder::new(limits);
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let mut first = responder.enter(ip).unwrap();
        let mut second = responder.enter(ip).unwrap();
        assert!(responder.enter(ip).is_none(), "a third connection from the same address");
        assert!(responder.enter("192.0.2.2".parse().unwrap()).is_some(), "another address is not held up");
        assert!(first.start_stream());
        assert!(!second.start_stream(), "a second stream from the same address");
        drop(first);
        assert!(second.start_stream(), "the stream's place came back");
        assert!(responder.enter(ip).is_some(), "the connection's place came back");
        drop(second);
        assert!(lock(&responder.per_address).get(&ip).is_none(), "nothing left behind for a gone address");
    }

    #[test]
    fn the_connection_bound_is_a_share_of_the_descriptor_limit() {
        let limits = HttpLimits::new(Vec::new());
        assert!((MIN_CONNECTIONS..=MAX_CONNECTIONS).contains(&limits.max_connections));
        assert!(limits.max_connections <= open_files_limit().max(MIN_CONNECTIONS * 8) / 8);
    }
}
