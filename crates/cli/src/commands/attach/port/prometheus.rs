//! `usbwire port --prometheus`: each relayed port's relay state and storage
//! accelerator counters (from the relay's status file) in the Prometheus text
//! format (version 0.0.4), for node_exporter's textfile collector. A client
//! has no listener: this prints a snapshot, and whoever runs it decides where
//! it goes. Not for the server's metrics (`/metrics`, `usbwire_server`).

use std::fmt::Write as _;

/// A used port that a live relay serves, and what its status file says.
pub(crate) struct RelayedPort {
    pub(crate) port: u32,
    /// The device's bus id on its server.
    pub(crate) busid: String,
    pub(crate) relay: serde_json::Value,
}

/// The storage accelerator's counters: (name in the status file, metric, help).
const STORAGE: [(&str, &str, &str); 7] = [
    (
        "commands_pipelined",
        "usbwire_port_storage_commands_pipelined_total",
        "Mass-storage commands whose command block was answered at once (one round trip a command).",
    ),
    (
        "statuses_ahead",
        "usbwire_port_storage_statuses_ahead_total",
        "Command statuses answered from a status read sent ahead.",
    ),
    (
        "statuses_wasted",
        "usbwire_port_storage_statuses_wasted_total",
        "Status reads sent ahead that could not be used (a failed stage): the kernel's own went to the device.",
    ),
    ("read_ahead_hits", "usbwire_port_storage_read_ahead_hits_total", "READ commands answered from a read ahead."),
    ("bytes_read_ahead", "usbwire_port_storage_read_ahead_bytes_total", "Bytes read ahead and served."),
    (
        "bytes_wasted",
        "usbwire_port_storage_read_ahead_wasted_bytes_total",
        "Bytes read ahead and dropped (a write, a seek, an error).",
    ),
    (
        "scan_hits",
        "usbwire_port_storage_scan_ahead_hits_total",
        "Requests of the kernel's scan of a new disk (GET_MAX_LUN and SCSI commands) answered from the scan ahead.",
    ),
];

/// The metrics of `ports`; the counters only for ports whose relay runs the
/// storage accelerator.
pub(crate) fn render(ports: &[RelayedPort]) -> String {
    let mut out = String::new();
    family(
        &mut out,
        "usbwire_port_relay_connected",
        "gauge",
        "1 while the port's relay is connected to its server, 0 while it resumes.",
    );
    for port in ports {
        let connected = port.relay.get("state").and_then(serde_json::Value::as_str) == Some("connected");
        let _ = writeln!(out, "usbwire_port_relay_connected{} {}", labels(port), u8::from(connected));
    }
    for (field, metric, help) in STORAGE {
        family(&mut out, metric, "counter", help);
        for port in ports {
            let Some(storage) = port.relay.get("storage") else { continue };
            let value = storage.get(field).and_then(serde_json::Value::as_u64).unwrap_or(0);
            let _ = writeln!(out, "{metric}{} {value}", labels(port));
        }
    }
    out
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// `{port="…",server="…",busid="…"}`.
fn labels(port: &RelayedPort) -> String {
    let server = port.relay.get("server").and_then(serde_json::Value::as_str).unwrap_or("");
    format!("{{port=\"{}\",server=\"{}\",busid=\"{}\"}}", port.port, escape(server), escape(&port.busid))
}

/// A label value as the text format wants it: backslash, quote and newline escaped.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests;
