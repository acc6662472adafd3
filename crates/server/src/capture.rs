//! Packet capture of URB channels (`usbwire serve --capture DIR`): one pcapng
//! file per imported device and connection, in the Linux usbmon format
//! (`LINKTYPE_USB_LINUX_MMAPPED`), so Wireshark and tshark decode the traffic
//! down to the class protocol (SCSI for a disk, HID reports). Captured at the
//! URB level, after TLS and stream transforms are undone.
//!
//! Each URB gives two records, as usbmon's: its submission (`S`, with OUT
//! data) and its completion (`C`, with IN data). Records go to the process's
//! one writer thread through a queue bounded in bytes (all captures together):
//! the URB path never waits for the disk, and a client streaming large URBs
//! cannot make the server hold more than [`QUEUE_BYTES`] of them; when the
//! queue is full, records are dropped and counted.
//!
//! The files hold what devices carried (keystrokes, disk blocks): the
//! directory is private ([`crate::private_dir`]: created 0700, refused if a
//! symlink, another user's or writable by others), each file is created 0600
//! with `O_EXCL | O_NOFOLLOW` (a planted link is never followed), a file that
//! reaches its bound is rotated (the previous one kept as `.1`), and all
//! capture files in the directory together stay under
//! [`CaptureConfig::max_bytes`]: the oldest are deleted first.
//!
//! What a replay needs besides the URBs (`docs/recording.md`): every file,
//! a rotated one too, starts with the device's descriptors as the server
//! took them at import (its descriptor snapshot), as completed
//! `GET_DESCRIPTOR` records with URB id 0, and its interface block carries
//! the device's speed (`if_speed`). A client that answers the kernel's
//! enumeration from the snapshot never sends those requests as URBs.

mod ledger;
mod pcapng;

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter, Write as _};
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tracing::{info, warn};
use usbwire_device::sync::lock;
use usbwire_device::{Completion, TransferType, Urb};
use usbwire_proto::descriptors::Snapshot;
use usbwire_proto::op::DeviceRecord;
use usbwire_proto::urb::TransferFlags;
use usbwire_proto::Direction;

use crate::private_dir::{ensure_private_dir, PrivateDirError};
use ledger::Ledger;
use pcapng::{descriptor_records, speed_bps, write_headers, write_packet, Usbmon, EINPROGRESS, USBMON_HEADER_LEN};

/// Bytes of records waiting for the writer thread, every capture together:
/// what capture may add to the server's memory (with one write buffer per file).
pub(crate) const QUEUE_BYTES: usize = 16 << 20;
/// Default bound of one capture file.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 64 << 20;
/// Default bound of all capture files in the directory together (`capture_max_bytes`).
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;
/// Each file's write buffer.
const WRITE_BUFFER: usize = 256 * 1024;

/// Where and how much to capture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureConfig {
    pub dir: PathBuf,
    /// A file rotates past this size (the previous one is kept as `NAME.1`).
    pub max_file_bytes: u64,
    /// All capture files in `dir` together (`capture_max_bytes`): past it the oldest are deleted.
    pub max_bytes: u64,
}

impl CaptureConfig {
    /// Capture into `dir` with the default bounds (64 MiB a file, 1 GiB in all).
    pub fn new(dir: PathBuf) -> Self {
        Self { dir, max_file_bytes: DEFAULT_MAX_FILE_BYTES, max_bytes: DEFAULT_MAX_BYTES }
    }

    /// Makes sure the directory is private (created 0700 if missing): what
    /// `--capture` and `usbwire capture` check before capturing anything.
    pub fn prepare(&self) -> Result<(), PrivateDirError> {
        ensure_private_dir(&self.dir)
    }
}

/// The capture setting every URB channel of a server follows (`--capture`,
/// `usbwire capture`), and the bounds the last one had (kept for a
/// `usbwire capture DIR` after `--capture` was off).
pub(crate) struct CaptureSwitch {
    setting: watch::Sender<Option<CaptureConfig>>,
    last: Mutex<Option<CaptureConfig>>,
}

