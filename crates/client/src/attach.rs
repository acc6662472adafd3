//! [`Attachment`]: a device imported from a server and attached to this
//! kernel's vhci-hcd, kept attached as its [`Plan`] says. `usbwire attach`,
//! `attach --follow`, `attach --auto-attach` and each `[[attach]]` rule of
//! `usbwire client` are this one thing with different plans:
//!
//! - plain USB/IP without resume, transforms, reservation or following: the
//!   kernel takes the TCP socket itself, as `usbip attach` does;
//! - otherwise the kernel gets one end of a socket pair and a task relays the
//!   other end to the server ([`crate::kernel_relay`]: TLS, transforms,
//!   resume), and, with [`Plan::follow`], imports the bus id again after each
//!   re-enumeration or loss ([`crate::follow`]).
//!
//! [`Attachment::lost`] says when the port no longer carries the device, and
//! why; [`Attachment::detach`] lets it go (the relay tells a resuming server
//! to release the device at once). Both leave no vhci record behind.
//!
//! Not for the import before it (by bus id, from the lab registry, or an
//! auto-attach's first wait — the caller imports, [`Plan::source`] says how),
//! nor for lab reservations (the caller holds one beside the attachment and
//! detaches it when the reservation is lost), nor for what `usbwire port`
//! reads (the CLI writes that from [`Attachment::status`]).

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};
use usbwire_proto::op::DeviceRecord;
use usbwire_transport::PeerStream;

use crate::follow::{FollowError, FollowStatus, Reimport, Target};
use crate::relay::{RelayState, Upstream};
use crate::vhci::{self, VhciError};
use crate::{Imported, RESUME_GIVE_UP};

/// How often a port the kernel holds the socket of is checked for having
/// been let go (vhci-hcd has no notification for it).
const WATCH_INTERVAL: Duration = Duration::from_millis(500);
/// How long a detach waits for its relay to say goodbye to the server.
const RELAY_END_WAIT: Duration = Duration::from_secs(3);

/// Where a device comes from and how it is kept attached.
#[derive(Clone)]
pub struct Plan {
    /// The server, its security and transforms, the bus id, and how it is
    /// imported again: with resume, with a lab reservation's token, and (when
    /// followed) for how long ([`Persistence`](crate::follow::Persistence)). The first import is the
    /// caller's, the same way ([`Reimport::first`] for an auto-attach).
    pub source: Reimport,
    /// `false`: the attachment ends with its session. `true`: the device is
    /// followed through re-enumerations (`--follow`) or, with
    /// [`Persistence::Forever`](crate::follow::Persistence::Forever), imported again after whatever ended it (`--auto-attach`).
    pub follow: bool,
}

impl Plan {
    /// What `usbip port` reads for the port: the server and the bus id.
    pub fn record(&self) -> vhci::Record {
        let Reimport { addr, busid, .. } = &self.source;
        vhci::Record { host: addr.ip().to_string(), service: addr.port().to_string(), busid: busid.to_string() }
    }

    /// Whether an import needs a relay: anything but plain USB/IP without
    /// resume, transforms, reservation, acceleration or following.
    fn needs_relay(&self, over_tls: bool, resumes: bool, storage: bool) -> bool {
        let Reimport { transforms, reservation, accelerate, .. } = &self.source;
        let accelerates = storage && *accelerate;
        self.follow || reservation.is_some() || resumes || over_tls || !transforms.is_empty() || accelerates
    }
}

/// Why an attachment's port no longer carries its device.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Lost {
    /// The kernel let go of the port (`usbwire detach`, `usbip detach`, or
    /// vhci-hcd dropping a connection it held itself). Nothing failed.
    #[error("port {port} was released")]
    Released { port: u32 },
    /// The relay or the follower ended (the session could not be resumed,
    /// the device did not come back, the server broke the protocol); its
    /// port was detached.
    #[error("relay ended: {0}")]
    Ended(#[from] FollowError),
    /// vhci-hcd could not be read any more.
    #[error("vhci-hcd cannot be read: {0}")]
    Vhci(VhciError),
    /// The relay's task stopped without a result (it panicked).
    #[error("the relay task stopped: {0}")]
    Task(String),
}

