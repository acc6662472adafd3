//! A virtual disk recorded while a host ran Bulk-Only commands, replayed to
//! a host that numbers its commands otherwise and polls the medium at its
//! own pace: the same data and statuses, each CSW with the host's tag.

use bytes::Bytes;
use usbwire_device::descriptor::ConfigurationInfo;
use usbwire_device::{Completion, Device as _, Speed, Status, Urb};

use super::{BulkOnly, Unplaced};
use crate::mass_storage::{DiskOptions, MassStorage, BULK_IN, BULK_OUT};
use crate::replay::tests::Recorder;
use crate::replay::{Mode, Recording, ReplayDevice, ReplayOptions, Report, Timing};
use crate::testing::{control, data_in, data_out, next};

const TEST_UNIT_READY: &[u8] = &[0; 6];
const INQUIRY: &[u8] = &[0x12, 0, 0, 0, 36, 0];
const READ_BLOCK_ZERO: &[u8] = &[0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0];

/// The recorded host's commands: its tag, the CDB and the bytes it reads.
const RECORDED: [(u32, &[u8], u32); 4] =
    [(1, TEST_UNIT_READY, 0), (2, INQUIRY, 36), (3, READ_BLOCK_ZERO, 512), (4, TEST_UNIT_READY, 0)];

fn cbw(tag: u32, cdb: &[u8], length: u32) -> Bytes {
    let mut cbw = [0u8; 31];
    cbw[..4].copy_from_slice(b"USBC");
    cbw[4..8].copy_from_slice(&tag.to_le_bytes());
    cbw[8..12].copy_from_slice(&length.to_le_bytes());
    cbw[12] = if length > 0 { 0x80 } else { 0 };
    cbw[14] = cdb.len() as u8;
    cbw[15..15 + cdb.len()].copy_from_slice(cdb);
    Bytes::copy_from_slice(&cbw)
}

/// What a host saw of one command: the data read, and the CSW.
type Seen = (Bytes, Bytes);

/// Configures the device, then runs `commands` as usb-storage does (CBW, data, CSW).
fn host(device: &mut dyn FnMut(Urb) -> Completion, commands: &[(u32, &[u8], u32)]) -> Vec<Seen> {
    let mut seqnum = 0;
    let mut run = |make: &dyn Fn(u32) -> Urb| {
        seqnum += 1;
        device(make(seqnum))
    };
    for setup in [[0x80, 6, 0, 1, 0, 0, 18, 0], [0x80, 6, 0, 2, 0, 0, 0xff, 0], [0x00, 9, 1, 0, 0, 0, 0, 0]] {
        assert_eq!(run(&|seqnum| control(seqnum, setup, &[])).status, Status::OK);
    }
    let mut seen = Vec::new();
    for &(tag, cdb, length) in commands {
        let block = run(&|seqnum| data_out(seqnum, BULK_OUT, cbw(tag, cdb, length)));
        assert_eq!((block.status, block.actual_length), (Status::OK, 31), "the CBW of tag {tag} taken");
        let data = if length > 0 { run(&|seqnum| data_in(seqnum, BULK_IN, length)).data } else { Bytes::new() };
        let csw = run(&|seqnum| data_in(seqnum, BULK_IN, 13));
        assert_eq!(csw.status, Status::OK);
        seen.push((data, csw.data));
    }
    seen
}

/// A 1 MiB virtual disk recorded running [`RECORDED`], and what that host saw.
fn recorded() -> (Recording, Vec<Seen>) {
    recorded_running(&RECORDED)
}

/// A 1 MiB virtual disk recorded running `commands`, and what that host saw.
fn recorded_running(commands: &[(u32, &[u8], u32)]) -> (Recording, Vec<Seen>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let image = dir.path().join("disk.img");
    let blocks: Vec<u8> = (0..1 << 20).map(|at: u32| (at * 7 / 3) as u8).collect();
    std::fs::write(&image, blocks).expect("image");
    let options = DiskOptions { size: None, read_only: false, speed: Speed::HIGH, bad_blocks: None };
    let mut recorder = Recorder::new(MassStorage::open(&image, &options).expect("disk"));
    let seen = host(
        &mut |urb| {
            recorder.submit(urb);
            recorder.complete(100)
        },
        commands,
    );
    (Recording::parse(Bytes::from(recorder.out)).expect("a recording"), seen)
}

