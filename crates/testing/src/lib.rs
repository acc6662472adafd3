//! What the integration tests of several usbwire crates share, as h2 keeps
//! `h2-support`: an in-process server on `127.0.0.1:0` with virtual devices
//! ([`TestServer`]), a peer that knows none of usbwire's extensions
//! ([`stock_peer`]), a scripted stock usbipd whose device can be unplugged
//! and plugged in again ([`StockUsbipd`]), a host driving the DFU device over
//! raw URBs ([`dfu`]), a real etcd member for the lab registry ([`etcd`]),
//! and, for tests of the real `usbwire` binary, scratch directories and
//! processes killed when dropped ([`process`]), and an import held as a
//! stock client holds it ([`stock_client`]).
//!
//! Only for tests (a dev-dependency, never published): a fixture that cannot
//! be set up panics with what went wrong, as a test should.

pub mod dfu;
pub mod etcd;
pub mod process;
mod server;
pub mod stock_client;
mod usbipd;

pub use server::{stock_peer, ServerBuilder, TestServer};
pub use usbipd::StockUsbipd;
