//! Building a server from the command line's virtual device specs, and the
//! warnings and guest sockets that go with serving: what `serve`, `demo`
//! and `redir` share.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use usbwire_device::Device as _;
use usbwire_gadgets::{DiskOptions, KeyboardHandle, MassStorage, TypeError};
use usbwire_server::{PlainPolicy, Security, Server, ServerConfig, TextInput, TypeRefusal};

use crate::config::{ReplayMode, ReplayTiming, VirtualSpec};
use crate::exit::Failure;

/// A usbredir guest socket at `path`: 0600, or 0660 for `group`, in a
/// directory only this user can change (see `private_dir::bind_socket`).
/// `what` names it in an error (`[[redir]] for 0-1`).
pub(crate) fn bind_unix_guest_socket(
    path: &std::path::Path,
    group: Option<u32>,
    what: &str,
) -> Result<usbwire_client::redir::GuestListener, Failure> {
    let listener = usbwire_server::private_dir::bind_socket(path, group).map_err(|e| Failure::socket(e, what))?;
    let registered = listener.set_nonblocking(true).and_then(|()| tokio::net::UnixListener::from_std(listener));
    let listener = registered.with_context(|| format!("{what}: socket {}", path.display())).map_err(Failure::os)?;
    Ok(listener.into())
}

/// Says once, at startup, what a server that takes plain USB/IP on a
/// non-loopback address exposes: USB/IP has no authentication, so whoever
/// reaches the port is a client.
pub(crate) fn warn_if_open(addr: std::net::SocketAddr, security: &Security, announced: bool) {
    let plain_from_anywhere = security.tls.is_none() || security.plain == PlainPolicy::Always;
    if !plain_from_anywhere || addr.ip().is_loopback() {
        return;
    }
    let what = if security.tls.is_none() {
        "every device this server exports"
    } else {
        "the devices that [[allow]] client = \"plain\" rules give"
    };
    let mdns = if announced { " (and mDNS announces this server to the whole local network)" } else { "" };
    tracing::warn!(
        "plain USB/IP is accepted on {addr}: any host that can reach this port can list, import and use {what}, \
         with no authentication{mdns}; listen on 127.0.0.1 (--listen 127.0.0.1:{port}), or use --tls \
         (with --allow-plain never or loopback) to admit only known clients",
        port = addr.port()
    );
}

/// Whether disk images may be reached through a symbolic link: yes when the
/// user named the path, no when we chose it (the demo's directory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DiskLinks {
    Follow,
    Refuse,
}

/// What was exported, one human-readable line per device.
pub(crate) fn build(
    config: ServerConfig,
    specs: &[VirtualSpec],
    links: DiskLinks,
) -> Result<(Server, Vec<String>), Failure> {
    let mut server = Server::new(config);
    let mut lines = Vec::new();
    for spec in specs {
        let (busid, detail) = match spec {
            VirtualSpec::Keyboard => {
                let (device, handle) = usbwire_gadgets::keyboard();
                let busid = server.export(spec.kind(), Box::new(device));
                server.add_text_input(busid.clone(), Arc::new(Keyboard(handle)));
                (busid, "keyboard (usbwire type TEXT types on it)".to_owned())
            }
            VirtualSpec::Mouse => {
                let (device, _handle) = usbwire_gadgets::mouse();
                (server.export(spec.kind(), Box::new(device)), "mouse".to_owned())
            }
            VirtualSpec::Disk { path, size, read_only, speed, bad } => {
                let options =
                    DiskOptions { size: *size, read_only: *read_only, speed: speed.speed(), bad_blocks: bad.clone() };
                let device = match links {
                    DiskLinks::Follow => MassStorage::open(path, &options),
                    DiskLinks::Refuse => MassStorage::open_no_follow(path, &options),
                }
                .map_err(|error| disk_failure(error, path))?;
                let mode = if *read_only { "read-only" } else { "read-write" };
                (
                    server.export(spec.kind(), Box::new(device)),
                    format!("disk {} ({mode}, {})", path.display(), speed.speed().name()),
                )
            }
            VirtualSpec::Serial { link } => {
                let (device, pty) = usbwire_gadgets::serial(link.as_deref()).map_err(serial_failure)?;
                let shown: PathBuf = link.clone().unwrap_or_else(|| pty.clone());
                let detail = match link {
                    Some(link) => format!("serial port bridged to {} (link {})", pty.display(), link.display()),
                    None => format!("serial port bridged to {}", shown.display()),
                };
                (server.export(spec.kind(), Box::new(device)), detail)
            }
            VirtualSpec::Loopback { speed } => {
                let device = usbwire_gadgets::loopback(speed.speed());
                (
                    server.export(spec.kind(), Box::new(device)),
                    format!("loopback test device ({})", speed.speed().name()),
                )
            }
            VirtualSpec::Dfu { path, size } => {
                let options = dfu_options(*size).map_err(Failure::config)?;
                let device =
                    usbwire_gadgets::DfuDevice::open(path, &options).map_err(|error| dfu_failure(error, path))?;
                let detail = format!(
                    "DFU device flashed into {} (up to {} bytes; {})",
                    path.display(),
                    options.size,
                    device.summary().product
                );
                (server.export(spec.kind(), Box::new(device)), detail)
            }
            VirtualSpec::Replay { path, mode, timing, report } => {
                let device = replay(path, *mode, *timing, report.clone())?;
                let summary = device.summary();
                let detail = format!(
                    "replay of {} ({:04x}:{:04x} {}, {} speed, {} mode)",
                    path.display(),
                    summary.vendor_id,
                    summary.product_id,
                    summary.product,
                    summary.speed.name(),
                    if *mode == ReplayMode::Strict { "strict" } else { "lenient" },
                );
                (server.export(spec.kind(), Box::new(device)), detail)
            }
            VirtualSpec::External { socket } => {
                let busid = server.export_external(socket.clone(), usbwire_server::ExternalOptions::default());
                (busid, format!("device served by the process connected to {} (listed while one is)", socket.display()))
            }
        };
        lines.push(format!("{busid:<5} {detail}"));
    }
    Ok((server, lines))
}

