//! Reaching a server: name resolution, TCP (keepalive, no Nagle) and TLS with
//! the server key pinned, and turning an early hang-up or TLS alert into the
//! error that says why.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use usbwire_transport::known_servers::KnownServers;
use usbwire_transport::tls::ServerTrust;
use usbwire_transport::{Fingerprint, Identity, PeerStream};

use crate::error::OP_TIMEOUT;
use crate::ClientError;

/// Resolves `HOST`, `HOST:PORT`, `[V6]`, `[V6]:PORT` or a bare IPv6
/// literal (default port 3240). `localhost` is 127.0.0.1 without asking the
/// resolver (RFC 6761), so it works on a machine without `/etc/hosts` too.
pub async fn resolve(target: &str) -> Result<SocketAddr, ClientError> {
    resolve_with_port(target, None).await
}

/// [`resolve`], with the port given apart (`usbip --tcp-port`): it applies to
/// every form of host, IPv6 literals too, and conflicts with a port in
/// `target` (one of them would be silently ignored).
pub async fn resolve_with_port(target: &str, port: Option<u16>) -> Result<SocketAddr, ClientError> {
    let (host, named_port) = split_host_port(target)?;
    let port = match (named_port, port) {
        (Some(named), Some(given)) => {
            return Err(ClientError::BadAddress {
                text: target.to_owned(),
                reason: format!("it names port {named} and --tcp-port says {given}: give the port once"),
            })
        }
        (Some(port), None) | (None, Some(port)) => port,
        (None, None) => usbwire_proto::DEFAULT_PORT,
    };
    if is_localhost(host) {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    let connect_error = |source| ClientError::Connect { addr: target.to_owned(), source };
    let mut addrs = tokio::net::lookup_host((host, port)).await.map_err(connect_error)?;
    addrs.next().ok_or_else(|| connect_error(std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))
}

/// Splits `HOST`, `HOST:PORT`, `[V6]`, `[V6]:PORT` or a bare IPv6 literal
/// into the host (without brackets) and the port, if it names one. A port
/// that is not a number from 1 to 65535 is an error, not part of a host name.
pub fn split_host_port(target: &str) -> Result<(&str, Option<u16>), ClientError> {
    let bad = |reason: String| ClientError::BadAddress { text: target.to_owned(), reason };
    if let Some(rest) = target.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(|| bad("an IPv6 address in [ ] lacks its ]".into()))?;
        return match after {
            "" => Ok((host, None)),
            _ => match after.strip_prefix(':') {
                Some(port) => Ok((host, Some(parse_port(port).map_err(bad)?))),
                None => Err(bad(format!("{after:?} after the ] is not :PORT"))),
            },
        };
    }
    if target.parse::<std::net::Ipv6Addr>().is_ok() {
        return Ok((target, None));
    }
    let (host, port) = match target.rsplit_once(':') {
        Some((host, port)) => (host, Some(parse_port(port).map_err(bad)?)),
        None => (target, None),
    };
    if host.is_empty() {
        return Err(bad("no host".into()));
    }
    if host.contains(':') {
        return Err(bad("an IPv6 address with a port is written [ADDRESS]:PORT".into()));
    }
    Ok((host, port))
}

fn parse_port(text: &str) -> Result<u16, String> {
    match text.parse::<u32>() {
        Ok(port @ 1..=65535) => Ok(port as u16),
        _ => Err(format!("{text:?} is not a port (a number from 1 to 65535)")),
    }
}

/// Whether `host` is a localhost name, which always means this machine's
/// loopback (RFC 6761 §6.3): `localhost`, `localhost.`, `*.localhost`.
pub fn is_localhost(host: &str) -> bool {
    let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    host == "localhost" || host.ends_with(".localhost")
}

/// How to reach a server: plain USB/IP, or TLS 1.3 with our identity and the
/// server's pinned fingerprint.
#[derive(Clone, Default)]
pub enum Security {
    #[default]
    Plain,
    Tls(Arc<TlsClient>),
}

