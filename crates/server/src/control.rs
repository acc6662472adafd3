//! The local control socket: how `usbwire type` and `usbwire state` reach a
//! running server on the same machine.
//!
//! A Unix stream socket carrying one JSON request per line and one JSON
//! response per line. Only the server's own user (and root) may drive it:
//! the socket is mode 0600 in a directory only that user can change (see
//! [`crate::private_dir`]), and every connection's peer uid is checked with
//! `SO_PEERCRED` before anything is read from it, so a socket reachable by
//! others for a moment (or through a directory they can search) still
//! answers nobody else.

use std::io;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tracing::{debug, info, warn};
use usbwire_device::devstate::DeviceStateEntry;
use usbwire_proto::op::BusId;

use crate::devstate;
use crate::error::ServerError;
use crate::host_exports::{BindError, BindOutcome, BindRuleState, HostExports};
use crate::state::ServerState;

/// Something that turns text into key presses on the attached host (a keyboard).
pub trait TextInput: Send + Sync {
    /// Queues `text`; returns the number of input reports queued, or why not.
    /// Text it cannot type is refused whether or not a host is attached.
    fn type_text(&self, text: &str) -> Result<usize, TypeRefusal>;
    /// Whether a host has the device attached and configured.
    fn is_attached(&self) -> bool;
}

/// Why [`TextInput::type_text`] typed nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TypeRefusal {
    /// The text holds a character the device has no key for (the message says which).
    Untypable(String),
    /// No host has the device attached, so nobody would receive the keys.
    NotAttached,
    /// It cannot take the text now (too much is queued); the message says what to do.
    Busy(String),
}

/// A request on the control socket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
pub enum ControlRequest {
    /// Type text on a keyboard (the first one unless `busid` names one).
    Type { text: String, busid: Option<String> },
    /// Every exported device and who holds it, and every bind rule.
    State,
    /// Export the real device at `busid` (now and when plugged in again).
    Bind { busid: String },
    /// Export every real device a selector (`VID:PID`, `serial=…`, `class=…`,
    /// a bus id) matches, now and whenever one is plugged in, across restarts.
    BindDevice { device: String },
    /// Stop exporting `busid`, ending any import, and give it back to its kernel drivers.
    Unbind { busid: String },
    /// Forget a `BindDevice` rule and withdraw the devices it matches.
    UnbindDevice { device: String },
    /// Forget every bind made by hand and withdraw every real device.
    UnbindAll,
    /// Capture every import into pcapng files in `dir` (running ones from now on), or stop (`None`).
    Capture { dir: Option<std::path::PathBuf> },
}

/// The answer to a [`ControlRequest`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlResponse {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What kind of failure `error` is (absent from older servers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<ControlErrorKind>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reports: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<DeviceStateEntry>>,
    /// The bus ids a bind exported, or an unbind withdrew.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busids: Option<Vec<String>>,
    /// Unbind: the binds made by hand it forgot (absent from older servers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forgotten: Option<Vec<String>>,
    /// State: every bind rule and what it exported (absent from older servers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind_rules: Option<Vec<BindRuleState>>,
    /// Done, but the user should know this (a bind that cannot be kept across a restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// What a refused control request ran into, so the client exits with the
/// code that says it (`usbwire` maps each to one of its exit codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ControlErrorKind {
    /// The request names nothing there or something unusable: no device at
    /// that bus id, a virtual device to unbind, a character with no key.
    Data,
    /// What it names is there but cannot do it now: the keyboard not
    /// attached, the device exported already, too much text queued.
    Unavailable,
    /// The system refused: the device list unreadable, a device not openable.
    Os,
    /// What it asked to be made could not be: the capture directory.
    CannotCreate,
    /// What it names is there but not safe to use: a capture directory
    /// others may write to, another user's, a symbolic link (as `serve
    /// --capture` refuses it, exit 78).
    Config,
    /// The asking user may not use this server's control socket.
    Permission,
    /// The server failed, or did not understand the request (another version).
    Internal,
}

impl ControlResponse {
    fn done() -> Self {
        Self { ok: true, ..Self::default() }
    }

    fn error(kind: ControlErrorKind, message: impl Into<String>) -> Self {
        Self { ok: false, error: Some(message.into()), error_kind: Some(kind), ..Self::default() }
    }

    fn bind_error(error: BindError) -> Self {
        let kind = match &error {
            BindError::NoDevice(_) => ControlErrorKind::Data,
            BindError::Exported(_) => ControlErrorKind::Unavailable,
            BindError::System(_) => ControlErrorKind::Os,
        };
        Self::error(kind, error.to_string())
    }

