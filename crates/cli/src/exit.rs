//! Exit codes (sysexits(3) values, so scripts can tell failures apart).

use std::process::ExitCode;

/// A command's failure and the exit code it maps to.
pub(crate) struct Failure {
    pub(crate) error: anyhow::Error,
    code: u8,
}

impl Failure {
    /// 64: the command line was wrong.
    pub(crate) fn usage(error: anyhow::Error) -> Self {
        Self { error, code: 64 }
    }
    /// 65: a peer sent data that is not valid USB/IP.
    pub(crate) fn protocol(error: anyhow::Error) -> Self {
        Self { error, code: 65 }
    }
    /// 69: the server (or device) is unreachable or refused.
    pub(crate) fn unavailable(error: anyhow::Error) -> Self {
        Self { error, code: 69 }
    }
    /// 77: the server does not admit this client's identity.
    pub(crate) fn not_admitted(error: anyhow::Error) -> Self {
        Self { error, code: 77 }
    }
    /// 70: an internal error.
    pub(crate) fn software(error: anyhow::Error) -> Self {
        Self { error, code: 70 }
    }
    /// 74: a file or socket operation failed.
    pub(crate) fn io(error: anyhow::Error) -> Self {
        Self { error, code: 74 }
    }
    /// 78: the configuration is wrong.
    pub(crate) fn config(error: anyhow::Error) -> Self {
        Self { error, code: 78 }
    }

    pub(crate) fn code(&self) -> ExitCode {
        ExitCode::from(self.code)
    }
}

impl From<usbwire_client::ClientError> for Failure {
    fn from(error: usbwire_client::ClientError) -> Self {
        use usbwire_client::ClientError as E;
        match error {
            E::Protocol(_) | E::WrongDevice { .. } => Self::protocol(error.into()),
            E::NotAdmitted { .. } | E::CertificateExpired { .. } => Self::not_admitted(error.into()),
            _ => Self::unavailable(error.into()),
        }
    }
}
