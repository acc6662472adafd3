//! The USB/IP server: exports [`Device`]s over TCP, wire-compatible with the
//! Linux `usbip` tools and vhci-hcd.
//!
//! One task per connection. A connection first speaks the OP phase (one
//! request: a device list or an import); after a successful import the same
//! socket becomes that device's URB channel, driven by [`urb_channel`], which
//! owns the device outright while it is imported — there is no lock on the
//! data path. When the client goes away, everything in flight is abandoned,
//! the device is reset and listed as available again — unless the import is
//! resumable: then the session parks for its grace period (`resumable.rs`),
//! the device running on, for the client to come back.
//!
//! This crate is not for building devices (see `usbwire-device` and
//! `usbwire-gadgets`) nor for parsing bytes (see `usbwire-proto`).

mod admission;
mod capture;
mod connection;
mod control;
mod host_exports;
mod http;
mod metrics;
mod peer;
pub mod private_dir;
mod registry;
mod resumable;
mod urb_channel;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_rustls::rustls as rustls_config;
use tracing::{info, warn, Instrument};
use usbwire_device::Device;
use usbwire_proto::op::BusId;
use usbwire_proto::{Budget, Limits};

pub use admission::AdmissionLimits;
pub use capture::{
    CaptureConfig, DEFAULT_MAX_BYTES as DEFAULT_CAPTURE_MAX_BYTES, DEFAULT_MAX_FILE_BYTES as DEFAULT_CAPTURE_FILE_BYTES,
};
pub use control::{
    default_control_path, request as control_request, ControlRequest, ControlResponse, StateEntry, TextInput,
};
pub use host_exports::{HostExports, HOST_KIND};
pub use registry::{reservation_digest, DeviceState, ExportInfo, Registry, ReservationDigest};
pub use usbwire_host::{Selector, SelectorError};
pub use usbwire_transport::access::{AccessRules, Admission};
pub use usbwire_transport::Identity;

/// Server settings, with the defaults `usbwire serve` uses.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to listen on (default `0.0.0.0:3240`).
    pub listen: SocketAddr,
    /// Local control socket (`usbwire type`, `usbwire state`); `None` disables it.
    pub control_path: Option<PathBuf>,
    /// Bounds applied to everything a client sends.
    pub limits: Limits,
    /// What one connection may hold in memory before we stop reading from it.
    pub budget: Budget,
    /// Concurrent connections past authentication (each device list or import is one).
    pub max_connections: usize,
    /// Connections not yet authenticated: their own small pool, a per-address cap, short deadlines.
    pub admission: AdmissionLimits,
    /// TLS, the plain-connection policy and per-client access rules.
    pub security: Security,
    /// Real devices to export (by bus id, VID:PID, serial or class), now and on hotplug.
    pub host_rules: Vec<Selector>,
    /// How long an import whose connection dropped is kept for a usbwire
    /// client to resume it (default 30 s); zero turns resume off.
    pub resume_grace: Duration,
    /// Where to serve Prometheus metrics (`GET /metrics`); `None`: nowhere.
    pub metrics: Option<SocketAddr>,
    /// Where to serve the status page (and `/metrics` beside it); `None`: nowhere.
    pub http: Option<SocketAddr>,
    /// Names a request to `--http` / `--metrics` may carry in its `Host`
    /// besides IP literals and `localhost` (others get 421: DNS rebinding).
    pub http_hosts: Vec<String>,
    /// Capture every import's URBs to pcapng files (usbmon format) here.
    pub capture: Option<CaptureConfig>,
    /// Keeps `usbwire bind`s across restarts (one bus id per line); `None`: they end with the server.
    pub bind_state: Option<PathBuf>,
}

/// Whether plain (unencrypted, unauthenticated) USB/IP connections are accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlainPolicy {
    Never,
    /// Only from the loopback interface (the default once TLS is configured).
    Loopback,
    Always,
}

/// Who may connect and what they may use.
#[derive(Clone, Debug)]
pub struct Security {
    /// TLS 1.3 with client certificates, on the same port as plain USB/IP.
    pub tls: Option<Arc<rustls_config::ServerConfig>>,
    pub plain: PlainPolicy,
    /// Which client sees and imports which device (`admission.rules`), and the
    /// private CA whose client certificates `client = "ca:NAME"` rules admit.
    /// With TLS, a plain client is the identity `plain`: it sees only what a
    /// `client = "plain"` rule gives it (see [`Security::visible`]).
    pub admission: Admission,
    /// The server's own `[[redir]]` bridges, which import as the server: what
    /// its key may see and import (nothing else, whatever the rules say).
    pub own_bridges: Option<OwnBridges>,
}

