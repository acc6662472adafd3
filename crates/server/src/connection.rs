//! One client connection: the OP phase, then (after an import) the URB phase.
//!
//! Like usbipd, a connection carries exactly one OP request. A device list is
//! answered and the connection closed; a failed import gets its status and is
//! closed; a successful import turns the socket into the device's URB channel.
//!
//! Until it has authenticated (TLS identity, or its plain OP request read) a
//! connection holds a place in the unauthenticated pool ([`crate::admission`]):
//! it can be evicted, each step has a short deadline, and its failures are
//! counted for a summary line instead of logged one by one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_rustls::rustls as rustls_config;
use tracing::{debug, info, warn, Instrument};
use usbwire_proto::liveness;
use usbwire_proto::op::{self, DeviceRecord, OpRequest, OpStatus};
use usbwire_proto::reservation::ReservationToken;
use usbwire_proto::resume::{self, Grant, Token};
use usbwire_proto::{DecodeError, Limits};
use usbwire_transport::access::ClientId;
use usbwire_transport::transform::{Pipeline, Side, TransformSpec, TransformedStream};
use usbwire_transport::{PeerStream, TLS_HANDSHAKE_BYTE};

use crate::admission::{Dropped, Ticket};
use crate::config::{PlainPolicy, ServerConfig};
use crate::meter::ServerMeter;
use crate::peer::{Peer, PeerProbe};
use crate::registry::Importer;
use crate::resumable::Handover;
use crate::state::ServerState;
use crate::urb_channel;

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
    serve_session(stream, client, Peer { addr: peer, ticket, probe }, state, stop).await;
}

/// Everything after the transport is settled and the client named: the OP phase
/// (with the transform negotiation), then the URB phase of an import.
pub(crate) async fn serve_session(
    mut stream: PeerStream,
    client: ClientId,
    mut peer: Peer,
    state: Arc<ServerState>,
    stop: watch::Receiver<bool>,
) {
    let (config, registry) = (&state.config, &state.registry);
    let visible =
        |kind: &str, device: &DeviceRecord, serial: &str| config.security.may_use(&client, kind, device, serial);
    let mut buf = BytesMut::with_capacity(256);
    let Some(mut request) = next_request(&mut stream, &mut buf, config, &peer.ticket).await else { return };
    // Set when the client asked for resume and we granted it: names the session an import starts.
    let mut resume_token = None;
    // The lab registry reservation the client says it holds.
    let mut reservation = None;
    if let OpRequest::Transforms { offer } = &request {
        reservation = ReservationToken::from_offer(offer);
        // Our extension: agree on transforms, then the real request comes framed.
        let specs = TransformSpec::parse_list(offer);
        let accepted = TransformSpec::list_text(&specs);
        let mut answer = accepted.clone();
        if resume::offered(offer) && !config.resume_grace.is_zero() {
            let token = Token(rand::random());
            if !answer.is_empty() {
                answer.push(',');
            }
            answer.push_str(&token.answer_entry());
            // Keep-alive goes with resume: a link gone silent is noticed in seconds and resumed.
            let keepalive = liveness::offered(offer);
            if keepalive {
                answer.push(',');
                answer.push_str(liveness::OFFER);
            }
            // What our table takes: the client sends no more, so we always read its acknowledgements.
            let in_flight = (config.budget.in_flight_urbs, config.budget.in_flight_bytes);
            answer.push(',');
            answer.push_str(&resume::in_flight_entry(in_flight.0, in_flight.1));
            resume_token = Some(Grant { token, keepalive, in_flight: Some(in_flight) });
        }
        let mut reply = BytesMut::new();
        op::encode_transforms_reply(&answer, &mut reply);
        if stream.write_all(&reply).await.is_err() || stream.flush().await.is_err() {
            return;
        }
        if !buf.is_empty() {
            warn!("client sent more before the transform answer; closing");
            return;
        }
        info!(
            // The reservation token is a secret: logged without it.
            offered = %match &reservation {
                Some(token) => offer.replace(&token.hex(), "…"),
                None => offer.clone(),
            },
            accepted = %accepted,
            resume = resume_token.is_some(),
            reservation = reservation.is_some(),
            "stream transforms"
        );
        if !specs.is_empty() {
            stream = PeerStream::Transformed(Box::new(
                TransformedStream::new(stream, Pipeline::new(&specs, Side::Server))
                    .with_decoded_budget(config.budget.decoded_bytes),
            ));
        }
        let Some(next) = next_request(&mut stream, &mut buf, config, &peer.ticket).await else { return };
        request = next;
    }
    if !peer.ticket.authenticate() {
        return;
    }
    let mut reply = BytesMut::new();
    match request {
        OpRequest::DevList => {
            let devices = registry.devlist(visible);
            op::encode_devlist_reply(&devices, &mut reply);
            debug!(devices = devices.len(), "device list");
            if let Err(error) = async {
                stream.write_all(&reply).await?;
                stream.flush().await
            }
            .await
            {
                debug!(%error, "device list not delivered");
            }
        }
        OpRequest::ImportMalformedBusId { requested } => {
            info!(busid = %requested.escape_ascii(), %client, "import refused: not a bus id");
            op::encode_import_reply(Err(OpStatus::NODEV), &mut reply);
            let _ = async {
                stream.write_all(&reply).await?;
                stream.flush().await
            }
            .await;
        }
        OpRequest::Transforms { .. } => warn!("transforms offered twice; closing"),
        OpRequest::Resume { token, replies_received } => {
            // The parked session answers and carries on with this connection.
            let peer_addr = peer.addr.ip();
            let arrival = Handover { stream, leftover: buf, replies_received, peer };
            let owner = crate::resumable::Owner::new(client.clone(), peer_addr);
            if let Err((refused, mut stream)) = state.parked.hand_over(&token, &owner, arrival) {
                info!(?token, %client, reason = %refused, "resume refused");
                op::encode_resume_reply(Err(OpStatus::NODEV), &mut reply);
                let _ = async {
                    stream.write_all(&reply).await?;
                    stream.flush().await
                }
                .await;
            }
        }
        OpRequest::DevState => {
            let devices = crate::devstate::entries(registry, visible);
            let body = serde_json::to_vec(&serde_json::json!({ "devices": devices })).unwrap_or_default();
            op::encode_devstate_reply(&body, &mut reply);
            debug!(devices = devices.len(), "device state");
            let _ = async {
                stream.write_all(&reply).await?;
                stream.flush().await
            }
            .await;
        }
        OpRequest::Import { busid } => {
            let importer = Importer { client: peer.addr, identity: identity(&client), probe: peer.probe, reservation };
            match registry.import(&busid, importer, visible, config.admission.release_wait).await {
                Err(refused) => {
                    info!(%busid, %client, reason = %refused, "import refused");
                    op::encode_import_reply(Err(refused.status()), &mut reply);
                    let _ = async {
                        stream.write_all(&reply).await?;
                        stream.flush().await
                    }
                    .await;
                }
                Ok(mut lease) => {
                    op::encode_import_reply(Ok(lease.record()), &mut reply);
                    if let Err(error) = async {
                        stream.write_all(&reply).await?;
                        stream.flush().await
                    }
                    .await
                    {
                        warn!(%busid, %error, "import reply not delivered");
                        lease.release().await;
                        return;
                    }
                    let span =
                        tracing::info_span!("urb", %busid, devid = format_args!("{:#x}", lease.record().devid()));
                    span.in_scope(|| info!("imported"));
                    let mut withdrawn = lease.withdrawn();
                    let resumable = resume_token.map(|Grant { token, keepalive, .. }| urb_channel::Resumable {
                        token,
                        keepalive,
                        client: crate::resumable::Owner::new(client.clone(), peer.addr.ip()),
                        parked: state.parked.clone(),
                        grace: config.resume_grace,
                    });
                    let channel = urb_channel::run(stream, buf, &mut lease, &state, stop, resumable, peer.addr)
                        .instrument(span.clone());
                    let outcome = tokio::select! {
                        outcome = channel => outcome,
                        _ = withdrawn.wait_for(|withdrawn| *withdrawn) => Ok(urb_channel::End::Withdrawn),
                    };
                    let _enter = span.enter();
                    match outcome {
                        Ok(urb_channel::End::ClientClosed | urb_channel::End::ClientEnded) => {
                            info!("client disconnected")
                        }
                        Ok(urb_channel::End::Shutdown) => info!("closed for server shutdown"),
                        Ok(urb_channel::End::DeviceGone) => info!("device unplugged; connection closed"),
                        Ok(urb_channel::End::Withdrawn) => info!("device unbound; connection closed"),
                        Err(error) => warn!(%error, "connection closed"),
                    }
                    drop(_enter);
                    // Resets the device (on a blocking thread) and makes it available again.
                    lease.release().await;
                }
            }
        }
    }
}

