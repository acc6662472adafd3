//! Which real (usbfs) devices this server exports: bind rules from the config
//! or `serve --bind`, `usbwire bind` / `unbind` through the control socket,
//! and hotplug — a device that arrives and matches a rule is exported at
//! once; one that leaves is withdrawn (its importer sees a clean close).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures_util::StreamExt;
use tokio::sync::watch;
use tracing::{info, warn};
use usbwire_host::{DeviceId, HostDevice, HotplugEvent, LocalDevice, Selector};
use usbwire_proto::op::BusId;

use crate::registry::Registry;

/// Kind label of real devices in listings and access rules.
pub const HOST_KIND: &str = "host";

/// Bind rules and what they exported. Cheap to clone (shared).
#[derive(Clone)]
pub(crate) struct HostExports {
    registry: Registry,
    inner: Arc<Mutex<Bindings>>,
}

#[derive(Default)]
struct Bindings {
    rules: Vec<Selector>,
    /// Exported real devices by bus id, with nusb's id to recognise departures.
    exported: HashMap<String, Option<DeviceId>>,
}

impl HostExports {
    pub(crate) fn new(registry: Registry, rules: Vec<Selector>) -> Self {
        Self { registry, inner: Arc::new(Mutex::new(Bindings { rules, exported: HashMap::new() })) }
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
    pub(crate) fn bind(&self, busid: &str) -> Result<String, String> {
        let selector: Selector = busid.parse().map_err(|e: usbwire_host::SelectorError| e.to_string())?;
        let devices = usbwire_host::list().map_err(|e| e.to_string())?;
        let device = devices
            .iter()
            .find(|d| selector.matches(d))
            .ok_or_else(|| format!("no USB device at {busid} on this machine (see `usbwire list -l`)"))?;
        {
            let mut inner = lock(&self.inner);
            if inner.exported.contains_key(&device.busid) {
                return Err(format!("{busid} is already exported"));
            }
            if !inner.rules.contains(&selector) {
                inner.rules.push(selector);
            }
        }
        self.export(device)
    }

    /// `usbwire unbind -b BUSID`: stop exporting it (ending any import) and give it back to its kernel drivers.
    pub(crate) fn unbind(&self, busid: &str) -> Result<(), String> {
        let mut inner = lock(&self.inner);
        inner.rules.retain(|rule| !matches!(rule, Selector::BusId(b) if b == busid));
        if inner.exported.remove(busid).is_none() {
            return Err(format!("{busid} is not exported by this server (see `usbwire state`)"));
        }
        drop(inner);
        self.registry.remove(busid);
        Ok(())
    }

    /// Follows hotplug until the server stops.
    pub(crate) async fn watch(self, mut stop: watch::Receiver<bool>) {
        let mut events = match usbwire_host::watch() {
            Ok(events) => events,
            Err(error) => {
                if lock(&self.inner).rules.is_empty() {
                    tracing::debug!(%error, "USB hotplug unavailable");
                } else {
                    warn!(%error, "USB hotplug unavailable; devices plugged in later need `usbwire bind`");
                }
                return;
            }
        };
        loop {
            let event = tokio::select! {
                () = crate::stopped(&mut stop) => return,
                event = events.next() => event,
            };
            match event {
                Some(HotplugEvent::Connected(info)) => {
                    if let Some(device) = usbwire_host::arrived(&info) {
                        if self.wanted(&device) {
                            let _ = self.export(&device);
                        }
                    }
                }
                Some(HotplugEvent::Disconnected(id)) => {
                    let busid = {
                        let mut inner = lock(&self.inner);
                        let busid = inner.exported.iter().find(|(_, v)| **v == Some(id)).map(|(b, _)| b.clone());
                        if let Some(busid) = &busid {
                            inner.exported.remove(busid);
                        }
                        busid
                    };
                    if let Some(busid) = busid {
                        info!(%busid, "unplugged");
                        self.registry.remove(&busid);
                    }
                }
                None => return,
            }
        }
    }

    fn wanted(&self, device: &LocalDevice) -> bool {
        let inner = lock(&self.inner);
        !inner.exported.contains_key(&device.busid) && inner.rules.iter().any(|rule| rule.matches(device))
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
        lock(&self.inner).exported.insert(device.busid.clone(), device.id);
        Ok(device.busid.clone())
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
