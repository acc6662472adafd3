//! Which real (usbfs) devices this server exports: bind rules from the config
//! or `serve --bind`, `usbwire bind` / `unbind` through the control socket,
//! and hotplug — a device that arrives and matches a rule is exported at
//! once; one that leaves is withdrawn (its importer sees a clean close).
//!
//! `usbwire bind` survives a restart: the server keeps what was bound by hand
//! (`-b BUSID`, and `--device VID:PID|serial=…|class=…` rules that export every
//! matching device, now and whenever one is plugged in, like usbipd-win's
//! `bind --hardware-id`) in its bind state file, one selector per line (a
//! file that lists only bus ids, as earlier versions wrote it, reads the
//! same), rewritten whole on every bind and unbind through
//! [`crate::private_dir::write_private_file`] (0600, in a directory only the
//! server's user can change, never through a planted link). A state file in
//! a directory others could write is not read: its binds would export
//! whatever they named.
//!
//! A port a bus-id rule names (in the config, `bind -b`, or `bind --device`
//! with a bus id) stays exported while its device is away: what is plugged
//! in there next (the same device re-enumerated as its bootloader, or a
//! replacement) is exported under the same bus id, and the importer of the
//! device that left is told it re-enumerated (`Registry::unplugged`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tracing::{debug, info, warn};
use usbwire_device::sync::lock;
use usbwire_device::Selector;
use usbwire_host::hotplug::{Hotplug, HotplugWatch};
use usbwire_host::{HostDevice, LocalDevice};
use usbwire_proto::op::BusId;

use crate::registry::Registry;

/// Kind label of real devices in listings and access rules.
pub const HOST_KIND: &str = "host";

/// How long a device just plugged in may stay unconfigured before it is exported as it is.
const CONFIGURATION_WAIT: Duration = Duration::from_secs(2);
/// How often an unconfigured arrival is looked at again.
const CONFIGURATION_POLL: Duration = Duration::from_millis(20);

/// Why `usbwire bind` or `unbind` did nothing; each carries the message for the user.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum BindError {
    /// The bus id names no real device this can apply to: nothing plugged in
    /// there, a virtual device, or (unbind) nothing exported.
    NoDevice(String),
    /// Bind: the device is exported already.
    Exported(String),
    /// The system refused: the device list unreadable, the device not openable.
    System(String),
}

impl std::fmt::Display for BindError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (Self::NoDevice(message) | Self::Exported(message) | Self::System(message)) = self;
        f.write_str(message)
    }
}

/// What a `bind --device` rule or `unbind --all` did.
#[derive(Debug, Default)]
pub(crate) struct BindOutcome {
    /// Bus ids exported (bind) or withdrawn (unbind), sorted.
    pub(crate) busids: Vec<String>,
    /// Unbind: the binds made by hand it forgot, as they were written (`0781:5567`, `1-1.2`).
    pub(crate) forgotten: Vec<String>,
    /// What the user should know: the bind could not be kept across a
    /// restart, or a matching device could not be opened.
    pub(crate) warning: Option<String>,
}

/// One bind rule and what it exported, as `usbwire state` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindRuleState {
    /// The selector as written: a bus id, `VID:PID`, `serial=…` or `class=…`.
    pub rule: String,
    /// `config` (a `[[bind]]` of the config file, or `serve --bind`) or
    /// `bind` (`usbwire bind`, kept across restarts until `usbwire unbind`).
    pub source: String,
    /// `exported` (it matched a device this server exports now) or
    /// `waiting` (none is plugged in, or none could be opened yet).
    pub state: String,
    /// The bus ids of the devices it matched that this server exports, sorted.
    pub busids: Vec<String>,
}

/// Bind rules and what they exported. Cheap to clone (shared).
#[derive(Clone)]
pub struct HostExports {
    registry: Registry,
    inner: Arc<Mutex<Bindings>>,
}

#[derive(Default)]
struct Bindings {
    /// From the config file and `serve --bind` (replaced on reload).
    rules: Vec<Selector>,
    /// From `usbwire bind` (kept across reloads until `usbwire unbind`).
    bound_by_hand: Vec<Selector>,
    /// Bus ids of the real devices exported.
    exported: HashSet<String>,
    /// Where `bound_by_hand` is kept across restarts.
    state_file: Option<PathBuf>,
}

