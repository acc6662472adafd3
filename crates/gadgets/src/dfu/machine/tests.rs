//! The state machine against DFU 1.1's state diagram (figure A.1, tables A.2):
//! every state × every request, then the timed paths and the errors.

use super::*;

/// The requests of the table, with the setup a host sends for each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Req {
    Detach,
    Dnload,
    /// DFU_DNLOAD with wLength 0: the end of the image.
    DnloadEnd,
    Upload,
    GetStatus,
    ClrStatus,
    GetState,
    Abort,
}

const REQUESTS: [Req; 8] =
    [Req::Detach, Req::Dnload, Req::DnloadEnd, Req::Upload, Req::GetStatus, Req::ClrStatus, Req::GetState, Req::Abort];

/// Bytes in region 0 of the test memory, and the block size the tests use.
const IMAGE: usize = 64;
const BLOCK: u16 = 16;

fn setup(request_type: u8, request: u8, value: u16, length: u16) -> SetupPacket {
    SetupPacket { request_type, request, value, index: 0, length }
}

fn send(machine: &mut DfuMachine<RamMemory>, now: Instant, req: Req) -> ControlReply {
    let block = [0x5a; BLOCK as usize];
    let (setup, data): (SetupPacket, &[u8]) = match req {
        Req::Detach => (setup(0x21, request::DETACH, DETACH_TIMEOUT_MS, 0), &[]),
        Req::Dnload => (setup(0x21, request::DNLOAD, 0, BLOCK), &block),
        Req::DnloadEnd => (setup(0x21, request::DNLOAD, 1, 0), &[]),
        Req::Upload => (setup(0xa1, request::UPLOAD, 0, BLOCK), &[]),
        Req::GetStatus => (setup(0xa1, request::GETSTATUS, 0, 6), &[]),
        Req::ClrStatus => (setup(0x21, request::CLRSTATUS, 0, 0), &[]),
        Req::GetState => (setup(0xa1, request::GETSTATE, 0, 1), &[]),
        Req::Abort => (setup(0x21, request::ABORT, 0, 0), &[]),
    };
    machine.control(now, &setup, data)
}

fn memory() -> RamMemory {
    let mut memory = RamMemory::new(&[1024, 16]);
    memory.regions[0] = (0..IMAGE as u8).collect();
    memory
}

/// A machine brought into `state` by the requests a host would send, and the time it is there.
fn machine_in(state: State) -> (DfuMachine<RamMemory>, Instant) {
    let mut now = Instant::now();
    let mode = if state.is_runtime() { Mode::Runtime } else { Mode::Dfu };
    let mut machine = DfuMachine::new(mode, memory());
    let path: &[Req] = match state {
        State::AppIdle | State::DfuIdle => &[],
        State::AppDetach => &[Req::Detach],
        State::DnloadSync => &[Req::Dnload],
        State::DnBusy => &[Req::Dnload, Req::GetStatus],
        State::DnloadIdle | State::ManifestSync | State::Manifest | State::ManifestWaitReset => {
            &[Req::Dnload, Req::GetStatus, Req::GetStatus]
        }
        State::UploadIdle => &[Req::Upload],
        State::Error => &[Req::ClrStatus],
    };
    for &req in path {
        if machine.state() == State::DnBusy {
            now += BLOCK_POLL_TIMEOUT;
        }
        send(&mut machine, now, req);
    }
    if matches!(state, State::ManifestSync | State::Manifest | State::ManifestWaitReset) {
        send(&mut machine, now, Req::DnloadEnd);
    }
    if matches!(state, State::Manifest | State::ManifestWaitReset) {
        send(&mut machine, now, Req::GetStatus);
    }
    if state == State::ManifestWaitReset {
        now += MANIFEST_POLL_TIMEOUT;
        machine.handle_timeout(now);
    }
    assert_eq!(machine.state(), state, "setting up {state:?}");
    // Busy states are met before their poll timeout ends; the others a moment later.
    if !matches!(state, State::DnBusy | State::Manifest) {
        now += Duration::from_micros(1);
    }
    (machine, now)
}

