//! How a command reaches a server: the address from `HOST`, `HOST:PORT`
//! or `--tcp-port`, TLS and the client identity from the security flags,
//! and the transforms `--compress` and `--jitter-buffer` ask for.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use usbwire_client::TransformSpec;
use usbwire_client::{Security, TlsClient};
use usbwire_transport::known_servers::KnownServers;
use usbwire_transport::Identity;

use super::process::hostname;
use crate::args::ClientSecurityArgs;
use crate::exit::Failure;

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

/// `HOST`, `HOST:PORT`, `[V6]:PORT`, or `HOST` with `--tcp-port PORT` (a
/// bare IPv6 address too). A bad port, or a port given both ways, is a usage
/// error (64).
pub(crate) async fn resolve(remote: &str, tcp_port: Option<u16>) -> Result<std::net::SocketAddr, Failure> {
    Ok(usbwire_client::resolve_with_port(remote, tcp_port).await?)
}

/// The transforms `--compress` and `--jitter-buffer` ask for, in that order.
pub(crate) fn transforms(compress: Option<&str>, jitter_buffer_ms: Option<u64>) -> Vec<TransformSpec> {
    let mut specs = Vec::new();
    match compress {
        Some("zstd") => specs.push(TransformSpec::Zstd),
        Some("lz4") => specs.push(TransformSpec::Lz4),
        _ => {}
    }
    if let Some(ms) = jitter_buffer_ms {
        specs.push(TransformSpec::Jitter(Duration::from_millis(ms)));
    }
    specs
}
