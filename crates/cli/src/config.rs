//! Configuration: the server's TOML file and `--virtual` specs, and the
//! client service's `[[attach]]` rules, parsed into plain values. Nothing
//! here touches the system; `commands::serve` and `commands::service` do.
//!
//! ```toml
//! listen = "0.0.0.0:3240"
//! control = "/run/usbwire/control.sock"
//! resume_grace = 30  # seconds a dropped import waits for its client to resume; 0: off
//! metrics = "127.0.0.1:9324" # Prometheus text at http://ADDR:PORT/metrics
//! http = "127.0.0.1:8324"    # the status page (and /metrics) at http://ADDR:PORT/
//! http_hosts = ["usb.lab.example"] # names it answers to besides IP literals and localhost (else 421)
//! capture = "/var/lib/usbwire/capture" # a pcapng file (usbmon) per import, in a private (0700) directory
//! capture_max_bytes = 1073741824       # all capture files together; the oldest are deleted first
//!
//! [[virtual]]
//! kind = "disk"
//! path = "/var/lib/usbwire/disk.img"
//! size = "64M"        # create with this size if missing
//! read_only = false
//! speed = "super"     # or "high" (default)
//!
//! [[virtual]]
//! kind = "keyboard"
//!
//! [[bind]]            # a real device of this machine, now and on hotplug
//! device = "0781:5567" # bus id (1-1.2), VID:PID, serial=TEXT or class=HEX
//! also = ["0781:df11"] # the same device in another mode
//! labels = ["nucleo", "bench-3"] # how the lab registry shows it (also in [[virtual]])
//!
//! [[redir]]           # offer a device to QEMU guests through usbredir (usb-redir)
//! device = "2-1"       # bus id, VID:PID, serial=TEXT or class=HEX; looked up for each guest
//! listen = "unix:/run/usbwire/redir-2-1.sock" # 0600; or "ADDR:PORT" with allow_unauthenticated = true
//! group = "libvirt-qemu" # optional: the socket 0660 for QEMU's group
//!
//! [registry]          # a lab registry on etcd (see RegistryTable)
//! endpoints = ["10.0.0.5:2379"]
//!
//! [limits]             # per connection; when one is full the server stops reading
//! max_transfer_length = "16M" # largest URB a client may submit
//! in_flight_bytes = "64M"     # URB bytes handed to devices and not completed
//! in_flight_urbs = 1024
//! queued_reply_bytes = "8M"   # replies waiting for the client to read them
//! unacked_reply_bytes = "32M" # replies a resumable session keeps until acknowledged
//! decoded_bytes = "8M"        # decompressed bytes waiting (--compress)
//!
//! [admission]         # connections not yet authenticated; the defaults
//! unauthenticated_max = 64   # at once, from all addresses
//! per_address_max = 8        # at once, from one IPv4 address or IPv6 /64
//! first_byte_timeout = "3s"  # accept to first byte
//! handshake_timeout = "3s"   # TLS handshake
//! request_timeout = "3s"     # each OP request
//! release_wait = "5s"        # an import waits this long for a device its last importer is giving back
//! log_interval = "10s"       # at most one summary line of refused connections per interval
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde::Deserialize;

/// Speeds a virtual device can be offered at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum SpeedChoice {
    #[default]
    High,
    Super,
}

impl SpeedChoice {
    fn parse(text: &str) -> anyhow::Result<Self> {
        match text {
            "high" => Ok(Self::High),
            "super" => Ok(Self::Super),
            other => bail!("unknown speed {other:?} (use speed=high or speed=super)"),
        }
    }

    pub(crate) fn speed(self) -> usbwire_device::Speed {
        match self {
            Self::High => usbwire_device::Speed::HIGH,
            Self::Super => usbwire_device::Speed::SUPER,
        }
    }
}

/// One virtual device to export.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub(crate) enum VirtualSpec {
    Keyboard,
    Mouse,
    Disk {
        path: PathBuf,
        #[serde(default, deserialize_with = "size_field")]
        size: Option<u64>,
        #[serde(default)]
        read_only: bool,
        #[serde(default)]
        speed: SpeedChoice,
    },
    Serial {
        #[serde(default)]
        link: Option<PathBuf>,
    },
    Loopback {
        #[serde(default)]
        speed: SpeedChoice,
    },
}