use State::{
    AppDetach, AppIdle, DfuIdle, DnBusy, DnloadIdle, DnloadSync, Error, Manifest, ManifestSync, ManifestWaitReset,
    UploadIdle,
};

/// (state, request, answered (false: stalled), next state). The status after
/// a stall in DFU mode is errSTALLEDPKT; in runtime mode, in dfuERROR (which
/// keeps its status) and in dfuMANIFEST-WAIT-RESET it does not change.
#[rustfmt::skip]
const TABLE: &[(State, Req, bool, State)] = &[
    // A.2.1 appIDLE: DETACH starts the detach; GETSTATUS/GETSTATE answered; the rest stall.
    (AppIdle, Req::Detach, true, AppDetach),
    (AppIdle, Req::Dnload, false, AppIdle),
    (AppIdle, Req::DnloadEnd, false, AppIdle),
    (AppIdle, Req::Upload, false, AppIdle),
    (AppIdle, Req::GetStatus, true, AppIdle),
    (AppIdle, Req::ClrStatus, false, AppIdle),
    (AppIdle, Req::GetState, true, AppIdle),
    (AppIdle, Req::Abort, false, AppIdle),
    // A.2.2 appDETACH: any other request stalls and returns to appIDLE.
    (AppDetach, Req::Detach, false, AppIdle),
    (AppDetach, Req::Dnload, false, AppIdle),
    (AppDetach, Req::DnloadEnd, false, AppIdle),
    (AppDetach, Req::Upload, false, AppIdle),
    (AppDetach, Req::GetStatus, true, AppDetach),
    (AppDetach, Req::ClrStatus, false, AppIdle),
    (AppDetach, Req::GetState, true, AppDetach),
    (AppDetach, Req::Abort, false, AppIdle),
    // A.2.3 dfuIDLE.
    (DfuIdle, Req::Detach, false, Error),
    (DfuIdle, Req::Dnload, true, DnloadSync),
    (DfuIdle, Req::DnloadEnd, false, Error),
    (DfuIdle, Req::Upload, true, UploadIdle),
    (DfuIdle, Req::GetStatus, true, DfuIdle),
    (DfuIdle, Req::ClrStatus, false, Error),
    (DfuIdle, Req::GetState, true, DfuIdle),
    (DfuIdle, Req::Abort, true, DfuIdle),
    // A.2.4 dfuDNLOAD-SYNC: only the status solicitations.
    (DnloadSync, Req::Detach, false, Error),
    (DnloadSync, Req::Dnload, false, Error),
    (DnloadSync, Req::DnloadEnd, false, Error),
    (DnloadSync, Req::Upload, false, Error),
    (DnloadSync, Req::GetStatus, true, DnBusy),
    (DnloadSync, Req::ClrStatus, false, Error),
    (DnloadSync, Req::GetState, true, DnloadSync),
    (DnloadSync, Req::Abort, false, Error),
    // A.2.5 dfuDNBUSY: nothing before the poll timeout.
    (DnBusy, Req::Detach, false, Error),
    (DnBusy, Req::Dnload, false, Error),
    (DnBusy, Req::DnloadEnd, false, Error),
    (DnBusy, Req::Upload, false, Error),
    (DnBusy, Req::GetStatus, false, Error),
    (DnBusy, Req::ClrStatus, false, Error),
    (DnBusy, Req::GetState, false, Error),
    (DnBusy, Req::Abort, false, Error),
    // A.2.6 dfuDNLOAD-IDLE.
    (DnloadIdle, Req::Detach, false, Error),
    (DnloadIdle, Req::Dnload, true, DnloadSync),
    (DnloadIdle, Req::DnloadEnd, true, ManifestSync),
    (DnloadIdle, Req::Upload, false, Error),
    (DnloadIdle, Req::GetStatus, true, DnloadIdle),
    (DnloadIdle, Req::ClrStatus, false, Error),
    (DnloadIdle, Req::GetState, true, DnloadIdle),
    (DnloadIdle, Req::Abort, true, DfuIdle),
    // A.2.7 dfuMANIFEST-SYNC (not manifestation tolerant).
    (ManifestSync, Req::Detach, false, Error),
    (ManifestSync, Req::Dnload, false, Error),
    (ManifestSync, Req::DnloadEnd, false, Error),
    (ManifestSync, Req::Upload, false, Error),
    (ManifestSync, Req::GetStatus, true, Manifest),
    (ManifestSync, Req::ClrStatus, false, Error),
    (ManifestSync, Req::GetState, true, ManifestSync),
    (ManifestSync, Req::Abort, false, Error),
    // A.2.8 dfuMANIFEST: nothing before the poll timeout.
    (Manifest, Req::Detach, false, Error),
    (Manifest, Req::Dnload, false, Error),
    (Manifest, Req::DnloadEnd, false, Error),
    (Manifest, Req::Upload, false, Error),
    (Manifest, Req::GetStatus, false, Error),
    (Manifest, Req::ClrStatus, false, Error),
    (Manifest, Req::GetState, false, Error),
    (Manifest, Req::Abort, false, Error),
    // A.2.9 dfuMANIFEST-WAIT-RESET: waits for the reset; answers the status (dfu-util asks).
    (ManifestWaitReset, Req::Detach, false, ManifestWaitReset),
    (ManifestWaitReset, Req::Dnload, false, ManifestWaitReset),
    (ManifestWaitReset, Req::DnloadEnd, false, ManifestWaitReset),
    (ManifestWaitReset, Req::Upload, false, ManifestWaitReset),
    (ManifestWaitReset, Req::GetStatus, true, ManifestWaitReset),
    (ManifestWaitReset, Req::ClrStatus, false, ManifestWaitReset),
    (ManifestWaitReset, Req::GetState, true, ManifestWaitReset),
    (ManifestWaitReset, Req::Abort, false, ManifestWaitReset),
    // A.2.10 dfuUPLOAD-IDLE (a full block keeps it there).
    (UploadIdle, Req::Detach, false, Error),
    (UploadIdle, Req::Dnload, false, Error),
    (UploadIdle, Req::DnloadEnd, false, Error),
    (UploadIdle, Req::Upload, true, UploadIdle),
    (UploadIdle, Req::GetStatus, true, UploadIdle),
    (UploadIdle, Req::ClrStatus, false, Error),
    (UploadIdle, Req::GetState, true, UploadIdle),
    (UploadIdle, Req::Abort, true, DfuIdle),
    // A.2.11 dfuERROR: only CLRSTATUS leaves it.
    (Error, Req::Detach, false, Error),
    (Error, Req::Dnload, false, Error),
    (Error, Req::DnloadEnd, false, Error),
    (Error, Req::Upload, false, Error),
    (Error, Req::GetStatus, true, Error),
    (Error, Req::ClrStatus, true, DfuIdle),
    (Error, Req::GetState, true, Error),
    (Error, Req::Abort, false, Error),
];

