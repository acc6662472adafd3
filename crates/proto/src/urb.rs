//! The URB phase: `CMD_SUBMIT`, `RET_SUBMIT`, `CMD_UNLINK`, `RET_UNLINK`.
//!
//! Every message starts with the same 48-byte header (`usbip_header_basic`
//! plus 28 command-specific bytes, all big-endian except the raw SETUP
//! packet). What follows depends on state the header does not carry: a
//! `CMD_SUBMIT` has a payload only for OUT, isochronous descriptors only for
//! isochronous endpoints; a `RET_SUBMIT` has a payload only if the request
//! was IN. So the decoders take that knowledge from the caller:
//! [`decode_command`] asks whether an endpoint is isochronous,
//! [`decode_return`] asks what was submitted under a seqnum.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::wire::{be_i32, be_u32, put_u32, Direction, Status};
use crate::{DecodeError, Limits};

/// Every URB-phase header is 48 bytes.
pub const HEADER_LEN: usize = 48;
/// Size of `struct usbip_iso_packet_descriptor`.
pub const ISO_DESCRIPTOR_LEN: usize = 16;

/// URB command words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Command(pub u32);

impl Command {
    pub const SUBMIT: Self = Self(1);
    pub const UNLINK: Self = Self(2);
    pub const RET_SUBMIT: Self = Self(3);
    pub const RET_UNLINK: Self = Self(4);
}

/// `USBIP_URB_*` transfer flags. Test bits one by one; unknown bits are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TransferFlags(pub u32);

impl TransferFlags {
    /// IN: a short read is an error (`-EREMOTEIO`).
    pub const SHORT_NOT_OK: u32 = 0x0001;
    /// ISO: schedule as soon as possible, ignore `start_frame`.
    pub const ISO_ASAP: u32 = 0x0002;
    /// Bulk OUT: end with a zero-length packet if the length is a multiple of wMaxPacketSize.
    pub const ZERO_PACKET: u32 = 0x0040;
    /// Set on IN URBs; redundant with the header's direction.
    pub const DIR_IN: u32 = 0x0200;

    pub fn contains(self, bit: u32) -> bool {
        self.0 & bit == bit
    }
}

/// `struct usbip_iso_packet_descriptor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IsoPacketDescriptor {
    /// Offset of the packet in the (uncompacted) transfer buffer.
    pub offset: u32,
    /// Expected length.
    pub length: u32,
    /// Bytes actually transferred (replies).
    pub actual_length: u32,
    /// Per-packet status (replies).
    pub status: Status,
}

impl IsoPacketDescriptor {
    fn put(&self, out: &mut impl BufMut) {
        out.put_u32(self.offset);
        out.put_u32(self.length);
        out.put_u32(self.actual_length);
        out.put_i32(self.status.0);
    }

    fn read(bytes: &[u8]) -> Self {
        Self {
            offset: be_u32(bytes, 0),
            length: be_u32(bytes, 4),
            actual_length: be_u32(bytes, 8),
            status: Status(be_i32(bytes, 12)),
        }
    }
}

/// `CMD_SUBMIT`: the client asks the device to run one URB.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CmdSubmit {
    pub seqnum: u32,
    pub devid: u32,
    pub direction: Direction,
    /// Endpoint number 0..=15, without the direction bit.
    pub ep: u8,
    pub transfer_flags: TransferFlags,
    /// OUT: bytes in `data`. IN: the most the device may return.
    pub transfer_buffer_length: u32,
    pub start_frame: i32,
    /// Isochronous packet count; for other endpoints Linux sends 0 and the spec -1.
    pub number_of_packets: i32,
    pub interval: i32,
    /// The raw SETUP packet (little-endian fields inside, per USB).
    pub setup: [u8; 8],
    /// OUT payload, sliced from the receive buffer without a copy.
    pub data: Bytes,
    /// Isochronous packet descriptors (empty for other endpoints).
    pub iso_packets: Vec<IsoPacketDescriptor>,
}

