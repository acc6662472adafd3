//! What the server counts, and how it reads as the `counters` of each
//! device in `state --json` / `OP_REP_DEVSTATE`.
//!
//! Each exported device has a [`DeviceMeter`] (atomics, shared by whoever
//! imports it); a URB channel counts through an [`UrbMeter`], which remembers
//! each URB's direction and transfer type from its submit until its
//! completion. The server as a whole has a [`ServerMeter`]. Counting never
//! takes a lock on the URB path except for an error status, which is rare.
//!
//! It imports nothing of the server: the registry keeps a [`DeviceMeter`]
//! per export, the URB channel counts into it, and the HTTP side
//! (`http/prometheus.rs`) reads it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use usbwire_device::counters::{BudgetCounter, DeviceCounters, ErrorCounter, TransferCounter};
use usbwire_device::sync::lock;
use usbwire_device::TransferType;
use usbwire_proto::{BudgetKind, Direction, Status};

const DIRECTIONS: [(Direction, &str); 2] = [(Direction::In, "in"), (Direction::Out, "out")];
const TRANSFERS: [(TransferType, &str); 4] = [
    (TransferType::Control, "control"),
    (TransferType::Isochronous, "isochronous"),
    (TransferType::Bulk, "bulk"),
    (TransferType::Interrupt, "interrupt"),
];
fn direction_index(direction: Direction) -> usize {
    DIRECTIONS.iter().position(|(d, _)| *d == direction).unwrap_or(0)
}

fn transfer_index(transfer: TransferType) -> usize {
    TRANSFERS.iter().position(|(t, _)| *t == transfer).unwrap_or(0)
}

/// A count per [direction][transfer type].
type PerTransfer = [[AtomicU64; 4]; 2];

/// One device's counters since the server started.
#[derive(Debug, Default)]
pub(crate) struct DeviceMeter {
    urbs: PerTransfer,
    bytes: PerTransfer,
    errors: Mutex<BTreeMap<i32, u64>>,
    in_flight: AtomicU64,
    imports: AtomicU64,
    resumes: AtomicU64,
    /// Per [`BudgetKind::ALL`]: times that budget became full.
    budget_refusals: [AtomicU64; 4],
}

impl DeviceMeter {
    pub(crate) fn imported(&self) {
        self.imports.fetch_add(1, Relaxed);
    }

    pub(crate) fn resumed(&self) {
        self.resumes.fetch_add(1, Relaxed);
    }

    /// What `state --json` and `OP_REP_DEVSTATE` show: only what happened (no zero counts).
    pub(crate) fn snapshot(&self) -> DeviceCounters {
        let transfers = self
            .transfer_totals()
            .into_iter()
            .filter(|totals| totals.urbs > 0)
            .map(|totals| TransferCounter {
                direction: totals.direction.to_owned(),
                transfer: totals.transfer.to_owned(),
                urbs: totals.urbs,
                bytes: totals.bytes,
            })
            .collect();
        let errors = self
            .error_totals()
            .into_iter()
            .map(|(status, urbs)| ErrorCounter { status, name: status_symbol(status), urbs })
            .collect();
        let budget_refusals = self
            .budget_refusal_totals()
            .into_iter()
            .filter(|(_, times)| *times > 0)
            .map(|(kind, times)| BudgetCounter { budget: kind.name().to_owned(), times })
            .collect();
        DeviceCounters {
            transfers,
            errors,
            in_flight: self.in_flight(),
            imports: self.imports(),
            resumes: self.resumes(),
            budget_refusals,
        }
    }

    /// URBs and bytes completed for every direction and transfer type, zeros
    /// included, always in the same order (in, out; control, isochronous, bulk, interrupt).
    pub(crate) fn transfer_totals(&self) -> Vec<TransferTotals> {
        let mut totals = Vec::with_capacity(DIRECTIONS.len() * TRANSFERS.len());
        for (d, (_, direction)) in DIRECTIONS.iter().enumerate() {
            for (t, (_, transfer)) in TRANSFERS.iter().enumerate() {
                totals.push(TransferTotals {
                    direction,
                    transfer,
                    urbs: self.urbs[d][t].load(Relaxed),
                    bytes: self.bytes[d][t].load(Relaxed),
                });
            }
        }
        totals
    }