impl VirtualSpec {
    /// Parses `keyboard`, `mouse`, `disk=PATH[,size=64M][,ro][,speed=super]`,
    /// `serial[=LINK]`, `loopback[,speed=super]`.
    pub(crate) fn parse(spec: &str) -> anyhow::Result<Self> {
        let mut parts = spec.split(',');
        let head = parts.next().unwrap_or_default();
        let (kind, value) = match head.split_once('=') {
            Some((kind, value)) => (kind, Some(value)),
            None => (head, None),
        };
        let options: Vec<&str> = parts.collect();
        let mut size = None;
        let mut read_only = false;
        let mut speed = SpeedChoice::High;
        for option in &options {
            match option.split_once('=') {
                Some(("size", text)) => size = Some(parse_size(text)?),
                Some(("speed", text)) => speed = SpeedChoice::parse(text)?,
                None if *option == "ro" => read_only = true,
                _ => bail!("unknown option {option:?} in --virtual {spec:?}"),
            }
        }
        let allow_only = |allowed: &[&str]| -> anyhow::Result<()> {
            for option in &options {
                let name = option.split_once('=').map_or(*option, |(n, _)| n);
                if !allowed.contains(&name) {
                    bail!("option {name:?} does not apply to {kind} in --virtual {spec:?}");
                }
            }
            Ok(())
        };
        match (kind, value) {
            ("keyboard", None) => allow_only(&[]).map(|()| Self::Keyboard),
            ("mouse", None) => allow_only(&[]).map(|()| Self::Mouse),
            ("disk", Some(path)) if !path.is_empty() => {
                allow_only(&["size", "ro", "speed"])?;
                Ok(Self::Disk { path: PathBuf::from(path), size, read_only, speed })
            }
            ("disk", _) => bail!("disk needs an image path: --virtual disk=PATH[,size=64M][,ro][,speed=super]"),
            ("serial", link) => {
                allow_only(&[])?;
                Ok(Self::Serial { link: link.filter(|l| !l.is_empty()).map(PathBuf::from) })
            }
            ("loopback", None) => allow_only(&["speed"]).map(|()| Self::Loopback { speed }),
            _ => bail!("unknown virtual device {spec:?} (keyboard, mouse, disk=PATH, serial[=LINK], loopback)"),
        }
    }

    /// The short label used in logs and `usbwire state`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Keyboard => "keyboard",
            Self::Mouse => "mouse",
            Self::Disk { .. } => "disk",
            Self::Serial { .. } => "serial",
            Self::Loopback { .. } => "loopback",
        }
    }
}

/// `64M`, `1G`, `512K`, `4096` (bytes; binary units).
pub(crate) fn parse_size(text: &str) -> anyhow::Result<u64> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let number: u64 = digits.parse().with_context(|| format!("invalid size {text:?} (e.g. 64M)"))?;
    let multiplier: u64 = match unit.to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        _ => bail!("invalid size unit in {text:?} (use K, M, G or T)"),
    };
    number.checked_mul(multiplier).with_context(|| format!("size {text:?} is too large"))
}

fn size_field<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Option::<Size>::deserialize(deserializer)? {
        None => Ok(None),
        Some(Size::Bytes(bytes)) => Ok(Some(bytes)),
        Some(Size::Text(text)) => parse_size(&text).map(Some).map_err(serde::de::Error::custom),
    }
}

/// The configuration file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    pub(crate) listen: Option<SocketAddr>,
    pub(crate) control: Option<PathBuf>,
    #[serde(default, rename = "virtual")]
    pub(crate) virtual_devices: Vec<VirtualEntry>,
    /// Real devices to export.
    #[serde(default)]
    pub(crate) bind: Vec<BindRule>,
    /// This server's devices offered to QEMU guests through usbredir.
    #[serde(default)]
    pub(crate) redir: Vec<RedirRule>,
    /// Announce the server with mDNS/DNS-SD (default true).
    pub(crate) advertise: Option<bool>,
    /// Require TLS 1.3 with client certificates.
    #[serde(default)]
    pub(crate) tls: bool,
    /// Identity directory.
    pub(crate) identity: Option<PathBuf>,
    /// `never`, `loopback` or `always`.
    pub(crate) allow_plain: Option<String>,
    /// A private CA whose client identities `client = "ca:NAME"` rules admit.
    pub(crate) ca: Option<PathBuf>,
    /// Access rules: `[[allow]] client = "sha256:…" devices = ["1-1", "disk", "*"]`.
    #[serde(default)]
    pub(crate) allow: Vec<usbwire_transport::access::Rule>,
    /// `[admission]`: limits for connections that have not authenticated yet.
    #[serde(default)]
    pub(crate) admission: AdmissionTable,
    /// Per-connection memory budgets and the largest URB accepted.
    #[serde(default)]
    pub(crate) limits: LimitsConfig,
    /// Let a `client = "*"` rule admit any client key (`--allow-any-client`).
    #[serde(default)]
    pub(crate) allow_any_client: bool,
    /// Seconds an import whose connection dropped waits for its client to resume (`--resume-grace`).
    pub(crate) resume_grace: Option<u64>,
    /// Where to serve Prometheus metrics (`--metrics`).
    pub(crate) metrics: Option<SocketAddr>,
    /// Where to serve the status page (`--http`).
    pub(crate) http: Option<SocketAddr>,
    /// Names the status page and metrics answer to besides IP literals and `localhost`.
    #[serde(default)]
    pub(crate) http_hosts: Vec<String>,
    /// Where to write packet captures (`--capture`).
    pub(crate) capture: Option<PathBuf>,
    /// All capture files together stay under this many bytes, the oldest deleted first (default 1 GiB).
    pub(crate) capture_max_bytes: Option<u64>,
    /// `[registry]`: register in a lab registry (`--registry`).
    pub(crate) registry: Option<RegistryTable>,
}

/// `[[virtual]]`: a virtual device, and the labels the lab registry shows for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VirtualEntry {
    pub(crate) spec: VirtualSpec,
    pub(crate) labels: Vec<String>,
}

impl<'de> Deserialize<'de> for VirtualEntry {
    /// The device's own fields ([`VirtualSpec`], unknown ones refused) and `labels`.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut table = toml::Table::deserialize(deserializer)?;
        let labels = match table.remove("labels") {
            Some(value) => Vec::<String>::deserialize(value).map_err(D::Error::custom)?,
            None => Vec::new(),
        };
        let spec = VirtualSpec::deserialize(toml::Value::Table(table)).map_err(D::Error::custom)?;
        Ok(Self { spec, labels })
    }
}

