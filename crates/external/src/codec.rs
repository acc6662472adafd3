//! The device protocol's frames (`docs/protocol.md` §9): bytes in, [`Message`]s
//! out, and back. Sans-I/O: no socket, no clock.
//!
//! A frame is `u32 length` (little-endian, counting the type byte and the body),
//! `u8 type`, then the body. [`decode`] is check-then-parse over a `BytesMut`:
//! partial input is `Ok(None)` and consumes nothing, a length over
//! [`MAX_FRAME_LEN`] is refused before anything is allocated, and data comes
//! out as `Bytes` sliced from the input (no copy).
//!
//! Not for what the messages mean (which side may send what, in which order):
//! that is [`crate::core`] on the server's side and the device library on the other.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use usbwire_proto::Speed;

/// What a device process sends first: `b"UWDP"`.
pub const MAGIC: [u8; 4] = *b"UWDP";
/// The protocol revision this codec speaks.
pub const VERSION: u16 = 1;
/// The length prefix and the type byte.
pub const HEADER_LEN: usize = 5;
/// The largest `length` a frame may carry: the largest transfer the server
/// accepts (`Limits::max_transfer_length`, 16 MiB) plus the biggest fixed body.
pub const MAX_FRAME_LEN: u32 = (16 << 20) + 64;
/// The longest reason a `REFUSE` carries.
pub const MAX_REASON_LEN: usize = 1024;

/// A frame's type byte. A newtype, so a value we do not know is named in the error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MessageType(pub u8);

impl MessageType {
    // Device process → server.
    pub const HELLO: Self = Self(0x01);
    pub const DATA: Self = Self(0x11);
    pub const ACK: Self = Self(0x12);
    pub const NAK: Self = Self(0x13);
    pub const STALL: Self = Self(0x14);
    // Server → device process.
    pub const WELCOME: Self = Self(0x81);
    pub const REFUSE: Self = Self(0x82);
    pub const SETUP: Self = Self(0x91);
    pub const OUT: Self = Self(0x92);
    pub const IN: Self = Self(0x93);
    pub const CANCEL: Self = Self(0x94);
    pub const RESET: Self = Self(0x95);
}

/// One frame of the device protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Device → server, first: the protocol revision, the device's speed and bMaxPacketSize0.
    Hello { version: u16, speed: Speed, ep0_max_packet: u8 },
    /// Device → server: IN data answering request `id` (a control IN's data stage, or an IN request).
    Data { id: u32, data: Bytes },
    /// Device → server: request `id` (OUT data, or a control request without IN data) is done.
    Ack { id: u32 },
    /// Device → server: request `id` is taken but not ready; its answer follows later.
    Nak { id: u32 },
    /// Device → server: request `id` is refused (the endpoint, or ep0 for this request, stalls).
    Stall { id: u32 },
    /// Server → device, after a good `Hello`: the revision in use and the largest frame it takes.
    Welcome { version: u16, max_frame_len: u32 },
    /// Server → device: why the connection is refused; the server closes it after.
    Refuse { reason: String },
    /// Server → device: a control request on ep0 with its OUT data stage (empty for IN).
    Setup { id: u32, setup: [u8; 8], data: Bytes },
    /// Server → device: OUT data for endpoint `endpoint` (1..=15).
    Out { id: u32, endpoint: u8, data: Bytes },
    /// Server → device: the host asks for up to `length` bytes from endpoint `endpoint` (1..=15) IN.
    In { id: u32, endpoint: u8, length: u32 },
    /// Server → device: request `id` was unlinked; drop it, send no answer (one sent already is ignored).
    Cancel { id: u32 },
    /// Server → device: a USB reset: every request is abandoned, the device is unconfigured.
    Reset,
}

