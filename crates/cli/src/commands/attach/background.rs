//! `attach` in the background: without `--foreground`, the relay runs in a
//! process of its own (the same command started again), whose output goes to
//! the relay log once the device is attached. Not for the relay itself (`relay`).

use anyhow::anyhow;
use usbwire_client::vhci;

use crate::commands::common::stdout::out;
use crate::exit::Failure;

/// Environment variable naming the relay log: set by `attach` for the
/// background process it starts, which detaches its output there once the
/// device is attached.
pub(super) const RELAY_LOG_ENV: &str = "USBWIRE_RELAY_LOG";

/// `attach` without `--foreground`: the same command runs again as a
/// background process (its own session, so the terminal's signals do not
/// reach it) and reports back on a pipe; once it says the device is attached
/// this returns, and the relay runs on until the port is detached.
pub(super) fn attach_in_background() -> Result<(), Failure> {
    use std::io::Read as _;
    use std::os::unix::process::CommandExt as _;
    let exe = std::env::current_exe().map_err(|e| Failure::software(e.into()))?;
    let log_path = std::path::Path::new(vhci::RECORD_DIR).join("usbwire-relay.log");
    let mut command = std::process::Command::new(exe);
    command
        .args(std::env::args_os().skip(1))
        .env(RELAY_LOG_ENV, &log_path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    // SAFETY: setsid is async-signal-safe and touches no memory of ours.
    unsafe {
        command.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|e| Failure::software(anyhow!("cannot start the relay process: {e}")))?;
    // The child closes its end of both pipes once attached (or exits).
    let errors = child.stderr.take().map(|mut err| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            text
        })
    });
    let mut said = String::new();
    let _ = child.stdout.take().map(|mut out| out.read_to_string(&mut said));
    if let Some(errors) = errors {
        eprint!("{}", errors.join().unwrap_or_default());
    }
    if said.contains("attached ") {
        return out!("{said}");
    }
    let status = child.wait().map_err(|e| Failure::software(e.into()))?;
    std::process::exit(status.code().unwrap_or(70));
}

/// Points stdout and stderr at the relay log (the `attach` that started us
/// has read what it needed and stopped listening).
pub(super) fn detach_output(log: &std::path::Path) {
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
