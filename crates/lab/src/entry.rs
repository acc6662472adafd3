//! What the registry holds, and where: the key layout, the JSON records
//! (servers, devices, reservations), the fleet they add up to, and the
//! device selectors clients pick from it with. No I/O.
//!
//! ```text
//! PREFIX/servers/SERVER                      ServerEntry       lease: the server's
//! PREFIX/devices/SERVER/BUSID                DeviceEntry       lease: the server's
//! PREFIX/devices/SERVER/!catalog/NNNNNN      its entries, 64 a key (`catalog`)
//! PREFIX/devices/SERVER/!term/KIND/VALUE/NNNNNN  those with a label, alike
//! PREFIX/reservations/SERVER/BUSID           ReservationEntry  lease: the holder's
//! PREFIX/index/KIND/VALUE/SERVER/BUSID       its state         lease: the server's
//! PREFIX/index/free/KIND/VALUE/BB/SERVER/BUSID  `available`     lease: the server's
//! ```
//!
//! SERVER is the address clients import from (`HOST:PORT`). A reservation is
//! created only by a transaction that finds its key absent, so at most one
//! exists per device; it goes when its holder releases it or its lease ends.
//!
//! The index lets a client find the devices a selector term names without
//! reading the fleet: one key per device and label (`label/nucleo`), VID:PID
//! (`id/0483:374b`), class of the device or an interface (`class/08`) and
//! serial (`serial/…`), whose value is the device's state (`available`,
//! `in_use`, `resuming`; servers before free keys wrote `reserved` too).
//! Beside it, the free devices: under `index/free/`, a key per term for each
//! device that is available and not reserved, spread over 256 buckets `BB`
//! (a hash of server and bus id), so a reservation reads one short page from
//! a random bucket instead of every matching device. Its server keeps both
//! current: an import changes its index keys and free keys, a reservation
//! (or its end) its free keys alone.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use usbwire_device::record::DeviceJson;
use usbwire_device::{AsDeviceFacts, DeviceFacts, Selector};

mod one_pass;

/// The version of the records' JSON; readers skip records of a newer major
/// version. Their device fields are the device record's (docs/json.md);
/// fields added since version 1 are optional, so version 1 readers read them.
pub const SCHEMA_VERSION: u32 = 1;

/// The registry's keys under one prefix.
#[derive(Clone, Debug)]
pub struct Keys {
    root: String,
}

/// What a registry key names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Key {
    Server { server: String },
    Device { server: String, busid: String },
    Reservation { server: String, busid: String },
}

impl Keys {
    pub fn new(prefix: &str) -> Self {
        Self { root: format!("{prefix}/") }
    }

    /// Every key of the registry starts with this.
    pub fn all(&self) -> String {
        self.root.clone()
    }

    pub fn server(&self, server: &str) -> String {
        format!("{}servers/{server}", self.root)
    }

    pub fn device(&self, server: &str, busid: &str) -> String {
        format!("{}devices/{server}/{busid}", self.root)
    }

    /// The prefix of one server's catalog: its device entries, a chunk a
    /// key (`catalog`). Under the server's own `devices/SERVER/` prefix, so
    /// a role that lets a server write its devices lets it write these; `!`
    /// sorts before every bus id, and no bus id has a `/`.
    pub fn catalog_of(&self, server: &str) -> String {
        format!("{}devices/{server}/{CATALOG}/", self.root)
    }

    /// The key of a server's catalog chunk `n` (six digits: keys sort as chunks do).
    pub fn catalog_chunk(&self, server: &str, n: usize) -> String {
        chunk_key(&self.catalog_of(server), n)
    }

    /// The prefix of a server's catalog of the devices with one term
    /// (`label`, `nucleo`; `catalog::TERM_KINDS`), beside its catalog.
    pub fn term_catalog_of(&self, server: &str, kind: &str, value: &str) -> String {
        format!("{}devices/{server}/{TERM_CATALOG}/{kind}/{}/", self.root, key_part(value))
    }

