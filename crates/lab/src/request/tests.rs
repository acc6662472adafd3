use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::*;
use crate::testing::Cluster;

fn broken_connection() -> etcd_client::Error {
    etcd_client::Error::IoError(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset"))
}

#[tokio::test(start_paused = true)]
async fn a_transient_failure_is_tried_again_with_growing_waits_until_it_succeeds() {
    let tries = AtomicU32::new(0);
    let started = Instant::now();
    let outcome = retried("test", || async {
        if tries.fetch_add(1, Ordering::SeqCst) < 4 {
            Err(broken_connection())
        } else {
            Ok(7)
        }
    })
    .await;
    assert_eq!(outcome.expect("succeeds on the fifth try"), 7);
    assert_eq!(tries.load(Ordering::SeqCst), 5);
    // Four waits, each in the upper half of 250, 500, 1000, 2000 ms: never at once.
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(1875) && waited <= Duration::from_millis(3750), "{waited:?}");
}

#[tokio::test(start_paused = true)]
async fn an_answer_that_says_no_is_not_tried_again() {
    let tries = AtomicU32::new(0);
    let outcome: Result<(), _> = retried("test", || async {
        tries.fetch_add(1, Ordering::SeqCst);
        Err(etcd_client::Error::InvalidArgs("no".into()))
    })
    .await;
    assert!(matches!(outcome, Err(etcd_client::Error::InvalidArgs(_))));
    assert_eq!(tries.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_failure_that_lasts_is_the_callers_after_the_retry_window() {
    let tries = AtomicU32::new(0);
    let started = Instant::now();
    let outcome: Result<(), _> = retried("test", || async {
        tries.fetch_add(1, Ordering::SeqCst);
        Err(broken_connection())
    })
    .await;
    assert!(matches!(outcome, Err(etcd_client::Error::IoError(_))));
    let waited = started.elapsed();
    assert!(waited < RETRY_WITHIN && waited >= RETRY_WITHIN - Retry::PATIENT.cap(), "{waited:?}");
    assert!(tries.load(Ordering::SeqCst) >= 7, "{} tries", tries.load(Ordering::SeqCst));
}

/// A member that stops answering for longer than a request's deadline (an
/// etcd swamped by a lab's registration storm): a single request fails with
/// its deadline; the retried one gets its answer once the member answers.
#[tokio::test]
async fn a_request_outlasting_its_deadline_gets_its_answer_when_the_member_answers_again() {
    let Some(cluster) = Cluster::start(1, "request-deadline").await else { return };
    let mut client = cluster.client(0).await;
    client.put("test/k", "v", None).await.expect("put");

    cluster.signal(0, "-STOP");
    let once = client.get("test/k", None).await;
    let error = once.expect_err("a frozen member does not answer within the deadline");
    assert!(transient(&error), "a missed deadline is transient: {error}");

    let thaw = tokio::spawn(async move {
        tokio::time::sleep(crate::etcd::REQUEST_TIMEOUT + Duration::from_secs(2)).await;
        cluster.signal(0, "-CONT");
        cluster
    });
    let started = Instant::now();
    let read = get(&client, "test/k", None).await.expect("answered once the member is back");
    assert_eq!(read.kvs()[0].value(), b"v");
    assert!(started.elapsed() > crate::etcd::REQUEST_TIMEOUT, "it did wait past one deadline");
    drop(thaw.await.expect("thawed"));
}

#[tokio::test]
async fn a_lease_already_gone_counts_as_revoked() {
    let Some(cluster) = Cluster::start(1, "request-revoke").await else { return };
    let client = cluster.client(0).await;
    let lease = lease_grant(&client, 5).await.expect("grant");
    lease_revoke(&client, lease).await.expect("revoked");
    lease_revoke(&client, lease).await.expect("gone is revoked");
}

/// A read at a revision the member has not applied yet is tried again
/// until it has, and then reads what was there; a revision compacted
/// away is not waited for, as it will not come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_at_a_future_revision_waits_for_it_and_one_at_a_compacted_revision_does_not() {
    let Some(cluster) = Cluster::start(1, "future_revision").await else { return };
    let mut client = cluster.client(0).await;
    let first = client.put("k", "1", None).await.unwrap().header().unwrap().revision();
    client.put("k", "2", None).await.unwrap();
    let future = client.get("k", Some(at(first + 2))).await.unwrap_err();
    assert!(transient(&future), "{future}");
    let reader = client.clone();
    let reading = tokio::spawn(async move { get(&reader, "k", Some(at(first + 2))).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!reading.is_finished(), "read at a revision no member has");
    client.put("k", "3", None).await.unwrap();
    client.put("k", "4", None).await.unwrap();
    let got = reading.await.unwrap().unwrap();
    assert_eq!(got.kvs()[0].value(), b"3");
    client.compact(first + 1, None).await.unwrap();
    let compacted = client.get("k", Some(at(first))).await.unwrap_err();
    assert!(!transient(&compacted), "{compacted}");
    assert_eq!(client.get("k", Some(at(first + 1))).await.unwrap().kvs()[0].value(), b"2");
}