impl CmdSubmit {
    /// A control, bulk or interrupt URB as vhci-hcd sends one: `URB_DIR_IN` in
    /// the flags of an IN, no isochronous fields. `length` is the OUT data's
    /// length, or the most an IN may return.
    pub fn new(
        seqnum: u32,
        devid: u32,
        direction: Direction,
        ep: u8,
        length: u32,
        setup: [u8; 8],
        data: Bytes,
    ) -> Self {
        let flags = if direction == Direction::In { TransferFlags::DIR_IN } else { 0 };
        Self {
            seqnum,
            devid,
            direction,
            ep,
            transfer_flags: TransferFlags(flags),
            transfer_buffer_length: length,
            start_frame: 0,
            number_of_packets: 0,
            interval: 0,
            setup,
            data,
            iso_packets: Vec::new(),
        }
    }

    /// The 48-byte header. The payload and descriptors follow it on the wire.
    #[inline]
    pub fn header(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        put_basic(&mut h, Command::SUBMIT, self.seqnum, self.devid, self.direction.to_u32(), self.ep.into());
        put_u32(&mut h, 0x14, self.transfer_flags.0);
        put_u32(&mut h, 0x18, self.transfer_buffer_length);
        put_u32(&mut h, 0x1c, self.start_frame as u32);
        put_u32(&mut h, 0x20, self.number_of_packets as u32);
        put_u32(&mut h, 0x24, self.interval as u32);
        h[0x28..0x30].copy_from_slice(&self.setup);
        h
    }

    /// The isochronous descriptors that follow the payload, encoded.
    pub fn iso_trailer(&self, out: &mut impl BufMut) {
        for packet in &self.iso_packets {
            packet.put(out);
        }
    }

    /// Appends the whole message (header, OUT payload, descriptors).
    pub fn encode(&self, out: &mut BytesMut) {
        out.put_slice(&self.header());
        if self.direction == Direction::Out {
            out.put_slice(&self.data);
        }
        self.iso_trailer(out);
    }
}

/// `CMD_UNLINK`: the client asks to cancel an earlier `CMD_SUBMIT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmdUnlink {
    /// This request's own seqnum (from the same counter as submits).
    pub seqnum: u32,
    pub devid: u32,
    /// The seqnum of the `CMD_SUBMIT` to cancel.
    pub unlink_seqnum: u32,
}

impl CmdUnlink {
    pub fn header(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        put_basic(&mut h, Command::UNLINK, self.seqnum, self.devid, 0, 0);
        put_u32(&mut h, 0x14, self.unlink_seqnum);
        h
    }
}

/// `RET_SUBMIT`: the result of one URB.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetSubmit {
    /// The seqnum of the `CMD_SUBMIT` being answered.
    pub seqnum: u32,
    pub status: Status,
    pub actual_length: u32,
    pub start_frame: i32,
    /// Isochronous: must equal the submitted count. Otherwise 0.
    pub number_of_packets: i32,
    pub error_count: i32,
    /// IN payload: `actual_length` bytes (compacted for isochronous IN). Empty for OUT.
    pub data: Bytes,
    pub iso_packets: Vec<IsoPacketDescriptor>,
}

impl RetSubmit {
    /// The reply to a control, bulk or interrupt URB: its status and, for an
    /// IN, the bytes read (`actual_length` is their count). Nothing isochronous.
    pub fn new(seqnum: u32, status: Status, data: Bytes) -> Self {
        let actual_length = data.len() as u32;
        Self {
            seqnum,
            status,
            actual_length,
            start_frame: 0,
            number_of_packets: 0,
            error_count: 0,
            data,
            iso_packets: Vec::new(),
        }
    }

    /// The 48-byte header. Like the kernel stub, devid, direction and ep are 0.
    #[inline]
    pub fn header(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        put_basic(&mut h, Command::RET_SUBMIT, self.seqnum, 0, 0, 0);
        put_u32(&mut h, 0x14, self.status.0 as u32);
        put_u32(&mut h, 0x18, self.actual_length);
        put_u32(&mut h, 0x1c, self.start_frame as u32);
        put_u32(&mut h, 0x20, self.number_of_packets as u32);
        put_u32(&mut h, 0x24, self.error_count as u32);
        h
    }

    /// The isochronous descriptors that follow the payload, encoded.
    pub fn iso_trailer(&self, out: &mut impl BufMut) {
        for packet in &self.iso_packets {
            packet.put(out);
        }
    }