    /// The server whose catalog a chunk's key is under.
    pub fn chunk_server<'k>(&self, key: &'k [u8]) -> Option<&'k str> {
        let rest = std::str::from_utf8(key).ok()?.strip_prefix(&self.root)?.strip_prefix("devices/")?;
        rest.split_once("/!").map(|(server, _)| server)
    }

    /// The prefix every catalog chunk of a server's starts with, and none
    /// of its device keys (no bus id starts with `!`).
    pub fn catalogs_of(&self, server: &str) -> String {
        format!("{}devices/{server}/!", self.root)
    }

    /// The prefix of one server's reservations.
    pub fn reservations_of(&self, server: &str) -> String {
        format!("{}reservations/{server}/", self.root)
    }

    pub fn reservation(&self, server: &str, busid: &str) -> String {
        format!("{}reservations/{server}/{busid}", self.root)
    }

    /// The prefixes the fleet view reads (the index is not part of it).
    pub fn fleet_prefixes(&self) -> [String; 3] {
        ["servers/", "devices/", "reservations/"].map(|kind| format!("{}{kind}", self.root))
    }

    /// The index prefix of one term (`label`, `nucleo`); `/` and `%` in the value are escaped.
    pub fn index_of(&self, kind: &str, value: &str) -> String {
        format!("{}index/{kind}/{}/", self.root, key_part(value))
    }

    /// A device's key in the index under one term.
    pub fn index_entry(&self, kind: &str, value: &str, server: &str, busid: &str) -> String {
        format!("{}{server}/{busid}", self.index_of(kind, value))
    }

    /// Every index key of a device (its labels, VID:PID, classes, serial).
    pub fn index_entries(&self, device: &DeviceEntry) -> Vec<String> {
        let (server, busid) = (&device.server, &device.record.busid);
        index_terms(device).into_iter().map(|(kind, value)| self.index_entry(kind, &value, server, busid)).collect()
    }

    /// The free-device prefix of one term: a key per device under it that
    /// is available and not reserved, and none for any other.
    pub fn free_of(&self, kind: &str, value: &str) -> String {
        format!("{}index/free/{kind}/{}/", self.root, key_part(value))
    }

    /// A device's key among the free devices of one term: under the term's
    /// prefix, its bucket (two hex digits of a hash of server and bus id, so
    /// that a read from a random bucket lands on a random device), then
    /// server and bus id.
    pub fn free_entry(&self, kind: &str, value: &str, server: &str, busid: &str) -> String {
        self.free_entry_under(&self.free_of(kind, value), server, busid)
    }

    /// The same under a prefix [`Keys::free_of`] made.
    pub fn free_entry_under(&self, prefix: &str, server: &str, busid: &str) -> String {
        format!("{prefix}{}/{server}/{busid}", bucket(server, busid))
    }

    /// Every free-device key of a device, one per term it has an index key for.
    pub fn free_entries(&self, device: &DeviceEntry) -> Vec<String> {
        let (server, busid) = (&device.server, &device.record.busid);
        index_terms(device).into_iter().map(|(kind, value)| self.free_entry(kind, &value, server, busid)).collect()
    }

    /// Whether `key` is a free-device key (of any term).
    pub fn is_free_entry(&self, key: &str) -> bool {
        key.strip_prefix(&self.root).is_some_and(|rest| rest.starts_with("index/free/"))
    }

    /// The (server, bus id) a free-device key under `prefix` names.
    pub fn parse_free_entry(&self, prefix: &str, key: &[u8]) -> Option<(String, String)> {
        let rest = std::str::from_utf8(key).ok()?.strip_prefix(prefix)?;
        let (_bucket, rest) = rest.split_once('/')?;
        rest.rsplit_once('/').map(|(server, busid)| (server.to_owned(), busid.to_owned()))
    }

    /// The (server, bus id) an index key under `prefix` names.
    pub fn parse_index_entry(&self, prefix: &str, key: &[u8]) -> Option<(String, String)> {
        let rest = std::str::from_utf8(key).ok()?.strip_prefix(prefix)?;
        rest.rsplit_once('/').map(|(server, busid)| (server.to_owned(), busid.to_owned()))
    }

    /// Names a key, if it is one of ours. Bus ids have no `/`; server
    /// addresses may (never in practice), so the bus id is the last part.
    pub fn parse(&self, key: &[u8]) -> Option<Key> {
        let rest = std::str::from_utf8(key).ok()?.strip_prefix(&self.root)?;
        let (kind, rest) = rest.split_once('/')?;
        let split = || rest.rsplit_once('/').map(|(server, busid)| (server.to_owned(), busid.to_owned()));
        match kind {
            "servers" if !rest.is_empty() => Some(Key::Server { server: rest.to_owned() }),
            // A catalog chunk's server part has a `/!` (no address has).
            "devices" => split()
                .filter(|(server, _)| !server.contains("/!"))
                .map(|(server, busid)| Key::Device { server, busid }),
            "reservations" => split().map(|(server, busid)| Key::Reservation { server, busid }),
            _ => None,
        }
    }
}

/// Chunk `n` of the catalog under `prefix` (six digits: keys sort as chunks do).
pub fn chunk_key(prefix: &str, n: usize) -> String {
    format!("{prefix}{n:06}")
}

/// The key part that sets a server's catalog apart from its devices.
pub(crate) const CATALOG: &str = "!catalog";
/// The same, for its catalogs of one term.
const TERM_CATALOG: &str = "!term";

