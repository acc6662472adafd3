//! Bounds on what a peer may make us allocate or parse.

/// Explicit limits applied while decoding untrusted input.
///
/// Defaults are generous enough for every real driver seen (usb-storage and
/// uas submit transfers of a few MiB through vhci's scatter-gather path) and
/// small enough that one connection cannot exhaust memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest `transfer_buffer_length` accepted, in bytes.
    pub max_transfer_length: u32,
    /// Largest `number_of_packets` of an isochronous URB (the kernel's `USBIP_MAX_ISO_PACKETS`).
    pub max_iso_packets: u32,
    /// Largest number of devices accepted in an `OP_REP_DEVLIST`.
    pub max_devices: u32,
}

impl Limits {
    /// The kernel stub's limit on isochronous packets per URB.
    pub const KERNEL_MAX_ISO_PACKETS: u32 = 1024;
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_transfer_length: 16 * 1024 * 1024, max_iso_packets: Self::KERNEL_MAX_ISO_PACKETS, max_devices: 1024 }
    }
}