    /// Appends the whole message (header, IN payload, descriptors).
    pub fn encode(&self, out: &mut BytesMut) {
        out.put_slice(&self.header());
        out.put_slice(&self.data);
        self.iso_trailer(out);
    }
}

/// `RET_UNLINK`: the answer to a `CMD_UNLINK`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetUnlink {
    /// The seqnum of the `CMD_UNLINK` (not of its target).
    pub seqnum: u32,
    /// `-ECONNRESET` if the URB was cancelled, 0 if it had already completed.
    pub status: Status,
}

impl RetUnlink {
    pub fn header(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        put_basic(&mut h, Command::RET_UNLINK, self.seqnum, 0, 0, 0);
        put_u32(&mut h, 0x14, self.status.0 as u32);
        h
    }
}

/// A message from client to server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientMessage {
    Submit(CmdSubmit),
    Unlink(CmdUnlink),
}

/// A message from server to client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerMessage {
    Submit(RetSubmit),
    Unlink(RetUnlink),
}

/// Whether the CMD_SUBMIT whose header starts `buf` announces isochronous
/// packets (`number_of_packets` > 0), for a sender that is trusted to
/// announce them exactly when its endpoint is isochronous, as vhci-hcd does:
/// a relay of the kernel's commands passes it to [`decode_command`] as
/// `is_iso`. `false` while the header is not all there (nothing decodes yet).
/// A server never asks this of its peer: it asks its device (see
/// `decode_command`).
#[inline]
pub fn announces_iso_packets(buf: &[u8]) -> bool {
    buf.len() >= HEADER_LEN && be_i32(buf, 0x20) > 0
}

/// How many bytes the client message at the front of `buf` occupies, once its
/// header is there. Use it to reserve room for a large OUT payload in one step.
pub fn command_frame_len(
    buf: &[u8],
    limits: &Limits,
    is_iso: impl Fn(Direction, u8) -> bool,
) -> Result<Option<usize>, DecodeError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    match Command(be_u32(buf, 0)) {
        Command::UNLINK => Ok(Some(HEADER_LEN)),
        Command::SUBMIT => {
            let submit = SubmitShape::parse(buf, limits, &is_iso)?;
            Ok(Some(HEADER_LEN + submit.payload_len + submit.iso_count * ISO_DESCRIPTOR_LEN))
        }
        other => Err(DecodeError::UnexpectedCommand(other.0)),
    }
}

/// Decodes one client message (server side). `Ok(None)` means more bytes are needed.
///
/// `is_iso(direction, ep)` says whether the endpoint is isochronous; only then
/// do descriptors follow (the kernel stub decides the same way, from the pipe).
pub fn decode_command(
    buf: &mut BytesMut,
    limits: &Limits,
    is_iso: impl Fn(Direction, u8) -> bool,
) -> Result<Option<ClientMessage>, DecodeError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    // The header is parsed once: the shape says how long the message is and
    // then how to cut it (`command_frame_len` would parse it again).
    let shape = match Command(be_u32(buf, 0)) {
        Command::UNLINK => {
            let header = take_header(buf);
            let unlink_seqnum = be_u32(&header, 0x14);
            let (seqnum, devid) = (be_u32(&header, 4), be_u32(&header, 8));
            return Ok(Some(ClientMessage::Unlink(CmdUnlink { seqnum, devid, unlink_seqnum })));
        }
        Command::SUBMIT => SubmitShape::parse(&buf[..HEADER_LEN], limits, &is_iso)?,
        other => return Err(DecodeError::UnexpectedCommand(other.0)),
    };
    if buf.len() < HEADER_LEN + shape.payload_len + shape.iso_count * ISO_DESCRIPTOR_LEN {
        return Ok(None);
    }
    let header = take_header(buf);
    let seqnum = be_u32(&header, 4);
    let devid = be_u32(&header, 8);
    let data = take_payload(buf, shape.payload_len);
    let mut iso_packets = Vec::with_capacity(shape.iso_count);
    if shape.iso_count > 0 {
        let descriptors = buf.split_to(shape.iso_count * ISO_DESCRIPTOR_LEN);
        let mut total_length = 0u64;
        for (index, chunk) in descriptors.chunks_exact(ISO_DESCRIPTOR_LEN).enumerate() {
            let packet = IsoPacketDescriptor::read(chunk);
            let end = u64::from(packet.offset) + u64::from(packet.length);
            total_length += u64::from(packet.length);
            if end > u64::from(shape.transfer_buffer_length) || total_length > u64::from(shape.transfer_buffer_length) {
                return Err(DecodeError::IsoPacketOutOfBounds { index });
            }
            iso_packets.push(packet);
        }
    }
    let mut setup = [0u8; 8];
    setup.copy_from_slice(&header[0x28..0x30]);
    Ok(Some(ClientMessage::Submit(CmdSubmit {
        seqnum,
        devid,
        direction: shape.direction,
        ep: shape.ep,
        transfer_flags: TransferFlags(be_u32(&header, 0x14)),
        transfer_buffer_length: shape.transfer_buffer_length,
        start_frame: be_i32(&header, 0x1c),
        number_of_packets: be_i32(&header, 0x20),
        interval: be_i32(&header, 0x24),
        setup,
        data,
        iso_packets,
    })))
}

