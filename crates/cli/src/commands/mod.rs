//! One module per verb; each takes its parsed arguments and does the work.

mod demo;
mod list;
mod local;
mod serve;

use crate::args::Command;
use crate::exit::Failure;

pub(crate) async fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Serve(args) => serve::run(args).await,
        Command::List(args) => list::run(args).await,
        Command::Type(args) => local::type_text(args).await,
        Command::State(args) => local::state(args).await,
        Command::Demo(args) => demo::run(args).await,
    }
}

/// Resolves when the process gets SIGINT or SIGTERM.
pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut terminate = match signal(SignalKind::terminate()) {
        Ok(stream) => stream,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
}
