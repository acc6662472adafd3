//! Exit codes: sysexits(3) values, so scripts can tell failures apart. The
//! one table of what each means is [`EXIT_CODES`]; the README's table and the
//! man pages' EXIT STATUS section are checked against it.

use std::process::ExitCode;

use usbwire_server::private_dir::{PrivateDirError, SocketError};

const USAGE: u8 = 64;
const DATA: u8 = 65;
const UNAVAILABLE: u8 = 69;
const SOFTWARE: u8 = 70;
const OS: u8 = 71;
const CANNOT_CREATE: u8 = 73;
const IO: u8 = 74;
const TEMPORARY: u8 = 75;
const PERMISSION: u8 = 77;
const CONFIG: u8 = 78;
/// [`Failure::closed_stdout`]: success, as far as the exit code goes.
const CLOSED_STDOUT: u8 = 0;

/// Every exit code but 0 (success), its sysexits name and when usbwire exits with it.
pub(crate) const EXIT_CODES: &[(u8, &str, &str)] = &[
    (
        USAGE,
        "usage",
        "the command line is wrong: an unknown verb or flag, a malformed bus id (not BUS-PORT[.PORT…] like 0-1 or 1-1.2, to any verb), a bad HOST:PORT, a port given both in -r HOST:PORT and --tcp-port",
    ),
    (
        DATA,
        "data",
        "what the command was given names nothing or cannot be used: a peer that does not speak USB/IP, text the keyboard cannot type, a bus id with no device to bind or unbind, a --device rule with no bind to unbind, nothing reserved to release, a vhci port with nothing attached",
    ),
    (
        UNAVAILABLE,
        "unavailable",
        "a server or service cannot be reached or refused: nothing listens, the device is in use, reserved or gone, no server on the control socket, the keyboard not attached by any host",
    ),
    (SOFTWARE, "internal", "a bug in usbwire: please report it"),
    (
        OS,
        "OS error",
        "the system lacks or refuses what the command needs: a listen address in use (or a Unix socket a running program answers on), vhci-hcd not loaded (attach and client alike), no pseudo-terminal for a serial port",
    ),
    (
        CANNOT_CREATE,
        "can't create",
        "a file, directory or socket the command must make cannot be made: the control socket, a capture directory (serve --capture and capture alike), a disk image, serial link or key file in a missing directory, a key file already there, without --force",
    ),
    (IO, "I/O", "reading or writing a file, socket or sysfs attribute failed"),
    (
        TEMPORARY,
        "temporary",
        "try again later: every matching device in the lab registry is taken, no free vhci-hcd port",
    ),
    (
        PERMISSION,
        "permission",
        "not allowed: the server does not admit this client's identity (or its certificate expired), another user's control socket or reservation, vhci-hcd without root",
    ),
    (
        CONFIG,
        "config",
        "the configuration is wrong: a config file, a disk image that is missing or unusable, an identity, a directory for the control socket, captures (serve --capture and capture alike), keys or the demo that is another user's, writable by others or a symbolic link",
    ),
];

/// A command's failure and the exit code it maps to.
pub(crate) struct Failure {
    pub(crate) error: anyhow::Error,
    code: u8,
}

impl Failure {
    /// The exit code of a command line clap refused (as [`Failure::usage`]).
    pub(crate) fn usage_code() -> ExitCode {
        ExitCode::from(USAGE)
    }

    /// 64: the command line was wrong.
    pub(crate) fn usage(error: anyhow::Error) -> Self {
        Self { error, code: USAGE }
    }
    /// 65: a peer sent data that is not valid USB/IP.
    pub(crate) fn protocol(error: anyhow::Error) -> Self {
        Self { error, code: DATA }
    }
    /// 65: what the command was given names nothing, or cannot be used (a
    /// bus id with no device, a character with no key).
    pub(crate) fn data(error: anyhow::Error) -> Self {
        Self { error, code: DATA }
    }
    /// 69: the server (or device) is unreachable or refused.
    pub(crate) fn unavailable(error: anyhow::Error) -> Self {
        Self { error, code: UNAVAILABLE }
    }
    /// 71: the system lacks or refuses what the command needs (a listen
    /// address in use, a kernel module not loaded).
    pub(crate) fn os(error: anyhow::Error) -> Self {
        Self { error, code: OS }
    }
    /// 73: a file, directory or socket the command must make cannot be made.
    pub(crate) fn cannot_create(error: anyhow::Error) -> Self {
        Self { error, code: CANNOT_CREATE }
    }
    /// 75: try again later (every matching device in the lab registry is taken).
    pub(crate) fn temporary(error: anyhow::Error) -> Self {
        Self { error, code: TEMPORARY }
    }
    /// 77: not allowed: the server does not admit this client's identity,
    /// or the thing is another user's.
    pub(crate) fn not_admitted(error: anyhow::Error) -> Self {
        Self { error, code: PERMISSION }
    }
    /// 70: an internal error.
    pub(crate) fn software(error: anyhow::Error) -> Self {
        Self { error, code: SOFTWARE }
    }
    /// 74: a file or socket operation failed.
    pub(crate) fn io(error: anyhow::Error) -> Self {
        Self { error, code: IO }
    }
    /// 78: the configuration is wrong.
    pub(crate) fn config(error: anyhow::Error) -> Self {
        Self { error, code: CONFIG }
    }

