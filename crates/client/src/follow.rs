//! Keeping a kernel attachment through re-enumerations: a device that
//! disconnects and comes back at the same bus id as another device (a DFU
//! board entering its bootloader and, after flashing, its new firmware) is
//! imported again and attached again — on the same vhci port when it is
//! free — whatever its VID:PID now.
//!
//! A usbwire server says when it happens (END with the reason
//! `REENUMERATED`, `docs/protocol.md` §5.3) and exports the bus id again at
//! once; the import that follows waits on the server for the device to be
//! listed, so nothing here polls. A stock server (usbipd) only closes the
//! connection: then the bus id is imported again with a bounded retry
//! ([`FALLBACK_WINDOW`]). The kernel sees an unplug and a plug, as with a
//! real board on a local port. The attachment ends when the kernel lets go
//! (`usbwire detach`), or when the device is not back in time.
//!
//! With [`Persistence::Forever`] (`usbwire attach --auto-attach`, as
//! usbipd-win's) there is no window: whatever ended the attachment (a server
//! restart, a network outage, the device unplugged or withdrawn on the
//! server), the bus id is imported again until it is back, backing off to
//! [`AUTO_ATTACH_MAX_INTERVAL`], and only a refusal that waiting cannot fix
//! ([`ClientError::is_lasting`]) ends it. Each change is logged once: the
//! device went away, waiting for the server (again only if the reason
//! changes), attached again; each attempt is a trace event, not a line.
//!
//! How a bus id is imported again ([`Reimport`], [`WentAway`]) is shared
//! with the usbredir bridge, which follows a device for its guest the same
//! way with `device_disconnect` / `device_connect` instead of vhci. Where
//! the device is attached is a [`Ports`]: vhci-hcd ([`Vhci`]) for the kernel.
//!
//! Not the entry for callers: a kernel attachment is an
//! [`crate::attach::Attachment`] whose plan follows. Not for userspace imports
//! ([`crate::ReattachingDevice`] imports again after any loss) nor for
//! choosing a device (the caller names the bus id).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::{info, trace, warn};
use usbwire_proto::op::BusId;
use usbwire_proto::op::DeviceRecord;
use usbwire_proto::reservation::ReservationToken;

use crate::kernel_relay;
use crate::relay::{RelayError, RelayState, Upstream};
use crate::storage::StorageCounters;
use crate::vhci::{self, VhciError};
use usbwire_proto::retry::Retry;

use crate::{ClientError, ConnectionEnd, Imported, Security, TransformSpec};

/// How long a device that went away without a word (a stock server, or a
/// server restart) is looked for at its bus id before the attachment ends.
pub const FALLBACK_WINDOW: Duration = Duration::from_secs(30);
/// How long a device the server said re-enumerated is looked for (the
/// server's own import wait covers most of it).
pub const NOTICE_WINDOW: Duration = Duration::from_secs(10);

/// The longest wait between two attempts of an auto-attach ([`Retry::PATIENT`]):
/// a server that comes back is attached within this.
pub const AUTO_ATTACH_MAX_INTERVAL: Duration = Retry::PATIENT.cap();

/// How long a device that went away is looked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Persistence {
    /// `--follow`: for [`WentAway::window`], then the attachment ends.
    Bounded,
    /// `--auto-attach`: until it is back, however long it takes, whatever
    /// ended the attachment; only a lasting refusal ends it.
    Forever,
}

/// What is followed and how it is imported again.
#[derive(Clone)]
pub struct Target {
    /// The server, the bus id and how it is imported again (and for how long).
    pub reimport: Reimport,
    /// How long each import's relay tries to resume a dropped session.
    pub give_up_after: Duration,
    /// What `usbip port` reads for the port.
    pub record: vhci::Record,
}

/// Where a followed device is attached, and attached again: vhci-hcd
/// ([`Vhci`]), or, in tests, a userspace stand-in for it.
pub trait Ports {
    /// Attaches `device` (on `preferred` if free) and returns its port and the
    /// end of the socket the relay carries.
    fn attach(
        &mut self,
        device: &DeviceRecord,
        record: &vhci::Record,
        preferred: Option<u32>,
    ) -> Result<(u32, tokio::net::UnixStream), VhciError>;
    /// Detaches `port`: its device is unplugged for the kernel.
    fn detach(&mut self, port: u32) -> Result<(), VhciError>;
    /// Resolves once a detached `port` is free again (or after a short wait).
    fn freed(&mut self, port: u32) -> impl std::future::Future<Output = ()> + Send;
}

