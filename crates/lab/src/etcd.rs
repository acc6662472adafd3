//! The etcd connection both sides use: endpoints, TLS, timeouts, and the
//! lease keep-alive loop that survives a member going away.

use std::path::PathBuf;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions, TlsOptions};
use tokio::time::Instant;
use tracing::debug;

use crate::url::RegistryUrl;
use crate::LabError;

/// How long one etcd request may take before the registry counts as unreachable.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long to wait for one member of several before trying the next.
const MEMBER_TIMEOUT: Duration = Duration::from_secs(2);
/// The lease time-to-live a server registers under and a client holds a reservation by.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

/// TLS towards etcd (`--registry-ca/--registry-cert/--registry-key`, or the
/// config's `[registry]`): the CA that signed the members' certificates, and
/// a client certificate when the cluster requires one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// Where the registry is and how to reach it.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub url: RegistryUrl,
    pub tls: Option<EtcdTls>,
}

impl Endpoint {
    pub fn plain(url: RegistryUrl) -> Self {
        Self { url, tls: None }
    }

    /// A client for the registry, through the first member that answers a
    /// request (tried in random order, so clients spread over the members).
    /// Each member serves the whole cluster; one client per member, because
    /// a client balancing over several sends requests to a member that is
    /// down as readily as to one that is up.
    pub(crate) async fn connect(&self) -> Result<Client, LabError> {
        use rand::seq::SliceRandom as _;
        let mut urls = self.url.endpoint_urls(self.tls.is_some());
        urls.shuffle(&mut rand::thread_rng());
        // Several members: do not wait long on one that does not answer.
        let timeout = if urls.len() > 1 { MEMBER_TIMEOUT } else { REQUEST_TIMEOUT };
        let mut failures = Vec::new();
        for url in urls {
            match self.connect_to(&url, timeout).await {
                Ok(client) => {
                    debug!(member = %url, "using etcd member");
                    return Ok(client);
                }
                Err(reason) => {
                    debug!(member = %url, %reason, "etcd member did not answer");
                    failures.push(format!("{url}: {reason}"));
                }
            }
        }
        Err(LabError::Unreachable { url: self.url.to_string(), reason: failures.join("; "), tls: self.tls.is_some() })
    }

    async fn connect_to(&self, url: &str, timeout: Duration) -> Result<Client, String> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(5));
        if let Some(tls) = &self.tls {
            options = options.with_tls(tls_options(tls).map_err(|e| format!("TLS files: {e}"))?);
        }
        let connecting = Client::connect([url], Some(options));
        let mut client = tokio::time::timeout(timeout, connecting)
            .await
            .map_err(|_| format!("no answer within {timeout:?}"))?
            .map_err(|e| short(&e))?;
        let probe = client.get(self.url.prefix.as_bytes(), Some(GetOptions::new().with_count_only()));
        tokio::time::timeout(timeout, probe)
            .await
            .map_err(|_| format!("no answer within {timeout:?}"))?
            .map_err(|e| short(&e))?;
        Ok(client)
    }
}

/// An etcd client error in a few words: tonic's carry their whole source
/// chain in their text; the status message and the innermost cause say it.
fn short(error: &etcd_client::Error) -> String {
    let etcd_client::Error::GRpcStatus(status) = error else { return error.to_string() };
    let mut innermost = None;
    let mut cause = std::error::Error::source(status);
    while let Some(error) = cause {
        innermost = Some(error.to_string());
        cause = error.source();
    }
    match innermost {
        Some(inner) if !status.message().contains(&inner) => format!("{} ({inner})", status.message()),
        _ => status.message().to_owned(),
    }
}

fn tls_options(tls: &EtcdTls) -> std::io::Result<TlsOptions> {
    let mut options = TlsOptions::new();
    if let Some(ca) = &tls.ca {
        options = options.ca_certificate(etcd_client::Certificate::from_pem(std::fs::read(ca)?));
    }
    match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => {
            options = options.identity(etcd_client::Identity::from_pem(std::fs::read(cert)?, std::fs::read(key)?));
        }
        (None, None) => {}
        _ => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a client certificate for etcd needs both cert and key",
            ))
        }
    }
    Ok(options)
}

/// Keeps `lease` alive until it is lost: renewed every third of `ttl`; when
/// the member we renew through goes away, the renewal is set up again
/// through another, until the lease would have expired. Returns why it was lost.
pub(crate) async fn keep_alive(endpoint: Endpoint, mut client: Client, lease: i64, ttl: Duration) -> LabError {
    let every = (ttl / 3).max(Duration::from_millis(500));
    let mut renewed = Instant::now();
    loop {
        let expires = renewed + ttl;
        let stream = tokio::time::timeout(REQUEST_TIMEOUT, client.lease_keep_alive(lease)).await;
        let (mut keeper, mut answers) = match stream {
            Ok(Ok(pair)) => pair,
            Ok(Err(error)) => {
                debug!(lease, error = %short(&error), "lease renewal not set up; trying another member");
                if Instant::now() >= expires {
                    return LabError::LeaseLost { lease, reason: short(&error) };
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                if let Ok(other) = endpoint.connect().await {
                    client = other;
                }
                continue;
            }
            Err(_) => {
                if Instant::now() >= expires {
                    return LabError::LeaseLost { lease, reason: "etcd did not answer".into() };
                }
                if let Ok(other) = endpoint.connect().await {
                    client = other;
                }
                continue;
            }
        };
        // Setting the renewal up sent the first request: its answer, then one every third of the ttl.
        loop {
            match tokio::time::timeout(REQUEST_TIMEOUT.min(ttl), answers.message()).await {
                Ok(Ok(Some(answer))) if answer.ttl() > 0 => renewed = Instant::now(),
                Ok(Ok(Some(_))) => {
                    return LabError::LeaseLost { lease, reason: "etcd says the lease has expired".into() };
                }
                Ok(Ok(None)) | Ok(Err(_)) | Err(_) => break,
            }
            tokio::time::sleep(every).await;
            if let Err(error) = keeper.keep_alive().await {
                debug!(lease, error = %short(&error), "lease renewal failed");
                break;
            }
        }
        if Instant::now() >= renewed + ttl {
            return LabError::LeaseLost { lease, reason: "not renewed within its time to live".into() };
        }
    }
}