/// `[registry]`: the lab registry this server registers in.
///
/// ```toml
/// [registry]
/// endpoints = ["10.0.0.5:2379", "10.0.0.6:2379", "10.0.0.7:2379"]
/// prefix = "usbwire"            # the default
/// address = "bench-3.lab:3240"  # what clients import from [default: listen, or the host name]
/// ttl = "10s"                   # a server that dies is gone from the registry after this
/// ca = "/etc/usbwire/etcd-ca.crt"   # TLS towards etcd; cert and key when it wants a client certificate
/// cert = "/etc/usbwire/etcd.crt"
/// key = "/etc/usbwire/etcd.key"
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RegistryTable {
    pub(crate) endpoints: Vec<String>,
    pub(crate) prefix: Option<String>,
    pub(crate) address: Option<String>,
    #[serde(default, deserialize_with = "duration_field")]
    pub(crate) ttl: Option<Duration>,
    pub(crate) ca: Option<PathBuf>,
    pub(crate) cert: Option<PathBuf>,
    pub(crate) key: Option<PathBuf>,
    /// A client's (`usbwire client`): import from servers whose entry carries no
    /// TLS key, over plain USB/IP (as `attach --allow-plain`). Refused by default.
    #[serde(default)]
    pub(crate) plain: bool,
}

impl RegistryTable {
    /// The endpoints and prefix as a `--registry` URL.
    pub(crate) fn url(&self) -> anyhow::Result<usbwire_lab::RegistryUrl> {
        let text = format!("etcd://{}/{}", self.endpoints.join(","), self.prefix.as_deref().unwrap_or_default());
        text.parse().context("[registry] endpoints and prefix")
    }

    /// The registry to reach: the URL, and TLS when `ca` or `cert` is set.
    pub(crate) fn endpoint(&self) -> anyhow::Result<usbwire_lab::Endpoint> {
        let tls = (self.ca.is_some() || self.cert.is_some()).then(|| usbwire_lab::EtcdTls {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone(),
        });
        Ok(usbwire_lab::Endpoint { url: self.url()?, tls })
    }
}

/// `[limits]`: what one connection may make the server hold. Unset fields keep
/// the defaults ([`usbwire_proto::Budget`], [`usbwire_proto::Limits`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LimitsConfig {
    #[serde(default, deserialize_with = "size_field")]
    pub(crate) max_transfer_length: Option<u64>,
    #[serde(default, deserialize_with = "size_field")]
    pub(crate) in_flight_bytes: Option<u64>,
    pub(crate) in_flight_urbs: Option<u64>,
    #[serde(default, deserialize_with = "size_field")]
    pub(crate) queued_reply_bytes: Option<u64>,
    #[serde(default, deserialize_with = "size_field")]
    pub(crate) unacked_reply_bytes: Option<u64>,
    #[serde(default, deserialize_with = "size_field")]
    pub(crate) decoded_bytes: Option<u64>,
}

impl LimitsConfig {
    /// The configured values over the defaults; zero, or a transfer length
    /// beyond what USB/IP can carry, is refused with the field's name.
    pub(crate) fn apply(
        &self,
        limits: &mut usbwire_proto::Limits,
        budget: &mut usbwire_proto::Budget,
    ) -> anyhow::Result<()> {
        fn positive(name: &str, value: Option<u64>) -> anyhow::Result<Option<u64>> {
            match value {
                Some(0) => bail!("[limits] {name} must be more than 0 (a connection could never move a byte)"),
                other => Ok(other),
            }
        }
        fn bytes(name: &str, value: Option<u64>) -> anyhow::Result<Option<usize>> {
            positive(name, value)?
                .map(|v| usize::try_from(v).with_context(|| format!("[limits] {name} is too large for this machine")))
                .transpose()
        }
        if let Some(length) = positive("max_transfer_length", self.max_transfer_length)? {
            limits.max_transfer_length = u32::try_from(length)
                .ok()
                .filter(|&l| l <= i32::MAX as u32)
                .with_context(|| format!("[limits] max_transfer_length {length} is beyond USB/IP's 2 GiB - 1"))?;
        }
        if let Some(value) = bytes("in_flight_bytes", self.in_flight_bytes)? {
            budget.in_flight_bytes = value;
        }
        if let Some(value) = bytes("in_flight_urbs", self.in_flight_urbs)? {
            budget.in_flight_urbs = value;
        }
        if let Some(value) = bytes("queued_reply_bytes", self.queued_reply_bytes)? {
            budget.queued_reply_bytes = value;
        }
        if let Some(value) = bytes("unacked_reply_bytes", self.unacked_reply_bytes)? {
            budget.unacked_reply_bytes = value;
        }
        if let Some(value) = bytes("decoded_bytes", self.decoded_bytes)? {
            budget.decoded_bytes = value;
        }
        Ok(())
    }
}

/// `[admission]`: each field left out keeps its default ([`usbwire_server::AdmissionLimits`]).
/// Durations are `"500ms"`, `"3s"`, `"1m"` or a number of seconds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AdmissionTable {
    pub(crate) unauthenticated_max: Option<usize>,
    pub(crate) per_address_max: Option<usize>,
    #[serde(default, deserialize_with = "duration_field")]
    pub(crate) first_byte_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration_field")]
    pub(crate) handshake_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration_field")]
    pub(crate) request_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "duration_field")]
    pub(crate) release_wait: Option<Duration>,
    #[serde(default, deserialize_with = "duration_field")]
    pub(crate) log_interval: Option<Duration>,
}