impl CaptureSwitch {
    /// Capturing as `initial` says (`None`: not at all) until [`set`](Self::set).
    pub(crate) fn new(initial: Option<CaptureConfig>) -> Self {
        let switch = Self { setting: watch::Sender::new(None), last: Mutex::new(None) };
        switch.set(initial);
        switch
    }

    /// Starts (`Some`) or stops (`None`) capturing every import, running ones included.
    pub(crate) fn set(&self, capture: Option<CaptureConfig>) {
        if let Some(config) = &capture {
            *lock(&self.last) = Some(config.clone());
        }
        self.setting.send_replace(capture);
    }

    /// Bounds for capturing into `dir` (`usbwire capture DIR`): those of
    /// the server's configuration (`capture_max_bytes`) or its last capture.
    pub(crate) fn for_dir(&self, dir: PathBuf) -> CaptureConfig {
        match lock(&self.last).as_ref() {
            Some(last) => CaptureConfig { dir, ..last.clone() },
            None => CaptureConfig::new(dir),
        }
    }

    /// Whether imports are captured now.
    pub(crate) fn is_on(&self) -> bool {
        self.setting.borrow().is_some()
    }

    /// The capture setting, and its changes from now on.
    pub(crate) fn watch(&self) -> watch::Receiver<Option<CaptureConfig>> {
        self.setting.subscribe()
    }
}

/// One URB channel's capture: records go to the writer thread.
pub(crate) struct Capture {
    writer: WriterHandle,
    id: u64,
    /// Endpoint, direction and transfer type of each URB submitted and not completed.
    in_flight: HashMap<u32, (u8, Direction, TransferType)>,
    busnum: u16,
    devnum: u8,
    dropped: u64,
    path: PathBuf,
}

impl Capture {
    /// Starts the capture of `device` imported by `peer`, in a new file
    /// that starts with `descriptors` (the import's snapshot, if one was taken).
    pub(crate) fn start(
        config: &CaptureConfig,
        device: &DeviceRecord,
        descriptors: Option<&Snapshot>,
        peer: SocketAddr,
    ) -> io::Result<Self> {
        let (busid, busnum, devnum) = (device.busid.as_str(), device.busnum, device.devnum);
        config.prepare().map_err(|error| io::Error::new(io::ErrorKind::PermissionDenied, error))?;
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let peer_name = peer.to_string().replace([':', '[', ']'], "_");
        let (path, file) = create_unique(&config.dir, &format!("usbwire-{busid}-{unix}-{peer_name}"))?;
        let writer = WriterHandle::get()?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let (busnum, devnum) = (u16::try_from(busnum).unwrap_or(u16::MAX), u8::try_from(devnum).unwrap_or(u8::MAX));
        let head = Head { speed: speed_bps(device.speed), records: descriptor_records(descriptors, busnum, devnum) };
        let file = Rotating::new(path.clone(), file, config.max_file_bytes, head)?;
        writer.send(Message::Open { id, file, dir: config.dir.clone(), max_bytes: config.max_bytes })?;
        info!(path = %path.display(), "capturing this import");
        Ok(Self { writer, id, in_flight: HashMap::new(), busnum, devnum, dropped: 0, path })
    }

    pub(crate) fn submitted(&mut self, urb: &Urb, transfer: TransferType) {
        self.in_flight.insert(urb.seqnum, (urb.endpoint, urb.direction, transfer));
        let data = if urb.direction == Direction::Out { &urb.data[..] } else { &[] };
        // Room is taken before the record is built: a dropped record costs no copy.
        let size = USBMON_HEADER_LEN + urb.iso_packets.len() * 16 + data.len();
        if !self.writer.reserve(size) {
            self.dropped += 1;
            return;
        }
        let mut head = self.header(b'S', urb.seqnum, urb.endpoint, urb.direction, transfer);
        let is_control = transfer == TransferType::Control;
        head.flag_setup = if is_control { 0 } else { b'-' };
        head.setup = urb.setup;
        head.status = EINPROGRESS;
        head.length = urb.length;
        head.interval = urb.interval;
        head.start_frame = urb.start_frame;
        head.flags = urb.flags;
        head.flag_data = if urb.direction == Direction::Out { 0 } else { b'<' };
        let iso: Vec<(i32, u32, u32)> = urb.iso_packets.iter().map(|p| (0, p.offset, p.length)).collect();
        if transfer == TransferType::Isochronous {
            head.iso = Some((0, iso.len() as i32));
        }
        self.send(head.encode(&iso, data));
    }