impl HostExports {
    /// With a `state_file`, the binds it lists (from an earlier run) are bound again.
    pub(crate) fn new(registry: Registry, rules: Vec<Selector>, state_file: Option<PathBuf>) -> Self {
        let bound_by_hand = match &state_file {
            Some(path) => match load_binds(path) {
                Ok(binds) => {
                    if !binds.is_empty() {
                        info!(path = %path.display(), binds = binds.len(), "binds from the last run");
                    }
                    binds
                }
                Err(error) => {
                    warn!(path = %path.display(), %error, "cannot read the bind state file; starting without its binds");
                    Vec::new()
                }
            },
            None => Vec::new(),
        };
        let bindings = Bindings { rules, bound_by_hand, state_file, ..Bindings::default() };
        registry.set_followed_ports(bindings.ports());
        Self { registry, inner: Arc::new(Mutex::new(bindings)) }
    }

    /// Exports every present device that matches a rule and is not exported yet.
    pub(crate) fn export_matching(&self) -> Vec<String> {
        let devices = match usbwire_host::list() {
            Ok(devices) => devices,
            Err(error) => {
                warn!(%error, "cannot list local USB devices");
                return Vec::new();
            }
        };
        devices.iter().filter(|d| self.wanted(d)).filter_map(|d| self.export(d).ok()).collect()
    }

    /// `usbwire bind -b BUSID`: export the device at `busid` now and whenever it is plugged in again.
    pub(crate) fn bind(&self, busid: &str) -> Result<BindOutcome, BindError> {
        if let Some(kind) = self.virtual_kind(busid) {
            return Err(BindError::Exported(format!(
                "{busid} is already exported: it is this server's virtual {kind} (see `usbwire state`)"
            )));
        }
        let selector: Selector =
            busid.parse().map_err(|e: usbwire_device::SelectorError| BindError::NoDevice(e.to_string()))?;
        let devices = usbwire_host::list().map_err(|e| BindError::System(e.to_string()))?;
        let device = devices.iter().find(|d| selector.matches(d)).ok_or_else(|| {
            BindError::NoDevice(format!("no USB device at {busid} on this machine (see `usbwire list -l`)"))
        })?;
        let warning = {
            let mut inner = lock(&self.inner);
            if inner.exported.contains(&device.busid) {
                return Err(BindError::Exported(format!("{busid} is already exported (see `usbwire state`)")));
            }
            if inner.bound_by_hand.contains(&selector) {
                None
            } else {
                inner.bound_by_hand.push(selector);
                let warning = inner.save().err();
                self.registry.set_followed_ports(inner.ports());
                warning
            }
        };
        let exported = self.export(device).map_err(BindError::System)?;
        Ok(BindOutcome { busids: vec![exported], warning, ..BindOutcome::default() })
    }

    /// `usbwire bind --device SELECTOR`: a rule kept until `usbwire unbind`
    /// that exports every device it matches, present now or plugged in later.
    /// None present is fine (the rule waits); one that cannot be opened is a warning.
    pub(crate) fn bind_rule(&self, text: &str) -> Result<BindOutcome, BindError> {
        let selector: Selector =
            text.parse().map_err(|e: usbwire_device::SelectorError| BindError::NoDevice(e.to_string()))?;
        if let Some(kind) = self.virtual_kind(text) {
            return Err(BindError::Exported(format!(
                "{text} is already exported: it is this server's virtual {kind} (see `usbwire state`)"
            )));
        }
        let devices = usbwire_host::list().map_err(|e| BindError::System(e.to_string()))?;
        let mut warnings = Vec::new();
        {
            let mut inner = lock(&self.inner);
            if !inner.bound_by_hand.contains(&selector) {
                inner.bound_by_hand.push(selector.clone());
                warnings.extend(inner.save().err());
                self.registry.set_followed_ports(inner.ports());
            }
        }
        let mut busids = Vec::new();
        for device in devices.iter().filter(|d| selector.matches(*d)) {
            if lock(&self.inner).exported.contains(&device.busid) {
                busids.push(device.busid.clone());
                continue;
            }
            match self.export(device) {
                Ok(busid) => busids.push(busid),
                Err(error) => warnings.push(format!("{}: {error}", device.busid)),
            }
        }
        info!(rule = %selector, exported = busids.len(), "bind rule added");
        Ok(BindOutcome {
            busids,
            warning: (!warnings.is_empty()).then(|| warnings.join("; ")),
            ..BindOutcome::default()
        })
    }

