//! Packet capture of URB channels (`usbwire serve --capture DIR`): one pcapng
//! file per imported device and connection, in the Linux usbmon format
//! (`LINKTYPE_USB_LINUX_MMAPPED`), so Wireshark and tshark decode the traffic
//! down to the class protocol (SCSI for a disk, HID reports). Captured at the
//! URB level, after TLS and stream transforms are undone.
//!
//! Each URB gives two records, as usbmon's: its submission (`S`, with OUT
//! data) and its completion (`C`, with IN data). Records go to a writer
//! thread through a bounded queue: the URB path never waits for the disk;
//! when the queue is full, records are dropped and counted. A file that
//! reaches its size bound is rotated: the previous one is kept as `.1`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::{info, warn};
use usbwire_device::{Completion, TransferType, Urb};
use usbwire_proto::urb::TransferFlags;
use usbwire_proto::Direction;

/// pcapng link type of usbmon's binary (mmap) records.
const LINKTYPE_USB_LINUX_MMAPPED: u16 = 220;
/// The usbmon record header.
const USBMON_HEADER_LEN: usize = 64;
/// Records waiting for the writer thread.
const QUEUE_RECORDS: usize = 4096;
/// Default bound of one capture file.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 64 << 20;
/// usbmon's status of a submission.
const EINPROGRESS: i32 = -115;

/// Where and how much to capture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureConfig {
    pub dir: PathBuf,
    /// A file rotates past this size (the previous one is kept as `NAME.1`).
    pub max_file_bytes: u64,
}

/// One URB channel's capture: records go to its writer thread.
pub(crate) struct Capture {
    records: SyncSender<Vec<u8>>,
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
        std::fs::create_dir_all(&config.dir)?;
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let peer_name = peer.to_string().replace([':', '[', ']'], "_");
        let path = config.dir.join(format!("usbwire-{busid}-{unix}-{peer_name}.pcapng"));
        let mut file = Rotating::create(path.clone(), config.max_file_bytes)?;
        let (records, queue) = sync_channel::<Vec<u8>>(QUEUE_RECORDS);
        std::thread::Builder::new().name(format!("capture {busid}")).spawn(move || {
            for record in queue {
                if let Err(error) = file.write(&record) {
                    warn!(path = %file.path.display(), %error, "capture stopped: cannot write");
                    return;
                }
            }
            let _ = file.flush();
        })?;
        info!(path = %path.display(), "capturing this import");
        Ok(Self {
            records,
            in_flight: HashMap::new(),
            busnum: u16::try_from(busnum).unwrap_or(u16::MAX),
            devnum: u8::try_from(devnum).unwrap_or(u8::MAX),
            dropped: 0,
            path,
        })
    }

    pub(crate) fn submitted(&mut self, urb: &Urb, transfer: TransferType) {
        self.in_flight.insert(urb.seqnum, (urb.endpoint, urb.direction, transfer));
        let mut head = self.header(b'S', urb.seqnum, urb.endpoint, urb.direction, transfer);
        let is_control = transfer == TransferType::Control;
        head.flag_setup = if is_control { 0 } else { b'-' };
        head.setup = urb.setup;
        head.status = EINPROGRESS;
        head.length = urb.length;
        head.interval = urb.interval;
        head.start_frame = urb.start_frame;
        head.flags = urb.flags;
        let data = if urb.direction == Direction::Out { &urb.data[..] } else { &[] };
        head.flag_data = if urb.direction == Direction::Out { 0 } else { b'<' };
        let iso: Vec<(i32, u32, u32)> = urb.iso_packets.iter().map(|p| (0, p.offset, p.length)).collect();
        if transfer == TransferType::Isochronous {
            head.iso = Some((0, iso.len() as i32));
        }
        self.send(head.encode(&iso, data));
    }

    pub(crate) fn completed(&mut self, done: &Completion) {
        let Some((endpoint, direction, transfer)) = self.in_flight.remove(&done.seqnum) else { return };
        let mut head = self.header(b'C', done.seqnum, endpoint, direction, transfer);
        head.flag_setup = b'-';
        head.status = done.status.0;
        head.length = done.actual_length;
        head.start_frame = done.start_frame;
        let data = if direction == Direction::In { &done.data[..] } else { &[] };
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

    fn send(&mut self, record: Vec<u8>) {
        match self.records.try_send(record) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => self.dropped += 1,
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if self.dropped > 0 {
            warn!(path = %self.path.display(), dropped = self.dropped, "capture: records dropped (the disk did not keep up)");
        }
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

impl Rotating {
    fn create(path: PathBuf, max: u64) -> io::Result<Self> {
        let mut file = BufWriter::with_capacity(256 * 1024, File::create(&path)?);
        let written = write_headers(&mut file)?;
        Ok(Self { path, file, written, max })
    }

    fn write(&mut self, record: &[u8]) -> io::Result<()> {
        if self.written > self.max {
            self.file.flush()?;
            let old = append_extension(&self.path, "1");
            std::fs::rename(&self.path, &old)?;
            self.file = BufWriter::with_capacity(256 * 1024, File::create(&self.path)?);
            self.written = write_headers(&mut self.file)?;
        }
        self.written += write_packet(&mut self.file, record)?;
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
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

/// An enhanced packet block for one usbmon record, timestamped from the record.
fn write_packet(out: &mut impl io::Write, record: &[u8]) -> io::Result<u64> {
    let sec = i64::from_le_bytes(record[16..24].try_into().unwrap_or_default());
    let usec = i32::from_le_bytes(record[24..28].try_into().unwrap_or_default());
    let micros = (sec as u64).saturating_mul(1_000_000).saturating_add(usec as u64);
    let mut body = Vec::with_capacity(20 + record.len());
    body.extend_from_slice(&0u32.to_le_bytes()); // interface 0
    body.extend_from_slice(&((micros >> 32) as u32).to_le_bytes());
    body.extend_from_slice(&(micros as u32).to_le_bytes());
    body.extend_from_slice(&(record.len() as u32).to_le_bytes());
    body.extend_from_slice(&(record.len() as u32).to_le_bytes());
    body.extend_from_slice(record);
    block(out, 6, &body)
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

    #[test]
    fn blocks_are_padded_and_files_rotate_past_their_bound() {
        let mut out = Vec::new();
        assert_eq!(block(&mut out, 6, &[1, 2, 3, 4, 5]).unwrap(), 20);
        assert_eq!(out.len(), 20);
        assert_eq!(&out[4..8], &20u32.to_le_bytes());
        assert_eq!(&out[16..20], &20u32.to_le_bytes());

        let dir = std::env::temp_dir().join(format!("usbwire-capture-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rotating.pcapng");
        let mut file = Rotating::create(path.clone(), 1000).unwrap();
        let record = vec![0u8; 200];
        for _ in 0..10 {
            file.write(&record).unwrap();
        }
        file.flush().unwrap();
        let current = std::fs::metadata(&path).unwrap().len();
        let previous = std::fs::metadata(append_extension(&path, "1")).unwrap().len();
        assert!(current <= 1000 + 300 && previous <= 1000 + 300, "{current} {previous}");
        assert_eq!(&std::fs::read(&path).unwrap()[..4], &0x0A0D_0D0Au32.to_le_bytes(), "a new file starts a section");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
