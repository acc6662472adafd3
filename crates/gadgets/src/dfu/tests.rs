//! The DFU device end to end through `Device`, as a host drives it: runtime →
//! DFU_DETACH → DFU mode → a 1 MiB download polled with DFU_GETSTATUS →
//! manifestation → runtime with the new hash → upload; resets; errors.

use std::future::poll_fn;
use std::task::Poll;
use std::time::Duration;

use usbwire_device::descriptor::{self, ConfigurationInfo, DeviceDescriptor};
use usbwire_device::{Device, Status};

use super::machine::request;
use super::*;
use crate::testing::{configure, control, next, request as ok_request};

/// An empty directory for one test, removed when the guard is dropped.
fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("usbwire-dfu-{name}-")).tempdir().unwrap()
}

fn dfu_out(request: u8, interface: u8, value: u16) -> [u8; 8] {
    let [v0, v1] = value.to_le_bytes();
    [0x21, request, v0, v1, interface, 0, 0, 0]
}

fn dfu_in(request: u8, interface: u8, length: u16) -> [u8; 8] {
    let [l0, l1] = length.to_le_bytes();
    [0xa1, request, 0, 0, interface, 0, l0, l1]
}

/// DFU_GETSTATUS: (bStatus, bwPollTimeout, bState).
fn get_status(dev: &mut impl Device, interface: u8) -> (DfuStatus, Duration, u8) {
    let b = ok_request(dev, dfu_in(request::GETSTATUS, interface, 6), &[]);
    assert_eq!(b.len(), 6);
    let poll = u32::from_le_bytes([b[1], b[2], b[3], 0]);
    (DfuStatus(b[0]), Duration::from_millis(u64::from(poll)), b[4])
}

/// Runs one control request and returns its status (for the ones expected to stall).
fn status_of(dev: &mut impl Device, setup: [u8; 8], data: &[u8]) -> Status {
    dev.submit(control(7, setup, data));
    next(dev).expect("control requests complete at once").status
}

/// Polls until the device has re-enumerated `count` times (on the paused tokio clock).
async fn until_enumeration(dev: &mut Box<dyn Device>, count: u32) {
    let waited = tokio::time::timeout(
        Duration::from_secs(10),
        poll_fn(|cx| match dev.poll_complete(cx) {
            Poll::Ready(done) => panic!("nothing was in flight, yet {done:?} completed"),
            Poll::Pending if dev.enumeration() == count => Poll::Ready(()),
            Poll::Pending => Poll::Pending,
        }),
    )
    .await;
    assert!(waited.is_ok(), "no re-enumeration to count {count}");
}

fn string(dev: &mut impl Device, index: u8) -> String {
    let bytes = ok_request(dev, [0x80, 6, index, 3, 0x09, 0x04, 0xff, 0], &[]);
    descriptor::parse_string(&bytes).unwrap()
}

fn configuration(dev: &mut impl Device) -> Vec<u8> {
    ok_request(dev, [0x80, 6, 0, 2, 0, 0, 0xff, 0], &[]).to_vec()
}

fn device_descriptor(dev: &mut impl Device) -> DeviceDescriptor {
    DeviceDescriptor::parse(&ok_request(dev, [0x80, 6, 0, 1, 0, 0, 18, 0], &[])).unwrap()
}

/// The functional descriptor's bytes after the interfaces.
fn functional(config: &[u8]) -> [u8; 9] {
    let at = config.windows(2).position(|w| w == [9, 0x21]).expect("a DFU functional descriptor");
    config[at..at + 9].try_into().unwrap()
}

/// Runtime → DFU mode through DFU_DETACH, checking the detach's reply comes first.
async fn detach(dev: &mut Box<dyn Device>) {
    let before = dev.enumeration();
    configure(dev);
    let (status, _, state) = get_status(dev, RUNTIME_DFU_INTERFACE);
    assert_eq!((status, state), (DfuStatus::OK, State::AppIdle as u8));
    dev.submit(control(1, dfu_out(request::DETACH, RUNTIME_DFU_INTERFACE, 1000), &[]));
    let done = next(dev).expect("the detach completes before the device leaves");
    assert_eq!((done.seqnum, done.status), (1, Status::OK));
    assert_eq!(dev.enumeration(), before, "not gone before the delay");
    until_enumeration(dev, before + 1).await;
    assert_eq!(dev.summary().product_id, DFU_PRODUCT_ID);
}