impl AdmissionTable {
    /// The server's limits with this table's values in place of the defaults.
    pub(crate) fn limits(&self) -> anyhow::Result<usbwire_server::AdmissionLimits> {
        let mut limits = usbwire_server::AdmissionLimits::default();
        let count = |name: &str, value: Option<usize>, default: usize| match value {
            Some(0) => bail!("[admission] {name} = 0 would refuse every client (use 1 or more)"),
            Some(value) => Ok(value),
            None => Ok(default),
        };
        let time = |name: &str, value: Option<Duration>, default: Duration, least: Duration| match value {
            Some(value) if value < least => bail!("[admission] {name} must be at least {least:?}"),
            Some(value) => Ok(value),
            None => Ok(default),
        };
        let ms = Duration::from_millis;
        limits.unauthenticated_max =
            count("unauthenticated_max", self.unauthenticated_max, limits.unauthenticated_max)?;
        limits.per_address_max = count("per_address_max", self.per_address_max, limits.per_address_max)?;
        limits.first_byte_timeout =
            time("first_byte_timeout", self.first_byte_timeout, limits.first_byte_timeout, ms(100))?;
        limits.handshake_timeout =
            time("handshake_timeout", self.handshake_timeout, limits.handshake_timeout, ms(100))?;
        limits.request_timeout = time("request_timeout", self.request_timeout, limits.request_timeout, ms(100))?;
        limits.release_wait = time("release_wait", self.release_wait, limits.release_wait, Duration::ZERO)?;
        limits.log_interval = time("log_interval", self.log_interval, limits.log_interval, ms(1000))?;
        Ok(limits)
    }
}

/// `500ms`, `3s`, `2m`, or a bare number of seconds.
pub(crate) fn parse_duration(text: &str) -> anyhow::Result<Duration> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let number: u64 =
        digits.parse().with_context(|| format!("invalid duration {text:?} (e.g. \"3s\" or \"500ms\")"))?;
    match unit.trim() {
        "ms" => Ok(Duration::from_millis(number)),
        "s" => Ok(Duration::from_secs(number)),
        "m" => Ok(Duration::from_secs(number.saturating_mul(60))),
        "h" => Ok(Duration::from_secs(number.saturating_mul(3600))),
        _ => bail!("invalid duration unit in {text:?} (use ms, s, m or h)"),
    }
}

fn duration_field<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Time {
        Seconds(u64),
        Text(String),
    }
    match Option::<Time>::deserialize(deserializer)? {
        None => Ok(None),
        Some(Time::Seconds(seconds)) => Ok(Some(Duration::from_secs(seconds))),
        Some(Time::Text(text)) => parse_duration(&text).map(Some).map_err(serde::de::Error::custom),
    }
}

/// `[[bind]] device = "SELECTOR"`: export matching real devices.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BindRule {
    #[serde(deserialize_with = "selector_field")]
    pub(crate) device: usbwire_server::Selector,
    /// The same device under other identities (after it re-enumerates, e.g. into its bootloader).
    #[serde(default, deserialize_with = "selector_list")]
    pub(crate) also: Vec<usbwire_server::Selector>,
    /// What the lab registry shows it as (`label=NAME` selects it there).
    #[serde(default)]
    pub(crate) labels: Vec<String>,
}

/// `[[redir]] device = "SELECTOR" listen = "unix:PATH"`: a usbredir bridge
/// for a device of this server (`--redir unix:PATH=SELECTOR` on the command line).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RedirRule {
    #[serde(deserialize_with = "selector_field")]
    pub(crate) device: usbwire_server::Selector,
    #[serde(deserialize_with = "redir_listen_field")]
    pub(crate) listen: RedirListen,
    /// A group (name or number) that may also open the Unix socket (0660).
    #[serde(default)]
    pub(crate) group: Option<String>,
    /// A TCP listener: usbredir has no authentication, so whoever reaches
    /// the port gets the device. Only when this says so.
    #[serde(default)]
    pub(crate) allow_unauthenticated: bool,
}

impl std::str::FromStr for RedirRule {
    type Err = anyhow::Error;

    /// `unix:PATH=SELECTOR` or `ADDR:PORT=SELECTOR`, e.g.
    /// `unix:/run/usbwire/disk.sock=2-1` or `[::1]:4000=serial=A1`.
    fn from_str(text: &str) -> anyhow::Result<Self> {
        let Some((listen, device)) = text.split_once('=') else {
            bail!("--redir {text:?}: expected unix:PATH=SELECTOR, e.g. unix:/run/usbwire/redir.sock=2-1");
        };
        let listen = listen.parse().with_context(|| format!("--redir {text:?}"))?;
        let device = device.parse().with_context(|| format!("--redir {text:?}: bad device selector"))?;
        Ok(Self { device, listen, group: None, allow_unauthenticated: false })
    }
}

