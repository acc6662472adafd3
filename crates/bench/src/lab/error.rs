//! [`LabBenchError`]: why a lab bench run ended without a report. Not for
//! what the report says went wrong along the way (`report`).

use usbwire_lab::LabError;

/// Why a run ended without a report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LabBenchError {
    /// The registry could not be reached, or refused or failed a request.
    #[error(transparent)]
    Registry(#[from] LabError),
    /// The fleet did not show up in time, or the registry ended the watch:
    /// check etcd's health and try again (a smaller `--servers` first).
    #[error("{0}")]
    Unavailable(String),
    /// The registry's answers contradict each other (a device reserved twice,
    /// a count that does not add up): a bug in the registry code to report.
    #[error("{0}")]
    Inconsistent(String),
    /// A task of the run panicked or was cancelled.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
}
