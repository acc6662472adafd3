//! The lab registry at scale (`usbwire bench --registry etcd://…`).
//!
//! A simulated fleet registers in a prefix of its own: N in-process servers
//! of M virtual devices each, every server with its own publisher task and
//! etcd connection, as N machines would have; nothing connects to their
//! (made-up) addresses. Then, in phases: registration (until a watch has seen
//! every device), list latency (`Lab::fleet`, one client, one call after
//! another), K clients connecting, K clients reserving one device of
//! `label=nucleo` each at once, and the K releases. etcd's own request
//! counters (`/metrics` of every member, summed) are read before and after
//! each phase, so each phase reports what it cost etcd per operation; each
//! phase begins once etcd has no request in progress (one a client gave up
//! on still runs to its end in etcd, and belongs to no later phase). With
//! `etcd --metrics extensive`, etcd's own time per request is shown too. The
//! publishers are stopped at the end; deleting the prefix is the caller's
//! (`usbwire_lab::Lab::delete_all`).
//!
//! Like every bench here, nothing asserts on timings; the run does fail when
//! the registry contradicts itself (a device reserved twice).

mod etcd_metrics;
mod phases;
mod report;

pub use report::Report;
use usbwire_device::Selector;
use usbwire_device::Speed;
use usbwire_lab::publish::Registration;
use usbwire_lab::{Endpoint, LabError, ServerEntry, DEFAULT_TTL};
use usbwire_server::{Server, ServerConfig};

/// Every this many devices of the fleet (counted across servers) gets the label.
const LABEL_EVERY: usize = 10;
const LABEL: &str = "nucleo";

/// How big the simulated lab is.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    pub servers: usize,
    pub devices_per_server: usize,
    pub clients: usize,
}

/// How a run reports its progress through the long phases (registration,
/// connecting, reserving, releasing): one stage at a time.
pub trait Progress: Send + Sync {
    /// A stage of `len` steps begins.
    fn begin(&self, len: usize, message: &'static str);
    /// One more step of the stage is done.
    fn advance(&self);
    /// The stage is over.
    fn finish(&self);
}

/// Reports nothing.
pub struct Quiet;

impl Progress for Quiet {
    fn begin(&self, _len: usize, _message: &'static str) {}
    fn advance(&self) {}
    fn finish(&self) {}
}

/// Why a run ended without a report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LabBenchError {
    /// The registry could not be reached, or refused or failed a request.
    #[error(transparent)]
    Registry(#[from] LabError),
    /// The fleet did not show up in time, or the registry ended the watch:
    /// check etcd's health and try again (a smaller `--servers` first).
    #[error("{0}")]
    Unavailable(String),
    /// The registry's answers contradict each other (a device reserved twice,
    /// a count that does not add up): a bug in the registry code to report.
    #[error("{0}")]
    Inconsistent(String),
    /// A task of the run panicked or was cancelled.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
}

/// Registers a fleet of `scale` under `endpoint`'s prefix (which should be
/// the run's own), runs every phase and stops the fleet again.
pub async fn run(endpoint: &Endpoint, scale: Scale, progress: &dyn Progress) -> Result<Report, LabBenchError> {
    let metrics = etcd_metrics::Metrics::new(endpoint);
    let mut fleet = SimulatedFleet::default();
    let outcome = phases::run(endpoint, &metrics, &mut fleet, scale, progress).await;
    fleet.stop();
    outcome
}

/// The in-process servers and their publishers.
#[derive(Default)]
pub(crate) struct SimulatedFleet {
    /// Kept for as long as their devices are to stay exported.
    servers: Vec<Server>,
    publishers: Vec<tokio::task::JoinHandle<()>>,
}

impl SimulatedFleet {
    /// Builds N servers of M loopback devices; returns their registrations
    /// (labelled devices by bus id) and how many devices carry the label.
    pub(crate) fn build(
        &mut self,
        endpoint: &Endpoint,
        servers: usize,
        per_server: usize,
    ) -> (Vec<Registration>, usize) {
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
                    version: env!("CARGO_PKG_VERSION").to_owned(),
                    started_at: usbwire_lab::entry::timestamp(std::time::SystemTime::now()),
                },
                labels,
            });
            self.servers.push(server);
        }
        (registrations, labelled)
    }

    pub(crate) fn start(&mut self, registrations: Vec<Registration>) {
        for (registration, server) in registrations.into_iter().zip(&self.servers) {
            let registry = server.registry().clone();
            // Stopped by aborting (see `stop`): no revocation per server.
            let publishing = usbwire_lab::publish::publish(registration, registry, std::future::pending());
            self.publishers.push(tokio::spawn(publishing));
        }
    }

    /// Stops publishing; the registrations' leases are left to expire (the prefix is deleted anyway).
    pub(crate) fn stop(&mut self) {
        for task in self.publishers.drain(..) {
            task.abort();
        }
        self.servers.clear();
    }
}
