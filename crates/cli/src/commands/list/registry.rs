//! `usbwire list --registry URL [--device SELECTOR] [--json | --json-lines]
//! [--watch]`: the lab registry's fleet, printed as it is read, then with
//! `--watch` every change from the revision it was read at.
//!
//! The whole fleet is read a page at a time at one revision
//! (`Lab::fleet_pages`) and each page printed as it arrives, in one of three
//! shapes ([`Shape`]): the table, each server's line before its devices and
//! the counts last; the `--json` document (docs/json.md), the same bytes a
//! document built whole would print, its devices written as they come and its
//! servers after them; `--json-lines`, one object a line. A `--device` list
//! reads only what the selector's index points at (`Lab::fleet_matching`) and
//! prints it in the same shapes. Not for a server's own list (`list -r`).

use std::collections::HashMap;

use anyhow::anyhow;
use serde::Serialize;
use serde_json::Value;
use usbwire_device::record::JSON_SCHEMA_VERSION;
use usbwire_lab::{Fleet, FleetChange, FleetDevice, Lab, Listed, ServerEntry, Want};
use usbwire_proto::display::escape;

use crate::args::RegistryArgs;
use crate::commands::common::output::{json_text, print_json, terminal_safe_json};
use crate::commands::common::registry::{failure, required, want};
use crate::commands::common::stdout::{outln, write_bytes};
use crate::exit::Failure;

/// How the fleet is printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// For people: a line per server, its devices under it, the counts last.
    Table,
    /// `--json`: one document, indented (on one line with `--watch`, the changes each on a line after it).
    Document,
    /// `--json-lines`: `{"what":"fleet","revision":…}`, then a `server` or
    /// `device` object a line (the document's records, each server before
    /// its devices), then `{"what":"listed",…}` with the counts; with
    /// `--watch` the changes after.
    Lines,
}

/// Lists the fleet (see the module docs), then follows it with `watch`.
pub(crate) async fn list(args: &RegistryArgs, device: Option<&str>, shape: Shape, watch: bool) -> Result<(), Failure> {
    let want = device.map(want).transpose()?;
    let mut lab = Lab::connect(required(args)?).await.map_err(failure)?;
    let mut printer = Printer::new(shape, watch, lab.endpoint().url.to_string());
    let (revision, listed) = match &want {
        Some(want) => {
            let fleet = lab.fleet_matching(want).await.map_err(failure)?;
            printer.fleet(&fleet)?;
            (fleet.revision, Some(fleet))
        }
        None => (read(&mut lab, &mut printer).await?, None),
    };
    if !watch {
        return Ok(());
    }
    let json = shape != Shape::Table;
    follow(&mut lab, revision, want.as_ref().zip(listed.as_ref()), json).await
}

/// Prints the fleet a page at a time; its revision.
async fn read(lab: &mut Lab, printer: &mut Printer) -> Result<i64, Failure> {
    let mut pages = lab.fleet_pages().await.map_err(failure)?;
    printer.begin(pages.revision());
    while let Some(page) = pages.next_page().await.map_err(failure)? {
        for listed in &page {
            match listed {
                Listed::Server(server) => printer.server(server),
                Listed::Device { device, .. } => printer.device(device),
            }
        }
        printer.flush()?;
    }
    printer.end();
    printer.flush()?;
    Ok(pages.revision())
}

/// Prints the changes after `revision`, until stopped: those about what a
/// filtered list (`filter`: its selector and what it listed) shows, or all.
async fn follow(lab: &mut Lab, revision: i64, filter: Option<(&Want, &Fleet)>, json: bool) -> Result<(), Failure> {
    let mut changes = lab.watch(revision).await.map_err(failure)?;
    let stop = crate::commands::common::process::shutdown_signal();
    tokio::pin!(stop);
    loop {
        let next = tokio::select! {
            next = changes.next() => next.map_err(failure)?,
            () = &mut stop => return Ok(()),
        };
        let Some(batch) = next else {
            return Err(Failure::unavailable(anyhow!("the lab registry ended the watch; run the command again")));
        };
        let shown = batch.into_iter().filter(|change| filter.is_none_or(|(want, fleet)| concerns(change, want, fleet)));
        for change in shown {
            if json {
                print_json(&change, false)?;
            } else {
                let what = match &change.busid {
                    Some(busid) => format!("{} {} {}", change.what, escape(&change.server), escape(busid)),
                    None => format!("{} {}", change.what, escape(&change.server)),
                };
                match &change.entry {
                    None => outln!("- {what} removed")?,
                    Some(entry) => outln!("+ {what}: {}", summary(entry))?,
                }
            }
        }
    }
}

