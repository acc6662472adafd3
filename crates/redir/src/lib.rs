//! The usbredir protocol (version 0.7, as spice-usbredir and QEMU's `usb-redir`
//! device speak it), sans I/O: [`Codec`] decodes the packets a peer sends from
//! a byte buffer, incrementally, and encodes ours. It owns what the framing
//! depends on — the capabilities both hellos announced, and with them the
//! header size and the type headers' sizes — and checks every packet against
//! the rules of the reference parser (`usbredirparser.c`): which side may send
//! it, its exact type-header size, whether it may carry data and how much.
//!
//! [`host::UsbHost`] plays the usb-host role on top of the codec for a device
//! reached over USB/IP, still without I/O: guest packets and URB completions
//! in, packets and URBs out. Not here: sockets and clocks (the client crate's
//! `redir` module drives it). Layout facts: `docs/protocol.md` §7.
//!
//! Wire format: little-endian, packed. A header `u32 type, u32 length, u32 id`
//! (or `u64 id` once both sides announced [`Caps::IDS_64`]; a hello always uses
//! the short header), then `length` bytes: the type header, then data.

mod codec;
mod error;
mod filter;
pub mod host;
mod packet;
mod wire;

pub use codec::Codec;
pub use error::RedirError;
pub use host::UsbHost;
pub use packet::{EndpointInfo, InterfaceInfo, Packet};
pub use wire::{Caps, PacketType, Side, Status, MAX_PACKET_LEN};