impl RedirRule {
    /// Refuses a TCP listener unless the rule opts in to an unauthenticated
    /// port, and always on a server that takes no plain USB/IP
    /// (`plain_never`): its bridge would be a plain door to the device.
    pub(crate) fn check(&self, plain_never: bool) -> anyhow::Result<()> {
        let RedirListen::Tcp(addr) = &self.listen else { return Ok(()) };
        let unix = format!("--redir unix:PATH={} (listen = \"unix:PATH\")", self.device);
        if self.group.is_some() {
            bail!("[[redir]] for {}: group is for a Unix socket, not {addr}; use {unix}", self.device);
        }
        if plain_never {
            bail!(
                "[[redir]] for {} on {addr}: usbredir has no authentication, and this server takes no plain \
                 USB/IP (allow_plain = \"never\"); a TCP port would hand the device to anyone who reaches it. \
                 Use a Unix socket: {unix}",
                self.device
            );
        }
        if !self.allow_unauthenticated {
            bail!(
                "[[redir]] for {} on {addr}: usbredir has no authentication, so anyone who reaches a TCP port \
                 gets the device (and reads what it carries). Use a Unix socket, {unix}, which only this \
                 user (or a `group`) may open; or, if every process that can reach {addr} may have the \
                 device, say so with allow_unauthenticated = true (--redir-tcp-unauthenticated)",
                self.device
            );
        }
        Ok(())
    }
}

/// Where a usbredir bridge waits for its guest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RedirListen {
    /// `unix:PATH`: a socket only this user (or a configured group) may open.
    Unix(PathBuf),
    /// `ADDR:PORT`: whoever reaches it gets the device.
    Tcp(SocketAddr),
}

impl std::str::FromStr for RedirListen {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> anyhow::Result<Self> {
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                bail!("{text:?}: unix: needs a path, e.g. unix:/run/usbwire/redir.sock");
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let addr = text.parse().with_context(|| {
            format!("{text:?} is neither unix:PATH nor an ADDR:PORT (e.g. unix:/run/usbwire/redir.sock)")
        })?;
        Ok(Self::Tcp(addr))
    }
}

impl std::fmt::Display for RedirListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
            Self::Tcp(addr) => write!(f, "{addr}"),
        }
    }
}

fn redir_listen_field<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<RedirListen, D::Error> {
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(|e: anyhow::Error| serde::de::Error::custom(format!("{e:#}")))
}

/// The gid of `group`, a name or a number.
pub(crate) fn group_id(group: &str) -> anyhow::Result<u32> {
    if let Ok(gid) = group.parse() {
        return Ok(gid);
    }
    let name = std::ffi::CString::new(group).with_context(|| format!("group {group:?}: not a group name"))?;
    // SAFETY: libc::group is plain data (integers and pointers), valid all zero.
    let mut entry: libc::group = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::group = std::ptr::null_mut();
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: every pointer is valid for the call and buf's length is passed; the
    // result points into entry and buf, which we read only for gr_gid (a copy).
    let status = unsafe { libc::getgrnam_r(name.as_ptr(), &mut entry, buf.as_mut_ptr(), buf.len(), &mut found) };
    if status != 0 {
        bail!("group {group:?}: cannot look it up: {}", std::io::Error::from_raw_os_error(status));
    }
    if found.is_null() {
        bail!("group {group:?} does not exist on this machine (`getent group` lists them); give its name or number");
    }
    Ok(entry.gr_gid)
}

fn selector_field<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<usbwire_server::Selector, D::Error> {
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(serde::de::Error::custom)
}

fn selector_list<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<usbwire_server::Selector>, D::Error> {
    let texts = Vec::<String>::deserialize(deserializer)?;
    texts.iter().map(|t| t.parse().map_err(serde::de::Error::custom)).collect()
}

/// The client service's file (`usbwire client --config FILE`):
///
/// ```toml
/// identity = "/etc/usbwire"        # for rules with tls = true
///
/// [[attach]]
/// server = "192.168.1.5:3240"      # or "discover" (needs tls = true): any pinned server that answers mDNS
/// device = "0483:5740"              # bus id, VID:PID, serial=TEXT or class=HEX
/// also = ["0483:df11"]              # the same device in another mode (its DFU bootloader)
/// tls = false
///
/// [registry]                        # a lab registry on etcd, for server = "registry" rules
/// endpoints = ["10.0.0.5:2379"]
/// plain = false                     # true: also servers whose entry has no TLS key, over plain USB/IP
///
/// [[attach]]
/// server = "registry"              # a free matching device, wherever it is, reserved while attached
/// device = "0483:374b"
/// labels = ["nucleo"]               # and carrying these labels
/// ```
///
/// `server = "discover"` without TLS is refused at load: any machine on the LAN
/// could answer mDNS and have its "device" (a keyboard that types commands)
/// attached to this kernel. With TLS, only servers whose key is pinned in the
/// identity's `known_servers` are accepted (the service never pins on first use).
/// `server = "registry"` rules always use TLS pinned to the key in the reserved
/// server's registry entry (whatever `tls` says); a server whose entry has no
/// key is refused unless `[registry] plain = true`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClientConfig {
    pub(crate) identity: Option<PathBuf>,
    #[serde(default)]
    pub(crate) attach: Vec<AttachRule>,
    /// The lab registry `server = "registry"` rules reserve from (its `address` and `ttl` are a server's, unused here).
    pub(crate) registry: Option<RegistryTable>,
}

