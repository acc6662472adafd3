//! cargo-fuzz entry point; the harness and its invariants are in `src/redir_bridge.rs`.
#![no_main]

/// Counts live heap bytes for the harness's memory bound.
#[global_allocator]
static ALLOCATOR: usbwire_fuzz::CountingAllocator = usbwire_fuzz::CountingAllocator;

libfuzzer_sys::fuzz_target!(|data: &[u8]| usbwire_fuzz::redir_bridge(data));
