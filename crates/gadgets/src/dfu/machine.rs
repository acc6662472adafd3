//! The DFU 1.1 class state machine: what each request does in each state
//! (the spec's figure A.1 and the tables of its appendix A.2), without I/O
//! and without a clock.
//!
//! Time is an input: every call takes `now`, [`DfuMachine::poll_timeout`]
//! says when the machine next changes on its own (a block programmed, the
//! manifestation over, the detach or the self-reset due) and
//! [`DfuMachine::handle_timeout`] lets it. Images go to and come from a
//! [`Memory`]; the machine only decides when. The device around it
//! (`super::DfuDevice`) owns the descriptors, the clock and the re-enumeration.
//!
//! Where the spec leaves a choice, this device takes the one dfu-util expects:
//! * bitWillDetach: after DFU_DETACH the device leaves for DFU mode on its own,
//!   [`DETACH_DELAY`] later (so the request's status stage completes first);
//! * bitManifestationTolerant is clear: after manifestation the device waits
//!   in dfuMANIFEST-WAIT-RESET, answers DFU_GETSTATUS there (dfu-util asks,
//!   then resets), and returns to runtime mode on a USB reset, or once the
//!   host has been quiet for [`RESET_DELAY`] after it reported that state, or
//!   at the latest [`WAIT_RESET_LIMIT`] after entering it (as a board whose
//!   watchdog fires). Quiet, because a host's USB reset over USB/IP (vhci-hcd
//!   resets its port itself) reaches the device only as the descriptor reads
//!   and SET_CONFIGURATION that follow it: leaving while the host checks the
//!   device after its reset would fail the reset (dfu-util's exit status);
//!   the device calls [`DfuMachine::host_activity`] for every request;
//! * a block's outcome (accepted, or errADDRESS past the region's end) is
//!   reported by the DFU_GETSTATUS that follows it, not by stalling the
//!   download, so the host sees the status code;
//! * wBlockNum is not an address: blocks are taken in the order they come.

use std::time::{Duration, Instant};

use tracing::debug;
use usbwire_device::control::SetupPacket;
use usbwire_device::ControlReply;

/// The class requests (bRequest).
pub mod request {
    pub const DETACH: u8 = 0;
    pub const DNLOAD: u8 = 1;
    pub const UPLOAD: u8 = 2;
    pub const GETSTATUS: u8 = 3;
    pub const CLRSTATUS: u8 = 4;
    pub const GETSTATE: u8 = 5;
    pub const ABORT: u8 = 6;
}

/// The largest block DFU_DNLOAD and DFU_UPLOAD move (wTransferSize).
pub const TRANSFER_SIZE: u16 = 4096;
/// wDetachTimeOut: the most the device waits after DFU_DETACH.
pub const DETACH_TIMEOUT_MS: u16 = 1000;
/// When, after DFU_DETACH, the device detaches (bitWillDetach).
pub const DETACH_DELAY: Duration = Duration::from_millis(10);
/// bwPollTimeout while a block is programmed (dfuDNBUSY): about what a
/// microcontroller takes to erase and write 4 KiB of flash.
pub const BLOCK_POLL_TIMEOUT: Duration = Duration::from_millis(5);
/// bwPollTimeout of dfuMANIFEST.
pub const MANIFEST_POLL_TIMEOUT: Duration = Duration::from_millis(100);
/// How long the host must have been quiet, after dfuMANIFEST-WAIT-RESET was
/// reported, before the device resets itself: longer than a USB reset takes
/// to start (its first descriptor read) through a vhci-hcd port.
pub const RESET_DELAY: Duration = Duration::from_millis(500);
/// The longest the device stays in dfuMANIFEST-WAIT-RESET when nobody asks.
/// dfu-util asks about 1.1 s after entering dfuMANIFEST.
pub const WAIT_RESET_LIMIT: Duration = Duration::from_secs(3);

