//! A device that is flashed like a lab board: DFU 1.1 (USB Device Firmware
//! Upgrade) with a firmware image kept in a file.
//!
//! In runtime mode ([`RUNTIME_PRODUCT_ID`]) it has a vendor interface (the
//! "application") and a DFU runtime interface; its product string carries the
//! first 8 hex digits of the SHA-256 of the image in FILE ("usbwire DFU demo
//! (fw 1a2b3c4d)"). DFU_DETACH makes it re-enumerate, as a real board does,
//! into DFU mode ([`DFU_PRODUCT_ID`], one DFU interface with alternate
//! settings 0 "flash" — FILE, up to [`DfuOptions::size`] bytes — and 1
//! "option bytes" — 16 bytes in RAM). There DFU_DNLOAD, DFU_UPLOAD,
//! DFU_GETSTATUS, DFU_CLRSTATUS, DFU_GETSTATE and DFU_ABORT follow the spec's
//! state diagram (see [`machine`]); manifestation writes the image to FILE
//! atomically (see [`memory`]), and the device then re-enumerates back into
//! runtime mode, with the new hash in its product string. A USB reset in DFU
//! mode returns to runtime mode too.
//!
//! Re-enumerating is the same object changing what it is: it counts up
//! [`Device::enumeration`], drops every URB in flight, and from then on
//! describes the other mode. Timers (the detach, a block's programming, the
//! self-reset after manifestation) run on the tokio clock, so the device must
//! be polled inside a tokio runtime, like the loopback's tick endpoint.
//!
//! ```no_run
//! use usbwire_device::Device;
//! use usbwire_gadgets::dfu::{DfuDevice, DfuOptions};
//!
//! let device = DfuDevice::open("fw.bin".as_ref(), &DfuOptions::default())?;
//! assert!(device.summary().product.starts_with("usbwire DFU demo"));
//! # Ok::<(), usbwire_gadgets::dfu::DfuError>(())
//! ```
//!
//! This module is not for real DFU devices (the host crate exports those) nor
//! for DfuSe, ST's vendor extension with addresses and erase commands.

mod function;
mod ids;
pub mod machine;
pub mod memory;

use std::future::Future as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use tracing::{info, warn};
use usbwire_device::{Completion, Device, DeviceSummary, Direction, TransferType, Urb, VirtualDevice};

pub use function::{
    Firmware, BOOTLOADER_PRODUCT, DFU_ATTRIBUTES, DFU_MODE_INTERFACE, REQUEST_FIRMWARE_SHA256, RUNTIME_DFU_INTERFACE,
    RUNTIME_VENDOR_INTERFACE,
};
pub use ids::{DFU_PRODUCT_ID, RUNTIME_PRODUCT_ID};
pub use machine::{DfuStatus, Mode, State, TRANSFER_SIZE};
pub use memory::{FileMemory, FLASH_ALT, OPTION_BYTES_ALT, OPTION_BYTES_LEN};

use function::DfuFunction;

/// The default size of the flash region: 1 MiB.
pub const DEFAULT_SIZE: usize = 1 << 20;
/// The largest flash region: an image is held in memory while it downloads.
pub const MAX_SIZE: usize = 64 << 20;

/// How to make the device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DfuOptions {
    /// The flash region's size: the largest image DFU_DNLOAD takes (larger is
    /// errADDRESS) and FILE may hold. 1..=[`MAX_SIZE`] bytes; [`DEFAULT_SIZE`] by default.
    pub size: usize,
}

impl Default for DfuOptions {
    fn default() -> Self {
        Self { size: DEFAULT_SIZE }
    }
}

/// Why a DFU device cannot be made on a file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DfuError {
    /// `size=` is 0 or above [`MAX_SIZE`].
    #[error("size {0} is not between 1 byte and 64 MiB")]
    BadSize(usize),
    /// FILE is a symbolic link (which might point at a file that is not a firmware image).
    #[error("{} is a symbolic link; refusing to follow it: remove it, and the image is written there", .0.display())]
    Symlink(PathBuf),
    /// Something other than a regular file is at FILE.
    #[error("{} is not a regular file; name a file (it need not exist yet)", .0.display())]
    NotAFile(PathBuf),
    /// FILE holds more than the flash region.
    #[error("{} is {len} bytes, more than size={size}; raise size= or use another file", .path.display())]
    TooLarge { path: PathBuf, len: u64, size: usize },
    /// Manifestation writes the new image beside FILE, and could not here.
    #[error(
        "cannot create files in the directory of {} ({source}): a flashed image is written beside it first; \
         use a file in a directory this user can write",
        .path.display()
    )]
    Directory { path: PathBuf, source: std::io::Error },
    /// FILE exists but could not be inspected.
    #[error("cannot use {}: {source}", .path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

