//! Reads a recording: a capture file (`usbwire serve --capture`, pcapng
//! with usbmon records, `docs/recording.md`) turned into what a replay
//! answers with: the device's descriptors and speed, and every URB with
//! its completion, per endpoint, in submission order.
//!
//! Sans I/O apart from [`Recording::open`], which only reads the file.
//! The file is untrusted input: every length is checked against what is
//! left before it is used, nothing is allocated from a length field, and
//! every error names the block (counted from 1) and its byte offset.
//! Not for answering requests (the replay device does) nor for writing
//! captures (the server's `capture`).

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use usbwire_device::descriptor::{ConfigurationInfo, DeviceDescriptor};
use usbwire_device::{Speed, Status, TransferType};
use usbwire_proto::descriptors::{Entry, Snapshot, GET_DESCRIPTOR, TO_HOST_DEVICE, TO_HOST_INTERFACE};

/// The largest recording read (a capture file rotates at 64 MiB by default).
pub const MAX_FILE_BYTES: u64 = 1 << 30;
/// The largest pcapng block accepted (a usbmon record of a large URB).
pub const MAX_BLOCK_BYTES: usize = 64 << 20;
/// URBs submitted and not completed at one time, at most.
pub const MAX_IN_FLIGHT: usize = 65_536;
/// Isochronous packet descriptors in one record, at most.
const MAX_ISO_PACKETS: u32 = 1024;
/// The usbmon record header (`struct usbmon_packet`).
const USBMON_HEADER: usize = 64;
/// pcapng block types.
const SECTION_HEADER: u32 = 0x0A0D_0D0A;
const INTERFACE: u32 = 1;
const ENHANCED_PACKET: u32 = 6;
/// `LINKTYPE_USB_LINUX_MMAPPED`: usbmon's 64-byte records.
const LINKTYPE_USBMON: u16 = 220;
/// pcapng's interface option `if_speed`.
const IF_SPEED: u16 = 8;

/// Why a recording cannot be replayed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordingError {
    /// The file could not be read: check the path and its permissions.
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    /// The file is larger than [`MAX_FILE_BYTES`]: replay a shorter recording.
    #[error("recording is {0} bytes (limit {MAX_FILE_BYTES})")]
    TooLarge(u64),
    /// A block is malformed: the file is damaged, truncated or not a capture.
    #[error("block {block} at offset {offset}: {problem}")]
    Block { block: u64, offset: u64, problem: String },
    /// A descriptor replay needs is missing: the capture began after the
    /// import, or was made by a server that does not write descriptors.
    #[error("recording has no {0}: capture from the start of an import with a server that writes descriptors")]
    Missing(&'static str),
}

/// One URB as recorded: what was asked and how it completed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchange {
    /// The block of its submission, for reports (counted from 1).
    pub block: u64,
    /// Endpoint address, direction bit included (0 or 0x80 on ep0).
    pub endpoint: u8,
    pub transfer: TransferType,
    /// The SETUP packet of a control transfer (zeros otherwise).
    pub setup: [u8; 8],
    /// The length the host asked for (IN) or sent (OUT).
    pub requested: u32,
    /// OUT data as captured.
    pub out: Bytes,
    /// When it was submitted, from the recording's first record.
    pub submitted_at: Duration,
    /// `None`: it never completed while recording (still in flight at the end).
    pub completion: Option<Recorded>,
}

/// A recorded completion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub status: Status,
    pub actual_length: u32,
    /// IN data as captured.
    pub data: Bytes,
    pub completed_at: Duration,
    /// An isochronous URB's packets as they completed: status, offset, bytes moved.
    pub iso_packets: Vec<RecordedPacket>,
    /// An isochronous URB's count of packets that failed.
    pub error_count: i32,
}

/// One packet of a recorded isochronous completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordedPacket {
    pub status: Status,
    pub offset: u32,
    pub actual_length: u32,
}

