//! Secure transport for USB/IP: TLS 1.3 with mutual authentication, on the
//! same port as plain USB/IP.
//!
//! * [`identity`]: a key pair per machine (server or client), its certificate
//!   and its fingerprint (`sha256:…` of the certificate), kept in files with
//!   mode 0600, written by [`key_files`] (atomic, never replacing a key
//!   unless told).
//! * [`tls`]: rustls configurations. Servers require a client certificate and
//!   admit it in the handshake by the access rules; clients pin the
//!   server's fingerprint (trust on first use, like ssh's known_hosts, see
//!   [`known_servers`]).
//! * [`access`]: which client may connect ([`access::Admission`]) and which
//!   device it may see and import.
//! * [`PeerStream`]: one type for a plain or a TLS connection, so the server
//!   and client code above it does not care which it has.
//! * [`handshake`]: the TLS handshake (rustls's unbuffered API), ending in a
//!   [`TlsStream`], our own record layer with the negotiated keys: its two halves,
//!   [`Writer`] and [`Reader`], do no I/O (the stream is their glue to the socket), so
//!   tests, the fuzz harness and the cipher benchmark drive them without one.
//!
//! Not for the USB/IP protocol itself (that is `usbwire-proto`), nor for
//! deciding policy (the server's configuration does), nor for what travels
//! over the stream (the device state document is `usbwire_device::devstate`).

pub mod access;
pub mod ca;
pub mod handshake;
pub mod identity;
pub mod key_files;
pub mod known_servers;
mod record;
mod record_reader;
mod record_writer;
mod stream;
pub mod tls;
mod tls_stream;
/// Stream transforms live in their own crate (no TLS needed to fuzz or reuse them).
pub use usbwire_transform as transform;

pub use identity::{Fingerprint, Identity, IdentityError};
pub use record::{PeerSession, RecordError, MAX_PLAINTEXT};
pub use record_reader::Reader;
pub use record_writer::Writer;
pub use stream::{accept_tls, connect_tls, poll_write_outbox, write_all_parts, PeerStream, RECORD_LAYER_VARIABLE};
pub use tls_stream::{Socket, TlsStream};

/// The record layer's parts with keys of the caller's choosing, for the fuzz harnesses
/// (`fuzz/src/tls_records.rs`, `fuzz/src/tls_pair.rs`). Not an API: connections come
/// from [`handshake`].
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::record::{content, wire_len, PeerSession, Sealer, MAX_PLAINTEXT};
    pub use crate::record_reader::Reader;
    pub use crate::record_writer::Writer;
    pub use rustls::crypto::cipher::{AeadKey, Iv};
    pub use rustls::ConnectionTrafficSecrets;
}

/// The first byte of a TLS handshake record (content type 22). A plain USB/IP
/// request starts with its version's high byte, 0x01.
pub const TLS_HANDSHAKE_BYTE: u8 = 0x16;

/// A directory for one unit test that does not exist yet (the code under
/// test creates it), inside a private one removed when this is dropped.
#[cfg(test)]
pub(crate) struct ScratchDir(tempfile::TempDir);

#[cfg(test)]
impl ScratchDir {
    pub(crate) fn new(name: &str) -> Self {
        Self(tempfile::Builder::new().prefix(&format!("usbwire-transport-{name}-")).tempdir().unwrap())
    }

    /// The directory's path (not created).
    pub(crate) fn path(&self) -> std::path::PathBuf {
        self.0.path().join("dir")
    }
}
