//! `usbwire doctor [-r HOST[:PORT]] [--json]`: checks what breaks USB/IP
//! setups in practice — vhci-hcd not loaded, no access to usbfs, the local
//! server not running, the remote port closed or filtered by a firewall, a
//! server that wants TLS, a clock that makes certificates invalid, key files
//! others can read — and says for each what to do. Exit code 0 when nothing
//! failed, 69 otherwise.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::anyhow;
use serde::Serialize;
use usbwire_client::vhci::{self, VhciError};
use usbwire_client::{ClientError, Security};

use super::common::stdout::outln;
use crate::args::DoctorArgs;
use crate::exit::Failure;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Verdict {
    Ok,
    /// Works, but something a user may trip over.
    Warn,
    Fail,
    /// Not applicable here.
    Skip,
}

#[derive(Debug, Serialize)]
struct Check {
    name: &'static str,
    verdict: Verdict,
    detail: String,
    /// What to do about it (empty when nothing is needed).
    #[serde(skip_serializing_if = "String::is_empty")]
    fix: String,
}

fn check(name: &'static str, verdict: Verdict, detail: impl Into<String>, fix: impl Into<String>) -> Check {
    Check { name, verdict, detail: detail.into(), fix: fix.into() }
}

pub(crate) async fn run(args: DoctorArgs) -> Result<(), Failure> {
    let mut checks = vec![vhci_hcd(), usbfs_access(Path::new("/dev/bus/usb")), clock(), identity_files(&args)];
    checks.push(local_server(&args).await);
    if let Some(remote) = &args.remote {
        checks.extend(remote_server(remote, &args).await);
    }
    if args.json {
        super::common::output::print_json(&serde_json::json!({ "checks": checks }), false)?;
    } else {
        for c in &checks {
            let mark = match c.verdict {
                Verdict::Ok => "ok  ",
                Verdict::Warn => "warn",
                Verdict::Fail => "FAIL",
                Verdict::Skip => "skip",
            };
            outln!("[{mark}] {:<14} {}", c.name, c.detail)?;
            if !c.fix.is_empty() {
                outln!("       {:<14} -> {}", "", c.fix)?;
            }
        }
    }
    let failed: Vec<_> = checks.iter().filter(|c| c.verdict == Verdict::Fail).map(|c| c.name).collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Failure::unavailable(anyhow!("failed: {}", failed.join(", "))))
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn vhci_hcd() -> Check {
    match vhci::ports() {
        Ok(ports) => {
            let used = ports.iter().filter(|p| !p.is_free()).count();
            check("vhci-hcd", Verdict::Ok, format!("loaded, {} ports, {used} in use", ports.len()), "")
        }
        Err(VhciError::NotLoaded) => check(
            "vhci-hcd",
            Verdict::Warn,
            "not loaded: `usbwire attach` and `usbwire client` cannot attach devices to this kernel",
            "modprobe vhci-hcd (as root); make it permanent with `echo vhci-hcd > /etc/modules-load.d/usbwire.conf`",
        ),
        Err(error) => check("vhci-hcd", Verdict::Fail, error.to_string(), "run as root to attach devices"),
    }
}

/// Whether this user can open the usbfs nodes read-write (needed to share real devices).
fn usbfs_access(root: &Path) -> Check {
    let Ok(buses) = std::fs::read_dir(root) else {
        return check(
            "usbfs",
            Verdict::Skip,
            format!("{} does not exist: no USB host controller here", root.display()),
            "",
        );
    };
    let nodes: Vec<_> = buses
        .flatten()
        .filter_map(|bus| std::fs::read_dir(bus.path()).ok())
        .flat_map(|devices| devices.flatten().map(|d| d.path()))
        .collect();
    let writable =
        nodes.iter().filter(|node| std::fs::OpenOptions::new().read(true).write(true).open(node).is_ok()).count();
    match (nodes.len(), writable) {
        (0, _) => check("usbfs", Verdict::Skip, "no USB devices plugged in", ""),
        (total, all) if all == total => {
            check("usbfs", Verdict::Ok, format!("read-write access to all {total} devices"), "")
        }
        (total, some) => check(
            "usbfs",
            if some == 0 { Verdict::Warn } else { Verdict::Ok },
            format!("read-write access to {some} of {total} devices; `usbwire serve` can share only those"),
            if is_root() {
                ""
            } else {
                "run the server as root, or name the devices in [[bind]] rules, install what `usbwire udev-rules \
                 --config FILE` prints as /etc/udev/rules.d/70-usbwire.rules and join group usbwire"
            },
        ),
    }
}