/// bState: the device's state (DFU 1.1 section 6.1.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    AppIdle = 0,
    AppDetach = 1,
    DfuIdle = 2,
    DnloadSync = 3,
    DnBusy = 4,
    DnloadIdle = 5,
    ManifestSync = 6,
    Manifest = 7,
    ManifestWaitReset = 8,
    UploadIdle = 9,
    Error = 10,
}

impl State {
    /// Every state, in bState order.
    pub const ALL: [Self; 11] = [
        Self::AppIdle,
        Self::AppDetach,
        Self::DfuIdle,
        Self::DnloadSync,
        Self::DnBusy,
        Self::DnloadIdle,
        Self::ManifestSync,
        Self::Manifest,
        Self::ManifestWaitReset,
        Self::UploadIdle,
        Self::Error,
    ];

    /// The runtime (application) states; the rest are DFU mode's.
    pub fn is_runtime(self) -> bool {
        matches!(self, Self::AppIdle | Self::AppDetach)
    }
}

/// bStatus: the outcome of the last request (DFU 1.1 section 6.1.2). Unknown
/// values survive, so the fuzz harness can hold any byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DfuStatus(pub u8);

impl DfuStatus {
    pub const OK: Self = Self(0x00);
    /// The file is not for this device.
    pub const ERR_TARGET: Self = Self(0x01);
    /// The file fails a vendor check.
    pub const ERR_FILE: Self = Self(0x02);
    /// Writing the memory failed.
    pub const ERR_WRITE: Self = Self(0x03);
    /// The programmed memory failed verification.
    pub const ERR_VERIFY: Self = Self(0x07);
    /// An address out of range: the image does not fit.
    pub const ERR_ADDRESS: Self = Self(0x08);
    /// A zero-length DFU_DNLOAD before the image is complete.
    pub const ERR_NOTDONE: Self = Self(0x09);
    /// A request the state does not allow: the device stalled it.
    pub const ERR_STALLEDPKT: Self = Self(0x0f);
}

/// What the device switches to when it re-enumerates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The application, with its DFU runtime interface.
    Runtime,
    /// The bootloader: one DFU interface.
    Dfu,
}

/// Where the images live: one region per alternate setting of the DFU-mode interface.
pub trait Memory {
    /// The most bytes alternate setting `alt` holds (0: no such region).
    fn capacity(&self, alt: u8) -> usize;

    /// Whether `len` bytes are a whole image for region `alt` (a zero-length
    /// DFU_DNLOAD before that is errNOTDONE).
    fn is_complete(&self, alt: u8, len: usize) -> bool {
        let _ = (alt, len);
        true
    }

    /// What region `alt` holds now (DFU_UPLOAD).
    fn read(&mut self, alt: u8) -> Result<Vec<u8>, DfuStatus>;

    /// Replaces region `alt` with `image` (manifestation). A failure is the status to report.
    fn program(&mut self, alt: u8, image: &[u8]) -> Result<(), DfuStatus>;
}

/// An upload in progress: the image read at its start, and how much has gone.
#[derive(Debug)]
struct Upload {
    image: Vec<u8>,
    sent: usize,
}

/// One DFU interface's state (see the module docs).
#[derive(Debug)]
pub struct DfuMachine<M> {
    memory: M,
    state: State,
    status: DfuStatus,
    alt: u8,
    /// The image downloaded so far.
    download: Vec<u8>,
    /// The last block's outcome, reported by the next DFU_GETSTATUS.
    block: Result<(), DfuStatus>,
    /// Whether the last block has been through dfuDNBUSY.
    block_programmed: bool,
    upload: Option<Upload>,
    /// When the machine next changes on its own; what changes depends on the state.
    deadline: Option<Instant>,
    /// The mode the device must re-enumerate as, once asked for.
    reenumerate: Option<Mode>,
    /// In dfuMANIFEST-WAIT-RESET: the latest self-reset, and whether the
    /// state was reported (from then on the host's quiet decides).
    wait_reset: Option<(Instant, bool)>,
}