/// A server, as it registers itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerEntry {
    pub schema_version: u32,
    /// `HOST:PORT` clients import from; also the server's name in the registry.
    pub address: String,
    /// SHA-256 of its TLS certificate (`sha256:…`) when it speaks TLS.
    pub tls_fingerprint: Option<String>,
    /// Plain USB/IP accepted too (a TLS server may refuse it).
    pub plain: bool,
    pub implementation: String,
    pub version: String,
    /// RFC 3339.
    pub started_at: String,
    /// It publishes a catalog of its devices (`catalog`) beside their
    /// entries, which lists read instead; servers before it do not.
    #[serde(default)]
    pub catalog: bool,
    /// The kinds of selector term (`label`) it keeps a catalog of each term
    /// of (`catalog`), which filtered lists read instead.
    #[serde(default)]
    pub catalog_terms: Vec<String>,
}

/// A device a server exports, with its state now: its device record
/// (`usbwire_device::record`, the same fields every `--json` shows), the
/// classes the index is keyed by, and its labels. Read in one pass
/// (`one_pass`), as the flattened derive would read it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceEntry {
    pub schema_version: u32,
    pub server: String,
    #[serde(flatten)]
    pub record: DeviceJson,
    /// The device class and each interface's, two hex digits each (`00`, `08`).
    pub class: String,
    pub interface_classes: Vec<String>,
    pub labels: Vec<String>,
}

impl DeviceEntry {
    /// `available`, `in_use` or `resuming`.
    pub fn state(&self) -> &str {
        self.record.state.as_deref().unwrap_or_default()
    }

    /// Its product string, else its kind: what a person calls it in one word.
    pub fn name(&self) -> &str {
        self.record.product.as_deref().or(self.record.kind.as_deref()).unwrap_or_default()
    }
}

/// A device taken for a client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationEntry {
    pub schema_version: u32,
    /// `user@host`.
    pub holder: String,
    /// What holds it: `usbwire attach` (released on detach) or `usbwire reserve`.
    pub client: String,
    pub pid: u32,
    /// SHA-256 of the token the holder's imports carry, hex.
    pub token_sha256: String,
    /// RFC 3339.
    pub since_at: String,
    /// RFC 3339: when it ends by itself (`--for`), if it does.
    pub until_at: Option<String>,
}

/// RFC 3339, to the second, UTC.
pub fn timestamp(at: SystemTime) -> String {
    humantime::format_rfc3339_seconds(at).to_string()
}

/// What an index entry says of its device: the only word a reservation
/// takes a device on is [`Availability::AVAILABLE`].
pub struct Availability;

impl Availability {
    pub const AVAILABLE: &'static str = "available";
    pub const RESERVED: &'static str = "reserved";

    /// The word for a device in `state` (`available`, `in_use`, `resuming`), reserved or not.
    pub fn of(state: &str, reserved: bool) -> &str {
        match state {
            Self::AVAILABLE if reserved => Self::RESERVED,
            other => other,
        }
    }
}

/// The class with no index (nor free keys, nor catalog): `00`, "given per
/// interface", is the device class of nearly every device, so its index
/// would repeat the whole lab (two of a loopback device's nine keys) and
/// narrow nothing. A selector with `class=00` reads the devices themselves.
pub const UNINDEXED_CLASS: u8 = 0x00;

/// The index terms of a device, as (kind, value): its labels, VID:PID, the
/// classes of the device and its interfaces but [`UNINDEXED_CLASS`], its serial.
pub(crate) fn index_terms(device: &DeviceEntry) -> Vec<(&'static str, String)> {
    let mut terms: Vec<(&'static str, String)> = device.labels.iter().map(|label| ("label", label.clone())).collect();
    terms.push(("id", format!("{}:{}", device.record.vendor_id, device.record.product_id)));
    let unindexed = format!("{UNINDEXED_CLASS:02x}");
    let mut classes: Vec<&String> =
        std::iter::once(&device.class).chain(&device.interface_classes).filter(|class| **class != unindexed).collect();
    classes.sort();
    classes.dedup();
    terms.extend(classes.into_iter().map(|class| ("class", class.clone())));
    if let Some(serial) = &device.record.serial {
        terms.push(("serial", serial.clone()));
    }
    terms
}

/// How many buckets the free-device keys of a term spread over.
pub const BUCKETS: u32 = 256;

/// A device's bucket among the free devices: the top byte of the 32-bit
/// FNV-1a hash of `SERVER/BUSID`, in hex. Every server and client computes
/// the same, whatever their version.
fn bucket(server: &str, busid: &str) -> String {
    let hash = server
        .bytes()
        .chain(std::iter::once(b'/'))
        .chain(busid.bytes())
        .fold(0x811c_9dc5_u32, |hash, byte| (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193));
    format!("{:02x}", hash >> 24)
}

/// A value as one part of a key: `/` and `%` escaped.
fn key_part(value: &str) -> String {
    value.replace('%', "%25").replace('/', "%2F")
}

/// A record, if it is one we can read (a newer major schema is skipped).
pub(crate) fn decode<T: Record>(value: &[u8]) -> Option<T> {
    decode_str(std::str::from_utf8(value).ok()?)
}

/// The same, of text known to be UTF-8 (validated once, not per string).
pub(crate) fn decode_str<T: Record>(value: &str) -> Option<T> {
    serde_json::from_str::<T>(value).ok().filter(|record| record.schema_version() <= SCHEMA_VERSION)
}

/// A record of the registry: JSON with a `schema_version`.
pub(crate) trait Record: serde::de::DeserializeOwned {
    fn schema_version(&self) -> u32;
}

impl Record for ServerEntry {
    fn schema_version(&self) -> u32 {
        self.schema_version
    }
}

impl Record for ReservationEntry {
    fn schema_version(&self) -> u32 {
        self.schema_version
    }
}

impl Record for DeviceEntry {
    fn schema_version(&self) -> u32 {
        self.schema_version
    }
}

/// A device in the fleet view: its entry and its reservation, if any.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FleetDevice {
    #[serde(flatten)]
    pub device: DeviceEntry,
    pub reservation: Option<ReservationView>,
}

