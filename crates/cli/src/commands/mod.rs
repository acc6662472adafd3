//! One module per verb; each takes its parsed arguments and does the work.
//! What several verbs share is in [`common`]; a verb never uses another verb's module.

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
