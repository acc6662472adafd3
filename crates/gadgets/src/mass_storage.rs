//! USB mass storage: Bulk-Only Transport carrying the SCSI commands a host
//! needs to use an image file as a disk.
//!
//! The BOT state machine lives here (CBW → optional data phase → CSW, with the
//! stall-until-reset recovery the spec demands after an invalid CBW); the
//! SCSI command set lives in [`scsi`]. Writes go to the file (`pwrite`)
//! before the CSW that acknowledges them, so an acknowledged write is in the
//! image; SYNCHRONIZE CACHE makes it durable with `fdatasync`.

mod scsi;

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::task::{Context, Poll};

use bytes::Bytes;
use tracing::{debug, trace};
use usbwire_device::control::{RequestKind, SetupPacket};
use usbwire_device::descriptor::{ConfigurationBuilder, DeviceDescriptor, EndpointSpec};
use usbwire_device::{
    Completion, CompletionQueue, ControlReply, DescriptorSet, Function, Speed, Status, Urb, VirtualDevice,
};

use crate::identity::{MANUFACTURER, VENDOR_ID};
pub use scsi::BLOCK_SIZE;
use scsi::{Outcome, Sense};

/// The disk's product id.
pub const PRODUCT_ID: u16 = 0x0003;
/// Bulk IN endpoint (data to the host and CSWs).
pub const BULK_IN: u8 = 0x81;
/// Bulk OUT endpoint (CBWs and data from the host).
pub const BULK_OUT: u8 = 0x02;

const CBW_SIGNATURE: u32 = 0x4342_5355;
const CSW_SIGNATURE: u32 = 0x5342_5355;
const CBW_LEN: usize = 31;
/// Bulk-Only Mass Storage Reset.
const REQUEST_RESET: u8 = 0xff;
/// Get Max LUN.
const REQUEST_GET_MAX_LUN: u8 = 0xfe;

/// How to open the image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskOptions {
    /// Create the image with this many bytes if it does not exist.
    pub size: Option<u64>,
    /// Refuse writes (WRITE gets DATA PROTECT; MODE SENSE reports write protect).
    pub read_only: bool,
    /// `Speed::HIGH` or `Speed::SUPER`.
    pub speed: Speed,
    /// Blocks that cannot be read, as on a failing medium: a READ that
    /// touches one fails with MEDIUM ERROR, unrecovered read error (what the
    /// host does then is a real disk's error path, for tests).
    pub bad_blocks: Option<std::ops::RangeInclusive<u64>>,
}

/// Why an image cannot be served.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskError {
    /// No such file and no size to create it with.
    #[error("{} does not exist; add size=64M (for example) to create it", .0.display())]
    Missing(PathBuf),
    /// Sizes must be whole 512-byte blocks.
    #[error("size {0} is not a positive multiple of 512 bytes")]
    BadSize(u64),
    /// An existing image whose length is not whole blocks.
    #[error(
        "{} is {len} bytes, not a positive multiple of 512: give a disk image, or remove it (and size= creates a new one)",
        .path.display()
    )]
    BadImage { path: PathBuf, len: u64 },
    /// An existing image of another size than asked for.
    #[error("{} is {len} bytes but size={wanted} was given; drop size= to use it as it is", .path.display())]
    SizeMismatch { path: PathBuf, len: u64, wanted: u64 },
    /// The file could not be opened.
    #[error("cannot open {}: {source}{}", .path.display(), if .source.kind() == io::ErrorKind::PermissionDenied { " (add ,ro to serve it read-only)" } else { "" })]
    Open { path: PathBuf, source: io::Error },
    /// There was no image and a new one could not be made (its directory is
    /// missing or not writable, or the file system refuses the size); nothing
    /// is left behind.
    #[error("cannot create {}: {source}", .path.display())]
    Create { path: PathBuf, source: io::Error },
    /// [`MassStorage::open_no_follow`] found a symbolic link where the image should be.
    #[error(
        "{} is a symbolic link; refusing to follow it (it may point at a file that is not a disk image): \
         remove it, and the image is created there again",
        .0.display()
    )]
    Symlink(PathBuf),
}

/// A new image of `size` bytes (sparse, 0600) at `path`, made whole under a
/// temporary name beside it and then renamed into place, so a failure (a
/// size the file system refuses) leaves nothing behind, and the final name is
/// never opened through a link, dangling or not, nor an existing file replaced.
fn create_image(path: &Path, size: u64) -> io::Result<std::fs::File> {
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temporary = tempfile::Builder::new().prefix(&format!(".{name}.")).suffix(".tmp").tempfile_in(dir)?;
    temporary.as_file().set_len(size)?;
    temporary.persist_noclobber(path).map_err(|e| e.error)
}

