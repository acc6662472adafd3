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
use usbwire_device::{Completion, TransferType, Urb};
use usbwire_proto::sync::lock;
use usbwire_proto::urb::TransferFlags;
use usbwire_proto::Direction;

use crate::private_dir::{ensure_private_dir, PrivateDirError};

/// pcapng link type of usbmon's binary (mmap) records.
const LINKTYPE_USB_LINUX_MMAPPED: u16 = 220;
/// The usbmon record header.
const USBMON_HEADER_LEN: usize = 64;
/// Bytes of records waiting for the writer thread, every capture together:
/// what capture may add to the server's memory (with one write buffer per file).
pub(crate) const QUEUE_BYTES: usize = 16 << 20;
/// Default bound of one capture file.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 64 << 20;
/// Default bound of all capture files in the directory together (`capture_max_bytes`).
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;
/// Each file's write buffer.
const WRITE_BUFFER: usize = 256 * 1024;
/// usbmon's status of a submission.
const EINPROGRESS: i32 = -115;

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
    /// Starts the capture of `busid` imported by `peer`, in a new file.
    pub(crate) fn start(
        config: &CaptureConfig,
        busid: &str,
        (busnum, devnum): (u32, u32),
        peer: SocketAddr,
    ) -> io::Result<Self> {
        config.prepare().map_err(|error| io::Error::new(io::ErrorKind::PermissionDenied, error))?;
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let peer_name = peer.to_string().replace([':', '[', ']'], "_");
        let (path, file) = create_unique(&config.dir, &format!("usbwire-{busid}-{unix}-{peer_name}"))?;
        let writer = WriterHandle::get()?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let file = Rotating::new(path.clone(), file, config.max_file_bytes)?;
        writer.send(Message::Open { id, file, dir: config.dir.clone(), max_bytes: config.max_bytes })?;
        info!(path = %path.display(), "capturing this import");
        Ok(Self {
            writer,
            id,
            in_flight: HashMap::new(),
            busnum: u16::try_from(busnum).unwrap_or(u16::MAX),
            devnum: u8::try_from(devnum).unwrap_or(u8::MAX),
            dropped: 0,
            path,
        })
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
                let ledger = self.dirs.entry(dir.clone()).or_insert_with(|| Ledger::scan(&dir));
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
                // A file holding only its headers cannot shrink further.
                (file.written > HEADERS_LEN).then(|| file.rotate(ledger))
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

/// The capture files of one directory, oldest first, and their bytes.
struct Ledger {
    entries: Vec<Entry>,
    total: u64,
    max_bytes: u64,
}

struct Entry {
    path: PathBuf,
    bytes: u64,
    /// When it was begun (rotation keeps the time): the oldest go first.
    created: SystemTime,
    open: bool,
}

impl Ledger {
    /// The capture files already in `dir` (earlier imports, earlier runs).
    fn scan(dir: &Path) -> Self {
        let mut ledger = Self { entries: Vec::new(), total: 0, max_bytes: DEFAULT_MAX_BYTES };
        let Ok(listing) = std::fs::read_dir(dir) else { return ledger };
        for item in listing.flatten() {
            let name = item.file_name();
            let name = name.to_string_lossy();
            if !name.starts_with("usbwire-") || !name.contains(".pcapng") {
                continue;
            }
            let Ok(meta) = item.metadata() else { continue };
            if meta.is_file() {
                let created = meta.modified().unwrap_or(UNIX_EPOCH);
                ledger.entries.push(Entry { path: item.path(), bytes: meta.len(), created, open: false });
                ledger.total += meta.len();
            }
        }
        ledger
    }

    fn opened(&mut self, path: &Path, bytes: u64) {
        if let Some(entry) = self.entries.iter_mut().find(|e| e.path == path) {
            self.total -= entry.bytes;
            entry.bytes = bytes;
            entry.open = true;
        } else {
            self.entries.push(Entry { path: path.to_path_buf(), bytes, created: SystemTime::now(), open: true });
        }
        self.total += bytes;
    }

    fn grew(&mut self, path: &Path, bytes: u64) {
        if let Some(entry) = self.entries.iter_mut().find(|e| e.path == path) {
            entry.bytes += bytes;
            self.total += bytes;
        }
    }

    fn closed(&mut self, path: &Path) {
        if let Some(entry) = self.entries.iter_mut().find(|e| e.path == path) {
            entry.open = false;
        }
    }

    /// `path` became `to` (rotation): what was at `to` is gone, `path` starts over.
    fn renamed(&mut self, path: &Path, to: &Path, headers: u64) {
        if let Some(replaced) = self.entries.iter().position(|e| e.path == to) {
            let entry = self.entries.remove(replaced);
            self.total -= entry.bytes;
        }
        if let Some(entry) = self.entries.iter_mut().find(|e| e.path == path) {
            entry.path = to.to_path_buf();
            entry.open = false;
        }
        self.entries.push(Entry { path: path.to_path_buf(), bytes: headers, created: SystemTime::now(), open: true });
        self.total += headers;
    }

    /// The oldest entry that is open (or closed).
    fn oldest(&self, open: bool) -> Option<usize> {
        self.entries.iter().enumerate().filter(|(_, e)| e.open == open).min_by_key(|(_, e)| e.created).map(|(i, _)| i)
    }
}

/// A usbmon record header (`struct usbmon_packet`, host byte order).
struct Usbmon {
    id: u64,
    kind: u8,
    transfer: u8,
    endpoint: u8,
    devnum: u8,
    busnum: u16,
    flag_setup: u8,
    flag_data: u8,
    sec: i64,
    usec: i32,
    status: i32,
    /// Submitted length, or actual length on completion.
    length: u32,
    setup: [u8; 8],
    /// Isochronous: (error count, number of descriptors), in place of the setup bytes.
    iso: Option<(i32, i32)>,
    interval: i32,
    start_frame: i32,
    flags: TransferFlags,
}

impl Usbmon {
    /// The record: header, isochronous descriptors (status, offset, length), data.
    fn encode(&self, iso: &[(i32, u32, u32)], data: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(USBMON_HEADER_LEN + iso.len() * 16 + data.len());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&[self.kind, self.transfer, self.endpoint, self.devnum]);
        out.extend_from_slice(&self.busnum.to_le_bytes());
        out.extend_from_slice(&[self.flag_setup, self.flag_data]);
        out.extend_from_slice(&self.sec.to_le_bytes());
        out.extend_from_slice(&self.usec.to_le_bytes());
        out.extend_from_slice(&self.status.to_le_bytes());
        out.extend_from_slice(&self.length.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        match self.iso {
            Some((errors, count)) => {
                out.extend_from_slice(&errors.to_le_bytes());
                out.extend_from_slice(&count.to_le_bytes());
            }
            None => out.extend_from_slice(&self.setup),
        }
        out.extend_from_slice(&self.interval.to_le_bytes());
        out.extend_from_slice(&self.start_frame.to_le_bytes());
        out.extend_from_slice(&self.flags.0.to_le_bytes());
        out.extend_from_slice(&(iso.len() as u32).to_le_bytes());
        debug_assert_eq!(out.len(), USBMON_HEADER_LEN);
        for &(status, offset, length) in iso {
            out.extend_from_slice(&status.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&length.to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes());
        }
        out.extend_from_slice(data);
        out
    }
}

/// A pcapng file that starts over (keeping the previous one as `.1`) past its bound.
struct Rotating {
    path: PathBuf,
    file: BufWriter<File>,
    written: u64,
    max: u64,
}

/// The section header and interface blocks every file starts with.
const HEADERS_LEN: u64 = 28 + 20;

impl Rotating {
    fn new(path: PathBuf, file: File, max: u64) -> io::Result<Self> {
        let mut file = BufWriter::with_capacity(WRITE_BUFFER, file);
        let written = write_headers(&mut file)?;
        Ok(Self { path, file, written, max })
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
        self.written = write_headers(&mut self.file)?;
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

/// A pcapng block: type, total length, body padded to 4 bytes, total length.
fn block(out: &mut impl io::Write, kind: u32, body: &[u8]) -> io::Result<u64> {
    let padded = body.len().div_ceil(4) * 4;
    let total = (12 + padded) as u32;
    out.write_all(&kind.to_le_bytes())?;
    out.write_all(&total.to_le_bytes())?;
    out.write_all(body)?;
    out.write_all(&[0; 3][..padded - body.len()])?;
    out.write_all(&total.to_le_bytes())?;
    Ok(u64::from(total))
}

/// The section header and the one interface (usbmon, microsecond timestamps).
fn write_headers(out: &mut impl io::Write) -> io::Result<u64> {
    let mut section = Vec::new();
    section.extend_from_slice(&0x1A2B_3C4Du32.to_le_bytes());
    section.extend_from_slice(&1u16.to_le_bytes());
    section.extend_from_slice(&0u16.to_le_bytes());
    section.extend_from_slice(&u64::MAX.to_le_bytes()); // section length unknown
    let mut interface = Vec::new();
    interface.extend_from_slice(&LINKTYPE_USB_LINUX_MMAPPED.to_le_bytes());
    interface.extend_from_slice(&0u16.to_le_bytes());
    interface.extend_from_slice(&0u32.to_le_bytes()); // no snap length
    Ok(block(out, 0x0A0D_0D0A, &section)? + block(out, 1, &interface)?)
}

/// An enhanced packet block for one usbmon record, timestamped from the
/// record; written in pieces (a record may be a megabyte: no second copy).
fn write_packet(out: &mut impl io::Write, record: &[u8]) -> io::Result<u64> {
    let sec = i64::from_le_bytes(record[16..24].try_into().unwrap_or_default());
    let usec = i32::from_le_bytes(record[24..28].try_into().unwrap_or_default());
    let micros = (sec as u64).saturating_mul(1_000_000).saturating_add(usec as u64);
    let mut head = [0u8; 28];
    let padded = record.len().div_ceil(4) * 4;
    let total = (12 + 20 + padded) as u32;
    head[0..4].copy_from_slice(&6u32.to_le_bytes());
    head[4..8].copy_from_slice(&total.to_le_bytes());
    // head[8..12]: interface 0.
    head[12..16].copy_from_slice(&((micros >> 32) as u32).to_le_bytes());
    head[16..20].copy_from_slice(&(micros as u32).to_le_bytes());
    head[20..24].copy_from_slice(&(record.len() as u32).to_le_bytes());
    head[24..28].copy_from_slice(&(record.len() as u32).to_le_bytes());
    out.write_all(&head)?;
    out.write_all(record)?;
    out.write_all(&[0; 3][..padded - record.len()])?;
    out.write_all(&total.to_le_bytes())?;
    Ok(u64::from(total))
}

#[cfg(test)]
mod tests {
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

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("usbwire-capture-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A writer driven by hand, and its file `name` in `dir` with these bounds.
    fn writer_with(dir: &Path, name: &str, max_file: u64, max_bytes: u64) -> Writer {
        let mut writer = Writer { files: HashMap::new(), dirs: HashMap::new(), queued: Arc::new(AtomicUsize::new(0)) };
        open(&mut writer, 1, dir, name, max_file, max_bytes);
        writer
    }

    fn open(writer: &mut Writer, id: u64, dir: &Path, name: &str, max_file: u64, max_bytes: u64) {
        let path = dir.join(name);
        let file = Rotating::new(path.clone(), create_private(&path).unwrap(), max_file).unwrap();
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
        let mut writer = writer_with(&dir, "rotating.pcapng", 1000, u64::MAX);
        for _ in 0..10 {
            writer.handle(Message::Record { id: 1, record: vec![0u8; 200] });
        }
        writer.handle(Message::Close { id: 1 });
        let path = dir.join("rotating.pcapng");
        let current = std::fs::metadata(&path).unwrap().len();
        let previous = std::fs::metadata(append_extension(&path, "1")).unwrap().len();
        assert!(current <= 1000 + 300 && previous <= 1000 + 300, "{current} {previous}");
        assert_eq!(&std::fs::read(&path).unwrap()[..4], &0x0A0D_0D0Au32.to_le_bytes(), "a new file starts a section");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn all_files_together_stay_under_max_bytes_the_oldest_deleted_first() {
        let dir = scratch("budget");
        // An earlier run's file, older than anything this run writes.
        let old = dir.join("usbwire-1-1-100-old.pcapng");
        std::fs::write(&old, vec![0u8; 3000]).unwrap();
        let an_hour_ago = SystemTime::now() - std::time::Duration::from_secs(3600);
        File::options().write(true).open(&old).unwrap().set_modified(an_hour_ago).unwrap();
        let unrelated = dir.join("notes.txt");
        std::fs::write(&unrelated, vec![0u8; 3000]).unwrap();
        let max_bytes = 10_000;
        let mut writer = writer_with(&dir, "usbwire-a.pcapng", 4000, max_bytes);
        for _ in 0..30 {
            writer.handle(Message::Record { id: 1, record: vec![0u8; 300] });
        }
        assert!(!old.exists(), "the earlier run's file went first");
        assert!(unrelated.exists(), "files that are not captures are left alone");
        writer.handle(Message::Close { id: 1 });
        open(&mut writer, 2, &dir, "usbwire-b.pcapng", 4000, max_bytes);
        for _ in 0..40 {
            writer.handle(Message::Record { id: 2, record: vec![0u8; 300] });
            let total: u64 =
                sizes(&dir).iter().filter(|(name, _)| name.starts_with("usbwire-")).map(|(_, bytes)| bytes).sum();
            assert!(total <= max_bytes, "{total} bytes on disk: {:?}", sizes(&dir));
        }
        let names: Vec<String> = sizes(&dir).into_iter().map(|(name, _)| name).collect();
        assert!(!names.iter().any(|n| n.starts_with("usbwire-a")), "the closed, older import's files went: {names:?}");
        assert!(names.contains(&"usbwire-b.pcapng".to_string()), "{names:?}");

        // One file alone larger than the budget: rotated and its old part deleted.
        let mut writer = writer_with(&dir, "usbwire-c.pcapng", u64::MAX, 2000);
        for _ in 0..20 {
            writer.handle(Message::Record { id: 1, record: vec![0u8; 300] });
        }
        let size = std::fs::metadata(dir.join("usbwire-c.pcapng")).unwrap().len();
        assert!(size <= 2000, "{size}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_directory_is_made_0700_and_files_0600() {
        let base = scratch("modes");
        std::fs::set_permissions(&base, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let config = CaptureConfig::new(base.join("capture"));
        let peer: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let capture = Capture::start(&config, "1-1", (1, 2), peer).unwrap();
        let path = capture.path.clone();
        drop(capture);
        use std::os::unix::fs::MetadataExt as _;
        assert_eq!(std::fs::metadata(&config.dir).unwrap().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        // The same name again (same second, same peer): a new file beside it, not the old one reused.
        let again = Capture::start(&config, "1-1", (1, 2), peer).unwrap();
        assert_ne!(again.path, path);
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn a_planted_symlink_is_not_followed_for_the_directory_or_a_file() {
        let base = scratch("symlink");
        let victim = base.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let elsewhere = base.join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, base.join("capture")).unwrap();
        let config = CaptureConfig::new(base.join("capture"));
        let peer: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let error = Capture::start(&config, "1-1", (1, 2), peer).err().unwrap();
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
        let _ = std::fs::remove_dir_all(&base);
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
}
