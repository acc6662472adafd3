//! `attach` in the background: without `--foreground`, the relay runs in a
//! process of its own, forked before the async runtime exists, whose output
//! goes to the relay log once the device is attached. Not for the relay
//! itself (`relay`).

use std::io::Read as _;
use std::os::fd::{FromRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::OnceLock;

use anyhow::anyhow;
use usbwire_client::vhci;

use crate::args::AttachArgs;
use crate::exit::Failure;

/// Set in the forked relay process: the log its output goes to once attached.
static RELAY_LOG: OnceLock<PathBuf> = OnceLock::new();

/// Whether `args` call for a relay in a process of its own: a relay may be
/// needed (a reservation, following, resume, TLS, stream transforms) and the
/// command does not stay in the foreground (`--foreground`, `--auto-attach`).
pub(super) fn goes_to_background(args: &AttachArgs) -> bool {
    let following = args.follow || args.auto_attach;
    let transforms = crate::commands::common::peer::transforms(args.compress.as_deref(), args.jitter_buffer);
    let reserving = args.registry.registry.is_some() && args.device.is_some();
    let may_relay = reserving || following || !args.no_resume || args.security.tls || !transforms.is_empty();
    let foreground = args.foreground || args.auto_attach;
    may_relay && !foreground
}

/// The relay log, in the forked relay process only.
pub(super) fn relay_log() -> Option<&'static Path> {
    RELAY_LOG.get().map(PathBuf::as_path)
}

/// Before the runtime: for an `attach` that goes to the background, forks.
/// The child (its own session, so the terminal's signals do not reach it) returns
/// `None` and runs the attach, reporting on pipes; the parent waits for it to say the
/// device is attached, prints that and returns the exit code, leaving the relay
/// running until the port is detached. `None` at once for every other attach.
///
/// A fork rather than starting the binary again: one process start less before
/// the import (0.15 s under an emulated CPU). It must come before the runtime, while
/// the process has its one thread.
pub(crate) fn fork_if_backgrounded(args: &AttachArgs) -> Option<ExitCode> {
    if !goes_to_background(args) {
        return None;
    }
    match fork_relay() {
        Ok(Forked::Relay) => None,
        Ok(Forked::Parent { pid, said, errors }) => Some(report(pid, said, errors)),
        Err(failure) => {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "usbwire: {}", crate::exit::describe(&failure.error));
            Some(failure.code())
        }
    }
}

enum Forked {
    /// This is the relay process.
    Relay,
    /// The `attach` that started it: the relay's pid and the read ends of its stdout and stderr.
    Parent { pid: libc::pid_t, said: OwnedFd, errors: OwnedFd },
}

/// A pipe whose ends close on exec.
fn pipe() -> Result<(OwnedFd, OwnedFd), Failure> {
    let mut ends = [0; 2];
    // SAFETY: pipe2 writes two descriptors into `ends` on success.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Failure::software(anyhow!(
            "cannot make a pipe for the relay: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: both descriptors are new and ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) })
}

fn fork_relay() -> Result<Forked, Failure> {
    use std::io::Write as _;
    use std::os::fd::AsRawFd as _;
    let threads = std::fs::read_dir("/proc/self/task").map(|tasks| tasks.count()).unwrap_or(1);
    if threads != 1 {
        return Err(Failure::software(anyhow!("cannot fork the relay: the process already runs {threads} threads")));
    }
    let (said_read, said_write) = pipe()?;
    let (errors_read, errors_write) = pipe()?;
    let null =
        std::fs::File::open("/dev/null").map_err(|e| Failure::software(anyhow!("cannot open /dev/null: {e}")))?;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: the process has one thread (checked above, and no runtime exists yet), so
    // the child inherits no lock held by another thread.
    let pid = unsafe { libc::fork() };
    match pid {
        -1 => Err(Failure::software(anyhow!("cannot start the relay process: {}", std::io::Error::last_os_error()))),
        0 => {
            // SAFETY: setsid and dup2 on descriptors we own; 0, 1 and 2 stay valid throughout.
            unsafe {
                libc::setsid();
                libc::dup2(null.as_raw_fd(), 0);
                libc::dup2(said_write.as_raw_fd(), 1);
                libc::dup2(errors_write.as_raw_fd(), 2);
            }
            let _ = RELAY_LOG.set(Path::new(vhci::RECORD_DIR).join("usbwire-relay.log"));
            Ok(Forked::Relay)
        }
        pid => Ok(Forked::Parent { pid, said: said_read, errors: errors_read }),
    }
}

/// The parent's part: what the relay said; success once it says the device is
/// attached (the relay runs on), else the relay's own exit code after it ended.
fn report(pid: libc::pid_t, said: OwnedFd, errors: OwnedFd) -> ExitCode {
    use std::io::Write as _;
    // The relay closes its ends of both pipes once attached (or exits).
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::fs::File::from(errors).read_to_string(&mut text);
        text
    });
    let mut text = String::new();
    let _ = std::fs::File::from(said).read_to_string(&mut text);
    let _ = write!(std::io::stderr(), "{}", errors.join().unwrap_or_default());
    if text.contains("attached ") {
        let _ = write!(std::io::stdout(), "{text}");
        return ExitCode::SUCCESS;
    }
    let mut status = 0;
    // SAFETY: waitpid on our own child, writing its status into `status`.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    match waited == pid && libc::WIFEXITED(status) {
        true => ExitCode::from(u8::try_from(libc::WEXITSTATUS(status)).unwrap_or(70)),
        false => ExitCode::from(70),
    }
}

/// Points stdout and stderr at the relay log (the `attach` that started us
/// has read what it needed and stopped listening).
pub(super) fn detach_output(log: &Path) {
    use std::io::Write as _;
    use std::os::fd::AsRawFd as _;
    let _ = std::io::stdout().flush();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .or_else(|_| std::fs::OpenOptions::new().write(true).open("/dev/null"));
    if let Ok(file) = file {
        // SAFETY: dup2 on descriptors we own; stdout and stderr stay valid descriptors throughout.
        unsafe {
            libc::dup2(file.as_raw_fd(), 1);
            libc::dup2(file.as_raw_fd(), 2);
        }
    }
}
