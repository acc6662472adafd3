//! `usbwire client --config FILE`: the long-running client. It keeps every
//! device an `[[attach]]` rule names attached to this kernel (vhci-hcd):
//! when the connection drops, the device goes away or the server restarts,
//! it attaches again — the first retry at once, then backing off to a few
//! seconds — and logs each step. SIGHUP re-reads the file: rules that did not
//! change keep their devices attached, removed rules detach, new rules start.
//! SIGTERM / SIGINT detach what this service attached and exit.
//!
//! A `server = "registry"` rule takes a free matching device from the lab
//! registry (`[registry]`), reserved for as long as it is attached: the
//! reservation is given back on detach, and a lost one detaches the device.
//! It imports over TLS pinned to the key in the server's registry entry, or
//! plain only with `[registry] plain = true` ([`super::common::registry::RegistryTrust`]).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::anyhow;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, trace, warn};
use usbwire_client::vhci;
use usbwire_client::Security;
use usbwire_device::DeviceFacts;
use usbwire_proto::retry::Retry;

use super::common::stdout::status_line;
use crate::args::{ClientArgs, ClientSecurityArgs};
use crate::config::{AttachRule, ClientConfig};
use crate::exit::Failure;

pub(crate) async fn run(args: ClientArgs) -> Result<(), Failure> {
    let config = ClientConfig::load(&args.config).map_err(Failure::config)?;
    check_pins(&config)?;
    // vhci-hcd missing or refused: the same words and exit code as `attach`.
    vhci::ports()?;
    let mut hangup =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).map_err(|e| Failure::io(e.into()))?;
    let shutdown = super::common::process::shutdown_signal();
    tokio::pin!(shutdown);
    let mut running: Vec<Running> = Vec::new();
    apply(&config, &mut running).await?;
    status_line!("usbwire client keeping {} rule(s) attached from {}", running.len(), args.config.display());
    super::common::process::notify_ready();
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = hangup.recv() => match ClientConfig::load(&args.config).and_then(|c| check_pins(&c).map(|()| c).map_err(|f| f.error)) {
                Ok(config) => {
                    info!(file = %args.config.display(), "reloading rules");
                    if let Err(error) = apply(&config, &mut running).await {
                        warn!(error = %error.error, "reload failed; keeping the rules that run");
                    }
                }
                Err(error) => warn!(%error, "config not reloaded; keeping the rules that run"),
            },
        }
    }
    info!("stopping: detaching what this service attached");
    for rule in running {
        rule.stop().await;
    }
    Ok(())
}

/// `server = "discover"` rules (TLS already required at load) accept only
/// servers whose key is pinned, since the service never trusts on first use:
/// with nothing pinned, every discovered server would be refused, so say how
/// to pin one instead of retrying forever.
fn check_pins(config: &ClientConfig) -> Result<(), Failure> {
    if !config.attach.iter().any(|r| r.server == "discover") {
        return Ok(());
    }
    let dir = config.identity.clone().unwrap_or_else(usbwire_transport::identity::default_dir);
    let known = usbwire_transport::known_servers::KnownServers::in_dir(&dir);
    if known.is_empty() {
        return Err(Failure::config(anyhow!(
            "server = \"discover\" accepts only servers whose key is pinned, and {} pins none: pin each server \
             first with `usbwire list -r HOST:PORT --tls --trust-new --identity {}`",
            known.path().display(),
            dir.display()
        )));
    }
    Ok(())
}