/// Where the Bulk-Only transport is.
#[derive(Debug)]
enum Phase {
    /// Waiting for a CBW on bulk OUT.
    Command,
    /// Sending `data[sent..]` to the host, then the CSW.
    DataIn { tag: u32, expected: u32, data: Bytes, sent: usize, status: u8 },
    /// Taking `expected` bytes from the host (written at `offset` when `write` is set).
    DataOut { tag: u32, expected: u32, received: u32, write: Option<WriteTarget> },
    /// The CSW waits for a bulk IN URB.
    Status([u8; 13]),
    /// An invalid CBW: both endpoints stall until a Bulk-Only reset.
    NeedsReset,
}

#[derive(Debug, Clone, Copy)]
struct WriteTarget {
    offset: u64,
    len: u64,
}

/// The mass-storage function (see [`MassStorage::open`]).
#[derive(Debug)]
pub struct MassStorage {
    descriptors: DescriptorSet,
    disk: scsi::Disk,
    phase: Phase,
    waiting_in: VecDeque<Urb>,
    halted_in: bool,
    halted_out: bool,
    done: CompletionQueue,
}

impl MassStorage {
    /// Opens `path` (creating it with `options.size` bytes if it does not exist)
    /// as a disk offered at `options.speed`.
    pub fn open(path: &Path, options: &DiskOptions) -> Result<VirtualDevice<Self>, DiskError> {
        Self::open_with(path, options, true)
    }

    /// Like [`open`](Self::open), but refuses (with [`DiskError::Symlink`])
    /// when `path` itself is a symbolic link, with `O_NOFOLLOW` on every open,
    /// so a link planted where the image belongs cannot make us write into
    /// the file it points at. For images at a path we chose (the demo's).
    pub fn open_no_follow(path: &Path, options: &DiskOptions) -> Result<VirtualDevice<Self>, DiskError> {
        Self::open_with(path, options, false)
    }

