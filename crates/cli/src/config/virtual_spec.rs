//! The virtual devices a server serves: `--virtual` specs (`disk:PATH`,
//! `keyboard`, …) and `[[virtual]]` tables, parsed into [`VirtualSpec`].

use std::ops::RangeInclusive;
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

/// What a replay does with a request its recording lacks (`mode=`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ReplayMode {
    #[default]
    Strict,
    Lenient,
}

/// When a replay gives IN data (`timing=`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ReplayTiming {
    #[default]
    Asap,
    Recorded,
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
        /// Blocks whose reads fail with MEDIUM ERROR (a failing medium, for tests).
        #[serde(default, deserialize_with = "bad_blocks_field")]
        bad: Option<RangeInclusive<u64>>,
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
    /// A device recorded by a server's capture, served back
    /// (`usbwire_gadgets::replay`); each import's report goes to `report`.
    Replay {
        path: PathBuf,
        #[serde(default)]
        mode: ReplayMode,
        #[serde(default)]
        timing: ReplayTiming,
        #[serde(default)]
        report: Option<PathBuf>,
    },
}

impl VirtualSpec {
    /// Parses `keyboard`, `mouse`, `disk=PATH[,size=64M][,ro][,speed=super][,bad=LBA[-LBA]]`,
    /// `serial[=LINK]`, `loopback[,speed=super]`, `dfu=FILE[,size=1M]`, `external=unix:PATH`,
    /// `replay=FILE[,mode=strict|lenient][,timing=asap|recorded][,report=PATH]`.
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
        let mut bad = None;
        let (mut mode, mut timing, mut report) = (ReplayMode::Strict, ReplayTiming::Asap, None);
        for option in &options {
            match option.split_once('=') {
                Some(("mode", "strict")) => mode = ReplayMode::Strict,
                Some(("mode", "lenient")) => mode = ReplayMode::Lenient,
                Some(("timing", "asap")) => timing = ReplayTiming::Asap,
                Some(("timing", "recorded")) => timing = ReplayTiming::Recorded,
                Some(("report", path)) if !path.is_empty() => report = Some(PathBuf::from(path)),
                Some((name @ ("mode" | "timing" | "report"), value)) => {
                    bail!("invalid {name}={value:?} in --virtual {spec:?} (mode=strict|lenient, timing=asap|recorded, report=PATH)")
                }
                Some(("size", text)) => size = Some(parse_size(text)?),
                Some(("bad", text)) => bad = Some(parse_blocks(text)?),
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
                allow_only(&["size", "ro", "speed", "bad"])?;
                Ok(Self::Disk { path: PathBuf::from(path), size, read_only, speed, bad })
            }
            ("disk", _) => {
                bail!("disk needs an image path: --virtual disk=PATH[,size=64M][,ro][,speed=super][,bad=LBA[-LBA]]")
            }
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
            ("replay", Some(path)) if !path.is_empty() => {
                allow_only(&["mode", "timing", "report"])?;
                Ok(Self::Replay { path: PathBuf::from(path), mode, timing, report })
            }
            ("replay", _) => bail!("replay needs a recording: --virtual replay=FILE[,mode=strict|lenient]"),
            _ => bail!(
                "unknown virtual device {spec:?} (keyboard, mouse, disk=PATH, serial[=LINK], loopback, dfu=FILE, \
                 external=unix:PATH, replay=FILE)"
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
            Self::Replay { .. } => "replay",
        }
    }
}

/// `100` or `100-199`: a range of blocks, both ends included.
fn parse_blocks(text: &str) -> anyhow::Result<RangeInclusive<u64>> {
    let number = |part: &str| {
        part.trim()
            .parse::<u64>()
            .map_err(|_| anyhow::anyhow!("invalid block range {text:?} (e.g. bad=100 or bad=100-199)"))
    };
    let (first, last) = match text.split_once('-') {
        Some((first, last)) => (number(first)?, number(last)?),
        None => (number(text)?, number(text)?),
    };
    if first > last {
        bail!("block range {text:?} ends before it starts");
    }
    Ok(first..=last)
}

/// `bad = "100-199"` (or a number) in a `[[virtual]]` table.
fn bad_blocks_field<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<RangeInclusive<u64>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Blocks {
        One(u64),
        Text(String),
    }
    match Option::<Blocks>::deserialize(deserializer)? {
        None => Ok(None),
        Some(Blocks::One(lba)) => Ok(Some(lba..=lba)),
        Some(Blocks::Text(text)) => parse_blocks(&text).map(Some).map_err(serde::de::Error::custom),
    }
}