fn replayed(mode: Mode, commands: &[(u32, &[u8], u32)]) -> (Vec<Seen>, Report) {
    let (recording, _) = recorded();
    let options = ReplayOptions { mode, timing: Timing::Asap, on_report: None };
    let mut device = ReplayDevice::new(recording, "disk.pcapng".into(), options);
    let seen = host(
        &mut |urb| {
            device.submit(urb);
            next(&mut device).expect("a replay answers at once")
        },
        commands,
    );
    (seen, device.report().clone())
}

/// `seen` with each CSW's tag replaced by `tag`.
fn with_tag(seen: &Seen, tag: u32) -> Seen {
    let mut csw = seen.1.to_vec();
    csw[4..8].copy_from_slice(&tag.to_le_bytes());
    (seen.0.clone(), Bytes::from(csw))
}

#[test]
fn another_hosts_tags_match_and_each_csw_carries_the_hosts_tag() {
    let (_, recorded) = recorded();
    let theirs: Vec<(u32, &[u8], u32)> =
        RECORDED.iter().map(|&(tag, cdb, length)| (tag + 0x7000, cdb, length)).collect();
    let (seen, report) = replayed(Mode::Strict, &theirs);
    let expected: Vec<Seen> = recorded.iter().zip(&theirs).map(|(seen, (tag, ..))| with_tag(seen, *tag)).collect();
    assert_eq!(seen, expected);
    // Four CBWs and CSWs, two data stages, SET_CONFIGURATION.
    assert_eq!((report.divergences, report.matched), (0, 4 * 2 + 2 + 1), "{report:?}");
}

#[test]
fn media_polling_is_answered_as_the_last_recorded_ready_check_without_moving_the_recording_on() {
    let (_, recorded) = recorded();
    // The host polls after the first check (its own tags 50, 51) and once more at the end.
    let polled: [(u32, &[u8], u32); 7] = [
        (1, TEST_UNIT_READY, 0),
        (50, TEST_UNIT_READY, 0),
        (51, TEST_UNIT_READY, 0),
        (2, INQUIRY, 36),
        (3, READ_BLOCK_ZERO, 512),
        (4, TEST_UNIT_READY, 0),
        (52, TEST_UNIT_READY, 0),
    ];
    let (seen, report) = replayed(Mode::Strict, &polled);
    assert_eq!(report.divergences, 0, "{report:?}");
    assert_eq!(report.ready_checks_answered, 3);
    assert_eq!(report.never_asked, 0);
    let good_check = |tag: u32| with_tag(&recorded[0], tag);
    assert_eq!(seen[1], good_check(50));
    assert_eq!(seen[2], good_check(51));
    assert_eq!(seen[6], good_check(52));
    assert_eq!([&seen[0], &seen[3], &seen[4], &seen[5]], [&recorded[0], &recorded[1], &recorded[2], &recorded[3]]);
}

#[test]
fn another_command_off_the_recording_still_diverges() {
    let unplaced: [(u32, &[u8], u32); 2] = [(1, TEST_UNIT_READY, 0), (2, READ_BLOCK_ZERO, 512)];
    let (recording, _) = recorded();
    let options = ReplayOptions { mode: Mode::Strict, timing: Timing::Asap, on_report: None };
    let mut device = ReplayDevice::new(recording, "disk.pcapng".into(), options);
    let mut answers = Vec::new();
    let mut seqnum = 0;
    for setup in [[0x80, 6, 0, 1, 0, 0, 18, 0], [0x00, 9, 1, 0, 0, 0, 0, 0]] {
        seqnum += 1;
        device.submit(control(seqnum, setup, &[]));
        answers.push(next(&mut device).expect("answered").status);
    }
    for (tag, cdb, length) in unplaced {
        seqnum += 1;
        device.submit(data_out(seqnum, BULK_OUT, cbw(tag, cdb, length)));
        answers.push(next(&mut device).expect("answered").status);
        if answers.last() != Some(&Status::OK) {
            break;
        }
        seqnum += 1;
        device.submit(data_in(seqnum, BULK_IN, 13));
        answers.push(next(&mut device).expect("answered").status);
    }
    assert_eq!(
        answers,
        [Status::OK, Status::OK, Status::OK, Status::OK, Status::EPIPE],
        "the READ in INQUIRY's place stalls"
    );
    let report = device.report();
    assert_eq!((report.divergences, report.ready_checks_answered), (1, 0), "{report:?}");
}

