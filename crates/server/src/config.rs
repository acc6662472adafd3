//! What a server is told: [`ServerConfig`] with the defaults `usbwire serve`
//! uses, and [`Security`] (TLS, the plain-connection policy, who may use
//! which device).
//!
//! Plain values, read by every floor above; nothing here opens a socket or a
//! file. Where they come from (config files, flags) is the CLI's business.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_rustls::rustls as rustls_config;
use usbwire_device::{DeviceFacts, Selector};
use usbwire_proto::{Budget, Limits};
use usbwire_transport::access::{AccessRules, Admission};
use usbwire_transport::Identity;

use crate::admission::AdmissionLimits;
use crate::capture::CaptureConfig;
use crate::private_dir::effective_uid;

/// Server settings, with the defaults `usbwire serve` uses.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to listen on (default `0.0.0.0:3240`).
    pub listen: SocketAddr,
    /// Local control socket (`usbwire type`, `usbwire state`); `None` disables it.
    pub control_path: Option<PathBuf>,
    /// Bounds applied to everything a client sends.
    pub limits: Limits,
    /// What one connection may hold in memory before we stop reading from it.
    pub budget: Budget,
    /// Concurrent connections past authentication (each device list or import is one).
    pub max_connections: usize,
    /// Connections not yet authenticated: their own small pool, a per-address cap, short deadlines.
    pub admission: AdmissionLimits,
    /// TLS, the plain-connection policy and per-client access rules.
    pub security: Security,
    /// Real devices to export (by bus id, VID:PID, serial or class), now and on hotplug.
    pub host_rules: Vec<Selector>,
    /// How long an import whose connection dropped is kept for a usbwire
    /// client to resume it (default 30 s); zero turns resume off.
    pub resume_grace: Duration,
    /// Where to serve Prometheus metrics (`GET /metrics`); `None`: nowhere.
    pub metrics: Option<SocketAddr>,
    /// Where to serve the status page (and `/metrics` beside it); `None`: nowhere.
    pub http: Option<SocketAddr>,
    /// Names a request to `--http` / `--metrics` may carry in its `Host`
    /// besides IP literals and `localhost` (others get 421: DNS rebinding).
    pub http_hosts: Vec<String>,
    /// Capture every import's URBs to pcapng files (usbmon format) here.
    pub capture: Option<CaptureConfig>,
    /// Keeps `usbwire bind`s across restarts (one bus id per line); `None`: they end with the server.
    pub bind_state: Option<PathBuf>,
}

/// Whether plain (unencrypted, unauthenticated) USB/IP connections are accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlainPolicy {
    Never,
    /// Only from the loopback interface (the default once TLS is configured).
    Loopback,
    Always,
}

/// Who may connect and what they may use.
#[derive(Clone, Debug)]
pub struct Security {
    /// TLS 1.3 with client certificates, on the same port as plain USB/IP.
    pub tls: Option<Arc<rustls_config::ServerConfig>>,
    pub plain: PlainPolicy,
    /// Which client sees and imports which device (`admission.rules`), and the
    /// private CA whose client certificates `client = "ca:NAME"` rules admit.
    /// With TLS, a plain client is the identity `plain`: it sees only what a
    /// `client = "plain"` rule gives it (see [`Security::visible`]).
    pub admission: Admission,
    /// The server's own `[[redir]]` bridges, which import as the server: what
    /// its key may see and import (nothing else, whatever the rules say).
    pub own_bridges: Option<OwnBridges>,
}

/// The server's own identity, admitted for its usbredir bridges only: it
/// sees and imports exactly the devices `devices` select.
#[derive(Clone, Debug)]
pub struct OwnBridges {
    /// The server's key (its bridges present it).
    pub identity: usbwire_transport::Fingerprint,
    /// The `[[redir]]` rules' devices.
    pub devices: Vec<Selector>,
}

impl Security {
    /// TLS with `identity`, admitting the clients `admission` names.
    pub fn tls(identity: &Identity, plain: PlainPolicy, admission: Admission) -> Result<Self, rustls_config::Error> {
        let tls = usbwire_transport::tls::server_config(identity, admission.clone())?;
        Ok(Self { tls: Some(tls), plain, admission, own_bridges: None })
    }

    /// Whether `client` may see and import `device` (of kind `kind`, serial
    /// number `serial`, empty if none): the server's own bridges the devices
    /// their rules select, everyone else what [`Security::visible`] says.
    pub fn may_use(
        &self,
        client: &usbwire_transport::access::ClientId,
        kind: &str,
        device: &usbwire_proto::op::DeviceRecord,
        serial: &str,
    ) -> bool {
        use usbwire_transport::access::ClientId;
        if let (Some(own), ClientId::Certificate(fingerprint) | ClientId::CaIssued { fingerprint, .. }) =
            (&self.own_bridges, client)
        {
            if *fingerprint == own.identity {
                let facts = DeviceFacts::of_record(device, Some(serial).filter(|s| !s.is_empty()));
                return own.devices.iter().any(|selector| selector.matches(&facts));
            }
        }
        self.visible(client, device.busid.as_str(), kind)
    }

    /// Whether this server shows its devices to TLS clients only: it has TLS
    /// and no rule names `plain`, so a plain client (from loopback, or any
    /// address with `--allow-plain always`) sees nothing. Its `OP_REP_DEVSTATE`
    /// says so (`tls_required`), and a usbwire client tells the user to add `--tls`.
    pub fn tls_only(&self) -> bool {
        self.tls.is_some() && !self.admission.rules.rules.iter().any(|r| r.client == "plain")
    }

