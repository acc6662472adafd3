//! The OP phase: device list and import, one request per connection.
//!
//! Layouts are `struct op_common`, `struct usbip_usb_device` (312 bytes) and
//! `struct usbip_usb_interface` (4 bytes) from the kernel's
//! `tools/usb/usbip/libsrc/usbip_common.h`; every integer is big-endian.

use bytes::{BufMut, BytesMut};

use crate::resume::Token;
use crate::wire::{be_u16, be_u32, Speed};
use crate::{DecodeError, Limits, USBIP_VERSION};

/// Size of the common OP header.
pub const OP_HEADER_LEN: usize = 8;
/// Size of `usbip_usb_device` on the wire.
pub const DEVICE_RECORD_LEN: usize = 312;
/// Size of `usbip_usb_interface` on the wire.
pub const INTERFACE_RECORD_LEN: usize = 4;
/// Size of the `path` field.
pub const PATH_LEN: usize = 256;
/// Size of the `busid` field (`SYSFS_BUS_ID_SIZE`).
pub const BUSID_LEN: usize = 32;

/// OP codes. A newtype so unknown codes can be reported as they were.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpCode(pub u16);

impl OpCode {
    pub const REQ_DEVLIST: Self = Self(0x8005);
    pub const REP_DEVLIST: Self = Self(0x0005);
    pub const REQ_IMPORT: Self = Self(0x8003);
    pub const REP_IMPORT: Self = Self(0x0003);
    /// usbwire extension: the state of every device the client may see, in use
    /// or not, as a JSON document. Only our client sends it; usbipd and
    /// usbipd-win close the connection on it, which tells our client to fall
    /// back to `OP_REQ_DEVLIST` alone.
    pub const REQ_DEVSTATE: Self = Self(0x80f1);
    pub const REP_DEVSTATE: Self = Self(0x00f1);
    /// usbwire extension: the client offers stream transforms (`zstd,jitter=40`),
    /// the server answers with the ones it applies; after that reply both sides
    /// frame the stream, and the real request (DEVLIST, IMPORT …) follows.
    pub const REQ_TRANSFORMS: Self = Self(0x80f2);
    pub const REP_TRANSFORMS: Self = Self(0x00f2);
    /// usbwire extension: take over a resumable session (token and replies
    /// received) instead of importing; the answer carries the commands the
    /// server had received. See [`crate::resume`].
    pub const REQ_RESUME: Self = Self(0x80f3);
    pub const REP_RESUME: Self = Self(0x00f3);
}

/// One of usbwire's own OP-phase extensions, which only usbwire ends speak
/// (a stock peer never sends them and closes on them, and usbwire falls back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extension {
    pub name: &'static str,
    pub request: OpCode,
    /// Its revision: raised when what it carries changes.
    pub version: u16,
    pub what: &'static str,
}

/// usbwire's extensions, as `usbwire version` reports them. What each
/// revision added is in docs/protocol.md §5 ("Revisions").
pub const EXTENSIONS: [Extension; 3] = [
    Extension {
        name: "devstate",
        request: OpCode::REQ_DEVSTATE,
        version: 2,
        what: "every device's state and holder, as JSON",
    },
    Extension {
        name: "transforms",
        request: OpCode::REQ_TRANSFORMS,
        version: 4,
        what: "paired stream transforms: zstd, lz4, jitter buffer; reservation tokens; storage stages; descriptor snapshots",
    },
    Extension {
        name: "resume",
        request: OpCode::REQ_RESUME,
        version: 2,
        what: "taking over an import after a dropped connection",
    },
];

/// Body of `OP_REQ_RESUME`: the token and a u64 count.
pub const RESUME_REQUEST_LEN: usize = 32 + 8;

/// Largest transform offer or answer accepted.
pub const MAX_TRANSFORMS_LEN: u32 = 1024;

/// Largest `OP_REP_DEVSTATE` body accepted.
pub const MAX_DEVSTATE_LEN: u32 = 1 << 20;

/// The status word of an OP reply (`ST_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpStatus(pub u32);

impl OpStatus {
    /// Request completed.
    pub const OK: Self = Self(0);
    /// Request failed (the kernel's usbipd uses it for any export failure).
    pub const NA: Self = Self(1);
    /// Device busy (already imported by someone).
    pub const DEV_BUSY: Self = Self(2);
    /// Device in error state.
    pub const DEV_ERR: Self = Self(3);
    /// No such device.
    pub const NODEV: Self = Self(4);
    /// Unexpected error.
    pub const ERROR: Self = Self(5);