    pub(crate) fn completed(&mut self, done: &Completion) {
        let Some((endpoint, direction, transfer)) = self.in_flight.remove(&done.seqnum) else { return };
        let data = if direction == Direction::In { &done.data[..] } else { &[] };
        let size = USBMON_HEADER_LEN + done.iso_packets.len() * 16 + data.len();
        if !self.writer.reserve(size) {
            self.dropped += 1;
            return;
        }
        let mut head = self.header(b'C', done.seqnum, endpoint, direction, transfer);
        head.flag_setup = b'-';
        head.status = done.status.0;
        head.length = done.actual_length;
        head.start_frame = done.start_frame;
        head.flag_data = if direction == Direction::In { 0 } else { b'>' };
        let iso: Vec<(i32, u32, u32)> =
            done.iso_packets.iter().map(|p| (p.status.0, p.offset, p.actual_length)).collect();
        if transfer == TransferType::Isochronous {
            head.iso = Some((done.error_count, iso.len() as i32));
        }
        self.send(head.encode(&iso, data));
    }

    fn header(&self, kind: u8, seqnum: u32, endpoint: u8, direction: Direction, transfer: TransferType) -> Usbmon {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        Usbmon {
            id: u64::from(seqnum),
            kind,
            transfer: match transfer {
                TransferType::Isochronous => 0,
                TransferType::Interrupt => 1,
                TransferType::Control => 2,
                TransferType::Bulk => 3,
            },
            endpoint: endpoint | if direction == Direction::In { 0x80 } else { 0 },
            devnum: self.devnum,
            busnum: self.busnum,
            flag_setup: b'-',
            flag_data: b'-',
            sec: now.as_secs() as i64,
            usec: now.subsec_micros() as i32,
            status: 0,
            length: 0,
            setup: [0; 8],
            iso: None,
            interval: 0,
            start_frame: 0,
            flags: TransferFlags(0),
        }
    }

    /// Sends a record whose room [`WriterHandle::reserve`] took.
    fn send(&mut self, record: Vec<u8>) {
        let size = record.len();
        if self.writer.send(Message::Record { id: self.id, record }).is_err() {
            self.writer.release(size);
            self.dropped += 1;
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.writer.send(Message::Close { id: self.id });
        if self.dropped > 0 {
            warn!(path = %self.path.display(), dropped = self.dropped, "capture: records dropped (the disk did not keep up)");
        }
    }
}

/// Creates `DIR/STEM.pcapng` (or `STEM-2.pcapng`, … if a file of that name
/// exists): 0600, never through a symlink, never over an existing file.
fn create_unique(dir: &Path, stem: &str) -> io::Result<(PathBuf, File)> {
    for attempt in 1..=16 {
        let name = if attempt == 1 { format!("{stem}.pcapng") } else { format!("{stem}-{attempt}.pcapng") };
        let path = dir.join(name);
        match create_private(&path) {
            Ok(file) => return Ok((path, file)),
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                let planted = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink());
                if planted {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!(
                            "{} is a symbolic link someone planted: not followed, not captured; remove it",
                            path.display()
                        ),
                    ));
                }
            }
            Err(error) => return Err(error),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!("{stem}.pcapng and 15 variants exist in {}", dir.display()),
    ))
}

