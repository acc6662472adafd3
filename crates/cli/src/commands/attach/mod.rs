//! `usbwire attach / port / detach`: the kernel's vhci-hcd as the client,
//! with our OP phase in front (works with usbipd and usbipd-win servers too).
//!
//! A plain import without resume hands the TCP socket to the kernel, as
//! `usbip attach` does. Otherwise (a usbwire server that resumes sessions,
//! TLS, transforms) the kernel gets one end of a socket pair and a relay
//! ([`usbwire_client::relay`]) carries the URB channel, in a process `attach`
//! forked before the import; `attach` returns once the device is attached,
//! and `port` shows each relay's state from `/var/run/vhci_hcd/usbwire-portN.json`.
//!
//! `attach --registry` reserves the device in the lab registry and imports it
//! over TLS pinned to the key in its server's entry, or plain only with
//! `--allow-plain` ([`super::common::registry::RegistryTrust`]); the relay holds the
//! reservation.
//!
//! This file is the `attach` verb up to the import: which device, from where, and
//! whether the kernel takes the socket itself. The rest of the family, one file each:
//! [`auto`] (`--auto-attach`'s first import), [`background`] (the relay's own
//! process), [`relay`] (the relay once attached), [`status_file`] (what `port` reads
//! of it), [`port`] and [`detach`]. Not here: `usbwire client`, which keeps its
//! config's `[[attach]]` rules attached (`commands::service`).

mod auto;
mod background;
pub(crate) mod detach;
pub(crate) mod port;
mod relay;
mod status_file;

use anyhow::anyhow;
use usbwire_client::vhci;
use usbwire_proto::op::BusId;

use super::common::stdout::outln;
use crate::args::AttachArgs;
use crate::exit::Failure;
pub(crate) use background::fork_if_backgrounded;

pub(crate) async fn run(args: AttachArgs) -> Result<(), Failure> {
    let wanted = match (&args.registry.registry, &args.device) {
        (Some(_), None) => {
            return Err(Failure::usage(anyhow!("--registry needs --device SELECTOR (which device to take)")))
        }
        (Some(_), Some(device)) => Some(device.clone()),
        _ => None,
    };
    let named_busid = match &args.busid {
        Some(text) if wanted.is_none() => {
            Some(BusId::new(text).ok_or_else(|| Failure::usage(anyhow!("invalid bus id {text:?}")))?)
        }
        _ => None,
    };
    // Check vhci before asking the server, so a missing module costs nothing remote.
    vhci::ports()?;
    let transforms = super::common::peer::transforms(args.compress.as_deref(), args.jitter_buffer);
    // A reservation lives as long as the process that holds it: the relay, which
    // `background::fork_if_backgrounded` started before the runtime (an auto-attach
    // runs until stopped, in the foreground, as usbipd-win's).
    let following = args.follow || args.auto_attach;
    let (addr, busid, security, taken) = source(&args, wanted.as_deref(), named_busid).await?;
    let source = usbwire_client::follow::Reimport {
        addr,
        security,
        transforms,
        busid,
        resumable: !args.no_resume,
        reservation: taken.as_ref().map(|taken| taken.token),
        persistence: match args.auto_attach {
            true => usbwire_client::follow::Persistence::Forever,
            false => usbwire_client::follow::Persistence::Bounded,
        },
        accelerate: args.accelerate == "auto",
    };
    let plan = usbwire_client::attach::Plan { source, follow: following };
    let imported = match first_import(&plan, args.auto_attach).await {
        Ok(Some(imported)) => imported,
        Ok(None) => return Ok(()),
        Err(failure) => return Err(give_back(taken, failure).await),
    };
    let attachment = match usbwire_client::attach::Attachment::start(imported, plan) {
        Ok(attachment) => attachment,
        Err(error) => return Err(give_back(taken, error.into()).await),
    };
    if attachment.is_relayed() {
        return relay::relay_attached(attachment, taken).await;
    }
    // Plain USB/IP without resume: the kernel took the socket itself, and this
    // command's work is done: a report.
    let source = &attachment.plan().source;
    outln!(
        "attached {} from {} to port {} ({} speed)",
        source.busid,
        source.addr,
        attachment.port(),
        attachment.device().speed.for_vhci().name()
    )
}

/// Gives a reservation taken for a device that was not attached back at once,
/// and passes on why.
async fn give_back(taken: Option<super::common::registry::Taken>, failure: Failure) -> Failure {
    if let Some(held) = taken.and_then(|taken| taken.held) {
        let _ = held.release().await;
    }
    failure
}

/// The first import of `plan`'s device: with its reservation, waiting for the
/// server and device (`--auto-attach`), or at once. `None` when an auto-attach
/// was stopped before the device was there.
async fn first_import(
    plan: &usbwire_client::attach::Plan,
    auto_attach: bool,
) -> Result<Option<usbwire_client::Imported>, Failure> {
    let imported = match &plan.source.reservation {
        None if auto_attach => return auto::first_import(&plan.source).await,
        _ => plan.source.import_once().await?,
    };
    Ok(Some(imported))
}

/// The server and device to import: a free device matching `wanted` taken in the lab
/// registry (with the reservation, released again if its server cannot be reached), or the
/// bus id named with -r/-b.
async fn source(
    args: &AttachArgs,
    wanted: Option<&str>,
    named_busid: Option<BusId>,
) -> Result<(std::net::SocketAddr, BusId, usbwire_client::Security, Option<super::common::registry::Taken>), Failure> {
    match (wanted, named_busid) {
        (Some(device), _) => {
            let mut taken = super::common::registry::take(&args.registry, device, args.hold_for).await?;
            let trust = super::common::registry::RegistryTrust {
                identity: args.security.identity.clone(),
                allow_plain: args.allow_plain,
            };
            match reserved_server(&taken, &trust).await {
                Ok((addr, busid, security)) => Ok((addr, busid, security, Some(taken))),
                Err(failure) => {
                    if let Some(held) = taken.held.take() {
                        let _ = held.release().await;
                    }
                    Err(failure)
                }
            }
        }
        (None, Some(busid)) => {
            let security = super::common::peer::client_security(&args.security)?;
            let remote = args.remote.as_deref().unwrap_or_default();
            Ok((super::common::peer::resolve(remote, args.tcp_port).await?, busid, security, None))
        }
        (None, None) => {
            Err(Failure::usage(anyhow!("attach needs -r HOST -b BUSID, or --registry URL --device SELECTOR")))
        }
    }
}

/// Where and how to import a device reserved in the lab registry: its
/// server's address and the security its entry calls for
/// ([`super::common::registry::RegistryTrust`]: TLS pinned to the entry's key, or plain
/// if allowed).
async fn reserved_server(
    taken: &super::common::registry::Taken,
    trust: &super::common::registry::RegistryTrust,
) -> Result<(std::net::SocketAddr, BusId, usbwire_client::Security), Failure> {
    let busid = BusId::new(&taken.busid)
        .ok_or_else(|| Failure::protocol(anyhow!("the lab registry names an invalid bus id {:?}", taken.busid)))?;
    let security = trust.security(&taken.server)?;
    let addr = super::common::peer::resolve(&taken.server.address, None).await?;
    Ok((addr, busid, security))
}
