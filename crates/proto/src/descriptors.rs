//! The descriptor snapshot (`docs/protocol.md` §5.8): what a usbwire server
//! sends right after `OP_REP_IMPORT` when both ends named `descriptors` in the
//! transform offer — every standard descriptor the device gave it (device,
//! configurations, BOS, strings in the device's first language, HID report
//! descriptors) — and how a client answers the kernel's `GET_DESCRIPTOR`
//! requests from it, so that enumerating a remote device costs no round trip
//! per descriptor.
//!
//! This module owns the frame's bytes ([`Snapshot::encode`] /
//! [`Snapshot::decode`], every length bounded), the lookup a client answers
//! with ([`Snapshot::answer`]), and, in [`plan`], which requests a server
//! makes to fill one. It does not talk to a device (the server's import
//! does), nor decide when a request may be answered out of the endpoint's
//! order (the client's relay does: only with nothing else in flight on ep0).

pub mod plan;

use bytes::{BufMut, Bytes, BytesMut};

/// The offer entry, and the server's answer when it sends snapshots.
pub const OFFER: &str = "descriptors";

/// The frame's first four bytes.
pub const MAGIC: [u8; 4] = *b"UWDS";

/// The frame's header: [`MAGIC`] and the length of the entries (u32, big-endian).
pub const HEADER_LEN: usize = 8;

/// The most the entries may take: every configuration of a device with
/// room to spare (a configuration descriptor is at most 64 KiB).
pub const MAX_LEN: usize = 256 * 1024;

/// The most entries one snapshot may hold.
pub const MAX_ENTRIES: usize = 128;

/// `bRequest` of `GET_DESCRIPTOR`.
pub const GET_DESCRIPTOR: u8 = 6;

/// `bmRequestType` of a standard request to the device, device to host.
pub const TO_HOST_DEVICE: u8 = 0x80;

/// `bmRequestType` of a standard request to an interface, device to host
/// (a HID report descriptor).
pub const TO_HOST_INTERFACE: u8 = 0x81;

/// Descriptor types (`wValue`'s high byte, a descriptor's second byte).
pub const DEVICE: u8 = 1;
pub const CONFIGURATION: u8 = 2;
pub const STRING: u8 = 3;
pub const INTERFACE: u8 = 4;
pub const BOS: u8 = 15;
pub const HID: u8 = 0x21;
pub const HID_REPORT: u8 = 0x22;

/// Each entry's fixed part: request type, value, index, flags, length.
const ENTRY_HEAD: usize = 8;

/// Flag bit: the device had no more to give than `data` (a request for more
/// gets exactly `data`).
const COMPLETE: u8 = 1;

/// Whether a transform offer (or answer) names the extension.
pub fn offered(text: &str) -> bool {
    text.split(',').any(|entry| entry.trim() == OFFER)
}

/// One descriptor as the device returned it to a `GET_DESCRIPTOR`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// [`TO_HOST_DEVICE`] or [`TO_HOST_INTERFACE`].
    pub request_type: u8,
    /// `wValue`: descriptor type << 8 | index.
    pub value: u16,
    /// `wIndex`: 0, a language id (strings) or an interface number (HID reports).
    pub index: u16,
    /// The device had no more to give: a request for more than `data` gets `data`.
    pub complete: bool,
    /// What the device returned (never empty).
    pub data: Bytes,
}

/// Why a snapshot frame could not be read. The client then imports without
/// one: the stream is out of step, so the import fails with this error.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SnapshotError {
    #[error("descriptor snapshot does not start with UWDS")]
    BadMagic,
    #[error("descriptor snapshot announces {0} bytes (limit {MAX_LEN})")]
    TooLong(u32),
    #[error("descriptor snapshot holds more than {MAX_ENTRIES} entries")]
    TooManyEntries,
    #[error("descriptor snapshot entry {0} runs past the frame's end")]
    Truncated(usize),
    #[error("descriptor snapshot entry {0} is not a GET_DESCRIPTOR answer a client may give")]
    BadEntry(usize),
}

/// The descriptors of one import, as the device gave them to the server.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    entries: Vec<Entry>,
}