/// This kernel's vhci-hcd.
pub struct Vhci;

impl Ports for Vhci {
    fn attach(
        &mut self,
        device: &DeviceRecord,
        record: &vhci::Record,
        preferred: Option<u32>,
    ) -> Result<(u32, tokio::net::UnixStream), VhciError> {
        vhci::attach_relayed(device, record, preferred)
    }

    fn detach(&mut self, port: u32) -> Result<(), VhciError> {
        vhci::detach(port)
    }

    fn freed(&mut self, port: u32) -> impl std::future::Future<Output = ()> + Send {
        port_freed(port)
    }
}

/// Where the followed device is now, for `usbwire port`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FollowStatus {
    pub port: u32,
    /// False while the device is away (its port detached, maybe someone else's by now).
    pub attached: bool,
    /// Times the device was attached again after a re-enumeration.
    pub reattached: u64,
    pub vendor_id: u16,
    pub product_id: u16,
    pub relay: RelayState,
    /// What the storage accelerator did, when it runs (`usbwire port`).
    pub storage: Option<StorageCounters>,
}

/// Why following stopped (other than the kernel letting go).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FollowError {
    /// The relay failed in a way that is not the device going away.
    #[error(transparent)]
    Relay(RelayError),
    /// The device did not come back at its bus id in time.
    #[error("{busid} did not come back within {} s after {why}: {last}", .window.as_secs())]
    NotBack { busid: BusId, why: String, window: Duration, last: ClientError },
    /// The kernel refused the new attachment.
    #[error("cannot attach {busid} again: {source}")]
    Vhci { busid: BusId, source: VhciError },
    /// An auto-attach met a refusal that waiting cannot fix
    /// ([`ClientError::is_lasting`]); its message says what to change.
    #[error("stopped trying to attach {busid}: {source}")]
    Refused { busid: BusId, source: ClientError },
}

/// Relays `imported` on `port` (the kernel holds the other end of `kernel`),
/// and after each re-enumeration imports `target.busid` again and attaches
/// it. `Ok` when the kernel lets go; `status` follows the port and counts.
pub(crate) async fn follow(
    target: Target,
    imported: Imported,
    port: u32,
    kernel: tokio::net::UnixStream,
    status: watch::Sender<FollowStatus>,
) -> Result<(), FollowError> {
    follow_on(&mut Vhci, target, imported, port, kernel, status).await
}

/// [`follow`], attaching through `ports`.
pub async fn follow_on<P: Ports>(
    ports: &mut P,
    target: Target,
    imported: Imported,
    port: u32,
    kernel: tokio::net::UnixStream,
    status: watch::Sender<FollowStatus>,
) -> Result<(), FollowError> {
    let (mut imported, mut port, mut kernel) = (imported, port, kernel);
    let Target { reimport, give_up_after, record } = &target;
    let (busid, forever) = (&reimport.busid, reimport.persistence == Persistence::Forever);
    let mut reattached = 0u64;
    loop {
        let device = imported.device.clone();
        status.send_replace(FollowStatus {
            port,
            attached: true,
            reattached,
            vendor_id: device.id_vendor,
            product_id: device.id_product,
            relay: RelayState::Connected,
            storage: None,
        });
        let upstream = Upstream {
            addr: reimport.addr,
            security: reimport.security.clone(),
            transforms: reimport.transforms.clone(),
            resume: imported.resume,
            give_up_after: *give_up_after,
            storage: imported.storage && reimport.accelerate,
            descriptors: imported.descriptors.filter(|_| reimport.accelerate),
        };
        let ended = relay_reporting(kernel, imported.stream, device.devid(), upstream, &status).await;
        let went = match ended {
            Ok(()) => return Ok(()),
            Err(RelayError::Reenumerated { .. }) => WentAway::Reenumerated,
            Err(RelayError::SessionLost { reason, .. }) => WentAway::ConnectionEnded(reason),
            // Auto-attach: a server that broke the protocol is lost like any other.
            Err(RelayError::Server(error)) if forever => WentAway::ConnectionEnded(error.to_string()),
            Err(other) => return Err(FollowError::Relay(other)),
        };
        let why = went.to_string();
        let noticed = Instant::now();
        // The kernel sees the device unplugged; its port is taken again below when free.
        match ports.detach(port) {
            Ok(()) | Err(VhciError::PortNotInUse(_)) => {}
            Err(error) => warn!(port, %error, "cannot detach the port of the device that went away"),
        }
        status.send_modify(|status| status.attached = false);
        info!(%busid, port, why, "device went away; importing its bus id again");
        imported = reimport.after(&went).await?;
        ports.freed(port).await;
        let again = ports
            .attach(&imported.device, record, Some(port))
            .map_err(|source| FollowError::Vhci { busid: busid.clone(), source })?;
        (port, kernel) = again;
        reattached += 1;
        info!(
            %busid,
            port,
            vid = format_args!("{:04x}", imported.device.id_vendor),
            pid = format_args!("{:04x}", imported.device.id_product),
            reattach_ms = noticed.elapsed().as_millis() as u64,
            reattached,
            why,
            "attached again"
        );
    }
}

