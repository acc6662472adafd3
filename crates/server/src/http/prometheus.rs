//! `/metrics`: the server's counters ([`crate::meter`]), the devices' states
//! and the admission gate's refusals in the Prometheus text format (version
//! 0.0.4). It reads; the counting is done where things happen.

use std::fmt::Write as _;

use crate::meter::{status_symbol, DeviceMeter, TransferTotals};
use crate::registry::{DeviceState, ExportInfo};
use crate::state::ServerState;

/// Everything in the Prometheus text format (version 0.0.4).
pub(crate) fn render(state: &ServerState) -> String {
    let devices = state.registry.list();
    let mut out = String::new();
    device_traffic(&mut out, &devices);
    device_sessions(&mut out, &devices);
    server_connections(&mut out, state);
    out
}

/// URBs, bytes, errors and URBs in flight, per device.
fn device_traffic(out: &mut String, devices: &[ExportInfo]) {
    per_transfer(
        out,
        devices,
        "usbwire_device_urbs_total",
        "URBs completed, by direction and transfer type.",
        |totals| totals.urbs,
    );
    per_transfer(
        out,
        devices,
        "usbwire_device_bytes_total",
        "Bytes transferred (actual length of each completion), by direction and transfer type.",
        |totals| totals.bytes,
    );
    family(out, "usbwire_device_urb_errors_total", "counter", "URBs completed with an error, by status.");
    for e in devices {
        for (status, urbs) in e.meter.error_totals() {
            let _ = writeln!(
                out,
                "usbwire_device_urb_errors_total{{{},status=\"{status}\",name=\"{}\"}} {urbs}",
                device_labels(e),
                status_symbol(status)
            );
        }
    }
    per_device(
        out,
        devices,
        ("usbwire_device_urbs_in_flight", "gauge", "URBs submitted to the device and not completed."),
        DeviceMeter::in_flight,
    );
}

/// Imports, resumes, budget refusals and who holds each device.
fn device_sessions(out: &mut String, devices: &[ExportInfo]) {
    per_device(out, devices, ("usbwire_device_imports_total", "counter", "Successful imports."), DeviceMeter::imports);
    per_device(
        out,
        devices,
        ("usbwire_device_resumes_total", "counter", "Sessions resumed after their connection dropped."),
        DeviceMeter::resumes,
    );
    family(
        out,
        "usbwire_device_budget_refusals_total",
        "counter",
        "Times a per-connection budget ([limits]) was full and the server refused more until there was room: \
         it stopped reading the client's commands, or taking the device's completions. By budget.",
    );
    for e in devices {
        for (kind, times) in e.meter.budget_refusal_totals() {
            let _ = writeln!(
                out,
                "usbwire_device_budget_refusals_total{{{},budget=\"{}\"}} {times}",
                device_labels(e),
                kind.name(),
            );
        }
    }
    family(
        out,
        "usbwire_device_in_use",
        "gauge",
        "1 while imported (client: its address; identity: its TLS key; resuming: its connection dropped), else 0.",
    );
    for e in devices {
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
}

/// Connections accepted, open and refused, and TLS handshakes refused.
fn server_connections(out: &mut String, state: &ServerState) {
    let server = &state.meter;
    family(out, "usbwire_connections_accepted_total", "counter", "TCP connections accepted past admission.");
    let _ = writeln!(out, "usbwire_connections_accepted_total {}", server.accepted());
    family(out, "usbwire_connections_open", "gauge", "Connections open now (OP phase or URB channel).");
    let _ = writeln!(out, "usbwire_connections_open {}", server.open());
    family(
        out,
        "usbwire_connections_refused_total",
        "counter",
        "Connections refused or closed before they authenticated, by reason.",
    );
    for (reason, count) in state.gate.dropped_totals() {
        let _ = writeln!(out, "usbwire_connections_refused_total{{reason=\"{reason}\"}} {count}");
    }
    family(
        out,
        "usbwire_tls_handshakes_refused_total",
        "counter",
        "TLS handshakes that failed or whose client key no rule admits.",
    );
    let _ = writeln!(out, "usbwire_tls_handshakes_refused_total {}", server.tls_refusals());
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
    value: impl Fn(&TransferTotals) -> u64,
) {
    family(out, name, "counter", help);
    for e in devices {
        for totals in e.meter.transfer_totals() {
            let (direction, transfer) = (totals.direction, totals.transfer);
            let _ = writeln!(
                out,
                "{name}{{{},direction=\"{direction}\",transfer=\"{transfer}\"}} {}",
                device_labels(e),
                value(&totals)
            );
        }
    }
}

/// A family (`name`, `kind`, `help`) with one sample per device.
fn per_device(
    out: &mut String,
    devices: &[ExportInfo],
    (name, kind, help): (&str, &str, &str),
    value: impl Fn(&DeviceMeter) -> u64,
) {
    family(out, name, kind, help);
    for e in devices {
        let _ = writeln!(out, "{name}{{{}}} {}", device_labels(e), value(&e.meter));
    }
}

#[cfg(test)]
mod tests {
    use usbwire_device::{Speed, TransferType};
    use usbwire_proto::{BudgetKind, Direction, Status};

    use super::*;
    use crate::config::ServerConfig;
    use crate::meter::UrbMeter;
    use crate::registry::Registry;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    /// The text every family renders to, for two devices (one with traffic, one
    /// whose kind needs escaping) and a server with one connection open. The
    /// golden text was written by the renderer before it left the counters'
    /// file (2026-11-26): what scrapers and dashboards read must not drift.
    #[test]
    fn the_text_matches_the_golden_file() {
        let registry = Registry::default();
        registry.add("loopback", Box::new(usbwire_gadgets::loopback(Speed::HIGH)));
        let (keyboard, _typing) = usbwire_gadgets::keyboard();
        registry.add("key\"board", Box::new(keyboard));
        let state = ServerState::new(ServerConfig::default(), registry.clone());
        let listed = registry.list();
        let mut meter = UrbMeter::new(listed[0].meter.clone());
        meter.submitted(1, Direction::In, TransferType::Bulk);
        meter.submitted(2, Direction::Out, TransferType::Control);
        meter.submitted(3, Direction::In, TransferType::Interrupt);
        meter.completed(1, Status::OK, 512);
        meter.completed(2, Status::EPIPE, 0);
        meter.held(Some(BudgetKind::InFlightUrbs), None);
        listed[0].meter.imported();
        listed[0].meter.resumed();
        let _open = state.meter.connection();
        state.meter.tls_refused();
        assert_eq!(render(&state), include_str!("prometheus_golden.txt"));
        drop(meter);
    }
}
