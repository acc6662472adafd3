//! The USB/IP client side, in userspace: list a server's devices, import one,
//! and run URBs on it with many in flight.
//!
//! [`list_devices`] and [`import`] speak the OP phase. An imported device's
//! socket becomes a [`Connection`]: [`Connection::submit`] sends a
//! `CMD_SUBMIT` and resolves when its `RET_SUBMIT` arrives (replies are
//! matched by seqnum, in any order); [`Connection::unlink`] sends
//! `CMD_UNLINK`. No kernel module is involved. For many URBs in flight from
//! one task, a [`TransferQueue`] ([`Connection::queue`]) delivers completions
//! in batches instead of one future per URB.
//!
//! Every connection's session is driven by a [`relay`] task: callers encode
//! their commands into it, within a budget of URBs and bytes in flight
//! (waiting for room past it), and the relay writes them and hands the
//! replies back, the same path the kernel attach and the usbredir bridge take.
//! [`Connection::import_resumable`] imports and, when the server (usbwire)
//! grants resume, keeps the session through network drops: the relay
//! reconnects and resumes, so an outage shorter than the server's grace
//! period is a delay for pending transfers, not an error. A session that
//! cannot be resumed fails them with [`TransferError::Disconnected`], as any
//! dropped connection does; [`ReattachingDevice`] then imports again.
//!
//! Modules by concept: `connect` (resolution, TCP, TLS and pinning),
//! `op_exchange` (device list, states, transforms, import), `transfer` (what a
//! caller asks of an endpoint), `connection` and `queue` (the URB channel's
//! API), `waiters` (the session the callers and the relay share, replies to
//! their waiters), `accelerators` (the descriptor snapshot and the storage
//! accelerator between either front, kernel or userspace, and the session),
//! [`relay`] (the task driving the session), `error`; [`vhci`]
//! attaches to the kernel, [`attach::Attachment`] is one device attached
//! there and kept so (`usbwire attach` in all its forms, `usbwire client`'s
//! rules), [`follow`] keeps a kernel attachment through the
//! device's re-enumerations, [`reattach`] keeps a device imported across drops,
//! [`redir`] bridges it to a usbredir guest, [`describe`] reads a device's
//! descriptors, `disk_limits` raises an accelerated virtual disk's command
//! size; [`DrivenConnection`] is a connection stepped by its caller
//! (tests, fuzzing). The
//! kernel attach path ([`vhci`]) imports the same way and then hands the
//! socket to vhci-hcd instead of keeping a [`Connection`] — or, when the
//! session is resumable, encrypted or transformed, one end of a socket pair
//! whose other end the [`relay`] carries.

mod accelerators;
pub mod attach;
pub mod describe;
mod disk_limits;
mod driven;
mod enumeration;
pub mod follow;
mod inbox;
pub mod kernel_relay;
mod queue;
pub mod reattach;
pub mod redir;
pub mod relay;
mod relay_wire;
mod storage;
pub mod vhci;

pub use queue::TransferQueue;
pub use reattach::ReattachingDevice;
pub use storage::StorageCounters;

/// The storage accelerator, for the fuzz harness (`fuzz/src/storage.rs`). Not an API:
/// the kernel's relay runs it.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::storage::Accelerator;
}
pub use usbwire_transport::transform::TransformSpec;

mod connect;
mod connection;
mod error;
mod op_exchange;
pub mod refusal;
mod transfer;
mod waiters;

pub use connect::{is_localhost, resolve, resolve_with_port, split_host_port, Security, TlsClient};
pub use connection::{Connection, ConnectionEnd, RESUME_GIVE_UP};
pub use driven::DrivenConnection;
pub use error::{ClientError, TransferError};
pub use op_exchange::{
    device_states, import, import_for_relay, import_reserved, import_resumable, import_with, list_devices,
    resume_session, server_state, Imported,
};
pub use transfer::{is_ok, Transfer};