/// Every `[[virtual]]` kind and the keys it takes besides `kind` and
/// `labels`: the parser checks each table's keys against this list (so a
/// typo is reported at its own line), usbwire.toml(5) is written from it,
/// and a test holds it to what [`VirtualSpec`]'s fields are.
pub(crate) const VIRTUAL_KINDS: &[(&str, &[&str])] = &[
    ("keyboard", &[]),
    ("mouse", &[]),
    ("disk", &["path", "size", "read_only", "speed", "bad"]),
    ("serial", &["link"]),
    ("loopback", &["speed"]),
    ("dfu", &["path", "size"]),
    ("external", &["socket"]),
    ("replay", &["path", "mode", "timing", "report"]),
];

/// The keys of a `[[virtual]]` table besides each kind's own.
const COMMON_KEYS: [&str; 2] = ["kind", "labels"];

/// A `[[virtual]]` key as usbwire.toml(5) shows it.
pub(crate) struct VirtualKey {
    pub(crate) key: &'static str,
    /// What its value looks like: `"FILE"`, `true|false`.
    pub(crate) form: &'static str,
    /// What it means for each kind that takes it.
    pub(crate) meanings: &'static [(&'static str, &'static str)],
}

/// Every kind's own `[[virtual]]` keys, for usbwire.toml(5) (`kind`'s
/// values and which kind takes which key come from [`VIRTUAL_KINDS`]; a
/// test holds the two together).
pub(crate) const VIRTUAL_KEYS: &[VirtualKey] = &[
    VirtualKey {
        key: "path",
        form: "\"FILE\"",
        meanings: &[
            ("disk", "its image file (created with size if missing)"),
            ("dfu", "its firmware image, written by each flash"),
            ("replay", "the recording: a capture file of `serve --capture` (docs/recording.md)"),
        ],
    },
    VirtualKey {
        key: "size",
        form: "\"64M\"",
        meanings: &[
            ("disk", "the image's size when it is created"),
            ("dfu", "its flash region (default 1M, at most 64M)"),
        ],
    },
    VirtualKey { key: "read_only", form: "true|false", meanings: &[("disk", "refuse writes")] },
    VirtualKey {
        key: "speed",
        form: "\"high\"|\"super\"",
        meanings: &[("disk", "the speed it reports"), ("loopback", "the speed it reports")],
    },
    VirtualKey {
        key: "bad",
        form: "\"LBA\"|\"LBA-LBA\"",
        meanings: &[(
            "disk",
            "blocks whose reads fail with MEDIUM ERROR, as a failing medium's (for testing error paths)",
        )],
    },
    VirtualKey {
        key: "mode",
        form: "\"strict\"|\"lenient\"",
        meanings: &[(
            "replay",
            "what a request the recording lacks gets: strict stalls it (default), lenient answers from the recording",
        )],
    },
    VirtualKey {
        key: "timing",
        form: "\"asap\"|\"recorded\"",
        meanings: &[("replay", "IN data at once (default), or after the time the recorded device took")],
    },
    VirtualKey {
        key: "report",
        form: "\"PATH\"",
        meanings: &[("replay", "a JSON file (0600) with each import's report, replaced when the next one ends")],
    },
    VirtualKey { key: "link", form: "\"PATH\"", meanings: &[("serial", "a symlink to its pseudo-terminal")] },
    VirtualKey {
        key: "socket",
        form: "\"PATH\"",
        meanings: &[(
            "external",
            "the Unix socket a process serving the device connects to (made 0600; listed while one is connected)",
        )],
    },
];

/// `[[virtual]]`: a virtual device, and the labels the lab registry shows for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VirtualEntry {
    pub(crate) spec: VirtualSpec,
    pub(crate) labels: Vec<String>,
}

impl<'de> Deserialize<'de> for VirtualEntry {
    /// The device's own fields ([`VirtualSpec`]) and `labels`. Each key is
    /// checked as it is read, against the kind when `kind` came before it
    /// (else against every kind's keys), so an unknown one is reported at its
    /// own line; serde's internally tagged enum would report it at the
    /// table's.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(EntryVisitor)
    }
}

struct EntryVisitor;

impl<'de> serde::de::Visitor<'de> for EntryVisitor {
    type Value = VirtualEntry;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a [[virtual]] table")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<VirtualEntry, A::Error> {
        use serde::de::Error as _;
        let mut table = toml::Table::new();
        let mut labels = Vec::new();
        let mut kind: Option<&'static (&'static str, &'static [&'static str])> = None;
        while let Some(key) = map.next_key_seed(KeyCheck { kind })? {
            match key.as_str() {
                "labels" => labels = map.next_value()?,
                "kind" => {
                    let name: String = map.next_value_seed(KindCheck)?;
                    kind = VIRTUAL_KINDS.iter().find(|(known, _)| *known == name);
                    table.insert(key, toml::Value::String(name));
                }
                _ => {
                    let value: toml::Value = map.next_value()?;
                    table.insert(key, value);
                }
            }
        }
        let spec = VirtualSpec::deserialize(toml::Value::Table(table)).map_err(A::Error::custom)?;
        Ok(VirtualEntry { spec, labels })
    }
}

