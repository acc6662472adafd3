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

use anyhow::anyhow;
use serde_json::json;
use usbwire_client::vhci;
use usbwire_device::record::DeviceJson;
use usbwire_proto::op::BusId;

use super::common::stdout::{out, outln, status_line};
use super::common::usb_names::UsbIds;
use crate::args::{AttachArgs, DetachArgs, PortArgs};
use crate::exit::Failure;

pub(crate) async fn attach(args: AttachArgs) -> Result<(), Failure> {
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
        None if args.auto_attach => match super::auto_attach::first_import(&reimport).await? {
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
    relay_attached(imported, upstream, record, taken, follow).await
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

/// Environment variable naming the relay log: set by `attach` for the
/// background process it starts, which detaches its output there once the
/// device is attached.
const RELAY_LOG_ENV: &str = "USBWIRE_RELAY_LOG";

/// `attach` without `--foreground`: the same command runs again as a
/// background process (its own session, so the terminal's signals do not
/// reach it) and reports back on a pipe; once it says the device is attached
/// this returns, and the relay runs on until the port is detached.
fn attach_in_background() -> Result<(), Failure> {
    use std::io::Read as _;
    use std::os::unix::process::CommandExt as _;
    let exe = std::env::current_exe().map_err(|e| Failure::software(e.into()))?;
    let log_path = std::path::Path::new(vhci::RECORD_DIR).join("usbwire-relay.log");
    let mut command = std::process::Command::new(exe);
    command
        .args(std::env::args_os().skip(1))
        .env(RELAY_LOG_ENV, &log_path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    // SAFETY: setsid is async-signal-safe and touches no memory of ours.
    unsafe {
        command.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|e| Failure::software(anyhow!("cannot start the relay process: {e}")))?;
    // The child closes its end of both pipes once attached (or exits).
    let errors = child.stderr.take().map(|mut err| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            text
        })
    });
    let mut said = String::new();
    let _ = child.stdout.take().map(|mut out| out.read_to_string(&mut said));
    if let Some(errors) = errors {
        eprint!("{}", errors.join().unwrap_or_default());
    }
    if said.contains("attached ") {
        return out!("{said}");
    }
    let status = child.wait().map_err(|e| Failure::software(e.into()))?;
    std::process::exit(status.code().unwrap_or(70));
}

/// What was attached to `port` and how it is relayed (TLS, transforms, resume, follow), and
/// how long a lab reservation holds it. Best effort: the relay runs on without a reader.
fn print_relayed(
    port: u32,
    imported: &usbwire_client::Imported,
    upstream: &usbwire_client::relay::Upstream,
    record: &vhci::Record,
    taken: Option<&super::common::registry::Taken>,
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
/// this process; started by [`attach_in_background`], it points its output
/// at the relay log once attached. `usbwire detach` (or the device going
/// away) ends it; SIGINT/SIGTERM detach the port first.
async fn relay_attached(
    imported: usbwire_client::Imported,
    upstream: usbwire_client::relay::Upstream,
    record: vhci::Record,
    taken: Option<super::common::registry::Taken>,
    follow: Option<usbwire_client::follow::Target>,
) -> Result<(), Failure> {
    let shutdown = super::common::process::shutdown_signal();
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
    let (state_tx, mut states) = tokio::sync::watch::channel(usbwire_client::relay::RelayState::Connected);
    let devid = imported.device.devid();
    let relay = usbwire_client::kernel_relay::run(kernel, imported.stream, devid, upstream, Some(state_tx));
    let reporting = async {
        while states.changed().await.is_ok() {
            let state = *states.borrow_and_update();
            status.send_modify(|status| status.relay = state);
        }
        std::future::pending::<std::convert::Infallible>().await
    };
    tokio::select! {
        ended = relay => Ok(ended?),
        never = reporting => match never {},
    }
}

/// Points stdout and stderr at the relay log (the `attach` that started us
/// has read what it needed and stopped listening).
fn detach_output(log: &std::path::Path) {
    use std::io::Write as _;
    use std::os::fd::AsRawFd as _;
    let _ = std::io::stdout().flush();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .or_else(|_| std::fs::OpenOptions::new().write(true).open("/dev/null"));
    if let Ok(file) = file {
        // SAFETY: dup2 on descriptors we own; stdout and stderr stay valid descriptors throughout.
        unsafe {
            libc::dup2(file.as_raw_fd(), 1);
            libc::dup2(file.as_raw_fd(), 2);
        }
    }
}

/// `/var/run/vhci_hcd/usbwire-portN.json`: the relay behind a port and what
/// it is doing (and, with `--follow`, the bus id it follows and how often it
/// attached it again), for `usbwire port`. Moves with a followed device to
/// its new port; removed when the relay ends.
struct RelayStatusFile {
    path: std::path::PathBuf,
    server: String,
    followed: Option<String>,
    auto_attach: bool,
}

use usbwire_client::follow::FollowStatus;

impl RelayStatusFile {
    fn create(
        first: FollowStatus,
        upstream: &usbwire_client::relay::Upstream,
        follow: Option<&usbwire_client::follow::Target>,
    ) -> Self {
        let mut file = Self {
            path: relay_status_path(first.port),
            server: upstream.addr.to_string(),
            followed: follow.map(|target| target.busid.to_string()),
            auto_attach: follow.is_some_and(|t| t.persistence == usbwire_client::follow::Persistence::Forever),
        };
        file.write(first);
        file
    }

    fn write(&mut self, status: FollowStatus) {
        let path = relay_status_path(status.port);
        // Away, the port may be someone else's soon: nothing to say about it until attached again.
        if path != self.path || !status.attached {
            let _ = std::fs::remove_file(&self.path);
            self.path = path;
        }
        if !status.attached {
            return;
        }
        let (name, since) = match status.relay {
            usbwire_client::relay::RelayState::Connected => ("connected", None),
            usbwire_client::relay::RelayState::Resuming { since } => {
                let ago = since.elapsed();
                let at = std::time::SystemTime::now() - ago;
                ("resuming", at.duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_secs()))
            }
        };
        let mut body =
            json!({ "pid": std::process::id(), "server": self.server, "state": name, "resuming_since": since });
        if let Some(busid) = &self.followed {
            body["follow"] = json!({
                "busid": busid,
                "reattached": status.reattached,
                "vendor_id": format!("{:04x}", status.vendor_id),
                "product_id": format!("{:04x}", status.product_id),
            });
        }
        if self.auto_attach {
            body["auto_attach"] = json!(true);
        }
        let temporary = self.path.with_extension("tmp");
        if std::fs::write(&temporary, body.to_string()).is_ok() {
            let _ = std::fs::rename(&temporary, &self.path);
        }
    }
}

