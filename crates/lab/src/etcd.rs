//! The etcd connection both sides use: endpoints, TLS, timeouts, and the
//! lease keep-alive loop that survives a member going away.

use std::path::PathBuf;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions, LeaseKeepAliveStream, LeaseKeeper, TlsOptions};
use tokio::time::Instant;
use tracing::debug;
use usbwire_proto::retry::Retry;

use crate::error::LabError;
use crate::url::RegistryUrl;

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
    /// down as readily as to one that is up. Its requests' deadline is
    /// [`REQUEST_TIMEOUT`].
    pub(crate) async fn connect(&self) -> Result<Client, LabError> {
        self.connect_with(REQUEST_TIMEOUT).await
    }

    /// [`Endpoint::connect`] with a request deadline of `deadline`. A longer
    /// one is for writes that must not be sent twice while the first may
    /// still be queued (a server's registration: in a storm, etcd applies
    /// writes seconds behind, every read and lease renewal waits for that,
    /// and a write timed out and sent again only lengthens the queue). The
    /// member that is tried first then gets `deadline` too when the quick
    /// pass over all of them found none answering.
    pub(crate) async fn connect_with(&self, deadline: Duration) -> Result<Client, LabError> {
        use rand::seq::SliceRandom as _;
        let mut urls = self.url.endpoint_urls(self.tls.is_some());
        urls.shuffle(&mut rand::thread_rng());
        // Several members: do not wait long on one that does not answer.
        let several = urls.len() > 1;
        let timeout = if several { MEMBER_TIMEOUT } else { deadline.min(REQUEST_TIMEOUT) };
        let mut failures = Vec::new();
        let patient = urls.first().filter(|_| deadline > timeout).cloned();
        let passes = urls.iter().map(|url| (url.clone(), timeout)).chain(patient.map(|url| (url, deadline)));
        for (url, timeout) in passes {
            match self.connect_to(&url, timeout, deadline).await {
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

    /// A client of the member at `url` whose requests have `deadline`, once
    /// it has answered one within `timeout`.
    async fn connect_to(&self, url: &str, timeout: Duration, deadline: Duration) -> Result<Client, String> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(timeout.min(REQUEST_TIMEOUT))
            .with_timeout(deadline)
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

/// Keeps `lease` alive until it is lost, and returns why. One lease for as
/// long as it lives: renewed every third of `ttl`; when the member we renew
/// through goes away (its stream ends, fails, or a renewal goes unanswered),
/// the renewal is set up again through another member under the same lease.
/// Lost only when etcd says the lease expired, or when no renewal was
/// answered for `ttl` (then etcd has let it expire too).
///
/// Only answers that arrive count as renewals. etcd-client's
/// `lease_keep_alive` sends the first request and reads its answer itself
/// (to learn the lease's id; it fails when that answer says the lease is
/// gone), so a renewal set up is a renewal answered; every later answer
/// comes through the stream it returns.
pub(crate) async fn keep_alive(endpoint: Endpoint, mut client: Client, lease: i64, ttl: Duration) -> LabError {
    let every = (ttl / 3).max(Duration::from_millis(500));
    // The caller has just granted the lease, or checked it is alive.
    let mut renewed = Instant::now();
    let mut backoff = Retry::SOON.backoff();
    backoff.next_delay();
    let several_members = endpoint.url.endpoint_urls(false).len() > 1;
    loop {
        let expires = renewed + ttl;
        let why = match tokio::time::timeout_at(
            expires.min(Instant::now() + REQUEST_TIMEOUT),
            client.lease_keep_alive(lease),
        )
        .await
        {
            Ok(Ok((mut keeper, mut answers))) => {
                renewed = Instant::now();
                backoff.reset();
                backoff.next_delay();
                match renew(&mut keeper, &mut answers, every, &mut renewed).await {
                    Renewals::Expired => return expired(lease),
                    Renewals::Broken(why) => why,
                }
            }
            Ok(Err(error)) if says_expired(&error) => return expired(lease),
            Ok(Err(error)) => short(&error),
            Err(_) => "etcd did not answer".to_owned(),
        };
        if Instant::now() >= renewed + ttl {
            return LabError::LeaseLost { lease, reason: format!("not renewed within its time to live ({why})") };
        }
        debug!(lease, reason = %why, "lease renewal interrupted; setting it up again, through another member if need be");
        tokio::time::sleep(backoff.next_delay()).await;
        // One member: its connection reconnects by itself; a new one would
        // only add a connection's set-up to a member that is already slow.
        if several_members {
            if let Ok(Ok(other)) = tokio::time::timeout_at(renewed + ttl, endpoint.connect_with(ttl)).await {
                client = other;
            }
        }
    }
}

/// How a renewal stream ended.
enum Renewals {
    /// etcd answered that the lease no longer exists.
    Expired,
    /// The stream ended, failed or stopped answering: set it up again.
    Broken(String),
}

/// Renews through one stream: a request every `every`, `renewed` moved on
/// by each answer that says the lease lives. A request unanswered for
/// `every` (at most [`REQUEST_TIMEOUT`]) counts the stream as broken.
async fn renew(
    keeper: &mut LeaseKeeper,
    answers: &mut LeaseKeepAliveStream,
    every: Duration,
    renewed: &mut Instant,
) -> Renewals {
    let patience = every.min(REQUEST_TIMEOUT);
    let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When the oldest request still unanswered was sent.
    let mut waiting_since: Option<Instant> = None;
    loop {
        let deadline = waiting_since.map(|since| since + patience);
        tokio::select! {
            _ = ticks.tick() => {
                if let Err(error) = keeper.keep_alive().await {
                    return Renewals::Broken(short(&error));
                }
                waiting_since.get_or_insert_with(Instant::now);
            }
            answer = answers.message() => match answer {
                Ok(Some(answer)) if answer.ttl() > 0 => {
                    *renewed = Instant::now();
                    waiting_since = None;
                }
                Ok(Some(_)) => return Renewals::Expired,
                Ok(None) => return Renewals::Broken("the member ended the renewal stream".into()),
                Err(error) => return Renewals::Broken(short(&error)),
            },
            () = sleep_until_some(deadline) => {
                return Renewals::Broken(format!("a renewal went unanswered for {patience:?}"));
            }
        }
    }
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// etcd-client says so when the first answer of a renewal carries no time
/// to live: the lease is gone (expired or revoked), not the member.
fn says_expired(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::LeaseKeepAliveError(message) if message.contains("not found"))
}

fn expired(lease: i64) -> LabError {
    LabError::LeaseLost { lease, reason: "etcd says the lease has expired".into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Cluster;

    const TTL: Duration = Duration::from_secs(2);

    /// A lease of [`TTL`] granted through the only member, and its renewal.
    async fn renewing_one(cluster: &Cluster) -> (Client, i64, tokio::task::JoinHandle<LabError>) {
        let mut client = cluster.client(0).await;
        let lease = client.lease_grant(2, None).await.expect("lease").id();
        let renewing = tokio::spawn(keep_alive(cluster.endpoint(&[0]), client.clone(), lease, TTL));
        (client, lease, renewing)
    }

    /// Checks once a time to live, `ttls` times, that `renewing` still runs
    /// and etcd still keeps `lease`; then stops it.
    async fn renewed_for(ttls: u32, renewing: tokio::task::JoinHandle<LabError>, client: &mut Client, lease: i64) {
        for _ in 0..ttls {
            tokio::time::sleep(TTL).await;
            assert!(!renewing.is_finished(), "renewal ended: {:?}", renewing.await.map(|e| e.to_string()));
            let remaining = client.lease_time_to_live(lease, None).await.expect("lease time to live").ttl();
            assert!(remaining > 0, "etcd let the lease expire");
        }
        renewing.abort();
    }

    /// Issue 18: the renewal waited for the answer etcd-client had already
    /// read, timed out, and called the lease lost after one time to live
    /// (servers re-registered every 10 s).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_quiet_lease_is_renewed_for_many_ttls() {
        let Some(cluster) = Cluster::start(1, "quiet_lease").await else { return };
        let (mut client, lease, renewing) = renewing_one(&cluster).await;
        renewed_for(4, renewing, &mut client, lease).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_member_moves_the_renewal_not_the_lease() {
        let Some(mut cluster) = Cluster::start(3, "member_lost").await else { return };
        // Renewing through a follower alone; the endpoint knows all three.
        let follower = cluster.follower().await;
        let through = cluster.client(follower).await;
        let others: Vec<usize> = (0..3).filter(|&i| i != follower).collect();
        let mut other = cluster.client(others[0]).await;
        let lease = other.lease_grant(2, None).await.expect("lease").id();
        let renewing = tokio::spawn(keep_alive(cluster.endpoint(&[0, 1, 2]), through, lease, TTL));
        tokio::time::sleep(TTL / 2).await;
        cluster.kill(follower);
        renewed_for(3, renewing, &mut other, lease).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_revoked_lease_ends_the_renewal_at_once() {
        let Some(cluster) = Cluster::start(1, "lease_revoked").await else { return };
        let (mut client, lease, renewing) = renewing_one(&cluster).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        client.lease_revoke(lease).await.expect("revoke");
        // The next renewal (a third of the ttl later) is answered "no such lease".
        let ended = tokio::time::timeout(TTL, renewing).await.expect("renewal ends within the ttl").expect("task");
        match ended {
            LabError::LeaseLost { lease: lost, reason } => {
                assert_eq!(lost, lease);
                assert!(reason.contains("expired"), "{reason}");
            }
            other => panic!("not a lost lease: {other}"),
        }
    }
}