/// A device as recorded.
#[derive(Clone, Debug)]
pub struct Recording {
    pub speed: Speed,
    pub device: DeviceDescriptor,
    /// Configuration 1, whole.
    pub configuration: Vec<u8>,
    /// Every descriptor recorded, answered as the device gave them.
    pub descriptors: Snapshot,
    /// ep0 requests other than the descriptors, in submission order.
    pub control: Vec<Exchange>,
    /// Each data endpoint's URBs in submission order, by endpoint address.
    pub endpoints: Vec<(u8, Vec<Exchange>)>,
}

impl Recording {
    /// Reads and parses the recording at `path` (at most [`MAX_FILE_BYTES`]).
    pub fn open(path: &Path) -> Result<Self, RecordingError> {
        use std::io::Read as _;
        let io = |source| RecordingError::Io { path: path.display().to_string(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        if size > MAX_FILE_BYTES {
            return Err(RecordingError::TooLarge(size));
        }
        let mut bytes = Vec::with_capacity(size as usize);
        file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(io)?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return Err(RecordingError::TooLarge(bytes.len() as u64));
        }
        Self::parse(Bytes::from(bytes))
    }

    /// Parses a recording's bytes.
    pub fn parse(bytes: Bytes) -> Result<Self, RecordingError> {
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return Err(RecordingError::TooLarge(bytes.len() as u64));
        }
        let mut urbs = Urbs::default();
        let mut speed = None;
        for block in Blocks::new(bytes) {
            let block = block?;
            match block.content {
                Content::Interface { speed: Some(bps) } => speed = speed.or(Some(speed_of(bps))),
                Content::Packet(record) => urbs.take(&block.at, &record)?,
                Content::Interface { speed: None } | Content::Other => {}
            }
        }
        urbs.finish(speed)
    }

    /// The number of recorded URBs that are not descriptors.
    pub fn urbs(&self) -> usize {
        self.control.len() + self.endpoints.iter().map(|(_, e)| e.len()).sum::<usize>()
    }
}

/// Where a block is, for errors.
#[derive(Clone, Copy, Debug)]
struct At {
    block: u64,
    offset: u64,
}

impl At {
    fn error(self, problem: impl Into<String>) -> RecordingError {
        RecordingError::Block { block: self.block, offset: self.offset, problem: problem.into() }
    }
}

struct Block {
    at: At,
    content: Content,
}

enum Content {
    /// An interface of usbmon records (its speed when given); others are `Other`.
    Interface {
        speed: Option<u64>,
    },
    /// A usbmon record on a usbmon interface.
    Packet(Bytes),
    Other,
}

/// The blocks of a pcapng file, checked one by one.
struct Blocks {
    bytes: Bytes,
    at: usize,
    block: u64,
    /// Whether each interface of the current section carries usbmon records.
    interfaces: Vec<bool>,
    failed: bool,
}

impl Blocks {
    fn new(bytes: Bytes) -> Self {
        Self { bytes, at: 0, block: 0, interfaces: Vec::new(), failed: false }
    }

    fn next_block(&mut self) -> Result<Block, RecordingError> {
        self.block += 1;
        let at = At { block: self.block, offset: self.at as u64 };
        let left = &self.bytes[self.at..];
        let (Some(kind), Some(total)) = (le32(left, 0), le32(left, 4)) else {
            return Err(at.error(format!("a block header needs 8 bytes, {} left", left.len())));
        };
        let total = total as usize;
        if total < 12 || !total.is_multiple_of(4) {
            return Err(at.error(format!("block length {total} is not a multiple of 4 of at least 12")));
        }
        if total > MAX_BLOCK_BYTES {
            return Err(at.error(format!("block length {total} is over the limit of {MAX_BLOCK_BYTES}")));
        }
        if total > left.len() {
            return Err(at.error(format!("block of {total} bytes runs past the end ({} left)", left.len())));
        }
        if le32(left, total - 4) != Some(total as u32) {
            return Err(at.error("the block's trailing length differs from its leading one"));
        }
        if self.block == 1 && kind != SECTION_HEADER {
            return Err(at.error("not a pcapng file: it does not start with a section header"));
        }
        let body = self.bytes.slice(self.at + 8..self.at + total - 4);
        self.at += total;
        let content = match kind {
            SECTION_HEADER => self.section(at, &body)?,
            INTERFACE => self.interface(at, &body)?,
            ENHANCED_PACKET => self.packet(at, &body)?,
            _ => Content::Other,
        };
        Ok(Block { at, content })
    }

