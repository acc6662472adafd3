//! The device state document (`OP_REP_DEVSTATE`, the control socket's
//! `state`, `list -r --json`): one entry per exported device, written by the
//! server and read by the client. Reading is lenient (fields a newer or older
//! server leaves out take defaults) so either side can be upgraded first.
//!
//! What a person or script reads is not this document but the device record
//! it converts into ([`DeviceJson`], `From<&DeviceStateEntry>`), with the
//! counters and reservation beside it ([`CountedDevice`]): `state --json`, `list -r --json`
//! and `/status.json`.
//!
//! It lives beside [`crate::record`] because it is a device's JSON and converts into
//! [`DeviceJson`], and because server and client share it: this is the lowest crate both
//! stand on that knows the record (the USB/IP layouts below, `usbwire-proto`, know no
//! JSON). Not for filling it in (the server's `devstate.rs` does, from its registry) or for the bytes of
//! `OP_REP_DEVSTATE` around it (`usbwire_proto::op`).

use serde::{Deserialize, Serialize};

use crate::counters::DeviceCounters;
use crate::record::{known, DeviceJson, InterfaceJson};

/// One exported device and who holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStateEntry {
    pub busid: String,
    /// What exports it: a virtual device kind (`disk`, `keyboard` …) or `host`.
    #[serde(default)]
    pub kind: String,
    pub vendor_id: String,
    pub product_id: String,
    /// The device's own product string.
    #[serde(default)]
    pub product: String,
    /// The same, under the name every `--json` gives the device's own string.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub product_string: String,
    #[serde(default)]
    pub speed: String,
    /// The device's release number (`1.00`); servers before it was sent leave it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bcd_device: Option<String>,
    /// The device's class triple (`00/00/00`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_class: Option<String>,
    /// Each interface's class triple, in interface order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub manufacturer: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub serial: String,
    /// `available` or `in_use`.
    pub state: String,
    /// The importer's address, when in use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// The importer's certificate fingerprint, when it came over TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// Seconds since the Unix epoch when the current client imported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<u64>,
    /// In use, but the importer's connection dropped at this time (seconds
    /// since the Unix epoch) and the server holds the session for it to resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resuming_since: Option<u64>,
    /// `since` in RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_at: Option<String>,
    /// `resuming_since` in RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resuming_since_at: Option<String>,
    /// What the device has carried since the server started (the same numbers
    /// as its Prometheus metrics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<DeviceCounters>,
    /// Reserved in the lab registry: for whom and until when. An import that
    /// does not carry the reservation is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<ReservedFor>,
}

/// A lab registry reservation as a server shows it (never its token).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservedFor {
    /// `user@host`.
    pub holder: String,
    /// What holds it: `usbwire attach` or `usbwire reserve`.
    #[serde(default)]
    pub client: String,
    /// RFC 3339.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_at: Option<String>,
    /// RFC 3339: when it ends by itself, if it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_at: Option<String>,
}

/// A device the server exported and withdrew lately: what an import of its
/// bus id is refused for (`NODEV`) when it is not exported again.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WithdrawnDevice {
    pub busid: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub vendor_id: String,
    #[serde(default)]
    pub product_id: String,
    /// `unbound` (the server stopped exporting it) or `unplugged` (it left its port).
    pub why: String,
    /// RFC 3339: when.
    pub at: String,
}

/// The whole `OP_REP_DEVSTATE` document.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStateDocument {
    pub devices: Vec<DeviceStateEntry>,
    /// Devices withdrawn lately and not exported again, newest first (servers
    /// before it was sent leave it out).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub withdrawn: Vec<WithdrawnDevice>,
    /// The server shows its devices to TLS clients only (it has TLS and no
    /// rule names `plain`), so this plain client sees none: a client tells
    /// its user to add `--tls` rather than show an empty list. Sent only
    /// when true, and only to plain clients.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tls_required: bool,
}

impl From<&DeviceStateEntry> for DeviceJson {
    /// The record of a device this document describes. In use with its
    /// connection lost is the state `resuming` (the document says `in_use`
    /// with `resuming_since`, which older clients read).
    fn from(entry: &DeviceStateEntry) -> Self {
        let state = match entry.state.as_str() {
            "in_use" if entry.resuming_since.is_some() => "resuming",
            other => other,
        };
        Self {
            busid: entry.busid.clone(),
            kind: known(&entry.kind),
            vendor_id: entry.vendor_id.clone(),
            product_id: entry.product_id.clone(),
            bcd_device: entry.bcd_device.clone(),
            device_class: entry.device_class.clone(),
            speed: entry.speed.clone(),
            manufacturer: known(&entry.manufacturer),
            product: known(&entry.product),
            serial: known(&entry.serial),
            vendor_name: None,
            product_name: None,
            interfaces: entry
                .interfaces
                .iter()
                .zip(0u8..)
                .map(|(class, number)| InterfaceJson { number, class: class.clone(), ..InterfaceJson::default() })
                .collect(),
            state: known(state),
            holder: entry.identity.clone().or_else(|| entry.client.clone()),
            client: entry.client.clone(),
            identity: entry.identity.clone(),
            since_at: entry.since_at.clone(),
            since: entry.since,
            resuming_since_at: entry.resuming_since_at.clone(),
            resuming_since: entry.resuming_since,
        }
    }
}