/// The server's own identity, admitted for its usbredir bridges only: it
/// sees and imports exactly the devices `devices` select.
#[derive(Clone, Debug)]
pub struct OwnBridges {
    /// The server's key (its bridges present it).
    pub identity: usbwire_transport::Fingerprint,
    /// The `[[redir]]` rules' devices.
    pub devices: Vec<Selector>,
}

impl Security {
    /// TLS with `identity`, admitting the clients `admission` names.
    pub fn tls(identity: &Identity, plain: PlainPolicy, admission: Admission) -> Result<Self, rustls_config::Error> {
        let tls = usbwire_transport::tls::server_config(identity, admission.clone())?;
        Ok(Self { tls: Some(tls), plain, admission, own_bridges: None })
    }

    /// Whether `client` may see and import `device` (of kind `kind`, serial
    /// number `serial`, empty if none): the server's own bridges the devices
    /// their rules select, everyone else what [`Security::visible`] says.
    pub fn may_use(
        &self,
        client: &usbwire_transport::access::ClientId,
        kind: &str,
        device: &usbwire_proto::op::DeviceRecord,
        serial: &str,
    ) -> bool {
        use usbwire_transport::access::ClientId;
        if let (Some(own), ClientId::Certificate(fingerprint) | ClientId::CaIssued { fingerprint, .. }) =
            (&self.own_bridges, client)
        {
            if *fingerprint == own.identity {
                let serial = Some(serial).filter(|s| !s.is_empty());
                return own.devices.iter().any(|selector| selector.matches_record(device, serial));
            }
        }
        self.visible(client, device.busid.as_str(), kind)
    }

    /// Whether `client` may see and import the device `busid` of kind `kind`.
    ///
    /// With TLS on, every client, plain ones included, gets exactly what the
    /// rules give it: `plain` is one more identity, and `plain` (how
    /// [`PlainPolicy`] lets it connect at all) decides nothing about devices.
    /// A server without TLS has nobody to tell apart: a plain client sees
    /// everything unless a rule names `plain` (as usbipd does).
    pub fn visible(&self, client: &usbwire_transport::access::ClientId, busid: &str, kind: &str) -> bool {
        let rules = &self.admission.rules;
        match client {
            usbwire_transport::access::ClientId::Plain
                if self.tls.is_none() && !rules.rules.iter().any(|r| r.client == "plain") =>
            {
                true
            }
            _ => rules.allows(client, busid, kind),
        }
    }
}

impl Default for Security {
    /// Plain USB/IP for everyone, as usbipd does.
    fn default() -> Self {
        Self {
            tls: None,
            plain: PlainPolicy::Always,
            admission: Admission { rules: AccessRules::open(), ca: None },
            own_bridges: None,
        }
    }
}

/// How long a dropped import waits for its client by default.
pub const DEFAULT_RESUME_GRACE: Duration = Duration::from_secs(30);

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], usbwire_proto::DEFAULT_PORT)),
            control_path: Some(default_control_path()),
            limits: Limits::default(),
            budget: Budget::default(),
            max_connections: 256,
            admission: AdmissionLimits::default(),
            security: Security::default(),
            host_rules: Vec::new(),
            resume_grace: DEFAULT_RESUME_GRACE,
            metrics: None,
            http: None,
            http_hosts: Vec::new(),
            capture: None,
            bind_state: None,
        }
    }
}

/// Errors that stop the server from starting.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The listen address is taken or not ours; pick another with `--listen`.
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    /// The control socket could not be created; pass `--control PATH` to put it elsewhere.
    #[error("cannot create control socket {path}: {source}")]
    Control { path: PathBuf, source: std::io::Error },
    /// The control socket's directory is not one only we can change (another
    /// user's, writable by others, a symlink); the message says what to do.
    #[error("control socket {path}: {reason}")]
    ControlDir { path: PathBuf, reason: private_dir::PrivateDirError },
    /// The capture directory is not one only we can change (another user's,
    /// writable by others, a symlink); the message says what to do.
    #[error("capture directory: {0}")]
    CaptureDir(private_dir::PrivateDirError),
    /// The metrics or status page address is taken or not ours; pick another with `--metrics` / `--http`.
    #[error("cannot serve HTTP (metrics or status page) on {addr}: {source}")]
    Metrics { addr: SocketAddr, source: std::io::Error },
}

/// A server being assembled: add devices, then [`bind`](Self::bind).
pub struct Server {
    config: ServerConfig,
    registry: Registry,
    text_inputs: Vec<(BusId, Arc<dyn TextInput>)>,
}

impl Server {
    pub fn new(config: ServerConfig) -> Self {
        let registry = Registry::default();
        registry.set_capture(config.capture.clone());
        Self { config, registry, text_inputs: Vec::new() }
    }

