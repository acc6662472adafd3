//! A lab of many servers: a shared device registry on etcd.
//!
//! * Servers ([`publish`]) register themselves and every device they export
//!   under a lease they keep alive, and publish each change (plug, unplug,
//!   import, release) as it happens; a server that dies leaves the registry
//!   when its lease expires. They follow the reservations of their devices
//!   and refuse imports that do not carry the reservation's token.
//! * Clients ([`Lab`]) list the fleet (a page at a time: [`FleetPages`]),
//!   follow it live, and reserve a free matching device with an etcd
//!   transaction under their own lease, so two clients never hold the same
//!   device; a reservation ends on release, at
//!   the end of `--for`, or when its holder dies (its lease expires). A
//!   [`Reservation`] carries its server's entry, whose TLS key the client
//!   pins when it imports: the registry names servers but does not vouch
//!   for them, and records that name another server than their keys are
//!   not taken.
//!
//! etcd does the coordinating (leases, transactions, watches); this crate
//! only lays out keys and records ([`entry`]). It is not needed to serve or
//! import directly: a server whose registry is unreachable keeps serving.

pub mod catalog;
pub mod entry;
mod error;
mod etcd;
mod lab;
mod matching;
mod pace;
mod pages;
pub mod publish;
mod request;
mod take;
#[cfg(test)]
mod testing;
pub mod url;

pub use entry::{DeviceEntry, Fleet, FleetDevice, ReservationEntry, ServerEntry, Want, WantError, SCHEMA_VERSION};
pub use error::LabError;
pub use etcd::{Endpoint, EtcdTls, DEFAULT_TTL};
pub use lab::{FleetChange, Hold, Lab, Reads, Reservation};
pub use pages::{FleetPages, Listed};
pub use url::{RegistryUrl, UrlError};