/// A reservation as others see it (no digest).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ReservationView {
    pub holder: String,
    pub client: String,
    pub pid: u32,
    pub since_at: String,
    pub until_at: Option<String>,
}

impl From<&ReservationEntry> for ReservationView {
    fn from(entry: &ReservationEntry) -> Self {
        Self {
            holder: entry.holder.clone(),
            client: entry.client.clone(),
            pid: entry.pid,
            since_at: entry.since_at.clone(),
            until_at: entry.until_at.clone(),
        }
    }
}

impl FleetDevice {
    /// Free to reserve: exported, not imported, not reserved, on a registered server.
    pub fn is_free(&self) -> bool {
        self.reservation.is_none() && self.device.state() == "available"
    }
}

/// Everything registered under a prefix, at one etcd revision.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Fleet {
    pub revision: i64,
    pub servers: Vec<ServerEntry>,
    /// Sorted by server, then bus id.
    pub devices: Vec<FleetDevice>,
}

impl Fleet {
    /// Builds the view from the registry's key-value pairs. Devices of
    /// servers that are not registered (a stale key) are left out;
    /// unreadable records are skipped.
    pub fn from_pairs<'a>(keys: &Keys, revision: i64, pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Self {
        let mut servers = BTreeMap::new();
        let mut devices = BTreeMap::new();
        let mut reservations = BTreeMap::new();
        for (key, value) in pairs {
            match keys.parse(key) {
                Some(Key::Server { server }) => {
                    if let Some(entry) = decode::<ServerEntry>(value) {
                        servers.insert(server, entry);
                    }
                }
                Some(Key::Device { server, busid }) => {
                    if let Some(entry) = decode::<DeviceEntry>(value) {
                        devices.insert((server, busid), entry);
                    }
                }
                Some(Key::Reservation { server, busid }) => {
                    if let Some(entry) = decode::<ReservationEntry>(value) {
                        reservations.insert((server, busid), entry);
                    }
                }
                None => {}
            }
        }
        let devices = devices
            .into_iter()
            .filter(|((server, _), _)| servers.contains_key(server))
            .map(|(at, device)| FleetDevice { device, reservation: reservations.get(&at).map(ReservationView::from) })
            .collect();
        Self { revision, servers: servers.into_values().collect(), devices }
    }

    pub fn server(&self, address: &str) -> Option<&ServerEntry> {
        self.servers.iter().find(|server| server.address == address)
    }
}

/// Which devices a client wants: terms joined by `,`, all of which must
/// match. A term is a bus id, `VID:PID`, `serial=TEXT`, `class=HEX` (the
/// device's class or an interface's), `label=NAME` or `server=HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Want {
    terms: Vec<Term>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Term {
    Device(Selector),
    Label(String),
    Server(String),
}

/// Why a `--device` value is not a selector.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0:?} is not a device selector: use terms joined by commas, each a bus id (1-1.2), VID:PID in hex (0483:374b), serial=TEXT, class=HEX, label=NAME or server=HOST:PORT")]
pub struct WantError(String);

impl FromStr for Want {
    type Err = WantError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let error = || WantError(text.to_owned());
        let mut terms = Vec::new();
        for term in text.split(',').map(str::trim) {
            let parsed = if let Some(label) = term.strip_prefix("label=") {
                (!label.is_empty()).then(|| Term::Label(label.to_owned()))
            } else if let Some(server) = term.strip_prefix("server=") {
                (!server.is_empty()).then(|| Term::Server(server.to_owned()))
            } else {
                term.parse().ok().map(Term::Device)
            };
            terms.push(parsed.ok_or_else(error)?);
        }
        Ok(Self { terms })
    }
}

