//! cargo-fuzz entry point; the harness and its invariants are in `src/tls_differential.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| usbwire_fuzz::tls_differential(data));
