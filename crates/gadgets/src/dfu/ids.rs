//! The DFU device's product ids, one per mode: what its descriptors show and
//! what a firmware image's DFU suffix must name to be taken.
//!
//! It sits below the function (descriptors) and the memory (suffix check).
//! It is not for the vendor id, which every gadget shares (`crate::identity`).

/// The product id in runtime mode.
pub const RUNTIME_PRODUCT_ID: u16 = 0x0006;
/// The product id in DFU mode (the bootloader).
pub const DFU_PRODUCT_ID: u16 = 0x0007;