/// Writes the fleet in its [`Shape`] as it comes: [`Printer::begin`], each
/// server and device, [`Printer::end`]; what is written waits in `text` until
/// [`Printer::flush`] (once a page).
struct Printer {
    shape: Shape,
    /// `--json --watch`: the document on one line, as the changes after it.
    one_line: bool,
    url: String,
    revision: i64,
    /// The document's servers, written after its devices.
    servers: Vec<ServerEntry>,
    server_count: usize,
    devices: usize,
    free: usize,
    text: String,
}

impl Printer {
    fn new(shape: Shape, watch: bool, url: String) -> Self {
        Self {
            shape,
            one_line: watch,
            url,
            revision: 0,
            servers: Vec::new(),
            server_count: 0,
            devices: 0,
            free: 0,
            text: String::new(),
        }
    }

    /// A fleet read whole (a filtered list): the table under each server its
    /// devices, the others every server, then the devices in the fleet's order.
    fn fleet(&mut self, fleet: &Fleet) -> Result<(), Failure> {
        self.write_fleet(fleet);
        self.flush()
    }

    /// [`Printer::fleet`] up to the flush.
    fn write_fleet(&mut self, fleet: &Fleet) {
        self.begin(fleet.revision);
        let mut by_server: HashMap<&str, Vec<&FleetDevice>> = HashMap::new();
        if self.shape == Shape::Table {
            for device in &fleet.devices {
                by_server.entry(device.device.server.as_str()).or_default().push(device);
            }
        }
        for server in &fleet.servers {
            self.server(server);
            for device in by_server.get(server.address.as_str()).into_iter().flatten() {
                self.device(device);
            }
        }
        if self.shape != Shape::Table {
            fleet.devices.iter().for_each(|d| self.device(d));
        }
        self.end();
    }

    fn begin(&mut self, revision: i64) {
        self.revision = revision;
        match self.shape {
            Shape::Table => {}
            Shape::Document if self.one_line => self.text.push_str("{\"devices\":["),
            Shape::Document => self.text.push_str("{\n  \"devices\": ["),
            Shape::Lines => self.line("fleet", &serde_json::json!({ "revision": revision })),
        }
    }

    fn server(&mut self, server: &ServerEntry) {
        self.server_count += 1;
        match self.shape {
            Shape::Table => {
                let security = match (&server.tls_fingerprint, server.plain) {
                    (Some(fingerprint), true) => format!("TLS {}, plain too", escape(fingerprint)),
                    (Some(fingerprint), false) => format!("TLS only, {}", escape(fingerprint)),
                    (None, _) => "plain".to_owned(),
                };
                self.text.push_str(&format!(
                    "{}  {} {} ({security})\n",
                    escape(&server.address),
                    escape(&server.implementation),
                    escape(&server.version)
                ));
            }
            Shape::Document => self.servers.push(server.clone()),
            Shape::Lines => self.line("server", server),
        }
    }

    fn device(&mut self, device: &FleetDevice) {
        self.devices += 1;
        self.free += usize::from(device.is_free());
        match self.shape {
            Shape::Table => self.text.push_str(&format!("    {}\n", device_line(device))),
            Shape::Document => {
                let separator = if self.devices == 1 { "" } else { "," };
                let value = serde_json::to_value(device).unwrap_or(Value::Null);
                let item = if self.one_line {
                    serde_json::to_string(&value).unwrap_or_default()
                } else {
                    format!("\n{}", indented(&serde_json::to_string_pretty(&value).unwrap_or_default(), "    "))
                };
                self.text.push_str(separator);
                self.text.push_str(&terminal_safe_json(item));
            }
            Shape::Lines => self.line("device", device),
        }
    }

    fn end(&mut self) {
        let (servers, devices, free) = (self.server_count, self.devices, self.free);
        match self.shape {
            Shape::Table => self.text.push_str(&format!(
                "lab registry {}: {servers} server(s), {devices} device(s), {free} free\n",
                self.url
            )),
            Shape::Document => {
                let servers = serde_json::to_value(&self.servers).unwrap_or(Value::Null);
                let tail = if self.one_line {
                    format!(
                        "],\"revision\":{},\"schema_version\":{JSON_SCHEMA_VERSION},\"servers\":{}}}",
                        self.revision,
                        serde_json::to_string(&servers).unwrap_or_default()
                    )
                } else {
                    let close = if devices == 0 { "]" } else { "\n  ]" };
                    let servers = serde_json::to_string_pretty(&servers).unwrap_or_default();
                    let servers = indented(&servers, "  ");
                    format!(
                        "{close},\n  \"revision\": {},\n  \"schema_version\": {JSON_SCHEMA_VERSION},\n  \"servers\": {}\n}}",
                        self.revision,
                        servers.trim_start()
                    )
                };
                self.text.push_str(&terminal_safe_json(tail));
                self.text.push('\n');
            }
            Shape::Lines => {
                let counts = serde_json::json!({
                    "revision": self.revision, "servers": servers, "devices": devices, "free": free,
                });
                self.line("listed", &counts);
            }
        }
    }

