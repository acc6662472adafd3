//! cargo-fuzz entry point; the harness and its invariants are in `src/recording.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| usbwire_fuzz::recording(data));
