//! The lab registry at scale (`usbwire bench --registry etcd://…`).
//!
//! A simulated fleet registers in a prefix of its own: N in-process servers
//! of M virtual devices each, every server with its own publisher task and
//! etcd connection, as N machines would have; nothing connects to their
//! (made-up) addresses. Then, in phases: registration (until a watch has seen
//! every device; the next phase waits until the servers have written their
//! last keys too, the registry's revision still for 2 s), list latency (`Lab::fleet`, one client, one call after
//! another; then filtered by `label=nucleo` and by the keyboards' VID:PID,
//! each a tenth of the fleet, and checked against the fleet filtered at the
//! same revision), K clients connecting, K clients reserving one device of
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

mod error;
mod etcd_metrics;
mod fleet;
mod phases;
mod progress;
mod report;

pub use error::LabBenchError;
pub use fleet::Scale;
pub use progress::{Progress, Quiet};
pub use report::Report;
use usbwire_lab::Endpoint;

use etcd_metrics::Metrics;
use fleet::SimulatedFleet;

/// Registers a fleet of `scale` under `endpoint`'s prefix (which should be
/// the run's own), runs every phase and stops the fleet again.
pub async fn run(endpoint: &Endpoint, scale: Scale, progress: &dyn Progress) -> Result<Report, LabBenchError> {
    let metrics = Metrics::new(endpoint);
    let mut fleet = SimulatedFleet::default();
    let outcome = phases::run(endpoint, &metrics, &mut fleet, scale, progress).await;
    fleet.stop();
    outcome
}