/// What the client remembers about an outstanding `CMD_SUBMIT`, needed to
/// parse its reply (the reply header carries no direction or endpoint).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubmittedShape {
    pub direction: Direction,
    pub transfer_buffer_length: u32,
    /// `Some(np)` for an isochronous endpoint.
    pub iso_packets: Option<i32>,
}

/// Decodes one server message (client side). `Ok(None)` means more bytes are needed.
///
/// `submitted(seqnum)` returns what was submitted under a seqnum, or `None` if
/// nothing is outstanding (the Linux vhci closes the connection then; so do we).
pub fn decode_return(
    buf: &mut BytesMut,
    limits: &Limits,
    submitted: impl Fn(u32) -> Option<SubmittedShape>,
) -> Result<Option<ServerMessage>, DecodeError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let seqnum = be_u32(buf, 4);
    match Command(be_u32(buf, 0)) {
        Command::RET_UNLINK => {
            let header = buf.split_to(HEADER_LEN);
            Ok(Some(ServerMessage::Unlink(RetUnlink { seqnum, status: Status(be_i32(&header, 0x14)) })))
        }
        Command::RET_SUBMIT => {
            let shape = submitted(seqnum).ok_or(DecodeError::UnknownSeqnum(seqnum))?;
            let raw_actual = be_i32(buf, 0x18);
            let actual_length = u32::try_from(raw_actual).map_err(|_| DecodeError::NegativeLength(raw_actual))?;
            if actual_length > shape.transfer_buffer_length || actual_length > limits.max_transfer_length {
                return Err(DecodeError::ActualLengthTooLong {
                    actual_length,
                    requested: shape.transfer_buffer_length,
                });
            }
            let number_of_packets = be_i32(buf, 0x20);
            let iso_count = match shape.iso_packets {
                Some(expected) => {
                    if number_of_packets != expected {
                        return Err(DecodeError::IsoPacketCountMismatch { expected, got: number_of_packets });
                    }
                    // `expected` should have been checked when it was submitted; check
                    // again so that a caller's mistake cannot size the frame.
                    match u32::try_from(expected) {
                        Ok(count) if count <= limits.max_iso_packets => count as usize,
                        _ => return Err(DecodeError::BadIsoPacketCount(expected)),
                    }
                }
                None => 0,
            };
            let payload_len = if shape.direction == Direction::In { actual_length as usize } else { 0 };
            let total = HEADER_LEN + payload_len + iso_count * ISO_DESCRIPTOR_LEN;
            if buf.len() < total {
                return Ok(None);
            }
            let header = take_header(buf);
            let data = take_payload(buf, payload_len);
            let mut iso_packets = Vec::with_capacity(iso_count);
            if iso_count > 0 {
                let descriptors = buf.split_to(iso_count * ISO_DESCRIPTOR_LEN);
                let mut sum = 0u64;
                for (index, chunk) in descriptors.chunks_exact(ISO_DESCRIPTOR_LEN).enumerate() {
                    let packet = IsoPacketDescriptor::read(chunk);
                    let end = u64::from(packet.offset) + u64::from(packet.actual_length);
                    if packet.actual_length > packet.length || end > u64::from(shape.transfer_buffer_length) {
                        return Err(DecodeError::IsoPacketOutOfBounds { index });
                    }
                    sum += u64::from(packet.actual_length);
                    iso_packets.push(packet);
                }
                if sum != u64::from(actual_length) {
                    return Err(DecodeError::IsoActualLengthMismatch { sum, actual_length });
                }
            }
            Ok(Some(ServerMessage::Submit(RetSubmit {
                seqnum,
                status: Status(be_i32(&header, 0x14)),
                actual_length,
                start_frame: be_i32(&header, 0x1c),
                number_of_packets,
                error_count: be_i32(&header, 0x24),
                data,
                iso_packets,
            })))
        }
        other => Err(DecodeError::UnexpectedCommand(other.0)),
    }
}