/// A device attached to a vhci port, and whatever keeps it attached.
pub struct Attachment {
    device: DeviceRecord,
    plan: Plan,
    over_tls: bool,
    resumes: bool,
    status: watch::Receiver<FollowStatus>,
    /// `None` when the kernel holds the server's socket itself.
    relay: Option<JoinHandle<Result<(), FollowError>>>,
}

impl Attachment {
    /// Attaches `imported` to a free vhci port and, when the plan calls for
    /// it, starts its relay on the current runtime.
    pub fn start(imported: Imported, plan: Plan) -> Result<Self, VhciError> {
        let record = plan.record();
        let device = imported.device.clone();
        let (over_tls, resumes) = (imported.stream.is_tls(), imported.resume.is_some());
        let first = |port| FollowStatus {
            port,
            attached: true,
            reattached: 0,
            vendor_id: device.id_vendor,
            product_id: device.id_product,
            relay: RelayState::Connected,
            storage: None,
        };
        let Imported { stream, resume, storage, descriptors, .. } = imported;
        let needs_relay = plan.needs_relay(over_tls, resumes, storage);
        let stream = match stream {
            PeerStream::Plain(tcp) if !needs_relay => {
                let socket = tcp.into_std().map_err(|source| VhciError::Io { path: "socket".into(), source })?;
                let port = vhci::attach(&socket, device.devid(), device.speed, &record)?;
                // The kernel holds its own reference to the socket now.
                drop(socket);
                let (_, status) = watch::channel(first(port));
                return Ok(Self { device, plan, over_tls, resumes, status, relay: None });
            }
            stream => stream,
        };
        let (port, kernel) = vhci::attach_relayed(&device, &record, None)?;
        let upstream = Upstream {
            addr: plan.source.addr,
            security: plan.source.security.clone(),
            transforms: plan.source.transforms.clone(),
            resume,
            give_up_after: RESUME_GIVE_UP,
            storage: storage && plan.source.accelerate,
            descriptors: descriptors.clone().filter(|_| plan.source.accelerate),
        };
        let (status_tx, status) = watch::channel(first(port));
        let imported = Imported { stream, device: device.clone(), resume, storage, descriptors };
        let relay = match plan.follow {
            true => {
                let target = Target { reimport: plan.source.clone(), give_up_after: RESUME_GIVE_UP, record };
                tokio::spawn(crate::follow::follow(target, imported, port, kernel, status_tx))
            }
            false => tokio::spawn(async move {
                let devid = imported.device.devid();
                crate::follow::relay_reporting(kernel, imported.stream, devid, upstream, &status_tx)
                    .await
                    .map_err(FollowError::Relay)
            }),
        };
        Ok(Self { device, plan, over_tls, resumes, status, relay: Some(relay) })
    }

    /// The port the device is on now (a followed one may move).
    pub fn port(&self) -> u32 {
        self.status.borrow().port
    }