impl Drop for RelayStatusFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn relay_status_path(port: u32) -> std::path::PathBuf {
    std::path::Path::new(vhci::RECORD_DIR).join(format!("usbwire-port{port}.json"))
}

/// The relay status of a port, if a live relay serves it.
fn relay_status(port: u32) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(relay_status_path(port)).ok()?;
    let status: serde_json::Value = serde_json::from_str(&text).ok()?;
    let pid = status.get("pid")?.as_u64()?;
    // A relay that died without cleaning up left a stale file.
    std::path::Path::new(&format!("/proc/{pid}")).exists().then_some(status)
}

/// One used port in `port --json`: the port's own fields, and the device
/// record (docs/json.md) of what is attached there: its bus id on the
/// server, its ids and strings as this machine enumerated it.
fn port_json(p: &vhci::PortStatus, here: &[usbwire_host::LocalDevice], names: &UsbIds) -> serde_json::Value {
    let record = vhci::read_record(p.port);
    let mut device = match here.iter().find(|d| d.busid == p.local_busid) {
        Some(local) => super::common::device_json::local(local, names).device,
        None => DeviceJson::default(),
    };
    device.busid = record.as_ref().map(|r| r.busid.clone()).unwrap_or_default();
    device.speed = p.speed.name().to_owned();
    let mut value = serde_json::to_value(device).unwrap_or_default();
    if let Some(fields) = value.as_object_mut() {
        let port = json!({
            "port": p.port,
            "hub": p.hub,
            "status": p.status,
            "devid": format!("{:08x}", p.devid),
            "local_busid": p.local_busid,
            "server": record.as_ref().map(|r| format!("{}:{}", r.host, r.service)),
            "remote_host": record.as_ref().map(|r| r.host.clone()),
            "remote_port": record.as_ref().map(|r| r.service.clone()),
            "remote_busid": record.as_ref().map(|r| r.busid.clone()),
            "relay": relay_status(p.port),
        });
        if let serde_json::Value::Object(port) = port {
            fields.extend(port);
        }
    }
    value
}

pub(crate) fn port(args: PortArgs) -> Result<(), Failure> {
    let ports = vhci::ports()?;
    let used: Vec<_> = ports.iter().filter(|p| !p.is_free()).collect();
    if args.json {
        let here = usbwire_host::list().unwrap_or_default();
        let names = super::common::usb_names::UsbIds::load();
        let list: Vec<serde_json::Value> = used.iter().map(|p| port_json(p, &here, &names)).collect();
        return super::common::output::print_json(&json!({ "ports": list }), false);
    }
    outln!("Imported USB devices\n====================")?;
    for p in used {
        outln!(
            "Port {:02}: <{}> at {} speed",
            p.port,
            if p.status == 6 { "Port in Use" } else { "Port Initializing" },
            p.speed.name()
        )?;
        match vhci::read_record(p.port) {
            Some(r) => outln!("       -> usbip://{}:{}/{}", r.host, r.service, r.busid)?,
            None => outln!("       -> (no record of the remote device)")?,
        }
        outln!("       local bus id {}", p.local_busid)?;
        if let Some(relay) = relay_status(p.port) {
            let state = relay.get("state").and_then(|s| s.as_str()).unwrap_or("unknown");
            let pid = relay.get("pid").and_then(serde_json::Value::as_u64).unwrap_or(0);
            outln!("       relay (pid {pid}): {state}")?;
            if let Some(follow) = relay.get("follow") {
                let busid = follow.get("busid").and_then(|b| b.as_str()).unwrap_or("?");
                let times = follow.get("reattached").and_then(serde_json::Value::as_u64).unwrap_or(0);
                outln!("       following {busid} through re-enumerations: attached again {times} time(s)")?;
            }
            if relay.get("auto_attach").and_then(serde_json::Value::as_bool) == Some(true) {
                outln!("       auto-attach: imported anew after every loss, until pid {pid} is stopped")?;
            }
        }
    }
    Ok(())
}

pub(crate) fn detach(args: DetachArgs) -> Result<(), Failure> {
    vhci::detach(args.port)?;
    outln!("port {} detached", args.port)
}