/// A client identity and where pinned server keys are kept.
#[derive(Debug)]
pub struct TlsClient {
    pub identity: Identity,
    pub known: KnownServers,
    /// Pin an unknown server's key on first use instead of refusing it.
    pub trust_new: bool,
    /// The server's key as a source the user trusts names it (the lab
    /// registry's entry for the server): only this key is accepted, whatever
    /// `known` pins for the address, and nothing is written to `known`.
    pub pinned: Option<Fingerprint>,
}

pub(crate) async fn connect(addr: SocketAddr, security: &Security) -> Result<PeerStream, ClientError> {
    let tcp = connect_tcp(addr).await?;
    let Security::Tls(tls) = security else {
        return Ok(PeerStream::Plain(tcp));
    };
    let key = addr.to_string();
    let pinned = tls.pinned.or_else(|| tls.known.lookup(&key));
    let trust = match (pinned, tls.trust_new) {
        (Some(fingerprint), _) => ServerTrust::Pinned(fingerprint),
        (None, true) => ServerTrust::FirstUse,
        (None, false) => ServerTrust::Unknown,
    };
    let (config, seen) = usbwire_transport::tls::client_config(&tls.identity, trust)
        .map_err(|e| ClientError::Tls { addr: key.clone(), reason: e.to_string() })?;
    let handshake = tokio::time::timeout(
        OP_TIMEOUT,
        usbwire_transport::connect_tls(tcp, config, usbwire_transport::tls::server_name()),
    );
    let stream = match handshake.await {
        Err(_) => return Err(ClientError::Timeout { addr: key }),
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => {
            let got = seen.fingerprint();
            return Err(match (pinned, got) {
                (Some(expected), Some(got)) if expected != got && tls.pinned.is_some() => {
                    ClientError::NotTheRegisteredKey { addr: key, expected: expected.to_string(), got: got.to_string() }
                }
                (Some(expected), Some(got)) if expected != got => ClientError::ServerKeyChanged {
                    addr: key,
                    expected: expected.to_string(),
                    got: got.to_string(),
                    known: tls.known.path().to_path_buf(),
                },
                (None, Some(got)) if !tls.trust_new => ClientError::UnknownServer {
                    addr: key,
                    fingerprint: got.to_string(),
                    known: tls.known.path().to_path_buf(),
                },
                _ => ClientError::Tls { addr: key, reason: error.to_string() },
            });
        }
    };
    if pinned.is_none() {
        if let Some(fingerprint) = seen.fingerprint() {
            pin(&tls.known, &key, fingerprint)?;
        }
    }
    Ok(stream)
}

fn pin(known: &KnownServers, key: &str, fingerprint: Fingerprint) -> Result<(), ClientError> {
    known.add(key, fingerprint)?;
    tracing::info!(server = key, %fingerprint, file = %known.path().display(), "pinned the server's key (trust on first use)");
    Ok(())
}

async fn connect_tcp(addr: SocketAddr) -> Result<TcpStream, ClientError> {
    let stream = tokio::time::timeout(OP_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| ClientError::Timeout { addr: addr.to_string() })?
        .map_err(|source| ClientError::Connect { addr: addr.to_string(), source })?;
    stream.set_nodelay(true)?;
    let keepalive =
        socket2::TcpKeepalive::new().with_time(Duration::from_secs(30)).with_interval(Duration::from_secs(10));
    let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
    Ok(stream)
}