/// Why bytes are not a frame. Each ends the connection: the stream cannot be
/// resynchronised, as USB/IP's cannot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The length prefix is over [`MAX_FRAME_LEN`] (or zero): the peer is not
    /// speaking this protocol, or is hostile.
    #[error("frame length {0} is outside 1..={MAX_FRAME_LEN}: not a usbwire device protocol peer")]
    BadLength(u32),
    /// A type byte no revision defines; the peer speaks a newer revision.
    #[error("unknown message type {:#04x}; upgrade the server or the device library", .0.0)]
    UnknownType(MessageType),
    /// The body does not have the size its type requires.
    #[error("message type {:#04x} with a body of {len} bytes: malformed frame", .kind.0)]
    BadBody { kind: MessageType, len: usize },
    /// A `Hello` without the magic bytes.
    #[error("hello without the UWDP magic: not a usbwire device process")]
    BadMagic,
    /// A `Refuse` reason that is not UTF-8.
    #[error("refusal reason is not UTF-8")]
    BadReason,
}

impl Message {
    /// The type byte of this message.
    pub fn kind(&self) -> MessageType {
        match self {
            Self::Hello { .. } => MessageType::HELLO,
            Self::Data { .. } => MessageType::DATA,
            Self::Ack { .. } => MessageType::ACK,
            Self::Nak { .. } => MessageType::NAK,
            Self::Stall { .. } => MessageType::STALL,
            Self::Welcome { .. } => MessageType::WELCOME,
            Self::Refuse { .. } => MessageType::REFUSE,
            Self::Setup { .. } => MessageType::SETUP,
            Self::Out { .. } => MessageType::OUT,
            Self::In { .. } => MessageType::IN,
            Self::Cancel { .. } => MessageType::CANCEL,
            Self::Reset => MessageType::RESET,
        }
    }

    /// The payload carried after the fixed part of the body (sent as its own
    /// slice, so OUT data is never copied), or empty.
    pub fn payload(&self) -> Bytes {
        match self {
            Self::Data { data, .. } | Self::Setup { data, .. } | Self::Out { data, .. } => data.clone(),
            Self::Refuse { reason } => {
                let cut = floor_char_boundary(reason, MAX_REASON_LEN);
                Bytes::copy_from_slice(&reason.as_bytes()[..cut])
            }
            _ => Bytes::new(),
        }
    }

    /// Appends the length prefix, the type byte and the fixed part of the body;
    /// [`payload`](Self::payload) follows it on the wire.
    pub fn encode_head(&self, out: &mut BytesMut) {
        let start = out.len();
        out.put_u32_le(0);
        out.put_u8(self.kind().0);
        match self {
            Self::Hello { version, speed, ep0_max_packet } => {
                out.put_slice(&MAGIC);
                out.put_u16_le(*version);
                out.put_u8(speed.0.min(255) as u8);
                out.put_u8(*ep0_max_packet);
            }
            Self::Data { id, .. } | Self::Ack { id } | Self::Nak { id } | Self::Stall { id } | Self::Cancel { id } => {
                out.put_u32_le(*id);
            }
            Self::Welcome { version, max_frame_len } => {
                out.put_u16_le(*version);
                out.put_u32_le(*max_frame_len);
            }
            Self::Refuse { .. } | Self::Reset => {}
            Self::Setup { id, setup, .. } => {
                out.put_u32_le(*id);
                out.put_slice(setup);
            }
            Self::Out { id, endpoint, .. } => {
                out.put_u32_le(*id);
                out.put_u8(*endpoint);
            }
            Self::In { id, endpoint, length } => {
                out.put_u32_le(*id);
                out.put_u8(*endpoint);
                out.put_u32_le(*length);
            }
        }
        let len = (out.len() - start - 4 + self.payload().len()) as u32;
        out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    }

    /// The whole frame in one buffer (tests, and small messages).
    pub fn encode(&self, out: &mut BytesMut) {
        self.encode_head(out);
        out.put_slice(&self.payload());
    }
}

/// The byte length of the frame at the front of `buf`, once its length prefix
/// is there (`Ok(None)` before), checked against [`MAX_FRAME_LEN`].
pub fn frame_len(buf: &[u8]) -> Result<Option<usize>, CodecError> {
    let Some(prefix) = buf.get(..4) else { return Ok(None) };
    let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]);
    if len == 0 || len > MAX_FRAME_LEN {
        return Err(CodecError::BadLength(len));
    }
    Ok(Some(4 + len as usize))
}