/// A new capture file: mode 0600, `O_EXCL` (nothing already there is
/// reused) and `O_NOFOLLOW` (nor a link followed).
fn create_private(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(path)
}

/// Numbers captures for the writer thread.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// The running writer thread, started by the first capture (and again if it stopped).
static WRITER: Mutex<Option<WriterHandle>> = Mutex::new(None);

/// What the writer thread is told.
enum Message {
    /// A capture began in `file`; `dir`'s files together stay under `max_bytes`.
    Open { id: u64, file: Rotating, dir: PathBuf, max_bytes: u64 },
    /// A record for capture `id` (its size reserved in the queue).
    Record { id: u64, record: Vec<u8> },
    /// Capture `id` ended: flush and close its file.
    Close { id: u64 },
}

/// A capture's way to the writer thread, with the queue's byte count.
#[derive(Clone)]
struct WriterHandle {
    queue: Sender<Message>,
    queued: Arc<AtomicUsize>,
}

impl WriterHandle {
    /// The running writer, started if there is none (or the last one stopped).
    fn get() -> io::Result<Self> {
        let mut running = lock(&WRITER);
        if let Some(handle) = running.as_ref().filter(|h| !h.is_stopped()) {
            return Ok(handle.clone());
        }
        let (queue, messages) = channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let handle = Self { queue, queued: queued.clone() };
        std::thread::Builder::new()
            .name("capture writer".into())
            .spawn(move || Writer { files: HashMap::new(), dirs: HashMap::new(), queued }.run(messages))?;
        *running = Some(handle.clone());
        Ok(handle)
    }

    fn is_stopped(&self) -> bool {
        // A probe the writer ignores: fails only once the thread is gone.
        self.queue.send(Message::Close { id: 0 }).is_err()
    }

    /// Takes room for `size` bytes in the queue, or says there is none.
    fn reserve(&self, size: usize) -> bool {
        self.queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                queued.checked_add(size).filter(|&total| total <= QUEUE_BYTES)
            })
            .is_ok()
    }

    fn release(&self, size: usize) {
        self.queued.fetch_sub(size, Ordering::AcqRel);
    }

    fn send(&self, message: Message) -> io::Result<()> {
        self.queue
            .send(message)
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the capture writer thread stopped"))
    }
}

/// The writer thread: every open capture file, and the bytes in each capture directory.
struct Writer {
    files: HashMap<u64, Rotating>,
    dirs: HashMap<PathBuf, Ledger>,
    queued: Arc<AtomicUsize>,
}

impl Writer {
    fn run(mut self, messages: Receiver<Message>) {
        loop {
            let message = match messages.try_recv() {
                Ok(message) => message,
                Err(_) => {
                    // Idle: what was buffered reaches the files (readable while
                    // capturing, and nothing is lost if the process ends now).
                    for file in self.files.values_mut() {
                        let _ = file.file.flush();
                    }
                    match messages.recv() {
                        Ok(message) => message,
                        Err(_) => return,
                    }
                }
            };
            self.handle(message);
        }
    }

    fn handle(&mut self, message: Message) {
        match message {
            Message::Open { id, file, dir, max_bytes } => {
                let ledger = self.dirs.entry(dir.clone()).or_insert_with(|| Ledger::scan(&dir, DEFAULT_MAX_BYTES));
                ledger.max_bytes = max_bytes;
                ledger.opened(&file.path, file.written);
                self.files.insert(id, file);
                self.trim(&dir);
            }
            Message::Record { id, record } => {
                self.write(id, &record);
                self.queued.fetch_sub(record.len(), Ordering::AcqRel);
            }
            Message::Close { id } => {
                if let Some(mut file) = self.files.remove(&id) {
                    let _ = file.file.flush();
                    if let Some(ledger) = self.dirs.get_mut(&file.dir()) {
                        ledger.closed(&file.path);
                    }
                }
            }
        }
    }

