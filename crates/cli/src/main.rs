//! `usbwire`: share USB devices over IP. A thin entry point: parse the
//! command line, set up logging, run the command, turn its error into an
//! exit code that means something.

mod args;
mod commands;
mod config;
mod exit;

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    let cli = match args::Cli::try_parse() {
        Ok(cli) => cli,
        // --help and -V print and succeed; a bad command line exits 64 (EX_USAGE), as README says.
        Err(error) => {
            let _ = error.print();
            return if error.use_stderr() { exit::Failure::usage_code() } else { std::process::ExitCode::SUCCESS };
        }
    };
    // Commands that print a report keep the in-process server's log quiet.
    let quiet = cli.quiet || matches!(cli.command, args::Command::Bench(_));
    init_logging(cli.verbose, quiet);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("usbwire: cannot start the async runtime: {error}");
            return exit::Failure::software(error.into()).code();
        }
    };
    match runtime.block_on(commands::run(cli.command)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("usbwire: {}", exit::describe(&failure.error));
            failure.code()
        }
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
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(verbose > 0)
        .init();
}