#[test]
fn every_state_answers_every_request_as_the_spec_table_says() {
    assert_eq!(TABLE.len(), State::ALL.len() * REQUESTS.len(), "one row per state and request");
    for &state in &State::ALL {
        for &req in &REQUESTS {
            let &(_, _, answered, next) =
                TABLE.iter().find(|row| row.0 == state && row.1 == req).unwrap_or_else(|| panic!("{state:?} {req:?}"));
            let (mut machine, now) = machine_in(state);
            let status_before = machine.status();
            let reply = send(&mut machine, now, req);
            let case = format!("{req:?} in {state:?}");
            assert_eq!(reply != ControlReply::Stall, answered, "{case}: {reply:?}");
            assert_eq!(machine.state(), next, "{case}");
            let expected_status = if answered && req == Req::ClrStatus {
                DfuStatus::OK
            } else if answered || state.is_runtime() || matches!(state, Error | ManifestWaitReset) {
                status_before
            } else {
                DfuStatus::ERR_STALLEDPKT
            };
            assert_eq!(machine.status(), expected_status, "{case}");
            if req == Req::GetStatus && answered {
                let ControlReply::Data(bytes) = &reply else { unreachable!() };
                assert_eq!(bytes.len(), 6, "{case}");
                assert_eq!((bytes[0], bytes[4]), (machine.status().0, machine.state() as u8), "{case}");
            }
            if req == Req::GetState && answered {
                assert_eq!(reply, ControlReply::Data(vec![state as u8]), "{case}");
            }
        }
    }
}

