//! One module per verb; each takes its parsed arguments and does the work.

mod demo;
mod describe;
mod kernel;
mod list;
mod local;
mod serve;

use crate::args::Command;
use crate::exit::Failure;

pub(crate) async fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Serve(args) => serve::run(args).await,
        Command::List(args) => list::run(args).await,
        Command::Describe(args) => describe::run(args).await,
        Command::Attach(args) => kernel::attach(args).await,
        Command::Port(args) => kernel::port(args),
        Command::Detach(args) => kernel::detach(args),
        Command::Type(args) => local::type_text(args).await,
        Command::State(args) => local::state(args).await,
        Command::Demo(args) => demo::run(args).await,
    }
}

/// Resolves when the process gets SIGINT or SIGTERM. The handlers are
/// installed when this is called (not when first polled), so call it before
/// announcing that the server is up.
pub(crate) fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let terminate = signal(SignalKind::terminate());
    let interrupt = signal(SignalKind::interrupt());
    async move {
        match (terminate, interrupt) {
            (Ok(mut terminate), Ok(mut interrupt)) => {
                tokio::select! {
                    _ = terminate.recv() => {}
                    _ = interrupt.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}