    fn open_with(path: &Path, options: &DiskOptions, follow: bool) -> Result<VirtualDevice<Self>, DiskError> {
        use std::os::unix::fs::OpenOptionsExt as _;
        if let Some(size) = options.size {
            if size == 0 || size % BLOCK_SIZE != 0 {
                return Err(DiskError::BadSize(size));
            }
        }
        let open_error = |source: io::Error| {
            if !follow && source.raw_os_error() == Some(libc::ELOOP) {
                DiskError::Symlink(path.to_path_buf())
            } else {
                DiskError::Open { path: path.to_path_buf(), source }
            }
        };
        let flags = if follow { 0 } else { libc::O_NOFOLLOW };
        let file = match OpenOptions::new().read(true).write(!options.read_only).custom_flags(flags).open(path) {
            Ok(file) => file,
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                let size = options.size.ok_or_else(|| DiskError::Missing(path.to_path_buf()))?;
                let file = create_image(path, size).map_err(|source| match open_error(source) {
                    DiskError::Open { path, source } => DiskError::Create { path, source },
                    other => other,
                })?;
                if options.read_only {
                    OpenOptions::new().read(true).custom_flags(flags).open(path).map_err(open_error)?
                } else {
                    file
                }
            }
            Err(error) => return Err(open_error(error)),
        };
        let len = file.metadata().map_err(open_error)?.len();
        if len == 0 || len % BLOCK_SIZE != 0 {
            return Err(DiskError::BadImage { path: path.to_path_buf(), len });
        }
        if let Some(wanted) = options.size {
            if wanted != len {
                return Err(DiskError::SizeMismatch { path: path.to_path_buf(), len, wanted });
            }
        }
        let serial = crate::identity::serial_number(path);
        let speed = if options.speed.is_superspeed() { Speed::SUPER } else { Speed::HIGH };
        let configuration = ConfigurationBuilder::new(speed, 100)
            .interface(0, 2, 0x08, 0x06, 0x50, 0)
            .endpoint(EndpointSpec::bulk(BULK_IN, speed))
            .endpoint(EndpointSpec::bulk(BULK_OUT, speed))
            .build();
        let descriptors = DescriptorSet::new(
            speed,
            DeviceDescriptor::for_speed(speed, VENDOR_ID, PRODUCT_ID),
            configuration,
            vec![MANUFACTURER.to_owned(), "usbwire disk".to_owned(), serial.clone()],
        );
        Ok(VirtualDevice::new(Self {
            descriptors,
            disk: scsi::Disk::new(file, len / BLOCK_SIZE, options.read_only, serial, options.bad_blocks.clone()),
            phase: Phase::Command,
            waiting_in: VecDeque::new(),
            halted_in: false,
            halted_out: false,
            done: CompletionQueue::new(),
        }))
    }

    /// Number of 512-byte blocks.
    pub fn blocks(&self) -> u64 {
        self.disk.blocks()
    }

    fn bulk_out(&mut self, urb: Urb) {
        if self.halted_out {
            self.done.push(urb.complete_with(Status::EPIPE));
            return;
        }
        match &mut self.phase {
            Phase::Command => {
                let done = urb.complete_out();
                self.command(&urb.data);
                self.done.push(done);
            }
            Phase::DataOut { tag, expected, received, write } => {
                let room = (*expected - *received) as usize;
                let take = urb.data.len().min(room);
                let chunk = &urb.data[..take];
                let mut failed = None;
                if let Some(target) = write {
                    let start = u64::from(*received);
                    if start < target.len {
                        let usable = (target.len - start).min(chunk.len() as u64) as usize;
                        if let Err(error) = self.disk.write_at(target.offset + start, &chunk[..usable]) {
                            debug!(%error, "image write failed");
                            failed = Some(Sense::WRITE_ERROR);
                        }
                    }
                }
                *received += take as u32;
                let (tag, expected, received) = (*tag, *expected, *received);
                let write_len = write.map(|t| t.len);
                if let Some(sense) = failed {
                    self.disk.set_sense(sense);
                    self.phase = Phase::Status(csw(tag, expected - received, 1));
                } else if received == expected {
                    // A host that sent more than the command needed gets the excess as residue.
                    let used = write_len.map_or(0, |len| len.min(u64::from(expected)) as u32);
                    let (residue, status) = match write_len {
                        Some(_) => (expected - used, 0),
                        None => (expected, 1),
                    };
                    self.phase = Phase::Status(csw(tag, residue, status));
                }
                self.done.push(urb.complete_out());
                self.pump();
            }
            _ => {
                // The host sent data while we owe it data or a status: a phase error.
                debug!(phase = ?self.phase, "bulk OUT in the wrong phase");
                self.done.push(urb.complete_with(Status::EPIPE));
            }
        }
    }

    fn command(&mut self, raw: &[u8]) {
        let Some(cbw) = Cbw::parse(raw) else {
            debug!(len = raw.len(), "invalid CBW: stalling until reset recovery");
            self.phase = Phase::NeedsReset;
            self.halted_in = true;
            self.halted_out = true;
            self.fail_waiting_in();
            return;
        };
        trace!(tag = cbw.tag, cdb = ?cbw.cdb, flags = raw[12], len = cbw.data_length, "CBW");
        let outcome = if cbw.lun != 0 { self.disk.no_such_lun() } else { self.disk.execute(&cbw.cdb) };
        let expected = cbw.data_length;
        self.phase = if expected == 0 {
            // No data phase. A command that wanted to move data is a phase error (BOT cases 2 and 3).
            let wants_data = match &outcome {
                Outcome::DataIn(data) => !data.is_empty(),
                Outcome::Write { len, .. } => *len > 0,
                Outcome::Done => false,
            };
            Phase::Status(csw(cbw.tag, 0, if wants_data { 2 } else { self.disk.status() }))
        } else {
            match (outcome, cbw.data_in) {
                (Outcome::DataIn(mut data), true) => {
                    data.truncate(expected as usize);
                    Phase::DataIn { tag: cbw.tag, expected, data, sent: 0, status: self.disk.status() }
                }
                (Outcome::Write { offset, len }, false) => {
                    Phase::DataOut { tag: cbw.tag, expected, received: 0, write: Some(WriteTarget { offset, len }) }
                }
                (Outcome::Done, true) => {
                    Phase::DataIn { tag: cbw.tag, expected, data: Bytes::new(), sent: 0, status: self.disk.status() }
                }
                (Outcome::Done, false) => Phase::DataOut { tag: cbw.tag, expected, received: 0, write: None },
                (_, true) => {
                    // The host reads where the command writes: phase error (BOT case 10).
                    Phase::DataIn { tag: cbw.tag, expected, data: Bytes::new(), sent: 0, status: 2 }
                }
                (_, false) => {
                    // The host writes where the command reads (BOT case 8): absorb, then fail.
                    Phase::DataOut { tag: cbw.tag, expected, received: 0, write: None }
                }
            }
        };
        if let Phase::DataOut { write: None, .. } = self.phase {
            // Data the command does not take is absorbed; the CSW reports failure.
            if self.disk.status() == 0 {
                self.disk.set_sense(Sense::INVALID_FIELD_IN_CDB);
            }
        }
        self.pump();
    }

    /// Completes waiting bulk IN URBs with data or the CSW, as far as the phase allows.
    fn pump(&mut self) {
        while let Some(urb) = self.waiting_in.pop_front() {
            match &mut self.phase {
                Phase::DataIn { tag, expected, data, sent, status } => {
                    let take = (urb.length as usize).min(data.len() - *sent);
                    let chunk = data.slice(*sent..*sent + take);
                    *sent += take;
                    // A short packet ends the data phase even if the host wanted more.
                    let finished = *sent == data.len();
                    let residue = *expected - *sent as u32;
                    let (tag, status) = (*tag, *status);
                    self.done.push(urb.complete_in(chunk));
                    if finished {
                        self.phase = Phase::Status(csw(tag, residue, status));
                    }
                }
                Phase::Status(wrapper) => {
                    let wrapper = *wrapper;
                    self.done.push(urb.complete_in(Bytes::copy_from_slice(&wrapper)));
                    self.phase = Phase::Command;
                }
                Phase::Command | Phase::DataOut { .. } | Phase::NeedsReset => {
                    // No IN phase: it waits, first in line, for the next one.
                    self.waiting_in.push_front(urb);
                    return;
                }
            }
        }
    }

    fn fail_waiting_in(&mut self) {
        while let Some(urb) = self.waiting_in.pop_front() {
            self.done.push(urb.complete_with(Status::EPIPE));
        }
    }
}

