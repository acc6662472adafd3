//! The server's TOML file (`usbwire serve --config`): listen addresses,
//! HTTP and capture, `[[virtual]]`, `[[bind]]`, `[[redir]]`, `[registry]`,
//! `[limits]` and `[admission]`, parsed into [`FileConfig`].
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
//! [[virtual]]
//! kind = "dfu"        # a board to flash with dfu-util: DFU 1.1, re-enumerates into its bootloader
//! path = "/var/lib/usbwire/fw.bin" # the firmware image: written (atomically) by each flash
//! size = "1M"         # the flash region (the default), at most 64M
//!
//! [[virtual]]
//! kind = "external"   # a device a process serves (Python's usbwire.device, a Facedancer script)
//! socket = "/run/usbwire/device.sock" # where it connects: made 0600, listed while one is connected
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

use super::redir::RedirRule;
use super::units::{duration_field, selector_field, selector_list, size_field};
use super::virtual_spec::VirtualEntry;

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

/// `[[bind]] device = "SELECTOR"`: export matching real devices.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BindRule {
    #[serde(deserialize_with = "selector_field")]
    pub(crate) device: usbwire_device::Selector,
    /// The same device under other identities (after it re-enumerates, e.g. into its bootloader).
    #[serde(default, deserialize_with = "selector_list")]
    pub(crate) also: Vec<usbwire_device::Selector>,
    /// What the lab registry shows it as (`label=NAME` selects it there).
    #[serde(default)]
    pub(crate) labels: Vec<String>,
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
    use crate::config::*;

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
