//! [`Lease`]: a registered server's lease and what it has published under
//! it, kept across connections while etcd keeps the lease; whether it is
//! alive, reading the catalogs back after a write whose outcome is not
//! known and the free-device keys back after a connection lost, and
//! revoking it. Not for what is written (`publish`).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use etcd_client::{Client, GetOptions, LeaseTimeToLiveOptions};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::entry::Keys;
use crate::error::LabError;
use crate::etcd::Endpoint;
use crate::request;

/// How long a stopping server tries to revoke its lease: an unreachable
/// registry must not hold the shutdown up (the lease then expires by itself).
const DEREGISTER_WITHIN: Duration = Duration::from_secs(2);

/// What is remembered of a key whose value etcd may not hold (a put whose
/// transaction failed, a free key after a connection lost whose keys could
/// not be listed): no value equals it, so the next sync puts the key again
/// (or deletes it).
pub(super) const UNKNOWN: &[u8] = b"\0unknown";

/// The server's lease and what is published under it: kept across
/// connections for as long as etcd keeps the lease.
pub(super) struct Lease {
    pub(super) id: i64,
    /// The latest session's client, to revoke the lease through.
    pub(super) client: Client,
    /// Renews the lease; ends, saying why, when it is lost.
    pub(super) renewing: JoinHandle<LabError>,
    /// Key → value of every device entry, index entry and catalog chunk put under it.
    pub(super) published: HashMap<String, Vec<u8>>,
    /// Each catalog's chunks as last written.
    pub(super) layouts: crate::catalog::Layouts,
    /// A write failed: it may or may not have landed, so what `published`
    /// and `layouts` say of the catalogs may not be what etcd holds.
    pub(super) unsure: bool,
}

impl Lease {
    /// Whether etcd still keeps it (asked through `client`), even when its
    /// renewal gave up: answers that came too late for the renewal (etcd
    /// answers a renewal only once it has applied what it committed, seconds
    /// behind in a storm) may still have kept it alive, and a server that
    /// took a new lease then would put everything again while its old
    /// entries stay until the old lease expires.
    pub(super) async fn alive(&self, client: &mut Client) -> Result<bool, LabError> {
        let id = self.id;
        let alive = request::retried("lease time to live", || {
            let mut client = client.clone();
            async move { client.lease_time_to_live(id, None).await }
        })
        .await?;
        Ok(alive.ttl() > 0)
    }

    /// Reads the server's catalogs back from etcd after a write whose
    /// outcome is not known: their chunks as etcd holds them become what is
    /// published and their layouts, so the next write orders its chunks by
    /// what is there (`catalog::write_order`). A linearizable read, so a
    /// write etcd committed before it is applied in what it returns.
    pub(super) async fn read_back_catalogs(
        &mut self,
        client: &Client,
        keys: &Keys,
        server: &str,
    ) -> Result<(), LabError> {
        let catalogs_of = keys.catalogs_of(server);
        let held = request::get(client, catalogs_of.clone(), Some(GetOptions::new().with_prefix())).await?;
        let chunks: Vec<(String, Vec<u8>)> =
            held.kvs().iter().filter_map(|kv| Some((kv.key_str().ok()?.to_owned(), kv.value().to_vec()))).collect();
        self.published.retain(|key, _| !key.starts_with(&catalogs_of));
        self.layouts = crate::catalog::layouts_of(server, chunks.iter().map(|(k, v)| (k.as_str(), v.as_slice())));
        self.published.extend(chunks);
        self.unsure = false;
        Ok(())
    }

    /// Forgets the free-device keys it published that etcd no longer holds
    /// under it: a reservation's transaction deletes some of its device's
    /// free keys (`take`), and one taken and given back while this server
    /// was not connected left them deleted with nothing that tells it. Read
    /// when a connection is set up again under the same lease, so the next
    /// sync puts back those the devices still want; the rest stay published
    /// as they were, and nothing is written for them.
    pub(super) async fn read_back_free_keys(&mut self, client: &Client, keys: &Keys) -> Result<(), LabError> {
        let id = self.id;
        let options = LeaseTimeToLiveOptions::new().with_keys();
        let answer = request::retried("lease keys", || {
            let mut client = client.clone();
            let options = options.clone();
            async move { client.lease_time_to_live(id, Some(options)).await }
        })
        .await;
        match answer {
            Ok(answer) => {
                forget_free_keys(&mut self.published, keys, Some(&answer.keys().iter().map(Vec::as_slice).collect()));
            }
            // An answer too large to take (some thousands of devices, 4 MiB): all written again.
            Err(error) if !request::transient(&error) => {
                debug!(%error, "the lease's keys could not be read back; its free-device keys are written again");
                forget_free_keys(&mut self.published, keys, None);
            }
            Err(error) => return Err(error.into()),
        }
        Ok(())
    }