/// Downloads `image` to alternate setting `alt` in DFU mode, as dfu-util does;
/// returns the final DFU_GETSTATUS after the zero-length block.
async fn download(dev: &mut Box<dyn Device>, alt: u8, image: &[u8]) -> (DfuStatus, Duration, u8) {
    configure(dev);
    ok_request(dev, [0x01, 0x0b, alt, 0, DFU_MODE_INTERFACE, 0, 0, 0], &[]);
    for (block_number, block) in image.chunks(usize::from(TRANSFER_SIZE)).enumerate() {
        let [l0, l1] = (block.len() as u16).to_le_bytes();
        let [b0, b1] = (block_number as u16).to_le_bytes();
        ok_request(dev, [0x21, request::DNLOAD, b0, b1, DFU_MODE_INTERFACE, 0, l0, l1], block);
        loop {
            let (status, poll, state) = get_status(dev, DFU_MODE_INTERFACE);
            if state == State::DnloadIdle as u8 || state == State::Error as u8 {
                if status != DfuStatus::OK {
                    return (status, poll, state);
                }
                break;
            }
            assert_eq!((state, poll), (State::DnBusy as u8, machine::BLOCK_POLL_TIMEOUT));
            tokio::time::sleep(poll).await;
        }
    }
    ok_request(dev, dfu_out(request::DNLOAD, DFU_MODE_INTERFACE, 0xffff), &[]);
    get_status(dev, DFU_MODE_INTERFACE)
}

