//! One real USB device exported through usbfs: [`HostDevice`] implements the
//! server's [`Device`] trait by submitting each URB to the kernel as a usbfs
//! URB and reaping completions when the usbfs file becomes writable.
//!
//! Like the kernel's stub (`drivers/usb/usbip/stub_rx.c`), a few control
//! requests are not forwarded but carried out here: SET_ADDRESS is absorbed,
//! SET_CONFIGURATION / SET_INTERFACE / CLEAR_FEATURE(ENDPOINT_HALT) and a hub
//! port reset go through the matching usbfs ioctls so the kernel's view of
//! the device stays right. Interfaces are claimed (kernel drivers detached)
//! when the first URB arrives and given back on [`Device::reset`] or drop.
//!
//! Memory handed to the kernel with a URB stays in a [`UrbTable`] keyed by
//! the URB's address until a reap returns that address; an unlink, a reset
//! or an unplug only changes who is told when it comes back (see
//! `urb_table.rs` for why a seqnum cannot be the key).
//!
//! This file opens the device and moves URBs (submit, reap, cancel, drain, reset);
//! [`requests`] carries out the control requests done here and the interface
//! claims; [`transfer`] turns one URB into its usbfs form and back.

mod requests;
mod transfer;

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tracing::{debug, warn};
use usbwire_device::descriptor::{ConfigurationInfo, DeviceDescriptor};
use usbwire_device::{Completion, Device, DeviceSummary, Direction, Status, TransferType, Urb};

use self::transfer::InFlight;
use crate::local::{read_sysfs, LocalDevice};
use crate::urb_table::{Reaped, UrbKey, UrbTable};
use crate::usbfs;

/// How long a reset or close waits for discarded URBs to come back. Those that
/// do not stay held (a reset) or are leaked (a close); never freed unreaped.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// `-ESHUTDOWN`: what the kernel gives URBs of a device that went away.
const ESHUTDOWN: Status = Status(-libc::ESHUTDOWN);
const ENODEV: Status = Status(-libc::ENODEV);

/// A real device opened through `/dev/bus/usb/BBB/DDD`.
pub struct HostDevice {
    busid: String,
    sysfs_path: PathBuf,
    /// A duplicate of `file`'s fd (same usbfs session) registered with tokio.
    reactor: Option<AsyncFd<File>>,
    file: File,
    summary: DeviceSummary,
    configurations: Vec<ConfigurationInfo>,
    active: Option<ConfigurationInfo>,
    alt_settings: HashMap<u8, u8>,
    endpoints: HashMap<u8, TransferType>,
    claimed: Vec<u8>,
    /// Every URB the kernel holds, by address.
    urbs: UrbTable<InFlight>,
    finished: VecDeque<Completion>,
    gone: bool,
}