    /// URBs completed with an error status, by status (lowest first).
    pub(crate) fn error_totals(&self) -> Vec<(i32, u64)> {
        lock(&self.errors).iter().map(|(&status, &urbs)| (status, urbs)).collect()
    }

    /// URBs submitted to the device and not completed.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Relaxed)
    }

    /// Successful imports.
    pub(crate) fn imports(&self) -> u64 {
        self.imports.load(Relaxed)
    }

    /// Sessions resumed after their connection dropped.
    pub(crate) fn resumes(&self) -> u64 {
        self.resumes.load(Relaxed)
    }

    /// Times each budget (every kind, in [`BudgetKind::ALL`]'s order) became full.
    pub(crate) fn budget_refusal_totals(&self) -> Vec<(BudgetKind, u64)> {
        BudgetKind::ALL.iter().zip(&self.budget_refusals).map(|(kind, times)| (*kind, times.load(Relaxed))).collect()
    }
}

/// One direction and transfer type's completed URBs and their bytes.
pub(crate) struct TransferTotals {
    /// `in` or `out`.
    pub(crate) direction: &'static str,
    /// `control`, `isochronous`, `bulk` or `interrupt`.
    pub(crate) transfer: &'static str,
    pub(crate) urbs: u64,
    pub(crate) bytes: u64,
}

/// `EPIPE` for -32: the errno's symbol, or the number.
pub(crate) fn status_symbol(status: i32) -> String {
    let text = Status(status).to_string();
    text.split_whitespace().next().unwrap_or_default().to_owned()
}

/// Counts one URB channel's traffic into its device's meter. URBs still in
/// flight when it is dropped (the connection ended) leave the in-flight gauge.
pub(crate) struct UrbMeter {
    device: Arc<DeviceMeter>,
    /// seqnum → (direction index, transfer index) of each URB in flight.
    in_flight: HashMap<u32, (usize, usize)>,
    /// The budgets holding the session back at the last look (input, completions).
    held: (Option<BudgetKind>, Option<BudgetKind>),
}

impl UrbMeter {
    pub(crate) fn new(device: Arc<DeviceMeter>) -> Self {
        Self { device, in_flight: HashMap::new(), held: (None, None) }
    }

    /// What holds the session back now (its reading of the client's
    /// commands, its taking of the device's completions); counts each budget
    /// when it becomes full.
    pub(crate) fn held(&mut self, input: Option<BudgetKind>, completions: Option<BudgetKind>) {
        if (input, completions) == self.held {
            return;
        }
        for (now, before) in [(input, self.held.0), (completions, self.held.1)] {
            if let Some(kind) = now.filter(|kind| Some(*kind) != before) {
                self.device.budget_refusals[kind as usize].fetch_add(1, Relaxed);
            }
        }
        self.held = (input, completions);
    }

    pub(crate) fn device(&self) -> &DeviceMeter {
        &self.device
    }

    pub(crate) fn submitted(&mut self, seqnum: u32, direction: Direction, transfer: TransferType) {
        if self.in_flight.insert(seqnum, (direction_index(direction), transfer_index(transfer))).is_none() {
            self.device.in_flight.fetch_add(1, Relaxed);
        }
    }

    pub(crate) fn completed(&mut self, seqnum: u32, status: Status, actual_length: u32) {
        let Some((d, t)) = self.in_flight.remove(&seqnum) else { return };
        self.device.in_flight.fetch_sub(1, Relaxed);
        self.device.urbs[d][t].fetch_add(1, Relaxed);
        self.device.bytes[d][t].fetch_add(u64::from(actual_length), Relaxed);
        if !status.is_ok() {
            *lock(&self.device.errors).entry(status.0).or_default() += 1;
        }
    }
}

impl Drop for UrbMeter {
    fn drop(&mut self) {
        self.device.in_flight.fetch_sub(self.in_flight.len() as u64, Relaxed);
    }
}

/// The server's own counters.
#[derive(Default)]
pub(crate) struct ServerMeter {
    accepted: AtomicU64,
    open: AtomicU64,
    tls_refused: AtomicU64,
}