/// Copies the 48-byte header out and drops it from `buf` (cheaper than
/// splitting off a reference-counted view that is only read and dropped).
#[inline]
fn take_header(buf: &mut BytesMut) -> [u8; HEADER_LEN] {
    let mut header = [0u8; HEADER_LEN];
    header.copy_from_slice(&buf[..HEADER_LEN]);
    buf.advance(HEADER_LEN);
    header
}

/// The next `len` bytes as a zero-copy `Bytes`; no reference taken when empty.
#[inline]
fn take_payload(buf: &mut BytesMut, len: usize) -> Bytes {
    if len == 0 {
        Bytes::new()
    } else {
        buf.split_to(len).freeze()
    }
}

/// The validated shape of a `CMD_SUBMIT` header.
struct SubmitShape {
    direction: Direction,
    ep: u8,
    transfer_buffer_length: u32,
    payload_len: usize,
    iso_count: usize,
}

impl SubmitShape {
    fn parse(header: &[u8], limits: &Limits, is_iso: &impl Fn(Direction, u8) -> bool) -> Result<Self, DecodeError> {
        let raw_direction = be_u32(header, 0x0c);
        let direction = Direction::from_u32(raw_direction).ok_or(DecodeError::BadDirection(raw_direction))?;
        let raw_ep = be_u32(header, 0x10);
        let ep = u8::try_from(raw_ep).ok().filter(|&ep| ep <= 15).ok_or(DecodeError::BadEndpoint(raw_ep))?;
        let raw_length = be_i32(header, 0x18);
        let transfer_buffer_length = u32::try_from(raw_length).map_err(|_| DecodeError::NegativeLength(raw_length))?;
        if transfer_buffer_length > limits.max_transfer_length {
            return Err(DecodeError::TransferTooLong { len: transfer_buffer_length, max: limits.max_transfer_length });
        }
        let iso_count = if is_iso(direction, ep) {
            let np = be_i32(header, 0x20);
            match u32::try_from(np) {
                Ok(count) if count <= limits.max_iso_packets => count as usize,
                _ => return Err(DecodeError::BadIsoPacketCount(np)),
            }
        } else {
            0
        };
        let payload_len = if direction == Direction::Out { transfer_buffer_length as usize } else { 0 };
        Ok(Self { direction, ep, transfer_buffer_length, payload_len, iso_count })
    }
}