/// Uploads alternate setting `alt` in DFU mode in wTransferSize blocks until a short one.
fn upload(dev: &mut impl Device, alt: u8) -> Vec<u8> {
    configure(dev);
    ok_request(dev, [0x01, 0x0b, alt, 0, DFU_MODE_INTERFACE, 0, 0, 0], &[]);
    let mut image = Vec::new();
    loop {
        let block = ok_request(dev, dfu_in(request::UPLOAD, DFU_MODE_INTERFACE, TRANSFER_SIZE), &[]);
        image.extend_from_slice(&block);
        if block.len() < usize::from(TRANSFER_SIZE) {
            return image;
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_one_mib_image_goes_through_both_re_enumerations_into_file_and_back() {
    let dir = scratch("flash");
    let dir = dir.path();
    let path = dir.join("fw.bin");
    let mut dev: Box<dyn Device> = Box::new(DfuDevice::open(&path, &DfuOptions::default()).unwrap());

    // Runtime mode, nothing flashed yet.
    let summary = dev.summary();
    assert_eq!((summary.vendor_id, summary.product_id), (crate::VENDOR_ID, RUNTIME_PRODUCT_ID));
    assert_eq!(summary.product, "usbwire DFU demo (no firmware)");
    assert_eq!(summary.interfaces, vec![(0xff, 0, 0), (0xfe, 1, 1)]);
    let config = configuration(&mut dev);
    let [_, _, attributes, d0, d1, t0, t1, v0, v1] = functional(&config);
    assert_eq!(attributes, 0x0b, "bitCanDnload, bitCanUpload, bitWillDetach; not manifestation tolerant");
    assert_eq!(
        (u16::from_le_bytes([d0, d1]), u16::from_le_bytes([t0, t1]), u16::from_le_bytes([v0, v1])),
        (1000, 4096, 0x0110)
    );
    let serial = summary.serial.clone();

    detach(&mut dev).await;
    let summary = dev.summary();
    assert_eq!(summary.product, BOOTLOADER_PRODUCT);
    assert_eq!(summary.interfaces, vec![(0xfe, 1, 2)]);
    assert_eq!(summary.serial, serial, "the same board");
    let info = ConfigurationInfo::parse(&configuration(&mut dev)).unwrap();
    let alts: Vec<_> = info.interfaces.iter().map(|i| (i.alt_setting, i.string_index)).collect();
    assert_eq!(alts, vec![(0, 4), (1, 5)]);
    assert_eq!((string(&mut dev, 4), string(&mut dev, 5)), ("flash".to_owned(), "option bytes".to_owned()));
    assert_eq!(device_descriptor(&mut dev).product_id, DFU_PRODUCT_ID);

    let image = crate::loopback::noise(DEFAULT_SIZE, 0x5eed);
    let (status, poll, state) = download(&mut dev, FLASH_ALT, &image).await;
    assert_eq!((status, poll, state), (DfuStatus::OK, machine::MANIFEST_POLL_TIMEOUT, State::Manifest as u8));
    let digest = memory::hex(&memory::sha256(&image));
    assert_eq!(memory::hex(&memory::sha256(&std::fs::read(&path).unwrap())), digest, "FILE holds the image");
    // dfu-util: wait the poll timeout, ask again, see dfuMANIFEST-WAIT-RESET.
    tokio::time::sleep(poll).await;
    let (status, _, state) = get_status(&mut dev, DFU_MODE_INTERFACE);
    assert_eq!((status, state), (DfuStatus::OK, State::ManifestWaitReset as u8));
    until_enumeration(&mut dev, 2).await;

    // Runtime again, running the new image.
    let summary = dev.summary();
    assert_eq!(summary.product_id, RUNTIME_PRODUCT_ID);
    assert_eq!(summary.product, format!("usbwire DFU demo (fw {})", &digest[..8]));
    assert_eq!(string(&mut dev, 2), summary.product, "the string descriptor says the same");
    let hash = ok_request(&mut dev, [0xc0, REQUEST_FIRMWARE_SHA256, 0, 0, 0, 0, 32, 0], &[]);
    assert_eq!(memory::hex(&hash), digest);

    // And back into DFU mode to read it out.
    detach(&mut dev).await;
    assert_eq!(upload(&mut dev, FLASH_ALT), image);
    assert_eq!(dev.enumeration(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_usb_reset_in_dfu_mode_returns_to_runtime_at_once() {
    let dir = scratch("reset");
    let dir = dir.path();
    let path = dir.join("fw.bin");
    std::fs::write(&path, b"running").unwrap();
    let mut dev: Box<dyn Device> = Box::new(DfuDevice::open(&path, &DfuOptions::default()).unwrap());
    let runtime_product = dev.summary().product;
    dev.reset();
    assert_eq!(dev.enumeration(), 0, "a reset in runtime mode changes nothing");
    detach(&mut dev).await;
    // Half a download, then the reset (what the server does when an import ends).
    configure(&mut dev);
    ok_request(&mut dev, [0x21, request::DNLOAD, 0, 0, 0, 0, 4, 0], b"half");
    dev.reset();
    assert_eq!(dev.enumeration(), 2);
    assert_eq!((dev.summary().product_id, dev.summary().product), (RUNTIME_PRODUCT_ID, runtime_product));
    assert_eq!(std::fs::read(&path).unwrap(), b"running", "an unfinished download changes nothing");

    // The hub-class port reset a usbip-win client sends does the same, once its reply is out.
    detach(&mut dev).await;
    configure(&mut dev);
    dev.submit(control(9, [0x23, 0x03, 4, 0, 1, 0, 0, 0], &[]));
    assert_eq!(next(&mut dev).unwrap().status, Status::OK);
    until_enumeration(&mut dev, 4).await;
    assert_eq!(dev.summary().product_id, RUNTIME_PRODUCT_ID);
}

#[tokio::test(start_paused = true)]
async fn a_reset_right_after_detach_enters_dfu_mode() {
    let dir = scratch("detach-reset");
    let dir = dir.path();
    let mut dev: Box<dyn Device> = Box::new(DfuDevice::open(&dir.join("fw.bin"), &DfuOptions::default()).unwrap());
    configure(&mut dev);
    ok_request(&mut dev, dfu_out(request::DETACH, RUNTIME_DFU_INTERFACE, 1000), &[]);
    dev.reset();
    assert_eq!((dev.enumeration(), dev.summary().product_id), (1, DFU_PRODUCT_ID));
}

#[tokio::test(start_paused = true)]
async fn an_image_over_size_is_err_address_and_file_is_untouched() {
    let dir = scratch("too-large");
    let dir = dir.path();
    let path = dir.join("fw.bin");
    std::fs::write(&path, b"old").unwrap();
    let mut dev: Box<dyn Device> = Box::new(DfuDevice::open(&path, &DfuOptions { size: 8192 }).unwrap());
    detach(&mut dev).await;
    let (status, _, state) = download(&mut dev, FLASH_ALT, &[7u8; 8193]).await;
    assert_eq!((status, state), (DfuStatus::ERR_ADDRESS, State::Error as u8));
    assert_eq!(std::fs::read(&path).unwrap(), b"old");
    // CLRSTATUS, and the same device takes an image that fits.
    ok_request(&mut dev, dfu_out(request::CLRSTATUS, DFU_MODE_INTERFACE, 0), &[]);
    let (status, _, state) = download(&mut dev, FLASH_ALT, &[7u8; 8192]).await;
    assert_eq!((status, state), (DfuStatus::OK, State::Manifest as u8));
    assert_eq!(std::fs::read(&path).unwrap(), vec![7u8; 8192]);
}

#[tokio::test(start_paused = true)]
async fn wrong_state_wrong_alternate_and_short_option_bytes_are_refused() {
    let dir = scratch("refused");
    let dir = dir.path();
    std::fs::write(dir.join("fw.bin"), b"firmware").unwrap();
    let mut dev: Box<dyn Device> = Box::new(DfuDevice::open(&dir.join("fw.bin"), &DfuOptions::default()).unwrap());
    // Runtime mode: no DNLOAD.
    configure(&mut dev);
    assert_eq!(status_of(&mut dev, [0x21, request::DNLOAD, 0, 0, 1, 0, 1, 0], b"x"), Status::EPIPE);
    detach(&mut dev).await;
    configure(&mut dev);
    assert_eq!(status_of(&mut dev, [0x01, 0x0b, 2, 0, 0, 0, 0, 0], &[]), Status::EPIPE, "no alternate setting 2");

    // DNLOAD in dfuUPLOAD-IDLE: stalled, dfuERROR, errSTALLEDPKT.
    ok_request(&mut dev, dfu_in(request::UPLOAD, DFU_MODE_INTERFACE, 1), &[]);
    assert_eq!(status_of(&mut dev, [0x21, request::DNLOAD, 0, 0, 0, 0, 1, 0], b"x"), Status::EPIPE);
    let (status, _, state) = get_status(&mut dev, DFU_MODE_INTERFACE);
    assert_eq!((status, state), (DfuStatus::ERR_STALLEDPKT, State::Error as u8));
    ok_request(&mut dev, dfu_out(request::CLRSTATUS, DFU_MODE_INTERFACE, 0), &[]);

    // Option bytes: 16 bytes with complements; fewer is errNOTDONE at the end of the download.
    assert_eq!(upload(&mut dev, OPTION_BYTES_ALT).len(), OPTION_BYTES_LEN);
    ok_request(&mut dev, [0x21, request::DNLOAD, 0, 0, 0, 0, 2, 0], &[0x01, 0xfe]);
    get_status(&mut dev, DFU_MODE_INTERFACE);
    tokio::time::sleep(machine::BLOCK_POLL_TIMEOUT).await;
    get_status(&mut dev, DFU_MODE_INTERFACE);
    assert_eq!(status_of(&mut dev, dfu_out(request::DNLOAD, DFU_MODE_INTERFACE, 1), &[]), Status::EPIPE);
    let (status, _, state) = get_status(&mut dev, DFU_MODE_INTERFACE);
    assert_eq!((status, state), (DfuStatus::ERR_NOTDONE, State::Error as u8));
}

#[test]
fn files_that_cannot_be_firmware_are_refused_with_what_to_do() {
    let dir = scratch("open");
    let dir = dir.path();
    let options = DfuOptions::default();
    let link = dir.join("link");
    std::os::unix::fs::symlink(dir.join("elsewhere"), &link).unwrap();
    assert!(matches!(DfuDevice::open(&link, &options), Err(DfuError::Symlink(_))));
    assert!(matches!(DfuDevice::open(dir, &options), Err(DfuError::NotAFile(_))));
    let big = dir.join("big.bin");
    std::fs::write(&big, [0u8; 10]).unwrap();
    let error = DfuDevice::open(&big, &DfuOptions { size: 8 }).err().unwrap();
    assert!(error.to_string().contains("raise size="), "{error}");
    assert!(matches!(DfuDevice::open(&big, &DfuOptions { size: 0 }), Err(DfuError::BadSize(0))));
    assert!(matches!(DfuDevice::open(&big, &DfuOptions { size: MAX_SIZE + 1 }), Err(DfuError::BadSize(_))));
    let missing_dir = dir.join("no-such-dir").join("fw.bin");
    let error = DfuDevice::open(&missing_dir, &options).err().unwrap();
    assert!(matches!(error, DfuError::Directory { .. }), "{error}");
    // Nothing is left behind by the directory check.
    let fine = dir.join("fw.bin");
    DfuDevice::open(&fine, &options).unwrap();
    let names: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 2, "{names:?}");
}