/// Keep a device matching `device` (or any of `also`) on `server` attached.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AttachRule {
    pub(crate) server: String,
    #[serde(deserialize_with = "selector_field")]
    pub(crate) device: usbwire_server::Selector,
    #[serde(default, deserialize_with = "selector_list")]
    pub(crate) also: Vec<usbwire_server::Selector>,
    #[serde(default)]
    pub(crate) tls: bool,
    /// With `server = "registry"`: the device must carry these labels too.
    #[serde(default)]
    pub(crate) labels: Vec<String>,
}

impl AttachRule {
    /// Every identity the device may show up under.
    pub(crate) fn selectors(&self) -> impl Iterator<Item = &usbwire_server::Selector> {
        std::iter::once(&self.device).chain(&self.also)
    }
}

impl AttachRule {
    /// A `server = "registry"` rule: what it asks the registry for.
    pub(crate) fn wanted(&self) -> anyhow::Result<usbwire_lab::Want> {
        let mut text = self.device.to_string();
        for label in &self.labels {
            text.push_str(&format!(",label={label}"));
        }
        text.parse().with_context(|| format!("[[attach]] rule {self}"))
    }
}

impl std::fmt::Display for AttachRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.device)?;
        for other in &self.also {
            write!(f, "|{other}")?;
        }
        for label in &self.labels {
            write!(f, ",label={label}")?;
        }
        write!(f, " on {}", self.server)
    }
}

impl ClientConfig {
    pub(crate) fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
        let config: Self = toml::from_str(&text).with_context(|| format!("invalid config {}", path.display()))?;
        if config.attach.is_empty() {
            bail!("{} has no [[attach]] rules: nothing to keep attached", path.display());
        }
        config.check().with_context(|| format!("refusing config {}", path.display()))?;
        Ok(config)
    }

    /// Refuses rules that would attach what an unauthenticated peer offers.
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        for rule in self.attach.iter().filter(|r| r.server == "registry") {
            if self.registry.is_none() {
                bail!("[[attach]] rule {rule}: server = \"registry\" needs a [registry] table (endpoints = [\"HOST:PORT\"])");
            }
            if !rule.also.is_empty() {
                bail!("[[attach]] rule {rule}: `also` does not apply to server = \"registry\" (a reservation is of one device)");
            }
            rule.wanted()?;
        }
        if let Some(rule) = self.attach.iter().find(|r| r.server != "registry" && !r.labels.is_empty()) {
            bail!("[[attach]] rule {rule}: labels apply only to server = \"registry\" rules");
        }
        if let Some(rule) = self.attach.iter().find(|r| r.server == "discover" && !r.tls) {
            bail!(
                "[[attach]] rule {rule}: server = \"discover\" needs tls = true: without TLS any machine on the \
                 local network can answer mDNS and have its device (a keyboard that types commands) attached to \
                 this kernel; write tls = true and pin each server's key first (`usbwire list -r HOST:PORT --tls \
                 --trust-new`), or name the server: server = \"HOST:PORT\""
            );
        }
        Ok(())
    }
}

impl FileConfig {
    pub(crate) fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("invalid config {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redir_rules_from_the_file_and_the_flag() {
        let config: FileConfig =
            toml::from_str("[[redir]]\ndevice = \"1209:0003\"\nlisten = \"unix:/run/u/r.sock\"").unwrap();
        assert_eq!(config.redir, vec!["unix:/run/u/r.sock=1209:0003".parse::<RedirRule>().unwrap()]);
        assert_eq!(config.redir[0].listen, RedirListen::Unix("/run/u/r.sock".into()));
        let flag: RedirRule = "[::1]:4000=serial=A1".parse().unwrap();
        assert_eq!(
            (flag.listen, flag.device),
            (RedirListen::Tcp("[::1]:4000".parse().unwrap()), "serial=A1".parse().unwrap())
        );
        assert!("127.0.0.1:4000".parse::<RedirRule>().unwrap_err().to_string().contains("unix:PATH=SELECTOR"));
        assert!("localhost=2-1".parse::<RedirRule>().is_err());
        assert!("unix:=2-1".parse::<RedirRule>().is_err());
    }

    #[test]
    fn a_tcp_redir_listener_needs_the_opt_in_and_never_with_plain_never() {
        let unix: RedirRule = "unix:/run/u/r.sock=2-1".parse().unwrap();
        assert!(unix.check(true).is_ok());
        let tcp: RedirRule = "127.0.0.1:4000=2-1".parse().unwrap();
        let refused = format!("{:#}", tcp.check(false).unwrap_err());
        assert!(refused.contains("no authentication") && refused.contains("unix:PATH"), "{refused}");
        let opted: FileConfig =
            toml::from_str("[[redir]]\ndevice = \"2-1\"\nlisten = \"127.0.0.1:4000\"\nallow_unauthenticated = true")
                .unwrap();
        assert!(opted.redir[0].check(false).is_ok());
        let never = format!("{:#}", opted.redir[0].check(true).unwrap_err());
        assert!(never.contains("allow_plain = \"never\"") && never.contains("unix:PATH"), "{never}");
        let grouped: FileConfig =
            toml::from_str("[[redir]]\ndevice = \"2-1\"\nlisten = \"unix:/r.sock\"\ngroup = \"kvm\"").unwrap();
        assert_eq!(grouped.redir[0].group.as_deref(), Some("kvm"));
        assert_eq!(group_id("0").unwrap(), 0);
        assert!(group_id("no-such-group-usbwire").is_err());
    }

