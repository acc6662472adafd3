//! The relay of an attached port: vhci-hcd gets one end of a socket pair and
//! this process relays between the other end and the server (TLS, transforms,
//! resume, `--follow`), holding a lab reservation while it lasts, until the
//! port is detached or the process is stopped. Not for the import before it
//! (the family's `mod.rs`) nor the relay's own loop (`usbwire_client::relay`).

use anyhow::anyhow;
use usbwire_client::follow::FollowStatus;
use usbwire_client::vhci;

use super::background::{detach_output, RELAY_LOG_ENV};
use super::status_file::RelayStatusFile;
use crate::commands::common::stdout::status_line;
use crate::exit::Failure;

/// What was attached to `port` and how it is relayed (TLS, transforms, resume, follow), and
/// how long a lab reservation holds it. Best effort: the relay runs on without a reader.
fn print_relayed(
    port: u32,
    imported: &usbwire_client::Imported,
    upstream: &usbwire_client::relay::Upstream,
    record: &vhci::Record,
    taken: Option<&crate::commands::common::registry::Taken>,
    follow: Option<&usbwire_client::follow::Target>,
) {
    let device = &imported.device;
    let following = follow.map(|target| target.persistence);
    status_line!(
        "attached {} from {} to port {port} ({} speed){}{}{}{}; relaying until `usbwire detach -p {port}`",
        record.busid,
        upstream.addr,
        device.speed.for_vhci().name(),
        if imported.stream.is_tls() { " over TLS" } else { "" },
        if upstream.transforms.is_empty() {
            String::new()
        } else {
            format!(" with {}", usbwire_client::TransformSpec::list_text(&upstream.transforms))
        },
        if upstream.resume.is_some() { ", resumable" } else { "" },
        match following {
            Some(usbwire_client::follow::Persistence::Forever) => {
                ", kept attached: imported anew after every loss until Ctrl-C (auto-attach)"
            }
            Some(usbwire_client::follow::Persistence::Bounded) => ", following it through re-enumerations",
            None => "",
        },
    );
    if let Some(taken) = taken {
        match taken.until {
            Some(until) => status_line!(
                "reserved in the lab registry until {}; detached and given back then",
                humantime::format_rfc3339_seconds(until)
            ),
            None => status_line!("reserved in the lab registry; given back on detach"),
        }
    }
}

/// Hands vhci-hcd one end of a socket pair and relays between the other end
/// and the server (TLS, transforms, resume). With `--foreground` the relay is
/// this process; started by [`super::background::attach_in_background`], it points its output
/// at the relay log once attached. `usbwire detach` (or the device going
/// away) ends it; SIGINT/SIGTERM detach the port first.
pub(super) async fn relay_attached(
    imported: usbwire_client::Imported,
    upstream: usbwire_client::relay::Upstream,
    record: vhci::Record,
    taken: Option<crate::commands::common::registry::Taken>,
    follow: Option<usbwire_client::follow::Target>,
) -> Result<(), Failure> {
    let shutdown = crate::commands::common::process::shutdown_signal();
    let (port, kernel) = vhci::attach_relayed(&imported.device, &record, None)?;
    print_relayed(port, &imported, &upstream, &record, taken.as_ref(), follow.as_ref());
    let device = &imported.device;
    let first = FollowStatus {
        port,
        attached: true,
        reattached: 0,
        vendor_id: device.id_vendor,
        product_id: device.id_product,
        relay: usbwire_client::relay::RelayState::Connected,
    };
    let status = std::cell::RefCell::new(RelayStatusFile::create(first, &upstream, follow.as_ref()));
    if let Some(log) = std::env::var_os(RELAY_LOG_ENV) {
        detach_output(std::path::Path::new(&log));
    }
    let (status_tx, mut statuses) = tokio::sync::watch::channel(first);
    let reporting = async {
        while statuses.changed().await.is_ok() {
            let now = *statuses.borrow_and_update();
            status.borrow_mut().write(now);
        }
        std::future::pending::<()>().await
    };
    let relay = relay_or_follow(imported, port, kernel, upstream, follow, status_tx);
    let (mut held, until) = match taken {
        Some(taken) => (taken.held, taken.until),
        None => (None, None),
    };
    let reservation_lost = async {
        match &mut held {
            Some(reservation) => reservation.lost().await,
            None => std::future::pending().await,
        }
    };
    let time_up = async {
        match until.and_then(|until| until.duration_since(std::time::SystemTime::now()).ok()) {
            Some(left) => tokio::time::sleep(left).await,
            None if until.is_some() => {}
            None => std::future::pending().await,
        }
    };
    let outcome = tokio::select! {
        result = relay => Some(result),
        () = reporting => None,
        () = shutdown => None,
        lost = reservation_lost => Some(Err(anyhow!("{lost}; the device may be someone else's now"))),
        () = time_up => {
            tracing::info!(port, "reservation time is up");
            None
        }
    };
    drop(status);
    // A followed device may be on another port by now, or away (its port someone else's by now).
    let FollowStatus { port, attached, .. } = *statuses.borrow();
    if attached {
        let _ = std::fs::remove_file(vhci::record_path(port));
    }
    if let Some(reservation) = held {
        if let Err(error) = reservation.release().await {
            tracing::warn!(%error, "reservation not released; it ends when its lease runs out");
        }
    }
    match outcome {
        Some(Ok(())) => {
            tracing::info!(port, "port detached; relay stopped");
            Ok(())
        }
        Some(Err(error)) => {
            if attached {
                let _ = vhci::detach(port);
            }
            tracing::error!(port, %error, "relay ended; port detached");
            Err(Failure::unavailable(anyhow!("relay for port {port} ended: {error}")))
        }
        None if attached => {
            let _ = vhci::detach(port);
            tracing::info!(port, "port detached on signal");
            Ok(())
        }
        None => {
            tracing::info!("stopped while the device was away");
            Ok(())
        }
    }
}

/// The relay for the attached device, or, with `--follow`, the relay again
/// after each re-enumeration; `status` says where the device is and what the
/// relay does.
async fn relay_or_follow(
    imported: usbwire_client::Imported,
    port: u32,
    kernel: tokio::net::UnixStream,
    upstream: usbwire_client::relay::Upstream,
    follow: Option<usbwire_client::follow::Target>,
    status: tokio::sync::watch::Sender<FollowStatus>,
) -> anyhow::Result<()> {
    if let Some(target) = follow {
        return Ok(usbwire_client::follow::follow(target, imported, port, kernel, status).await?);
    }
    let devid = imported.device.devid();
    Ok(usbwire_client::follow::relay_reporting(kernel, imported.stream, devid, upstream, &status).await?)
}
