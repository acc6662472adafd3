//! The device state document (`OP_REP_DEVSTATE`, the control socket's
//! `state`, `list -r --json`): one entry per exported device, written by the
//! server and read by the client. Reading is lenient (fields a newer or older
//! server leaves out take defaults) so either side can be upgraded first.

use serde::{Deserialize, Serialize};

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
}

/// A device's traffic counters since the server started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceCounters {
    /// URBs completed and bytes moved, per direction and transfer type (only those seen).
    #[serde(default)]
    pub transfers: Vec<TransferCounter>,
    /// URBs completed with an error status, per status.
    #[serde(default)]
    pub errors: Vec<ErrorCounter>,
    /// URBs submitted to the device and not completed yet.
    #[serde(default)]
    pub in_flight: u64,
    /// Successful imports.
    #[serde(default)]
    pub imports: u64,
    /// Sessions resumed after a dropped connection.
    #[serde(default)]
    pub resumes: u64,
    /// Times a per-connection budget was full and the server refused more
    /// until there was room, per budget (only those that were).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budget_refusals: Vec<BudgetCounter>,
}

/// How often one budget (`in_flight_urbs`, `in_flight_bytes`,
/// `queued_reply_bytes`, `unacked_reply_bytes`) was full.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetCounter {
    pub budget: String,
    pub times: u64,
}

/// URBs and bytes for one direction (`in`, `out`) and transfer type
/// (`control`, `isochronous`, `bulk`, `interrupt`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferCounter {
    pub direction: String,
    pub transfer: String,
    pub urbs: u64,
    /// Bytes actually transferred (`actual_length` of each completion).
    pub bytes: u64,
}

/// URBs that completed with `status` (a negative Linux errno; `name` is its symbol, e.g. `EPIPE`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorCounter {
    pub status: i32,
    pub name: String,
    pub urbs: u64,
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
}
