//! The DFU device as one [`Function`] per mode: the descriptors it shows in
//! runtime and in DFU mode, and where its ep0 requests go (chapter 9 is
//! [`VirtualDevice`](usbwire_device::VirtualDevice)'s, the DFU class requests
//! the state machine's).

use std::task::{Context, Poll};

use usbwire_device::control::{Recipient, RequestKind, SetupPacket};
use usbwire_device::descriptor::{ConfigurationBuilder, DeviceDescriptor};
use usbwire_device::{Completion, CompletionQueue, ControlReply, DescriptorSet, Function, Speed, Status, Urb};

use super::ids::{DFU_PRODUCT_ID, RUNTIME_PRODUCT_ID};
use super::machine::{DfuMachine, Mode, DETACH_TIMEOUT_MS, TRANSFER_SIZE};
use super::memory::{hex, sha256, FileMemory};
use crate::identity::{MANUFACTURER, VENDOR_ID};

/// The application-specific class (DFU 1.1 section 4.2.1).
const CLASS_APPLICATION: u8 = 0xfe;
/// The DFU subclass.
const SUBCLASS_DFU: u8 = 0x01;
const PROTOCOL_RUNTIME: u8 = 0x01;
const PROTOCOL_DFU_MODE: u8 = 0x02;
/// The DFU functional descriptor's type.
const DFU_FUNCTIONAL: u8 = 0x21;
/// bmAttributes: bitCanDnload | bitCanUpload | bitWillDetach (not manifestation tolerant).
pub const DFU_ATTRIBUTES: u8 = 0x01 | 0x02 | 0x08;
/// bcdDFUVersion 1.1.
const DFU_VERSION: u16 = 0x0110;

/// The runtime interface numbers: a vendor interface (what the "application"
/// does) and the DFU runtime interface.
pub const RUNTIME_VENDOR_INTERFACE: u8 = 0;
pub const RUNTIME_DFU_INTERFACE: u8 = 1;
/// DFU mode has one interface.
pub const DFU_MODE_INTERFACE: u8 = 0;

/// Vendor request (device recipient, IN) of the runtime mode: the SHA-256 of
/// the image it runs (32 bytes), for tests and scripts that want more than the
/// product string's 8 digits.
pub const REQUEST_FIRMWARE_SHA256: u8 = 0x01;

/// The product string of each mode (runtime: with the image's hash).
pub const BOOTLOADER_PRODUCT: &str = "usbwire DFU bootloader";

/// What the runtime mode "runs": the image in FILE when it enumerated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Firmware {
    Image {
        len: usize,
        sha256: [u8; 32],
    },
    /// FILE could not be read (the product string says so; the log says why).
    Unreadable,
}

impl Firmware {
    /// The runtime product string: "usbwire DFU demo (fw 1a2b3c4d)".
    pub fn product(&self) -> String {
        match self {
            Self::Image { len: 0, .. } => "usbwire DFU demo (no firmware)".to_owned(),
            Self::Image { sha256, .. } => format!("usbwire DFU demo (fw {})", &hex(sha256)[..8]),
            Self::Unreadable => "usbwire DFU demo (firmware unreadable)".to_owned(),
        }
    }

    pub(super) fn of(image: &[u8]) -> Self {
        Self::Image { len: image.len(), sha256: sha256(image) }
    }
}

/// One mode of the DFU device.
pub(super) struct DfuFunction {
    descriptors: DescriptorSet,
    mode: Mode,
    firmware: Option<Firmware>,
    machine: DfuMachine<FileMemory>,
    /// URBs for endpoints the device lacks (VirtualDevice filters them; kept for the contract).
    done: CompletionQueue,
}

impl DfuFunction {
    /// The runtime mode, running `firmware`.
    pub(super) fn runtime(memory: FileMemory, firmware: Firmware, serial: &str) -> Self {
        let speed = Speed::HIGH;
        let configuration = ConfigurationBuilder::new(speed, 100)
            .interface(RUNTIME_VENDOR_INTERFACE, 0, 0xff, 0, 0, 4)
            .interface(RUNTIME_DFU_INTERFACE, 0, CLASS_APPLICATION, SUBCLASS_DFU, PROTOCOL_RUNTIME, 5)
            .raw(&functional_descriptor())
            .build();
        let strings = vec![
            MANUFACTURER.to_owned(),
            firmware.product(),
            serial.to_owned(),
            "usbwire DFU demo application".to_owned(),
            "usbwire DFU runtime".to_owned(),
        ];
        let device = DeviceDescriptor::for_speed(speed, VENDOR_ID, RUNTIME_PRODUCT_ID);
        Self {
            descriptors: DescriptorSet::new(speed, device, configuration, strings),
            mode: Mode::Runtime,
            firmware: Some(firmware),
            machine: DfuMachine::new(Mode::Runtime, memory),
            done: CompletionQueue::new(),
        }
    }