    /// Whether `client` may see and import the device `busid` of kind `kind`.
    ///
    /// With TLS on, every client, plain ones included, gets exactly what the
    /// rules give it: `plain` is one more identity, and `plain` (how
    /// [`PlainPolicy`] lets it connect at all) decides nothing about devices.
    /// A server without TLS has nobody to tell apart: a plain client sees
    /// everything unless a rule names `plain` (as usbipd does).
    pub fn visible(&self, client: &usbwire_transport::access::ClientId, busid: &str, kind: &str) -> bool {
        let rules = &self.admission.rules;
        match client {
            usbwire_transport::access::ClientId::Plain
                if self.tls.is_none() && !rules.rules.iter().any(|r| r.client == "plain") =>
            {
                true
            }
            _ => rules.allows(client, busid, kind),
        }
    }
}

impl Default for Security {
    /// Plain USB/IP for everyone, as usbipd does.
    fn default() -> Self {
        Self {
            tls: None,
            plain: PlainPolicy::Always,
            admission: Admission { rules: AccessRules::open(), ca: None },
            own_bridges: None,
        }
    }
}

/// How long a dropped import waits for its client by default.
pub const DEFAULT_RESUME_GRACE: Duration = Duration::from_secs(30);

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], usbwire_proto::DEFAULT_PORT)),
            control_path: Some(default_control_path()),
            limits: Limits::default(),
            budget: Budget::default(),
            max_connections: 256,
            admission: AdmissionLimits::default(),
            security: Security::default(),
            host_rules: Vec::new(),
            resume_grace: DEFAULT_RESUME_GRACE,
            metrics: None,
            http: None,
            http_hosts: Vec::new(),
            capture: None,
            bind_state: None,
        }
    }
}

/// Where the control socket lives unless `--control` says otherwise:
/// `/run/usbwire/control.sock` for root, `$XDG_RUNTIME_DIR/usbwire/control.sock`
/// or `TMPDIR/usbwire-UID/control.sock` (`/tmp` unless `TMPDIR` is set) for
/// other users.
pub fn default_control_path() -> PathBuf {
    let uid = effective_uid();
    if uid == 0 {
        return PathBuf::from("/run/usbwire/control.sock");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => Path::new(&dir).join("usbwire/control.sock"),
        _ => std::env::temp_dir().join(format!("usbwire-{uid}/control.sock")),
    }
}

/// Where a server keeps what `usbwire bind` bound when neither `--bind-state`
/// nor `--config` says: root's in `/var/lib/usbwire/binds` (the state
/// directory of the packaged service), other users' in
/// `$XDG_STATE_HOME/usbwire/binds` (`~/.local/state/usbwire/binds`).
pub fn default_bind_state_path() -> PathBuf {
    if effective_uid() == 0 {
        return PathBuf::from("/var/lib/usbwire/binds");
    }
    let base = match std::env::var_os("XDG_STATE_HOME").filter(|dir| !dir.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(&std::env::var_os("HOME").unwrap_or_else(|| "/".into())).join(".local/state"),
    };
    base.join("usbwire/binds")
}

#[cfg(test)]
mod tests {
    use usbwire_transport::access::{ClientId, Rule};

    use super::*;

    fn rules(rules: &[(&str, &str)]) -> Admission {
        let rules = rules.iter().map(|(c, d)| Rule { client: (*c).into(), devices: vec![(*d).into()] }).collect();
        Admission { rules: AccessRules { rules }, ca: None }
    }

    #[test]
    fn with_tls_a_plain_client_gets_only_what_a_plain_rule_gives_it() {
        let server = Identity::generate("server").unwrap();
        let alice = ClientId::Certificate(usbwire_transport::Fingerprint([0xaa; 32]));
        let alice_rule = alice.to_string();
        for policy in [PlainPolicy::Loopback, PlainPolicy::Always] {
            let security = Security::tls(&server, policy, rules(&[(&alice_rule, "1-1")])).unwrap();
            assert!(security.visible(&alice, "1-1", "loopback"));
            assert!(!security.visible(&ClientId::Plain, "1-1", "loopback"), "{policy:?}");
            assert!(!security.visible(&ClientId::Plain, "1-2", "disk"), "{policy:?}");
            let security = Security::tls(&server, policy, rules(&[(&alice_rule, "1-1"), ("plain", "disk")])).unwrap();
            assert!(security.visible(&ClientId::Plain, "1-2", "disk"));
            assert!(!security.visible(&ClientId::Plain, "1-1", "loopback"));
        }
    }

    #[test]
    fn without_tls_a_plain_client_sees_everything_unless_a_rule_names_it() {
        assert!(Security::default().visible(&ClientId::Plain, "1-1", "keyboard"));
        let unnamed =
            Security { tls: None, plain: PlainPolicy::Always, admission: rules(&[("*", "1-1")]), own_bridges: None };
        assert!(unnamed.visible(&ClientId::Plain, "1-2", "disk"));
        let named = Security {
            tls: None,
            plain: PlainPolicy::Always,
            admission: rules(&[("plain", "1-1")]),
            own_bridges: None,
        };
        assert!(named.visible(&ClientId::Plain, "1-1", "disk"));
        assert!(!named.visible(&ClientId::Plain, "1-2", "disk"));
    }
}