fn clock() -> Check {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    // Certificates made today say "not before <today>"; a clock years behind rejects them.
    const YEAR_2024: u64 = 1_704_067_200;
    if now < YEAR_2024 {
        check(
            "clock",
            Verdict::Fail,
            format!("system time is {now} s after 1970, before 2024: TLS certificates will look not yet valid"),
            "set the clock (NTP: `timedatectl set-ntp true`)",
        )
    } else {
        check(
            "clock",
            Verdict::Ok,
            "plausible; usbwire identities are valid from 1975 to 4096, so skew between hosts does not matter",
            "",
        )
    }
}

/// The identity's private key must be readable by its owner only.
fn identity_files(args: &DoctorArgs) -> Check {
    let dir = args.identity.clone().unwrap_or_else(usbwire_transport::identity::default_dir);
    let key = dir.join("identity.key");
    match std::fs::metadata(&key) {
        Err(_) => {
            check("identity", Verdict::Skip, format!("no identity in {} (only needed for --tls)", dir.display()), "")
        }
        Ok(meta) if meta.permissions().mode() & 0o077 != 0 => check(
            "identity",
            Verdict::Fail,
            format!("{} is readable by others (mode {:o})", key.display(), meta.permissions().mode() & 0o777),
            format!("chmod 600 {}", key.display()),
        ),
        Ok(_) => match usbwire_transport::Identity::load(&dir) {
            Ok(identity) => {
                check("identity", Verdict::Ok, format!("{} in {}", identity.fingerprint(), dir.display()), "")
            }
            Err(error) => check(
                "identity",
                Verdict::Fail,
                error.to_string(),
                format!(
                    "make a new one (peers must then allow its fingerprint): `usbwire identity --create --force --dir {}` \
                     (the old pair is kept as identity.key.old and identity.crt.old)",
                    dir.display()
                ),
            ),
        },
    }
}

async fn local_server(args: &DoctorArgs) -> Check {
    let path = args.control.clone().unwrap_or_else(usbwire_server::default_control_path);
    match usbwire_server::control_request(&path, &usbwire_server::ControlRequest::State).await {
        Ok(response) => {
            let devices = response.devices.unwrap_or_default();
            let in_use = devices.iter().filter(|d| d.state == "in_use").count();
            check(
                "local server",
                Verdict::Ok,
                format!("running, {} devices exported, {in_use} in use", devices.len()),
                "",
            )
        }
        Err(_) => check("local server", Verdict::Skip, format!("no usbwire server answers on {}", path.display()), ""),
    }
}

async fn remote_server(remote: &str, args: &DoctorArgs) -> Vec<Check> {
    let addr: SocketAddr = match super::common::peer::resolve(remote, args.tcp_port).await {
        Ok(addr) => addr,
        Err(failure) => {
            return vec![check(
                "server address",
                Verdict::Fail,
                failure.error.to_string(),
                "check the host name (DNS, /etc/hosts)",
            )]
        }
    };
    let mut checks = Vec::new();
    match tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => checks.push(check("server port", Verdict::Ok, format!("{addr} accepts connections"), "")),
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::ConnectionRefused => {
            checks.push(check(
                "server port",
                Verdict::Fail,
                format!("{addr} refused the connection: nothing listens there"),
                "start `usbwire serve` (or usbipd) on that host, or use the port it listens on (-r HOST:PORT)",
            ));
            return checks;
        }
        Ok(Err(error)) => {
            checks.push(check(
                "server port",
                Verdict::Fail,
                format!("{addr}: {error}"),
                "check the route to that host",
            ));
            return checks;
        }
        Err(_) => {
            checks.push(check(
                "server port",
                Verdict::Fail,
                format!("{addr} did not answer within 3 s: a firewall drops the packets"),
                format!(
                    "allow TCP port {} on the server (e.g. `nft add rule inet filter input tcp dport {} accept`)",
                    addr.port(),
                    addr.port()
                ),
            ));
            return checks;
        }
    }
    match usbwire_client::list_devices(addr, &Security::Plain).await {
        Ok(devices) if devices.is_empty() && tls_required(addr).await => {
            checks.push(check(
                "usbip",
                Verdict::Warn,
                "answers plain USB/IP, but shows its devices to TLS clients only: a plain client sees none",
                "use --tls (and allow this machine's `usbwire identity` fingerprint on the server)",
            ));
            checks.push(tls_with_identity(addr, args).await);
        }
        Ok(devices) => checks.push(check(
            "usbip",
            Verdict::Ok,
            format!("answers plain USB/IP, {} devices available", devices.len()),
            "",
        )),
        Err(ClientError::ClosedWithoutAnswer { .. }) => {
            checks.push(check(
                "usbip",
                Verdict::Warn,
                "the server hung up on a plain request: it requires TLS (or refuses this address)",
                "use --tls (and allow this machine's `usbwire identity` fingerprint on the server)",
            ));
            checks.push(tls_with_identity(addr, args).await);
        }
        Err(error) => {
            checks.push(check("usbip", Verdict::Fail, error.to_string(), "is it a USB/IP server on that port?"))
        }
    }
    checks
}

