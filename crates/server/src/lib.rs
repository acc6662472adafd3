//! The USB/IP server: exports [`Device`]s over TCP, wire-compatible with the
//! Linux `usbip` tools and vhci-hcd.
//!
//! One task per connection, on one of the connection threads
//! ([`connection_threads`]) for its whole life. A connection first speaks the OP phase (one
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
mod config;
mod connection;
mod connection_threads;
mod control;
pub mod cores;
mod descriptor_snapshot;
mod devstate;
mod error;
mod external;
mod host_exports;
mod http;
mod meter;
mod op;
mod peer;
pub mod private_dir;
mod registry;
pub mod reservation;
mod resumable;
mod shutdown;
mod state;
mod urb_channel;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{info, warn, Instrument};
use usbwire_device::Device;
use usbwire_proto::op::BusId;

pub use admission::AdmissionLimits;
pub use capture::{
    CaptureConfig, DEFAULT_MAX_BYTES as DEFAULT_CAPTURE_MAX_BYTES, DEFAULT_MAX_FILE_BYTES as DEFAULT_CAPTURE_FILE_BYTES,
};
pub use config::{
    default_bind_state_path, default_control_path, OwnBridges, PlainPolicy, Security, ServerConfig,
    DEFAULT_RESUME_GRACE,
};
pub use control::{
    request as control_request, ControlErrorKind, ControlRequest, ControlResponse, TextInput, TypeRefusal,
};
pub use devstate::state_entry;
pub use error::ServerError;
pub use external::EXTERNAL_KIND;
pub use host_exports::{BindRuleState, HostExports, HOST_KIND};
pub use registry::{DeviceState, ExportInfo, Registry, Reservation, VIRTUAL_BUS};
use state::ServerState;
pub use usbwire_external::Options as ExternalOptions;
pub use usbwire_transport::access::{AccessRules, Admission};
pub use usbwire_transport::Identity;

/// A server being assembled: add devices, then [`bind`](Self::bind).
pub struct Server {
    config: ServerConfig,
    registry: Registry,
    text_inputs: Vec<(BusId, Arc<dyn TextInput>)>,
    externals: Vec<external::ExternalExport>,
}

impl Server {
    pub fn new(config: ServerConfig) -> Self {
        Self { config, registry: Registry::default(), text_inputs: Vec::new(), externals: Vec::new() }
    }

    /// Exports the device a device process serves on the Unix socket `path`
    /// (made when the server binds), under a bus id set aside now: listed while
    /// a device process is connected, withdrawn while none is.
    pub fn export_external(&mut self, path: std::path::PathBuf, options: ExternalOptions) -> BusId {
        let (busid, devnum) = self.registry.reserve();
        self.externals.push(external::ExternalExport { path, busid: busid.clone(), devnum, options });
        busid
    }

    /// Exports a virtual device under the next free bus id on bus 0 (`0-1`,
    /// `0-2` …, in order; [`VIRTUAL_BUS`]). `kind` is a short label for humans.
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
        let externals =
            self.externals.into_iter().map(external::ExternalSocket::bind).collect::<Result<Vec<_>, _>>()?;
        let metrics = match self.config.metrics {
            Some(addr) => Some(listen(addr).map_err(|source| ServerError::Metrics { addr, source })?),
            None => None,
        };
        let http = match self.config.http {
            Some(addr) => Some(listen(addr).map_err(|source| ServerError::Metrics { addr, source })?),
            None => None,
        };
        let threads = connection_threads::ConnectionThreads::start().map_err(ServerError::Threads)?;
        Ok(BoundServer {
            listener,
            threads,
            control,
            externals,
            metrics,
            http,
            host_exports: host_exports::HostExports::new(
                self.registry.clone(),
                self.config.host_rules.clone(),
                self.config.bind_state.clone(),
            ),
            state: ServerState::new(self.config, self.registry),
            text_inputs: Arc::new(self.text_inputs),
        })
    }
}

impl Server {
    /// The server without sockets: sessions are handed to it from inside the process
    /// (the fuzz harness drives whole sessions this way). No control socket, no bind rules.
    pub fn in_process(self) -> InProcessServer {
        let (stop, _) = watch::channel(false);
        InProcessServer { state: ServerState::new(self.config, self.registry), stop }
    }
}

/// A server that serves connections made inside the process, one [`serve`](Self::serve)
/// call each: exactly what a TCP connection gets after its TLS handshake (or its plain
/// first byte), with the same budgets and rules.
pub struct InProcessServer {
    state: Arc<ServerState>,
    stop: watch::Sender<bool>,
}

