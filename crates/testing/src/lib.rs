//! What the integration tests of several usbwire crates share, as h2 keeps
//! `h2-support`: an in-process server on `127.0.0.1:0` with virtual devices
//! ([`TestServer`]), a peer that knows none of usbwire's extensions
//! ([`stock_peer`]), and, for tests of the real `usbwire` binary, scratch
//! directories and processes killed when dropped ([`process`]), and one real
//! etcd member for the lab registry ([`etcd`]).
//!
//! Only for tests (a dev-dependency, never published): a fixture that cannot
//! be set up panics with what went wrong, as a test should.

pub mod etcd;
pub mod process;
mod server;

pub use server::{stock_peer, ServerBuilder, TestServer};
