//! A lab of many servers: a shared device registry on etcd.
//!
//! * Servers ([`publish`]) register themselves and every device they export
//!   under a lease they keep alive, and publish each change (plug, unplug,
//!   import, release) as it happens; a server that dies leaves the registry
//!   when its lease expires. They follow the reservations of their devices
//!   and refuse imports that do not carry the reservation's token.
//! * Clients ([`Lab`]) list the fleet, follow it live, and reserve a free
//!   matching device with an etcd transaction under their own lease, so two
//!   clients never hold the same device; a reservation ends on release, at
//!   the end of `--for`, or when its holder dies (its lease expires). A
//!   [`Reservation`] carries its server's entry, whose TLS key the client
//!   pins when it imports: the registry names servers but does not vouch
//!   for them, and records that name another server than their keys are
//!   not taken.
//!
//! etcd does the coordinating (leases, transactions, watches); this crate
//! only lays out keys and records ([`entry`]). It is not needed to serve or
//! import directly: a server whose registry is unreachable keeps serving.

pub mod entry;
mod etcd;
mod lab;
pub mod publish;
#[cfg(test)]
mod testing;
pub mod url;

pub use entry::{DeviceEntry, Fleet, FleetDevice, ReservationEntry, ServerEntry, Want, WantError, SCHEMA_VERSION};
pub use etcd::{Endpoint, EtcdTls, DEFAULT_TTL};
pub use lab::{Hold, Lab, Reservation};
pub use url::{RegistryUrl, UrlError};

/// What went wrong with the registry.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LabError {
    /// No etcd member answered: the cluster is down, `--registry` names the
    /// wrong place, or TLS towards it failed.
    #[error("lab registry {url} unreachable: {reason} ({})", unreachable_hint(.reason, *.tls))]
    Unreachable { url: String, reason: String, tls: bool },
    /// A request reached etcd and failed.
    #[error("lab registry request failed: {0}")]
    Request(#[from] etcd_client::Error),
    /// The TLS files for etcd could not be read.
    #[error("TLS for the lab registry: {0}")]
    Tls(String),
    /// No registered device matches the selector at all.
    #[error("no device in the lab registry matches {want}")]
    NoMatch { want: String },
    /// Devices match, but every one is reserved or in use.
    #[error(
        "no free device matches {want}: all {matching} matching are taken ({reserved} reserved, {in_use} in use without a reservation); try again later"
    )]
    NoneFree { want: String, matching: usize, reserved: usize, in_use: usize },
    /// The lease that held a registration or reservation ended (etcd unreachable for its time to live).
    #[error("lease {lease:x} lost: {reason}")]
    LeaseLost { lease: i64, reason: String },
    /// `release` named a reservation that does not exist (or is not ours).
    #[error("{what} is not reserved{by}")]
    NotReserved { what: String, by: String },
}

/// What to check, from why etcd could not be reached.
fn unreachable_hint(reason: &str, tls: bool) -> &'static str {
    let reason = reason.to_ascii_lowercase();
    if reason.contains("certificate") || reason.contains("alert") {
        "TLS towards etcd failed: check --registry-ca, --registry-cert and --registry-key (or [registry] ca, cert, key)"
    } else if tls {
        "is etcd running there, with TLS? check --registry, and --registry-ca, --registry-cert and --registry-key"
    } else {
        "is etcd running there? check --registry"
    }
}

impl LabError {
    /// The registry could not be reached (as opposed to: it answered no).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Self::Unreachable { .. } | Self::Request(_) | Self::LeaseLost { .. })
    }
}