/// Whether a usbwire server says a plain client must use TLS to see any
/// device (`tls_required` in its device state; other servers never do).
async fn tls_required(addr: SocketAddr) -> bool {
    matches!(usbwire_client::server_state(addr, &Security::Plain).await, Ok(Some(document)) if document.tls_required)
}

/// Tries TLS with this machine's identity, pinning nothing: does the server
/// know us, and do we know the server?
async fn tls_with_identity(addr: SocketAddr, args: &DoctorArgs) -> Check {
    let dir = args.identity.clone().unwrap_or_else(usbwire_transport::identity::default_dir);
    let Ok(identity) = usbwire_transport::Identity::load(&dir) else {
        return check(
            "tls",
            Verdict::Skip,
            format!("no usable identity in {} to try TLS with", dir.display()),
            format!(
                "create one with `usbwire identity --create --dir {}` and have the server allow its fingerprint",
                dir.display()
            ),
        );
    };
    // The commands suggested below carry the identity the user named.
    let identity_flag = args.identity.as_ref().map(|d| format!(" --identity {}", d.display())).unwrap_or_default();
    let fingerprint = identity.fingerprint();
    let known = usbwire_transport::known_servers::KnownServers::in_dir(&dir);
    let security = Security::Tls(std::sync::Arc::new(usbwire_client::TlsClient {
        identity,
        known,
        trust_new: false,
        pinned: None,
    }));
    match usbwire_client::list_devices(addr, &security).await {
        Ok(devices) => check(
            "tls",
            Verdict::Ok,
            format!("TLS works: the server admits {fingerprint} and shows it {} devices", devices.len()),
            "",
        ),
        Err(error @ ClientError::UnknownServer { .. }) => check(
            "tls",
            Verdict::Warn,
            error.to_string(),
            format!(
                "compare with `usbwire identity` on the server, then `usbwire list -r {addr} --tls --trust-new{identity_flag}`"
            ),
        ),
        Err(error @ ClientError::NotAdmitted { .. }) => check(
            "tls",
            Verdict::Fail,
            error.to_string(),
            format!("on the server: `usbwire serve --tls --allow {fingerprint}` (or an [[allow]] rule)"),
        ),
        Err(error) => check("tls", Verdict::Fail, error.to_string(), "see the message; -v shows the TLS details"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usbfs_without_a_usb_stack_is_skipped_not_failed() {
        let c = usbfs_access(Path::new("/nonexistent/bus/usb"));
        assert_eq!(c.verdict, Verdict::Skip);
    }

    #[test]
    fn usbfs_counts_accessible_nodes() {
        let dir = std::env::temp_dir().join(format!("usbwire-doctor-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("001")).unwrap();
        std::fs::write(dir.join("001/001"), b"").unwrap();
        let c = usbfs_access(&dir);
        assert_eq!(c.verdict, Verdict::Ok, "{c:?}");
        assert!(c.detail.contains("all 1 devices"), "{c:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