impl<M: Memory> DfuMachine<M> {
    /// A machine in `mode`'s first state: appIDLE, or dfuIDLE on alternate setting 0.
    pub fn new(mode: Mode, memory: M) -> Self {
        Self {
            memory,
            state: if mode == Mode::Runtime { State::AppIdle } else { State::DfuIdle },
            status: DfuStatus::OK,
            alt: 0,
            download: Vec::new(),
            block: Ok(()),
            block_programmed: false,
            upload: None,
            deadline: None,
            reenumerate: None,
            wait_reset: None,
        }
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn status(&self) -> DfuStatus {
        self.status
    }

    pub fn memory(&self) -> &M {
        &self.memory
    }

    pub fn memory_mut(&mut self) -> &mut M {
        &mut self.memory
    }

    /// The selected alternate setting.
    pub fn alt(&self) -> u8 {
        self.alt
    }

    /// When [`handle_timeout`](Self::handle_timeout) should next be called.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.deadline
    }

    /// Lets the time pass: a programmed block, a finished manifestation, a
    /// detach or a self-reset that is due by `now` happens.
    pub fn handle_timeout(&mut self, now: Instant) {
        let Some(deadline) = self.deadline else { return };
        if now < deadline {
            return;
        }
        self.deadline = None;
        match self.state {
            State::DnBusy => {
                self.state = State::DnloadSync;
                self.block_programmed = true;
            }
            State::Manifest => {
                self.state = State::ManifestWaitReset;
                self.deadline = Some(deadline + WAIT_RESET_LIMIT);
                self.wait_reset = Some((deadline + WAIT_RESET_LIMIT, false));
            }
            State::AppDetach => self.reenumerate = Some(Mode::Dfu),
            State::ManifestWaitReset => self.reenumerate = Some(Mode::Runtime),
            _ => {}
        }
    }

    /// The host sent the device a request (any, standard ones included):
    /// in dfuMANIFEST-WAIT-RESET, once reported, the self-reset waits for
    /// [`RESET_DELAY`] of quiet from `now` (never past the limit).
    pub fn host_activity(&mut self, now: Instant) {
        if let (State::ManifestWaitReset, Some((limit, true))) = (self.state, self.wait_reset) {
            self.deadline = Some(limit.min(now + RESET_DELAY));
        }
    }

    /// The mode to re-enumerate as, once (after DFU_DETACH, after
    /// manifestation, after a USB reset in DFU mode).
    pub fn take_reenumeration(&mut self) -> Option<Mode> {
        self.reenumerate.take()
    }

    /// A USB reset (DFU 1.1 A.2): in appDETACH it enters DFU mode; in DFU
    /// mode it returns to the application (whose image is always whole here:
    /// manifestation replaces it in one step). In appIDLE nothing changes.
    pub fn usb_reset(&mut self) {
        self.deadline = None;
        self.upload = None;
        self.download = Vec::new();
        match self.state {
            State::AppIdle => {}
            State::AppDetach => self.reenumerate = Some(Mode::Dfu),
            _ => self.reenumerate = Some(Mode::Runtime),
        }
    }

    /// SET_INTERFACE on the DFU interface: allowed between transfers (dfuIDLE
    /// or dfuERROR) and only to a region the memory has.
    pub fn select_alt(&mut self, alt: u8) -> bool {
        let between_transfers = matches!(self.state, State::DfuIdle | State::Error);
        if !between_transfers || self.memory.capacity(alt) == 0 {
            debug!(alt, state = ?self.state, "alternate setting refused");
            return false;
        }
        self.alt = alt;
        true
    }

