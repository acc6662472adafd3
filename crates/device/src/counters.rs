//! A device's traffic counters as every document shows them: the device state
//! document's `counters` ([`crate::devstate`]), `state --json` and `/status.json`.
//! The server's meter counts URBs as they complete and hands out a
//! [`DeviceCounters`] snapshot; this module holds only the shape of that
//! snapshot, so what counts and what presents the numbers share it without
//! depending on each other.
//!
//! Not for counting (the server's `meter`) or for Prometheus text (its
//! `http/prometheus`).

use serde::{Deserialize, Serialize};

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
