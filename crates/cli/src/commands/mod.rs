//! One module per verb, or per family of verbs, each named for it; each verb
//! takes its parsed arguments and does the work. A family of more than one
//! file is a directory whose `mod.rs` holds its first verb or what its verbs
//! share: [`attach`] (attach, port, detach: vhci-hcd as the client),
//! [`local`] (type, state, bind, unbind, capture: the local server's control
//! socket), [`bench`] (bench, and its `--registry` run). Two families are one
//! file: [`lab`] (reserve, release, who) and [`docs`] (completions, man).
//! [`service`] is `usbwire client`, [`udev`] is `udev-rules`.
//!
//! What several verbs or families share is in [`common`]; a verb never uses
//! another verb's module. Not here: parsing the command line (`args`) and
//! library work, which belongs to the crates (the bench matrix is
//! `usbwire_bench::matrix`).

mod attach;
mod bench;
mod common;
mod demo;
mod describe;
mod docs;
mod doctor;
mod identity;
mod lab;
mod list;
mod local;
mod redir;
mod serve;
mod service;
mod udev;
mod version;

pub(crate) use common::process::set_verbosity;

use crate::args::Command;
use crate::exit::Failure;

/// What a command does before the async runtime exists, while the process has
/// one thread: `attach` forks its relay. `Some(code)` when the process is done.
pub(crate) fn before_runtime(command: &Command) -> Option<std::process::ExitCode> {
    match command {
        Command::Attach(args) => attach::fork_if_backgrounded(args),
        _ => None,
    }
}

pub(crate) async fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Serve(args) => serve::run(args).await,
        Command::List(args) => list::run(args).await,
        Command::Describe(args) => describe::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Attach(args) => attach::run(args).await,
        Command::Port(args) => attach::port::run(args),
        Command::Detach(args) => attach::detach::run(args),
        Command::Identity(args) => identity::run(args),
        Command::Type(args) => local::type_text::run(args).await,
        Command::State(args) => local::state::run(args).await,
        Command::Client(args) => service::run(args).await,
        Command::Doctor(args) => doctor::run(args).await,
        Command::Bind(args) => local::bind::run(args).await,
        Command::Unbind(args) => local::unbind::run(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Redir(args) => redir::run(args).await,
        Command::Capture(args) => local::capture::run(args).await,
        Command::Reserve(args) => lab::reserve(args).await,
        Command::Release(args) => lab::release(args).await,
        Command::Who(args) => lab::who(args).await,
        Command::UdevRules(args) => udev::run(args),
        Command::Completions(args) => docs::completions(args),
        Command::Man(args) => docs::man(args),
        Command::Version(args) => version::run(&args),
    }
}
