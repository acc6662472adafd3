//! Devices served by another process: a USB device whose descriptors and
//! endpoint traffic come from a program connected to the server over a Unix
//! socket — a Python script (the `usbwire.device` library, or a Facedancer
//! device script through its usbwire backend), or any program speaking the
//! framed device protocol of `docs/protocol.md` §9.
//!
//! * [`codec`]: the frames, sans-I/O (bytes in, [`Message`]s out, and back);
//! * [`core`]: the server's half of the protocol as a state machine: URBs in,
//!   requests out, answers in, completions out, deadlines as input;
//! * [`ExternalDevice`] ([`attach`]): the [`Device`](usbwire_device::Device)
//!   that speaks it over a stream, with the task that moves the bytes.
//!
//! ```
//! use bytes::BytesMut;
//! use usbwire_external::codec::{decode, Message};
//!
//! let mut wire = BytesMut::from(&b"\x09\x00\x00\x00\x01UWDP\x01\x00\x03\x40"[..]);
//! let hello = decode(&mut wire).unwrap();
//! assert!(matches!(hello, Some(Message::Hello { version: 1, ep0_max_packet: 64, .. })));
//! ```
//!
//! This crate is not for listening on sockets or exporting devices: the
//! server accepts device processes (with its socket's ownership checks) and
//! exports what [`attach`] returns.

pub mod codec;
pub mod core;
mod device;
pub mod enumerate;
pub mod process;

pub use codec::{CodecError, Message, MessageType};
pub use core::{Gone, ProtocolError};
pub use device::{attach, AttachError, Attached, ExternalDevice, Options};
pub use enumerate::{Descriptors, EnumerationError};
