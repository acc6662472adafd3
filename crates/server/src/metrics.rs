//! What the server counts, and how it reads as Prometheus text ([`render`],
//! served by [`crate::http`] as `/metrics`) and as the `counters` of each
//! device in `state --json` / `OP_REP_DEVSTATE`.
//!
//! Each exported device has a [`DeviceMeter`] (atomics, shared by whoever
//! imports it); a URB channel counts through an [`UrbMeter`], which remembers
//! each URB's direction and transfer type from its submit until its
//! completion. The server as a whole has a [`ServerMeter`]. Counting never
//! takes a lock on the URB path except for an error status, which is rare.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use usbwire_device::TransferType;
use usbwire_proto::sync::lock;
use usbwire_proto::{BudgetKind, Direction, Status};
use usbwire_transport::devstate::{BudgetCounter, DeviceCounters, ErrorCounter, TransferCounter};

use crate::registry::{DeviceState, ExportInfo};
use crate::state::ServerState;

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

    pub(crate) fn snapshot(&self) -> DeviceCounters {
        let mut transfers = Vec::new();
        for (d, (_, direction)) in DIRECTIONS.iter().enumerate() {
            for (t, (_, transfer)) in TRANSFERS.iter().enumerate() {
                let urbs = self.urbs[d][t].load(Relaxed);
                if urbs > 0 {
                    transfers.push(TransferCounter {
                        direction: (*direction).to_owned(),
                        transfer: (*transfer).to_owned(),
                        urbs,
                        bytes: self.bytes[d][t].load(Relaxed),
                    });
                }
            }
        }
        let errors = lock(&self.errors)
            .iter()
            .map(|(&status, &urbs)| ErrorCounter { status, name: status_symbol(status), urbs })
            .collect();
        let budget_refusals = BudgetKind::ALL
            .iter()
            .zip(&self.budget_refusals)
            .map(|(kind, times)| (kind, times.load(Relaxed)))
            .filter(|(_, times)| *times > 0)
            .map(|(kind, times)| BudgetCounter { budget: kind.name().to_owned(), times })
            .collect();
        DeviceCounters {
            transfers,
            errors,
            in_flight: self.in_flight.load(Relaxed),
            imports: self.imports.load(Relaxed),
            resumes: self.resumes.load(Relaxed),
            budget_refusals,
        }
    }
}

/// `EPIPE` for -32: the errno's symbol, or the number.
fn status_symbol(status: i32) -> String {
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
}

/// Counts a connection as open while it lives.
pub(crate) struct OpenConnection(Arc<ServerMeter>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
    }
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn device_labels(e: &ExportInfo) -> String {
    format!("busid=\"{}\",kind=\"{}\"", label(e.record.busid.as_str()), label(&e.kind))
}

/// A counter family with one sample per device, direction and transfer type.
fn per_transfer(
    out: &mut String,
    devices: &[ExportInfo],
    name: &str,
    help: &str,
    counts: impl Fn(&DeviceMeter) -> &PerTransfer,
) {
    family(out, name, "counter", help);
    for e in devices {
        let counts = counts(&e.meter);
        for (d, (_, direction)) in DIRECTIONS.iter().enumerate() {
            for (t, (_, transfer)) in TRANSFERS.iter().enumerate() {
                let value = counts[d][t].load(Relaxed);
                let _ = writeln!(
                    out,
                    "{name}{{{},direction=\"{direction}\",transfer=\"{transfer}\"}} {value}",
                    device_labels(e)
                );
            }
        }
    }
}

