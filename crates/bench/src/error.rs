//! [`BenchError`]: why a measurement of a link (the [`matrix`](crate::matrix),
//! the device it imports, the loopback server it may start) ended without a
//! result. Not for the lab bench's (`lab::LabBenchError`), nor for what a
//! result says went wrong along the way (`Record::measurement_problem`).

/// Why a link measurement ended without a result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// Importing the device to measure failed: the server's refusal or the
    /// connection's failure, as the client says it.
    #[error(transparent)]
    Import(#[from] usbwire_client::ClientError),
    /// The server or device cannot be measured as asked: no resume granted,
    /// no bulk endpoint, a transfer that failed.
    #[error("{0}")]
    Unavailable(String),
    /// The in-process loopback server did not start.
    #[error(transparent)]
    Loopback(std::io::Error),
    /// A socket of the measurement itself failed: the raw-TCP ceiling's
    /// server or client, or the delay proxy.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A bug: the measuring thread ended without a result, the cipher could
    /// not be measured, the loopback server never named its device.
    #[error(transparent)]
    Internal(Box<dyn std::error::Error + Send + Sync>),
}