    /// Ends the registration now: through the latest session's member, else
    /// through any that answers, for at most [`DEREGISTER_WITHIN`].
    pub(super) async fn revoke(self, endpoint: &Endpoint) {
        self.renewing.abort();
        let url = endpoint.url.to_string();
        let id = self.id;
        let mut client = self.client.clone();
        let revoking = async {
            if client.lease_revoke(id).await.is_ok() {
                return Ok(());
            }
            let mut other = endpoint.connect().await?;
            other.lease_revoke(id).await?;
            Ok::<(), LabError>(())
        };
        match tokio::time::timeout(DEREGISTER_WITHIN, revoking).await {
            Ok(Ok(())) => info!(registry = %url, lease = format_args!("{id:x}"), "left the lab registry"),
            Ok(Err(error)) => {
                warn!(registry = %url, %error, "could not leave the lab registry; its entries expire with the lease");
            }
            Err(_) => warn!(
                registry = %url,
                "the lab registry did not answer within {DEREGISTER_WITHIN:?}; its entries expire with the lease"
            ),
        }
    }
}

/// Of the free-device keys `published`, forgets those not in `held` (the
/// keys etcd holds under the lease); with none known, takes each for
/// unknown, so the next sync puts it again or deletes it.
fn forget_free_keys(published: &mut HashMap<String, Vec<u8>>, keys: &Keys, held: Option<&HashSet<&[u8]>>) {
    match held {
        Some(held) => published.retain(|key, _| !keys.is_free_entry(key) || held.contains(key.as_bytes())),
        None => {
            for (_, value) in published.iter_mut().filter(|(key, _)| keys.is_free_entry(key)) {
                *value = UNKNOWN.to_vec();
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.renewing.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{plant_as, Cluster};

    /// Read back after a connection lost, the free keys etcd no longer holds
    /// under the lease are forgotten (the next sync puts them again where
    /// the devices want them) and the rest kept as published; when the
    /// lease's keys cannot be listed, every free key is taken for unknown
    /// (put again or deleted). Other keys stay as they were either way.
    #[test]
    fn free_keys_gone_from_the_lease_are_forgotten() {
        let keys = Keys::new("test");
        let kept = keys.free_entry("id", "1209:0005", "s:1", "1-1");
        let gone = keys.free_entry("id", "1209:0005", "s:1", "1-2");
        let device = keys.device("s:1", "1-2");
        let published = HashMap::from([
            (kept.clone(), b"available".to_vec()),
            (gone.clone(), b"available".to_vec()),
            (device.clone(), b"{}".to_vec()),
        ]);
        let mut read_back = published.clone();
        let held: HashSet<&[u8]> = [kept.as_bytes(), device.as_bytes()].into();
        forget_free_keys(&mut read_back, &keys, Some(&held));
        let expected = HashMap::from([(kept.clone(), b"available".to_vec()), (device.clone(), b"{}".to_vec())]);
        assert_eq!(read_back, expected);
        let mut unknown = published;
        forget_free_keys(&mut unknown, &keys, None);
        let expected = HashMap::from([(kept, UNKNOWN.to_vec()), (gone, UNKNOWN.to_vec()), (device, b"{}".to_vec())]);
        assert_eq!(unknown, expected);
    }

    /// After a write whose outcome is not known, the lease takes what etcd
    /// holds of the server's catalogs as published and as their layouts;
    /// what it holds of other keys stays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reading_back_takes_the_catalogs_as_etcd_holds_them() {
        let Some(cluster) = Cluster::start(1, "lease_read_back").await else { return };
        let keys = Keys::new("test");
        let server = "10.0.0.1:3240";
        let mut client = cluster.client(0).await;
        plant_as(&mut client, &keys, server, 150, 20, true).await;
        let mut lease = Lease {
            id: 1,
            client: client.clone(),
            renewing: tokio::spawn(std::future::pending()),
            published: HashMap::from([
                (keys.catalog_chunk(server, 0), b"\0unknown".to_vec()),
                (keys.catalog_chunk(server, 9), b"gone".to_vec()),
                (keys.device(server, "1-1"), b"kept".to_vec()),
            ]),
            layouts: HashMap::from([(keys.catalog_of(server), vec![vec!["9-9".to_owned()]])]),
            unsure: true,
        };
        lease.read_back_catalogs(&client, &keys, server).await.unwrap();
        let held = client.get(keys.catalogs_of(server), Some(GetOptions::new().with_prefix())).await.unwrap();
        let mut expected: HashMap<String, Vec<u8>> =
            held.kvs().iter().map(|kv| (kv.key_str().unwrap().to_owned(), kv.value().to_vec())).collect();
        assert_eq!(
            expected.len(),
            9,
            "3 chunks of all 150 devices, 1 of the 8 nucleo, markers for the 142 other, 0483:374b and 3 classes"
        );
        expected.insert(keys.device(server, "1-1"), b"kept".to_vec());
        assert_eq!(lease.published, expected);
        let busid = |i: usize| format!("{}-{}", 1 + i / 100, 1 + i % 100);
        let mut all: Vec<String> = (0..150).map(busid).collect();
        all.sort();
        let chunks: Vec<Vec<String>> = all.chunks(64).map(<[String]>::to_vec).collect();
        assert_eq!(lease.layouts[&keys.catalog_of(server)], chunks);
        let labelled: Vec<String> = {
            let mut labelled: Vec<String> = (0..150).step_by(20).map(busid).collect();
            labelled.sort();
            labelled
        };
        assert_eq!(lease.layouts[&keys.term_catalog_of(server, "label", "nucleo")], [labelled]);
        assert!(!lease.unsure);
    }
}