/// How a server turns a client away during the OP phase, in the user's terms:
/// a TLS alert refusing our identity (TLS 1.3 finishes the client's side of the
/// handshake before the server has checked its certificate, so the alert comes
/// with the first reply), or a hang-up (a refused plain client, or TLS required)
/// rather than "connection reset".
pub(crate) fn closed_early(error: ClientError, addr: SocketAddr, security: &Security) -> ClientError {
    use tokio_rustls::rustls;
    let ClientError::Io(io) = error else { return error };
    let alert = io.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()).and_then(|e| match e {
        rustls::Error::AlertReceived(alert) => Some(*alert),
        _ => None,
    });
    match (alert, security) {
        (Some(rustls::AlertDescription::AccessDenied), Security::Tls(tls)) => {
            return ClientError::NotAdmitted {
                addr: addr.to_string(),
                fingerprint: tls.identity.fingerprint().to_string(),
                issued_by: tls.identity.issued_by().map(|(ca, name)| (ca.to_owned(), name.to_owned())),
            }
        }
        (Some(rustls::AlertDescription::CertificateExpired), _) => {
            return ClientError::CertificateExpired { addr: addr.to_string() }
        }
        (Some(alert), _) => {
            return ClientError::Tls { addr: addr.to_string(), reason: format!("the server sent the alert {alert:?}") }
        }
        (None, _) => {}
    }
    match io.kind() {
        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::BrokenPipe => {
            ClientError::ClosedWithoutAnswer { addr: addr.to_string() }
        }
        _ => ClientError::Io(io),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_is_recognised_but_a_bare_v6_address_is_not_one() {
        let split = |text| split_host_port(text).map_err(|error| error.to_string());
        assert_eq!(split("host:3240"), Ok(("host", Some(3240))));
        assert_eq!(split("host"), Ok(("host", None)));
        assert_eq!(split("::1"), Ok(("::1", None)));
        assert_eq!(split("[::1]"), Ok(("::1", None)));
        assert_eq!(split("[fe80::1]:4000"), Ok(("fe80::1", Some(4000))));
        assert_eq!(split("10.0.0.5:65535"), Ok(("10.0.0.5", Some(65535))));
        for bad in ["127.0.0.1:99999", "127.0.0.1:0", "host:http", "[::1]:x", "[::1", "[::1]4000", ":3240", "::1:3240x"]
        {
            let error = split(bad).expect_err(bad);
            assert!(error.starts_with(&format!("{bad:?} is not a server address")), "{error}");
        }
        assert!(split("127.0.0.1:99999").unwrap_err().contains("\"99999\" is not a port (a number from 1 to 65535)"));
    }

    /// `list -r ::1 --tcp-port N` dialled 3240: the port was dropped for any host with a colon.
    #[tokio::test]
    async fn the_separate_port_applies_to_ipv6_hosts_and_conflicts_with_a_named_one() {
        assert_eq!(resolve_with_port("::1", Some(4000)).await.unwrap(), "[::1]:4000".parse().unwrap());
        assert_eq!(resolve_with_port("[::1]", Some(4000)).await.unwrap(), "[::1]:4000".parse().unwrap());
        assert_eq!(resolve_with_port("127.0.0.1", Some(4000)).await.unwrap(), "127.0.0.1:4000".parse().unwrap());
        assert_eq!(resolve("::1").await.unwrap(), "[::1]:3240".parse().unwrap());
        for named in ["127.0.0.1:3240", "[::1]:3240", "localhost:4000"] {
            let error = resolve_with_port(named, Some(4000)).await.unwrap_err();
            assert!(matches!(error, ClientError::BadAddress { .. }), "{named}: {error}");
            assert!(error.to_string().contains("give the port once"), "{error}");
        }
    }

    #[tokio::test]
    async fn localhost_is_loopback_without_the_resolver() {
        assert!(is_localhost("localhost") && is_localhost("LOCALHOST.") && is_localhost("lab.localhost"));
        assert!(!is_localhost("localhost.example") && !is_localhost("mylocalhost"));
        assert_eq!(resolve("localhost").await.unwrap(), "127.0.0.1:3240".parse().unwrap());
        assert_eq!(resolve("localhost:4000").await.unwrap(), "127.0.0.1:4000".parse().unwrap());
    }
}