impl Snapshot {
    /// Keeps `entry`, in place of an earlier one for the same request (a
    /// configuration's first 9 bytes give way to the whole of it).
    /// Entries past [`MAX_ENTRIES`] or [`MAX_LEN`], and empty ones, are not kept.
    pub fn insert(&mut self, entry: Entry) {
        if entry.data.is_empty() || !answerable(entry.request_type, entry.value) {
            return;
        }
        let key = (entry.request_type, entry.value, entry.index);
        let kept = self.entries.iter().position(|e| (e.request_type, e.value, e.index) == key);
        let others: usize = self
            .entries
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != kept)
            .map(|(_, e)| ENTRY_HEAD + e.data.len())
            .sum();
        if others + ENTRY_HEAD + entry.data.len() > MAX_LEN {
            return;
        }
        match kept {
            Some(i) => self.entries[i] = entry,
            None if self.entries.len() < MAX_ENTRIES => self.entries.push(entry),
            None => {}
        }
    }

    /// The entries, in the order they were taken.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What the device would return to this SETUP packet, if the snapshot
    /// holds it: a standard `GET_DESCRIPTOR` for a descriptor taken, asking no
    /// more than was taken (or anything, when the device had no more). `None`
    /// means: ask the device.
    pub fn answer(&self, setup: &[u8; 8]) -> Option<Bytes> {
        let request_type = setup[0];
        let value = u16::from_le_bytes([setup[2], setup[3]]);
        let index = u16::from_le_bytes([setup[4], setup[5]]);
        let length = usize::from(u16::from_le_bytes([setup[6], setup[7]]));
        if setup[1] != GET_DESCRIPTOR || !answerable(request_type, value) || length == 0 {
            return None;
        }
        let entry = self.entries.iter().find(|e| (e.request_type, e.value, e.index) == (request_type, value, index))?;
        if length <= entry.data.len() {
            Some(entry.data.slice(..length))
        } else if entry.complete {
            Some(entry.data.clone())
        } else {
            None
        }
    }

    /// The frame: [`MAGIC`], the entries' length, the entries.
    pub fn encode(&self, out: &mut BytesMut) {
        let len: usize = self.entries.iter().map(|e| ENTRY_HEAD + e.data.len()).sum();
        out.reserve(HEADER_LEN + len);
        out.put_slice(&MAGIC);
        out.put_u32(len as u32);
        for entry in &self.entries {
            out.put_u8(entry.request_type);
            out.put_u16(entry.value);
            out.put_u16(entry.index);
            out.put_u8(if entry.complete { COMPLETE } else { 0 });
            out.put_u16(entry.data.len() as u16);
            out.put_slice(&entry.data);
        }
    }

    /// How many bytes follow a frame's header, from its first [`HEADER_LEN`]
    /// bytes; checked before anything is read or allocated for them.
    pub fn body_len(header: &[u8; HEADER_LEN]) -> Result<usize, SnapshotError> {
        if header[..4] != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let len = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
        if len as usize > MAX_LEN {
            return Err(SnapshotError::TooLong(len));
        }
        Ok(len as usize)
    }

    /// The entries of a frame whose header announced `body.len()` bytes.
    pub fn decode(body: Bytes) -> Result<Self, SnapshotError> {
        if body.len() > MAX_LEN {
            return Err(SnapshotError::TooLong(body.len() as u32));
        }
        let mut entries = Vec::new();
        let mut at = 0;
        while at < body.len() {
            let n = entries.len();
            if n == MAX_ENTRIES {
                return Err(SnapshotError::TooManyEntries);
            }
            let head = body.get(at..at + ENTRY_HEAD).ok_or(SnapshotError::Truncated(n))?;
            let request_type = head[0];
            let value = u16::from_be_bytes([head[1], head[2]]);
            let index = u16::from_be_bytes([head[3], head[4]]);
            let flags = head[5];
            let len = usize::from(u16::from_be_bytes([head[6], head[7]]));
            let start = at + ENTRY_HEAD;
            if start + len > body.len() {
                return Err(SnapshotError::Truncated(n));
            }
            if len == 0 || flags & !COMPLETE != 0 || !answerable(request_type, value) {
                return Err(SnapshotError::BadEntry(n));
            }
            let key = (request_type, value, index);
            if entries.iter().any(|e: &Entry| (e.request_type, e.value, e.index) == key) {
                return Err(SnapshotError::BadEntry(n));
            }
            entries.push(Entry {
                request_type,
                value,
                index,
                complete: flags & COMPLETE != 0,
                data: body.slice(start..start + len),
            });
            at = start + len;
        }
        Ok(Self { entries })
    }
}