/// The DFU device (see the module docs).
pub struct DfuDevice {
    current: VirtualDevice<DfuFunction>,
    serial: String,
    enumeration: u32,
    /// Armed at the state machine's next deadline while one is pending.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl DfuDevice {
    /// A device in runtime mode running the image in `path` (none yet if the
    /// file does not exist; it is created by the first flash).
    pub fn open(path: &Path, options: &DfuOptions) -> Result<Self, DfuError> {
        if options.size == 0 || options.size > MAX_SIZE {
            return Err(DfuError::BadSize(options.size));
        }
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_symlink() => return Err(DfuError::Symlink(path.to_path_buf())),
            Ok(meta) if !meta.is_file() => return Err(DfuError::NotAFile(path.to_path_buf())),
            Ok(meta) if meta.len() > options.size as u64 => {
                return Err(DfuError::TooLarge { path: path.to_path_buf(), len: meta.len(), size: options.size });
            }
            Ok(_) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(DfuError::Io { path: path.to_path_buf(), source }),
        }
        let directory_error = |source| DfuError::Directory { path: path.to_path_buf(), source };
        let (dir, _, temp_path) = memory::create_temp_beside(path).map_err(directory_error)?;
        std::fs::remove_file(&temp_path).map_err(directory_error)?;
        let resolved = dir.canonicalize().unwrap_or(dir).join(path.file_name().unwrap_or_default());
        let serial = crate::identity::serial_number(&resolved);
        let memory = FileMemory::new(path.to_path_buf(), options.size);
        let function = runtime_function(memory, &serial);
        Ok(Self { current: VirtualDevice::new(function), serial, enumeration: 0, timer: None })
    }

    /// The mode the device is in now.
    pub fn mode(&self) -> Mode {
        self.current.function().mode()
    }

    /// The DFU state of the current mode's interface.
    pub fn state(&self) -> State {
        self.current.function().machine().state()
    }

    /// What the runtime mode runs (`None` in DFU mode).
    pub fn firmware(&self) -> Option<&Firmware> {
        self.current.function().firmware()
    }

    /// FILE.
    pub fn path(&self) -> &Path {
        self.current.function().machine().memory().path()
    }

    /// Becomes the device of `mode`: a new enumeration, nothing in flight.
    fn reenumerate(&mut self, mode: Mode) {
        let memory = self.current.function().machine().memory().clone();
        let function = match mode {
            Mode::Runtime => runtime_function(memory, &self.serial),
            Mode::Dfu => DfuFunction::bootloader(memory, &self.serial),
        };
        self.current = VirtualDevice::new(function);
        self.enumeration = self.enumeration.wrapping_add(1);
        self.timer = None;
        let product = self.current.summary().product;
        info!(?mode, enumeration = self.enumeration, %product, "dfu device re-enumerated");
    }

    /// Lets due timers fire; re-enumerates if the state machine asks. Ready
    /// when something changed (call again), Pending with the timer armed otherwise.
    fn poll_timers(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let machine = self.current.function_mut().machine_mut();
        machine.handle_timeout(tokio::time::Instant::now().into_std());
        if let Some(mode) = machine.take_reenumeration() {
            self.reenumerate(mode);
            // The server looks at `enumeration` after this round of polling.
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let Some(deadline) = machine.poll_timeout() else {
            self.timer = None;
            return Poll::Pending;
        };
        let wake_at = tokio::time::Instant::from_std(deadline);
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(wake_at)));
        if timer.deadline() != wake_at {
            timer.as_mut().reset(wake_at);
        }
        if timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        // The timer's word is the clock's: the deadline has passed.
        self.timer = None;
        machine.handle_timeout(deadline);
        Poll::Ready(())
    }
}

/// The runtime mode, running what FILE holds now.
fn runtime_function(memory: FileMemory, serial: &str) -> DfuFunction {
    let firmware = match memory.firmware() {
        Ok(image) => Firmware::of(&image),
        Err(error) => {
            warn!(path = %memory.path().display(), %error, "cannot read the firmware image");
            Firmware::Unreadable
        }
    };
    DfuFunction::runtime(memory, firmware, serial)
}

impl Device for DfuDevice {
    fn summary(&self) -> DeviceSummary {
        self.current.summary()
    }

    fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        self.current.endpoint_type(direction, number)
    }

    fn submit(&mut self, urb: Urb) {
        // Waiting for a reset that over USB/IP shows only as the host's requests after it.
        let now = tokio::time::Instant::now().into_std();
        self.current.function_mut().machine_mut().host_activity(now);
        self.current.submit(urb);
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        loop {
            // Completions first: a re-enumeration waits until the reply that
            // caused it has been collected.
            if let Poll::Ready(done) = self.current.poll_complete(cx) {
                return Poll::Ready(done);
            }
            if self.poll_timers(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }

    fn cancel(&mut self, seqnum: u32) {
        self.current.cancel(seqnum);
    }

    /// A USB reset: in DFU mode (or right after DFU_DETACH) the device
    /// re-enumerates at once, into runtime (or DFU) mode.
    fn reset(&mut self) {
        self.current.reset();
        if let Some(mode) = self.current.function_mut().machine_mut().take_reenumeration() {
            self.reenumerate(mode);
        }
    }

    fn enumeration(&self) -> u32 {
        self.enumeration
    }
}

#[cfg(test)]
mod tests;
