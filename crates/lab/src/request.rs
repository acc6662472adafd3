//! Requests to etcd that survive a busy moment: each has a deadline (the
//! connection's [`REQUEST_TIMEOUT`](crate::etcd::REQUEST_TIMEOUT)) and is
//! tried again, with the client's one retry policy ([`Retry::PATIENT`],
//! jittered), when it failed in a way that waiting can fix: the deadline
//! passed, the member was unavailable or overloaded, the connection broke.
//! An answer that says no (a permission, a lease that is gone, a malformed
//! request) is the caller's at once, and so is a transient failure that
//! outlasts [`RETRY_WITHIN`].
//!
//! For requests that do the same thing however often they run: reads, puts
//! of a known value, deletes, lease grants and revocations. Not for a
//! transaction whose outcome depends on whether an earlier try landed (a
//! reservation's): that one checks what its lost try did itself
//! (`take`).

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, DeleteOptions, DeleteResponse, GetOptions, GetResponse, Txn, TxnResponse};
use tokio::time::Instant;
use tracing::debug;
use usbwire_proto::retry::Retry;

/// How long a request is tried again after transient failures. etcd under a
/// storm (a lab's servers all registering after a power cut, a thousand
/// clients reserving at once) answers late, not never: a client that gives
/// up after one deadline makes the storm worse by starting over.
pub(crate) const RETRY_WITHIN: Duration = Duration::from_secs(30);

/// gRPC status codes that say "not now" rather than "no".
const CANCELLED: i32 = 1;
const DEADLINE_EXCEEDED: i32 = 4;
const RESOURCE_EXHAUSTED: i32 = 8;
const OUT_OF_RANGE: i32 = 11;
const UNAVAILABLE: i32 = 14;
/// And the one that says a user's roles do not allow a request.
const PERMISSION_DENIED: i32 = 7;

/// What a member says to a read at a revision it has not applied yet.
const FUTURE_REVISION: &str = "required revision is a future revision";

/// Whether `error` may go away by itself: a deadline that passed (tonic's
/// own deadline reports `Cancelled`, "Timeout expired"), a member that is
/// unavailable, has no leader for a moment, or sheds load ("too many
/// requests"), a connection that broke, a member behind the revision read
/// at ([`at`]). Not a revision compacted away (also `OutOfRange`).
pub(crate) fn transient(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => {
            matches!(status.code() as i32, CANCELLED | DEADLINE_EXCEEDED | RESOURCE_EXHAUSTED | UNAVAILABLE)
                || (status.code() as i32 == OUT_OF_RANGE && status.message().contains(FUTURE_REVISION))
        }
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

/// Whether etcd refused a request for want of a permission (auth enabled,
/// and the user's roles do not cover a key it writes): never transient.
pub(crate) fn permission_denied(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::GRpcStatus(status) if status.code() as i32 == PERMISSION_DENIED)
}

/// Runs `attempt` until it succeeds, fails for good, or transient failures
/// have lasted [`RETRY_WITHIN`]; waits between tries as [`Retry::PATIENT`]
/// says, from its first non-zero wait (a request that just timed out is not
/// sent again at once).
pub(crate) async fn retried<T, F, Fut>(what: &'static str, mut attempt: F) -> Result<T, etcd_client::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let started = Instant::now();
    let mut backoff = Retry::PATIENT.backoff();
    backoff.next_delay();
    let mut tries = 1u32;
    loop {
        match attempt().await {
            Err(error) if transient(&error) && started.elapsed() + backoff.upcoming() < RETRY_WITHIN => {
                let wait = backoff.next_delay();
                debug!(request = what, tries, %error, retry_in_ms = wait.as_millis(), "etcd request failed; trying again");
                tokio::time::sleep(wait).await;
                tries += 1;
            }
            outcome => return outcome,
        }
    }
}

/// A read at `revision`, which an earlier linearizable read gave: every
/// member that has applied it holds the same there, so the member asked
/// answers from what it has (serializable) without asking the leader
/// first; one that has not applied it yet says so, and the read is tried
/// again ([`transient`]).
pub(crate) fn at(revision: i64) -> GetOptions {
    GetOptions::new().with_revision(revision).with_serializable()
}

/// `client.get`, retried.
pub(crate) async fn get(
    client: &Client,
    key: impl Into<Vec<u8>>,
    options: Option<GetOptions>,
) -> Result<GetResponse, etcd_client::Error> {
    let key = key.into();
    retried("range", || {
        let mut client = client.clone();
        let (key, options) = (key.clone(), options.clone());
        async move { client.get(key, options).await }
    })
    .await
}

/// `client.txn`, retried: for transactions that may run twice (reads, puts
/// of known values, deletes), see the module docs.
pub(crate) async fn txn(client: &Client, txn: Txn) -> Result<TxnResponse, etcd_client::Error> {
    retried("txn", || {
        let mut client = client.clone();
        let txn = txn.clone();
        async move { client.txn(txn).await }
    })
    .await
}

/// `client.delete`, retried.
pub(crate) async fn delete(
    client: &Client,
    key: impl Into<Vec<u8>>,
    options: Option<DeleteOptions>,
) -> Result<DeleteResponse, etcd_client::Error> {
    let key = key.into();
    retried("delete", || {
        let mut client = client.clone();
        let (key, options) = (key.clone(), options.clone());
        async move { client.delete(key, options).await }
    })
    .await
}

/// A new lease of `ttl_secs`, retried (a lease granted by a try whose answer
/// was lost expires unused).
pub(crate) async fn lease_grant(client: &Client, ttl_secs: i64) -> Result<i64, etcd_client::Error> {
    retried("lease grant", || {
        let mut client = client.clone();
        async move { client.lease_grant(ttl_secs, None).await.map(|granted| granted.id()) }
    })
    .await
}

/// Revokes `lease`, retried; a lease already gone counts as revoked.
pub(crate) async fn lease_revoke(client: &Client, lease: i64) -> Result<(), etcd_client::Error> {
    let revoked = retried("lease revoke", || {
        let mut client = client.clone();
        async move { client.lease_revoke(lease).await.map(drop) }
    })
    .await;
    match revoked {
        Err(error) if lease_not_found(&error) => Ok(()),
        other => other,
    }
}

/// etcd's answer for a lease that expired or was revoked.
pub(crate) fn lease_not_found(error: &etcd_client::Error) -> bool {
    error.to_string().contains("requested lease not found")
}

#[cfg(test)]
mod tests;