    /// Exports a device under the next free bus id (bus 2 for SuperSpeed,
    /// bus 1 otherwise, numbered in order). `kind` is a short label for humans.
    pub fn export(&mut self, kind: &str, device: Box<dyn Device>) -> BusId {
        self.registry.add(kind, device)
    }

    /// Lets `usbwire type` reach a keyboard exported under `busid`.
    pub fn add_text_input(&mut self, busid: BusId, input: Arc<dyn TextInput>) {
        self.text_inputs.push((busid, input));
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Binds the listening socket and the control socket.
    pub async fn bind(self) -> Result<BoundServer, ServerError> {
        if let Some(capture) = &self.config.capture {
            capture.prepare().map_err(ServerError::CaptureDir)?;
        }
        let addr = self.config.listen;
        let listener = listen(addr).map_err(|source| ServerError::Listen { addr, source })?;
        let control = match &self.config.control_path {
            Some(path) => Some(control::ControlSocket::bind(path)?),
            None => None,
        };
        let metrics = match self.config.metrics {
            Some(addr) => Some(listen(addr).map_err(|source| ServerError::Metrics { addr, source })?),
            None => None,
        };
        let http = match self.config.http {
            Some(addr) => Some(listen(addr).map_err(|source| ServerError::Metrics { addr, source })?),
            None => None,
        };
        Ok(BoundServer {
            listener,
            control,
            metrics,
            http,
            host_exports: host_exports::HostExports::new(
                self.registry.clone(),
                self.config.host_rules.clone(),
                self.config.bind_state.clone(),
            ),
            config: Arc::new(self.config),
            registry: self.registry,
            text_inputs: Arc::new(self.text_inputs),
        })
    }
}

impl Server {
    /// The server without sockets: sessions are handed to it from inside the process
    /// (the fuzz harness drives whole sessions this way). No control socket, no bind rules.
    pub fn in_process(self) -> InProcessServer {
        let (stop, _) = watch::channel(false);
        InProcessServer { config: Arc::new(self.config), registry: self.registry, stop }
    }
}

/// A server that serves connections made inside the process, one [`serve`](Self::serve)
/// call each: exactly what a TCP connection gets after its TLS handshake (or its plain
/// first byte), with the same budgets and rules.
pub struct InProcessServer {
    config: Arc<ServerConfig>,
    registry: Registry,
    stop: watch::Sender<bool>,
}

impl InProcessServer {
    /// Serves one plain session on `stream` as if from `peer`, until it ends. The
    /// imported device, if any, is back in the registry when this returns.
    pub async fn serve(&self, stream: tokio::io::DuplexStream, peer: SocketAddr) {
        let session = connection::serve_session(
            usbwire_transport::PeerStream::InProcess(stream),
            usbwire_transport::access::ClientId::Plain,
            peer::Peer { addr: peer, ticket: admission::Ticket::unlimited(), probe: peer::PeerProbe::none() },
            self.registry.clone(),
            self.config.clone(),
            self.stop.subscribe(),
        );
        session.instrument(tracing::info_span!("conn", %peer)).await;
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

/// A server with its sockets bound, ready to [`run`](Self::run).
pub struct BoundServer {
    listener: TcpListener,
    control: Option<control::ControlSocket>,
    metrics: Option<TcpListener>,
    http: Option<TcpListener>,
    config: Arc<ServerConfig>,
    registry: Registry,
    text_inputs: Arc<Vec<(BusId, Arc<dyn TextInput>)>>,
    host_exports: host_exports::HostExports,
}

impl BoundServer {
    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or(self.config.listen)
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The real-device bind rules, to reload them while running.
    pub fn host_exports(&self) -> HostExports {
        self.host_exports.clone()
    }

    /// Where it serves Prometheus metrics, if it does.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// Where it serves the status page, if it does.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http.as_ref().and_then(|l| l.local_addr().ok())
    }

    /// TLS and plain-connection settings it runs with.
    pub fn security(&self) -> &Security {
        &self.config.security
    }

    /// Serves until `shutdown` resolves, then closes every connection (each
    /// resets its device) and returns.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let gate = admission::Gate::new(self.config.admission.clone(), self.config.max_connections);
        self.registry.server_meter().watch_gate(gate.clone());
        let mut summaries = tokio::time::interval(self.config.admission.log_interval.max(Duration::from_millis(100)));
        summaries.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut tasks = tokio::task::JoinSet::new();
        // Both HTTP listeners share one budget of connections, apart from USB/IP's.
        let responder = http::Responder::new(http::HttpLimits::new(self.config.http_hosts.clone()));
        for (listener, site) in [(self.metrics.take(), http::Site::Metrics), (self.http.take(), http::Site::StatusPage)]
        {
            if let Some(listener) = listener {
                let (registry, stop) = (self.registry.clone(), stop_rx.clone());
                tasks.spawn(http::serve(listener, registry, stop, site, responder.clone()));
            }
        }
        if !self.config.host_rules.is_empty() {
            let exported = self.host_exports.export_matching();
            info!(?exported, "real devices exported by bind rules");
        }
        tasks.spawn(self.host_exports.clone().watch(stop_rx.clone()));
        if let Some(control) = self.control.take() {
            let registry = self.registry.clone();
            let inputs = self.text_inputs.clone();
            let hosts = self.host_exports.clone();
            let stop = stop_rx.clone();
            tasks.spawn(async move { control.serve(registry, inputs, hosts, stop).await });
        }
        info!(addr = %self.local_addr(), devices = self.registry.len(), "usbwire server listening");
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = self.listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(pair) => pair,
                        Err(error) => {
                            // EMFILE and friends: back off instead of spinning.
                            warn!(%error, "accept failed");
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    let Ok(ticket) = gate.admit(peer.ip()) else {
                        // Counted for the summary line. A reset, not a FIN: no TIME_WAIT
                        // left behind per refusal when one address hammers the port.
                        let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
                        drop(stream);
                        gate.log_summary();
                        continue;
                    };
                    let registry = self.registry.clone();
                    let config = self.config.clone();
                    let stop = stop_rx.clone();
                    let span = tracing::info_span!("conn", %peer);
                    let open = self.registry.server_meter().connection();
                    tasks.spawn(async move {
                        let _open = open;
                        connection::handle(stream, peer, registry, config, stop, ticket).await;
                    }.instrument(span));
                }
                _ = summaries.tick() => gate.log_summary(),
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
        info!("shutting down: closing connections and resetting devices");
        let _ = stop_tx.send(true);
        while tasks.join_next().await.is_some() {}
        if let Some(path) = &self.config.control_path {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Connections the kernel queues for `accept`. The std/mio default of 128
/// overflows while one address re-opens hundreds of refused connections, and
/// every SYN dropped then costs an honest client a 1 s retransmit. The kernel
/// caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 4096;

fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Resolves once the server starts shutting down.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    // The borrow `wait_for` returns is not Send; end it here, inside this function.
    let _ = stop.wait_for(|stopping| *stopping).await.map(|_| ());
}

#[cfg(test)]
mod tests {
    use usbwire_transport::access::{ClientId, Rule};

    use super::*;

    fn rules(rules: &[(&str, &str)]) -> Admission {
        let rules = rules.iter().map(|(c, d)| Rule { client: (*c).into(), devices: vec![(*d).into()] }).collect();
        Admission { rules: AccessRules { rules }, ca: None }
    }

    #[test]
    fn with_tls_a_plain_client_gets_only_what_a_plain_rule_gives_it() {
        let server = Identity::generate("server").unwrap();
        let alice = ClientId::Certificate(usbwire_transport::Fingerprint([0xaa; 32]));
        let alice_rule = alice.to_string();
        for policy in [PlainPolicy::Loopback, PlainPolicy::Always] {
            let security = Security::tls(&server, policy, rules(&[(&alice_rule, "1-1")])).unwrap();
            assert!(security.visible(&alice, "1-1", "loopback"));
            assert!(!security.visible(&ClientId::Plain, "1-1", "loopback"), "{policy:?}");
            assert!(!security.visible(&ClientId::Plain, "1-2", "disk"), "{policy:?}");
            let security = Security::tls(&server, policy, rules(&[(&alice_rule, "1-1"), ("plain", "disk")])).unwrap();
            assert!(security.visible(&ClientId::Plain, "1-2", "disk"));
            assert!(!security.visible(&ClientId::Plain, "1-1", "loopback"));
        }
    }

    #[test]
    fn without_tls_a_plain_client_sees_everything_unless_a_rule_names_it() {
        assert!(Security::default().visible(&ClientId::Plain, "1-1", "keyboard"));
        let unnamed =
            Security { tls: None, plain: PlainPolicy::Always, admission: rules(&[("*", "1-1")]), own_bridges: None };
        assert!(unnamed.visible(&ClientId::Plain, "1-2", "disk"));
        let named = Security {
            tls: None,
            plain: PlainPolicy::Always,
            admission: rules(&[("plain", "1-1")]),
            own_bridges: None,
        };
        assert!(named.visible(&ClientId::Plain, "1-1", "disk"));
        assert!(!named.visible(&ClientId::Plain, "1-2", "disk"));
    }
}
