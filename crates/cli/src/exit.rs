//! Exit codes (sysexits(3) values, so scripts can tell failures apart).

use std::process::ExitCode;

/// A command's failure and the exit code it maps to.
pub(crate) struct Failure {
    pub(crate) error: anyhow::Error,
    code: u8,
}

impl Failure {
    /// The exit code of a command line clap refused (as [`Failure::usage`]).
    pub(crate) fn usage_code() -> ExitCode {
        ExitCode::from(64)
    }

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
    /// 75: try again later (every matching device in the lab registry is taken).
    pub(crate) fn temporary(error: anyhow::Error) -> Self {
        Self { error, code: 75 }
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

/// An error and its causes on one line, each said once: a cause whose text
/// the message already carries (`cannot connect to X: Connection refused`
/// from an error that also exposes that `io::Error` as its source) is not
/// repeated.
pub(crate) fn describe(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let said = cause.to_string();
        if text.contains(&said) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&said);
    }
    text
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_the_message_already_carries_is_not_repeated() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused (os error 111)");
        let connect = usbwire_client::ClientError::Connect { addr: "127.0.0.1:1".into(), source: io };
        let text = describe(&anyhow::Error::from(connect));
        assert_eq!(text, "cannot connect to 127.0.0.1:1: Connection refused (os error 111)");
        let layered = anyhow::anyhow!("disk.img: not found").context("cannot open the disk image");
        assert_eq!(describe(&layered), "cannot open the disk image: disk.img: not found");
    }
}
