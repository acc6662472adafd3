//! What is plugged into this machine: [`LocalDevice`] (bus id, VID:PID,
//! strings, speed, each interface's kernel driver), read through nusb and
//! sysfs, and [`list`], which enumerates them in bus-id order.
//!
//! It sits below the exported device (which opens a `LocalDevice`) and the
//! selector facts. It is not for opening a device or moving URBs (`device`).

use std::io;
use std::path::{Path, PathBuf};

use nusb::MaybeFuture;
use usbwire_device::Speed;

/// A USB device plugged into this machine.
#[derive(Clone, Debug)]
pub struct LocalDevice {
    /// As usbip names it: `BUS-PORT[.PORT...]`, e.g. `1-1.2`.
    pub busid: String,
    pub busnum: u8,
    pub devnum: u8,
    pub vendor_id: u16,
    pub product_id: u16,
    pub manufacturer: Option<String>,
    pub product: Option<String>,
    pub serial: Option<String>,
    pub speed: Speed,
    /// The device's release number (`bcdDevice`).
    pub bcd_device: u16,
    pub class: u8,
    pub subclass: u8,
    pub protocol: u8,
    pub interfaces: Vec<LocalInterface>,
    /// The configuration in effect (`bConfigurationValue`); `None` while the kernel has
    /// not chosen one yet, as just after a hotplug `add` event.
    pub configuration: Option<u8>,
    pub sysfs_path: PathBuf,
}

/// One interface of a [`LocalDevice`] and the kernel driver bound to it.
#[derive(Clone, Debug)]
pub struct LocalInterface {
    pub number: u8,
    pub class: u8,
    pub subclass: u8,
    pub protocol: u8,
    /// `None` when no driver is bound; `usbfs` while a usbwire server holds it.
    pub driver: Option<String>,
}

impl LocalDevice {
    fn from_info(info: &nusb::DeviceInfo) -> Option<Self> {
        let sysfs_path = info.sysfs_path().to_path_buf();
        let busid = sysfs_path.file_name()?.to_str()?.to_owned();
        // Root hubs (`usb1`) are not devices anyone shares.
        if busid.starts_with("usb") {
            return None;
        }
        let configuration = read_sysfs(&sysfs_path, "bConfigurationValue").unwrap_or_default();
        let interfaces = info
            .interfaces()
            .map(|interface| {
                let number = interface.interface_number();
                let link = sysfs_path.join(format!("{busid}:{configuration}.{number}/driver"));
                let driver =
                    std::fs::read_link(link).ok().and_then(|t| t.file_name().map(|n| n.to_string_lossy().into()));
                LocalInterface {
                    number,
                    class: interface.class(),
                    subclass: interface.subclass(),
                    protocol: interface.protocol(),
                    driver,
                }
            })
            .collect();
        Some(Self {
            busid,
            busnum: info.busnum(),
            devnum: info.device_address(),
            vendor_id: info.vendor_id(),
            product_id: info.product_id(),
            manufacturer: info.manufacturer_string().map(str::to_owned),
            product: info.product_string().map(str::to_owned),
            serial: info.serial_number().map(str::to_owned),
            speed: match info.speed() {
                Some(nusb::Speed::Low) => Speed::LOW,
                Some(nusb::Speed::Full) => Speed::FULL,
                Some(nusb::Speed::High) => Speed::HIGH,
                Some(nusb::Speed::Super) => Speed::SUPER,
                Some(nusb::Speed::SuperPlus) => Speed::SUPER_PLUS,
                _ => Speed::UNKNOWN,
            },
            bcd_device: info.device_version(),
            class: info.class(),
            subclass: info.subclass(),
            protocol: info.protocol(),
            interfaces,
            configuration: configuration.parse().ok(),
            sysfs_path,
        })
    }

    /// The device's class, or its interfaces' classes when it defers to them.
    pub fn classes(&self) -> impl Iterator<Item = u8> + '_ {
        std::iter::once(self.class).filter(|&c| c != 0).chain(self.interfaces.iter().map(|i| i.class))
    }
}

/// Every USB device on this machine (root hubs left out), sorted by bus id.
pub fn list() -> io::Result<Vec<LocalDevice>> {
    if !std::path::Path::new("/sys/bus/usb/devices").exists() {
        // A kernel without USB support (or a container without /sys/bus/usb): nothing plugged in.
        return Ok(Vec::new());
    }
    let devices = nusb::list_devices().wait().map_err(|error| {
        io::Error::other(format!("cannot enumerate USB devices ({error}); is sysfs mounted at /sys?"))
    })?;
    let mut found: Vec<LocalDevice> = devices.filter_map(|info| LocalDevice::from_info(&info)).collect();
    found.sort_by_key(|device| busid_order(&device.busid));
    Ok(found)
}

/// Numeric order for bus ids, so `1-10` sorts after `1-2`.
fn busid_order(busid: &str) -> Vec<u32> {
    busid.split(['-', '.']).map(|part| part.parse().unwrap_or(u32::MAX)).collect()
}

/// One attribute of a device in sysfs (`bConfigurationValue`), trimmed.
pub(crate) fn read_sysfs(device: &Path, attribute: &str) -> Option<String> {
    std::fs::read_to_string(device.join(attribute)).ok().map(|text| text.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_sort_numerically() {
        let mut ids = vec!["1-10", "1-2", "2-1", "1-2.3", "1-2.10", "1-2.2"];
        ids.sort_by_key(|id| busid_order(id));
        assert_eq!(ids, ["1-2", "1-2.2", "1-2.3", "1-2.10", "1-10", "2-1"]);
    }
}