    fn section(&mut self, at: At, body: &[u8]) -> Result<Content, RecordingError> {
        match le32(body, 0) {
            Some(0x1A2B_3C4D) => {}
            Some(0x4D3C_2B1A) => return Err(at.error("a big-endian section: only little-endian captures are read")),
            _ => return Err(at.error("a section header without the byte-order magic")),
        }
        if le16(body, 4) != Some(1) {
            return Err(at.error("a pcapng version other than 1"));
        }
        self.interfaces.clear();
        Ok(Content::Other)
    }

    fn interface(&mut self, at: At, body: &[u8]) -> Result<Content, RecordingError> {
        let Some(link) = le16(body, 0) else { return Err(at.error("an interface block shorter than 8 bytes")) };
        if self.interfaces.len() >= 256 {
            return Err(at.error("more than 256 interfaces in one section"));
        }
        let usbmon = link == LINKTYPE_USBMON;
        self.interfaces.push(usbmon);
        if !usbmon {
            return Ok(Content::Other);
        }
        let mut speed = None;
        let mut option = 8;
        while let (Some(code), Some(len)) = (le16(body, option), le16(body, option + 2)) {
            let len = usize::from(len);
            let value =
                body.get(option + 4..option + 4 + len).ok_or_else(|| at.error("an option runs past its block"))?;
            match code {
                0 => break,
                IF_SPEED if len == 8 => speed = le64(value, 0),
                _ => {}
            }
            option += 4 + len.div_ceil(4) * 4;
        }
        Ok(Content::Interface { speed })
    }

    fn packet(&mut self, at: At, body: &Bytes) -> Result<Content, RecordingError> {
        let (Some(interface), Some(captured)) = (le32(body, 0), le32(body, 12)) else {
            return Err(at.error("an enhanced packet block shorter than 20 bytes"));
        };
        match self.interfaces.get(interface as usize) {
            Some(true) => {}
            Some(false) => return Ok(Content::Other),
            None => return Err(at.error(format!("a packet on interface {interface}, which the section lacks"))),
        }
        let captured = captured as usize;
        if captured > body.len().saturating_sub(20) {
            return Err(at.error(format!("a packet of {captured} bytes runs past its block")));
        }
        Ok(Content::Packet(body.slice(20..20 + captured)))
    }
}

impl Iterator for Blocks {
    type Item = Result<Block, RecordingError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.at >= self.bytes.len() {
            return None;
        }
        let block = self.next_block();
        self.failed = block.is_err();
        Some(block)
    }
}

/// A usbmon record's fields that a recording keeps.
struct Usbmon {
    id: u64,
    kind: u8,
    transfer: TransferType,
    endpoint: u8,
    device: (u16, u8),
    micros: i128,
    status: i32,
    length: u32,
    setup: [u8; 8],
    data: Bytes,
    iso_packets: Vec<RecordedPacket>,
    error_count: i32,
}