    /// `usbwire unbind --all`: forgets every bind made by hand and withdraws
    /// every real device exported (importers are disconnected, kernel drivers
    /// take the devices back). Devices the config's `[[bind]]` rules name
    /// come back when plugged in again or the config is reloaded.
    pub(crate) fn unbind_all(&self) -> BindOutcome {
        let (mut busids, forgotten, warning) = {
            let mut inner = lock(&self.inner);
            let forgotten: Vec<String> = inner.bound_by_hand.drain(..).map(|rule| rule.to_string()).collect();
            let warning = if forgotten.is_empty() {
                None
            } else {
                self.registry.set_followed_ports(inner.ports());
                inner.save().err()
            };
            (inner.exported.drain().collect::<Vec<_>>(), forgotten, warning)
        };
        busids.sort();
        for busid in &busids {
            self.registry.remove(busid);
        }
        BindOutcome { busids, forgotten, warning }
    }

    /// Every bind rule, the config's first, each with the exported devices it
    /// matches (`usbwire state`). Reads the system's device list.
    pub(crate) fn rule_states(&self) -> Vec<BindRuleState> {
        let devices = usbwire_host::list().unwrap_or_else(|error| {
            warn!(%error, "cannot list local USB devices");
            Vec::new()
        });
        lock(&self.inner).rule_states(&devices)
    }

    /// `usbwire unbind -b BUSID`: stop exporting it (ending any import) and give it back to its kernel drivers.
    pub(crate) fn unbind(&self, busid: &str) -> Result<Option<String>, BindError> {
        if let Some(kind) = self.virtual_kind(busid) {
            return Err(BindError::NoDevice(format!(
                "{busid} is this server's virtual {kind}, exported for as long as it runs: unbind is for real \
                 devices (start the server without that --virtual to stop exporting it)"
            )));
        }
        let mut inner = lock(&self.inner);
        let before = inner.bound_by_hand.len();
        inner.bound_by_hand.retain(|rule| !matches!(rule, Selector::BusId(b) if b == busid));
        let warning = if inner.bound_by_hand.len() == before {
            None
        } else {
            self.registry.set_followed_ports(inner.ports());
            inner.save().err()
        };
        if !inner.exported.remove(busid) {
            return Err(BindError::NoDevice(format!("{busid} is not exported by this server (see `usbwire state`)")));
        }
        drop(inner);
        self.registry.remove(busid);
        Ok(warning)
    }

    /// `usbwire unbind --device SELECTOR`: forgets that rule and withdraws
    /// the exported devices it matches.
    pub(crate) fn unbind_rule(&self, text: &str) -> Result<BindOutcome, BindError> {
        let selector: Selector =
            text.parse().map_err(|e: usbwire_device::SelectorError| BindError::NoDevice(e.to_string()))?;
        let devices = usbwire_host::list().unwrap_or_default();
        let (mut busids, warning, forgot) = {
            let mut inner = lock(&self.inner);
            let before = inner.bound_by_hand.len();
            inner.bound_by_hand.retain(|rule| rule != &selector);
            let forgot = inner.bound_by_hand.len() != before;
            let matching: Vec<String> = devices
                .iter()
                .filter(|d| selector.matches(*d) && inner.exported.contains(&d.busid))
                .map(|d| d.busid.clone())
                .collect();
            if !forgot && matching.is_empty() {
                return Err(BindError::NoDevice(format!(
                    "no bind matches {selector} on this server (see `usbwire state`, and `usbwire unbind --all`)"
                )));
            }
            for busid in &matching {
                inner.exported.remove(busid);
            }
            if forgot {
                self.registry.set_followed_ports(inner.ports());
            }
            (matching, if forgot { inner.save().err() } else { None }, forgot)
        };
        busids.sort();
        for busid in &busids {
            self.registry.remove(busid);
        }
        let forgotten = if forgot { vec![selector.to_string()] } else { Vec::new() };
        Ok(BindOutcome { busids, forgotten, warning })
    }

