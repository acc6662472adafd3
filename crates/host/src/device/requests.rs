//! What `HostDevice` does itself instead of forwarding to the device, as the kernel's stub
//! does (`drivers/usb/usbip/stub_rx.c`): SET_ADDRESS absorbed; SET_CONFIGURATION,
//! SET_INTERFACE, CLEAR_FEATURE(ENDPOINT_HALT) and a hub port reset through the matching
//! usbfs ioctls, so the kernel's view of the device stays right; the endpoints of the setting
//! in effect; and claiming the interfaces from their kernel drivers and giving them back.

use std::io;
use std::os::fd::AsFd;

use tracing::{debug, info, warn};
use usbwire_device::{Completion, Status, Urb};

use super::HostDevice;
use crate::usbfs;

impl HostDevice {
    pub(super) fn refresh_endpoints(&mut self) {
        self.endpoints.clear();
        if let Some(active) = &self.active {
            let alt_settings = &self.alt_settings;
            for endpoint in active.active_endpoints(|interface| alt_settings.get(&interface).copied().unwrap_or(0)) {
                self.endpoints.insert(endpoint.address, endpoint.transfer_type);
            }
        }
    }

    /// A device opened right after it was plugged in may have had no configuration yet: the
    /// kernel chooses one (and binds its drivers) after announcing the device. Before its
    /// interfaces are claimed or a SET_CONFIGURATION is judged, learn what the kernel chose,
    /// or the kernel's drivers keep the interfaces and SET_CONFIGURATION fails with EBUSY.
    pub(super) fn learn_configuration(&mut self) {
        if self.active.is_some() {
            return;
        }
        self.active = super::configuration_in_effect(&self.sysfs_path, &self.configurations);
        if let Some(active) = &self.active {
            debug!(busid = %self.busid, configuration = active.value, "the kernel configured the device after it was opened");
            self.summary.configuration_value = active.value;
            self.refresh_endpoints();
        }
    }

    /// Claims every interface of the active configuration, detaching kernel drivers.
    pub(super) fn claim_interfaces(&mut self) {
        let Some(active) = &self.active else { return };
        let mut numbers: Vec<u8> = active.interfaces.iter().map(|i| i.number).collect();
        numbers.dedup();
        for number in numbers {
            if self.claimed.contains(&number) {
                continue;
            }
            match usbfs::disconnect_and_claim(self.file.as_fd(), number) {
                Ok(()) => self.claimed.push(number),
                Err(error) => warn!(busid = %self.busid, interface = number, %error, "cannot claim interface"),
            }
        }
        if !self.claimed.is_empty() {
            info!(busid = %self.busid, interfaces = ?self.claimed, "interfaces claimed from their kernel drivers");
        }
    }

    /// Releases our claims and lets the kernel's drivers bind again.
    pub(super) fn give_back_interfaces(&mut self) {
        for number in std::mem::take(&mut self.claimed) {
            if let Err(error) = usbfs::release_interface(self.fd(), number) {
                debug!(busid = %self.busid, interface = number, %error, "release interface");
            }
            if let Err(error) = usbfs::connect_kernel_driver(self.fd(), number) {
                debug!(busid = %self.busid, interface = number, %error, "reconnect kernel driver");
            }
        }
    }

    /// Carries out the control requests the stub does not forward. `None`
    /// means: forward this URB to the device.
    pub(super) fn handle_special_request(&mut self, urb: &Urb) -> Option<Completion> {
        let [request_type, request, value_lo, value_hi, index_lo, _, _, _] = urb.setup;
        let value = u16::from_le_bytes([value_lo, value_hi]);
        let status = |result: io::Result<()>| match result {
            Ok(()) => Status::OK,
            Err(error) => Status(-error.raw_os_error().unwrap_or(libc::EIO)),
        };
        match (request_type, request) {
            // SET_ADDRESS: the device already has its address on this bus.
            (0x00, 0x05) => Some(urb.complete_with(Status::OK)),
            // SET_CONFIGURATION.
            (0x00, 0x09) => {
                let wanted = value as u8;
                self.learn_configuration();
                if self.active.as_ref().map(|c| c.value) == Some(wanted) {
                    return Some(urb.complete_with(Status::OK));
                }
                let had_claims = !self.claimed.is_empty();
                for number in std::mem::take(&mut self.claimed) {
                    let _ = usbfs::release_interface(self.fd(), number);
                }
                let result = usbfs::set_configuration(self.fd(), wanted);
                if result.is_ok() {
                    self.active = self.configurations.iter().find(|c| c.value == wanted).cloned();
                    self.alt_settings.clear();
                    self.refresh_endpoints();
                }
                if had_claims || result.is_ok() {
                    self.claim_interfaces();
                }
                Some(urb.complete_with(status(result)))
            }
            // SET_INTERFACE.
            (0x01, 0x0b) => {
                let interface = index_lo;
                let result = usbfs::set_interface(self.fd(), interface, value as u8);
                if result.is_ok() {
                    self.alt_settings.insert(interface, value as u8);
                    self.refresh_endpoints();
                }
                Some(urb.complete_with(status(result)))
            }
            // CLEAR_FEATURE(ENDPOINT_HALT).
            (0x02, 0x01) if value == 0 => Some(urb.complete_with(status(usbfs::clear_halt(self.fd(), index_lo)))),
            // A hub's SET_FEATURE(PORT_RESET) aimed at the port this device sits on.
            (0x23, 0x03) if value == 4 => {
                let result = usbfs::reset(self.fd());
                info!(busid = %self.busid, ok = result.is_ok(), "port reset");
                Some(urb.complete_with(status(result)))
            }
            _ => None,
        }
    }
}