impl Usbmon {
    fn parse(at: &At, record: &Bytes) -> Result<Self, RecordingError> {
        if record.len() < USBMON_HEADER {
            return Err(at.error(format!("a usbmon record of {} bytes, short of its 64-byte header", record.len())));
        }
        let field = |offset| le32(record, offset).unwrap_or_default();
        let transfer = match record[9] {
            0 => TransferType::Isochronous,
            1 => TransferType::Interrupt,
            2 => TransferType::Control,
            3 => TransferType::Bulk,
            other => return Err(at.error(format!("transfer type {other} is none of usbmon's four"))),
        };
        let kind = record[8];
        if !matches!(kind, b'S' | b'C' | b'E') {
            return Err(at.error(format!("event type {:?} is none of S, C, E", char::from(kind))));
        }
        let packets = field(60);
        if packets > MAX_ISO_PACKETS {
            return Err(at.error(format!("{packets} isochronous packets (limit {MAX_ISO_PACKETS})")));
        }
        let start = USBMON_HEADER + packets as usize * 16;
        let captured = field(36) as usize;
        let data = record.get(start..start.saturating_add(captured)).ok_or_else(|| {
            at.error(format!(
                "{captured} bytes of data announced, {} in the record",
                record.len().saturating_sub(start)
            ))
        })?;
        // usbmon's isochronous descriptors: status, offset, length, padding; 16 bytes each.
        let iso_packets = (0..packets as usize)
            .map(|n| USBMON_HEADER + n * 16)
            .map(|at| RecordedPacket {
                status: Status(field(at) as i32),
                offset: field(at + 4),
                actual_length: field(at + 8),
            })
            .collect();
        let sec = le64(record, 16).unwrap_or_default() as i64;
        let mut setup = [0; 8];
        setup.copy_from_slice(&record[40..48]);
        Ok(Self {
            id: le64(record, 0).unwrap_or_default(),
            kind,
            transfer,
            endpoint: record[10],
            device: (le16(record, 12).unwrap_or_default(), record[11]),
            micros: i128::from(sec) * 1_000_000 + i128::from(field(24) as i32),
            status: field(28) as i32,
            length: field(32),
            setup: if transfer == TransferType::Control && record[14] == 0 { setup } else { [0; 8] },
            data: record.slice_ref(data),
            iso_packets,
            error_count: if transfer == TransferType::Isochronous { field(40) as i32 } else { 0 },
        })
    }
}

/// The URBs read so far, in submission order, and those in flight.
#[derive(Default)]
struct Urbs {
    exchanges: Vec<Exchange>,
    /// usbmon id → index in `exchanges`.
    in_flight: HashMap<u64, usize>,
    device: Option<(u16, u8)>,
    first: Option<i128>,
}

impl Urbs {
    fn take(&mut self, at: &At, record: &Bytes) -> Result<(), RecordingError> {
        let usbmon = Usbmon::parse(at, record)?;
        if *self.device.get_or_insert(usbmon.device) != usbmon.device {
            return Err(at.error("a record of a second device: a recording holds one"));
        }
        let first = *self.first.get_or_insert(usbmon.micros);
        let since = Duration::from_micros(u64::try_from(usbmon.micros - first).unwrap_or(0));
        let is_in = usbmon.endpoint & 0x80 != 0;
        if usbmon.kind == b'S' {
            if self.in_flight.len() >= MAX_IN_FLIGHT {
                return Err(at.error(format!("more than {MAX_IN_FLIGHT} URBs in flight")));
            }
            if self.in_flight.insert(usbmon.id, self.exchanges.len()).is_some() {
                return Err(at.error(format!("URB {:#x} submitted again before it completed", usbmon.id)));
            }
            self.exchanges.push(Exchange {
                block: at.block,
                endpoint: usbmon.endpoint,
                transfer: usbmon.transfer,
                setup: usbmon.setup,
                requested: usbmon.length,
                out: if is_in { Bytes::new() } else { usbmon.data },
                submitted_at: since,
                completion: None,
            });
            return Ok(());
        }
        // A completion whose submission was not captured (capture switched on mid-URB) is left out.
        let Some(index) = self.in_flight.remove(&usbmon.id) else { return Ok(()) };
        let exchange = &mut self.exchanges[index];
        if (exchange.endpoint, exchange.transfer) != (usbmon.endpoint, usbmon.transfer) {
            return Err(at.error(format!("URB {:#x} completes on another endpoint than it was submitted", usbmon.id)));
        }
        exchange.completion = Some(Recorded {
            status: Status(usbmon.status),
            actual_length: usbmon.length,
            data: if is_in { usbmon.data } else { Bytes::new() },
            completed_at: since,
            iso_packets: usbmon.iso_packets,
            error_count: usbmon.error_count,
        });
        Ok(())
    }

