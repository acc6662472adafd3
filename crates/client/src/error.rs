//! What can go wrong: [`ClientError`] for connecting and the OP phase,
//! [`TransferError`] for a URB.

use std::net::SocketAddr;
use std::time::Duration;

use usbwire_proto::op::OpStatus;
use usbwire_proto::{DecodeError, Status};

/// How long the OP phase may take before we give up on a server.
pub(crate) const OP_TIMEOUT: Duration = Duration::from_secs(10);

/// Client-side failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server's address is not `HOST`, `HOST:PORT`, `[V6]:PORT` (a port
    /// out of range, an unclosed bracket), or names its port twice.
    #[error("{text:?} is not a server address: {reason}")]
    BadAddress { text: String, reason: String },
    /// Nothing listens there, or the network is in the way.
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: std::io::Error },
    /// The server did not answer the request in time.
    #[error("{addr} did not answer within {} s", OP_TIMEOUT.as_secs())]
    Timeout { addr: String },
    /// The server closed the connection or the socket failed.
    #[error("connection lost: {0}")]
    Io(#[from] std::io::Error),
    /// The server sent something that is not USB/IP v1.1.1.
    #[error("protocol error: {0}")]
    Protocol(#[from] DecodeError),
    /// The descriptor snapshot after the import reply (§5.8) is malformed:
    /// the server does not speak the extension as this client does.
    #[error(
        "{addr} sent a malformed descriptor snapshot ({error}); attach with --accelerate off to import without one"
    )]
    Snapshot { addr: String, error: usbwire_proto::descriptors::SnapshotError },
    /// The server refused the import; `reason` is what a usbwire server said
    /// of the device when asked (in use by whom, reserved for whom, withdrawn).
    #[error("server refused {busid}: {}{}", .status.describe(), .reason.as_deref().map(|why| format!("; {why}")).unwrap_or_default())]
    Refused { busid: String, status: OpStatus, reason: Option<String> },
    /// TLS: the server's key is not pinned yet and trusting a new one was not allowed.
    #[error("{addr} presented an unknown key {fingerprint}; if that is the server's (`usbwire identity` on it shows it), run again with --trust-new to pin it in {}", .known.display())]
    UnknownServer { addr: String, fingerprint: String, known: std::path::PathBuf },
    /// TLS: the server's key differs from the pinned one.
    #[error("{addr} presented key {got}, but {expected} is pinned in {}: someone may be in the middle; if the server's key really changed, remove its line from that file", .known.display())]
    ServerKeyChanged { addr: String, expected: String, got: String, known: std::path::PathBuf },
    /// TLS: the server's key is not the one its lab registry entry names
    /// ([`crate::TlsClient::pinned`]): the entry was planted or is stale, or
    /// someone is in the middle.
    #[error("{addr} presented key {got}, but its lab registry entry names {expected}: refused (a planted or stale entry, or someone in the middle); if the server's key really changed, restart its `usbwire serve --registry` so it registers the new one")]
    NotTheRegisteredKey { addr: String, expected: String, got: String },
    /// TLS: the handshake failed (for instance the server does not know our identity).
    #[error(
        "TLS with {addr} failed: {reason} (does the server allow this client's identity? `usbwire identity` shows it)"
    )]
    Tls { addr: String, reason: String },
    /// TLS: the server does not admit this client's identity (an access-denied alert).
    /// `issued_by` (CA, name) for a CA-issued identity: then a fingerprint rule is
    /// not what to ask for, the CA and the name are.
    #[error("{addr} does not admit this client ({})", not_admitted_advice(.fingerprint, .issued_by))]
    NotAdmitted { addr: String, fingerprint: String, issued_by: Option<(String, String)> },
    /// TLS: the server refused this client's CA-issued certificate as expired or not yet valid.
    #[error(
        "{addr} refused this client's certificate as expired or not yet valid: have the CA issue a new one (`usbwire identity --ca-issue NAME --days N`) and check this machine's clock"
    )]
    CertificateExpired { addr: String },
    /// The server closed the connection before answering (plain USB/IP refused, or TLS required).
    #[error(
        "{addr} closed the connection without answering (it may require TLS: use --tls, or it refused this client)"
    )]
    ClosedWithoutAnswer { addr: String },
    /// The server answered an import for another bus id.
    #[error("{addr} did not agree to stream transforms (a usbwire server is needed; leave out --compress / --jitter-buffer)")]
    NoTransforms { addr: String },
    #[error("server answered for bus id {got} instead of {wanted}")]
    WrongDevice { wanted: String, got: String },
    /// A resume was refused: the server no longer holds the session (its grace
    /// period ran out, or it restarted). Import the device again.
    #[error("{addr} no longer holds the session (grace period over or server restarted); import the device again")]
    ResumeRefused { addr: String },
    /// No device the server lists (available) matches the rule.
    #[error("no available device on {addr} matches {rule} (`usbwire list -r {addr}` shows what it has)")]
    NoMatchingDevice { addr: SocketAddr, rule: String },
}

