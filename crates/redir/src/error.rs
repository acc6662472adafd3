//! [`RedirError`]: why a peer's usbredir bytes were refused, or why we could
//! not send a packet. Not for the usb-host core's own errors (`host`).

use crate::wire::Side;

/// Why a peer's bytes were refused. Each ends the connection: the stream
/// cannot be resynchronised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RedirError {
    /// The peer's first packet must be its hello.
    #[error("expected a hello first, got packet type {0}")]
    HelloFirst(u32),
    /// A type number the protocol does not define.
    #[error("unknown packet type {0}")]
    UnknownType(u32),
    /// A type the peer's side never sends (a guest announcing a device, say).
    #[error("packet type {0} may not come from the {1:?} side")]
    WrongSender(u32, Side),
    /// The packet is shorter than its type header.
    #[error("packet type {kind}: length {length} is shorter than its {header} byte header")]
    Short { kind: u32, length: u32, header: usize },
    /// The packet is longer than this codec accepts ([`Codec::new`](crate::Codec::new)'s `max_data`).
    #[error("packet type {kind}: length {length} exceeds the limit of {limit}")]
    TooLong { kind: u32, length: u32, limit: u32 },
    /// Data where the type allows none, or not the amount its length field says.
    #[error("packet type {kind}: {data} bytes of data where {expected} belong")]
    BadData { kind: u32, data: usize, expected: usize },
    /// An interface count beyond the 32 the packet has room for.
    #[error("interface_info: {0} interfaces (at most 32)")]
    TooManyInterfaces(u32),
    /// A filter string without its terminating NUL, or not text.
    #[error("filter_filter: the rules are not a NUL-terminated string")]
    BadFilter,
    /// We tried to send a bulk length that needs [`Caps::BULK_LENGTH_32`](crate::Caps::BULK_LENGTH_32), not in effect.
    #[error("bulk length {0} does not fit 16 bits without the 32-bit bulk length capability")]
    BulkLengthNeedsCap(u32),
    /// We tried to send a packet before the peer's hello said how to frame it.
    #[error("packet type {0} before the peer's hello (only a hello may go first)")]
    BeforePeerHello(u32),
}