impl ServerMeter {
    /// A connection was accepted; the guard counts it open until dropped.
    pub(crate) fn connection(self: &Arc<Self>) -> OpenConnection {
        self.accepted.fetch_add(1, Relaxed);
        self.open.fetch_add(1, Relaxed);
        OpenConnection(self.clone())
    }

    pub(crate) fn tls_refused(&self) {
        self.tls_refused.fetch_add(1, Relaxed);
    }

    /// TCP connections accepted past admission since the start.
    pub(crate) fn accepted(&self) -> u64 {
        self.accepted.load(Relaxed)
    }

    /// Connections open now.
    pub(crate) fn open(&self) -> u64 {
        self.open.load(Relaxed)
    }

    /// TLS handshakes that failed or were refused since the start.
    pub(crate) fn tls_refusals(&self) -> u64 {
        self.tls_refused.load(Relaxed)
    }
}

/// Counts a connection as open while it lives.
pub(crate) struct OpenConnection(Arc<ServerMeter>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_count_by_the_submits_direction_and_type_and_in_flight_leaves_with_the_channel() {
        let device = Arc::new(DeviceMeter::default());
        let mut meter = UrbMeter::new(device.clone());
        meter.submitted(1, Direction::Out, TransferType::Bulk);
        meter.submitted(2, Direction::In, TransferType::Bulk);
        meter.submitted(3, Direction::In, TransferType::Control);
        assert_eq!(device.snapshot().in_flight, 3);
        meter.completed(1, Status::OK, 4096);
        meter.completed(2, Status::OK, 512);
        meter.completed(2, Status::OK, 512); // a duplicate completion is not counted twice
        meter.completed(9, Status::OK, 1); // nor one never submitted
        let snapshot = device.snapshot();
        assert_eq!(snapshot.in_flight, 1);
        let find = |d: &str, t: &str| snapshot.transfers.iter().find(|c| c.direction == d && c.transfer == t).cloned();
        assert_eq!(find("out", "bulk").map(|c| (c.urbs, c.bytes)), Some((1, 4096)));
        assert_eq!(find("in", "bulk").map(|c| (c.urbs, c.bytes)), Some((1, 512)));
        assert_eq!(find("in", "control"), None, "still in flight");
        drop(meter);
        assert_eq!(device.snapshot().in_flight, 0, "the channel ended: nothing in flight any more");
    }

    #[test]
    fn errors_count_by_status_with_their_symbol() {
        let device = Arc::new(DeviceMeter::default());
        let mut meter = UrbMeter::new(device.clone());
        for seqnum in 1..=3 {
            meter.submitted(seqnum, Direction::In, TransferType::Interrupt);
        }
        meter.completed(1, Status::EPIPE, 0);
        meter.completed(2, Status::EPIPE, 0);
        meter.completed(3, Status(-5), 0);
        let errors = device.snapshot().errors;
        assert_eq!(
            errors,
            vec![
                ErrorCounter { status: -32, name: "EPIPE".into(), urbs: 2 },
                ErrorCounter { status: -5, name: "Status(-5)".into(), urbs: 1 },
            ]
        );
    }

    #[test]
    fn a_budget_counts_each_time_it_becomes_full() {
        let device = Arc::new(DeviceMeter::default());
        let mut meter = UrbMeter::new(device.clone());
        meter.held(Some(BudgetKind::InFlightUrbs), None);
        meter.held(Some(BudgetKind::InFlightUrbs), None);
        meter.held(None, None);
        meter.held(Some(BudgetKind::InFlightUrbs), Some(BudgetKind::QueuedReplyBytes));
        meter.held(Some(BudgetKind::QueuedReplyBytes), Some(BudgetKind::QueuedReplyBytes));
        let counted: Vec<(String, u64)> =
            device.snapshot().budget_refusals.into_iter().map(|c| (c.budget, c.times)).collect();
        assert_eq!(
            counted,
            [("in_flight_urbs".to_owned(), 2), ("queued_reply_bytes".to_owned(), 2)],
            "full twice each: input by URBs, then by replies; completions by replies once"
        );
    }
}
