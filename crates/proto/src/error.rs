//! Decode errors: every way a peer's bytes can be wrong.

/// A message that cannot be decoded. The stream is self-delimiting with no
/// length prefix, so after any of these the connection cannot resynchronise
/// and must be closed (which is what both kernel sides do).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// An OP header carried a version other than 0x0111; the peer speaks another protocol.
    #[error("unsupported protocol version {0:#06x} (expected 0x0111)")]
    BadVersion(u16),
    /// An OP code this side does not handle (or a reply where a request was expected).
    #[error("unexpected op code {0:#06x}")]
    UnexpectedOpCode(u16),
    /// A request carried a non-zero status (the kernel rejects these too).
    #[error("request carries non-zero status {0}")]
    RequestStatusNotZero(u32),
    /// A busid or path field had no NUL terminator within its fixed size.
    #[error("string field is not NUL-terminated within {0} bytes")]
    StringNotTerminated(usize),
    /// A devlist reply announced more devices than [`crate::Limits::max_devices`].
    #[error("device list announces {count} devices (limit {max})")]
    TooManyDevices { count: u32, max: u32 },
    /// An `OP_REP_DEVLIST` carried a non-zero status: the server refused to list
    /// its devices (no body follows). Report the status; the connection is over.
    #[error("peer answered with status {0}")]
    RequestFailed(u32),
    /// A URB header's command word is not valid in this direction of the stream.
    #[error("unexpected urb command {0}")]
    UnexpectedCommand(u32),
    /// The direction word is neither 0 (OUT) nor 1 (IN).
    #[error("invalid direction {0}")]
    BadDirection(u32),
    /// An endpoint number above 15.
    #[error("invalid endpoint number {0}")]
    BadEndpoint(u32),
    /// A negative `transfer_buffer_length` or `actual_length`.
    #[error("negative length {0}")]
    NegativeLength(i32),
    /// A transfer longer than [`crate::Limits::max_transfer_length`].
    #[error("transfer length {len} exceeds the limit of {max} bytes")]
    TransferTooLong { len: u32, max: u32 },
    /// An isochronous packet count below zero or above [`crate::Limits::max_iso_packets`].
    #[error("invalid isochronous packet count {0}")]
    BadIsoPacketCount(i32),
    /// An isochronous packet descriptor that points outside the transfer buffer.
    #[error("isochronous packet {index} lies outside the transfer buffer")]
    IsoPacketOutOfBounds { index: usize },
    /// The per-packet actual lengths of an isochronous reply do not add up to its actual length.
    #[error("isochronous actual lengths sum to {sum}, header says {actual_length}")]
    IsoActualLengthMismatch { sum: u64, actual_length: u32 },
    /// A reply's packet count differs from what was submitted.
    #[error("reply has {got} isochronous packets, {expected} were submitted")]
    IsoPacketCountMismatch { expected: i32, got: i32 },
    /// A reply's `actual_length` exceeds the length that was requested.
    #[error("actual length {actual_length} exceeds the requested {requested}")]
    ActualLengthTooLong { actual_length: u32, requested: u32 },
    /// A text field of an extension message is not UTF-8.
    #[error("text field is not UTF-8")]
    NotUtf8,
    /// A `RET_SUBMIT` for a seqnum that is not outstanding.
    #[error("reply for unknown seqnum {0}")]
    UnknownSeqnum(u32),
}