    /// Done: what a bind exported or an unbind withdrew, and what the user should know.
    fn bound(outcome: BindOutcome) -> Self {
        Self {
            busids: Some(outcome.busids),
            forgotten: Some(outcome.forgotten),
            warning: outcome.warning,
            ..Self::done()
        }
    }
}

pub(crate) struct ControlSocket {
    listener: UnixListener,
}

impl ControlSocket {
    /// Creates the socket at `path`, in a directory only we can change (made
    /// with mode 0700 if missing; refused, and left alone, if someone else's)
    /// or a sticky shared one like `/tmp` ([`crate::private_dir::ensure_socket_dir`]).
    pub(crate) fn bind(path: &Path) -> Result<Self, ServerError> {
        let failed = |source| ServerError::Control { path: path.to_path_buf(), source };
        let listener = match crate::private_dir::bind_socket(path, None) {
            Ok(listener) => listener,
            Err(crate::private_dir::SocketError::Dir { reason, .. }) => {
                return Err(ServerError::ControlDir { path: path.to_path_buf(), reason })
            }
            Err(crate::private_dir::SocketError::InUse { .. }) => {
                return Err(failed(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another usbwire server is using it (stop it, or pass --control PATH)",
                )))
            }
            Err(crate::private_dir::SocketError::Io { source, .. }) => return Err(failed(source)),
        };
        listener.set_nonblocking(true).map_err(failed)?;
        let listener = UnixListener::from_std(listener).map_err(failed)?;
        info!(path = %path.display(), "control socket ready");
        Ok(Self { listener })
    }

    pub(crate) async fn serve(
        self,
        state: Arc<ServerState>,
        inputs: Arc<Vec<(BusId, Arc<dyn TextInput>)>>,
        hosts: HostExports,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            tokio::select! {
                () = crate::shutdown::stopped(&mut stop) => return,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        if let Err(refusal) = crate::private_dir::check_peer(&stream, "control") {
                            tokio::spawn(refuse(stream, refusal));
                            continue;
                        }
                        let state = state.clone();
                        let inputs = inputs.clone();
                        let hosts = hosts.clone();
                        tokio::spawn(async move {
                            if let Err(error) = serve_client(stream, &state, &inputs, &hosts).await {
                                debug!(%error, "control client");
                            }
                        });
                    }
                    Err(error) => {
                        warn!(%error, "control socket accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                }
            }
        }
    }
}

/// Tells a refused control client why. What it sent is discarded unread (up
/// to 64 KiB, for at most a second) before closing: closing on unread data
/// would reset the connection and the client would see that, not the reason.
async fn refuse(mut stream: UnixStream, reason: String) {
    let Ok(mut text) = serde_json::to_string(&ControlResponse::error(ControlErrorKind::Permission, reason)) else {
        return;
    };
    text.push('\n');
    if stream.write_all(text.as_bytes()).await.is_err() || stream.shutdown().await.is_err() {
        return;
    }
    let (reader, _writer) = stream.split();
    let mut discard = reader.take(1 << 16);
    let _ =
        tokio::time::timeout(std::time::Duration::from_secs(1), tokio::io::copy(&mut discard, &mut tokio::io::sink()))
            .await;
}

async fn serve_client(
    stream: UnixStream,
    state: &Arc<ServerState>,
    inputs: &Arc<Vec<(BusId, Arc<dyn TextInput>)>>,
    hosts: &HostExports,
) -> io::Result<()> {
    let (reader, mut writer) = stream.into_split();
    let mut lines = BufReader::new(reader.take(1 << 20)).lines();
    while let Some(line) = lines.next_line().await? {
        let response = match serde_json::from_str::<ControlRequest>(&line) {
            // Binding opens a device and unbinding waits for its URBs: keep them off the reactor.
            Ok(request) => {
                let (state, inputs, hosts) = (state.clone(), inputs.clone(), hosts.clone());
                tokio::task::spawn_blocking(move || answer(request, &state, &inputs, &hosts)).await.unwrap_or_else(
                    |error| ControlResponse::error(ControlErrorKind::Internal, format!("request failed: {error}")),
                )
            }
            Err(error) => ControlResponse::error(ControlErrorKind::Internal, format!("invalid request: {error}")),
        };
        let mut text = serde_json::to_string(&response).map_err(io::Error::other)?;
        text.push('\n');
        writer.write_all(text.as_bytes()).await?;
    }
    Ok(())
}

use tokio::io::AsyncReadExt as _;

