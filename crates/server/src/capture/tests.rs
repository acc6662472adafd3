//! Capture records, files, rotation, the directory bound and the queue bound.

use super::pcapng::block;
use super::*;
use bytes::Bytes;

fn urb(endpoint: u8, direction: Direction, data: &[u8]) -> Urb {
    Urb {
        seqnum: 7,
        endpoint,
        direction,
        setup: [0x80, 6, 0, 1, 0, 0, 18, 0],
        flags: TransferFlags(0),
        length: if direction == Direction::In { 18 } else { data.len() as u32 },
        data: Bytes::copy_from_slice(data),
        start_frame: 0,
        interval: 0,
        number_of_packets: 0,
        iso_packets: Vec::new(),
    }
}

#[test]
fn a_control_submit_is_a_usbmon_record_with_its_setup() {
    let mut head = Usbmon {
        id: 7,
        kind: b'S',
        transfer: 2,
        endpoint: 0x80,
        devnum: 3,
        busnum: 2,
        flag_setup: 0,
        flag_data: b'<',
        sec: 1,
        usec: 2,
        status: EINPROGRESS,
        length: 18,
        setup: urb(0, Direction::In, &[]).setup,
        iso: None,
        interval: 0,
        start_frame: 0,
        flags: TransferFlags(TransferFlags::DIR_IN),
    };
    let record = head.encode(&[], &[]);
    assert_eq!(record.len(), USBMON_HEADER_LEN);
    assert_eq!(&record[..16], &[7, 0, 0, 0, 0, 0, 0, 0, b'S', 2, 0x80, 3, 2, 0, 0, b'<']);
    assert_eq!(&record[28..32], &(-115i32).to_le_bytes());
    assert_eq!(&record[32..40], &[18, 0, 0, 0, 0, 0, 0, 0], "length 18, nothing captured");
    assert_eq!(&record[40..48], &[0x80, 6, 0, 1, 0, 0, 18, 0]);
    head.iso = Some((1, 2));
    let record = head.encode(&[(0, 0, 192), (-18, 192, 100)], b"abc");
    assert_eq!(&record[40..48], &[1, 0, 0, 0, 2, 0, 0, 0], "error count and descriptors instead of setup");
    assert_eq!(&record[60..64], &[2, 0, 0, 0]);
    assert_eq!(&record[80..84], &(-18i32).to_le_bytes());
    assert_eq!(&record[96..], b"abc");
}

/// What the server lists for bus id `busid` (bus 1, device 2, high speed).
fn record(busid: &str) -> DeviceRecord {
    DeviceRecord {
        path: String::new(),
        busid: usbwire_proto::op::BusId::new(busid).unwrap(),
        busnum: 1,
        devnum: 2,
        speed: usbwire_proto::Speed::HIGH,
        id_vendor: 0x1209,
        id_product: 5,
        bcd_device: 0,
        b_device_class: 0,
        b_device_sub_class: 0,
        b_device_protocol: 0,
        b_configuration_value: 1,
        b_num_configurations: 1,
        interfaces: Vec::new(),
        b_num_interfaces: 0,
    }
}

/// An empty directory for one test, removed when the guard is dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("usbwire-capture-{name}-")).tempdir().unwrap()
}

/// A writer driven by hand, and its file `name` in `dir` with these bounds.
fn writer_with(dir: &Path, name: &str, max_file: u64, max_bytes: u64) -> Writer {
    let mut writer = Writer { files: HashMap::new(), dirs: HashMap::new(), queued: Arc::new(AtomicUsize::new(0)) };
    open(&mut writer, 1, dir, name, max_file, max_bytes);
    writer
}

fn open(writer: &mut Writer, id: u64, dir: &Path, name: &str, max_file: u64, max_bytes: u64) {
    let path = dir.join(name);
    let head = Head { speed: None, records: Vec::new() };
    let file = Rotating::new(path.clone(), create_private(&path).unwrap(), max_file, head).unwrap();
    writer.handle(Message::Open { id, file, dir: dir.to_path_buf(), max_bytes });
}

fn sizes(dir: &Path) -> Vec<(String, u64)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().unwrap().len()))
        .collect();
    files.sort();
    files
}