    /// A `--json-lines` object: `value`'s fields with `what`. The first and
    /// last lines carry the document's `schema_version`, as `--json`'s top
    /// does; a server or device keeps its record's, as in the document.
    fn line(&mut self, what: &str, value: &impl Serialize) {
        let mut value = serde_json::to_value(value).unwrap_or(Value::Null);
        if let Some(object) = value.as_object_mut() {
            object.insert("what".into(), what.into());
        }
        let text = match what {
            "fleet" | "listed" => json_text(&value, false),
            _ => terminal_safe_json(serde_json::to_string(&value).unwrap_or_default()),
        };
        self.text.push_str(&text);
        self.text.push('\n');
    }

    /// Prints what was written since the last flush.
    fn flush(&mut self) -> Result<(), Failure> {
        if self.text.is_empty() {
            return Ok(());
        }
        let written = write_bytes(self.text.as_bytes());
        self.text.clear();
        written
    }
}

/// `text` with `indent` before each line: pretty JSON nested that deep
/// (inside a JSON string a line break is `\n`, so every line is structure).
fn indented(text: &str, indent: &str) -> String {
    let mut out = String::with_capacity(text.len() + text.len() / 8);
    for (n, line) in text.lines().enumerate() {
        if n > 0 {
            out.push('\n');
        }
        out.push_str(indent);
        out.push_str(line);
    }
    out
}

/// Whether a change is about what a filtered list shows: a device it listed
/// (or its reservation, or its server), or a device entry that matches.
fn concerns(change: &FleetChange, want: &Want, listed: &Fleet) -> bool {
    let listed_here =
        |busid: &str| listed.devices.iter().any(|d| d.device.server == change.server && d.device.record.busid == busid);
    match &change.busid {
        None => listed.servers.iter().any(|server| server.address == change.server),
        Some(busid) if listed_here(busid) => true,
        Some(_) => change
            .entry
            .as_ref()
            .and_then(|entry| serde_json::from_value::<usbwire_lab::DeviceEntry>(entry.clone()).ok())
            .is_some_and(|device| change.what == "device" && want.matches(&device)),
    }
}

/// One line about a changed record.
fn summary(entry: &Value) -> String {
    let field = |name: &str| entry.get(name).and_then(Value::as_str).map(|s| escape(s).to_string());
    if let Some(state) = field("state") {
        let mut line = state;
        if let Some(holder) = field("holder") {
            line.push_str(&format!(" by {holder}"));
        }
        return line;
    }
    if let Some(holder) = field("holder") {
        let until = field("until_at").map(|u| format!(" until {u}")).unwrap_or_default();
        return format!("reserved by {holder}{until}");
    }
    match field("implementation") {
        Some(implementation) => format!("{implementation} {}", field("version").unwrap_or_default()),
        None => "changed".to_owned(),
    }
}

fn device_line(device: &FleetDevice) -> String {
    let entry = &device.device;
    let name = entry.name();
    let mut line = format!(
        "{:<6} {}:{}  {:<22} {:<6} {}",
        escape(&entry.record.busid),
        escape(&entry.record.vendor_id),
        escape(&entry.record.product_id),
        escape(name),
        escape(&entry.record.speed),
        escape(entry.state()).to_string().replace('_', " ")
    );
    if let Some(holder) = &entry.record.holder {
        line.push_str(&format!(" by {}", escape(holder)));
    }
    if let Some(reservation) = &device.reservation {
        line.push_str(&format!("; reserved by {} ({})", escape(&reservation.holder), escape(&reservation.client)));
        if let Some(until) = &reservation.until_at {
            line.push_str(&format!(" until {}", escape(until)));
        }
    }
    if !entry.labels.is_empty() {
        let labels: Vec<String> = entry.labels.iter().map(|l| escape(l).to_string()).collect();
        line.push_str(&format!("  [{}]", labels.join(", ")));
    }
    line
}

#[cfg(test)]
mod tests;
