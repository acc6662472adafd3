//! `usbwire attach --auto-attach`, as usbipd-win's: the first import, which
//! waits for a server or device that is not there yet as for one that went
//! away. What follows it (attach, relay, attach again after every loss until
//! stopped) is `attach --follow`'s with [`Persistence::Forever`]: the client
//! crate's [`usbwire_client::follow`] owns the retrying and its backoff.
//!
//! [`Persistence::Forever`]: usbwire_client::follow::Persistence::Forever

use anyhow::anyhow;
use usbwire_client::follow::{FollowError, Reimport};
use usbwire_client::Imported;

use crate::exit::Failure;

/// Imports the device, trying on until the server and the device are there
/// (each change logged once). `None` when stopped (Ctrl-C, SIGTERM) first:
/// nothing was attached, nothing to undo.
pub(super) async fn first_import(reimport: &Reimport) -> Result<Option<Imported>, Failure> {
    let stopped = crate::commands::common::process::shutdown_signal();
    tokio::select! {
        imported = reimport.first() => match imported {
            Ok(imported) => Ok(Some(imported)),
            // Waiting cannot fix it: the server's own refusal and its exit code.
            Err(FollowError::Refused { source, .. }) => Err(source.into()),
            Err(error) => Err(Failure::unavailable(anyhow!(error))),
        },
        () = stopped => {
            tracing::info!(busid = %reimport.busid, "stopped before the device was attached");
            Ok(None)
        }
    }
}