/// How long the kernel may take to let go of a detached port before the
/// device is attached elsewhere.
const PORT_RELEASE_WAIT: Duration = Duration::from_millis(500);

/// Waits (briefly) for vhci-hcd to free `port` after its detach, so the
/// device goes back where it was. vhci frees it on its event thread, which
/// has no notification; its status file is read every 10 ms.
async fn port_freed(port: u32) {
    let started = Instant::now();
    while started.elapsed() < PORT_RELEASE_WAIT {
        let free = vhci::ports().map_or(true, |ports| ports.iter().any(|p| p.port == port && p.is_free()));
        if free {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs the relay, mirroring its state into `status` (an [`crate::attach::Attachment`]'s
/// relay without following too).
pub(crate) async fn relay_reporting(
    kernel: tokio::net::UnixStream,
    stream: usbwire_transport::PeerStream,
    devid: u32,
    upstream: Upstream,
    status: &watch::Sender<FollowStatus>,
) -> Result<(), RelayError> {
    let (state_tx, mut states) = watch::channel(RelayState::Connected);
    let (counters_tx, mut counters) = watch::channel(StorageCounters::default());
    let accelerated = upstream.storage;
    status.send_modify(|status| status.storage = accelerated.then(StorageCounters::default));
    let (port, vendor_id, product_id) = {
        let now = status.borrow();
        (now.port, now.vendor_id, now.product_id)
    };
    let relay = kernel_relay::run(kernel, stream, devid, upstream, Some(state_tx), Some(counters_tx));
    let reporting = async {
        loop {
            tokio::select! {
                changed = states.changed() => match changed {
                    Ok(()) => {
                        let state = *states.borrow_and_update();
                        status.send_modify(|status| status.relay = state);
                    }
                    Err(_) => break,
                },
                Ok(()) = counters.changed() => {
                    let now = *counters.borrow_and_update();
                    status.send_modify(|status| status.storage = Some(now));
                }
            }
        }
        // The relay dropped its sender: it has ended, and the other branch has its result.
        std::future::pending::<std::convert::Infallible>().await
    };
    // An accelerated disk known to take 1 MiB commands gets them once the kernel made it.
    let raising = async {
        if accelerated {
            crate::disk_limits::raise_when_attached(port, vendor_id, product_id).await;
        }
        std::future::pending::<std::convert::Infallible>().await
    };
    tokio::select! {
        ended = relay => ended,
        never = reporting => match never {},
        never = raising => match never {},
    }
}

/// Why a followed device is looked for again, which says for how long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WentAway {
    /// The server said the device re-enumerated (END `REENUMERATED`): it
    /// exports the bus id again at once ([`NOTICE_WINDOW`]).
    Reenumerated,
    /// The connection ended without a word, with the relay's reason (a stock
    /// server's unplug or re-enumeration, a server restart): [`FALLBACK_WINDOW`].
    ConnectionEnded(String),
}

impl WentAway {
    /// How long the bus id is tried before the device counts as gone.
    pub fn window(&self) -> Duration {
        match self {
            Self::Reenumerated => NOTICE_WINDOW,
            Self::ConnectionEnded(_) => FALLBACK_WINDOW,
        }
    }

    /// Why a userspace connection ended, as this says it; `None` when its
    /// users closed it (nothing went away).
    pub fn of(end: &ConnectionEnd) -> Option<Self> {
        match end {
            ConnectionEnd::Closed => None,
            ConnectionEnd::Reenumerated => Some(Self::Reenumerated),
            ConnectionEnd::Lost(reason) => Some(Self::ConnectionEnded(reason.clone())),
        }
    }
}

impl std::fmt::Display for WentAway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Reenumerated => f.write_str("the server said it re-enumerated"),
            Self::ConnectionEnded(reason) => write!(f, "the connection ended ({reason})"),
        }
    }
}