fn answer(
    request: ControlRequest,
    state: &ServerState,
    inputs: &[(BusId, Arc<dyn TextInput>)],
    hosts: &HostExports,
) -> ControlResponse {
    match request {
        ControlRequest::Bind { busid } => match hosts.bind(&busid) {
            Ok(outcome) => {
                info!(%busid, "bound");
                ControlResponse::bound(outcome)
            }
            Err(error) => ControlResponse::bind_error(error),
        },
        ControlRequest::BindDevice { device } => {
            hosts.bind_rule(&device).map_or_else(ControlResponse::bind_error, ControlResponse::bound)
        }
        ControlRequest::Unbind { busid } => match hosts.unbind(&busid) {
            Ok(warning) => {
                info!(%busid, "unbound");
                ControlResponse { busids: Some(vec![busid]), warning, ..ControlResponse::done() }
            }
            Err(error) => ControlResponse::bind_error(error),
        },
        ControlRequest::UnbindDevice { device } => {
            hosts.unbind_rule(&device).map_or_else(ControlResponse::bind_error, ControlResponse::bound)
        }
        ControlRequest::UnbindAll => {
            let outcome = hosts.unbind_all();
            info!(withdrawn = outcome.busids.len(), "unbound everything");
            ControlResponse::bound(outcome)
        }
        ControlRequest::Capture { dir } => {
            let setting = dir.map(|dir| state.capture.for_dir(dir));
            match &setting {
                Some(setting) => {
                    // A private directory, or no capture: what it holds is what devices carried.
                    if let Err(error) = setting.prepare() {
                        // As `serve --capture` says it: cannot be made (73), or not safe to use (78).
                        let kind = match error {
                            crate::private_dir::PrivateDirError::Io { .. } => ControlErrorKind::CannotCreate,
                            _ => ControlErrorKind::Config,
                        };
                        return ControlResponse::error(kind, format!("cannot capture: {error}"));
                    }
                    info!(dir = %setting.dir.display(), "capturing imports");
                }
                None => info!("capture stopped"),
            }
            state.capture.set(setting);
            ControlResponse::done()
        }
        ControlRequest::Type { text, busid } => type_text(&text, busid.as_deref(), inputs),
        ControlRequest::State => {
            let devices = devstate::entries(&state.registry, |_, _, _| true);
            ControlResponse { devices: Some(devices), bind_rules: Some(hosts.rule_states()), ..ControlResponse::done() }
        }
    }
}

/// Types `text` on the keyboard `busid` names (the first one without). Text
/// with a character no key makes is refused before anything else is looked at.
fn type_text(text: &str, busid: Option<&str>, inputs: &[(BusId, Arc<dyn TextInput>)]) -> ControlResponse {
    let target = match busid {
        Some(wanted) => inputs.iter().find(|(b, _)| b.as_str() == wanted),
        None => inputs.first(),
    };
    let Some((busid, input)) = target else {
        return ControlResponse::error(
            ControlErrorKind::Data,
            match busid {
                Some(b) => format!("no keyboard is exported as {b}"),
                None => "this server exports no keyboard (start it with --virtual keyboard)".into(),
            },
        );
    };
    match input.type_text(text) {
        Ok(reports) => {
            info!(%busid, chars = text.chars().count(), "typing");
            ControlResponse { reports: Some(reports), ..ControlResponse::done() }
        }
        Err(TypeRefusal::Untypable(message)) => ControlResponse::error(ControlErrorKind::Data, message),
        Err(TypeRefusal::NotAttached) => ControlResponse::error(
            ControlErrorKind::Unavailable,
            format!(
                "keyboard {busid} is not attached by any host yet (attach it with `usbip attach -r HOST -b {busid}`)"
            ),
        ),
        Err(TypeRefusal::Busy(message)) => ControlResponse::error(ControlErrorKind::Unavailable, message),
    }
}

/// Sends one request to a server's control socket and returns its answer.
///
/// Refuses (`PermissionDenied`, carrying a [`SocketOwnerError`](crate::private_dir::SocketOwnerError))
/// before connecting when the socket or its directory belongs to another
/// non-root user: what we send (text to type) would go to them.
pub async fn request(path: &Path, request: &ControlRequest) -> io::Result<ControlResponse> {
    crate::private_dir::check_socket_owner(path).map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e))?;
    let stream = UnixStream::connect(path).await?;
    let (reader, mut writer) = stream.into_split();
    let mut text = serde_json::to_string(request).map_err(io::Error::other)?;
    text.push('\n');
    writer.write_all(text.as_bytes()).await?;
    let mut lines = BufReader::new(reader).lines();
    let line = lines
        .next_line()
        .await?
        .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "server closed the control connection"))?;
    serde_json::from_str(&line).map_err(io::Error::other)
}