#[test]
fn a_ready_check_that_failed_is_not_answered_again() {
    let (recording, _) = recorded();
    let configuration = ConfigurationInfo::parse(&recording.configuration).expect("the disk's configuration");
    let mut bulk_only = BulkOnly::of(&configuration);
    let check = cbw(9, TEST_UNIT_READY, 0);
    let csw = |status: u8| {
        let mut csw = [0u8; 13];
        csw[..4].copy_from_slice(b"USBS");
        csw[4..8].copy_from_slice(&9u32.to_le_bytes());
        csw[12] = status;
        Bytes::copy_from_slice(&csw)
    };
    assert!(matches!(bulk_only.unplaced_out(BULK_OUT, &check), Unplaced::Diverges), "none recorded yet");
    bulk_only.matched_out(BULK_OUT, &check, &check);
    assert_eq!(bulk_only.answered_in(BULK_IN, csw(1)), csw(1));
    assert!(matches!(bulk_only.unplaced_out(BULK_OUT, &check), Unplaced::Diverges), "the last one failed");
    bulk_only.matched_out(BULK_OUT, &check, &check);
    bulk_only.answered_in(BULK_IN, csw(0));
    assert!(matches!(bulk_only.unplaced_out(BULK_OUT, &check), Unplaced::ReadyAnswered));
    assert_eq!(bulk_only.made_status(BULK_IN), Some(csw(0)));
    assert!(!bulk_only.same_out(BULK_IN, &check, &cbw(10, TEST_UNIT_READY, 0)), "not a Bulk-Only OUT pipe");
    assert!(bulk_only.same_out(BULK_OUT, &check, &cbw(10, TEST_UNIT_READY, 0)));
    assert!(!bulk_only.same_out(BULK_OUT, &check, &cbw(9, INQUIRY, 36)));
}

#[test]
fn the_recorded_hosts_polling_is_passed_over_when_this_host_does_not_poll() {
    // Recorded with polls between INQUIRY and READ (two) and before the end (one).
    let polled: [(u32, &[u8], u32); 7] = [
        (1, TEST_UNIT_READY, 0),
        (2, INQUIRY, 36),
        (3, TEST_UNIT_READY, 0),
        (4, TEST_UNIT_READY, 0),
        (5, READ_BLOCK_ZERO, 512),
        (6, TEST_UNIT_READY, 0),
        (7, INQUIRY, 36),
    ];
    let (recording, recorded) = recorded_running(&polled);
    let options = ReplayOptions { mode: Mode::Strict, timing: Timing::Asap, on_report: None };
    let mut device = ReplayDevice::new(recording, "disk.pcapng".into(), options);
    let quiet: [(u32, &[u8], u32); 3] = [(1, TEST_UNIT_READY, 0), (2, INQUIRY, 36), (3, READ_BLOCK_ZERO, 512)];
    let seen = host(
        &mut |urb| {
            device.submit(urb);
            next(&mut device).expect("a replay answers at once")
        },
        &quiet,
    );
    assert_eq!(seen, [recorded[0].clone(), recorded[1].clone(), with_tag(&recorded[4], 3)]);
    let report = device.report();
    assert_eq!((report.divergences, report.ready_checks_passed_over), (0, 2), "{report:?}");
}

#[test]
fn a_command_off_the_recording_after_recorded_checks_passes_none_over() {
    let polled: [(u32, &[u8], u32); 3] = [(1, TEST_UNIT_READY, 0), (2, TEST_UNIT_READY, 0), (3, INQUIRY, 36)];
    let (recording, _) = recorded_running(&polled);
    let mut bulk_only = BulkOnly::of(&ConfigurationInfo::parse(&recording.configuration).expect("parsed"));
    let outs: Vec<Bytes> = polled.iter().map(|&(tag, cdb, length)| cbw(tag, cdb, length)).collect();
    let read = cbw(3, READ_BLOCK_ZERO, 512);
    assert_eq!(bulk_only.passes_over(BULK_OUT, outs.iter().map(|out| &out[..]), &read), 0, "no READ recorded");
    assert_eq!(bulk_only.skips_in(BULK_IN), 0);
    let inquiry = cbw(9, INQUIRY, 36);
    assert_eq!(bulk_only.passes_over(BULK_OUT, outs.iter().map(|out| &out[..]), &inquiry), 2);
    assert_eq!(bulk_only.skips_in(BULK_IN), 2, "their two CSWs");
}