impl ClientError {
    /// Whether trying again cannot help until someone changes something: the
    /// address is malformed, the server's key is not the one trusted, the server
    /// does not admit this client, or it does not speak what was asked of it. A
    /// client that retries until a server is back stops on these and says why.
    pub fn is_lasting(&self) -> bool {
        matches!(
            self,
            Self::BadAddress { .. }
                | Self::UnknownServer { .. }
                | Self::ServerKeyChanged { .. }
                | Self::NotTheRegisteredKey { .. }
                | Self::NotAdmitted { .. }
                | Self::CertificateExpired { .. }
                | Self::NoTransforms { .. }
        )
    }
}

/// Why a URB did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The connection to the server ended (the device may be gone).
    #[error("connection to the server lost")]
    Disconnected,
    /// The endpoint stalled (-EPIPE): clear the halt, or the request is not supported.
    #[error("endpoint stalled")]
    Stall,
    /// The device sent more than the buffer holds (-EOVERFLOW, babble).
    #[error("device sent more data than requested (babble)")]
    Overflow,
    /// The URB was cancelled (-ECONNRESET / -ENOENT), usually by our unlink.
    #[error("transfer cancelled")]
    Cancelled,
    /// The device went away on the server (-ENODEV / -ESHUTDOWN).
    #[error("device gone")]
    DeviceGone,
    /// Any other failure status the server reported.
    #[error("transfer failed: {0}")]
    Failed(Status),
}

impl TransferError {
    /// The typed error for a failed URB status (`None` for success and for a
    /// short read, which is not an error unless the caller asked for it).
    pub fn from_status(status: Status) -> Option<Self> {
        Some(match status {
            Status::OK => return None,
            Status::EPIPE => Self::Stall,
            Status::EOVERFLOW => Self::Overflow,
            Status::ECONNRESET | Status::ENOENT => Self::Cancelled,
            Status::ENODEV | Status::ESHUTDOWN => Self::DeviceGone,
            other => Self::Failed(other),
        })
    }
}

/// What a refused client should ask the server's administrator for.
fn not_admitted_advice(fingerprint: &str, issued_by: &Option<(String, String)>) -> String {
    match issued_by {
        Some((ca, name)) => format!(
            "its certificate was issued by CA {ca} for {name}): the server does not trust that CA, or no rule admits \
             `ca:{name}`; ask its administrator to trust the CA (`--ca DIR/ca.crt`) and allow `ca:{name}`, or to \
             issue this client a new identity from the CA the server trusts (`usbwire identity --ca CA_DIR \
             --ca-issue {name} --dir DIR --force`"
        ),
        None => format!(
            "identity {fingerprint}): ask its administrator to allow it (`usbwire serve --allow {fingerprint}`, or an \
             [[allow]] rule"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_typed_errors() {
        assert_eq!(TransferError::from_status(Status::OK), None);
        assert_eq!(TransferError::from_status(Status::EPIPE), Some(TransferError::Stall));
        assert_eq!(TransferError::from_status(Status::EOVERFLOW), Some(TransferError::Overflow));
        assert_eq!(TransferError::from_status(Status::ECONNRESET), Some(TransferError::Cancelled));
        assert_eq!(TransferError::from_status(Status::ESHUTDOWN), Some(TransferError::DeviceGone));
        assert_eq!(TransferError::from_status(Status::EPROTO), Some(TransferError::Failed(Status::EPROTO)));
    }
}