    /// The kind of the virtual device exported as `busid`, if one is.
    fn virtual_kind(&self, busid: &str) -> Option<String> {
        self.registry
            .list()
            .into_iter()
            .find(|e| e.record.busid.as_str() == busid && e.kind != HOST_KIND)
            .map(|e| e.kind)
    }

    /// Listens to the kernel's USB uevents. Called before the first
    /// [`Self::export_matching`], so that a device plugged in (or still being
    /// enumerated) while the server starts is seen by one or the other.
    pub(crate) fn subscribe(&self) -> Option<HotplugWatch> {
        match usbwire_host::hotplug::watch() {
            Ok(events) => Some(events),
            Err(error) => {
                if lock(&self.inner).rules.is_empty() && lock(&self.inner).bound_by_hand.is_empty() {
                    debug!(%error, "USB hotplug unavailable");
                } else {
                    warn!(%error, "USB hotplug unavailable; devices plugged in later need `usbwire bind`");
                }
                None
            }
        }
    }

    /// Follows hotplug until the server stops. First, a device the start-up
    /// scan wanted but could not open yet (its usbfs node may lag its sysfs
    /// entry) gets the retries a plugged-in device gets.
    pub(crate) async fn watch(self, events: Option<HotplugWatch>, mut stop: watch::Receiver<bool>) {
        let Some(mut events) = events else { return };
        let missed: Vec<String> =
            usbwire_host::list().unwrap_or_default().into_iter().filter(|d| self.wanted(d)).map(|d| d.busid).collect();
        for busid in missed {
            self.arrived(&busid).await;
        }
        loop {
            let event = tokio::select! {
                () = crate::shutdown::stopped(&mut stop) => return,
                event = events.next() => event,
            };
            match event {
                Ok(Hotplug::Added(busid)) => self.arrived(&busid).await,
                Ok(Hotplug::Removed(busid)) => {
                    if lock(&self.inner).exported.remove(&busid) {
                        info!(%busid, "unplugged");
                        self.registry.unplugged(&busid);
                    }
                }
                Err(error) => {
                    warn!(%error, "USB hotplug stopped; devices plugged in later need `usbwire bind`");
                    return;
                }
            }
        }
    }