    /// A DFU class request to this interface (`data`: the OUT data stage).
    pub fn control(&mut self, now: Instant, setup: &SetupPacket, data: &[u8]) -> ControlReply {
        self.handle_timeout(now);
        if !direction_fits(setup) {
            return self.refuse(setup.request);
        }
        let reply = match (self.state, setup.request) {
            // Busy states answer nothing (DFU 1.1 A.2.5, A.2.8).
            (State::DnBusy | State::Manifest, _) => None,
            (state, request::GETSTATE) => Some(ControlReply::Data(vec![state as u8])),
            (State::AppIdle | State::AppDetach, request::GETSTATUS) => Some(self.status_reply(Duration::ZERO)),
            (State::AppIdle, request::DETACH) => {
                self.state = State::AppDetach;
                self.deadline = Some(now + DETACH_DELAY);
                Some(ack())
            }
            (State::DfuIdle | State::DnloadIdle, request::DNLOAD) => self.dnload(setup, data),
            (State::DfuIdle | State::UploadIdle, request::UPLOAD) => self.upload(setup),
            (State::DfuIdle | State::DnloadIdle | State::UploadIdle, request::ABORT) => {
                self.end_transfer();
                Some(ack())
            }
            (State::DfuIdle | State::DnloadIdle | State::UploadIdle | State::Error, request::GETSTATUS) => {
                Some(self.status_reply(Duration::ZERO))
            }
            (State::DnloadSync, request::GETSTATUS) => Some(self.block_status(now)),
            (State::ManifestSync, request::GETSTATUS) => Some(self.manifest(now)),
            (State::ManifestWaitReset, request::GETSTATUS) => {
                let limit = self.wait_reset.map_or(now + WAIT_RESET_LIMIT, |(limit, _)| limit);
                self.wait_reset = Some((limit, true));
                self.deadline = Some(limit.min(now + RESET_DELAY));
                Some(self.status_reply(Duration::ZERO))
            }
            (State::Error, request::CLRSTATUS) => {
                self.status = DfuStatus::OK;
                self.end_transfer();
                Some(ack())
            }
            _ => None,
        };
        reply.unwrap_or_else(|| self.refuse(setup.request))
    }

    /// A request the state does not allow: stall, and (DFU 1.1 A.2) leave
    /// appDETACH for appIDLE, enter dfuERROR from a DFU state.
    fn refuse(&mut self, request: u8) -> ControlReply {
        debug!(request, state = ?self.state, "dfu request stalled");
        match self.state {
            State::AppIdle => {}
            State::AppDetach => {
                self.state = State::AppIdle;
                self.deadline = None;
            }
            // Waiting for the reset: the device does nothing else.
            State::ManifestWaitReset => {}
            State::Error => {}
            _ => self.fail(DfuStatus::ERR_STALLEDPKT),
        }
        ControlReply::Stall
    }

    fn fail(&mut self, status: DfuStatus) {
        debug!(?status, state = ?self.state, "dfu error");
        self.state = State::Error;
        self.status = status;
        self.deadline = None;
        self.download = Vec::new();
        self.upload = None;
    }

    fn end_transfer(&mut self) {
        self.state = State::DfuIdle;
        self.download = Vec::new();
        self.upload = None;
    }

    /// The six bytes of DFU_GETSTATUS for the current state.
    fn status_reply(&self, poll_timeout: Duration) -> ControlReply {
        let millis = poll_timeout.as_millis().min(0x00ff_ffff) as u32;
        let [p0, p1, p2, _] = millis.to_le_bytes();
        ControlReply::Data(vec![self.status.0, p0, p1, p2, self.state as u8, 0])
    }

    fn dnload(&mut self, setup: &SetupPacket, data: &[u8]) -> Option<ControlReply> {
        if usize::from(setup.length) != data.len() || setup.length > TRANSFER_SIZE {
            return None;
        }
        if data.is_empty() {
            // In dfuIDLE a zero-length download is an error (nothing to manifest).
            if self.state != State::DnloadIdle {
                return None;
            }
            if !self.memory.is_complete(self.alt, self.download.len()) {
                self.fail(DfuStatus::ERR_NOTDONE);
                return Some(ControlReply::Stall);
            }
            self.state = State::ManifestSync;
            return Some(ack());
        }
        if self.state == State::DfuIdle {
            self.download = Vec::new();
        }
        let capacity = self.memory.capacity(self.alt);
        self.block = if self.download.len() + data.len() > capacity {
            Err(DfuStatus::ERR_ADDRESS)
        } else {
            self.download.extend_from_slice(data);
            Ok(())
        };
        self.block_programmed = false;
        self.state = State::DnloadSync;
        Some(ack())
    }