impl Function for MassStorage {
    fn descriptors(&self) -> &DescriptorSet {
        &self.descriptors
    }

    fn control(&mut self, setup: &SetupPacket, _data: &[u8]) -> ControlReply {
        if setup.kind() != RequestKind::Class || setup.index & 0xff != 0 {
            return ControlReply::Stall;
        }
        match (setup.request_type, setup.request) {
            (0x21, REQUEST_RESET) if setup.value == 0 && setup.length == 0 => {
                debug!("bulk-only mass storage reset");
                self.phase = Phase::Command;
                ControlReply::Data(Vec::new())
            }
            (0xa1, REQUEST_GET_MAX_LUN) if setup.value == 0 && setup.length == 1 => ControlReply::Data(vec![0]),
            _ => ControlReply::Stall,
        }
    }

    fn set_configuration(&mut self, _value: u8) {
        self.reset();
    }

    fn clear_halt(&mut self, endpoint_address: u8) {
        // After an invalid CBW the endpoints stay halted until the reset (BOT 6.6.1).
        if matches!(self.phase, Phase::NeedsReset) {
            return;
        }
        match endpoint_address {
            BULK_IN => self.halted_in = false,
            BULK_OUT => self.halted_out = false,
            _ => {}
        }
    }

    fn is_halted(&self, endpoint_address: u8) -> bool {
        match endpoint_address {
            BULK_IN => self.halted_in,
            BULK_OUT => self.halted_out,
            _ => false,
        }
    }

    fn submit(&mut self, urb: Urb) {
        if urb.is_in() {
            if self.halted_in {
                self.done.push(urb.complete_with(Status::EPIPE));
                return;
            }
            self.waiting_in.push_back(urb);
            self.pump();
        } else {
            self.bulk_out(urb);
        }
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        self.done.poll_pop(cx)
    }

    fn cancel(&mut self, seqnum: u32) {
        if let Some(at) = self.waiting_in.iter().position(|u| u.seqnum == seqnum) {
            if let Some(urb) = self.waiting_in.remove(at) {
                self.done.push(urb.complete_with(Status::ECONNRESET));
            }
        }
    }

    fn reset(&mut self) {
        self.waiting_in.clear();
        self.done.clear();
        self.phase = Phase::Command;
        self.halted_in = false;
        self.halted_out = false;
        self.disk.set_sense(Sense::NONE);
    }
}

/// A Command Block Wrapper.
struct Cbw {
    tag: u32,
    data_length: u32,
    data_in: bool,
    lun: u8,
    cdb: Vec<u8>,
}

impl Cbw {
    /// A valid and meaningful CBW (BOT 6.2), or `None`.
    fn parse(raw: &[u8]) -> Option<Self> {
        if raw.len() != CBW_LEN {
            return None;
        }
        let le = |at: usize| u32::from_le_bytes([raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]);
        if le(0) != CBW_SIGNATURE {
            return None;
        }
        let cdb_len = usize::from(raw[14] & 0x1f);
        if !(1..=16).contains(&cdb_len) || raw[13] & 0xf0 != 0 {
            return None;
        }
        Some(Self {
            tag: le(4),
            data_length: le(8),
            data_in: raw[12] & 0x80 != 0,
            lun: raw[13],
            cdb: raw[15..15 + cdb_len].to_vec(),
        })
    }
}

