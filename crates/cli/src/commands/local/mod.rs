//! Verbs that talk to the server on this machine through its control socket:
//! `usbwire type`, `usbwire state`, `usbwire bind`, `usbwire unbind` and
//! `usbwire capture`, one file each. What they share is here: asking the
//! server ([`ask`], and what its refusal means as an exit code) and passing on
//! its warnings ([`warn_of`]). Not for the control socket's protocol
//! (`usbwire_server::control_request`).

pub(crate) mod bind;
pub(crate) mod capture;
pub(crate) mod state;
pub(crate) mod type_text;
pub(crate) mod unbind;

use std::path::PathBuf;

use anyhow::anyhow;
use usbwire_server::{control_request, default_control_path, ControlErrorKind, ControlRequest, ControlResponse};

use crate::args::ControlArgs;
use crate::exit::Failure;

/// Sends `request` to the server's control socket and returns its answer, or
/// what its refusal means.
pub(super) async fn ask(control: &ControlArgs, request: ControlRequest) -> Result<ControlResponse, Failure> {
    let path: PathBuf = control.control.clone().unwrap_or_else(default_control_path);
    let response = control_request(&path, &request).await.map_err(|error| {
        // Not ours to talk to: say exactly that, not "is it running?".
        if error.get_ref().is_some_and(|inner| inner.is::<usbwire_server::private_dir::SocketOwnerError>()) {
            return Failure::not_admitted(anyhow!(error));
        }
        Failure::unavailable(anyhow!(
            "cannot reach a usbwire server through {}: {error} (is `usbwire serve` running? pass --control PATH if it uses another socket)",
            path.display()
        ))
    })?;
    if response.ok {
        return Ok(response);
    }
    let error = anyhow!(response.error.unwrap_or_else(|| "the server refused".into()));
    Err(match response.error_kind {
        Some(ControlErrorKind::Data) => Failure::data(error),
        Some(ControlErrorKind::Os) => Failure::os(error),
        Some(ControlErrorKind::CannotCreate) => Failure::cannot_create(error),
        Some(ControlErrorKind::Config) => Failure::config(error),
        Some(ControlErrorKind::Permission) => Failure::not_admitted(error),
        Some(ControlErrorKind::Internal) => Failure::software(error),
        // Unavailable, and what an older or newer server does not say.
        _ => Failure::unavailable(error),
    })
}

/// What the server did but wants the user to know (a bind it cannot keep across a restart).
pub(super) fn warn_of(response: &ControlResponse) {
    if let Some(warning) = &response.warning {
        eprintln!("usbwire: warning: {}", usbwire_proto::display::escape(warning));
    }
}