/// Takes one whole frame from the front of `buf`: `Ok(None)` (nothing consumed)
/// until all of it is there.
pub fn decode(buf: &mut BytesMut) -> Result<Option<Message>, CodecError> {
    let Some(len) = frame_len(buf)? else { return Ok(None) };
    if buf.len() < len {
        return Ok(None);
    }
    let mut frame = buf.split_to(len).freeze();
    frame.advance(4);
    let kind = MessageType(frame.get_u8());
    parse_body(kind, frame).map(Some)
}

fn parse_body(kind: MessageType, mut body: Bytes) -> Result<Message, CodecError> {
    let len = body.len();
    let need = |fixed: usize, exact: bool| {
        if len < fixed || (exact && len != fixed) {
            Err(CodecError::BadBody { kind, len })
        } else {
            Ok(())
        }
    };
    Ok(match kind {
        MessageType::HELLO => {
            need(8, true)?;
            if body[..4] != MAGIC {
                return Err(CodecError::BadMagic);
            }
            body.advance(4);
            let version = body.get_u16_le();
            Message::Hello { version, speed: Speed(u32::from(body.get_u8())), ep0_max_packet: body.get_u8() }
        }
        MessageType::DATA => {
            need(4, false)?;
            Message::Data { id: body.get_u32_le(), data: body }
        }
        MessageType::ACK | MessageType::NAK | MessageType::STALL | MessageType::CANCEL => {
            need(4, true)?;
            let id = body.get_u32_le();
            match kind {
                MessageType::ACK => Message::Ack { id },
                MessageType::NAK => Message::Nak { id },
                MessageType::STALL => Message::Stall { id },
                _ => Message::Cancel { id },
            }
        }
        MessageType::WELCOME => {
            need(6, true)?;
            Message::Welcome { version: body.get_u16_le(), max_frame_len: body.get_u32_le() }
        }
        MessageType::REFUSE => {
            if len > MAX_REASON_LEN {
                return Err(CodecError::BadBody { kind, len });
            }
            let reason = String::from_utf8(body.to_vec()).map_err(|_| CodecError::BadReason)?;
            Message::Refuse { reason }
        }
        MessageType::SETUP => {
            need(12, false)?;
            let id = body.get_u32_le();
            let mut setup = [0u8; 8];
            body.copy_to_slice(&mut setup);
            Message::Setup { id, setup, data: body }
        }
        MessageType::OUT => {
            need(5, false)?;
            Message::Out { id: body.get_u32_le(), endpoint: body.get_u8(), data: body }
        }
        MessageType::IN => {
            need(9, true)?;
            Message::In { id: body.get_u32_le(), endpoint: body.get_u8(), length: body.get_u32_le() }
        }
        MessageType::RESET => {
            need(0, true)?;
            Message::Reset
        }
        other => return Err(CodecError::UnknownType(other)),
    })
}