    #[test]
    fn specs_parse() {
        assert_eq!(VirtualSpec::parse("keyboard").unwrap(), VirtualSpec::Keyboard);
        assert_eq!(
            VirtualSpec::parse("disk=/tmp/d.img,size=64M,ro,speed=super").unwrap(),
            VirtualSpec::Disk {
                path: "/tmp/d.img".into(),
                size: Some(64 << 20),
                read_only: true,
                speed: SpeedChoice::Super
            }
        );
        assert_eq!(VirtualSpec::parse("serial").unwrap(), VirtualSpec::Serial { link: None });
        assert_eq!(
            VirtualSpec::parse("serial=/tmp/tty").unwrap(),
            VirtualSpec::Serial { link: Some("/tmp/tty".into()) }
        );
        assert_eq!(
            VirtualSpec::parse("loopback,speed=super").unwrap(),
            VirtualSpec::Loopback { speed: SpeedChoice::Super }
        );
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        for (spec, needle) in [
            ("disk", "needs an image path"),
            ("disk=x,size=12Q", "invalid size unit"),
            ("keyboard,ro", "does not apply"),
            ("webcam", "unknown virtual device"),
            ("disk=x,speed=warp", "unknown speed"),
        ] {
            let message = VirtualSpec::parse(spec).unwrap_err().to_string();
            assert!(message.contains(needle), "{spec}: {message}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert!(parse_size("M").is_err());
    }

    #[test]
    fn client_config_rules() {
        let config: ClientConfig = toml::from_str(
            r#"
            [[attach]]
            server = "10.0.2.2:3240"
            device = "0483:5740"
            also = ["0483:df11", "serial=X"]
            [[attach]]
            server = "host"
            device = "2-1"
            tls = true
            "#,
        )
        .unwrap();
        assert_eq!(config.attach.len(), 2);
        assert_eq!(config.attach[0].to_string(), "0483:5740|0483:df11|serial=X on 10.0.2.2:3240");
        assert_eq!(config.attach[0].selectors().count(), 3);
        assert!(config.attach[1].tls && !config.attach[0].tls);
        let bad = toml::from_str::<ClientConfig>("[[attach]]\nserver = \"h\"\ndevice = \"1-1\"\nalso = [\"nope\"]");
        assert!(bad.unwrap_err().to_string().contains("not a device selector"));
    }

    #[test]
    fn registry_rules_need_the_registry_and_take_labels() {
        let rule = "[[attach]]\nserver = \"registry\"\ndevice = \"0483:374b\"\nlabels = [\"nucleo\"]\n";
        let without: ClientConfig = toml::from_str(rule).unwrap();
        assert!(without.check().unwrap_err().to_string().contains("needs a [registry] table"));
        let with: ClientConfig =
            toml::from_str(&format!("{rule}[registry]\nendpoints = [\"127.0.0.1:2379\"]\n")).unwrap();
        with.check().unwrap();
        assert_eq!(with.attach[0].wanted().unwrap().to_string(), "0483:374b,label=nucleo");
        let labels_elsewhere: ClientConfig =
            toml::from_str("[[attach]]\nserver = \"h:1\"\ndevice = \"1-1\"\nlabels = [\"x\"]").unwrap();
        assert!(labels_elsewhere.check().unwrap_err().to_string().contains("only to server = \"registry\""));
    }

    #[test]
    fn discover_needs_tls() {
        let rule = |tls: bool| format!("[[attach]]\nserver = \"discover\"\ndevice = \"1-1\"\ntls = {tls}\n");
        let plain: ClientConfig = toml::from_str(&rule(false)).unwrap();
        let message = plain.check().unwrap_err().to_string();
        assert!(message.contains("needs tls = true") && message.contains("server = \"HOST:PORT\""), "{message}");
        let secure: ClientConfig = toml::from_str(&rule(true)).unwrap();
        secure.check().unwrap();
        let named: ClientConfig = toml::from_str("[[attach]]\nserver = \"h:1\"\ndevice = \"1-1\"").unwrap();
        named.check().unwrap();
    }

    #[test]
    fn labels_and_the_registry_table() {
        let config: FileConfig = toml::from_str(
            r#"
            [[virtual]]
            kind = "disk"
            path = "/tmp/x.img"
            labels = ["nucleo", "bench-3"]
            [[virtual]]
            kind = "keyboard"
            [[bind]]
            device = "0483:374b"
            labels = ["stlink"]
            [registry]
            endpoints = ["127.0.0.1:2379", "127.0.0.1:2479"]
            ttl = "4s"
            "#,
        )
        .unwrap();
        assert_eq!(config.virtual_devices[0].labels, ["nucleo", "bench-3"]);
        assert!(config.virtual_devices[1].labels.is_empty());
        assert_eq!(config.virtual_devices[1].spec, VirtualSpec::Keyboard);
        assert_eq!(config.bind[0].labels, ["stlink"]);
        let registry = config.registry.unwrap();
        assert_eq!(registry.ttl, Some(Duration::from_secs(4)));
        assert_eq!(registry.url().unwrap().to_string(), "etcd://127.0.0.1:2379,127.0.0.1:2479/usbwire");
        let unknown =
            toml::from_str::<FileConfig>("[[virtual]]\nkind = \"disk\"\npath = \"/x\"\nlable = [\"x\"]").unwrap_err();
        assert!(unknown.to_string().contains("lable"), "{unknown}");
    }

    #[test]
    fn config_file() {
        let config: FileConfig = toml::from_str(
            r#"
            listen = "127.0.0.1:4000"
            [[virtual]]
            kind = "disk"
            path = "/tmp/x.img"
            size = "1M"
            speed = "super"
            [[virtual]]
            kind = "keyboard"
            [[virtual]]
            kind = "serial"
            link = "/tmp/ttyUW"
            [[bind]]
            device = "46f4:0001"
            [[bind]]
            device = "serial=A1"
            also = ["0483:df11"]
            "#,
        )
        .unwrap();
        assert_eq!(config.listen, Some("127.0.0.1:4000".parse().unwrap()));
        assert_eq!(config.virtual_devices.len(), 3);
        assert_eq!(config.bind.len(), 2);
        assert_eq!(config.bind[1].device, "serial=A1".parse().unwrap());
        assert_eq!(config.bind[1].also, vec!["0483:df11".parse().unwrap()]);
        assert!(matches!(
            config.virtual_devices[0].spec,
            VirtualSpec::Disk { size: Some(1048576), speed: SpeedChoice::Super, .. }
        ));
        assert!(toml::from_str::<FileConfig>("lisen = 1").is_err());
        let bad = toml::from_str::<FileConfig>("[[bind]]\ndevice = \"usb stick\"").unwrap_err().to_string();
        assert!(bad.contains("VID:PID"), "{bad}");
        let secure: FileConfig = toml::from_str(
            r#"
            tls = true
            allow_plain = "never"
            [[allow]]
            client = "sha256:0000000000000000000000000000000000000000000000000000000000000000"
            devices = ["1-1", "disk"]
            "#,
        )
        .unwrap();
        assert!(secure.tls);
        assert_eq!(secure.allow[0].devices, vec!["1-1".to_string(), "disk".to_string()]);
    }

    #[test]
    fn limits_table_overrides_the_defaults_and_refuses_nonsense() {
        let config: FileConfig = toml::from_str(
            r#"
            [limits]
            max_transfer_length = "4M"
            in_flight_bytes = "32M"
            in_flight_urbs = 256
            queued_reply_bytes = 1048576
            unacked_reply_bytes = "16M"
            "#,
        )
        .unwrap();
        let mut limits = usbwire_proto::Limits::default();
        let mut budget = usbwire_proto::Budget::default();
        config.limits.apply(&mut limits, &mut budget).unwrap();
        assert_eq!(limits.max_transfer_length, 4 << 20);
        assert_eq!(
            budget,
            usbwire_proto::Budget {
                in_flight_bytes: 32 << 20,
                in_flight_urbs: 256,
                queued_reply_bytes: 1 << 20,
                unacked_reply_bytes: 16 << 20,
                ..usbwire_proto::Budget::default()
            }
        );

        for (text, said) in [
            ("[limits]\ndecoded_bytes = 0", "decoded_bytes must be more than 0"),
            ("[limits]\nmax_transfer_length = \"4G\"", "beyond USB/IP's 2 GiB"),
        ] {
            let config: FileConfig = toml::from_str(text).unwrap();
            let error = config.limits.apply(&mut limits, &mut budget).unwrap_err().to_string();
            assert!(error.contains(said), "{text}: {error}");
        }
        assert!(toml::from_str::<FileConfig>("[limits]\nin_flight = 3").is_err(), "unknown keys are refused");
    }

    #[test]
    fn admission_table_overrides_only_what_it_names() {
        let defaults = FileConfig::default().admission.limits().unwrap();
        assert_eq!(defaults, usbwire_server::AdmissionLimits::default());
        assert_eq!((defaults.unauthenticated_max, defaults.per_address_max), (64, 8));
        assert_eq!(defaults.first_byte_timeout, Duration::from_secs(3));
        let config: FileConfig = toml::from_str(
            r#"
            [admission]
            per_address_max = 2
            first_byte_timeout = "500ms"
            request_timeout = 4
            release_wait = "0s"
            log_interval = "1m"
            "#,
        )
        .unwrap();
        let limits = config.admission.limits().unwrap();
        assert_eq!(limits.per_address_max, 2);
        assert_eq!(limits.unauthenticated_max, 64, "left at its default");
        assert_eq!(limits.first_byte_timeout, Duration::from_millis(500));
        assert_eq!(limits.handshake_timeout, Duration::from_secs(3));
        assert_eq!(limits.request_timeout, Duration::from_secs(4));
        assert_eq!(limits.release_wait, Duration::ZERO);
        assert_eq!(limits.log_interval, Duration::from_secs(60));
    }

    #[test]
    fn bad_admission_values_say_what_to_do() {
        for (table, needle) in [
            ("per_address_max = 0", "would refuse every client"),
            ("first_byte_timeout = \"10ms\"", "at least 100ms"),
            ("log_interval = \"0s\"", "at least 1s"),
        ] {
            let config: FileConfig = toml::from_str(&format!("[admission]\n{table}")).unwrap();
            let message = config.admission.limits().unwrap_err().to_string();
            assert!(message.contains(needle), "{table}: {message}");
        }
        for (table, needle) in
            [("request_timeout = \"3 fortnights\"", "use ms, s, m or h"), ("per_adress_max = 1", "unknown field")]
        {
            let message = toml::from_str::<FileConfig>(&format!("[admission]\n{table}")).unwrap_err().to_string();
            assert!(message.contains(needle), "{table}: {message}");
        }
    }
}
