//! The process around a command: systemd readiness, shutdown signals, the
//! host name, and how verbose printed output is.

/// `-v` count, for commands whose output (not only their log) grows with it.
static VERBOSITY: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

pub(crate) fn set_verbosity(verbose: u8) {
    VERBOSITY.store(verbose, std::sync::atomic::Ordering::Relaxed);
}

pub(crate) fn verbosity() -> u8 {
    VERBOSITY.load(std::sync::atomic::Ordering::Relaxed)
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

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "usbwire".into())
}