/// A rule being kept attached.
struct Running {
    rule: AttachRule,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Starts the rules that are new, stops the ones that are gone, leaves the rest alone.
async fn apply(config: &ClientConfig, running: &mut Vec<Running>) -> Result<(), Failure> {
    let (kept, removed): (Vec<Running>, Vec<Running>) =
        std::mem::take(running).into_iter().partition(|r| config.attach.contains(&r.rule));
    for rule in removed {
        info!(rule = %rule.rule, "rule removed; detaching");
        rule.stop().await;
    }
    *running = kept;
    for rule in &config.attach {
        if running.iter().any(|r| &r.rule == rule) {
            continue;
        }
        let security = super::common::peer::client_security(&ClientSecurityArgs {
            tls: rule.tls,
            identity: config.identity.clone(),
            trust_new: false,
        })?;
        let registry = match (&config.registry, rule.server == "registry") {
            (Some(table), true) => Some(Registry {
                endpoint: table.endpoint().map_err(Failure::config)?,
                trust: super::common::registry::RegistryTrust {
                    identity: config.identity.clone(),
                    allow_plain: table.plain,
                },
            }),
            _ => None,
        };
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(keep_attached(rule.clone(), security, registry, stopped));
        running.push(Running { rule: rule.clone(), stop, task });
    }
    Ok(())
}

/// The lab registry a `server = "registry"` rule reserves from, and how it
/// reaches the servers there.
struct Registry {
    endpoint: usbwire_lab::Endpoint,
    trust: super::common::registry::RegistryTrust,
}

/// Attaches the rule's device and attaches it again whenever it is lost, until stopped.
async fn keep_attached(
    rule: AttachRule,
    security: Security,
    registry: Option<Registry>,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = Retry::PATIENT.backoff();
    // The last failure logged: a server that stays away is said once, not every 4 s.
    let mut last_failure: Option<String> = None;
    loop {
        let delay = backoff.next_delay();
        if !delay.is_zero() {
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = stop.wait_for(|stop| *stop) => return,
            }
        }
        let attached = tokio::select! {
            attached = attach_once(&rule, &security, registry.as_ref()) => attached,
            _ = stop.wait_for(|stop| *stop) => return,
        };
        match attached {
            Ok(mut attachment) => {
                info!(rule = %rule, port = attachment.port(), busid = %attachment.busid(), "attached");
                last_failure = None;
                backoff.reset();
                let stopped = tokio::select! {
                    reason = attachment.lost() => {
                        warn!(rule = %rule, port = attachment.port(), reason, "attachment lost; attaching again");
                        false
                    }
                    _ = stop.wait_for(|stop| *stop) => true,
                };
                if stopped {
                    attachment.detach().await;
                    return;
                }
            }
            Err(error) => {
                let reason = error.to_string();
                if last_failure.as_deref() == Some(reason.as_str()) {
                    trace!(rule = %rule, %error, retry_in_ms = backoff.upcoming().as_millis(), "attach failed again");
                } else {
                    warn!(rule = %rule, %error, "attach failed; retrying until it works (said again if the reason changes)");
                    last_failure = Some(reason);
                }
            }
        }
    }
}

/// A device this service attached ([`usbwire_client::attach::Attachment`]) and
/// the lab reservation it was taken under (`server = "registry"`).
struct Attachment {
    attached: usbwire_client::attach::Attachment,
    reservation: Option<usbwire_lab::Reservation>,
}

impl Attachment {
    fn port(&self) -> u32 {
        self.attached.port()
    }

    fn busid(&self) -> &usbwire_proto::op::BusId {
        &self.attached.plan().source.busid
    }