/// A `[[virtual]]` key, refused unless the kind (when known yet) takes it.
struct KeyCheck {
    kind: Option<&'static (&'static str, &'static [&'static str])>,
}

impl<'de> serde::de::DeserializeSeed<'de> for KeyCheck {
    type Value = String;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<String, D::Error> {
        use serde::de::Error as _;
        let key = String::deserialize(deserializer)?;
        if COMMON_KEYS.contains(&key.as_str()) {
            return Ok(key);
        }
        match self.kind {
            Some((_, keys)) if keys.contains(&key.as_str()) => Ok(key),
            Some((kind, keys)) => Err(D::Error::custom(format!(
                "unknown key `{key}` for a virtual {kind}: it takes {}",
                quoted(COMMON_KEYS.iter().chain(keys.iter()))
            ))),
            None if VIRTUAL_KINDS.iter().any(|(_, keys)| keys.contains(&key.as_str())) => Ok(key),
            None => {
                let mut every: Vec<&str> = VIRTUAL_KINDS.iter().flat_map(|(_, keys)| keys.iter().copied()).collect();
                every.sort_unstable();
                every.dedup();
                Err(D::Error::custom(format!(
                    "unknown key `{key}`: a [[virtual]] table takes {}",
                    quoted(COMMON_KEYS.iter().chain(every.iter()))
                )))
            }
        }
    }
}

/// A `[[virtual]]` kind, refused unless it is one of [`VIRTUAL_KINDS`].
struct KindCheck;

impl<'de> serde::de::DeserializeSeed<'de> for KindCheck {
    type Value = String;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<String, D::Error> {
        use serde::de::Error as _;
        let kind = String::deserialize(deserializer)?;
        if VIRTUAL_KINDS.iter().any(|(known, _)| *known == kind) {
            return Ok(kind);
        }
        Err(D::Error::custom(format!(
            "unknown virtual device kind {kind:?}: one of {}",
            quoted(VIRTUAL_KINDS.iter().map(|(known, _)| known))
        )))
    }
}

/// `` `a`, `b`, `c` ``.
fn quoted(names: impl Iterator<Item = impl std::fmt::Display>) -> String {
    names.map(|name| format!("`{name}`")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_specs_parse_with_their_options_and_refuse_others() {
        assert_eq!(
            VirtualSpec::parse("replay=kbd.pcapng").unwrap(),
            VirtualSpec::Replay {
                path: "kbd.pcapng".into(),
                mode: ReplayMode::Strict,
                timing: ReplayTiming::Asap,
                report: None
            }
        );
        assert_eq!(
            VirtualSpec::parse("replay=kbd.pcapng,mode=lenient,timing=recorded,report=out/r.json").unwrap(),
            VirtualSpec::Replay {
                path: "kbd.pcapng".into(),
                mode: ReplayMode::Lenient,
                timing: ReplayTiming::Recorded,
                report: Some("out/r.json".into())
            }
        );
        for (spec, says) in [
            ("replay", "needs a recording"),
            ("replay=k.pcapng,mode=loose", "invalid mode=\"loose\""),
            ("replay=k.pcapng,size=1M", "does not apply to replay"),
            ("keyboard,mode=strict", "does not apply to keyboard"),
        ] {
            let error = VirtualSpec::parse(spec).unwrap_err().to_string();
            assert!(error.contains(says), "{spec}: {error}");
        }
        let table: VirtualEntry =
            toml::from_str("kind = \"replay\"\npath = \"k.pcapng\"\nmode = \"lenient\"\nreport = \"r.json\"").unwrap();
        assert!(matches!(table.spec, VirtualSpec::Replay { mode: ReplayMode::Lenient, report: Some(_), .. }));
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
                speed: SpeedChoice::Super,
                bad: None,
            }
        );
        assert!(matches!(
            VirtualSpec::parse("disk=/tmp/d.img,bad=100-107").unwrap(),
            VirtualSpec::Disk { bad: Some(range), .. } if range == (100..=107)
        ));
        assert!(matches!(
            VirtualSpec::parse("disk=/tmp/d.img,bad=9").unwrap(),
            VirtualSpec::Disk { bad: Some(range), .. } if range == (9..=9)
        ));
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
            ("disk=x,bad=7-3", "ends before it starts"),
            ("disk=x,bad=seven", "invalid block range"),
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