    /// A directory of ours (`private_dir`) that cannot be used, `context`
    /// saying which: one that cannot be made is 73, like any file the
    /// command must make; one that is there but not safe (another user's,
    /// writable by others, a symbolic link) is the setup's fault, 78.
    pub(crate) fn private_dir(error: PrivateDirError, context: impl std::fmt::Display) -> Self {
        let code = private_dir_code(&error);
        Self { error: anyhow::Error::from(error).context(context.to_string()), code }
    }
    /// A Unix socket the command makes (a usbredir guest's, a device
    /// process's): its directory as [`Failure::private_dir`]; one a running
    /// program answers on is 71, as a listen address in use; failing to
    /// make it, 73.
    pub(crate) fn socket(error: SocketError, context: impl std::fmt::Display) -> Self {
        let code = socket_code(&error);
        Self { error: anyhow::Error::from(error).context(context.to_string()), code }
    }

    /// Not the command's failure: the reader of its standard output went
    /// away (`usbwire state | head -1`). `main` ends on it quietly, with 0
    /// and nothing on stderr, as `ls | head` does; see
    /// `commands::common::stdout`.
    pub(crate) fn closed_stdout() -> Self {
        Self { error: anyhow::anyhow!("standard output was closed"), code: CLOSED_STDOUT }
    }
    /// Whether this is [`Failure::closed_stdout`].
    pub(crate) fn is_closed_stdout(&self) -> bool {
        self.code == CLOSED_STDOUT
    }

    pub(crate) fn code(&self) -> ExitCode {
        ExitCode::from(self.code)
    }
}

/// The EXIT STATUS section of a man page, in roff, from [`EXIT_CODES`].
pub(crate) fn man_section() -> String {
    let mut roff = String::from(".SH \"EXIT STATUS\"\n.TP\n\\fB0\\fR\nsuccess\n");
    for (code, name, when) in EXIT_CODES {
        roff.push_str(&format!(".TP\n\\fB{code}\\fR\n{name}: {}\n", roff_text(when)));
    }
    roff
}

/// Text safe in a roff paragraph: backslashes doubled, no line starting with a control character.
fn roff_text(text: &str) -> String {
    let escaped = text.replace('\\', "\\\\");
    match escaped.chars().next() {
        Some('.' | '\'') => format!("\\&{escaped}"),
        _ => escaped,
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
            E::BadAddress { .. } => Self::usage(error.into()),
            E::Protocol(_) | E::WrongDevice { .. } => Self::protocol(error.into()),
            E::NotAdmitted { .. } | E::CertificateExpired { .. } => Self::not_admitted(error.into()),
            _ => Self::unavailable(error.into()),
        }
    }
}

/// What vhci-hcd's refusal means, the same for `attach`, `port`, `detach` and `client`.
impl From<usbwire_client::vhci::VhciError> for Failure {
    fn from(error: usbwire_client::vhci::VhciError) -> Self {
        use usbwire_client::vhci::VhciError as E;
        match error {
            E::NotLoaded => Self::os(error.into()),
            E::NoFreePort { .. } => Self::temporary(error.into()),
            E::PortNotInUse(_) => Self::data(error.into()),
            E::Permission { .. } => Self::not_admitted(error.into()),
            _ => Self::io(error.into()),
        }
    }
}

impl From<usbwire_bench::BenchError> for Failure {
    fn from(error: usbwire_bench::BenchError) -> Self {
        use usbwire_bench::BenchError as E;
        match error {
            E::Import(error) => error.into(),
            E::Unavailable(why) => Self::unavailable(anyhow::anyhow!(why)),
            E::Loopback(error) => Self::unavailable(error.into()),
            E::Io(error) => Self::io(error.into()),
            E::Internal(error) => Self::software(anyhow::Error::from_boxed(error)),
            _ => Self::software(error.into()),
        }
    }
}

/// See [`Failure::private_dir`].
fn private_dir_code(error: &PrivateDirError) -> u8 {
    match error {
        PrivateDirError::Io { .. } => CANNOT_CREATE,
        _ => CONFIG,
    }
}

/// See [`Failure::socket`].
fn socket_code(error: &SocketError) -> u8 {
    match error {
        SocketError::Dir { reason, .. } => private_dir_code(reason),
        SocketError::InUse { .. } => OS,
        _ => CANNOT_CREATE,
    }
}

impl From<usbwire_server::ServerError> for Failure {
    fn from(error: usbwire_server::ServerError) -> Self {
        use usbwire_server::ServerError as E;
        let code = match &error {
            E::Listen { .. } | E::Metrics { .. } | E::Threads(_) => OS,
            E::Control { .. } => CANNOT_CREATE,
            E::ControlDir { reason, .. } | E::CaptureDir(reason) => private_dir_code(reason),
            E::External { reason, .. } => socket_code(reason),
            _ => CONFIG,
        };
        Self { error: error.into(), code }
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

    /// The README's exit status table says what [`EXIT_CODES`] says, row for row.
    #[test]
    fn the_readme_table_is_the_exit_code_table() {
        let readme = include_str!("../../../README.md");
        let rows: Vec<&str> = readme.lines().filter(|line| line.starts_with("| `") && line.contains("` | ")).collect();
        let table: Vec<String> = std::iter::once("| `0` | success | |".to_owned())
            .chain(EXIT_CODES.iter().map(|(code, name, when)| format!("| `{code}` | {name} | {when} |")))
            .collect();
        for row in &table {
            assert!(rows.contains(&row.as_str()), "README.md lacks the row\n{row}");
        }
        let sysexits = [64, 65, 69, 70, 71, 73, 74, 75, 77, 78];
        assert_eq!(EXIT_CODES.iter().map(|(code, ..)| *code).collect::<Vec<_>>(), sysexits);
    }

    #[test]
    fn the_man_section_lists_every_code() {
        let roff = man_section();
        assert!(roff.starts_with(".SH \"EXIT STATUS\""), "{roff}");
        for (code, name, _) in EXIT_CODES {
            assert!(roff.contains(&format!(".TP\n\\fB{code}\\fR\n{name}: ")), "{code} missing: {roff}");
        }
    }
}