/// A device's record, its traffic counters and its lab registry reservation:
/// each device of `state --json` and `/status.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountedDevice {
    #[serde(flatten)]
    pub device: DeviceJson,
    /// `null` where the source keeps none.
    #[serde(default)]
    pub counters: Option<DeviceCounters>,
    /// Reserved in the lab registry (what the server enforces), else `null`.
    #[serde(default)]
    pub reservation: Option<ShownReservation>,
}

impl From<&DeviceStateEntry> for CountedDevice {
    fn from(entry: &DeviceStateEntry) -> Self {
        Self {
            device: DeviceJson::from(entry),
            counters: entry.counters.clone(),
            reservation: entry.reservation.as_ref().map(ShownReservation::from),
        }
    }
}

/// A reservation as `list -r --json`, `state --json` and `/status.json` show
/// it beside a device record: the fields of `list --registry`'s `reservation`
/// that a server knows (not the holder's pid), every one present (`null` when
/// not known) so scripts read one shape.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShownReservation {
    pub holder: String,
    pub client: String,
    pub since_at: Option<String>,
    pub until_at: Option<String>,
}

impl From<&ReservedFor> for ShownReservation {
    fn from(reservation: &ReservedFor) -> Self {
        Self {
            holder: reservation.holder.clone(),
            client: reservation.client.clone(),
            since_at: reservation.since_at.clone(),
            until_at: reservation.until_at.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_from_an_older_server_reads_with_defaults_and_round_trips() {
        let old = r#"{"busid":"1-1","vendor_id":"1d6b","product_id":"0104","state":"available"}"#;
        let entry: DeviceStateEntry = serde_json::from_str(old).unwrap();
        assert_eq!(entry.busid, "1-1");
        assert_eq!(entry.resuming_since, None);
        let again: DeviceStateEntry = serde_json::from_str(&serde_json::to_string(&entry).unwrap()).unwrap();
        assert_eq!(again, entry);
        let text = serde_json::to_string(&DeviceStateEntry { resuming_since: Some(5), ..entry }).unwrap();
        assert!(text.contains(r#""resuming_since":5"#) && !text.contains("identity"), "{text}");
    }

    #[test]
    fn an_entry_becomes_the_device_record_with_its_holder_and_state() {
        let entry = DeviceStateEntry {
            busid: "2-1".into(),
            kind: "disk".into(),
            vendor_id: "1209".into(),
            product_id: "0003".into(),
            product: "usbwire disk".into(),
            speed: "super".into(),
            interfaces: vec!["08/06/50".into()],
            state: "in_use".into(),
            client: Some("10.0.0.9:4000".into()),
            identity: Some("sha256:ab".into()),
            since: Some(60),
            resuming_since: Some(120),
            ..DeviceStateEntry::default()
        };
        let device = DeviceJson::from(&entry);
        assert_eq!(device.state.as_deref(), Some("resuming"));
        assert_eq!(device.holder.as_deref(), Some("sha256:ab"));
        assert_eq!(device.product.as_deref(), Some("usbwire disk"));
        assert_eq!(device.manufacturer, None, "an empty string is not known");
        assert_eq!(device.interfaces[0].class, "08/06/50");
        let counted = serde_json::to_value(CountedDevice::from(&entry)).unwrap();
        assert_eq!(counted["busid"], "2-1");
        assert!(counted["counters"].is_null() && counted["vendor_name"].is_null(), "{counted}");
        assert!(counted["reservation"].is_null(), "a device nobody reserved: {counted}");
    }

    #[test]
    fn a_reserved_device_shows_its_reservation_with_every_field() {
        let entry = DeviceStateEntry {
            busid: "1-1".into(),
            vendor_id: "1d6b".into(),
            product_id: "0104".into(),
            reservation: Some(ReservedFor {
                holder: "ada@lab".into(),
                client: "usbwire reserve".into(),
                since_at: Some("2026-11-26T03:00:00Z".into()),
                until_at: None,
            }),
            ..DeviceStateEntry::default()
        };
        let counted = serde_json::to_value(CountedDevice::from(&entry)).unwrap();
        let reservation = &counted["reservation"];
        assert_eq!(reservation["holder"], "ada@lab");
        assert_eq!(reservation["client"], "usbwire reserve");
        assert_eq!(reservation["since_at"], "2026-11-26T03:00:00Z");
        assert!(reservation.get("until_at").is_some_and(|v| v.is_null()), "{reservation}");
    }
}