    /// Resolves when the port no longer carries this device (connection
    /// dropped, device gone, detached by hand), the relay ended or the
    /// reservation was lost (then the device is detached: it may be someone else's).
    async fn lost(&mut self) -> String {
        let Self { attached, reservation } = self;
        let reservation_lost = async {
            match reservation {
                Some(reservation) => reservation.lost().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            lost = attached.lost() => lost.to_string(),
            error = reservation_lost => {
                let _ = vhci::detach(attached.port());
                format!("reservation lost: {error}")
            }
        }
    }

    async fn detach(self) {
        self.attached.detach().await;
        if let Some(reservation) = self.reservation {
            if let Err(error) = reservation.release().await {
                warn!(%error, "reservation not released; it ends when its lease runs out");
            }
        }
    }
}

/// The servers a rule looks at: its named server, or (`server = "discover"`)
/// every server that answers mDNS/DNS-SD.
async fn candidate_servers(rule: &AttachRule) -> anyhow::Result<Vec<SocketAddr>> {
    if rule.server != "discover" {
        return Ok(vec![usbwire_client::resolve(&rule.server).await?]);
    }
    let found = tokio::task::spawn_blocking(|| usbwire_discovery::browse(Duration::from_secs(2))).await??;
    let addrs: Vec<SocketAddr> =
        found.iter().filter_map(|s| s.addresses.first().map(|ip| SocketAddr::new(*ip, s.port))).collect();
    if addrs.is_empty() {
        anyhow::bail!("no USB/IP server answered mDNS");
    }
    Ok(addrs)
}

/// Finds an available device matching the rule and attaches it.
async fn attach_once(
    rule: &AttachRule,
    security: &Security,
    registry: Option<&Registry>,
) -> anyhow::Result<Attachment> {
    if let Some(registry) = registry {
        return attach_reserved(registry, rule).await;
    }
    let mut last_error = None;
    for addr in candidate_servers(rule).await? {
        match attach_from(addr, rule, security).await {
            Ok(attachment) => return Ok(attachment),
            Err(error) => last_error = Some(error),
        }
    }
    Err(last_error.unwrap_or_else(|| anyhow!("no server to try")))
}

async fn attach_from(addr: SocketAddr, rule: &AttachRule, security: &Security) -> anyhow::Result<Attachment> {
    let devices = usbwire_client::list_devices(addr, security).await?;
    let states = usbwire_client::device_states(addr, security).await.ok().flatten().unwrap_or_default();
    let serial_of = |busid: &str| states.iter().find(|s| s.busid == busid).map(|s| s.serial.as_str());
    let device = devices
        .iter()
        .find(|d| rule.selectors().any(|s| s.matches(&DeviceFacts::of_record(d, serial_of(d.busid.as_str())))))
        .ok_or_else(|| anyhow!("no available device on {addr} matches {rule}"))?;
    // Resumable where the server is usbwire: a network blip is carried by the
    // relay and the kernel never notices; a server that shuts down ends the
    // session, the relay ends, the port goes, and the rule attaches again.
    let imported =
        usbwire_client::import_for_relay(addr, &device.busid, security, &[], None, rule.accelerates()).await?;
    attach_imported(addr, imported, security, None, rule)
}

/// A `server = "registry"` rule: reserve a free matching device in the lab
/// registry, then import it with the reservation, over TLS pinned to the key
/// in its server's entry (or plain, where `[registry] plain = true` allows).
async fn attach_reserved(registry: &Registry, rule: &AttachRule) -> anyhow::Result<Attachment> {
    let want = rule.wanted()?;
    let mut lab = usbwire_lab::Lab::connect(registry.endpoint.clone()).await?;
    let hold = usbwire_lab::Hold::WhileRunning { ttl: usbwire_lab::DEFAULT_TTL, until: None };
    let reservation = lab.reserve(&want, hold, "usbwire client").await?;
    let imported = async {
        let security = registry.trust.security(&reservation.server).map_err(|failure| failure.error)?;
        let addr = usbwire_client::resolve(&reservation.server.address).await?;
        let busid = usbwire_proto::op::BusId::new(&reservation.device.record.busid)
            .ok_or_else(|| anyhow!("the lab registry names an invalid bus id {:?}", reservation.device.record.busid))?;
        let token = Some(&reservation.token);
        let imported =
            usbwire_client::import_for_relay(addr, &busid, &security, &[], token, rule.accelerates()).await?;
        anyhow::Ok((addr, imported, security))
    }
    .await;
    match imported {
        Ok((addr, imported, security)) => attach_imported(addr, imported, &security, Some(reservation), rule),
        Err(error) => {
            let _ = reservation.release().await;
            Err(error)
        }
    }
}

/// Hands an imported device to vhci-hcd, kept as the rule says
/// ([`usbwire_client::attach::Plan`]): a reservation and `follow` always
/// relay (the relay lives as long as this process does and holds the
/// reservation; the follower attaches the device again after each re-enumeration).
fn attach_imported(
    addr: SocketAddr,
    imported: usbwire_client::Imported,
    security: &Security,
    reservation: Option<usbwire_lab::Reservation>,
    rule: &AttachRule,
) -> anyhow::Result<Attachment> {
    let source = usbwire_client::follow::Reimport {
        addr,
        security: security.clone(),
        transforms: vec![],
        busid: imported.device.busid.clone(),
        resumable: true,
        reservation: reservation.as_ref().map(|reservation| reservation.token),
        persistence: usbwire_client::follow::Persistence::Bounded,
        accelerate: rule.accelerates(),
    };
    let plan = usbwire_client::attach::Plan { source, follow: rule.follows() };
    let attached = usbwire_client::attach::Attachment::start(imported, plan)?;
    Ok(Attachment { attached, reservation })
}
