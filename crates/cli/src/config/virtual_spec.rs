//! The virtual devices a server serves: `--virtual` specs (`disk:PATH`,
//! `keyboard`, …) and `[[virtual]]` tables, parsed into [`VirtualSpec`].

use std::path::PathBuf;

use anyhow::bail;
use serde::Deserialize;

use super::units::{parse_size, size_field};

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
    /// A DFU 1.1 device flashed into `path` (`usbwire_gadgets::dfu`); `size`
    /// is its flash region, 1 MiB by default.
    Dfu {
        path: PathBuf,
        #[serde(default, deserialize_with = "size_field")]
        size: Option<u64>,
    },
    /// A device served by another process connected to the Unix socket at
    /// `socket` (`usbwire_external`; Python's `usbwire.device`, Facedancer).
    External {
        socket: PathBuf,
    },
}

impl VirtualSpec {
    /// Parses `keyboard`, `mouse`, `disk=PATH[,size=64M][,ro][,speed=super]`,
    /// `serial[=LINK]`, `loopback[,speed=super]`, `dfu=FILE[,size=1M]`, `external=unix:PATH`.
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
            ("dfu", Some(path)) if !path.is_empty() => {
                allow_only(&["size"])?;
                Ok(Self::Dfu { path: PathBuf::from(path), size })
            }
            ("dfu", _) => bail!("dfu needs a firmware file: --virtual dfu=FILE[,size=1M]"),
            ("external", Some(address)) => {
                allow_only(&[])?;
                match address.strip_prefix("unix:") {
                    Some(path) if !path.is_empty() => Ok(Self::External { socket: PathBuf::from(path) }),
                    _ => bail!("external needs a Unix socket path: --virtual external=unix:PATH"),
                }
            }
            ("external", None) => bail!("external needs a Unix socket path: --virtual external=unix:PATH"),
            _ => bail!(
                "unknown virtual device {spec:?} (keyboard, mouse, disk=PATH, serial[=LINK], loopback, dfu=FILE, \
                 external=unix:PATH)"
            ),
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
            Self::Dfu { .. } => "dfu",
            Self::External { .. } => "external",
        }
    }
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
        assert_eq!(
            VirtualSpec::parse("dfu=/tmp/fw.bin,size=2M").unwrap(),
            VirtualSpec::Dfu { path: "/tmp/fw.bin".into(), size: Some(2 << 20) }
        );
        assert_eq!(VirtualSpec::parse("dfu=fw.bin").unwrap(), VirtualSpec::Dfu { path: "fw.bin".into(), size: None });
        assert_eq!(
            VirtualSpec::parse("external=unix:/run/usbwire/dev.sock").unwrap(),
            VirtualSpec::External { socket: "/run/usbwire/dev.sock".into() }
        );
        let table: VirtualEntry = toml::from_str("kind = \"external\"\nsocket = \"/run/d.sock\"").unwrap();
        assert_eq!(table.spec, VirtualSpec::External { socket: "/run/d.sock".into() });
        let table: VirtualEntry = toml::from_str("kind = \"dfu\"\npath = \"/tmp/fw.bin\"\nsize = \"512K\"").unwrap();
        assert_eq!(table.spec, VirtualSpec::Dfu { path: "/tmp/fw.bin".into(), size: Some(512 << 10) });
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        for (spec, needle) in [
            ("disk", "needs an image path"),
            ("disk=x,size=12Q", "invalid size unit"),
            ("keyboard,ro", "does not apply"),
            ("webcam", "unknown virtual device"),
            ("disk=x,speed=warp", "unknown speed"),
            ("dfu", "needs a firmware file"),
            ("external", "needs a Unix socket path"),
            ("external=/run/x.sock", "needs a Unix socket path"),
            ("external=unix:/run/x.sock,size=1M", "does not apply"),
            ("dfu=fw.bin,ro", "does not apply"),
        ] {
            let message = VirtualSpec::parse(spec).unwrap_err().to_string();
            assert!(message.contains(needle), "{spec}: {message}");
        }
    }
}