    /// The DFU mode (bootloader): alternate settings 0 "flash" and 1 "option bytes".
    pub(super) fn bootloader(memory: FileMemory, serial: &str) -> Self {
        let speed = Speed::HIGH;
        let configuration = ConfigurationBuilder::new(speed, 100)
            .interface(DFU_MODE_INTERFACE, 0, CLASS_APPLICATION, SUBCLASS_DFU, PROTOCOL_DFU_MODE, 4)
            .alternate(DFU_MODE_INTERFACE, 1, 0, CLASS_APPLICATION, SUBCLASS_DFU, PROTOCOL_DFU_MODE, 5)
            .raw(&functional_descriptor())
            .build();
        let strings = vec![
            MANUFACTURER.to_owned(),
            BOOTLOADER_PRODUCT.to_owned(),
            serial.to_owned(),
            "flash".to_owned(),
            "option bytes".to_owned(),
        ];
        let device = DeviceDescriptor::for_speed(speed, VENDOR_ID, DFU_PRODUCT_ID);
        Self {
            descriptors: DescriptorSet::new(speed, device, configuration, strings),
            mode: Mode::Dfu,
            firmware: None,
            machine: DfuMachine::new(Mode::Dfu, memory),
            done: CompletionQueue::new(),
        }
    }

    pub(super) fn mode(&self) -> Mode {
        self.mode
    }

    /// What the runtime mode runs (`None` in DFU mode).
    pub(super) fn firmware(&self) -> Option<&Firmware> {
        self.firmware.as_ref()
    }

    pub(super) fn machine(&self) -> &DfuMachine<FileMemory> {
        &self.machine
    }

    pub(super) fn machine_mut(&mut self) -> &mut DfuMachine<FileMemory> {
        &mut self.machine
    }

    fn dfu_interface(&self) -> u8 {
        match self.mode {
            Mode::Runtime => RUNTIME_DFU_INTERFACE,
            Mode::Dfu => DFU_MODE_INTERFACE,
        }
    }
}

/// The DFU functional descriptor (DFU 1.1 section 4.1.3), the same in both modes.
fn functional_descriptor() -> [u8; 9] {
    let [detach_lo, detach_hi] = DETACH_TIMEOUT_MS.to_le_bytes();
    let [size_lo, size_hi] = TRANSFER_SIZE.to_le_bytes();
    let [version_lo, version_hi] = DFU_VERSION.to_le_bytes();
    [9, DFU_FUNCTIONAL, DFU_ATTRIBUTES, detach_lo, detach_hi, size_lo, size_hi, version_lo, version_hi]
}

impl Function for DfuFunction {
    fn descriptors(&self) -> &DescriptorSet {
        &self.descriptors
    }

    fn control(&mut self, setup: &SetupPacket, data: &[u8]) -> ControlReply {
        let to_dfu_interface = setup.kind() == RequestKind::Class
            && setup.recipient() == Recipient::Interface
            && (setup.index & 0xff) as u8 == self.dfu_interface();
        if to_dfu_interface {
            let now = tokio::time::Instant::now().into_std();
            return self.machine.control(now, setup, data);
        }
        match (&self.firmware, setup.request_type, setup.request) {
            (Some(Firmware::Image { sha256, .. }), 0xc0, REQUEST_FIRMWARE_SHA256) => {
                ControlReply::Data(sha256.to_vec())
            }
            _ => ControlReply::Stall,
        }
    }

    fn set_interface(&mut self, interface: u8, alt_setting: u8) -> bool {
        match self.mode {
            Mode::Dfu if interface == DFU_MODE_INTERFACE => self.machine.select_alt(alt_setting),
            _ => alt_setting == 0,
        }
    }

    fn submit(&mut self, urb: Urb) {
        self.done.push(urb.complete_with(Status::EPIPE));
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        self.done.poll_pop(cx)
    }

    fn cancel(&mut self, _seqnum: u32) {}

    /// A USB reset: the state machine decides whether the device re-enumerates.
    fn reset(&mut self) {
        self.done.clear();
        self.machine.usb_reset();
    }
}