/// A replay of the recording at `path`, its reports written to `report`; a
/// recording that cannot be read or used is a configuration error (78).
fn replay(
    path: &std::path::Path,
    mode: ReplayMode,
    timing: ReplayTiming,
    report: Option<PathBuf>,
) -> Result<usbwire_gadgets::ReplayDevice, Failure> {
    use usbwire_gadgets::replay::{Mode, ReplayOptions, Report, ReportSink, Timing};
    let on_report = report.map(|report_path| -> ReportSink {
        Box::new(move |report: &Report| {
            let written = serde_json::to_vec_pretty(report).map_err(std::io::Error::other).and_then(|mut json| {
                json.push(b'\n');
                usbwire_server::private_dir::replace_file(&report_path, &json, 0o600)
            });
            if let Err(error) = written {
                tracing::warn!(path = %report_path.display(), %error, "cannot write the replay report");
            }
        })
    });
    let mode = if mode == ReplayMode::Strict { Mode::Strict } else { Mode::Lenient };
    let timing = if timing == ReplayTiming::Asap { Timing::Asap } else { Timing::Recorded };
    usbwire_gadgets::ReplayDevice::open(path, ReplayOptions { mode, timing, on_report })
        .map_err(|error| Failure::config(anyhow::Error::from(error).context(format!("replay {}", path.display()))))
}

/// A disk image that cannot be made (73), or is missing, unusable or the
/// wrong size (78).
fn disk_failure(error: usbwire_gadgets::DiskError, path: &std::path::Path) -> Failure {
    let cannot_create = matches!(error, usbwire_gadgets::DiskError::Create { .. });
    let error = anyhow::Error::from(error).context(format!("disk {}", path.display()));
    if cannot_create {
        Failure::cannot_create(error)
    } else {
        Failure::config(error)
    }
}

/// A serial port's link that cannot be made (73); no pseudo-terminal (71).
fn serial_failure(error: usbwire_gadgets::SerialError) -> Failure {
    use usbwire_gadgets::SerialError as E;
    let make = match &error {
        E::Link { .. } | E::LinkOccupied(_) => Failure::cannot_create,
        E::Pty(_) => Failure::os,
        E::NoRuntime => Failure::software,
        _ => Failure::io,
    };
    make(anyhow::Error::from(error).context("serial port"))
}

/// A DFU image whose directory takes no new files (73: the flashed image is
/// made there); a FILE that cannot be used (78).
fn dfu_failure(error: usbwire_gadgets::DfuError, path: &std::path::Path) -> Failure {
    let cannot_create = matches!(error, usbwire_gadgets::DfuError::Directory { .. });
    let error = anyhow::Error::from(error).context(format!("dfu {}", path.display()));
    if cannot_create {
        Failure::cannot_create(error)
    } else {
        Failure::config(error)
    }
}

/// The DFU device's options from `size=` (1 MiB when not given).
fn dfu_options(size: Option<u64>) -> anyhow::Result<usbwire_gadgets::DfuOptions> {
    let Some(size) = size else { return Ok(usbwire_gadgets::DfuOptions::default()) };
    let size = usize::try_from(size)
        .ok()
        .filter(|size| (1..=usbwire_gadgets::dfu::MAX_SIZE).contains(size))
        .ok_or_else(|| anyhow::anyhow!("dfu size={size} is not between 1 byte and 64M"))?;
    Ok(usbwire_gadgets::DfuOptions { size })
}

/// Lets the control socket type on a virtual keyboard.
struct Keyboard(KeyboardHandle);

impl TextInput for Keyboard {
    fn type_text(&self, text: &str) -> Result<usize, TypeRefusal> {
        self.0.type_text(text).map_err(|error| match error {
            TypeError::NotAttached => TypeRefusal::NotAttached,
            TypeError::Unsupported(_) => TypeRefusal::Untypable(error.to_string()),
            _ => TypeRefusal::Busy(error.to_string()),
        })
    }

    fn is_attached(&self) -> bool {
        self.0.is_attached()
    }
}