/// Descriptor types a snapshot may answer for: device, configuration,
/// string and BOS from the device, a HID report descriptor from an interface.
fn answerable(request_type: u8, value: u16) -> bool {
    let kind = (value >> 8) as u8;
    match request_type {
        TO_HOST_DEVICE => matches!(kind, DEVICE | CONFIGURATION | STRING | BOS),
        TO_HOST_INTERFACE => kind == HID_REPORT,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(request_type: u8, value: u16, index: u16, complete: bool, data: &[u8]) -> Entry {
        Entry { request_type, value, index, complete, data: Bytes::copy_from_slice(data) }
    }

    fn setup(request_type: u8, value: u16, index: u16, length: u16) -> [u8; 8] {
        let mut s = [request_type, GET_DESCRIPTOR, 0, 0, 0, 0, 0, 0];
        s[2..4].copy_from_slice(&value.to_le_bytes());
        s[4..6].copy_from_slice(&index.to_le_bytes());
        s[6..8].copy_from_slice(&length.to_le_bytes());
        s
    }

    #[test]
    fn the_frame_has_a_fixed_layout() {
        let mut snapshot = Snapshot::default();
        snapshot.insert(entry(0x80, 0x0100, 0, true, &[18, 1, 0, 2]));
        let mut out = BytesMut::new();
        snapshot.encode(&mut out);
        assert_eq!(&out[..], &[b'U', b'W', b'D', b'S', 0, 0, 0, 12, 0x80, 0x01, 0x00, 0, 0, 1, 0, 4, 18, 1, 0, 2][..]);
        let header: [u8; HEADER_LEN] = out[..HEADER_LEN].try_into().unwrap();
        assert_eq!(Snapshot::body_len(&header), Ok(12));
        assert_eq!(Snapshot::decode(out.freeze().slice(HEADER_LEN..)), Ok(snapshot));
    }

    #[test]
    fn answers_as_the_device_would_and_only_what_it_holds() {
        let mut snapshot = Snapshot::default();
        let device: Vec<u8> = (0..18).collect();
        snapshot.insert(entry(0x80, 0x0100, 0, true, &device));
        // A configuration's first 9 bytes, then the whole of it in their place.
        snapshot.insert(entry(0x80, 0x0200, 0, false, &[9, 2, 32, 0, 1, 1, 0, 0x80, 50]));
        let config: Vec<u8> = (0..32).collect();
        snapshot.insert(entry(0x80, 0x0200, 0, true, &config));
        snapshot.insert(entry(0x80, 0x0302, 0x0409, false, &[4, 3, b'a', 0]));
        assert_eq!(snapshot.entries().len(), 3);
        // The kernel's first request asks 64 bytes: the device gives 18.
        assert_eq!(snapshot.answer(&setup(0x80, 0x0100, 0, 64)).unwrap(), &device[..]);
        assert_eq!(snapshot.answer(&setup(0x80, 0x0100, 0, 8)).unwrap(), &device[..8]);
        assert_eq!(snapshot.answer(&setup(0x80, 0x0200, 0, 9)).unwrap(), &config[..9]);
        assert_eq!(snapshot.answer(&setup(0x80, 0x0200, 0, 0xffff)).unwrap(), &config[..]);
        // Not taken whole: asking for more goes to the device.
        assert!(snapshot.answer(&setup(0x80, 0x0302, 0x0409, 255)).is_none());
        assert_eq!(snapshot.answer(&setup(0x80, 0x0302, 0x0409, 4)).unwrap(), &[4, 3, b'a', 0][..]);
        // Another language, another configuration, another request, another recipient, nothing asked.
        assert!(snapshot.answer(&setup(0x80, 0x0302, 0x0407, 4)).is_none());
        assert!(snapshot.answer(&setup(0x80, 0x0201, 0, 9)).is_none());
        assert!(snapshot.answer(&[0x80, 0, 0, 0, 0, 0, 2, 0]).is_none(), "GET_STATUS");
        assert!(snapshot.answer(&setup(0x81, 0x0100, 0, 18)).is_none());
        assert!(snapshot.answer(&setup(0x80, 0x0100, 0, 0)).is_none());
    }

    #[test]
    fn what_a_client_must_not_answer_is_neither_kept_nor_read() {
        let mut snapshot = Snapshot::default();
        snapshot.insert(entry(0x80, 0x2200, 0, true, &[1])); // a HID report asked of the device
        snapshot.insert(entry(0xa1, 0x0100, 0, true, &[1])); // a class request
        snapshot.insert(entry(0x80, 0x0100, 0, true, &[])); // nothing
        assert!(snapshot.is_empty());
        let bad = [0xa1u8, 0x01, 0x00, 0, 0, 1, 0, 1, 7];
        assert_eq!(Snapshot::decode(Bytes::copy_from_slice(&bad)), Err(SnapshotError::BadEntry(0)));
        let empty = [0x80u8, 0x01, 0x00, 0, 0, 1, 0, 0];
        assert_eq!(Snapshot::decode(Bytes::copy_from_slice(&empty)), Err(SnapshotError::BadEntry(0)));
        let flags = [0x80u8, 0x01, 0x00, 0, 0, 2, 0, 1, 7];
        assert_eq!(Snapshot::decode(Bytes::copy_from_slice(&flags)), Err(SnapshotError::BadEntry(0)));
        let twice = [[0x80u8, 0x01, 0x00, 0, 0, 1, 0, 1, 7], [0x80u8, 0x01, 0x00, 0, 0, 1, 0, 1, 7]].concat();
        assert_eq!(Snapshot::decode(Bytes::from(twice)), Err(SnapshotError::BadEntry(1)));
        let short = [0x80u8, 0x01, 0x00, 0, 0, 1, 0, 4, 7];
        assert_eq!(Snapshot::decode(Bytes::copy_from_slice(&short)), Err(SnapshotError::Truncated(0)));
        assert_eq!(Snapshot::body_len(b"UWDX\0\0\0\0"), Err(SnapshotError::BadMagic));
        assert_eq!(Snapshot::body_len(b"UWDS\0\x04\0\x01"), Err(SnapshotError::TooLong(0x40001)));
    }

    #[test]
    fn a_snapshot_stays_within_its_bounds() {
        let mut snapshot = Snapshot::default();
        for i in 0..=MAX_ENTRIES as u16 {
            snapshot.insert(entry(0x80, 0x0300 | (i & 0xff), i >> 8, true, &[2, 3]));
        }
        assert_eq!(snapshot.entries().len(), MAX_ENTRIES);
        let mut big = Snapshot::default();
        for i in 0..8 {
            big.insert(entry(0x80, 0x0200 | i, 0, true, &vec![0u8; 65_535]));
        }
        let mut out = BytesMut::new();
        big.encode(&mut out);
        assert!(out.len() - HEADER_LEN <= MAX_LEN, "{}", out.len());
        assert_eq!(big.entries().len(), 3);
    }

    proptest! {
        #[test]
        fn any_snapshot_round_trips(raw in prop::collection::vec(
            (any::<bool>(), 0u8..4, any::<u8>(), any::<u16>(), any::<bool>(), prop::collection::vec(any::<u8>(), 1..300)),
            0..20,
        )) {
            let mut snapshot = Snapshot::default();
            for (interface, kind, index, w_index, complete, data) in raw {
                let (request_type, kind) = if interface {
                    (TO_HOST_INTERFACE, HID_REPORT)
                } else {
                    (TO_HOST_DEVICE, [DEVICE, CONFIGURATION, STRING, BOS][kind as usize])
                };
                snapshot.insert(Entry { request_type, value: u16::from(kind) << 8 | u16::from(index), index: w_index, complete, data: data.into() });
            }
            let mut out = BytesMut::new();
            snapshot.encode(&mut out);
            let header: [u8; HEADER_LEN] = out[..HEADER_LEN].try_into().unwrap();
            prop_assert_eq!(Snapshot::body_len(&header).unwrap(), out.len() - HEADER_LEN);
            prop_assert_eq!(Snapshot::decode(out.freeze().slice(HEADER_LEN..)).unwrap(), snapshot);
        }

        #[test]
        fn no_bytes_make_decode_panic(body in prop::collection::vec(any::<u8>(), 0..400)) {
            let _ = Snapshot::decode(Bytes::from(body));
        }
    }
}
