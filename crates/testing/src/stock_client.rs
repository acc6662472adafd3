//! What a stock USB/IP client does, by hand, for tests that need a device
//! held the way `usbip attach` holds it: `OP_REQ_IMPORT` written as raw bytes
//! and the connection kept open. Not a client to test the server with (the
//! client crate is that), just an importer to be seen.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;

/// Imports `busid` from the server at `addr` as a stock client would and
/// returns the connection: the device stays in use until it is dropped.
/// Panics (it is for tests) when the server does not answer with success.
pub fn hold_import(addr: &str, busid: &str) -> TcpStream {
    let mut import = vec![0x01, 0x11, 0x80, 0x03, 0, 0, 0, 0];
    let mut field = [0u8; 32];
    field[..busid.len()].copy_from_slice(busid.as_bytes());
    import.extend_from_slice(&field);
    let mut held = TcpStream::connect(addr).expect("server answers");
    held.write_all(&import).expect("import sent");
    let mut reply = [0u8; 8 + 312];
    held.read_exact(&mut reply).expect("import answered");
    assert_eq!(&reply[4..8], &[0, 0, 0, 0], "{busid} imported");
    held
}
