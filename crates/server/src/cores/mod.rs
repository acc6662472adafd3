//! The server's sans-I/O cores: decisions that depend on time, with the clock
//! left to the caller (the quinn-proto shape: `poll_timeout` says when,
//! `handle_timeout(now)` is told it came). Nothing here holds a socket, a task
//! or a lock, so the tests drive each core with a virtual clock
//! (`tests/grace_and_import.rs`).
//!
//! * [`import_slot`]: what an `OP_REQ_IMPORT` does with a device it finds
//!   taken ([`import_slot::ImportWait`], and the [`import_slot::Claimant`]
//!   that holds or asks for it): take it, wait (bounded) for the previous
//!   importer's teardown, or answer busy.
//! * [`park`]: the grace period of a parked session ([`park::Grace`]).
//!
//! Not for the URB channel's state machine or the resume token, which are the
//! protocol's (`usbwire_proto::server_session`, `usbwire_proto::resume`), nor
//! for what carries the decisions out (the registry, `resumable.rs`,
//! `urb_channel.rs`).

pub mod import_slot;
pub mod park;
