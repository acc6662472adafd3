//! `usbwire attach / port / detach`: the kernel's vhci-hcd as the client,
//! with our OP phase in front (works with usbipd and usbipd-win servers too).
//!
//! A plain import without resume hands the TCP socket to the kernel, as
//! `usbip attach` does. Otherwise (a usbwire server that resumes sessions,
//! TLS, transforms) the kernel gets one end of a socket pair and a relay
//! ([`usbwire_client::relay`]) carries the URB channel; `attach` then starts
//! itself again in the background and returns once the device is attached,
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
use background::{attach_in_background, RELAY_LOG_ENV};

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
    // A reservation lives as long as the process that holds it: the relay.
    let following = args.follow || args.auto_attach;
    let may_relay = wanted.is_some() || following || !args.no_resume || args.security.tls || !transforms.is_empty();
    // An auto-attach runs until stopped, in the foreground (as usbipd-win's).
    let foreground = args.foreground || args.auto_attach;
    if may_relay && !foreground && std::env::var_os(RELAY_LOG_ENV).is_none() {
        return attach_in_background();
    }
    let (addr, busid, security, taken) = source(&args, wanted.as_deref(), named_busid).await?;
    let persistence = match args.auto_attach {
        true => usbwire_client::follow::Persistence::Forever,
        false => usbwire_client::follow::Persistence::Bounded,
    };
    let reimport = usbwire_client::follow::Reimport {
        addr,
        security: security.clone(),
        transforms: transforms.clone(),
        busid: busid.clone(),
        resumable: !args.no_resume,
        reservation: None,
        persistence,
    };
    let imported = match &taken {
        None if args.auto_attach => match auto::first_import(&reimport).await? {
            Some(imported) => imported,
            None => return Ok(()),
        },
        Some(reserved) => {
            match usbwire_client::import_reserved(addr, &busid, &security, &transforms, &reserved.token).await {
                Ok(imported) => imported,
                Err(error) => {
                    if let Some(held) = taken.and_then(|t| t.held) {
                        let _ = held.release().await;
                    }
                    return Err(error.into());
                }
            }
        }
        None if args.no_resume => {
            let (stream, device) = usbwire_client::import_with(addr, &busid, &security, &transforms).await?;
            usbwire_client::Imported { stream, device, resume: None }
        }
        None => usbwire_client::import_resumable(addr, &busid, &security, &transforms).await?,
    };
    let record =
        vhci::Record { host: addr.ip().to_string(), service: addr.port().to_string(), busid: busid.to_string() };
    let needs_relay =
        following || taken.is_some() || imported.resume.is_some() || imported.stream.is_tls() || !transforms.is_empty();
    if !needs_relay {
        // Plain USB/IP without resume: the kernel takes the socket itself.
        let usbwire_transport::PeerStream::Plain(tcp) = imported.stream else {
            return Err(Failure::software(anyhow!("a plain import returned a TLS stream")));
        };
        let socket = tcp.into_std().map_err(|e| Failure::io(e.into()))?;
        let port = vhci::attach(&socket, imported.device.devid(), imported.device.speed, &record)?;
        // The kernel holds its own reference to the socket now.
        drop(socket);
        // Attached, and this command's work done: a report.
        return outln!(
            "attached {busid} from {addr} to port {port} ({} speed)",
            imported.device.speed.for_vhci().name()
        );
    }
    let upstream = usbwire_client::relay::Upstream {
        addr,
        security,
        transforms: transforms.clone(),
        resume: imported.resume,
        give_up_after: usbwire_client::RESUME_GIVE_UP,
    };
    let follow = following.then(|| usbwire_client::follow::Target {
        upstream: upstream.clone(),
        busid: busid.clone(),
        resumable: !args.no_resume,
        reservation: taken.as_ref().map(|taken| taken.token),
        record: record.clone(),
        persistence,
    });
    relay::relay_attached(imported, upstream, record, taken, follow).await
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
