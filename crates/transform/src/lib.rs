//! Paired stream transforms (the transformation modules of Taylor & Pasquale's
//! networked device driver): after the OP-phase negotiation both sides wrap
//! the connection in a [`TransformedStream`], which cuts what is written into
//! frames, passes each frame through the agreed [`Transform`]s in order, and
//! on the far side undoes them in reverse order — automatically, from the
//! same list. A transform that would not gain anything on a frame leaves it
//! alone and says so in the frame's flags, so compression never costs more
//! than it saves.
//!
//! Frame on the wire: `u32 length | u8 flags | u64 sent_at_us | payload`
//! (big-endian; `sent_at_us` is microseconds on the sender's clock since the
//! stream began, which the jitter buffer uses to restore spacing).

mod compress;
mod frame;
mod framed;
mod jitter;
mod pipeline;
mod timer;

pub use compress::{Compression, Lz4, Zstd};
pub use frame::{Frame, Transform, FRAME_HEADER_LEN, MAX_FRAME_PAYLOAD, MAX_WIRE_PAYLOAD};
pub use framed::{TransformStats, TransformedStream};
pub use jitter::JitterBuffer;
pub use pipeline::{Pipeline, Side, TransformSpec};
