//! The bytes of a capture file: usbmon records (`struct usbmon_packet`, as
//! the Linux usbmon binary interface gives them) in pcapng blocks (a section
//! header, one interface of type `LINKTYPE_USB_LINUX_MMAPPED`, one enhanced
//! packet block per record), and the records that carry a device's
//! descriptors at the head of each file (`docs/recording.md`). Encoding
//! only: which files, when and how much is `capture.rs`'s business.

use std::io;

use std::time::{SystemTime, UNIX_EPOCH};

use usbwire_proto::descriptors::{Snapshot, GET_DESCRIPTOR};
use usbwire_proto::urb::TransferFlags;
use usbwire_proto::Speed;

/// pcapng link type of usbmon's binary (mmap) records.
const LINKTYPE_USB_LINUX_MMAPPED: u16 = 220;
/// The usbmon record header.
pub(crate) const USBMON_HEADER_LEN: usize = 64;
/// usbmon's status of a submission.
pub(crate) const EINPROGRESS: i32 = -115;

/// A usbmon record header (`struct usbmon_packet`, host byte order).
pub(crate) struct Usbmon {
    pub(crate) id: u64,
    pub(crate) kind: u8,
    pub(crate) transfer: u8,
    pub(crate) endpoint: u8,
    pub(crate) devnum: u8,
    pub(crate) busnum: u16,
    pub(crate) flag_setup: u8,
    pub(crate) flag_data: u8,
    pub(crate) sec: i64,
    pub(crate) usec: i32,
    pub(crate) status: i32,
    /// Submitted length, or actual length on completion.
    pub(crate) length: u32,
    pub(crate) setup: [u8; 8],
    /// Isochronous: (error count, number of descriptors), in place of the setup bytes.
    pub(crate) iso: Option<(i32, i32)>,
    pub(crate) interval: i32,
    pub(crate) start_frame: i32,
    pub(crate) flags: TransferFlags,
}

impl Usbmon {
    /// The record: header, isochronous descriptors (status, offset, length), data.
    pub(crate) fn encode(&self, iso: &[(i32, u32, u32)], data: &[u8]) -> Vec<u8> {
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

/// A pcapng block: type, total length, body padded to 4 bytes, total length.
pub(crate) fn block(out: &mut impl io::Write, kind: u32, body: &[u8]) -> io::Result<u64> {
    let padded = body.len().div_ceil(4) * 4;
    let total = (12 + padded) as u32;
    out.write_all(&kind.to_le_bytes())?;
    out.write_all(&total.to_le_bytes())?;
    out.write_all(body)?;
    out.write_all(&[0; 3][..padded - body.len()])?;
    out.write_all(&total.to_le_bytes())?;
    Ok(u64::from(total))
}

/// pcapng's interface option `if_speed` (bits per second, u64).
const IF_SPEED: u16 = 8;

/// A device's speed as `if_speed` gives it: its signalling rate.
pub(crate) fn speed_bps(speed: Speed) -> Option<u64> {
    match speed {
        Speed::LOW => Some(1_500_000),
        Speed::FULL => Some(12_000_000),
        Speed::HIGH => Some(480_000_000),
        Speed::SUPER => Some(5_000_000_000),
        Speed::SUPER_PLUS => Some(10_000_000_000),
        _ => None,
    }
}

/// Each descriptor of `snapshot` as a `GET_DESCRIPTOR` the device answered:
/// a submission (URB id 0, `wLength` the bytes taken, or 0xffff when the
/// device had no more to give) and its completion with the descriptor.
pub(crate) fn descriptor_records(snapshot: Option<&Snapshot>, busnum: u16, devnum: u8) -> Vec<Vec<u8>> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let mut records = Vec::new();
    for entry in snapshot.map(Snapshot::entries).unwrap_or_default() {
        let length = if entry.complete { u16::MAX } else { entry.data.len() as u16 };
        let [value_lo, value_hi] = entry.value.to_le_bytes();
        let [index_lo, index_hi] = entry.index.to_le_bytes();
        let [length_lo, length_hi] = length.to_le_bytes();
        let mut head = Usbmon {
            id: 0,
            kind: b'S',
            transfer: 2,
            endpoint: 0x80,
            devnum,
            busnum,
            flag_setup: 0,
            flag_data: b'<',
            sec: now.as_secs() as i64,
            usec: now.subsec_micros() as i32,
            status: EINPROGRESS,
            length: u32::from(length),
            setup: [entry.request_type, GET_DESCRIPTOR, value_lo, value_hi, index_lo, index_hi, length_lo, length_hi],
            iso: None,
            interval: 0,
            start_frame: 0,
            flags: TransferFlags(TransferFlags::DIR_IN),
        };
        records.push(head.encode(&[], &[]));
        (head.kind, head.flag_setup, head.flag_data, head.status) = (b'C', b'-', 0, 0);
        head.length = entry.data.len() as u32;
        records.push(head.encode(&[], &entry.data));
    }
    records
}

/// The section header and the one interface (usbmon, microsecond
/// timestamps, the device's speed when known).
pub(crate) fn write_headers(out: &mut impl io::Write, speed: Option<u64>) -> io::Result<u64> {
    let mut section = Vec::new();
    section.extend_from_slice(&0x1A2B_3C4Du32.to_le_bytes());
    section.extend_from_slice(&1u16.to_le_bytes());
    section.extend_from_slice(&0u16.to_le_bytes());
    section.extend_from_slice(&u64::MAX.to_le_bytes()); // section length unknown
    let mut interface = Vec::new();
    interface.extend_from_slice(&LINKTYPE_USB_LINUX_MMAPPED.to_le_bytes());
    interface.extend_from_slice(&0u16.to_le_bytes());
    interface.extend_from_slice(&0u32.to_le_bytes()); // no snap length
    if let Some(speed) = speed {
        interface.extend_from_slice(&IF_SPEED.to_le_bytes());
        interface.extend_from_slice(&8u16.to_le_bytes());
        interface.extend_from_slice(&speed.to_le_bytes());
        interface.extend_from_slice(&[0; 4]); // opt_endofopt
    }
    Ok(block(out, 0x0A0D_0D0A, &section)? + block(out, 1, &interface)?)
}

/// An enhanced packet block for one usbmon record, timestamped from the
/// record; written in pieces (a record may be a megabyte: no second copy).
pub(crate) fn write_packet(out: &mut impl io::Write, record: &[u8]) -> io::Result<u64> {
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