#[test]
fn abort_returns_to_dfu_idle_from_every_idle_state_and_nowhere_else() {
    for &state in &State::ALL {
        let (mut machine, now) = machine_in(state);
        let answered = send(&mut machine, now, Req::Abort) != ControlReply::Stall;
        let idle = matches!(state, DfuIdle | DnloadIdle | UploadIdle);
        assert_eq!(answered, idle, "ABORT in {state:?}");
        if idle {
            assert_eq!(machine.state(), DfuIdle);
            // The aborted download is gone: a new one starts from nothing.
            send(&mut machine, now, Req::Dnload);
            assert_eq!(machine.download.len(), usize::from(BLOCK));
        }
    }
}

fn status_of(reply: &ControlReply) -> (DfuStatus, u32, State) {
    let ControlReply::Data(bytes) = reply else { panic!("stalled: {reply:?}") };
    let poll = u32::from_le_bytes([bytes[1], bytes[2], bytes[3], 0]);
    (DfuStatus(bytes[0]), poll, State::ALL[usize::from(bytes[4])])
}

fn block_request(length: u16) -> SetupPacket {
    setup(0x21, request::DNLOAD, 0, length)
}

#[test]
fn a_download_polls_through_busy_then_manifests_and_asks_for_runtime() {
    let mut now = Instant::now();
    let mut machine = DfuMachine::new(Mode::Dfu, RamMemory::new(&[1 << 20, 16]));
    let image: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
    for block in image.chunks(usize::from(TRANSFER_SIZE)) {
        assert_eq!(machine.control(now, &block_request(block.len() as u16), block), ack());
        let (status, poll, state) = status_of(&send(&mut machine, now, Req::GetStatus));
        assert_eq!((status, poll, state), (DfuStatus::OK, 5, DnBusy));
        assert_eq!(machine.poll_timeout(), Some(now + BLOCK_POLL_TIMEOUT));
        now += Duration::from_millis(u64::from(poll));
        assert_eq!(status_of(&send(&mut machine, now, Req::GetStatus)).2, DnloadIdle);
    }
    send(&mut machine, now, Req::DnloadEnd);
    let (status, poll, state) = status_of(&send(&mut machine, now, Req::GetStatus));
    assert_eq!((status, poll, state), (DfuStatus::OK, 100, Manifest));
    assert_eq!(machine.memory().regions[0], image, "programmed when manifestation starts");
    now += MANIFEST_POLL_TIMEOUT;
    assert_eq!(status_of(&send(&mut machine, now, Req::GetStatus)).2, ManifestWaitReset);
    assert_eq!(machine.take_reenumeration(), None, "not before the reply is out");
    machine.handle_timeout(now + RESET_DELAY - Duration::from_millis(1));
    assert_eq!(machine.take_reenumeration(), None);
    machine.handle_timeout(now + RESET_DELAY);
    assert_eq!(machine.take_reenumeration(), Some(Mode::Runtime));
    assert_eq!(machine.take_reenumeration(), None, "once");
}

#[test]
fn the_hosts_requests_after_the_report_postpone_the_self_reset_up_to_the_limit() {
    let (mut machine, now) = machine_in(ManifestWaitReset);
    let entered = now - Duration::from_micros(1);
    machine.host_activity(now + Duration::from_millis(100));
    assert_eq!(machine.poll_timeout(), Some(entered + WAIT_RESET_LIMIT), "nothing reported yet: only the limit");
    assert_eq!(status_of(&send(&mut machine, now, Req::GetStatus)).2, ManifestWaitReset);
    // The host resets the port, then reads descriptors: each request restarts the quiet.
    let reads = now + Duration::from_millis(300);
    machine.host_activity(reads);
    machine.handle_timeout(now + RESET_DELAY);
    assert_eq!(machine.take_reenumeration(), None, "the host was not quiet for long enough");
    machine.handle_timeout(reads + RESET_DELAY);
    assert_eq!(machine.take_reenumeration(), Some(Mode::Runtime));
    // A host that keeps talking cannot hold the device past the limit.
    let (mut machine, now) = machine_in(ManifestWaitReset);
    send(&mut machine, now, Req::GetStatus);
    machine.host_activity(now + WAIT_RESET_LIMIT);
    assert_eq!(machine.poll_timeout(), Some(now - Duration::from_micros(1) + WAIT_RESET_LIMIT));
}