impl fmt::Display for Want {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, term) in self.terms.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            match term {
                Term::Device(selector) => write!(f, "{selector}")?,
                Term::Label(label) => write!(f, "label={label}")?,
                Term::Server(server) => write!(f, "server={server}")?,
            }
        }
        Ok(())
    }
}

impl Want {
    /// The index prefixes of the terms that have one (all but bus id and
    /// server); a device the selector matches is under every one of them.
    /// None for a selector with `class=00`, which has no index (see
    /// [`UNINDEXED_CLASS`]): it reads the devices themselves.
    pub fn index_prefixes(&self, keys: &Keys) -> Vec<String> {
        self.index_terms().into_iter().map(|(kind, value)| keys.index_of(kind, &value)).collect()
    }

    /// The free-device prefixes of the same terms, in the same order.
    pub fn free_prefixes(&self, keys: &Keys) -> Vec<String> {
        self.index_terms().into_iter().map(|(kind, value)| keys.free_of(kind, &value)).collect()
    }

    /// The terms that have an index, as (kind, value); none when one of
    /// them is [`UNINDEXED_CLASS`].
    pub(crate) fn index_terms(&self) -> Vec<(&'static str, String)> {
        if self.terms.contains(&Term::Device(Selector::Class(UNINDEXED_CLASS))) {
            return Vec::new();
        }
        self.terms
            .iter()
            .filter_map(|term| match term {
                Term::Label(label) => Some(("label", label.clone())),
                Term::Device(Selector::VidPid { vendor_id, product_id }) => {
                    Some(("id", format!("{vendor_id:04x}:{product_id:04x}")))
                }
                Term::Device(Selector::Class(class)) => Some(("class", format!("{class:02x}"))),
                Term::Device(Selector::Serial(serial)) => Some(("serial", serial.clone())),
                Term::Device(Selector::BusId(_)) | Term::Server(_) => None,
            })
            .collect()
    }

    /// Whether the bus id and server terms allow this device.
    pub fn matches_place(&self, server: &str, busid: &str) -> bool {
        self.terms.iter().all(|term| match term {
            Term::Server(wanted) => wanted == server,
            Term::Device(Selector::BusId(wanted)) => wanted == busid,
            _ => true,
        })
    }

    pub fn matches(&self, device: &DeviceEntry) -> bool {
        self.terms.iter().all(|term| match term {
            Term::Label(label) => device.labels.iter().any(|l| l == label),
            Term::Server(server) => &device.server == server,
            Term::Device(selector) => selector.matches(device),
        })
    }
}

