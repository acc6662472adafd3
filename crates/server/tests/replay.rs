//! Record once, replay forever, in process: a server captures an import of
//! its loopback device driven by the userspace client; a second server
//! serves that capture back (`usbwire_gadgets::replay`). The same workload
//! gets the same answers byte for byte and a clean report; another workload
//! is stalled at its first divergent request in strict mode, which the
//! report names, and goes on in lenient mode.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use bytes::Bytes;
use usbwire_client::{Connection, Security, Transfer};
use usbwire_gadgets::loopback::{LOOP_IN, LOOP_OUT, SOURCE_IN};
use usbwire_gadgets::replay::{Mode, Recording, ReplayDevice, ReplayOptions, Report, Timing};
use usbwire_proto::op::BusId;
use usbwire_proto::Status;
use usbwire_server::CaptureConfig;
use usbwire_testing::TestServer;

const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];
const GET_STATUS: [u8; 8] = [0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00];
const RECORDED: [&[u8]; 3] = [b"first payload", b"second payload", b"third"];

/// What the workload saw: each reply's status, length and data.
type Seen = Vec<(Status, u32, Bytes)>;

/// Configures the device, loops each payload through it and reads the source.
async fn workload(addr: SocketAddr, payloads: &[&[u8]]) -> Seen {
    let busid = BusId::new("0-1").unwrap();
    let (stream, record) = usbwire_client::import(addr, &busid, &Security::Plain).await.unwrap();
    let conn = Connection::new(stream, &record);
    let mut transfers =
        vec![Transfer::control_out(SET_CONFIGURATION_1, Bytes::new()), Transfer::control_in(GET_STATUS)];
    for payload in payloads {
        transfers.push(Transfer::bulk_out(LOOP_OUT, Bytes::copy_from_slice(payload)));
        transfers.push(Transfer::bulk_in(LOOP_IN, 512));
    }
    transfers.push(Transfer::bulk_in(SOURCE_IN, 512));
    let mut seen = Vec::new();
    for transfer in transfers {
        let ret = conn.transfer(transfer).await.unwrap();
        seen.push((ret.status, ret.actual_length, ret.data));
    }
    conn.close().await;
    seen
}

/// Whether every URB of `recording` has its completion written (the capture
/// writer may still be behind the last one).
fn complete(recording: &Recording) -> bool {
    let mut exchanges = recording.control.iter().chain(recording.endpoints.iter().flat_map(|(_, urbs)| urbs));
    exchanges.all(|exchange| exchange.completion.is_some())
}

/// The capture file of the one import in `dir`, once it reads as a recording
/// of `urbs` URBs, each with its completion.
async fn recorded(dir: &Path, urbs: usize) -> PathBuf {
    for _ in 0..300 {
        let files: Vec<PathBuf> =
            std::fs::read_dir(dir).map_or(Vec::new(), |d| d.flatten().map(|e| e.path()).collect());
        if let [file] = &files[..] {
            if Recording::open(file).is_ok_and(|r| r.urbs() == urbs && complete(&r)) {
                return file.clone();
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no complete capture in {}", dir.display());
}

/// A server replaying `file`, and the reports of its imports.
async fn replaying(file: &Path, mode: Mode) -> (TestServer, mpsc::Receiver<Report>) {
    let (reports, received) = mpsc::channel();
    let on_report = Box::new(move |report: &Report| {
        let _ = reports.send(report.clone());
    });
    let options = ReplayOptions { mode, timing: Timing::Asap, on_report: Some(on_report) };
    let device = ReplayDevice::open(file, options).unwrap();
    (TestServer::builder().device("replay", Box::new(device)).start().await, received)
}

async fn report_of(reports: &mpsc::Receiver<Report>) -> Report {
    for _ in 0..300 {
        if let Ok(report) = reports.try_recv() {
            return report;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no report after the import ended");
}

#[tokio::test]
async fn a_recorded_loopback_replays_byte_for_byte_and_diverges_where_the_workload_does() {
    let dir = tempfile::tempdir().unwrap();
    let capture = dir.path().join("capture");
    let server = TestServer::builder()
        .loopback()
        .config(|config| config.capture = Some(CaptureConfig::new(capture.clone())))
        .start()
        .await;
    let original = workload(server.addr(), &RECORDED).await;
    assert!(original.iter().all(|(status, _, _)| *status == Status::OK), "{original:?}");
    let file = recorded(&capture, 2 + 2 * RECORDED.len() + 1).await;

    let (replay, reports) = replaying(&file, Mode::Strict).await;
    assert_eq!(workload(replay.addr(), &RECORDED).await, original, "the same answers, byte for byte");
    let report = report_of(&reports).await;
    assert!(report.is_clean() && report.never_asked == 0, "{report:?}");
    assert_eq!((report.requests, report.matched), (9, 9));

    let other: [&[u8]; 3] = [b"first payload", b"another payload", b"third"];
    let diverged = workload(replay.addr(), &other).await;
    assert_eq!(diverged[4].0, Status::EPIPE, "strict: the second OUT stalls");
    assert_eq!(diverged[..4], original[..4], "as recorded up to there");
    let report = report_of(&reports).await;
    let first = &report.first_divergences[0];
    assert_eq!((first.position, first.endpoint.as_str(), first.answered.as_str()), (5, "0x03", "stall"));
    assert_eq!(first.recorded.as_ref().map(|r| r.length), Some(14));
    assert_eq!(first.received.length, 15);

    let (lenient, reports) = replaying(&file, Mode::Lenient).await;
    let kept_going = workload(lenient.addr(), &other).await;
    assert_eq!(kept_going[4].0, Status::OK, "lenient answers from the recording");
    assert_eq!(kept_going[5], original[5], "and goes on with what was recorded");
    assert_eq!(kept_going[6..], original[6..]);
    let report = report_of(&reports).await;
    assert_eq!((report.divergences, report.never_asked), (1, 0));
}