/// Everything in the Prometheus text format (version 0.0.4).
pub(crate) fn render(state: &ServerState) -> String {
    let devices = state.registry.list();
    let mut out = String::new();

    per_transfer(
        &mut out,
        &devices,
        "usbwire_device_urbs_total",
        "URBs completed, by direction and transfer type.",
        |m| &m.urbs,
    );
    per_transfer(
        &mut out,
        &devices,
        "usbwire_device_bytes_total",
        "Bytes transferred (actual length of each completion), by direction and transfer type.",
        |m| &m.bytes,
    );
    family(&mut out, "usbwire_device_urb_errors_total", "counter", "URBs completed with an error, by status.");
    for e in &devices {
        let meter = &e.meter;
        for (status, urbs) in lock(&meter.errors).iter() {
            let _ = writeln!(
                out,
                "usbwire_device_urb_errors_total{{{},status=\"{status}\",name=\"{}\"}} {urbs}",
                device_labels(e),
                status_symbol(*status)
            );
        }
    }
    family(&mut out, "usbwire_device_urbs_in_flight", "gauge", "URBs submitted to the device and not completed.");
    for e in &devices {
        let meter = &e.meter;
        let _ =
            writeln!(out, "usbwire_device_urbs_in_flight{{{}}} {}", device_labels(e), meter.in_flight.load(Relaxed));
    }
    family(&mut out, "usbwire_device_imports_total", "counter", "Successful imports.");
    for e in &devices {
        let meter = &e.meter;
        let _ = writeln!(out, "usbwire_device_imports_total{{{}}} {}", device_labels(e), meter.imports.load(Relaxed));
    }
    family(&mut out, "usbwire_device_resumes_total", "counter", "Sessions resumed after their connection dropped.");
    for e in &devices {
        let meter = &e.meter;
        let _ = writeln!(out, "usbwire_device_resumes_total{{{}}} {}", device_labels(e), meter.resumes.load(Relaxed));
    }
    family(
        &mut out,
        "usbwire_device_budget_refusals_total",
        "counter",
        "Times a per-connection budget ([limits]) was full and the server refused more until there was room: \
         it stopped reading the client's commands, or taking the device's completions. By budget.",
    );
    for e in &devices {
        for (kind, times) in BudgetKind::ALL.iter().zip(&e.meter.budget_refusals) {
            let _ = writeln!(
                out,
                "usbwire_device_budget_refusals_total{{{},budget=\"{}\"}} {}",
                device_labels(e),
                kind.name(),
                times.load(Relaxed)
            );
        }
    }
    family(
        &mut out,
        "usbwire_device_in_use",
        "gauge",
        "1 while imported (client: its address; identity: its TLS key; resuming: its connection dropped), else 0.",
    );
    for e in &devices {
        match &e.state {
            DeviceState::Available => {
                let _ = writeln!(out, "usbwire_device_in_use{{{}}} 0", device_labels(e));
            }
            DeviceState::InUse { client, identity, resuming_since, .. } => {
                let _ = writeln!(
                    out,
                    "usbwire_device_in_use{{{},client=\"{}\",identity=\"{}\",resuming=\"{}\"}} 1",
                    device_labels(e),
                    label(&client.to_string()),
                    label(identity.as_deref().unwrap_or("")),
                    resuming_since.is_some()
                );
            }
        }
    }
    let server = &state.meter;
    family(&mut out, "usbwire_connections_accepted_total", "counter", "TCP connections accepted past admission.");
    let _ = writeln!(out, "usbwire_connections_accepted_total {}", server.accepted.load(Relaxed));
    family(&mut out, "usbwire_connections_open", "gauge", "Connections open now (OP phase or URB channel).");
    let _ = writeln!(out, "usbwire_connections_open {}", server.open.load(Relaxed));
    family(
        &mut out,
        "usbwire_connections_refused_total",
        "counter",
        "Connections refused or closed before they authenticated, by reason.",
    );
    let dropped = state.gate.dropped_totals();
    for (reason, count) in dropped {
        let _ = writeln!(out, "usbwire_connections_refused_total{{reason=\"{reason}\"}} {count}");
    }
    family(
        &mut out,
        "usbwire_tls_handshakes_refused_total",
        "counter",
        "TLS handshakes that failed or whose client key no rule admits.",
    );
    let _ = writeln!(out, "usbwire_tls_handshakes_refused_total {}", server.tls_refused.load(Relaxed));
    out
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

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
