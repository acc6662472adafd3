//! One module per verb; each takes its parsed arguments and does the work.

mod bench;
mod bench_lab;
mod demo;
mod describe;
mod docs;
mod doctor;
mod identity;
mod kernel;
mod lab;
mod list;
mod local;
mod output;
mod redir;
mod serve;
mod service;
mod udev;

use std::sync::Arc;

use anyhow::Context as _;
use usbwire_client::{Security, TlsClient};
use usbwire_transport::known_servers::KnownServers;
use usbwire_transport::Identity;

use crate::args::{ClientSecurityArgs, Command};
use crate::exit::Failure;

/// `-v` count, for commands whose output (not only their log) grows with it.
static VERBOSITY: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

pub(crate) fn set_verbosity(verbose: u8) {
    VERBOSITY.store(verbose, std::sync::atomic::Ordering::Relaxed);
}

pub(crate) fn verbosity() -> u8 {
    VERBOSITY.load(std::sync::atomic::Ordering::Relaxed)
}

pub(crate) async fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Serve(args) => serve::run(args).await,
        Command::List(args) => list::run(args).await,
        Command::Describe(args) => describe::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Attach(args) => kernel::attach(args).await,
        Command::Port(args) => kernel::port(args),
        Command::Detach(args) => kernel::detach(args),
        Command::Identity(args) => identity::run(args),
        Command::Type(args) => local::type_text(args).await,
        Command::State(args) => local::state(args).await,
        Command::Client(args) => service::run(args).await,
        Command::Doctor(args) => doctor::run(args).await,
        Command::Bind(args) => local::bind(args).await,
        Command::Unbind(args) => local::unbind(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Redir(args) => redir::run(args).await,
        Command::Capture(args) => local::capture(args).await,
        Command::Reserve(args) => lab::reserve(args).await,
        Command::Release(args) => lab::release(args).await,
        Command::Who(args) => lab::who(args).await,
        Command::UdevRules(args) => udev::run(args),
        Command::Completions(args) => docs::completions(args),
        Command::Man(args) => docs::man(args),
    }
}

/// Tells systemd (a `Type=notify` unit) that the service is up: `READY=1` on
/// `$NOTIFY_SOCKET`, a path or an abstract name (`@…`). Nothing without one.
pub(crate) fn notify_ready() {
    use std::os::linux::net::SocketAddrExt as _;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let target = target.to_string_lossy().into_owned();
    let addr = match target.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        None => SocketAddr::from_pathname(&target),
    };
    let sent = addr.and_then(|addr| UnixDatagram::unbound()?.send_to_addr(b"READY=1", &addr));
    if let Err(error) = sent {
        tracing::warn!(socket = %target, %error, "could not tell systemd the service is ready");
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

/// The client's transport, from `--tls`, `--identity` and `--trust-new`.
/// A client identity is created on first use (its fingerprint is what a
/// server's `--allow` needs).
pub(crate) fn client_security(args: &ClientSecurityArgs) -> Result<Security, Failure> {
    if !args.tls {
        return Ok(Security::Plain);
    }
    let (identity, dir) = client_identity(args.identity.as_deref())?;
    Ok(Security::Tls(Arc::new(TlsClient {
        identity,
        known: KnownServers::in_dir(&dir),
        trust_new: args.trust_new,
        pinned: None,
    })))
}

/// This client's TLS identity from `dir` (`--identity`, else the default
/// directory), created there on first use (and said so on stderr); with the
/// directory it came from.
pub(crate) fn client_identity(dir: Option<&std::path::Path>) -> Result<(Identity, std::path::PathBuf), Failure> {
    let dir = dir.map(std::path::Path::to_path_buf).unwrap_or_else(usbwire_transport::identity::default_dir);
    let (identity, created) = Identity::load_or_create(&dir, &hostname())
        .with_context(|| format!("identity in {}", dir.display()))
        .map_err(Failure::config)?;
    if created {
        eprintln!(
            "usbwire: created identity {} in {} (allow it on the server with --allow)",
            identity.fingerprint(),
            dir.display()
        );
    }
    Ok((identity, dir))
}

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "usbwire".into())
}