/// How a followed bus id is imported again: the server, its security and
/// transforms, whether to ask for resume, and the lab reservation each
/// import carries (so it holds across re-enumerations).
#[derive(Clone)]
pub struct Reimport {
    pub addr: SocketAddr,
    pub security: Security,
    pub transforms: Vec<TransformSpec>,
    pub busid: BusId,
    pub resumable: bool,
    pub reservation: Option<ReservationToken>,
    pub persistence: Persistence,
    /// Accelerate a mass-storage device when the server agrees (`--accelerate
    /// auto`, the default): the relay pipelines its commands (`storage`).
    pub accelerate: bool,
}

impl Reimport {
    /// Imports the bus id again after the device `went` away: at once, then
    /// [`Retry::SOON`], for the window that calls for ([`Persistence::Bounded`]);
    /// or [`Retry::PATIENT`] until it is back
    /// ([`Persistence::Forever`]). A usbwire server's import waits on its side
    /// while the device is still being released.
    pub async fn after(&self, went: &WentAway) -> Result<Imported, FollowError> {
        self.retrying(Some(went)).await
    }

    /// The first import of an auto-attach: at once, and with
    /// [`Persistence::Forever`] on until the server and the device are there,
    /// as after a loss; a single attempt otherwise.
    pub async fn first(&self) -> Result<Imported, FollowError> {
        self.retrying(None).await
    }

    async fn retrying(&self, went: Option<&WentAway>) -> Result<Imported, FollowError> {
        let forever = self.persistence == Persistence::Forever;
        let why = went.map_or_else(|| "the first attempt failed".to_owned(), ToString::to_string);
        let window = match went {
            Some(went) => went.window(),
            None => Duration::ZERO,
        };
        let retry = if forever { Retry::PATIENT } else { Retry::SOON };
        let (started, mut backoff) = (Instant::now(), retry.backoff());
        // What the server last said, so a long wait is logged once (and again only when that changes).
        let mut waiting_on = None;
        loop {
            tokio::time::sleep(backoff.next_delay()).await;
            let busid = &self.busid;
            let last = match self.import_once().await {
                Ok(imported) => return Ok(imported),
                Err(last) => last,
            };
            if forever && last.is_lasting() {
                return Err(FollowError::Refused { busid: busid.clone(), source: last });
            }
            if !forever && started.elapsed() >= window {
                return Err(FollowError::NotBack { busid: busid.clone(), why, window, last });
            }
            let kind = std::mem::discriminant(&last);
            if forever && waiting_on != Some(kind) {
                waiting_on = Some(kind);
                info!(%busid, error = %last, retry_max_s = retry.cap().as_secs(),
                    "waiting for {} to offer {busid} again; trying on until it does", self.addr);
            } else {
                trace!(%busid, error = %last, "not back yet");
            }
        }
    }

    /// One import of the device, as this plan says: reserved, resumable
    /// (accelerated or not), or plain.
    pub async fn import_once(&self) -> Result<Imported, ClientError> {
        let Self { addr, security, transforms, busid, accelerate, .. } = self;
        match (&self.reservation, self.resumable) {
            (token @ Some(_), _) | (token @ None, true) => {
                crate::import_for_relay(*addr, busid, security, transforms, token.as_ref(), *accelerate).await
            }
            (None, false) => crate::import_with(*addr, busid, security, transforms)
                .await
                .map(|(stream, device)| Imported { stream, device, resume: None, storage: false, descriptors: None }),
        }
    }
}
