//! The storage extension's words on the wire (`docs/protocol.md` §5.7): the
//! offer entry that asks a usbwire server to run mass-storage commands in
//! stages, and the two transfer-flag bits a client sets on the URBs of those
//! stages. What the flags ask of the server is enforced by its stage gate
//! (`usbwire-server`'s `stage_gate`); what a client does with them (completing
//! a command block at once, reading the status ahead) is the client's
//! accelerator. This module is only the vocabulary both agree on, so neither
//! writes the bits or the entry by hand.

use crate::urb::TransferFlags;

/// The offer entry, and the server's answer when it runs stages.
pub const OFFER: &str = "storage";

/// Run this URB only once every earlier `STAGE` URB of the import has
/// completed, in the order the commands arrived: the one-stage-at-a-time
/// discipline of a Bulk-Only host (command block, data, status), kept by the
/// server while the client sends the stages without waiting.
pub const STAGE: u32 = 0x4000_0000;

/// With [`STAGE`]: run this URB only if the `STAGE` URB before it completed
/// with status 0. Otherwise it is not run at all and completes at once with
/// `-EPROTO` ([`SKIPPED`]): a stage after a failed one must not reach the device.
pub const AFTER_SUCCESS: u32 = 0x2000_0000;

/// Both bits: what the server takes off before the device sees the URB.
pub const FLAGS: u32 = STAGE | AFTER_SUCCESS;

/// The status of a URB skipped because the stage before it failed: `-EPROTO`,
/// which usb-storage takes as a transport error and answers with a reset.
pub const SKIPPED: crate::Status = crate::Status::EPROTO;

/// Whether a transform offer (or answer) names the extension.
pub fn offered(text: &str) -> bool {
    text.split(',').any(|entry| entry.trim() == OFFER)
}

/// Whether a URB's flags ask for the stage gate.
pub fn is_stage(flags: TransferFlags) -> bool {
    flags.contains(STAGE)
}

/// Whether a URB's flags ask to run only after a successful stage.
pub fn after_success(flags: TransferFlags) -> bool {
    flags.contains(STAGE | AFTER_SUCCESS)
}

/// The flags with the extension's bits taken off, as the device must see them.
pub fn device_flags(flags: TransferFlags) -> TransferFlags {
    TransferFlags(flags.0 & !FLAGS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offer_is_found_among_other_entries_and_only_whole() {
        assert!(offered("storage"));
        assert!(offered("zstd,resume, storage ,keepalive"));
        assert!(!offered("storages,zstd"));
        assert!(!offered(""));
    }

    #[test]
    fn the_bits_stay_clear_of_every_kernel_urb_flag() {
        // Linux's URB_* flags that vhci passes on all sit below bit 24.
        assert_eq!(FLAGS & 0x00ff_ffff, 0);
        let kernel = TransferFlags(TransferFlags::DIR_IN | TransferFlags::SHORT_NOT_OK);
        let flagged = TransferFlags(kernel.0 | STAGE | AFTER_SUCCESS);
        assert!(is_stage(flagged) && after_success(flagged));
        assert_eq!(device_flags(flagged), kernel);
        assert!(!after_success(TransferFlags(AFTER_SUCCESS)), "AFTER_SUCCESS means nothing without STAGE");
    }
}