#[test]
fn a_device_nobody_asks_resets_itself_after_the_wait_limit() {
    let (mut machine, now) = machine_in(ManifestWaitReset);
    let entered = now - Duration::from_micros(1);
    machine.handle_timeout(entered + WAIT_RESET_LIMIT - Duration::from_millis(1));
    assert_eq!(machine.take_reenumeration(), None);
    machine.handle_timeout(entered + WAIT_RESET_LIMIT);
    assert_eq!(machine.take_reenumeration(), Some(Mode::Runtime));
}

#[test]
fn detach_leaves_for_dfu_mode_after_the_delay_unless_interrupted() {
    let (mut machine, now) = machine_in(AppIdle);
    send(&mut machine, now, Req::Detach);
    assert_eq!(machine.poll_timeout(), Some(now + DETACH_DELAY));
    machine.handle_timeout(now + DETACH_DELAY - Duration::from_millis(1));
    assert_eq!(machine.take_reenumeration(), None);
    machine.handle_timeout(now + DETACH_DELAY);
    assert_eq!(machine.take_reenumeration(), Some(Mode::Dfu));

    // Another request in appDETACH cancels the detach (A.2.2).
    let (mut machine, now) = machine_in(AppDetach);
    send(&mut machine, now, Req::Abort);
    assert_eq!((machine.state(), machine.poll_timeout()), (AppIdle, None));
}

#[test]
fn a_usb_reset_enters_dfu_mode_from_app_detach_and_leaves_it_from_any_dfu_state() {
    for &state in &State::ALL {
        let (mut machine, _) = machine_in(state);
        machine.usb_reset();
        let expected = match state {
            AppIdle => None,
            AppDetach => Some(Mode::Dfu),
            _ => Some(Mode::Runtime),
        };
        assert_eq!(machine.take_reenumeration(), expected, "reset in {state:?}");
        assert_eq!(machine.poll_timeout(), None, "no timer survives a reset ({state:?})");
    }
}

#[test]
fn an_image_larger_than_the_region_is_err_address_at_the_next_status() {
    let now = Instant::now();
    let mut machine = DfuMachine::new(Mode::Dfu, RamMemory::new(&[100, 16]));
    let block = [1u8; 64];
    machine.control(now, &block_request(64), &block);
    send(&mut machine, now, Req::GetStatus);
    let later = now + BLOCK_POLL_TIMEOUT;
    assert_eq!(status_of(&send(&mut machine, later, Req::GetStatus)).2, DnloadIdle);
    assert_eq!(machine.control(later, &block_request(64), &block), ack(), "the data stage is taken");
    let (status, _, state) = status_of(&send(&mut machine, later, Req::GetStatus));
    assert_eq!((status, state), (DfuStatus::ERR_ADDRESS, Error));
    assert_eq!(machine.memory().regions[0], Vec::<u8>::new(), "nothing programmed");
    send(&mut machine, later, Req::ClrStatus);
    assert_eq!((machine.state(), machine.status()), (DfuIdle, DfuStatus::OK));
}

#[test]
fn blocks_over_the_transfer_size_or_short_of_wlength_stall() {
    let now = Instant::now();
    let mut machine = DfuMachine::new(Mode::Dfu, RamMemory::new(&[1 << 20]));
    let big = vec![0u8; usize::from(TRANSFER_SIZE) + 1];
    assert_eq!(machine.control(now, &block_request(TRANSFER_SIZE + 1), &big), ControlReply::Stall);
    assert_eq!((machine.state(), machine.status()), (Error, DfuStatus::ERR_STALLEDPKT));
    send(&mut machine, now, Req::ClrStatus);
    assert_eq!(machine.control(now, &block_request(8), &[0; 4]), ControlReply::Stall, "wLength 8, 4 bytes");
    assert_eq!(machine.state(), Error);
}