/// The largest index `<= at` that starts a character of `text`.
fn floor_char_boundary(text: &str, at: usize) -> usize {
    (0..=at.min(text.len())).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shared golden vectors: `(name, frame bytes)` from
    /// `tests/vectors/device_protocol.txt`, which the Python library's tests read too.
    fn vectors() -> Vec<(&'static str, Vec<u8>)> {
        let text = include_str!("../../../tests/vectors/device_protocol.txt");
        let mut vectors = Vec::new();
        for line in text.lines() {
            let mut tokens = line.split('#').next().unwrap_or_default().split_whitespace();
            let Some(name) = tokens.next() else { continue };
            let hex: String = tokens.collect();
            let bytes = (0..hex.len()).step_by(2).map(|at| u8::from_str_radix(&hex[at..at + 2], 16).unwrap()).collect();
            vectors.push((name, bytes));
        }
        vectors
    }

    /// Every message type, by the name of its line in the vectors file.
    fn messages() -> Vec<(&'static str, Message)> {
        vec![
            ("hello", Message::Hello { version: 1, speed: Speed::HIGH, ep0_max_packet: 64 }),
            ("data", Message::Data { id: 7, data: Bytes::from_static(b"\x12\x01") }),
            ("ack", Message::Ack { id: 0x0102_0304 }),
            ("nak", Message::Nak { id: 2 }),
            ("stall", Message::Stall { id: 3 }),
            ("welcome", Message::Welcome { version: 1, max_frame_len: MAX_FRAME_LEN }),
            ("refuse", Message::Refuse { reason: "busy".into() }),
            (
                "setup",
                Message::Setup { id: 1, setup: [0x80, 0x06, 0x00, 0x01, 0x00, 0x00, 0x12, 0x00], data: Bytes::new() },
            ),
            ("out", Message::Out { id: 9, endpoint: 2, data: Bytes::from_static(b"hi") }),
            ("in", Message::In { id: 10, endpoint: 1, length: 512 }),
            ("cancel", Message::Cancel { id: 10 }),
            ("reset", Message::Reset),
        ]
    }

    #[test]
    fn golden_bytes_decode_and_encode() {
        let vectors = vectors();
        let messages = messages();
        let vector_names: std::collections::BTreeSet<&str> = vectors.iter().map(|(name, _)| *name).collect();
        let message_names: std::collections::BTreeSet<&str> = messages.iter().map(|(name, _)| *name).collect();
        assert_eq!(vector_names, message_names, "one vector per message type, one message per vector");
        for (name, message) in messages {
            let bytes = &vectors.iter().find(|(vector, _)| *vector == name).unwrap().1;
            let mut encoded = BytesMut::new();
            message.encode(&mut encoded);
            assert_eq!(&encoded[..], &bytes[..], "{message:?} encodes to the vector {name}");
            let mut input = BytesMut::from(&bytes[..]);
            assert_eq!(decode(&mut input), Ok(Some(message.clone())));
            assert!(input.is_empty(), "{message:?} consumed whole");
        }
    }

    #[test]
    fn a_partial_frame_consumes_nothing() {
        let mut input = BytesMut::from(&b"\x05\x00\x00\x00\x12\x04\x03"[..]);
        assert_eq!(decode(&mut input), Ok(None));
        assert_eq!(input.len(), 7);
    }

    #[test]
    fn an_oversized_length_is_refused_before_its_bytes_arrive() {
        let mut input = BytesMut::from(&b"\xff\xff\xff\x7f\x11"[..]);
        assert_eq!(decode(&mut input), Err(CodecError::BadLength(0x7fff_ffff)));
        let mut zero = BytesMut::from(&b"\x00\x00\x00\x00"[..]);
        assert_eq!(decode(&mut zero), Err(CodecError::BadLength(0)));
    }

    #[test]
    fn malformed_bodies_are_named() {
        let cases: [(&[u8], CodecError); 4] = [
            (b"\x04\x00\x00\x00\x12\x01\x02\x03", CodecError::BadBody { kind: MessageType::ACK, len: 3 }),
            (b"\x09\x00\x00\x00\x01UWDX\x01\x00\x03\x40", CodecError::BadMagic),
            (b"\x01\x00\x00\x00\x7f", CodecError::UnknownType(MessageType(0x7f))),
            (b"\x03\x00\x00\x00\x82\xff\xfe", CodecError::BadReason),
        ];
        for (bytes, error) in cases {
            assert_eq!(decode(&mut BytesMut::from(bytes)), Err(error));
        }
    }

    #[test]
    fn a_long_refusal_is_cut_at_a_character() {
        let message = Message::Refuse { reason: "é".repeat(MAX_REASON_LEN) };
        let mut encoded = BytesMut::new();
        message.encode(&mut encoded);
        let Ok(Some(Message::Refuse { reason })) = decode(&mut encoded) else { panic!("decodes") };
        assert_eq!(reason.len(), MAX_REASON_LEN);
    }
}