/// What `usbwire state` shows as the importer's identity.
fn identity(client: &ClientId) -> Option<String> {
    match client {
        ClientId::Certificate(fingerprint) => Some(fingerprint.to_string()),
        ClientId::CaIssued { .. } => Some(client.to_string()),
        ClientId::Plain => None,
    }
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
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.clone());
    let stream =
        match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(usbwire_transport::tls_socket(tcp))).await
        {
            Ok(Ok(stream)) => stream,
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
    let leaf = stream.get_ref().1.peer_certificates().and_then(|certs| certs.first())?;
    let client = security.admission.identify(leaf).ok()?;
    info!(%client, "TLS client authenticated");
    Some((PeerStream::ServerTls(Box::new(stream)), client))
}

/// The next OP request, or `None` (logged, or counted while unauthenticated)
/// when the client sent garbage, went quiet, hung up or was evicted.
async fn next_request(
    stream: &mut PeerStream,
    buf: &mut BytesMut,
    config: &ServerConfig,
    ticket: &Ticket,
) -> Option<OpRequest> {
    let deadline = config.admission.request_timeout;
    let read = tokio::time::timeout(deadline, read_request(stream, buf, &config.limits));
    let outcome = tokio::select! {
        outcome = read => outcome,
        () = ticket.evicted() => return None,
    };
    match outcome {
        Err(_) => {
            if !ticket.dropped(Dropped::TimedOut) {
                warn!("no request within {deadline:?}; closing");
            }
            None
        }
        Ok(Err(error)) => {
            if ticket.dropped(Dropped::Failed) {
                debug!(%error, "invalid request; closing");
            } else {
                warn!(%error, "invalid request; closing");
            }
            None
        }
        Ok(Ok(None)) => {
            debug!("closed before sending a request");
            None
        }
        Ok(Ok(Some(request))) => Some(request),
    }
}

async fn read_request(
    stream: &mut PeerStream,
    buf: &mut BytesMut,
    limits: &Limits,
) -> Result<Option<OpRequest>, DecodeError> {
    loop {
        if let Some(request) = op::decode_request(buf, limits)? {
            return Ok(Some(request));
        }
        match stream.read_buf(buf).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(_) => {}
        }
    }
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
