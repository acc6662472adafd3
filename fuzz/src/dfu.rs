//! The `dfu_control` harness: what a hostile host sends a virtual DFU
//! device's class interface, through `usbwire_gadgets::dfu::machine` on a
//! virtual clock, with the device's re-enumerations followed.
//!
//! Input: `[size] ++ ops`. `size` picks the flash region (64 bytes to 16 KiB,
//! holding an image of its own size / 2 to upload). Each op is one byte
//! (taken modulo 6) and its operands:
//! 0 a control request: 8 setup bytes, then for an OUT request `wLength`
//!   bytes of data (fewer if the input ends, which the device must refuse);
//! 1 time passes: one byte of milliseconds; 2 SET_INTERFACE: one byte;
//! 3 a USB reset; 4 the device re-enumerates if it asked to;
//! 5 time passes to the machine's next deadline.
//!
//! Invariants: no panic; DFU_GETSTATUS answers six bytes naming the state and
//! status the machine is in; DFU_GETSTATE answers the state; an UPLOAD never
//! answers more than `wLength`, and a finished upload is exactly what the
//! region held; a manifested image is exactly the blocks the device accepted;
//! no region ever holds more than its capacity; runtime states only in
//! runtime mode, DFU states only in DFU mode.

use std::time::{Duration, Instant};

use usbwire_device::control::SetupPacket;
use usbwire_device::ControlReply;
use usbwire_gadgets::dfu::machine::{request, DfuMachine, Memory, Mode, RamMemory, State, TRANSFER_SIZE};

/// Option bytes' size, as the device has them.
const SECOND_REGION: usize = 16;

/// What the harness expects, followed alongside the machine.
struct Model {
    mode: Mode,
    /// Blocks accepted since the download began.
    download: Vec<u8>,
    /// An upload in progress: the region when it began, and what came so far.
    upload: Option<(Vec<u8>, Vec<u8>)>,
}

pub fn dfu_control(data: &[u8]) {
    let Some((&size, mut ops)) = data.split_first() else { return };
    let capacity = 64 * (usize::from(size) + 1);
    let mut memory = RamMemory::new(&[capacity, SECOND_REGION]);
    memory.regions[0] = (0..capacity / 2).map(|i| (i * 31 % 251) as u8).collect();
    let mut now = Instant::now();
    let mut model = Model { mode: Mode::Runtime, download: Vec::new(), upload: None };
    let mut machine = DfuMachine::new(Mode::Runtime, memory);
    while let Some((&op, rest)) = ops.split_first() {
        ops = rest;
        match op % 6 {
            0 => {
                let Some((raw, rest)) = ops.split_first_chunk::<8>() else { return };
                let setup = SetupPacket::parse(raw);
                let wanted = if setup.is_in() { 0 } else { usize::from(setup.length) };
                let (data, rest) = rest.split_at(wanted.min(rest.len()));
                ops = rest;
                control(&mut machine, &mut model, now, &setup, data);
            }
            1 => {
                let Some((&millis, rest)) = ops.split_first() else { return };
                ops = rest;
                now += Duration::from_millis(u64::from(millis));
                machine.handle_timeout(now);
            }
            2 => {
                let Some((&alt, rest)) = ops.split_first() else { return };
                ops = rest;
                let before = machine.alt();
                if machine.select_alt(alt) {
                    assert!(machine.memory().capacity(alt) > 0, "alt {alt} has no region");
                } else {
                    assert_eq!(machine.alt(), before, "a refused alt changes nothing");
                }
            }
            3 => machine.usb_reset(),
            4 => {}
            _ => {
                if let Some(deadline) = machine.poll_timeout() {
                    now = now.max(deadline);
                    machine.handle_timeout(now);
                }
            }
        }
        if let Some(mode) = machine.take_reenumeration() {
            // The device comes back as `mode`, with the same memory.
            let memory = machine.memory().clone();
            machine = DfuMachine::new(mode, memory);
            model = Model { mode, download: Vec::new(), upload: None };
        }
        check_always(&machine, &model);
    }
}

fn control(machine: &mut DfuMachine<RamMemory>, model: &mut Model, now: Instant, setup: &SetupPacket, data: &[u8]) {
    let before = machine.state();
    let alt = machine.alt();
    machine.handle_timeout(now);
    let settled = machine.state();
    let reply = machine.control(now, setup, data);
    let answered = reply != ControlReply::Stall;
    let ControlReply::Data(bytes) = reply else { return after_stall(machine, model) };
    match setup.request {
        request::GETSTATUS if setup.request_type == 0xa1 && !matches!(settled, State::DnBusy | State::Manifest) => {
            assert_eq!(bytes.len(), 6);
            assert_eq!((bytes[0], bytes[4]), (machine.status().0, machine.state() as u8));
            if machine.state() == State::Manifest {
                let programmed = &machine.memory().regions[usize::from(alt)];
                assert_eq!(programmed, &model.download, "the manifested image is the accepted blocks");
            }
        }
        request::GETSTATE if setup.request_type == 0xa1 => assert_eq!(bytes, vec![machine.state() as u8]),
        request::UPLOAD if setup.request_type == 0xa1 => {
            assert!(bytes.len() <= usize::from(setup.length), "upload beyond wLength");
            if settled == State::DfuIdle {
                let region = machine.memory().regions[usize::from(alt)].clone();
                model.upload = Some((region, Vec::new()));
            }
            let Some((expected, got)) = model.upload.as_mut() else { panic!("an upload answered from {before:?}") };
            got.extend_from_slice(&bytes);
            assert!(expected.starts_with(got), "upload differs from the region");
            if machine.state() == State::DfuIdle {
                assert_eq!(got, expected, "a finished upload is the whole region");
                model.upload = None;
            }
        }
        request::DNLOAD if setup.request_type == 0x21 && answered && !data.is_empty() => {
            if settled == State::DfuIdle {
                model.download.clear();
            }
            if model.download.len() + data.len() <= machine.memory().capacity(alt) {
                model.download.extend_from_slice(data);
            }
            assert!(data.len() <= usize::from(TRANSFER_SIZE));
        }
        _ => {}
    }
    if matches!(machine.state(), State::DfuIdle | State::Error) {
        model.upload = None;
    }
}

fn after_stall(machine: &DfuMachine<RamMemory>, model: &mut Model) {
    if matches!(machine.state(), State::DfuIdle | State::Error | State::AppIdle) {
        model.upload = None;
    }
}

fn check_always(machine: &DfuMachine<RamMemory>, model: &Model) {
    assert_eq!(
        machine.state().is_runtime(),
        model.mode == Mode::Runtime,
        "{:?} in {:?} mode",
        machine.state(),
        model.mode
    );
    for (alt, region) in machine.memory().regions.iter().enumerate() {
        assert!(region.len() <= machine.memory().capacity(alt as u8), "region {alt} over capacity");
    }
    if let Some(deadline) = machine.poll_timeout() {
        let expected =
            matches!(machine.state(), State::AppDetach | State::DnBusy | State::Manifest | State::ManifestWaitReset);
        assert!(expected, "a deadline ({deadline:?}) in {:?}", machine.state());
    }
}