    fn write(&mut self, id: u64, record: &[u8]) {
        let Some(file) = self.files.get_mut(&id) else { return };
        let dir = file.dir();
        let Some(ledger) = self.dirs.get_mut(&dir) else { return };
        let result = (|| {
            if file.written > file.max {
                file.rotate(ledger)?;
            }
            let written = write_packet(&mut file.file, record)?;
            file.written += written;
            ledger.grew(&file.path, written);
            io::Result::Ok(())
        })();
        if let Err(error) = result {
            warn!(path = %file.path.display(), %error, "capture stopped: cannot write");
            let path = file.path.clone();
            self.files.remove(&id);
            ledger.closed(&path);
            return;
        }
        self.trim(&dir);
    }

    /// Deletes the oldest closed files of `dir` until its files fit its
    /// bound; when only open ones are left, the oldest is rotated first (its
    /// content becomes a closed `.1`).
    fn trim(&mut self, dir: &Path) {
        let Some(ledger) = self.dirs.get_mut(dir) else { return };
        while ledger.total > ledger.max_bytes {
            if let Some(oldest) = ledger.oldest(false) {
                let entry = ledger.entries.remove(oldest);
                ledger.total -= entry.bytes;
                match std::fs::remove_file(&entry.path) {
                    Ok(()) => {
                        info!(path = %entry.path.display(), "capture: deleted the oldest file (capture_max_bytes)")
                    }
                    Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                    Err(error) => warn!(path = %entry.path.display(), %error, "capture: cannot delete an old file"),
                }
                continue;
            }
            let rotated = ledger.oldest(true).and_then(|oldest| {
                let path = ledger.entries[oldest].path.clone();
                let file = self.files.values_mut().find(|f| f.path == path)?;
                // A file holding only its head cannot shrink further.
                (file.written > file.head_len).then(|| file.rotate(ledger))
            });
            match rotated {
                Some(Ok(())) => {}
                Some(Err(error)) => {
                    warn!(dir = %dir.display(), %error, "capture: cannot rotate to stay under capture_max_bytes");
                    break;
                }
                None => break,
            }
        }
    }
}

/// A pcapng file that starts over (keeping the previous one as `.1`) past its bound.
struct Rotating {
    path: PathBuf,
    file: BufWriter<File>,
    written: u64,
    max: u64,
    head: Head,
    /// The bytes of [`Head`] written: what a file that starts over holds.
    head_len: u64,
}

/// What every file of a capture starts with, rotated ones too.
struct Head {
    /// The device's speed in bits per second (the interface's `if_speed`).
    speed: Option<u64>,
    /// Usbmon records of the device's descriptors.
    records: Vec<Vec<u8>>,
}

impl Head {
    fn write(&self, out: &mut impl io::Write) -> io::Result<u64> {
        let mut written = write_headers(out, self.speed)?;
        for record in &self.records {
            written += write_packet(out, record)?;
        }
        Ok(written)
    }
}

impl Rotating {
    fn new(path: PathBuf, file: File, max: u64, head: Head) -> io::Result<Self> {
        let mut file = BufWriter::with_capacity(WRITE_BUFFER, file);
        let written = head.write(&mut file)?;
        Ok(Self { path, file, written, max, head, head_len: written })
    }

    fn dir(&self) -> PathBuf {
        self.path.parent().map(Path::to_path_buf).unwrap_or_default()
    }

    /// Keeps what was written as `NAME.1` (replacing an older one) and starts `NAME` again.
    fn rotate(&mut self, ledger: &mut Ledger) -> io::Result<()> {
        self.file.flush()?;
        let old = append_extension(&self.path, "1");
        std::fs::rename(&self.path, &old)?;
        self.file = BufWriter::with_capacity(WRITE_BUFFER, create_private(&self.path)?);
        self.written = self.head.write(&mut self.file)?;
        ledger.renamed(&self.path, &old, self.written);
        Ok(())
    }
}

fn append_extension(path: &Path, extension: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".");
    name.push(extension);
    PathBuf::from(name)
}

#[cfg(test)]
mod tests;