#[inline]
fn put_basic(h: &mut [u8; HEADER_LEN], command: Command, seqnum: u32, devid: u32, direction: u32, ep: u32) {
    put_u32(h, 0x00, command.0);
    put_u32(h, 0x04, seqnum);
    put_u32(h, 0x08, devid);
    put_u32(h, 0x0c, direction);
    put_u32(h, 0x10, ep);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_iso(_: Direction, _: u8) -> bool {
        false
    }

    /// The interrupt-IN example from the kernel's usbip_protocol.rst.
    #[test]
    fn kernel_doc_interrupt_in_example_decodes() {
        let words: [u32; 12] = [
            0x00000001, 0x00000d05, 0x0001000f, 0x00000001, 0x00000001, 0x00000200, 0x00000040, 0xffffffff, 0x00000000,
            0x00000004, 0x00000000, 0x00000000,
        ];
        let mut buf = BytesMut::new();
        for w in words {
            buf.put_u32(w);
        }
        let ClientMessage::Submit(submit) = decode_command(&mut buf, &Limits::default(), no_iso).unwrap().unwrap()
        else {
            panic!("expected a submit");
        };
        assert_eq!(submit.seqnum, 0xd05);
        assert_eq!(submit.devid, 0x0001_000f);
        assert_eq!(submit.direction, Direction::In);
        assert_eq!(submit.ep, 1);
        assert!(submit.transfer_flags.contains(TransferFlags::DIR_IN));
        assert_eq!(submit.transfer_buffer_length, 64);
        assert_eq!(submit.start_frame, -1);
        assert_eq!(submit.interval, 4);
        assert!(submit.data.is_empty());
        assert!(buf.is_empty());
    }

    #[test]
    fn a_submit_announces_iso_packets_by_its_count_once_its_header_is_whole() {
        let mut iso = CmdSubmit::new(1, 2, Direction::In, 3, 192, [0; 8], Bytes::new());
        iso.number_of_packets = 3;
        let header = iso.header();
        assert!(announces_iso_packets(&header));
        assert!(!announces_iso_packets(&header[..HEADER_LEN - 1]), "not before the header is whole");
        let bulk = CmdSubmit::new(1, 2, Direction::In, 3, 192, [0; 8], Bytes::new());
        assert!(!announces_iso_packets(&bulk.header()));
        // The answer is what decode_command needs: the descriptors are then read.
        let mut buf = BytesMut::from(&header[..]);
        for packet in 0..3u32 {
            buf.put_u32(packet * 64);
            buf.put_u32(64);
            buf.put_u32(0);
            buf.put_u32(0);
        }
        let announced = announces_iso_packets(&buf);
        let Some(ClientMessage::Submit(decoded)) =
            decode_command(&mut buf, &Limits::default(), |_, _| announced).unwrap()
        else {
            panic!("expected a submit")
        };
        assert_eq!(decoded.iso_packets.len(), 3);
        assert!(buf.is_empty());
    }

    #[test]
    fn out_submit_waits_for_its_payload() {
        let submit = CmdSubmit {
            seqnum: 7,
            devid: 0x10002,
            direction: Direction::Out,
            ep: 2,
            transfer_flags: TransferFlags(0),
            transfer_buffer_length: 5,
            start_frame: 0,
            number_of_packets: 0,
            interval: 0,
            setup: [0; 8],
            data: Bytes::from_static(b"hello"),
            iso_packets: vec![],
        };
        let mut wire = BytesMut::new();
        submit.encode(&mut wire);
        assert_eq!(wire.len(), 53);
        let mut partial = BytesMut::from(&wire[..52]);
        assert_eq!(decode_command(&mut partial, &Limits::default(), no_iso).unwrap(), None);
        assert_eq!(partial.len(), 52, "partial input must not be consumed");
        assert_eq!(decode_command(&mut wire, &Limits::default(), no_iso).unwrap(), Some(ClientMessage::Submit(submit)));
    }

    #[test]
    fn unlink_golden() {
        let unlink = CmdUnlink { seqnum: 0x10, devid: 0x0001_0002, unlink_seqnum: 0x0f };
        let h = unlink.header();
        assert_eq!(&h[..24], &[0, 0, 0, 2, 0, 0, 0, 0x10, 0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x0f]);
        assert!(h[24..].iter().all(|&b| b == 0));
        let ret = RetUnlink { seqnum: 0x10, status: Status::ECONNRESET };
        assert_eq!(
            &ret.header()[..24],
            &[0, 0, 0, 4, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0x98]
        );
    }

    #[test]
    fn hostile_headers_are_rejected() {
        let limits = Limits { max_transfer_length: 1024, ..Limits::default() };
        let mut header = CmdSubmit {
            seqnum: 1,
            devid: 1,
            direction: Direction::In,
            ep: 1,
            transfer_flags: TransferFlags(0),
            transfer_buffer_length: 4096,
            start_frame: 0,
            number_of_packets: 0,
            interval: 0,
            setup: [0; 8],
            data: Bytes::new(),
            iso_packets: vec![],
        }
        .header();
        let mut buf = BytesMut::from(&header[..]);
        assert_eq!(
            decode_command(&mut buf, &limits, no_iso),
            Err(DecodeError::TransferTooLong { len: 4096, max: 1024 })
        );
        put_u32(&mut header, 0x18, 0xffff_fff0);
        let mut buf = BytesMut::from(&header[..]);
        assert_eq!(decode_command(&mut buf, &limits, no_iso), Err(DecodeError::NegativeLength(-16)));
        put_u32(&mut header, 0x18, 8);
        put_u32(&mut header, 0x10, 16);
        let mut buf = BytesMut::from(&header[..]);
        assert_eq!(decode_command(&mut buf, &limits, no_iso), Err(DecodeError::BadEndpoint(16)));
        put_u32(&mut header, 0x10, 1);
        put_u32(&mut header, 0x0c, 2);
        let mut buf = BytesMut::from(&header[..]);
        assert_eq!(decode_command(&mut buf, &limits, no_iso), Err(DecodeError::BadDirection(2)));
        put_u32(&mut header, 0x0c, 1);
        put_u32(&mut header, 0x20, 5000);
        let mut buf = BytesMut::from(&header[..]);
        assert_eq!(decode_command(&mut buf, &limits, |_, _| true), Err(DecodeError::BadIsoPacketCount(5000)));
        put_u32(&mut header, 0, 3);
        let mut buf = BytesMut::from(&header[..]);
        assert_eq!(decode_command(&mut buf, &limits, no_iso), Err(DecodeError::UnexpectedCommand(3)));
    }

    #[test]
    fn iso_descriptor_out_of_bounds_is_rejected() {
        let submit = CmdSubmit {
            seqnum: 1,
            devid: 1,
            direction: Direction::In,
            ep: 3,
            transfer_flags: TransferFlags(TransferFlags::ISO_ASAP),
            transfer_buffer_length: 200,
            start_frame: 0,
            number_of_packets: 2,
            interval: 1,
            setup: [0; 8],
            data: Bytes::new(),
            iso_packets: vec![
                IsoPacketDescriptor { offset: 0, length: 100, actual_length: 0, status: Status::OK },
                IsoPacketDescriptor { offset: 150, length: 100, actual_length: 0, status: Status::OK },
            ],
        };
        let mut wire = BytesMut::new();
        submit.encode(&mut wire);
        assert_eq!(
            decode_command(&mut wire, &Limits::default(), |_, _| true),
            Err(DecodeError::IsoPacketOutOfBounds { index: 1 })
        );
    }

    #[test]
    fn iso_in_return_round_trip() {
        let ret = RetSubmit {
            seqnum: 9,
            status: Status::OK,
            actual_length: 5,
            start_frame: 0,
            number_of_packets: 2,
            error_count: 1,
            data: Bytes::from_static(b"abcde"),
            iso_packets: vec![
                IsoPacketDescriptor { offset: 0, length: 4, actual_length: 3, status: Status::OK },
                IsoPacketDescriptor { offset: 4, length: 4, actual_length: 2, status: Status::EXDEV },
            ],
        };
        let mut wire = BytesMut::new();
        ret.encode(&mut wire);
        let shape = SubmittedShape { direction: Direction::In, transfer_buffer_length: 8, iso_packets: Some(2) };
        let decoded = decode_return(&mut wire, &Limits::default(), |_| Some(shape)).unwrap().unwrap();
        assert_eq!(decoded, ServerMessage::Submit(ret));
    }

    #[test]
    fn return_checks_against_what_was_submitted() {
        let ret = RetSubmit {
            seqnum: 9,
            status: Status::OK,
            actual_length: 64,
            start_frame: 0,
            number_of_packets: 0,
            error_count: 0,
            data: Bytes::from(vec![0u8; 64]),
            iso_packets: vec![],
        };
        let mut wire = BytesMut::new();
        ret.encode(&mut wire);
        let shape = SubmittedShape { direction: Direction::In, transfer_buffer_length: 8, iso_packets: None };
        assert!(matches!(
            decode_return(&mut wire.clone(), &Limits::default(), |_| Some(shape)),
            Err(DecodeError::ActualLengthTooLong { .. })
        ));
        assert_eq!(decode_return(&mut wire, &Limits::default(), |_| None), Err(DecodeError::UnknownSeqnum(9)));
    }
}