impl AsDeviceFacts for DeviceEntry {
    /// Ids and classes are hex text in the registry; one that does not read
    /// as hex is not known, and matches no selector that asks for it.
    fn device_facts(&self) -> DeviceFacts<'_> {
        DeviceFacts {
            busid: &self.record.busid,
            vendor_id: self.record.vendor_number(),
            product_id: self.record.product_number(),
            serial: self.record.serial.as_deref(),
            classes: std::iter::once(&self.class)
                .chain(&self.interface_classes)
                .filter_map(|class| u8::from_str_radix(class, 16).ok())
                .collect(),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn a_device_has_a_free_key_per_indexed_term_in_a_bucket_every_version_computes_alike() {
        let keys = Keys::new("lab");
        let entry = device("10.0.0.5:3240", "1-1.2", &["nucleo"]);
        let free = keys.free_entries(&entry);
        let index = keys.index_entries(&entry);
        assert_eq!(free.len(), index.len(), "one per indexed term: {free:?}");
        // FNV-1a 32 of "10.0.0.5:3240/1-1.2" is 0xfc520eee: bucket fc.
        assert_eq!(free[0], "lab/index/free/label/nucleo/fc/10.0.0.5:3240/1-1.2");
        assert!(free.iter().all(|key| key.contains("/fc/10.0.0.5:3240/1-1.2")));
        let want: Want = "label=nucleo,1209:0003".parse().unwrap();
        let prefixes = want.free_prefixes(&keys);
        assert_eq!(prefixes, ["lab/index/free/label/nucleo/", "lab/index/free/id/1209:0003/"]);
        for prefix in &prefixes {
            let key = keys.free_entry_under(prefix, "10.0.0.5:3240", "1-1.2");
            assert!(free.contains(&key), "{key} among {free:?}");
            assert_eq!(
                keys.parse_free_entry(prefix, key.as_bytes()),
                Some(("10.0.0.5:3240".to_owned(), "1-1.2".to_owned()))
            );
        }
        // The free keys are not read as the index's, nor as a record.
        assert!(!keys.index_of("label", "nucleo").starts_with(&keys.free_of("label", "nucleo")));
        assert_eq!(keys.parse(free[0].as_bytes()), None);
        // Buckets spread: 1 000 devices of one server land in most of the 256.
        let buckets: std::collections::BTreeSet<String> = (0..1000)
            .map(|i| keys.free_entry("label", "x", "10.0.0.5:3240", &format!("1-{i}")))
            .map(|key| key.split('/').nth(5).unwrap_or_default().to_owned())
            .collect();
        assert!(buckets.len() > 200, "{} buckets", buckets.len());
    }

    /// What serde's derive reads a device entry as: the reference the one
    /// pass is held to.
    #[derive(Deserialize)]
    struct Flattened {
        schema_version: u32,
        server: String,
        #[serde(flatten)]
        record: DeviceJson,
        class: String,
        interface_classes: Vec<String>,
        labels: Vec<String>,
    }

    impl From<Flattened> for DeviceEntry {
        fn from(f: Flattened) -> Self {
            let Flattened { schema_version, server, record, class, interface_classes, labels } = f;
            Self { schema_version, server, record, class, interface_classes, labels }
        }
    }

    pub(crate) fn device(server: &str, busid: &str, labels: &[&str]) -> DeviceEntry {
        DeviceEntry {
            schema_version: SCHEMA_VERSION,
            server: server.into(),
            record: DeviceJson {
                busid: busid.into(),
                kind: Some("disk".into()),
                vendor_id: "1209".into(),
                product_id: "0003".into(),
                manufacturer: Some("usbwire".into()),
                product: Some("usbwire disk".into()),
                serial: Some(format!("SN-{busid}")),
                speed: "high".into(),
                state: Some("available".into()),
                ..DeviceJson::default()
            },
            class: "00".into(),
            interface_classes: vec!["08".into()],
            labels: labels.iter().map(|l| l.to_string()).collect(),
        }
    }

    fn server(address: &str) -> ServerEntry {
        ServerEntry {
            schema_version: SCHEMA_VERSION,
            address: address.into(),
            tls_fingerprint: None,
            plain: true,
            implementation: "usbwire".into(),
            version: "0.1.0".into(),
            started_at: timestamp(SystemTime::UNIX_EPOCH),
            catalog: false,
            catalog_terms: Vec::new(),
        }
    }

    #[test]
    fn keys_round_trip() {
        let keys = Keys::new("lab/a");
        assert_eq!(keys.device("10.0.0.5:3240", "1-1.2"), "lab/a/devices/10.0.0.5:3240/1-1.2");
        assert_eq!(
            keys.parse(keys.reservation("[::1]:3240", "2-1").as_bytes()),
            Some(Key::Reservation { server: "[::1]:3240".into(), busid: "2-1".into() })
        );
        assert_eq!(keys.parse(keys.server("h:1").as_bytes()), Some(Key::Server { server: "h:1".into() }));
        assert_eq!(keys.parse(b"lab/b/servers/h:1"), None);
        assert_eq!(keys.parse(b"lab/a/devices/nobusid"), None);
        assert_eq!(keys.parse(b"lab/a/other/h:1/1-1"), None);
        assert_eq!(keys.parse(&[0xff, 0xfe]), None);
    }

    #[test]
    fn fleet_joins_devices_with_servers_and_reservations() {
        let keys = Keys::new("usbwire");
        let reservation = ReservationEntry {
            schema_version: SCHEMA_VERSION,
            holder: "ci@runner".into(),
            client: "usbwire attach".into(),
            pid: 7,
            token_sha256: "00".repeat(32),
            since_at: timestamp(SystemTime::UNIX_EPOCH),
            until_at: None,
        };
        let mut newer = device("a:1", "1-3", &[]);
        newer.schema_version = SCHEMA_VERSION + 1;
        let pairs: Vec<(String, Vec<u8>)> = vec![
            (keys.server("a:1"), serde_json::to_vec(&server("a:1")).unwrap()),
            (keys.device("a:1", "1-1"), serde_json::to_vec(&device("a:1", "1-1", &["x"])).unwrap()),
            (keys.device("a:1", "1-2"), serde_json::to_vec(&device("a:1", "1-2", &[])).unwrap()),
            (keys.device("a:1", "1-3"), serde_json::to_vec(&newer).unwrap()),
            (keys.device("a:1", "1-4"), b"{not json".to_vec()),
            // A device of a server that is gone (its lease not yet expired for this key).
            (keys.device("b:1", "1-1"), serde_json::to_vec(&device("b:1", "1-1", &[])).unwrap()),
            (keys.reservation("a:1", "1-2"), serde_json::to_vec(&reservation).unwrap()),
        ];
        let fleet = Fleet::from_pairs(&keys, 42, pairs.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())));
        assert_eq!(fleet.revision, 42);
        assert_eq!(fleet.servers.len(), 1);
        let listed: Vec<(&str, bool)> =
            fleet.devices.iter().map(|d| (d.device.record.busid.as_str(), d.is_free())).collect();
        assert_eq!(listed, [("1-1", true), ("1-2", false)]);
        assert_eq!(fleet.devices[1].reservation.as_ref().unwrap().holder, "ci@runner");
        let json = serde_json::to_value(&fleet).unwrap();
        assert!(json["devices"][1]["reservation"].get("token_sha256").is_none(), "the digest is not shown");
    }

    #[test]
    fn a_version_1_device_record_reads_and_a_new_one_keeps_its_version_1_fields() {
        // As servers before the device record wrote it (and as anyone could plant it).
        let old = r#"{"schema_version":1,"server":"a:1","busid":"1-1","kind":"keyboard","vendor_id":"1209",
            "product_id":"0001","manufacturer":null,"product":"planted keyboard","serial":null,"class":"03",
            "interface_classes":[],"speed":"full","state":"available","holder":null,"since_at":null,"labels":["kbd"]}"#;
        let entry: DeviceEntry = decode(old.as_bytes()).expect("a version 1 record reads");
        assert_eq!(
            (entry.record.busid.as_str(), entry.state(), entry.name()),
            ("1-1", "available", "planted keyboard")
        );
        assert_eq!(entry.record.bcd_device, None);
        // What a version 1 reader needs is still there, with the same types.
        let new = serde_json::to_value(device("a:1", "1-2", &["x"])).unwrap();
        for (field, is_string) in
            [("busid", true), ("kind", true), ("vendor_id", true), ("speed", true), ("state", true)]
        {
            assert_eq!(new[field].is_string(), is_string, "{field} in {new}");
        }
        assert!(new["labels"].is_array() && new["interface_classes"].is_array() && new["class"].is_string());
    }

    #[test]
    fn selectors_match_every_term() {
        let disk = device("a:1", "1-1", &["nucleo", "bench-3"]);
        for (text, expected) in [
            ("1209:0003", true),
            ("1209:0003,label=nucleo", true),
            ("1209:0003,label=stm32", false),
            ("class=08", true),
            ("class=03", false),
            ("serial=SN-1-1", true),
            ("server=a:1,1-1", true),
            ("server=b:1", false),
            ("label=bench-3", true),
        ] {
            let want: Want = text.parse().unwrap();
            assert_eq!(want.matches(&disk), expected, "{text}");
            assert_eq!(want.to_string(), text);
        }
        for bad in ["", "label=", "server=", "nucleo", "1209:0003,,label=x", "class=zz"] {
            assert!(bad.parse::<Want>().is_err(), "{bad:?} accepted");
        }
    }

    /// A filtered list reads the catalogs of one of the selector's labels,
    /// VID:PIDs or classes, and each term's catalog is where its devices are.
    #[test]
    fn the_catalog_terms_of_a_selector_are_its_labels_and_hold_its_devices() {
        let keys = Keys::new("usbwire");
        let want: Want = "class=08,serial=SN-1-1,1209:0003,server=a:1,label=nucleo".parse().unwrap();
        let terms = crate::catalog::terms_of(&want);
        assert_eq!(terms, [("label", "nucleo".into()), ("id", "1209:0003".into()), ("class", "08".into())]);
        let disk = device("a:1", "1-1", &["nucleo", "bench/3"]);
        let catalogs = crate::catalog::term_catalogs(&keys, &disk);
        let kept: Vec<(&str, String)> = index_terms(&disk).into_iter().filter(|(kind, _)| *kind != "serial").collect();
        for (kind, value) in &kept {
            assert!(catalogs.contains(&keys.term_catalog_of("a:1", kind, value)), "{kind}={value} in {catalogs:?}");
        }
        assert!(catalogs.contains(&"usbwire/devices/a:1/!term/label/bench%2F3/".to_owned()), "{catalogs:?}");
        assert_eq!(catalogs.len(), kept.len(), "a catalog per label, VID:PID and class, not serial: {catalogs:?}");
        let chunk = chunk_key(&catalogs[0], 7);
        assert_eq!(keys.parse(chunk.as_bytes()), None, "a chunk is not a device");
        assert_eq!(keys.chunk_server(chunk.as_bytes()), Some("a:1"));
        assert_eq!(crate::catalog::terms_of(&"serial=SN-1-1,1209:0003".parse().unwrap()), [("id", "1209:0003".into())]);
        assert!(crate::catalog::terms_of(&"serial=SN-1-1".parse().unwrap()).is_empty());
    }

    #[test]
    fn a_matching_selector_finds_the_device_under_each_of_its_index_terms() {
        let keys = Keys::new("usbwire");
        let mut disk = device("a:1", "1-1", &["nucleo", "bench/3"]);
        disk.record.serial = Some("SN/1%".into());
        let entries = keys.index_entries(&disk);
        assert!(entries.contains(&"usbwire/index/label/bench%2F3/a:1/1-1".to_owned()), "{entries:?}");
        assert!(entries.contains(&"usbwire/index/serial/SN%2F1%25/a:1/1-1".to_owned()), "{entries:?}");
        for text in
            ["label=nucleo", "1209:0003,label=bench/3", "class=08", "class=00", "serial=SN/1%", "server=a:1,1-1"]
        {
            let want: Want = text.parse().unwrap();
            assert!(want.matches(&disk), "{text}");
            assert!(want.matches_place(&disk.server, &disk.record.busid), "{text}");
            for prefix in want.index_prefixes(&keys) {
                let found: Vec<_> = entries.iter().filter(|e| e.starts_with(&prefix)).collect();
                assert_eq!(found.len(), 1, "{text}: {prefix} in {entries:?}");
                assert_eq!(keys.parse_index_entry(&prefix, found[0].as_bytes()), Some(("a:1".into(), "1-1".into())));
            }
        }
        let elsewhere: Want = "server=b:1".parse().unwrap();
        assert!(!elsewhere.matches_place(&disk.server, &disk.record.busid));
        assert!(keys.parse(entries[0].as_bytes()).is_none(), "the index is not part of the fleet view");
        assert_eq!(Availability::of("available", true), Availability::RESERVED);
        assert_eq!(Availability::of("available", false), Availability::AVAILABLE);
        assert_eq!(Availability::of("in_use", true), "in_use");
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Whatever the registry holds (other tools write there too), reading it never panics,
            /// and only keys of ours with readable records become servers and devices.
            #[test]
            fn any_keys_and_values_read_without_panic(
                pairs in proptest::collection::vec((proptest::collection::vec(any::<u8>(), 0..40), proptest::collection::vec(any::<u8>(), 0..80)), 0..20)
            ) {
                let keys = Keys::new("usbwire");
                let fleet = Fleet::from_pairs(&keys, 1, pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
                prop_assert!(fleet.devices.len() <= pairs.len());
                prop_assert!(fleet.servers.len() <= pairs.len());
            }

            /// Every server address and bus id a key is made of is read back from it.
            #[test]
            fn keys_round_trip(server in "[a-z0-9.:\\[\\]-]{1,30}", busid in "[0-9]{1,2}-[0-9.]{1,8}") {
                let keys = Keys::new("lab/x");
                prop_assert_eq!(keys.parse(keys.device(&server, &busid).as_bytes()), Some(Key::Device { server: server.clone(), busid: busid.clone() }));
                prop_assert_eq!(keys.parse(keys.reservation(&server, &busid).as_bytes()), Some(Key::Reservation { server: server.clone(), busid }));
                prop_assert_eq!(keys.parse(keys.server(&server).as_bytes()), Some(Key::Server { server }));
            }

            /// A device entry reads in one pass (`one_pass`) as serde's
            /// flattened derive reads it: the same entry, or nothing when that
            /// gives nothing; whatever field is missing, mistyped, added or
            /// written with an escape.
            #[test]
            fn device_entries_read_as_the_derive_reads_them(
                busid in "[0-9]{1,2}-[0-9.]{1,6}",
                labels in proptest::collection::vec("[a-z\\\\\"é-]{0,8}", 0..4),
                serial in proptest::option::of("[ -~]{0,12}"),
                holder in proptest::option::of("[a-z@.]{1,12}"),
                version in 0u32..3,
                change in 0usize..40,
                what in 0u8..4,
            ) {
                let mut entry = device("10.0.0.5:3240", &busid, &[]);
                entry.labels = labels;
                entry.record.serial = serial;
                entry.record.holder = holder;
                entry.schema_version = version;
                let mut json = serde_json::to_value(&entry).unwrap();
                let object = json.as_object_mut().unwrap();
                let names: Vec<String> = object.keys().cloned().collect();
                let name = &names[change % names.len()];
                match what {
                    0 => { object.remove(name); }
                    1 => { object.insert(name.clone(), serde_json::json!([1, 2])); }
                    2 => { object.insert(format!("new_{name}"), serde_json::json!({"x": null})); }
                    _ => {}
                }
                let mut text = json.to_string();
                if what == 3 {
                    // The name with its first letter escaped: read, but not borrowed.
                    let escaped = format!("\"\\u{:04x}{}\"", u32::from(name.as_bytes()[0]), &name[1..]);
                    text = text.replacen(&format!("\"{name}\""), &escaped, 1);
                }
                let derived = serde_json::from_str::<Flattened>(&text).ok().map(DeviceEntry::from);
                prop_assert_eq!(serde_json::from_str::<DeviceEntry>(&text).ok(), derived.clone());
                prop_assert_eq!(decode::<DeviceEntry>(text.as_bytes()), derived.filter(|e| e.schema_version <= SCHEMA_VERSION));
            }
        }
    }
}
