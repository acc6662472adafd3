//! The USB/IP v1.1.1 wire protocol, sans I/O.
//!
//! This crate owns the byte layouts of every USB/IP message (the OP phase:
//! `OP_REQ/REP_DEVLIST`, `OP_REQ/REP_IMPORT`; the URB phase: `CMD_SUBMIT`,
//! `RET_SUBMIT`, `CMD_UNLINK`, `RET_UNLINK`, isochronous packet descriptors)
//! and decodes them incrementally from a byte buffer: partial input is normal
//! and simply yields `Ok(None)` until the whole message is there.
//!
//! It is **not** for sockets, tasks or clocks: it never performs I/O and has
//! no async runtime. Callers (the server and client crates) read bytes into a
//! [`bytes::BytesMut`], call a `decode_*` function, and write what an
//! `encode_*` function produced.
//!
//! Every length that comes from the network is checked against [`Limits`]
//! before anything is allocated for it, and every malformed input is a typed
//! [`DecodeError`], never a panic.
//!
//! ```
//! use bytes::BytesMut;
//! use usbwire_proto::{op, Limits};
//!
//! let mut wire = BytesMut::new();
//! op::OpRequest::Import { busid: op::BusId::new("1-1").unwrap() }.encode(&mut wire);
//! let req = op::decode_request(&mut wire, &Limits::default()).unwrap().unwrap();
//! assert_eq!(req, op::OpRequest::Import { busid: op::BusId::new("1-1").unwrap() });
//! ```
//!
//! Field names follow the kernel's `usbip_common.h` so that code greps
//! against it.
//!
//! Above the codec, [`server_session::ServerSession`] is the server side of a URB
//! channel as a state machine (in-flight table, unlink rules, memory budget),
//! fed bytes and completions and yielding device calls and replies; the
//! server's tokio loop only drives it. [`client_session::ClientSession`] is the
//! client side (outstanding URBs, their replies, acknowledgements), and both
//! carry the resume state of [`resume`], the usbwire extension that lets a
//! URB channel outlive its connection, and the keep-alives of [`liveness`]
//! that notice a link gone silent.
//!
//! [`retry::Retry`] spaces the attempts of every loop that reaches for a
//! peer again.
//!
//! [`display::escape`] is how every crate shows a string that came from the
//! network (device strings, paths, mDNS names): control characters and bidi
//! overrides become visible escapes.
//!
//! Not for what a server decides around the sessions (an import's wait for a
//! device, a parked session's grace period: `usbwire-server`'s cores), nor
//! for what a lab registry keeps (a reservation's digest).

pub mod client_session;
pub mod descriptors;
pub mod display;
mod error;
mod limits;
pub mod liveness;
pub mod op;
mod outbox;
mod recv_buffer;
pub mod reservation;
pub mod resume;
pub mod retry;
mod seqnum_map;
pub mod server_session;
pub mod storage;
pub mod urb;
mod wire;

pub use error::DecodeError;
pub use limits::{Budget, BudgetKind, Limits};
pub use outbox::Outbox;
pub use recv_buffer::RecvBuffer;
pub use seqnum_map::{SeqnumHasher, SeqnumMap};
pub use wire::{Direction, Speed, Status};

/// The protocol version carried in every OP header (v1.1.1).
pub const USBIP_VERSION: u16 = 0x0111;

/// The TCP port USB/IP servers listen on by default.
pub const DEFAULT_PORT: u16 = 3240;
