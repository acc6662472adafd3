//! What every gadget says about who made it: the vendor id, the manufacturer
//! string, and a stable serial number for a gadget backed by a file.
//!
//! It sits below every gadget module. It is not for a gadget's own product id
//! or descriptors, which live with the gadget.

/// The vendor id of every gadget (pid.codes, the open-source hardware vendor id).
pub const VENDOR_ID: u16 = 0x1209;

/// The manufacturer string of every gadget.
pub(crate) const MANUFACTURER: &str = "usbwire";

/// A stable serial number for a backing file's path (so the host recognises
/// the device across restarts): FNV-1a of the canonical path (the path as given
/// if it does not exist), as 16 hex digits.
pub(crate) fn serial_number(path: &std::path::Path) -> String {
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let hash = canonical
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("{hash:016X}")
}