impl InProcessServer {
    /// Serves one plain session on `stream` as if from `peer`, until it ends. The
    /// imported device, if any, is back in the registry when this returns.
    pub async fn serve(&self, stream: tokio::io::DuplexStream, peer: SocketAddr) {
        let session = op::serve_session(
            usbwire_transport::PeerStream::InProcess(stream),
            usbwire_transport::access::ClientId::Plain,
            peer::Peer { addr: peer, ticket: admission::Ticket::unlimited(), probe: peer::PeerProbe::none() },
            self.state.clone(),
            self.stop.subscribe(),
        );
        session.instrument(tracing::info_span!("conn", %peer)).await;
    }

    pub fn registry(&self) -> &Registry {
        &self.state.registry
    }
}

/// A server with its sockets bound, ready to [`run`](Self::run).
pub struct BoundServer {
    listener: TcpListener,
    /// Where accepted connections run.
    threads: connection_threads::ConnectionThreads,
    control: Option<control::ControlSocket>,
    externals: Vec<external::ExternalSocket>,
    metrics: Option<TcpListener>,
    http: Option<TcpListener>,
    state: Arc<ServerState>,
    text_inputs: Arc<Vec<(BusId, Arc<dyn TextInput>)>>,
    host_exports: host_exports::HostExports,
}

impl BoundServer {
    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap_or(self.state.config.listen)
    }

    pub fn registry(&self) -> &Registry {
        &self.state.registry
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
        &self.state.config.security
    }

    /// Serves until `shutdown` resolves, then closes every connection (each
    /// resets its device) and returns.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let config = &self.state.config;
        let gate = self.state.gate.clone();
        let mut summaries = tokio::time::interval(config.admission.log_interval.max(Duration::from_millis(100)));
        summaries.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut tasks = tokio::task::JoinSet::new();
        let mut threads = self.threads;
        // Both HTTP listeners share one budget of connections, apart from USB/IP's.
        let limits = http::HttpLimits::new(config.http_hosts.clone());
        if self.metrics.is_some() || self.http.is_some() {
            info!(connections = limits.max_connections, per_address = limits.per_address, "HTTP limits");
        }
        let responder = http::Responder::new(limits);
        for (listener, site) in [(self.metrics.take(), http::Site::Metrics), (self.http.take(), http::Site::StatusPage)]
        {
            if let Some(listener) = listener {
                let (state, stop) = (self.state.clone(), stop_rx.clone());
                tasks.spawn(http::serve(listener, state, stop, site, responder.clone()));
            }
        }
        // Subscribed before the scan: a device that appears in between is not missed.
        let hotplug = self.host_exports.subscribe();
        if !config.host_rules.is_empty() {
            let exported = self.host_exports.export_matching();
            info!(?exported, "real devices exported by bind rules");
        }
        tasks.spawn(self.host_exports.clone().watch(hotplug, stop_rx.clone()));
        for socket in std::mem::take(&mut self.externals) {
            tasks.spawn(socket.serve(self.state.registry.clone(), stop_rx.clone()));
        }
        if let Some(control) = self.control.take() {
            let state = self.state.clone();
            let inputs = self.text_inputs.clone();
            let hosts = self.host_exports.clone();
            let stop = stop_rx.clone();
            tasks.spawn(async move { control.serve(state, inputs, hosts, stop).await });
        }
        let addr = self.listener.local_addr().unwrap_or(self.state.config.listen);
        info!(%addr, devices = self.state.registry.len(), "usbwire server listening");
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
                    // Registered again on its connection thread's runtime.
                    let stream = match stream.into_std() {
                        Ok(stream) => stream,
                        Err(error) => {
                            warn!(%peer, %error, "cannot hand the connection to its thread");
                            continue;
                        }
                    };
                    let state = self.state.clone();
                    let stop = stop_rx.clone();
                    let span = tracing::info_span!("conn", %peer);
                    let open = self.state.meter.connection();
                    tasks.spawn(threads.spawn(move || async move {
                        let _open = open;
                        match tokio::net::TcpStream::from_std(stream) {
                            Ok(stream) => connection::handle(stream, peer, state, stop, ticket).await,
                            Err(error) => warn!(%error, "cannot register the connection on its thread"),
                        }
                    }.instrument(span)));
                }
                _ = summaries.tick() => gate.log_summary(),
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            }
        }
        info!("shutting down: closing connections and resetting devices");
        let _ = stop_tx.send(true);
        while tasks.join_next().await.is_some() {}
        threads.shut_down().await;
        if let Some(path) = &self.state.config.control_path {
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