#[test]
fn blocks_are_padded_and_files_rotate_past_their_bound() {
    let mut out = Vec::new();
    assert_eq!(block(&mut out, 6, &[1, 2, 3, 4, 5]).unwrap(), 20);
    assert_eq!(out.len(), 20);
    assert_eq!(&out[4..8], &20u32.to_le_bytes());
    assert_eq!(&out[16..20], &20u32.to_le_bytes());
    let mut packet = Vec::new();
    assert_eq!(write_packet(&mut packet, &[0; 65]).unwrap(), 12 + 20 + 68);
    assert_eq!(packet.len(), 100);
    assert_eq!(&packet[96..], &100u32.to_le_bytes());

    let dir = scratch("rotate");
    let dir = dir.path();
    let mut writer = writer_with(dir, "rotating.pcapng", 1000, u64::MAX);
    for _ in 0..10 {
        writer.handle(Message::Record { id: 1, record: vec![0u8; 200] });
    }
    writer.handle(Message::Close { id: 1 });
    let path = dir.join("rotating.pcapng");
    let current = std::fs::metadata(&path).unwrap().len();
    let previous = std::fs::metadata(append_extension(&path, "1")).unwrap().len();
    assert!(current <= 1000 + 300 && previous <= 1000 + 300, "{current} {previous}");
    assert_eq!(&std::fs::read(&path).unwrap()[..4], &0x0A0D_0D0Au32.to_le_bytes(), "a new file starts a section");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn all_files_together_stay_under_max_bytes_the_oldest_deleted_first() {
    let dir = scratch("budget");
    let dir = dir.path();
    // An earlier run's file, older than anything this run writes.
    let old = dir.join("usbwire-1-1-100-old.pcapng");
    std::fs::write(&old, vec![0u8; 3000]).unwrap();
    let an_hour_ago = SystemTime::now() - std::time::Duration::from_secs(3600);
    File::options().write(true).open(&old).unwrap().set_modified(an_hour_ago).unwrap();
    let unrelated = dir.join("notes.txt");
    std::fs::write(&unrelated, vec![0u8; 3000]).unwrap();
    let max_bytes = 10_000;
    let mut writer = writer_with(dir, "usbwire-a.pcapng", 4000, max_bytes);
    for _ in 0..30 {
        writer.handle(Message::Record { id: 1, record: vec![0u8; 300] });
    }
    assert!(!old.exists(), "the earlier run's file went first");
    assert!(unrelated.exists(), "files that are not captures are left alone");
    writer.handle(Message::Close { id: 1 });
    open(&mut writer, 2, dir, "usbwire-b.pcapng", 4000, max_bytes);
    for _ in 0..40 {
        writer.handle(Message::Record { id: 2, record: vec![0u8; 300] });
        let total: u64 =
            sizes(dir).iter().filter(|(name, _)| name.starts_with("usbwire-")).map(|(_, bytes)| bytes).sum();
        assert!(total <= max_bytes, "{total} bytes on disk: {:?}", sizes(dir));
    }
    let names: Vec<String> = sizes(dir).into_iter().map(|(name, _)| name).collect();
    assert!(!names.iter().any(|n| n.starts_with("usbwire-a")), "the closed, older import's files went: {names:?}");
    assert!(names.contains(&"usbwire-b.pcapng".to_string()), "{names:?}");

    // One file alone larger than the budget: rotated and its old part deleted.
    let mut writer = writer_with(dir, "usbwire-c.pcapng", u64::MAX, 2000);
    for _ in 0..20 {
        writer.handle(Message::Record { id: 1, record: vec![0u8; 300] });
    }
    let size = std::fs::metadata(dir.join("usbwire-c.pcapng")).unwrap().len();
    assert!(size <= 2000, "{size}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_directory_is_made_0700_and_files_0600() {
    let base = scratch("modes");
    let base = base.path();
    std::fs::set_permissions(base, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let config = CaptureConfig::new(base.join("capture"));
    let peer: SocketAddr = "127.0.0.1:4000".parse().unwrap();
    let capture = Capture::start(&config, &record("1-1"), None, peer).unwrap();
    let path = capture.path.clone();
    drop(capture);
    use std::os::unix::fs::MetadataExt as _;
    assert_eq!(std::fs::metadata(&config.dir).unwrap().mode() & 0o777, 0o700);
    assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
    // The same name again (same second, same peer): a new file beside it, not the old one reused.
    let again = Capture::start(&config, &record("1-1"), None, peer).unwrap();
    assert_ne!(again.path, path);
    let _ = std::fs::remove_dir_all(base);
}

#[test]
fn a_planted_symlink_is_not_followed_for_the_directory_or_a_file() {
    let base = scratch("symlink");
    let base = base.path();
    let victim = base.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let elsewhere = base.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, base.join("capture")).unwrap();
    let config = CaptureConfig::new(base.join("capture"));
    let peer: SocketAddr = "127.0.0.1:4000".parse().unwrap();
    let error = Capture::start(&config, &record("1-1"), None, peer).err().unwrap();
    assert!(error.to_string().contains("symbolic link"), "{error}");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "nothing written through the link");

    let dir = base.join("real");
    CaptureConfig::new(dir.clone()).prepare().unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("usbwire-1-1.pcapng")).unwrap();
    let error = create_unique(&dir, "usbwire-1-1").err().unwrap();
    assert!(error.to_string().contains("symbolic link"), "{error}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    let error = create_private(&dir.join("usbwire-1-1.pcapng")).err().unwrap();
    assert_eq!(error.kind(), io::ErrorKind::AlreadyExists);
    let _ = std::fs::remove_dir_all(base);
}

#[test]
fn the_queue_is_bounded_in_bytes_and_what_does_not_fit_is_dropped_and_counted() {
    let (queue, messages) = channel();
    let writer = WriterHandle { queue, queued: Arc::new(AtomicUsize::new(0)) };
    let mut capture = Capture {
        writer: writer.clone(),
        id: 1,
        in_flight: HashMap::new(),
        busnum: 1,
        devnum: 1,
        dropped: 0,
        path: PathBuf::from("unused"),
    };
    // Nothing drains the queue: a stalled disk.
    for seqnum in 0..100 {
        let mut out = urb(1, Direction::Out, &[]);
        out.seqnum = seqnum;
        out.data = Bytes::from(vec![0u8; 1 << 20]);
        out.length = 1 << 20;
        capture.submitted(&out, TransferType::Bulk);
    }
    let queued = writer.queued.load(Ordering::Acquire);
    assert!(queued <= QUEUE_BYTES, "{queued}");
    let held: usize = messages
        .try_iter()
        .map(|m| match m {
            Message::Record { record, .. } => record.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(held, queued, "the count is what the queue holds");
    assert_eq!(capture.dropped, 100 - (QUEUE_BYTES / ((1 << 20) + USBMON_HEADER_LEN)) as u64);
}

#[test]
fn golden_the_interface_block_carries_the_devices_speed() {
    let mut out = Vec::new();
    assert_eq!(write_headers(&mut out, speed_bps(usbwire_proto::Speed::HIGH)).unwrap(), 28 + 36);
    let interface = &out[28..];
    assert_eq!(
        interface,
        &[
            1, 0, 0, 0, 36, 0, 0, 0, 220, 0, 0, 0, 0, 0, 0, 0, // type, length, link type, snap length
            8, 0, 8, 0, 0x00, 0x38, 0x9c, 0x1c, 0, 0, 0, 0, // if_speed: 480 000 000
            0, 0, 0, 0, 36, 0, 0, 0, // end of options, length
        ][..]
    );
}

#[tokio::test]
async fn every_file_starts_with_the_descriptors_a_replay_needs() {
    let base = scratch("descriptors");
    let config = CaptureConfig::new(base.path().join("capture"));
    let (mut keyboard, _keys) = usbwire_gadgets::keyboard();
    let snapshot = crate::descriptor_snapshot::take(&mut keyboard, 0x10002).await;
    let peer: SocketAddr = "127.0.0.1:4000".parse().unwrap();
    let capture = Capture::start(&config, &record("1-1"), Some(&snapshot), peer).unwrap();
    let path = capture.path.clone();
    drop(capture);
    let mut read = Err(None);
    for _ in 0..200 {
        match usbwire_gadgets::replay::Recording::open(&path) {
            Ok(recording) => {
                read = Ok(recording);
                break;
            }
            Err(error) => read = Err(Some(error.to_string())),
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let recording = read.unwrap_or_else(|error| panic!("the capture is a recording: {error:?}"));
    assert_eq!(recording.speed, usbwire_proto::Speed::HIGH);
    assert_eq!((recording.device.vendor_id, recording.device.product_id), (0x1209, 0x0001));
    assert_eq!(recording.descriptors, snapshot, "every descriptor of the snapshot, as taken");
    assert_eq!(recording.urbs(), 0, "the descriptors are no URBs to replay");
}