impl HostDevice {
    /// Opens a device found by [`crate::list`]. Needs read-write access to its
    /// usbfs node (root, or a udev rule; see README).
    pub fn open(local: &LocalDevice) -> io::Result<Self> {
        let node = format!("/dev/bus/usb/{:03}/{:03}", local.busnum, local.devnum);
        let mut file = File::options().read(true).write(true).open(&node).map_err(|error| {
            io::Error::new(error.kind(), format!("cannot open {node} for {}: {error}", local.busid))
        })?;
        // Reading a usbfs node gives the device descriptor and every configuration descriptor.
        let mut descriptors = Vec::new();
        file.read_to_end(&mut descriptors)?;
        let device = DeviceDescriptor::parse(&descriptors)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("{node}: no device descriptor")))?;
        let mut configurations = Vec::new();
        let mut at = usize::from(descriptors[0]);
        while at + 4 <= descriptors.len() {
            let total = usize::from(u16::from_le_bytes([descriptors[at + 2], descriptors[at + 3]]));
            let end = (at + total.max(9)).min(descriptors.len());
            if let Some(config) = ConfigurationInfo::parse(&descriptors[at..end]) {
                configurations.push(config);
            }
            at = end;
        }
        let active = configuration_in_effect(&local.sysfs_path, &configurations);
        let listed = active.as_ref().or(configurations.first());
        let summary = DeviceSummary {
            speed: local.speed,
            vendor_id: device.vendor_id,
            product_id: device.product_id,
            bcd_device: device.bcd_device,
            class: device.class,
            subclass: device.subclass,
            protocol: device.protocol,
            configuration_value: active.as_ref().map_or(0, |c| c.value),
            num_configurations: device.num_configurations,
            interfaces: listed.map(|c| c.interface_classes()).unwrap_or_default(),
            product: local.product.clone().unwrap_or_default(),
            manufacturer: local.manufacturer.clone().unwrap_or_default(),
            serial: local.serial.clone().unwrap_or_default(),
        };
        let mut host = Self {
            busid: local.busid.clone(),
            sysfs_path: local.sysfs_path.clone(),
            reactor: None,
            file,
            summary,
            configurations,
            active,
            alt_settings: HashMap::new(),
            endpoints: HashMap::new(),
            claimed: Vec::new(),
            urbs: UrbTable::new(),
            finished: VecDeque::new(),
            gone: false,
        };
        host.refresh_endpoints();
        Ok(host)
    }

    pub fn busid(&self) -> &str {
        &self.busid
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Reaps every finished URB. Returns whether anything was reaped.
    fn reap_all(&mut self) -> bool {
        let mut reaped = false;
        loop {
            match usbfs::reap(self.fd()) {
                Ok(Some(raw)) => {
                    reaped = true;
                    // Look the address up before touching it: only memory we
                    // still hold is read, whatever the kernel returned.
                    match self.urbs.reap(UrbKey::of(raw)) {
                        Reaped::Completed { seqnum, cancelled, entry } => {
                            if cancelled {
                                debug!(busid = %self.busid, seqnum, "discarded URB came back");
                            }
                            let mut completion = entry.finish(cancelled, &self.endpoints);
                            let unplugged = completion.status != Status::OK
                                && completion.status != Status::ECONNRESET
                                && !self.gone
                                && self.disconnected();
                            if unplugged {
                                // However the kernel tore it down, tell the client what an unplug is.
                                completion.status = ESHUTDOWN;
                            }
                            self.finished.push_back(completion);
                            if unplugged {
                                self.mark_gone();
                            }
                        }
                        // Nobody waits for it; the kernel is done with its memory.
                        Reaped::Abandoned(entry) => drop(entry),
                        Reaped::Unknown => {
                            warn!(busid = %self.busid, address = ?raw, "usbfs returned a URB this device does not hold; ignored")
                        }
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    // ENODEV: unplugged and nothing completed is left to reap now.
                    if error.raw_os_error() != Some(libc::ENODEV) {
                        warn!(busid = %self.busid, %error, "usbfs reap failed; treating the device as gone");
                    }
                    self.mark_gone();
                    break;
                }
            }
        }
        reaped
    }

    /// Whether usbfs reports the device gone (POLLHUP/POLLERR on its file).
    fn disconnected(&self) -> bool {
        let mut poll = libc::pollfd { fd: self.file.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        ready > 0 && poll.revents & (libc::POLLHUP | libc::POLLERR) != 0
    }

    /// The device was unplugged: every URB still out ends with `-ESHUTDOWN`
    /// now. Their memory stays held until reaped (usbfs still returns
    /// completed URBs after an unplug) or the device is dropped.
    fn mark_gone(&mut self) {
        if self.gone {
            return;
        }
        self.gone = true;
        self.claimed.clear();
        warn!(busid = %self.busid, in_flight = self.urbs.awaited(), "device disconnected");
        let finished = &mut self.finished;
        self.urbs.abandon_all(|_, in_flight| finished.push_back(in_flight.urb.complete_with(ESHUTDOWN)));
    }

    fn reactor(&mut self) -> io::Result<&AsyncFd<File>> {
        let reactor = match self.reactor.take() {
            Some(reactor) => reactor,
            None => {
                let duplicate = self.file.try_clone()?;
                // SAFETY: the AsyncFd owns `duplicate`, so the fd stays open (and is not
                // reused) for as long as it is registered.
                unsafe { AsyncFd::register_with_interest(duplicate, Interest::WRITABLE) }
                    .map_err(|error| error.into_parts().1)?
            }
        };
        Ok(self.reactor.insert(reactor))
    }

    /// Cancels everything in flight (no completions follow) and waits, at
    /// most [`DRAIN_TIMEOUT`], for the kernel to hand it back. What does not
    /// come back stays in the table, where a later reap frees it.
    fn drain(&mut self) {
        self.urbs.abandon_all(|_, _| {});
        let fd = self.file.as_fd();
        for in_flight in self.urbs.held_mut() {
            // SAFETY: the table holds only URBs submitted on this fd and not
            // yet reaped. EINVAL means it already finished.
            let _ = unsafe { usbfs::discard(fd, in_flight.raw()) };
        }
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while !self.urbs.is_empty() && Instant::now() < deadline {
            if !self.reap_all() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        if !self.urbs.is_empty() {
            warn!(
                busid = %self.busid,
                stuck = self.urbs.len(),
                "URBs did not come back within {DRAIN_TIMEOUT:?} of a discard; their memory stays reserved until the \
                 kernel returns them"
            );
        }
        self.finished.clear();
    }
}

impl Device for HostDevice {
    fn summary(&self) -> DeviceSummary {
        self.summary.clone()
    }

    fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        if number == 0 {
            return Some(TransferType::Control);
        }
        let address = if direction == Direction::In { number | 0x80 } else { number };
        self.endpoints.get(&address).copied()
    }

    fn submit(&mut self, urb: Urb) {
        if self.gone {
            self.finished.push_back(urb.complete_with(ENODEV));
            return;
        }
        if self.claimed.is_empty() {
            self.learn_configuration();
            self.claim_interfaces();
        }
        if urb.endpoint == 0 {
            if let Some(done) = self.handle_special_request(&urb) {
                self.finished.push_back(done);
                return;
            }
        }
        let seqnum = urb.seqnum;
        match InFlight::prepare(urb, &self.endpoints) {
            Err((urb, status)) => self.finished.push_back(urb.complete_with(status)),
            Ok(mut in_flight) => {
                let raw = in_flight.raw();
                // SAFETY: `in_flight` (block and buffer, both heap allocations that do
                // not move when the struct does) stays in `self.urbs` until a reap
                // returns `raw`, or is leaked.
                match unsafe { usbfs::submit(self.file.as_fd(), raw) } {
                    Ok(()) => {
                        if let Err(twin) = self.urbs.insert(UrbKey::of(raw), seqnum, in_flight) {
                            // Cannot happen while the table owns the memory at that address;
                            // if it did, the kernel now holds `twin` too: never free it.
                            warn!(busid = %self.busid, seqnum, "submitted URB address already held; leaking it");
                            std::mem::forget(twin);
                        }
                    }
                    Err(error) => {
                        let errno = error.raw_os_error().unwrap_or(libc::EIO);
                        debug!(busid = %self.busid, seqnum, %error, "usbfs refused the URB");
                        if errno == libc::ENODEV {
                            self.mark_gone();
                        }
                        self.finished.push_back(in_flight.urb.complete_with(Status(-errno)));
                    }
                }
            }
        }
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        loop {
            if let Some(done) = self.finished.pop_front() {
                return Poll::Ready(done);
            }
            // After an unplug, `drain` (reset or drop) reaps what is left.
            if self.urbs.is_empty() || self.gone {
                return Poll::Pending;
            }
            let reactor = match self.reactor() {
                Ok(reactor) => reactor,
                Err(error) => {
                    warn!(busid = %self.busid, %error, "cannot watch the usbfs file");
                    self.mark_gone();
                    continue;
                }
            };
            match reactor.poll_write_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(error)) => {
                    warn!(busid = %self.busid, %error, "usbfs poll failed");
                    self.mark_gone();
                }
                Poll::Ready(Ok(mut guard)) => {
                    guard.clear_ready();
                    self.reap_all();
                }
            }
        }
    }

    fn cancel(&mut self, seqnum: u32) {
        // The URB stays in the table, cancelled, until the kernel returns it.
        if let Some(in_flight) = self.urbs.cancel(seqnum) {
            // SAFETY: the URB is in flight on this fd. EINVAL means it already finished.
            if let Err(error) = unsafe { usbfs::discard(self.file.as_fd(), in_flight.raw()) } {
                debug!(busid = %self.busid, seqnum, %error, "discard");
            }
        }
    }

    fn reset(&mut self) {
        self.drain();
        if self.gone {
            return;
        }
        if !self.claimed.is_empty() {
            // Like usbip-host when its client goes: reset, so the next user starts clean.
            if let Err(error) = usbfs::reset(self.fd()) {
                debug!(busid = %self.busid, %error, "device reset");
            }
        }
        self.give_back_interfaces();
        self.alt_settings.clear();
        self.active = configuration_in_effect(&self.sysfs_path, &self.configurations).or_else(|| self.active.take());
        self.refresh_endpoints();
    }

    fn is_gone(&self) -> bool {
        self.gone
    }
}

/// The configuration the kernel has in effect, per sysfs; `None` while it has chosen none.
/// Reading the attribute waits for a configuration change the kernel is making.
fn configuration_in_effect(sysfs_path: &Path, configurations: &[ConfigurationInfo]) -> Option<ConfigurationInfo> {
    let value = read_sysfs(sysfs_path, "bConfigurationValue")?.parse::<u8>().ok()?;
    configurations.iter().find(|c| c.value == value).cloned()
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        if !self.urbs.is_empty() {
            // What still does not come back is leaked when `urbs` drops.
            self.drain();
        }
        if !self.gone {
            self.give_back_interfaces();
        }
    }
}

// SAFETY: the raw pointers inside `InFlight` point into allocations owned by the
// same value; the device is used from one task at a time.
unsafe impl Send for HostDevice {}
