//! `usbwire`: share USB devices over IP. A thin entry point: parse the
//! command line, set up logging, run the command, turn its error into an
//! exit code that means something.

#![warn(clippy::print_stdout)]

mod args;
mod commands;
mod config;
mod exit;
mod manual;
mod version;

use clap::FromArgMatches as _;

fn main() -> std::process::ExitCode {
    let parsed = args::command().try_get_matches().and_then(|matches| args::Cli::from_arg_matches(&matches));
    let cli = match parsed {
        Ok(cli) => cli,
        // --help and -V print and succeed; a bad command line exits 64 (EX_USAGE), as README says.
        Err(error) => {
            let _ = error.print();
            return if error.use_stderr() { exit::Failure::usage_code() } else { std::process::ExitCode::SUCCESS };
        }
    };
    let (verbose, quiet) = (cli.verbose, cli.quiet);
    let command = match cli.into_command() {
        Ok(command) => command,
        Err(usage) => {
            say(format_args!("{usage}"));
            return exit::Failure::usage_code();
        }
    };
    // Commands that print a report keep the in-process server's log quiet.
    let quiet = quiet || matches!(command, args::Command::Bench(_));
    init_logging(verbose, quiet);
    commands::set_verbosity(verbose);
    if let Some(code) = commands::before_runtime(&command) {
        return code;
    }
    let runtime = match runtime_for(&command).enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            say(format_args!("cannot start the async runtime: {error}"));
            return exit::Failure::software(error.into()).code();
        }
    };
    match runtime.block_on(commands::run(command)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader of stdout went away (`usbwire state | head -1`): nothing went wrong.
        Err(failure) if failure.is_closed_stdout() => std::process::ExitCode::SUCCESS,
        Err(failure) => {
            say(format_args!("{}", exit::describe(&failure.error)));
            failure.code()
        }
    }
}

/// `usbwire: TEXT` on stderr; nothing (and no panic, as `eprintln!` would) when stderr is closed.
fn say(text: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "usbwire: {text}");
}

/// `attach` is a relay: one future moving every URB between the kernel's
/// socket and the server's. On a single-threaded runtime the I/O driver wakes
/// it on its own thread; on a multi-threaded one every wake-up crosses threads,
/// and the relay moved 12–24 % less over TLS (BENCHMARKS.md, "The attach relay
/// on one thread"). Everything else, `serve` first, gets the multi-threaded runtime.
fn runtime_for(command: &args::Command) -> tokio::runtime::Builder {
    match command {
        args::Command::Attach(_) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    }
}

fn init_logging(verbose: u8, quiet: bool) {
    let default = match (quiet, verbose) {
        (true, _) => "warn",
        (false, 0) => "info",
        (false, 1) => "debug",
        (false, _) => "trace",
    };
    // RUST_LOG, when set, wins over -v.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("warn,usbwire={default},usbwire_server={default},usbwire_gadgets={default},usbwire_device={default},usbwire_client={default}")));
    use std::io::IsTerminal as _;
    if stderr_is_journal() {
        // journald stamps each line itself and reads the priority from a `<N>` prefix.
        let format = tracing_subscriber::fmt::format().without_time().with_ansi(false).with_target(verbose > 0);
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .event_format(SyslogPriority(format))
            .init();
        return;
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(verbose > 0)
        .init();
}

/// Whether stderr is the journal's stream: `$JOURNAL_STREAM` (`DEVICE:INODE`)
/// names it, as systemd sets it for a service's output.
fn stderr_is_journal() -> bool {
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else { return false };
    let Some((device, inode)) = stream.to_str().and_then(|s| s.split_once(':')) else { return false };
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat on descriptor 2 fills `stat` on success; it is read only then.
    if unsafe { libc::fstat(2, stat.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: fstat succeeded.
    let stat = unsafe { stat.assume_init() };
    device.parse() == Ok(stat.st_dev) && inode.parse() == Ok(stat.st_ino)
}

/// Puts the syslog priority journald understands (`<3>` error … `<7>` debug) before each line.
struct SyslogPriority<F>(F);

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for SyslogPriority<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        context: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let priority = match *event.metadata().level() {
            tracing::Level::ERROR => 3,
            tracing::Level::WARN => 4,
            tracing::Level::INFO => 6,
            _ => 7,
        };
        write!(writer, "<{priority}>")?;
        self.0.format_event(context, writer, event)
    }
}

#[cfg(test)]
mod tests {
    use clap::FromArgMatches as _;
    use tokio::runtime::RuntimeFlavor;

    fn flavor(line: &[&str]) -> RuntimeFlavor {
        let matches = crate::args::command().try_get_matches_from(line).unwrap();
        let cli = crate::args::Cli::from_arg_matches(&matches).unwrap();
        crate::runtime_for(&cli.command).enable_all().build().unwrap().handle().runtime_flavor()
    }

    #[test]
    fn the_attach_relay_runs_on_one_thread_and_the_server_on_several() {
        assert_eq!(flavor(&["usbwire", "attach", "-r", "127.0.0.1", "-b", "1-1"]), RuntimeFlavor::CurrentThread);
        assert_eq!(flavor(&["usbwire", "serve", "--virtual", "loopback"]), RuntimeFlavor::MultiThread);
    }
}