    fn finish(self, speed: Option<Speed>) -> Result<Recording, RecordingError> {
        let mut descriptors = Snapshot::default();
        let mut control = Vec::new();
        let mut endpoints: Vec<(u8, Vec<Exchange>)> = Vec::new();
        for exchange in self.exchanges {
            if exchange.endpoint & 0x7f == 0 {
                if !keep_descriptor(&mut descriptors, &exchange) {
                    control.push(exchange);
                }
                continue;
            }
            match endpoints.iter_mut().find(|(address, _)| *address == exchange.endpoint) {
                Some((_, list)) => list.push(exchange),
                None => endpoints.push((exchange.endpoint, vec![exchange])),
            }
        }
        endpoints.sort_by_key(|(address, _)| *address);
        let wanted = |value: u16, length: u16| {
            let [lo, hi] = value.to_le_bytes();
            let [len_lo, len_hi] = length.to_le_bytes();
            descriptors.answer(&[TO_HOST_DEVICE, GET_DESCRIPTOR, lo, hi, 0, 0, len_lo, len_hi])
        };
        let device = wanted(0x0100, 18)
            .and_then(|bytes| DeviceDescriptor::parse(&bytes))
            .ok_or(RecordingError::Missing("device descriptor"))?;
        let header = wanted(0x0200, 9)
            .filter(|bytes| bytes.len() >= 4)
            .ok_or(RecordingError::Missing("configuration descriptor"))?;
        let total = u16::from_le_bytes([header[2], header[3]]);
        let configuration = wanted(0x0200, total)
            .filter(|bytes| bytes.len() == usize::from(total) && ConfigurationInfo::parse(bytes).is_some())
            .ok_or(RecordingError::Missing("whole configuration descriptor"))?
            .to_vec();
        let speed = speed.unwrap_or(if device.bcd_usb >= 0x0300 { Speed::SUPER } else { Speed::HIGH });
        Ok(Recording { speed, device, configuration, descriptors, control, endpoints })
    }
}

/// Keeps a recorded `GET_DESCRIPTOR` answer in `descriptors`, unless an
/// answer kept earlier says more; whether the exchange was one.
fn keep_descriptor(descriptors: &mut Snapshot, exchange: &Exchange) -> bool {
    let setup = exchange.setup;
    let Some(done) = exchange.completion.as_ref().filter(|done| done.status == Status::OK) else { return false };
    if setup[1] != GET_DESCRIPTOR || !matches!(setup[0], TO_HOST_DEVICE | TO_HOST_INTERFACE) || done.data.is_empty() {
        return false;
    }
    let value = u16::from_le_bytes([setup[2], setup[3]]);
    let index = u16::from_le_bytes([setup[4], setup[5]]);
    let requested = u16::from_le_bytes([setup[6], setup[7]]);
    let complete = done.data.len() < usize::from(requested);
    let key = (setup[0], value, index);
    let earlier = descriptors.entries().iter().find(|e| (e.request_type, e.value, e.index) == key);
    if let Some(earlier) = earlier {
        if earlier.data.len() > done.data.len() || (earlier.data.len() == done.data.len() && earlier.complete) {
            return true;
        }
    }
    let entry = Entry { request_type: setup[0], value, index, complete, data: done.data.clone() };
    descriptors.insert(entry.clone());
    // Kept (in place of an earlier answer, or beside): the snapshot answers it from now on.
    descriptors.entries().contains(&entry)
}

/// The speed an interface's `if_speed` names (bits per second).
fn speed_of(bps: u64) -> Speed {
    match bps {
        0..=1_500_000 => Speed::LOW,
        1_500_001..=12_000_000 => Speed::FULL,
        12_000_001..=480_000_000 => Speed::HIGH,
        480_000_001..=5_000_000_000 => Speed::SUPER,
        _ => Speed::SUPER_PLUS,
    }
}

fn le16(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

fn le32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

fn le64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at.checked_add(8)?)?.try_into().ok()?))
}
