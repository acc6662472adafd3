//! Standard output, for every verb: what a verb prints goes through here,
//! never through `println!`, which panics ("failed printing to stdout:
//! Broken pipe", exit 101, a backtrace) once the reader has gone, as in
//! `usbwire state | head -1`.
//!
//! Two kinds of verb, two ways to print:
//!
//! - [`outln!`] and [`out!`] (and [`write_bytes`]) for a **report**, the
//!   output a verb runs for. Each returns `Result<(), Failure>`: pass it up
//!   with `?`. A write that finds the reader gone is
//!   [`Failure::closed_stdout`], which `main` ends as a quiet exit 0 (as
//!   `ls | head` does), the verb's destructors having run on the way up; any
//!   other write error (a full disk under `> file`) is `Failure::io` (74).
//!   Used by state, list (`--watch` too), describe, port, detach, version,
//!   completions, man, udev-rules, identity, doctor, bench's tables, who,
//!   `reserve --for`, release, and the confirmations of bind, unbind,
//!   capture and of an `attach` that ends once attached (kernel socket, or
//!   the background relay's parent).
//! - [`status_line!`] and [`status!`] for a **service**'s status lines,
//!   which no one has to read: the service goes on when its stdout is
//!   closed, and a write error of any kind is dropped (what matters is in
//!   the log, on stderr). Used by serve, demo, client, redir, the relay of
//!   `attach` once attached (foreground, or the background process whose
//!   stdout is its parent's pipe), and `reserve` without `--for`, which
//!   holds its reservation until stopped: a closed stdout must not take
//!   down what they serve or hold.
//!
//! In a verb's module: `use super::common::stdout::{out, outln};` (in a
//! family's directory, `use crate::commands::common::stdout::…`), then
//! `outln!("...", ...)?` as `println!` was used.
//!
//! Not for stderr (the log, warnings and errors go through `tracing` and
//! `eprintln!`), nor for files a verb writes.

use std::io::Write as _;

use crate::exit::Failure;

/// Prints a line of a report: `outln!("{busid} ready")?`. See the module docs.
macro_rules! outln {
    () => {
        $crate::commands::common::stdout::write_fmt(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::commands::common::stdout::write_fmt(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Prints part of a report, no newline added: `out!("{table}")?`. See the module docs.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::commands::common::stdout::write_fmt(format_args!($($arg)*))
    };
}

/// Prints a service's status line, best effort: nothing to handle. See the module docs.
macro_rules! status_line {
    () => {
        $crate::commands::common::stdout::status_fmt(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::commands::common::stdout::status_fmt(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Prints part of a service's status, no newline added, best effort. See the module docs.
macro_rules! status {
    ($($arg:tt)*) => {
        $crate::commands::common::stdout::status_fmt(format_args!($($arg)*))
    };
}

pub(crate) use {out, outln, status, status_line};

/// Writes formatted text to stdout and flushes it (what [`out!`] and [`outln!`] do).
pub(crate) fn write_fmt(text: std::fmt::Arguments<'_>) -> Result<(), Failure> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_fmt(text).and_then(|()| stdout.flush()).map_err(failure)
}

/// Writes bytes to stdout and flushes them: a report made elsewhere (a completion script).
pub(crate) fn write_bytes(bytes: &[u8]) -> Result<(), Failure> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(bytes).and_then(|()| stdout.flush()).map_err(failure)
}

/// Writes a status line (what [`status_line!`] does), dropping any error.
pub(crate) fn status_fmt(text: std::fmt::Arguments<'_>) {
    let _ = write_fmt(text);
}

/// The failure a write to stdout ends the command with.
fn failure(error: std::io::Error) -> Failure {
    if error.kind() == std::io::ErrorKind::BrokenPipe {
        Failure::closed_stdout()
    } else {
        Failure::io(anyhow::Error::new(error).context("cannot write to standard output"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_reader_is_a_quiet_end_and_any_other_error_is_io() {
        assert!(failure(std::io::ErrorKind::BrokenPipe.into()).is_closed_stdout());
        let full = failure(std::io::Error::from_raw_os_error(libc::ENOSPC));
        assert!(!full.is_closed_stdout());
        assert_eq!(full.code(), std::process::ExitCode::from(74));
        assert!(crate::exit::describe(&full.error).starts_with("cannot write to standard output: "));
    }
}
