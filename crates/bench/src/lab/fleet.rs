//! The simulated lab: its [`Scale`], and the [`SimulatedFleet`] of
//! in-process servers of loopback devices, each with its own publisher task
//! and etcd connection, every [`LABEL_EVERY`]th device labelled [`LABEL`],
//! and every [`Scale::keyboard_every`]th (by default another tenth) a
//! keyboard ([`KEYBOARD`]) among loopback devices, so that a VID:PID matches
//! part of the fleet too.
//!
//! It sits below the phases that build, start and stop it. It is not for
//! measuring anything (`phases`, `etcd_metrics`).

use usbwire_device::{Selector, Speed};
use usbwire_lab::publish::Registration;
use usbwire_lab::{Endpoint, ServerEntry, DEFAULT_TTL};
use usbwire_server::{Server, ServerConfig};

/// Every this many devices of the fleet (counted across servers) gets the label.
pub(super) const LABEL_EVERY: usize = 10;
pub(super) const LABEL: &str = "nucleo";
/// The VID:PID of the keyboards among the loopback devices.
pub(super) const KEYBOARD: &str = "1209:0001";

/// How big the simulated lab is.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    pub servers: usize,
    pub devices_per_server: usize,
    pub clients: usize,
    /// Every this many devices (counted across servers) is a keyboard, the
    /// rest loopback devices. At 2 no VID:PID or class is held by more than
    /// half of a server's devices: each device is then in a catalog of its
    /// VID:PID and of its class, besides the whole one (the catalogs' worst
    /// case for writes).
    pub keyboard_every: usize,
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
        keyboard_every: usize,
    ) -> (Vec<Registration>, usize) {
        let mut registrations = Vec::with_capacity(servers);
        let mut labelled = 0;
        for i in 0..servers {
            let mut server = Server::new(ServerConfig::default());
            let mut labels = Vec::new();
            for j in 0..per_server {
                let n = i * per_server + j;
                let busid = if n % keyboard_every == keyboard_every / 2 {
                    server.export("keyboard", Box::new(usbwire_gadgets::keyboard().0))
                } else {
                    server.export("loopback", Box::new(usbwire_gadgets::loopback(Speed::HIGH)))
                };
                if n.is_multiple_of(LABEL_EVERY) {
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
                    catalog: true,
                    catalog_terms: Vec::new(),
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