    /// A device just appeared: export it if a rule wants it. The kernel announces a device
    /// before it chooses a configuration and binds its drivers, so the export waits for the
    /// configuration ([`CONFIGURATION_WAIT`] at most: a device may stay unconfigured). Its
    /// usbfs node may lag the event (udev sets permissions afterwards), so opening is
    /// retried briefly.
    async fn arrived(&self, busid: &str) {
        let announced = tokio::time::Instant::now();
        let mut waited_for_configuration = false;
        let mut attempt = 0;
        while attempt < 10 {
            let found = usbwire_host::list().ok().and_then(|all| all.into_iter().find(|d| d.busid == busid));
            let Some(device) = found else { return };
            if !self.wanted(&device) {
                return;
            }
            if device.configuration.is_none() && announced.elapsed() < CONFIGURATION_WAIT {
                waited_for_configuration = true;
                tokio::time::sleep(CONFIGURATION_POLL).await;
                continue;
            }
            if std::mem::take(&mut waited_for_configuration) {
                let waited_ms = announced.elapsed().as_millis();
                match device.configuration {
                    Some(configuration) => {
                        info!(busid, configuration, waited_ms, "the kernel configured it after announcing it")
                    }
                    None => info!(busid, waited_ms, "the kernel left it unconfigured; exported as it is"),
                }
            }
            attempt += 1;
            if self.export(&device).is_ok() {
                info!(busid, "plugged in and exported");
                return;
            }
            debug!(busid, attempt, "cannot export yet; retrying");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn wanted(&self, device: &LocalDevice) -> bool {
        let inner = lock(&self.inner);
        !inner.exported.contains(&device.busid) && inner.matches(device)
    }

    /// New rules from a reloaded config: devices no rule wants any more are
    /// withdrawn (an importer is disconnected), newly matching ones exported,
    /// the rest untouched. Returns (exported, withdrawn) bus ids.
    pub fn reload_rules(&self, rules: Vec<Selector>) -> (Vec<String>, Vec<String>) {
        let devices = usbwire_host::list().unwrap_or_default();
        let withdrawn: Vec<String> = {
            let mut inner = lock(&self.inner);
            inner.rules = rules;
            self.registry.set_followed_ports(inner.ports());
            let unwanted: Vec<String> = inner
                .exported
                .iter()
                .filter(|busid| !devices.iter().any(|d| &&d.busid == busid && inner.matches(d)))
                .cloned()
                .collect();
            for busid in &unwanted {
                inner.exported.remove(busid);
            }
            unwanted
        };
        for busid in &withdrawn {
            self.registry.remove(busid);
        }
        (self.export_matching(), withdrawn)
    }

    fn export(&self, device: &LocalDevice) -> Result<String, String> {
        let busid = BusId::new(&device.busid).ok_or_else(|| format!("{:?} is not a usable bus id", device.busid))?;
        if self.registry.contains(&device.busid) {
            let message = format!("bus id {} is already used by a virtual device here", device.busid);
            warn!(busid = %device.busid, "{message}");
            return Err(message);
        }
        let host = HostDevice::open(device).map_err(|error| {
            warn!(busid = %device.busid, %error, "cannot open device (the server needs read-write access to /dev/bus/usb; see README)");
            error.to_string()
        })?;
        let path = device.sysfs_path.to_string_lossy().into_owned();
        let numbers = (u32::from(device.busnum), u32::from(device.devnum));
        self.registry
            .add_named(HOST_KIND, busid, numbers, path, Box::new(host))
            .map_err(|_| format!("bus id {} is taken", device.busid))?;
        lock(&self.inner).exported.insert(device.busid.clone());
        Ok(device.busid.clone())
    }
}

impl Bindings {
    /// Each rule (the config's, then those bound by hand) with the devices
    /// among `devices` it matches that are exported.
    fn rule_states(&self, devices: &[LocalDevice]) -> Vec<BindRuleState> {
        let config = self.rules.iter().map(|rule| (rule, "config"));
        let by_hand = self.bound_by_hand.iter().map(|rule| (rule, "bind"));
        config
            .chain(by_hand)
            .map(|(rule, source)| {
                let mut busids: Vec<String> = devices
                    .iter()
                    .filter(|d| rule.matches(d) && self.exported.contains(&d.busid))
                    .map(|d| d.busid.clone())
                    .collect();
                busids.sort();
                busids.dedup();
                let state = if busids.is_empty() { "waiting" } else { "exported" };
                BindRuleState { rule: rule.to_string(), source: source.into(), state: state.into(), busids }
            })
            .collect()
    }

    fn matches(&self, device: &LocalDevice) -> bool {
        self.rules.iter().chain(&self.bound_by_hand).any(|rule| rule.matches(device))
    }

    /// The ports bus-id rules name: whatever is plugged in there is exported,
    /// so a device that leaves one (re-enumerating, replaced) comes back
    /// under the same bus id.
    fn ports(&self) -> HashSet<String> {
        let port = |rule: &Selector| match rule {
            Selector::BusId(busid) => Some(busid.clone()),
            _ => None,
        };
        self.rules.iter().chain(&self.bound_by_hand).filter_map(port).collect()
    }

    /// Writes the binds made by hand to the state file. A failure is
    /// logged and returned, for the user: the bind itself holds until the
    /// server stops, but not across a restart.
    fn save(&self) -> Result<(), String> {
        let Some(path) = &self.state_file else {
            return Err(
                "this server keeps no bind state file (serve --bind-state FILE): the bind ends with the server".into(),
            );
        };
        save_binds(path, &self.bound_by_hand).map_err(|error| {
            warn!(path = %path.display(), %error, "cannot write the bind state file; this bind ends with the server");
            format!("cannot keep the bind in {}: {error}; it ends with the server", path.display())
        })
    }
}

/// The binds in a state file: one selector per line; `#` comments and blank
/// lines skipped. A missing file is no binds.
fn load_binds(path: &Path) -> std::io::Result<Vec<Selector>> {
    let Some(text) = crate::private_dir::read_private_file(path)? else { return Ok(Vec::new()) };
    let mut binds = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        match line.parse() {
            Ok(selector) => binds.push(selector),
            Err(error) => warn!(path = %path.display(), line, %error, "bind state file: line skipped"),
        }
    }
    Ok(binds)
}

/// Replaces the state file with `binds`.
fn save_binds(path: &Path, binds: &[Selector]) -> std::io::Result<()> {
    let mut text = String::from(
        "# usbwire bind: devices bound by hand, exported again after a restart (usbwire unbind removes them)\n",
    );
    for bind in binds {
        text.push_str(&format!("{bind}\n"));
    }
    crate::private_dir::write_private_file(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(busid: &str, vendor_id: u16, product_id: u16) -> LocalDevice {
        LocalDevice {
            busid: busid.into(),
            busnum: 1,
            devnum: 2,
            vendor_id,
            product_id,
            manufacturer: None,
            product: None,
            serial: None,
            speed: usbwire_device::Speed::HIGH,
            bcd_device: 0x0100,
            class: 0,
            subclass: 0,
            protocol: 0,
            interfaces: Vec::new(),
            configuration: Some(1),
            sysfs_path: PathBuf::new(),
        }
    }

    /// `usbwire state`'s bind rules: a rule matching an exported device says
    /// which; one matching only a device that is not exported (it could not
    /// be opened) or nothing plugged in waits.
    #[test]
    fn each_rule_says_what_it_exported_or_that_it_waits() {
        let selector = |text: &str| -> Selector { text.parse().unwrap() };
        let bindings = Bindings {
            rules: vec![selector("0781:5567"), selector("3-4")],
            bound_by_hand: vec![selector("046d:c52b"), selector("1209:0001")],
            exported: ["1-1".to_owned(), "1-2".to_owned()].into(),
            ..Bindings::default()
        };
        let devices = [device("1-2", 0x0781, 0x5567), device("1-1", 0x0781, 0x5567), device("2-1", 0x046d, 0xc52b)];
        let states = bindings.rule_states(&devices);
        let rule = |rule: &str, source: &str, busids: &[&str]| BindRuleState {
            rule: rule.into(),
            source: source.into(),
            state: if busids.is_empty() { "waiting" } else { "exported" }.into(),
            busids: busids.iter().map(|b| (*b).to_owned()).collect(),
        };
        assert_eq!(
            states,
            [
                rule("0781:5567", "config", &["1-1", "1-2"]),
                rule("3-4", "config", &[]),
                rule("046d:c52b", "bind", &[]),
                rule("1209:0001", "bind", &[]),
            ]
        );
    }

    #[test]
    fn binds_survive_a_save_and_load_and_a_missing_file_is_none() {
        let dir = std::env::temp_dir().join(format!("usbwire-binds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("server.binds");
        assert!(load_binds(&path).unwrap().is_empty());
        let binds: Vec<Selector> = ["1-1.2", "0781:5567"].iter().map(|s| s.parse().unwrap()).collect();
        save_binds(&path, &binds).unwrap();
        assert_eq!(load_binds(&path).unwrap(), binds);
        std::fs::write(&path, "# comment\n\n1-3\nnot a selector\n").unwrap();
        assert_eq!(load_binds(&path).unwrap(), vec!["1-3".parse().unwrap()]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Earlier versions wrote the file beside the config file (server.toml →
    /// server.binds) with the process's umask (0644) in a directory like
    /// /etc/usbwire (0755), one bus id per line: such a file still loads.
    #[test]
    fn a_bind_state_file_as_earlier_versions_wrote_it_still_loads() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("usbwire-old-binds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.join("server.binds");
        std::fs::write(
            &path,
            "# usbwire bind: devices bound by hand, exported again after a restart (usbwire unbind removes them)\n\
             1-1.2\n3-4\n",
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let wanted: Vec<Selector> = ["1-1.2", "3-4"].iter().map(|s| s.parse().unwrap()).collect();
        assert_eq!(load_binds(&path).unwrap(), wanted);
        // The next save replaces it in the same format, 0600.
        save_binds(&path, &wanted).unwrap();
        assert_eq!(load_binds(&path).unwrap(), wanted);
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