    /// The explanation `usbip` prints for this status.
    pub fn describe(self) -> &'static str {
        match self {
            Self::OK => "request completed successfully",
            Self::NA => "request failed",
            Self::DEV_BUSY => "device busy (exported)",
            Self::DEV_ERR => "device in error state",
            Self::NODEV => "device not found",
            Self::ERROR => "unexpected response",
            _ => "unknown status",
        }
    }
}

/// A bus id such as `1-1` or `3-2.4`: at most 31 bytes, no NUL.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BusId(String);

impl BusId {
    /// Validates a bus id: non-empty, at most 31 bytes, printable ASCII.
    pub fn new(text: &str) -> Option<Self> {
        let valid = !text.is_empty() && text.len() < BUSID_LEN && text.bytes().all(|b| b.is_ascii_graphic());
        valid.then(|| Self(text.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for BusId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::fmt::Display for BusId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One interface as listed in `OP_REP_DEVLIST` (`usbip_usb_interface`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InterfaceRecord {
    pub b_interface_class: u8,
    pub b_interface_sub_class: u8,
    pub b_interface_protocol: u8,
}

/// `struct usbip_usb_device`: what a server says about an exported device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceRecord {
    /// The sysfs path on the server (free text for virtual devices), at most 255 bytes.
    pub path: String,
    pub busid: BusId,
    pub busnum: u32,
    pub devnum: u32,
    pub speed: Speed,
    pub id_vendor: u16,
    pub id_product: u16,
    pub bcd_device: u16,
    pub b_device_class: u8,
    pub b_device_sub_class: u8,
    pub b_device_protocol: u8,
    pub b_configuration_value: u8,
    pub b_num_configurations: u8,
    /// Interfaces of the current configuration. Only `OP_REP_DEVLIST` carries
    /// them; `OP_REP_IMPORT` carries just their count.
    pub interfaces: Vec<InterfaceRecord>,
    /// `bNumInterfaces` as sent. Equals `interfaces.len()` in a devlist.
    pub b_num_interfaces: u8,
}

impl DeviceRecord {
    /// `(busnum << 16) | devnum`, the id every URB header carries.
    pub fn devid(&self) -> u32 {
        (self.busnum << 16) | (self.devnum & 0xffff)
    }

    fn encode(&self, out: &mut BytesMut) {
        put_fixed_str(out, &self.path, PATH_LEN);
        put_fixed_str(out, self.busid.as_str(), BUSID_LEN);
        out.put_u32(self.busnum);
        out.put_u32(self.devnum);
        out.put_u32(self.speed.0);
        out.put_u16(self.id_vendor);
        out.put_u16(self.id_product);
        out.put_u16(self.bcd_device);
        out.put_u8(self.b_device_class);
        out.put_u8(self.b_device_sub_class);
        out.put_u8(self.b_device_protocol);
        out.put_u8(self.b_configuration_value);
        out.put_u8(self.b_num_configurations);
        out.put_u8(self.b_num_interfaces);
    }

    /// Parses the fixed 312-byte part; `interfaces` is left empty.
    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        debug_assert_eq!(bytes.len(), DEVICE_RECORD_LEN);
        let path = fixed_str(&bytes[..PATH_LEN])?;
        let busid_text = fixed_str(&bytes[PATH_LEN..PATH_LEN + BUSID_LEN])?;
        let busid = BusId::new(&busid_text).ok_or(DecodeError::StringNotTerminated(BUSID_LEN))?;
        let at = PATH_LEN + BUSID_LEN;
        Ok(Self {
            path,
            busid,
            busnum: be_u32(bytes, at),
            devnum: be_u32(bytes, at + 4),
            speed: Speed(be_u32(bytes, at + 8)),
            id_vendor: be_u16(bytes, at + 12),
            id_product: be_u16(bytes, at + 14),
            bcd_device: be_u16(bytes, at + 16),
            b_device_class: bytes[at + 18],
            b_device_sub_class: bytes[at + 19],
            b_device_protocol: bytes[at + 20],
            b_configuration_value: bytes[at + 21],
            b_num_configurations: bytes[at + 22],
            b_num_interfaces: bytes[at + 23],
            interfaces: Vec::new(),
        })
    }
}

/// A request from client to server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpRequest {
    /// `OP_REQ_DEVLIST`: list exported devices.
    DevList,
    /// `OP_REQ_IMPORT`: take a device; on success the connection becomes its URB channel.
    Import { busid: BusId },
    /// `OP_REQ_IMPORT` naming something that cannot be a bus id (empty or not
    /// printable ASCII): the bytes before the NUL, kept exactly so they can be
    /// logged escaped and encoded back unchanged. Servers answer `ST_NODEV`.
    ImportMalformedBusId { requested: Vec<u8> },
    /// `OP_REQ_DEVSTATE` (usbwire extension): every visible device with its state.
    DevState,
    /// `OP_REQ_TRANSFORMS` (usbwire extension): the transforms the client offers, comma-separated.
    Transforms { offer: String },
    /// `OP_REQ_RESUME` (usbwire extension): continue the session `token` names;
    /// the client has received `replies_received` server messages of it.
    Resume { token: Token, replies_received: u64 },
}

impl OpRequest {
    pub fn encode(&self, out: &mut BytesMut) {
        match self {
            Self::DevList => put_header(out, OpCode::REQ_DEVLIST, OpStatus::OK),
            Self::Import { busid } => {
                put_header(out, OpCode::REQ_IMPORT, OpStatus::OK);
                put_fixed_str(out, busid.as_str(), BUSID_LEN);
            }
            Self::DevState => put_header(out, OpCode::REQ_DEVSTATE, OpStatus::OK),
            Self::Transforms { offer } => {
                put_header(out, OpCode::REQ_TRANSFORMS, OpStatus::OK);
                out.put_u32(offer.len() as u32);
                out.put_slice(offer.as_bytes());
            }
            Self::Resume { token, replies_received } => {
                put_header(out, OpCode::REQ_RESUME, OpStatus::OK);
                out.put_slice(&token.0);
                out.put_u64(*replies_received);
            }
            Self::ImportMalformedBusId { requested } => {
                put_header(out, OpCode::REQ_IMPORT, OpStatus::OK);
                let kept = &requested[..requested.len().min(BUSID_LEN - 1)];
                out.put_slice(kept);
                out.put_bytes(0, BUSID_LEN - kept.len());
            }
        }
    }
}

/// Decodes one OP request (server side). `Ok(None)` means more bytes are needed.
///
/// Like the kernel's `usbip_net_recv_op_common`, a wrong version or a non-zero
/// status is an error; so is an opcode other than DEVLIST and IMPORT and our
/// own DEVSTATE, TRANSFORMS and RESUME (docs/protocol.md).
pub fn decode_request(buf: &mut BytesMut, _limits: &Limits) -> Result<Option<OpRequest>, DecodeError> {
    let Some(code) = peek_header(buf, None)? else {
        return Ok(None);
    };
    match code {
        OpCode::REQ_DEVLIST => {
            let _ = buf.split_to(OP_HEADER_LEN);
            Ok(Some(OpRequest::DevList))
        }
        OpCode::REQ_DEVSTATE => {
            let _ = buf.split_to(OP_HEADER_LEN);
            Ok(Some(OpRequest::DevState))
        }
        OpCode::REQ_TRANSFORMS => {
            let Some(offer) = counted_text(buf)? else { return Ok(None) };
            Ok(Some(OpRequest::Transforms { offer }))
        }
        OpCode::REQ_RESUME => {
            if buf.len() < OP_HEADER_LEN + RESUME_REQUEST_LEN {
                return Ok(None);
            }
            let frame = buf.split_to(OP_HEADER_LEN + RESUME_REQUEST_LEN);
            let mut token = [0u8; 32];
            token.copy_from_slice(&frame[OP_HEADER_LEN..OP_HEADER_LEN + 32]);
            let replies_received = be_u64(&frame, OP_HEADER_LEN + 32);
            Ok(Some(OpRequest::Resume { token: Token(token), replies_received }))
        }
        OpCode::REQ_IMPORT => {
            if buf.len() < OP_HEADER_LEN + BUSID_LEN {
                return Ok(None);
            }
            let frame = buf.split_to(OP_HEADER_LEN + BUSID_LEN);
            let field = &frame[OP_HEADER_LEN..];
            let end = field.iter().position(|&b| b == 0).ok_or(DecodeError::StringNotTerminated(BUSID_LEN))?;
            let requested = &field[..end];
            // An empty or non-printable busid cannot name anything we export (every
            // exported BusId went through `BusId::new`); the server answers ST_NODEV
            // like usbipd.
            match std::str::from_utf8(requested).ok().and_then(BusId::new) {
                Some(busid) => Ok(Some(OpRequest::Import { busid })),
                None => Ok(Some(OpRequest::ImportMalformedBusId { requested: requested.to_vec() })),
            }
        }
        other => Err(DecodeError::UnexpectedOpCode(other.0)),
    }
}

/// Encodes `OP_REP_DEVLIST` with every device and its interfaces.
pub fn encode_devlist_reply(devices: &[DeviceRecord], out: &mut BytesMut) {
    put_header(out, OpCode::REP_DEVLIST, OpStatus::OK);
    out.put_u32(devices.len() as u32);
    for device in devices {
        let mut listed = device.clone();
        listed.b_num_interfaces = device.interfaces.len().min(255) as u8;
        listed.encode(out);
        for interface in device.interfaces.iter().take(255) {
            out.put_u8(interface.b_interface_class);
            out.put_u8(interface.b_interface_sub_class);
            out.put_u8(interface.b_interface_protocol);
            out.put_u8(0);
        }
    }
}

/// Encodes `OP_REP_IMPORT`: the device record on success, only the header otherwise.
pub fn encode_import_reply(result: Result<&DeviceRecord, OpStatus>, out: &mut BytesMut) {
    match result {
        Ok(device) => {
            put_header(out, OpCode::REP_IMPORT, OpStatus::OK);
            device.encode(out);
        }
        Err(status) => put_header(out, OpCode::REP_IMPORT, status),
    }
}

/// Decodes `OP_REP_DEVLIST` (client side). `Ok(None)` means more bytes are needed.
///
/// Records have variable size (312 + 4·bNumInterfaces), so they are walked one by one;
/// nothing is allocated before the count is checked against the limits.
pub fn decode_devlist_reply(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Vec<DeviceRecord>>, DecodeError> {
    let Some(count) = peek_counted_reply(buf, OpCode::REP_DEVLIST)? else {
        return Ok(None);
    };
    if count > limits.max_devices {
        return Err(DecodeError::TooManyDevices { count, max: limits.max_devices });
    }
    // First pass: is everything there?
    let mut at = OP_HEADER_LEN + 4;
    for _ in 0..count {
        if buf.len() < at + DEVICE_RECORD_LEN {
            return Ok(None);
        }
        let interfaces = buf[at + DEVICE_RECORD_LEN - 1] as usize;
        at += DEVICE_RECORD_LEN + interfaces * INTERFACE_RECORD_LEN;
        if buf.len() < at {
            return Ok(None);
        }
    }
    let frame = buf.split_to(at);
    let mut devices = Vec::with_capacity(count as usize);
    let mut at = OP_HEADER_LEN + 4;
    for _ in 0..count {
        let mut device = DeviceRecord::decode(&frame[at..at + DEVICE_RECORD_LEN])?;
        at += DEVICE_RECORD_LEN;
        for _ in 0..device.b_num_interfaces {
            device.interfaces.push(InterfaceRecord {
                b_interface_class: frame[at],
                b_interface_sub_class: frame[at + 1],
                b_interface_protocol: frame[at + 2],
            });
            at += INTERFACE_RECORD_LEN;
        }
        devices.push(device);
    }
    Ok(Some(devices))
}

/// A u32 length and that much UTF-8 after the header (at most
/// [`MAX_TRANSFORMS_LEN`]); consumed once whole.
fn counted_text(buf: &mut BytesMut) -> Result<Option<String>, DecodeError> {
    if buf.len() < OP_HEADER_LEN + 4 {
        return Ok(None);
    }
    let len = be_u32(buf, OP_HEADER_LEN);
    if len > MAX_TRANSFORMS_LEN {
        return Err(DecodeError::TransferTooLong { len, max: MAX_TRANSFORMS_LEN });
    }
    let end = OP_HEADER_LEN + 4 + len as usize;
    if buf.len() < end {
        return Ok(None);
    }
    let text = std::str::from_utf8(&buf[OP_HEADER_LEN + 4..end]).map_err(|_| DecodeError::NotUtf8)?.to_owned();
    let _ = buf.split_to(end);
    Ok(Some(text))
}

/// Encodes `OP_REP_TRANSFORMS`: the transforms the server applies, comma-separated.
pub fn encode_transforms_reply(accepted: &str, out: &mut BytesMut) {
    put_header(out, OpCode::REP_TRANSFORMS, OpStatus::OK);
    out.put_u32(accepted.len() as u32);
    out.put_slice(accepted.as_bytes());
}

/// Decodes `OP_REP_TRANSFORMS` (client side).
pub fn decode_transforms_reply(buf: &mut BytesMut) -> Result<Option<String>, DecodeError> {
    let Some(status) = peek_reply_header(buf, OpCode::REP_TRANSFORMS)? else {
        return Ok(None);
    };
    if status != OpStatus::OK {
        let _ = buf.split_to(OP_HEADER_LEN);
        return Err(DecodeError::RequestFailed(status.0));
    }
    counted_text(buf)
}

/// Encodes `OP_REP_RESUME`: on success the number of commands the server had
/// received whole (u64); only the header with an error status otherwise: the
/// server sends `ST_NODEV` when the session is unknown, expired or not the
/// caller's, and `ST_NA` when the client's count of replies does not fit it.
pub fn encode_resume_reply(result: Result<u64, OpStatus>, out: &mut BytesMut) {
    match result {
        Ok(commands_received) => {
            put_header(out, OpCode::REP_RESUME, OpStatus::OK);
            out.put_u64(commands_received);
        }
        Err(status) => put_header(out, OpCode::REP_RESUME, status),
    }
}

/// Decodes `OP_REP_RESUME` (client side): the commands received, or the status.
pub fn decode_resume_reply(buf: &mut BytesMut) -> Result<Option<Result<u64, OpStatus>>, DecodeError> {
    let Some(status) = peek_reply_header(buf, OpCode::REP_RESUME)? else {
        return Ok(None);
    };
    if status != OpStatus::OK {
        let _ = buf.split_to(OP_HEADER_LEN);
        return Ok(Some(Err(status)));
    }
    if buf.len() < OP_HEADER_LEN + 8 {
        return Ok(None);
    }
    let frame = buf.split_to(OP_HEADER_LEN + 8);
    Ok(Some(Ok(be_u64(&frame, OP_HEADER_LEN))))
}

fn be_u64(bytes: &[u8], at: usize) -> u64 {
    (u64::from(be_u32(bytes, at)) << 32) | u64::from(be_u32(bytes, at + 4))
}

/// Encodes `OP_REP_DEVSTATE`: header, body length (u32), body.
pub fn encode_devstate_reply(body: &[u8], out: &mut BytesMut) {
    put_header(out, OpCode::REP_DEVSTATE, OpStatus::OK);
    out.put_u32(body.len() as u32);
    out.put_slice(body);
}

/// Decodes `OP_REP_DEVSTATE` (client side): the body, at most [`MAX_DEVSTATE_LEN`] bytes.
pub fn decode_devstate_reply(buf: &mut BytesMut) -> Result<Option<Vec<u8>>, DecodeError> {
    let Some(len) = peek_counted_reply(buf, OpCode::REP_DEVSTATE)? else {
        return Ok(None);
    };
    if len > MAX_DEVSTATE_LEN {
        return Err(DecodeError::TransferTooLong { len, max: MAX_DEVSTATE_LEN });
    }
    let end = OP_HEADER_LEN + 4 + len as usize;
    if buf.len() < end {
        return Ok(None);
    }
    let frame = buf.split_to(end);
    Ok(Some(frame[OP_HEADER_LEN + 4..].to_vec()))
}

/// Decodes `OP_REP_IMPORT` (client side): the device on success, the status otherwise.
pub fn decode_import_reply(buf: &mut BytesMut) -> Result<Option<Result<DeviceRecord, OpStatus>>, DecodeError> {
    let Some(status) = peek_reply_header(buf, OpCode::REP_IMPORT)? else {
        return Ok(None);
    };
    if status != OpStatus::OK {
        let _ = buf.split_to(OP_HEADER_LEN);
        return Ok(Some(Err(status)));
    }
    if buf.len() < OP_HEADER_LEN + DEVICE_RECORD_LEN {
        return Ok(None);
    }
    let frame = buf.split_to(OP_HEADER_LEN + DEVICE_RECORD_LEN);
    DeviceRecord::decode(&frame[OP_HEADER_LEN..]).map(|device| Some(Ok(device)))
}

/// For replies whose header is followed by a u32 count or length: that number,
/// once 12 bytes are there.
fn peek_counted_reply(buf: &mut BytesMut, expected: OpCode) -> Result<Option<u32>, DecodeError> {
    let Some(status) = peek_reply_header(buf, expected)? else {
        return Ok(None);
    };
    if status != OpStatus::OK {
        // Like the kernel's `usbip_net_recv_op_common`, a non-OK status is a
        // failure (no body follows), not an empty reply.
        let _ = buf.split_to(OP_HEADER_LEN);
        return Err(DecodeError::RequestFailed(status.0));
    }
    if buf.len() < OP_HEADER_LEN + 4 {
        return Ok(None);
    }
    Ok(Some(be_u32(buf, OP_HEADER_LEN)))
}

fn put_header(out: &mut BytesMut, code: OpCode, status: OpStatus) {
    out.put_u16(USBIP_VERSION);
    out.put_u16(code.0);
    out.put_u32(status.0);
}

/// Checks a request header; returns its code once 8 bytes are there.
fn peek_header(buf: &[u8], _expected: Option<OpCode>) -> Result<Option<OpCode>, DecodeError> {
    if buf.len() < OP_HEADER_LEN {
        return Ok(None);
    }
    let version = be_u16(buf, 0);
    if version != USBIP_VERSION {
        return Err(DecodeError::BadVersion(version));
    }
    let status = be_u32(buf, 4);
    if status != 0 {
        return Err(DecodeError::RequestStatusNotZero(status));
    }
    Ok(Some(OpCode(be_u16(buf, 2))))
}

fn peek_reply_header(buf: &[u8], expected: OpCode) -> Result<Option<OpStatus>, DecodeError> {
    if buf.len() < OP_HEADER_LEN {
        return Ok(None);
    }
    let version = be_u16(buf, 0);
    if version != USBIP_VERSION {
        return Err(DecodeError::BadVersion(version));
    }
    let code = be_u16(buf, 2);
    if code != expected.0 {
        return Err(DecodeError::UnexpectedOpCode(code));
    }
    Ok(Some(OpStatus(be_u32(buf, 4))))
}

fn put_fixed_str(out: &mut BytesMut, text: &str, size: usize) {
    // Leave room for the terminating NUL; longer text is cut (paths are
    // informational) at a character boundary, so the peer still gets UTF-8.
    let mut end = text.len().min(size - 1);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let bytes = &text.as_bytes()[..end];
    out.put_slice(bytes);
    out.put_bytes(0, size - bytes.len());
}

fn fixed_str(field: &[u8]) -> Result<String, DecodeError> {
    let end = field.iter().position(|&b| b == 0).ok_or(DecodeError::StringNotTerminated(field.len()))?;
    Ok(String::from_utf8_lossy(&field[..end]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DeviceRecord {
        DeviceRecord {
            path: "/sys/devices/usbwire/1-1".into(),
            busid: BusId::new("1-1").unwrap(),
            busnum: 1,
            devnum: 1,
            speed: Speed::HIGH,
            id_vendor: 0x1209,
            id_product: 0x0001,
            bcd_device: 0x0100,
            b_device_class: 0,
            b_device_sub_class: 0,
            b_device_protocol: 0,
            b_configuration_value: 1,
            b_num_configurations: 1,
            interfaces: vec![InterfaceRecord {
                b_interface_class: 3,
                b_interface_sub_class: 1,
                b_interface_protocol: 1,
            }],
            b_num_interfaces: 1,
        }
    }

    #[test]
    fn devlist_request_golden() {
        let mut out = BytesMut::new();
        OpRequest::DevList.encode(&mut out);
        assert_eq!(&out[..], &[0x01, 0x11, 0x80, 0x05, 0, 0, 0, 0]);
    }

    #[test]
    fn import_request_golden() {
        let mut out = BytesMut::new();
        OpRequest::Import { busid: BusId::new("1-1").unwrap() }.encode(&mut out);
        let mut expected = vec![0x01, 0x11, 0x80, 0x03, 0, 0, 0, 0, b'1', b'-', b'1'];
        expected.resize(40, 0);
        assert_eq!(&out[..], &expected[..]);
    }

    /// Found by the op_phase fuzz target: a busid of non-ASCII bytes must decode
    /// to the same bytes (so the server can refuse and log it) and encode back
    /// unchanged, not to an escaped string that no longer fits the field.
    #[test]
    fn malformed_busid_is_kept_byte_for_byte() {
        let mut frame = vec![0x01, 0x11, 0x80, 0x03, 0, 0, 0, 0, b'1', b'-'];
        frame.extend([0x97; 29]);
        frame.resize(40, 0);
        let mut buf = BytesMut::from(&frame[..]);
        let request = decode_request(&mut buf, &Limits::default()).unwrap().unwrap();
        let mut requested = b"1-".to_vec();
        requested.extend([0x97; 29]);
        assert_eq!(request, OpRequest::ImportMalformedBusId { requested });
        let mut out = BytesMut::new();
        request.encode(&mut out);
        assert_eq!(&out[..], &frame[..]);

        let mut empty = vec![0x01, 0x11, 0x80, 0x03, 0, 0, 0, 0];
        empty.resize(40, 0);
        let request = decode_request(&mut BytesMut::from(&empty[..]), &Limits::default()).unwrap().unwrap();
        assert_eq!(request, OpRequest::ImportMalformedBusId { requested: vec![] });
    }

    #[test]
    fn transforms_negotiation_round_trip() {
        let mut out = BytesMut::new();
        OpRequest::Transforms { offer: "zstd,jitter=40".into() }.encode(&mut out);
        assert_eq!(&out[..12], &[0x01, 0x11, 0x80, 0xf2, 0, 0, 0, 0, 0, 0, 0, 14]);
        let mut partial = BytesMut::from(&out[..15]);
        assert_eq!(decode_request(&mut partial, &Limits::default()), Ok(None));
        assert_eq!(
            decode_request(&mut out, &Limits::default()),
            Ok(Some(OpRequest::Transforms { offer: "zstd,jitter=40".into() }))
        );
        let mut reply = BytesMut::new();
        encode_transforms_reply("zstd", &mut reply);
        assert_eq!(decode_transforms_reply(&mut reply), Ok(Some("zstd".into())));
        let mut huge = BytesMut::from(&[0x01, 0x11, 0x80, 0xf2, 0, 0, 0, 0, 0, 1, 0, 0][..]);
        assert!(decode_request(&mut huge, &Limits::default()).is_err());
    }

    #[test]
    fn devstate_round_trip_and_limit() {
        let mut out = BytesMut::new();
        OpRequest::DevState.encode(&mut out);
        assert_eq!(&out[..], &[0x01, 0x11, 0x80, 0xf1, 0, 0, 0, 0]);
        assert_eq!(decode_request(&mut out, &Limits::default()), Ok(Some(OpRequest::DevState)));
        let mut reply = BytesMut::new();
        encode_devstate_reply(br#"{"devices":[]}"#, &mut reply);
        assert_eq!(&reply[..12], &[0x01, 0x11, 0x00, 0xf1, 0, 0, 0, 0, 0, 0, 0, 14]);
        let mut partial = BytesMut::from(&reply[..20]);
        assert_eq!(decode_devstate_reply(&mut partial), Ok(None));
        assert_eq!(decode_devstate_reply(&mut reply), Ok(Some(br#"{"devices":[]}"#.to_vec())));
        let mut huge = BytesMut::from(&[0x01, 0x11, 0x00, 0xf1, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff][..]);
        assert!(matches!(decode_devstate_reply(&mut huge), Err(DecodeError::TransferTooLong { .. })));
    }

    #[test]
    fn devlist_reply_layout_matches_kernel_offsets() {
        let mut out = BytesMut::new();
        encode_devlist_reply(&[sample()], &mut out);
        assert_eq!(out.len(), 12 + 312 + 4);
        assert_eq!(&out[..12], &[0x01, 0x11, 0x00, 0x05, 0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(&out[0x10C..0x10F], b"1-1");
        assert_eq!(&out[0x12C..0x130], &[0, 0, 0, 1]); // busnum
        assert_eq!(&out[0x134..0x138], &[0, 0, 0, 3]); // speed high
        assert_eq!(&out[0x138..0x13A], &[0x12, 0x09]); // idVendor
        assert_eq!(out[0x141], 1); // bConfigurationValue
        assert_eq!(out[0x143], 1); // bNumInterfaces
        assert_eq!(&out[0x144..0x148], &[3, 1, 1, 0]);
    }

    #[test]
    fn devlist_round_trip_byte_by_byte() {
        let mut wire = BytesMut::new();
        encode_devlist_reply(&[sample(), sample()], &mut wire);
        let mut buf = BytesMut::new();
        let limits = Limits::default();
        for (i, byte) in wire.iter().enumerate() {
            buf.put_u8(*byte);
            let decoded = decode_devlist_reply(&mut buf, &limits).unwrap();
            if i + 1 < wire.len() {
                assert!(decoded.is_none(), "decoded early at {i}");
            } else {
                assert_eq!(decoded.unwrap(), vec![sample(), sample()]);
            }
        }
    }

    #[test]
    fn import_reply_round_trip_and_error() {
        let mut wire = BytesMut::new();
        encode_import_reply(Ok(&sample()), &mut wire);
        assert_eq!(wire.len(), 320);
        let mut device = decode_import_reply(&mut wire).unwrap().unwrap().unwrap();
        device.interfaces = sample().interfaces;
        assert_eq!(device, sample());

        let mut wire = BytesMut::new();
        encode_import_reply(Err(OpStatus::DEV_BUSY), &mut wire);
        assert_eq!(&wire[..], &[0x01, 0x11, 0x00, 0x03, 0, 0, 0, 2]);
        assert_eq!(decode_import_reply(&mut wire).unwrap(), Some(Err(OpStatus::DEV_BUSY)));
    }

    #[test]
    fn bad_requests_are_typed_errors() {
        let limits = Limits::default();
        let mut buf = BytesMut::from(&[0x01, 0x06, 0x80, 0x05, 0, 0, 0, 0][..]);
        assert_eq!(decode_request(&mut buf, &limits), Err(DecodeError::BadVersion(0x0106)));
        let mut buf = BytesMut::from(&[0x01, 0x11, 0x80, 0x02, 0, 0, 0, 0][..]);
        assert_eq!(decode_request(&mut buf, &limits), Err(DecodeError::UnexpectedOpCode(0x8002)));
        let mut buf = BytesMut::from(&[0x01, 0x11, 0x80, 0x05, 0, 0, 0, 1][..]);
        assert_eq!(decode_request(&mut buf, &limits), Err(DecodeError::RequestStatusNotZero(1)));
        let mut unterminated = vec![0x01, 0x11, 0x80, 0x03, 0, 0, 0, 0];
        unterminated.resize(40, b'x');
        let mut buf = BytesMut::from(&unterminated[..]);
        assert_eq!(decode_request(&mut buf, &limits), Err(DecodeError::StringNotTerminated(32)));
    }

    #[test]
    fn devlist_count_is_bounded_before_allocation() {
        let mut buf = BytesMut::from(&[0x01, 0x11, 0x00, 0x05, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff][..]);
        assert!(matches!(decode_devlist_reply(&mut buf, &Limits::default()), Err(DecodeError::TooManyDevices { .. })));
    }

    #[test]
    fn resume_request_and_reply_golden_bytes() {
        let token = Token(std::array::from_fn(|i| i as u8));
        let mut out = BytesMut::new();
        OpRequest::Resume { token, replies_received: 0x0102_0304_0506_0708 }.encode(&mut out);
        let mut expected = vec![0x01, 0x11, 0x80, 0xf3, 0, 0, 0, 0];
        expected.extend(0u8..32);
        expected.extend([1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&out[..], &expected[..]);
        for cut in 0..expected.len() {
            let mut partial = BytesMut::from(&expected[..cut]);
            assert_eq!(decode_request(&mut partial, &Limits::default()), Ok(None), "cut at {cut}");
        }
        assert_eq!(
            decode_request(&mut out, &Limits::default()),
            Ok(Some(OpRequest::Resume { token, replies_received: 0x0102_0304_0506_0708 }))
        );

        let mut reply = BytesMut::new();
        encode_resume_reply(Ok(42), &mut reply);
        assert_eq!(&reply[..], &[0x01, 0x11, 0x00, 0xf3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 42]);
        assert_eq!(decode_resume_reply(&mut reply), Ok(Some(Ok(42))));
        encode_resume_reply(Err(OpStatus::NODEV), &mut reply);
        assert_eq!(&reply[..], &[0x01, 0x11, 0x00, 0xf3, 0, 0, 0, 4]);
        assert_eq!(decode_resume_reply(&mut reply), Ok(Some(Err(OpStatus::NODEV))));
    }
}