    /// The device as the server first described it.
    pub fn device(&self) -> &DeviceRecord {
        &self.device
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Whether a relay carries the device (else the kernel holds the socket).
    pub fn is_relayed(&self) -> bool {
        self.relay.is_some()
    }

    /// Whether the first import is over TLS.
    pub fn over_tls(&self) -> bool {
        self.over_tls
    }

    /// Whether the server granted resume on the first import.
    pub fn resumes(&self) -> bool {
        self.resumes
    }

    /// Where the device is and what its relay does, as it changes.
    pub fn status(&self) -> watch::Receiver<FollowStatus> {
        self.status.clone()
    }

    /// Resolves when the port no longer carries the device. A relay that
    /// failed has its port detached; no vhci record is left behind.
    /// Cancel-safe: dropping the future leaves the attachment as it was.
    pub async fn lost(&mut self) -> Lost {
        let lost = match &mut self.relay {
            Some(relay) => match relay.await {
                Ok(Ok(())) => Lost::Released { port: self.port() },
                Ok(Err(error)) => Lost::Ended(error),
                Err(error) => Lost::Task(error.to_string()),
            },
            None => self.port_released().await,
        };
        // Joined: `detach` must not wait on the finished task again.
        self.relay = None;
        let FollowStatus { port, attached, .. } = *self.status.borrow();
        if attached {
            if !matches!(lost, Lost::Released { .. }) {
                let _ = vhci::detach(port);
            }
            let _ = std::fs::remove_file(vhci::record_path(port));
        }
        lost
    }

    /// Polls vhci-hcd until the port no longer holds this device.
    async fn port_released(&self) -> Lost {
        let (port, devid) = (self.port(), self.device.devid());
        loop {
            tokio::time::sleep(WATCH_INTERVAL).await;
            match vhci::ports() {
                Ok(ports) => match ports.iter().find(|p| p.port == port) {
                    Some(p) if !p.is_free() && p.devid == devid => {}
                    _ => return Lost::Released { port },
                },
                Err(error) => return Lost::Vhci(error),
            }
        }
    }

    /// Detaches the port (when the device is on one) and waits briefly for
    /// the relay to tell a resuming server to release the device now rather
    /// than hold it for its grace period.
    pub async fn detach(mut self) {
        let FollowStatus { port, attached, .. } = *self.status.borrow();
        if attached {
            match vhci::detach(port) {
                Ok(()) => info!(port, busid = %self.plan.source.busid, "detached"),
                Err(VhciError::PortNotInUse(_)) => {}
                Err(error) => warn!(port, %error, "detach failed"),
            }
            let _ = std::fs::remove_file(vhci::record_path(port));
        }
        if let Some(mut relay) = self.relay.take() {
            if tokio::time::timeout(RELAY_END_WAIT, &mut relay).await.is_err() {
                relay.abort();
            }
        }
    }
}

impl Drop for Attachment {
    /// An attachment dropped without [`Attachment::detach`] stops its relay
    /// (the kernel then sees the device go): nothing runs on unowned.
    fn drop(&mut self) {
        if let Some(relay) = &self.relay {
            relay.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use usbwire_proto::op::BusId;
    use usbwire_proto::reservation::ReservationToken;

    use super::*;
    use crate::follow::Persistence;
    use crate::{Security, TransformSpec};

    fn plan() -> Plan {
        let source = Reimport {
            addr: "192.0.2.7:3240".parse().unwrap(),
            security: Security::Plain,
            transforms: vec![],
            busid: BusId::new("1-1.2").unwrap(),
            resumable: true,
            reservation: None,
            persistence: Persistence::Bounded,
            accelerate: true,
        };
        Plan { source, follow: false }
    }

    #[test]
    fn only_plain_usbip_without_resume_goes_to_the_kernel_directly() {
        assert!(!plan().needs_relay(false, false, false));
        assert!(plan().needs_relay(true, false, false), "TLS");
        assert!(plan().needs_relay(false, true, false), "a session the server resumes");
        assert!(plan().needs_relay(false, false, true), "storage the server runs in stages");
        let slow = Plan { source: Reimport { accelerate: false, ..plan().source }, ..plan() };
        assert!(!slow.needs_relay(false, false, true), "--accelerate off");
        let mut transformed = plan();
        transformed.source.transforms = vec![TransformSpec::Lz4];
        assert!(transformed.needs_relay(false, false, false), "transforms");
        let mut reserved = plan();
        reserved.source.reservation = Some(ReservationToken([7; 32]));
        assert!(reserved.needs_relay(false, false, false), "a reservation");
        assert!(Plan { follow: true, ..plan() }.needs_relay(false, false, false), "following");
    }

    #[test]
    fn the_vhci_record_names_the_server_and_the_bus_id() {
        let record = plan().record();
        assert_eq!(
            (record.host.as_str(), record.service.as_str(), record.busid.as_str()),
            ("192.0.2.7", "3240", "1-1.2")
        );
    }
}