    /// DFU_GETSTATUS after a block: busy for a while the first time, then idle.
    fn block_status(&mut self, now: Instant) -> ControlReply {
        if let Err(status) = self.block {
            self.fail(status);
            return self.status_reply(Duration::ZERO);
        }
        if self.block_programmed {
            self.state = State::DnloadIdle;
            return self.status_reply(Duration::ZERO);
        }
        self.state = State::DnBusy;
        self.deadline = Some(now + BLOCK_POLL_TIMEOUT);
        self.status_reply(BLOCK_POLL_TIMEOUT)
    }

    /// DFU_GETSTATUS in dfuMANIFEST-SYNC: the image is programmed, and the
    /// device reports dfuMANIFEST until it is done.
    fn manifest(&mut self, now: Instant) -> ControlReply {
        let image = std::mem::take(&mut self.download);
        if let Err(status) = self.memory.program(self.alt, &image) {
            self.fail(status);
            return self.status_reply(Duration::ZERO);
        }
        self.state = State::Manifest;
        self.deadline = Some(now + MANIFEST_POLL_TIMEOUT);
        self.status_reply(MANIFEST_POLL_TIMEOUT)
    }

    fn upload(&mut self, setup: &SetupPacket) -> Option<ControlReply> {
        if setup.length > TRANSFER_SIZE {
            return None;
        }
        if self.state == State::DfuIdle {
            match self.memory.read(self.alt) {
                Ok(image) => self.upload = Some(Upload { image, sent: 0 }),
                Err(status) => {
                    self.fail(status);
                    return Some(ControlReply::Stall);
                }
            }
        }
        let upload = self.upload.as_mut()?;
        let wanted = usize::from(setup.length);
        let end = upload.image.len().min(upload.sent + wanted);
        let block = upload.image[upload.sent..end].to_vec();
        upload.sent = end;
        if block.len() < wanted {
            // A short block ends the upload.
            self.end_transfer();
        } else {
            self.state = State::UploadIdle;
        }
        Some(ControlReply::Data(block))
    }
}

fn ack() -> ControlReply {
    ControlReply::Data(Vec::new())
}

/// Whether the request's direction is the one its code needs (class, interface recipient).
fn direction_fits(setup: &SetupPacket) -> bool {
    let device_to_host = matches!(setup.request, request::UPLOAD | request::GETSTATUS | request::GETSTATE);
    setup.request_type == if device_to_host { 0xa1 } else { 0x21 }
}

/// A memory held in RAM, with `capacities[alt]` bytes per alternate setting:
/// for the state machine's tests and its fuzz target (the device keeps its
/// firmware in a file, see `super::FileMemory`).
#[derive(Clone, Debug, Default)]
pub struct RamMemory {
    pub regions: Vec<Vec<u8>>,
    pub capacities: Vec<usize>,
}

impl RamMemory {
    pub fn new(capacities: &[usize]) -> Self {
        Self { regions: vec![Vec::new(); capacities.len()], capacities: capacities.to_vec() }
    }
}

impl Memory for RamMemory {
    fn capacity(&self, alt: u8) -> usize {
        self.capacities.get(usize::from(alt)).copied().unwrap_or(0)
    }

    fn read(&mut self, alt: u8) -> Result<Vec<u8>, DfuStatus> {
        self.regions.get(usize::from(alt)).cloned().ok_or(DfuStatus::ERR_ADDRESS)
    }

    fn program(&mut self, alt: u8, image: &[u8]) -> Result<(), DfuStatus> {
        if image.len() > self.capacity(alt) {
            return Err(DfuStatus::ERR_ADDRESS);
        }
        let region = self.regions.get_mut(usize::from(alt)).ok_or(DfuStatus::ERR_ADDRESS)?;
        *region = image.to_vec();
        Ok(())
    }
}

#[cfg(test)]
mod tests;
