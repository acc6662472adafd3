//! The relay of an attached port: vhci-hcd gets one end of a socket pair and
//! this process relays between the other end and the server (TLS, transforms,
//! resume, `--follow`), holding a lab reservation while it lasts, until the
//! port is detached or the process is stopped. Not for the import before it
//! (the family's `mod.rs`) nor the relay's own loop (`usbwire_client::relay`).

use anyhow::anyhow;
use usbwire_client::attach::{Attachment, Lost};
use usbwire_client::follow::Persistence;

use super::background::{detach_output, relay_log};
use super::status_file::RelayStatusFile;
use crate::commands::common::registry::Taken;
use crate::commands::common::stdout::status_line;
use crate::exit::Failure;

/// What was attached to which port and how it is relayed (TLS, transforms, resume, follow),
/// and how long a lab reservation holds it. Best effort: the relay runs on without a reader.
fn print_relayed(attachment: &Attachment, taken: Option<&Taken>) {
    let plan = attachment.plan();
    let source = &plan.source;
    let port = attachment.port();
    status_line!(
        "attached {} from {} to port {port} ({} speed){}{}{}{}; relaying until `usbwire detach -p {port}`",
        source.busid,
        source.addr,
        attachment.device().speed.for_vhci().name(),
        if attachment.over_tls() { " over TLS" } else { "" },
        if source.transforms.is_empty() {
            String::new()
        } else {
            format!(" with {}", usbwire_client::TransformSpec::list_text(&source.transforms))
        },
        if attachment.resumes() { ", resumable" } else { "" },
        match (plan.follow, source.persistence) {
            (true, Persistence::Forever) =>
                ", kept attached: imported anew after every loss until Ctrl-C (auto-attach)",
            (true, Persistence::Bounded) => ", following it through re-enumerations",
            (false, _) => "",
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

/// Keeps `attachment` (relayed: the kernel holds one end of a socket pair, the
/// relay the other) until the kernel lets go or the relay ends, mirroring its
/// state into the port's status file. With `--foreground` the relay is this
/// process; forked by [`super::background::fork_if_backgrounded`], it points
/// its output at the relay log once attached. SIGINT/SIGTERM, a lost
/// reservation or the reservation's end detach the port first.
pub(super) async fn relay_attached(mut attachment: Attachment, taken: Option<Taken>) -> Result<(), Failure> {
    let shutdown = crate::commands::common::process::shutdown_signal();
    print_relayed(&attachment, taken.as_ref());
    let mut statuses = attachment.status();
    let plan = attachment.plan();
    let source = &plan.source;
    let followed = plan.follow.then_some((&source.busid, source.persistence == Persistence::Forever));
    let mut status = RelayStatusFile::create(*statuses.borrow_and_update(), source.addr, followed);
    if let Some(log) = relay_log() {
        detach_output(log);
    }
    let reporting = async {
        while statuses.changed().await.is_ok() {
            let now = *statuses.borrow_and_update();
            status.write(now);
        }
        std::future::pending::<()>().await
    };
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
    let ended = tokio::select! {
        lost = attachment.lost() => match lost {
            Lost::Released { port } => {
                tracing::info!(port, "port detached; relay stopped");
                Ok(())
            }
            lost => {
                let port = attachment.port();
                tracing::error!(port, error = %lost, "relay ended; port detached");
                Err(Failure::unavailable(anyhow!("relay for port {port} ended: {lost}")))
            }
        },
        () = reporting => Ok(()),
        () = shutdown => {
            tracing::info!(port = attachment.port(), "detaching on signal");
            Ok(())
        }
        lost = reservation_lost => {
            let port = attachment.port();
            Err(Failure::unavailable(anyhow!("relay for port {port} ended: {lost}; the device may be someone else's now")))
        }
        () = time_up => {
            tracing::info!(port = attachment.port(), "reservation time is up");
            Ok(())
        }
    };
    attachment.detach().await;
    drop(status);
    if let Some(reservation) = held {
        if let Err(error) = reservation.release().await {
            tracing::warn!(%error, "reservation not released; it ends when its lease runs out");
        }
    }
    ended
}
