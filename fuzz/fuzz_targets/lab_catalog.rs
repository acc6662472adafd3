//! cargo-fuzz entry point; the harness and its invariants are in `src/lab.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| usbwire_fuzz::lab_catalog(data));