/// A Command Status Wrapper.
fn csw(tag: u32, residue: u32, status: u8) -> [u8; 13] {
    let mut w = [0u8; 13];
    w[0..4].copy_from_slice(&CSW_SIGNATURE.to_le_bytes());
    w[4..8].copy_from_slice(&tag.to_le_bytes());
    w[8..12].copy_from_slice(&residue.to_le_bytes());
    w[12] = status;
    w
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{configure, data_in, data_out, next, request};
    use proptest::prelude::*;
    use usbwire_device::descriptor::{self, ConfigurationInfo};
    use usbwire_device::Device;

    struct Image(PathBuf);

    impl Image {
        fn new(name: &str) -> Self {
            let path = std::env::temp_dir().join(format!("usbwire-msc-{}-{name}.img", std::process::id()));
            let _ = std::fs::remove_file(&path);
            Self(path)
        }
    }

    impl Drop for Image {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn disk(image: &Image, read_only: bool, speed: Speed) -> VirtualDevice<MassStorage> {
        if !image.0.exists() {
            drop(
                MassStorage::open(
                    &image.0,
                    &DiskOptions { size: Some(1 << 20), read_only: false, speed, bad_blocks: None },
                )
                .unwrap(),
            );
        }
        let mut dev =
            MassStorage::open(&image.0, &DiskOptions { size: None, read_only, speed, bad_blocks: None }).unwrap();
        configure(&mut dev);
        dev
    }

    fn cbw(tag: u32, length: u32, data_in: bool, cdb: &[u8]) -> Bytes {
        let mut raw = vec![0u8; CBW_LEN];
        raw[0..4].copy_from_slice(&CBW_SIGNATURE.to_le_bytes());
        raw[4..8].copy_from_slice(&tag.to_le_bytes());
        raw[8..12].copy_from_slice(&length.to_le_bytes());
        raw[12] = if data_in { 0x80 } else { 0 };
        raw[14] = cdb.len() as u8;
        raw[15..15 + cdb.len()].copy_from_slice(cdb);
        raw.into()
    }

    /// One BOT command with an IN data phase: returns (data, residue, status).
    fn command_in(dev: &mut VirtualDevice<MassStorage>, cdb: &[u8], length: u32) -> (Bytes, u32, u8) {
        dev.submit(data_out(1, BULK_OUT, cbw(7, length, true, cdb)));
        assert_eq!(next(dev).unwrap().status, Status::OK);
        let mut data = Bytes::new();
        if length > 0 {
            dev.submit(data_in(2, BULK_IN, length));
            data = next(dev).expect("data phase").data;
        }
        let (residue, status) = read_csw(dev, 7);
        (data, residue, status)
    }

    fn command_out(dev: &mut VirtualDevice<MassStorage>, cdb: &[u8], payload: &[u8]) -> (u32, u8) {
        dev.submit(data_out(1, BULK_OUT, cbw(9, payload.len() as u32, false, cdb)));
        assert_eq!(next(dev).unwrap().status, Status::OK);
        if !payload.is_empty() {
            dev.submit(data_out(2, BULK_OUT, Bytes::copy_from_slice(payload)));
            assert_eq!(next(dev).unwrap().actual_length as usize, payload.len());
        }
        read_csw(dev, 9)
    }

    fn read_csw(dev: &mut VirtualDevice<MassStorage>, tag: u32) -> (u32, u8) {
        dev.submit(data_in(3, BULK_IN, 13));
        let csw = next(dev).expect("CSW").data;
        assert_eq!(csw.len(), 13);
        assert_eq!(&csw[0..4], &CSW_SIGNATURE.to_le_bytes());
        assert_eq!(u32::from_le_bytes(csw[4..8].try_into().unwrap()), tag);
        (u32::from_le_bytes(csw[8..12].try_into().unwrap()), csw[12])
    }

    fn sense(dev: &mut VirtualDevice<MassStorage>) -> (u8, u8) {
        let (data, _, status) = command_in(dev, &[0x03, 0, 0, 0, 18, 0], 18);
        assert_eq!(status, 0);
        assert_eq!(data[0], 0x70);
        (data[2], data[12])
    }

    #[test]
    fn inquiry_and_capacity() {
        let image = Image::new("inquiry");
        let mut dev = disk(&image, false, Speed::HIGH);
        let (data, residue, status) = command_in(&mut dev, &[0x12, 0, 0, 0, 36, 0], 36);
        assert_eq!((residue, status), (0, 0));
        assert_eq!(data[1], 0x80, "removable");
        assert_eq!(&data[8..16], b"usbwire ");
        let (data, _, _) = command_in(&mut dev, &[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], 8);
        assert_eq!(u32::from_be_bytes(data[0..4].try_into().unwrap()), 2047);
        assert_eq!(u32::from_be_bytes(data[4..8].try_into().unwrap()), 512);
        let (data, _, _) = command_in(&mut dev, &[0x9e, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0], 32);
        assert_eq!(u64::from_be_bytes(data[0..8].try_into().unwrap()), 2047);
        // VPD serial page.
        let (data, _, status) = command_in(&mut dev, &[0x12, 1, 0x80, 0, 64, 0], 64);
        assert_eq!(status, 0);
        assert_eq!(data[1], 0x80);
        // A short answer leaves a residue.
        let (data, residue, _) = command_in(&mut dev, &[0x12, 0, 0, 0, 36, 0], 96);
        assert_eq!((data.len(), residue), (36, 60));
    }

    #[test]
    fn write_then_read_back_and_in_the_file() {
        let image = Image::new("rw");
        let mut dev = disk(&image, false, Speed::HIGH);
        let payload: Vec<u8> = (0..1024u32).map(|i| (i * 31 % 251) as u8).collect();
        // WRITE(10) LBA 5, 2 blocks.
        let (residue, status) = command_out(&mut dev, &[0x2a, 0, 0, 0, 0, 5, 0, 0, 2, 0], &payload);
        assert_eq!((residue, status), (0, 0));
        // Acknowledged means in the file, before any sync.
        let file = std::fs::read(&image.0).unwrap();
        assert_eq!(&file[5 * 512..7 * 512], &payload[..]);
        assert_eq!(command_out(&mut dev, &[0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]), (0, 0));
        // READ(16) back.
        let (data, residue, status) = command_in(&mut dev, &[0x88, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 2, 0, 0], 1024);
        assert_eq!((residue, status), (0, 0));
        assert_eq!(&data[..], &payload[..]);
    }

    #[test]
    fn data_phase_split_across_urbs() {
        let image = Image::new("split");
        let mut dev = disk(&image, false, Speed::HIGH);
        let payload = vec![0x5au8; 4096];
        dev.submit(data_out(1, BULK_OUT, cbw(1, 4096, false, &[0x2a, 0, 0, 0, 0, 0, 0, 0, 8, 0])));
        next(&mut dev).unwrap();
        for (i, chunk) in payload.chunks(1000).enumerate() {
            dev.submit(data_out(10 + i as u32, BULK_OUT, Bytes::copy_from_slice(chunk)));
            assert_eq!(next(&mut dev).unwrap().status, Status::OK);
        }
        assert_eq!(read_csw(&mut dev, 1), (0, 0));
        // Read it with two IN URBs queued before the command arrives.
        dev.submit(data_in(20, BULK_IN, 2048));
        dev.submit(data_in(21, BULK_IN, 2048));
        dev.submit(data_in(22, BULK_IN, 13));
        dev.submit(data_out(23, BULK_OUT, cbw(2, 4096, true, &[0x28, 0, 0, 0, 0, 0, 0, 0, 8, 0])));
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(next(&mut dev).unwrap());
        }
        let by_seq = |s: u32| got.iter().find(|c| c.seqnum == s).unwrap();
        assert_eq!(by_seq(20).data.len() + by_seq(21).data.len(), 4096);
        assert!(by_seq(20).data.iter().chain(by_seq(21).data.iter()).all(|&b| b == 0x5a));
        assert_eq!(by_seq(22).data[12], 0);
    }

    #[test]
    fn errors_have_real_sense_data() {
        let image = Image::new("sense");
        let mut dev = disk(&image, false, Speed::HIGH);
        assert_eq!(command_in(&mut dev, &[0xd7, 0, 0, 0, 0, 0], 0).2, 1);
        assert_eq!(sense(&mut dev), (0x05, 0x20));
        assert_eq!(sense(&mut dev), (0x00, 0x00), "sense is cleared once read");
        // READ beyond the end.
        let (data, residue, status) = command_in(&mut dev, &[0x28, 0, 0, 0, 0x07, 0xff, 0, 0, 2, 0], 1024);
        assert_eq!((data.len(), residue, status), (0, 1024, 1));
        assert_eq!(sense(&mut dev), (0x05, 0x21));
        // MODE SENSE of an unknown page.
        assert_eq!(command_in(&mut dev, &[0x1a, 0, 0x1c, 0, 64, 0], 64).2, 1);
        assert_eq!(sense(&mut dev), (0x05, 0x24));
        // MODE SENSE(6) of all pages: not write protected.
        let (data, _, status) = command_in(&mut dev, &[0x1a, 0, 0x3f, 0, 192, 0], 192);
        assert_eq!((status, data[2] & 0x80), (0, 0));
        assert_eq!(data[4], 0x08);
    }

    #[test]
    fn a_read_that_touches_a_bad_block_fails_with_a_medium_error_and_its_neighbours_read() {
        let image = Image::new("bad");
        drop(disk(&image, false, Speed::HIGH));
        let options = DiskOptions { size: None, read_only: false, speed: Speed::HIGH, bad_blocks: Some(100..=103) };
        let mut dev = MassStorage::open(&image.0, &options).unwrap();
        configure(&mut dev);
        let read10 = |lba: u32, blocks: u16| {
            let [l0, l1, l2, l3] = lba.to_be_bytes();
            let [b0, b1] = blocks.to_be_bytes();
            [0x28, 0, l0, l1, l2, l3, 0, b0, b1, 0]
        };
        for (lba, blocks) in [(96, 4), (104, 8), (0, 100)] {
            let (data, residue, status) = command_in(&mut dev, &read10(lba, blocks), u32::from(blocks) * 512);
            assert_eq!((data.len(), residue, status), (usize::from(blocks) * 512, 0, 0), "LBA {lba}+{blocks}");
        }
        for (lba, blocks) in [(96, 5), (103, 1), (90, 20)] {
            let (_, residue, status) = command_in(&mut dev, &read10(lba, blocks), u32::from(blocks) * 512);
            assert_eq!((residue, status), (u32::from(blocks) * 512, 1), "LBA {lba}+{blocks}");
            assert_eq!(sense(&mut dev), (0x03, 0x11), "MEDIUM ERROR, unrecovered read error");
        }
        // Writes are not refused: the medium takes them, only reads fail.
        assert_eq!(command_out(&mut dev, &[0x2a, 0, 0, 0, 0, 100, 0, 0, 1, 0], &[7; 512]), (0, 0));
    }

    #[test]
    fn read_only_refuses_writes_with_data_protect() {
        let image = Image::new("ro");
        drop(disk(&image, false, Speed::HIGH));
        let mut dev = disk(&image, true, Speed::HIGH);
        let (residue, status) = command_out(&mut dev, &[0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[1u8; 512]);
        assert_eq!((residue, status), (512, 1));
        assert_eq!(sense(&mut dev), (0x07, 0x27));
        assert!(std::fs::read(&image.0).unwrap().iter().all(|&b| b == 0));
        let (data, _, _) = command_in(&mut dev, &[0x5a, 0, 0x3f, 0, 0, 0, 0, 0, 255, 0], 255);
        assert_eq!(data[3] & 0x80, 0x80, "write protect bit");
    }

    #[test]
    fn invalid_cbw_stalls_until_reset_recovery() {
        let image = Image::new("stall");
        let mut dev = disk(&image, false, Speed::HIGH);
        dev.submit(data_out(1, BULK_OUT, Bytes::from_static(b"not a cbw")));
        next(&mut dev).unwrap();
        dev.submit(data_in(2, BULK_IN, 13));
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE);
        // Clearing the halt alone is not enough.
        request(&mut dev, [0x02, 0x01, 0, 0, BULK_IN, 0, 0, 0], &[]);
        dev.submit(data_in(3, BULK_IN, 13));
        assert_eq!(next(&mut dev).unwrap().status, Status::EPIPE);
        // Reset recovery: class reset, then clear both halts.
        request(&mut dev, [0x21, 0xff, 0, 0, 0, 0, 0, 0], &[]);
        request(&mut dev, [0x02, 0x01, 0, 0, BULK_IN, 0, 0, 0], &[]);
        request(&mut dev, [0x02, 0x01, 0, 0, BULK_OUT, 0, 0, 0], &[]);
        assert_eq!(command_in(&mut dev, &[0x00, 0, 0, 0, 0, 0], 0), (Bytes::new(), 0, 0));
        assert_eq!(&request(&mut dev, [0xa1, 0xfe, 0, 0, 0, 0, 1, 0], &[])[..], &[0]);
    }

    #[test]
    fn superspeed_descriptors_and_cancel() {
        let image = Image::new("ss");
        let mut dev = disk(&image, false, Speed::SUPER);
        let config = request(&mut dev, [0x80, 0x06, 0, 2, 0, 0, 255, 0], &[]);
        assert!(config.iter().filter(|&&b| b == descriptor::SS_ENDPOINT_COMPANION).count() >= 2);
        let info = ConfigurationInfo::parse(&config).unwrap();
        assert_eq!(info.interfaces[0].endpoints[0].max_packet_size, 1024);
        let bos = request(&mut dev, [0x80, 0x06, 0, 0x0f, 0, 0, 255, 0], &[]);
        assert_eq!(bos[1], descriptor::BOS);
        dev.submit(data_in(5, BULK_IN, 512));
        assert!(next(&mut dev).is_none());
        dev.cancel(5);
        assert_eq!(next(&mut dev).unwrap().status, Status::ECONNRESET);
    }

    #[test]
    fn open_errors_say_what_to_do() {
        let image = Image::new("errors");
        let missing = MassStorage::open(
            &image.0,
            &DiskOptions { size: None, read_only: false, speed: Speed::HIGH, bad_blocks: None },
        );
        assert!(matches!(missing, Err(DiskError::Missing(_))));
        assert!(matches!(
            MassStorage::open(
                &image.0,
                &DiskOptions { size: Some(1000), read_only: false, speed: Speed::HIGH, bad_blocks: None }
            ),
            Err(DiskError::BadSize(1000))
        ));
        drop(disk(&image, false, Speed::HIGH));
        let mismatch = MassStorage::open(
            &image.0,
            &DiskOptions { size: Some(4096), read_only: false, speed: Speed::HIGH, bad_blocks: None },
        );
        assert!(matches!(mismatch, Err(ref e) if e.to_string().contains("drop size=")));
    }

    #[test]
    fn a_failed_creation_leaves_no_file_behind_and_an_empty_image_says_what_to_do() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        // 2^63 bytes: no file system takes it (like size=100T on ext4, "File too large").
        let huge = MassStorage::open(
            &path,
            &DiskOptions { size: Some(1 << 63), read_only: false, speed: Speed::HIGH, bad_blocks: None },
        );
        assert!(matches!(huge, Err(DiskError::Create { .. })), "{:?}", huge.err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no image and no temporary file left");
        // So the next run with a size that fits just works, and the new image is private.
        assert!(MassStorage::open(
            &path,
            &DiskOptions { size: Some(1 << 20), read_only: false, speed: Speed::HIGH, bad_blocks: None }
        )
        .is_ok());
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!((meta.len(), meta.permissions().mode() & 0o777), (1 << 20, 0o600));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // An image left empty by something else is refused with what to do.
        let empty = dir.path().join("empty.img");
        std::fs::write(&empty, b"").unwrap();
        let error = MassStorage::open(
            &empty,
            &DiskOptions { size: Some(1 << 20), read_only: false, speed: Speed::HIGH, bad_blocks: None },
        )
        .err()
        .unwrap()
        .to_string();
        assert!(error.contains("0 bytes") && error.contains("remove it"), "{error}");
    }

    #[test]
    fn open_no_follow_refuses_a_planted_symlink_and_leaves_its_target_alone() {
        let victim = Image::new("victim");
        let content: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        std::fs::write(&victim.0, &content).unwrap();
        let link = Image::new("planted");
        std::os::unix::fs::symlink(&victim.0, &link.0).unwrap();
        for size in [None, Some(1 << 20), Some(64 << 20)] {
            for read_only in [false, true] {
                let options = DiskOptions { size, read_only, speed: Speed::HIGH, bad_blocks: None };
                let opened = MassStorage::open_no_follow(&link.0, &options);
                assert!(matches!(opened, Err(DiskError::Symlink(_))), "{size:?} {read_only}");
            }
        }
        let message = MassStorage::open_no_follow(
            &link.0,
            &DiskOptions { size: None, read_only: false, speed: Speed::HIGH, bad_blocks: None },
        )
        .err()
        .unwrap()
        .to_string();
        assert!(message.contains("symbolic link") && message.contains("remove it"), "{message}");
        assert_eq!(std::fs::read(&victim.0).unwrap(), content);
        // A dangling link is refused too, and nothing is created where it points.
        std::fs::remove_file(&victim.0).unwrap();
        let opened = MassStorage::open_no_follow(
            &link.0,
            &DiskOptions { size: Some(1 << 20), read_only: false, speed: Speed::HIGH, bad_blocks: None },
        );
        assert!(matches!(opened, Err(DiskError::Symlink(_))));
        assert!(!victim.0.exists());
        // A plain path opens (and is created) as with `open`.
        let image = Image::new("no-follow-plain");
        MassStorage::open_no_follow(
            &image.0,
            &DiskOptions { size: Some(1 << 20), read_only: false, speed: Speed::HIGH, bad_blocks: None },
        )
        .unwrap();
        assert_eq!(std::fs::metadata(&image.0).unwrap().len(), 1 << 20);
    }

    proptest! {
        /// Any bytes as a CBW end in a CSW or a stall, never a panic.
        #[test]
        fn random_cbws_never_panic(raw in proptest::collection::vec(any::<u8>(), 0..40), length in 0u32..70_000, data_in_flag: bool) {
            let image = Image::new("prop");
            let mut dev = disk(&image, false, Speed::HIGH);
            let mut bytes = raw.clone();
            if bytes.len() >= 15 && data_in_flag {
                bytes[0..4].copy_from_slice(&CBW_SIGNATURE.to_le_bytes());
                bytes.resize(CBW_LEN, 0);
                bytes[8..12].copy_from_slice(&length.to_le_bytes());
            }
            dev.submit(data_out(1, BULK_OUT, Bytes::from(bytes)));
            next(&mut dev).unwrap();
            for seq in 2..8 {
                dev.submit(data_in(seq, BULK_IN, 65536));
                if let Some(done) = next(&mut dev) {
                    if done.status == Status::EPIPE || done.actual_length == 13 {
                        break;
                    }
                }
            }
        }
    }
}
