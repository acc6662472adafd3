//! Configuration: the server's TOML file and `--virtual` specs, and the
//! client service's `[[attach]]` rules, parsed into plain values. Nothing
//! here touches the system; `commands::serve` and `commands::service` do.
//!
//! ```toml
//! listen = "0.0.0.0:3240"
//! control = "/run/usbwire/control.sock"
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
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

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
    pub(crate) virtual_devices: Vec<VirtualSpec>,
    /// Real devices to export.
    #[serde(default)]
    pub(crate) bind: Vec<BindRule>,
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
    /// Let a `client = "*"` rule admit any client key (`--allow-any-client`).
    #[serde(default)]
    pub(crate) allow_any_client: bool,
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
/// ```
///
/// `server = "discover"` without TLS is refused at load: any machine on the LAN
/// could answer mDNS and have its "device" (a keyboard that types commands)
/// attached to this kernel. With TLS, only servers whose key is pinned in the
/// identity's `known_servers` are accepted (the service never pins on first use).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClientConfig {
    pub(crate) identity: Option<PathBuf>,
    #[serde(default)]
    pub(crate) attach: Vec<AttachRule>,
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
}

impl AttachRule {
    /// Every identity the device may show up under.
    pub(crate) fn selectors(&self) -> impl Iterator<Item = &usbwire_server::Selector> {
        std::iter::once(&self.device).chain(&self.also)
    }
}

impl std::fmt::Display for AttachRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.device)?;
        for other in &self.also {
            write!(f, "|{other}")?;
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
            config.virtual_devices[0],
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
}
