//! One accepted TCP connection up to its OP phase: socket options, TLS or
//! plain (by the first byte, under the plain-connection policy), the TLS
//! handshake and the client's identity; then [`crate::op`] serves it.
//!
//! Until it has authenticated (TLS identity, or its plain OP request read) a
//! connection holds a place in the unauthenticated pool ([`crate::admission`]):
//! it can be evicted, each step has a short deadline, and its failures are
//! counted for a summary line instead of logged one by one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_rustls::rustls as rustls_config;
use tracing::{debug, info};
use usbwire_transport::access::ClientId;
use usbwire_transport::{PeerStream, TLS_HANDSHAKE_BYTE};

use crate::admission::{Dropped, Ticket};
use crate::config::{PlainPolicy, ServerConfig};
use crate::meter::ServerMeter;
use crate::peer::{Peer, PeerProbe};
use crate::state::ServerState;

pub(crate) async fn handle(
    tcp: TcpStream,
    peer: SocketAddr,
    state: Arc<ServerState>,
    stop: watch::Receiver<bool>,
    mut ticket: Ticket,
) {
    configure_socket(&tcp);
    let probe = PeerProbe::of(&tcp);
    let mut stopping = stop.clone();
    let secured = tokio::select! {
        secured = secure(tcp, peer, &state.config, &ticket, &state.meter) => secured,
        // Counted by the gate when it evicted us.
        () = ticket.evicted() => None,
        () = crate::shutdown::stopped(&mut stopping) => None,
    };
    let Some((stream, client)) = secured else {
        return;
    };
    // A TLS identity the handshake admitted has authenticated; a plain client once its request is read.
    if client != ClientId::Plain && !ticket.authenticate() {
        return;
    }
    crate::op::serve_session(stream, client, Peer { addr: peer, ticket, probe }, state, stop).await;
}

/// Tells TLS from plain USB/IP by the first byte, applies the plain-connection
/// policy, runs the TLS handshake and identifies the client. `None` means the
/// connection was refused (and logged) before anything was listed.
async fn secure(
    tcp: TcpStream,
    peer: SocketAddr,
    config: &ServerConfig,
    ticket: &Ticket,
    meter: &ServerMeter,
) -> Option<(PeerStream, ClientId)> {
    let security = &config.security;
    let limits = &config.admission;
    let mut first = [0u8; 1];
    match tokio::time::timeout(limits.first_byte_timeout, tcp.peek(&mut first)).await {
        Ok(Ok(1)) => {}
        Ok(_) => return None,
        Err(_) => {
            debug!("nothing received within {:?}; closing", limits.first_byte_timeout);
            ticket.dropped(Dropped::TimedOut);
            return None;
        }
    }
    if first[0] != TLS_HANDSHAKE_BYTE {
        let allowed = match (security.tls.is_some(), security.plain) {
            (false, _) | (true, PlainPolicy::Always) => true,
            (true, PlainPolicy::Loopback) => peer.ip().is_loopback(),
            (true, PlainPolicy::Never) => false,
        };
        if !allowed {
            debug!("plain USB/IP refused: this server requires TLS (connect with usbwire --tls)");
            ticket.dropped(Dropped::Failed);
            return None;
        }
        return Some((PeerStream::Plain(tcp), ClientId::Plain));
    }
    let Some(tls) = &security.tls else {
        debug!("TLS client, but this server has no TLS identity (start it with --tls)");
        ticket.dropped(Dropped::Failed);
        return None;
    };
    let (stream, leaf) =
        match tokio::time::timeout(limits.handshake_timeout, usbwire_transport::accept_tls(tcp, tls.clone())).await {
            Ok(Ok(accepted)) => accepted,
            Ok(Err(error)) => {
                // A refused identity was logged, with its fingerprint, when it was refused.
                let refused =
                    error.get_ref().and_then(|inner| inner.downcast_ref::<rustls_config::Error>()).is_some_and(|e| {
                        use rustls_config::CertificateError as Why;
                        matches!(
                            e,
                            rustls_config::Error::InvalidCertificate(
                                Why::ApplicationVerificationFailure | Why::Expired | Why::NotValidYet
                            )
                        )
                    });
                if refused {
                    debug!(%error, "TLS handshake ended: client refused");
                } else {
                    debug!(%error, "TLS handshake failed");
                }
                meter.tls_refused();
                ticket.dropped(Dropped::Failed);
                return None;
            }
            Err(_) => {
                debug!("TLS handshake not done within {:?}; closing", limits.handshake_timeout);
                ticket.dropped(Dropped::TimedOut);
                return None;
            }
        };
    // The handshake admitted it (tls::server_config); this names it.
    let client = security.admission.identify(&leaf?).ok()?;
    info!(%client, "TLS client authenticated");
    Some((stream, client))
}

/// TCP_NODELAY (48-byte headers must not wait for Nagle) and keepalive
/// (USB/IP has no heartbeat, and an interrupt URB may legitimately pend for hours).
fn configure_socket(stream: &TcpStream) {
    if let Err(error) = stream.set_nodelay(true) {
        debug!(%error, "TCP_NODELAY not set");
    }
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    if let Err(error) = socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive) {
        debug!(%error, "keepalive not set");
    }
}