#[test]
fn requests_in_the_wrong_direction_stall() {
    let (mut machine, now) = machine_in(DfuIdle);
    assert_eq!(machine.control(now, &setup(0x21, request::GETSTATUS, 0, 6), &[]), ControlReply::Stall);
    assert_eq!(machine.state(), Error);
    let (mut machine, now) = machine_in(DfuIdle);
    assert_eq!(machine.control(now, &setup(0xa1, request::DNLOAD, 0, 0), &[]), ControlReply::Stall);
    let (mut machine, now) = machine_in(DfuIdle);
    assert_eq!(machine.control(now, &setup(0x21, 7, 0, 0), &[]), ControlReply::Stall, "no such request");
    assert_eq!(machine.state(), Error);
}

#[test]
fn alternate_settings_change_only_between_transfers_and_only_to_regions_that_exist() {
    let (mut machine, now) = machine_in(DfuIdle);
    assert!(!machine.select_alt(2), "no third region");
    assert!(machine.select_alt(1));
    send(&mut machine, now, Req::Dnload);
    send(&mut machine, now, Req::GetStatus);
    send(&mut machine, now + BLOCK_POLL_TIMEOUT, Req::GetStatus);
    assert_eq!(machine.state(), DnloadIdle);
    assert!(!machine.select_alt(0), "mid-download");
    assert_eq!(machine.alt(), 1);
    // Region 1 holds 16 bytes: a second block does not fit.
    send(&mut machine, now, Req::Dnload);
    let (status, _, _) = status_of(&send(&mut machine, now, Req::GetStatus));
    assert_eq!(status, DfuStatus::ERR_ADDRESS);
    assert!(machine.select_alt(0), "allowed again in dfuERROR");
}

#[test]
fn an_upload_ends_with_the_first_short_block() {
    let (mut machine, now) = machine_in(DfuIdle);
    let mut got = Vec::new();
    loop {
        let ControlReply::Data(block) = send(&mut machine, now, Req::Upload) else { panic!("stalled") };
        got.extend_from_slice(&block);
        if block.len() < usize::from(BLOCK) {
            break;
        }
        assert_eq!(machine.state(), UploadIdle);
    }
    // 64 bytes in 16-byte blocks: four full blocks, then an empty one.
    assert_eq!(got, (0..IMAGE as u8).collect::<Vec<_>>());
    assert_eq!(machine.state(), DfuIdle);
}

/// A memory whose programming fails with a given status.
struct Failing(DfuStatus);

impl Memory for Failing {
    fn capacity(&self, _alt: u8) -> usize {
        1024
    }
    fn read(&mut self, _alt: u8) -> Result<Vec<u8>, DfuStatus> {
        Err(DfuStatus::ERR_FILE)
    }
    fn program(&mut self, _alt: u8, _image: &[u8]) -> Result<(), DfuStatus> {
        Err(self.0)
    }
}

#[test]
fn a_failed_manifestation_or_upload_is_reported_as_dfu_error() {
    let now = Instant::now();
    let mut machine = DfuMachine::new(Mode::Dfu, Failing(DfuStatus::ERR_VERIFY));
    machine.control(now, &block_request(4), &[1, 2, 3, 4]);
    machine.control(now, &setup(0xa1, request::GETSTATUS, 0, 6), &[]);
    let later = now + BLOCK_POLL_TIMEOUT;
    machine.control(later, &setup(0xa1, request::GETSTATUS, 0, 6), &[]);
    machine.control(later, &block_request(0), &[]);
    let reply = machine.control(later, &setup(0xa1, request::GETSTATUS, 0, 6), &[]);
    assert_eq!(status_of(&reply), (DfuStatus::ERR_VERIFY, 0, Error));
    machine.control(later, &setup(0x21, request::CLRSTATUS, 0, 0), &[]);
    let upload = machine.control(later, &setup(0xa1, request::UPLOAD, 0, 16), &[]);
    assert_eq!(upload, ControlReply::Stall);
    assert_eq!((machine.state(), machine.status()), (Error, DfuStatus::ERR_FILE));
}
