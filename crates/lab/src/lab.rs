//! The client's side: read the fleet, follow it, take and give back reservations.
//!
//! Requests per operation (what grows with the lab): [`Lab::fleet`] reads
//! the servers, their catalogs (a transaction per 16 servers) and the
//! reservations, a page at a time (`pages`; its size grows with the
//! devices); a
//! reservation (`take`) reads one page of free devices, then one lease grant
//! and one transaction per device tried; holding it costs one renewal every
//! third of the lease's time to live; a release is one lease revocation.

use std::time::{Duration, SystemTime};

use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, EventType, GetOptions, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use tokio::task::JoinHandle;
use usbwire_proto::reservation::ReservationToken;

use crate::entry::{decode, DeviceEntry, Key, Keys, ReservationEntry, ServerEntry};
use crate::error::LabError;
use crate::etcd::Endpoint;
use crate::request;

/// Keys one step of [`Lab::delete_all`] deletes. On three members sharing
/// two vCPUs, a bench's 730 000 keys in one deletion outlasted a request's
/// deadline (5 s), and etcd renews no lease while it applies it: on an etcd
/// a lab shares, its servers' leases would run out.
const DELETE_STEP: i64 = 10_000;

/// A connection to the lab registry.
pub struct Lab {
    pub(crate) endpoint: Endpoint,
    pub(crate) client: Client,
    pub(crate) keys: Keys,
    pub(crate) reads: Reads,
    /// Whether a reservation's transaction deletes its device's free keys
    /// (`take`): until etcd says this user may not.
    pub(crate) takes_free_keys: bool,
}

/// The range requests a [`Lab`] made and the bytes they brought back (keys
/// and values), and the reservation transactions it ran: what its
/// operations cost etcd, for benchmarks and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reads {
    pub requests: u64,
    pub bytes: u64,
    /// Reservation transactions run (a chain's try is one).
    pub transactions: u64,
}

impl Reads {
    pub(crate) fn count(&mut self, response: &etcd_client::GetResponse) {
        self.requests += 1;
        self.bytes += response.kvs().iter().map(|kv| (kv.key().len() + kv.value().len()) as u64).sum::<u64>();
    }

    pub(crate) fn add(&mut self, other: Self) {
        self.requests += other.requests;
        self.bytes += other.bytes;
        self.transactions += other.transactions;
    }
}

/// How long a reservation lasts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// While this process runs: renewed every third of `ttl`, gone within
    /// `ttl` of the process dying. `until`, if set, is shown to others as
    /// when the holder means to let go (`attach --for`).
    WhileRunning { ttl: Duration, until: Option<SystemTime> },
    /// For a fixed time, whether or not this process runs (`usbwire reserve --for`).
    For(Duration),
}

/// A device taken in the registry. Dropping it stops renewing the lease (the
/// reservation then ends within its time to live); [`Reservation::release`]
/// ends it at once.
pub struct Reservation {
    pub server: ServerEntry,
    pub device: DeviceEntry,
    pub entry: ReservationEntry,
    /// What the import must carry.
    pub token: ReservationToken,
    pub lease: i64,
    pub(crate) client: Client,
    pub(crate) renewing: Option<JoinHandle<LabError>>,
}

/// How many keys one range request returns at most.
pub(crate) const PAGE: i64 = 2000;
/// Whether a server's and a device's records name the server and bus id of
/// the keys they were read from (`servers/SERVER`, `devices/SERVER/BUSID`).
/// A client imports from the address and pins the key the records name, so
/// records that name another server are not taken.
pub(crate) fn names_its_key(server: &ServerEntry, device: &DeviceEntry, key_server: &str, key_busid: &str) -> bool {
    server.address == key_server && device.server == key_server && device.record.busid == key_busid
}

/// The first key after every key that starts with `prefix`.
pub(crate) fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// One change seen by [`FleetWatch`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FleetChange {
    /// `server`, `device` or `reservation`.
    pub what: &'static str,
    pub server: String,
    pub busid: Option<String>,
    /// The new record; `None` when it was removed.
    pub entry: Option<serde_json::Value>,
    pub revision: i64,
}

/// Follows every change under the registry's prefix.
pub struct FleetWatch {
    stream: etcd_client::WatchStream,
    keys: Keys,
}

impl Lab {
    /// Connects (and checks the registry answers).
    pub async fn connect(endpoint: Endpoint) -> Result<Self, LabError> {
        let client = endpoint.connect().await?;
        let keys = Keys::new(&endpoint.url.prefix);
        Ok(Self { endpoint, client, keys, reads: Reads::default(), takes_free_keys: true })
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The registry's revision now (a linearizable read of no key): it moves
    /// with every write, and not with lease renewals or watches.
    pub async fn revision(&mut self) -> Result<i64, LabError> {
        let options = GetOptions::new().with_count_only();
        let got = request::get(&self.client, self.keys.all(), Some(options)).await?;
        Ok(got.header().map_or(0, |header| header.revision()))
    }

    /// What this connection has read so far.
    pub fn reads(&self) -> Reads {
        self.reads
    }

    /// Every key under `prefix` (and its value unless `keys_only`), in pages
    /// of [`PAGE`], at `revision` (the first page's when `None`).
    pub(crate) async fn range(
        &mut self,
        prefix: &str,
        revision: Option<i64>,
        keys_only: bool,
    ) -> Result<(i64, Vec<etcd_client::KeyValue>), LabError> {
        let end = prefix_end(prefix);
        let mut from = prefix.as_bytes().to_vec();
        let mut revision = revision;
        let mut kvs = Vec::new();
        loop {
            let read = revision.map_or_else(GetOptions::new, request::at);
            let mut options = read.with_range(end.clone()).with_limit(PAGE);
            if keys_only {
                options = options.with_keys_only();
            }
            let mut response = request::get(&self.client, from.clone(), Some(options)).await?;
            self.reads.count(&response);
            revision = revision.or(response.header().map(|h| h.revision()));
            let more = response.more();
            let mut page = response.take_kvs();
            if let (true, Some(last)) = (more, page.last()) {
                from = last.key().to_vec();
                from.push(0);
            }
            kvs.append(&mut page);
            if !more {
                return Ok((revision.unwrap_or(0), kvs));
            }
        }
    }

    /// Changes after `revision` (a [`Fleet`]'s), as they happen.
    pub async fn watch(&mut self, revision: i64) -> Result<FleetWatch, LabError> {
        // Fragments: a watch that falls behind gets up to a thousand revisions
        // in one answer, more than gRPC's 4 MiB message limit in a large lab.
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1).with_fragment();
        let stream = self.client.watch(self.keys.all(), Some(options)).await?;
        Ok(FleetWatch { stream, keys: self.keys.clone() })
    }

    /// Deletes every key under the registry's prefix (servers, devices,
    /// reservations, indexes) and returns how many there were: for a prefix
    /// of its own that a run is done with, such as `usbwire bench
    /// --registry`'s. Publishers still running there put their keys back.
    /// Deleted [`DELETE_STEP`] keys at a time, so that etcd is never busy
    /// with one deletion for long.
    pub async fn delete_all(&mut self) -> Result<i64, LabError> {
        self.delete_all_in_steps_of(DELETE_STEP).await
    }

    /// [`Lab::delete_all`], `step` keys a deletion: each step reads the
    /// first `step` keys left (their names only) and deletes from the
    /// prefix's start to the last of them.
    async fn delete_all_in_steps_of(&mut self, step: i64) -> Result<i64, LabError> {
        let (start, end) = (self.keys.all(), prefix_end(&self.keys.all()));
        let mut deleted = 0;
        loop {
            let first = GetOptions::new().with_range(end.clone()).with_keys_only().with_limit(step);
            let got = request::get(&self.client, start.clone(), Some(first)).await?;
            let Some(last) = got.kvs().last() else { return Ok(deleted) };
            let through = [last.key(), &[0]].concat();
            let options = DeleteOptions::new().with_range(through);
            deleted += request::delete(&self.client, start.clone(), Some(options)).await?.deleted();
        }
    }

    /// The device `busid` on `server` and its server's entry, if the
    /// reservation `token` proves is still there (not run out, not someone
    /// else's since) and the records name their own keys: one request.
    pub async fn still_held(
        &mut self,
        server: &str,
        busid: &str,
        token: &ReservationToken,
    ) -> Result<Option<(ServerEntry, DeviceEntry)>, LabError> {
        let read = Txn::new().and_then([
            TxnOp::get(self.keys.reservation(server, busid), None),
            TxnOp::get(self.keys.device(server, busid), None),
            TxnOp::get(self.keys.server(server), None),
        ]);
        let response = request::txn(&self.client, read).await?;
        let mut values = response.op_responses().into_iter().map(|op| match op {
            TxnOpResponse::Get(got) => got.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        let reservation = values.next().flatten().and_then(|v| decode::<ReservationEntry>(&v));
        let device = values.next().flatten().and_then(|v| decode::<DeviceEntry>(&v));
        let entry = values.next().flatten().and_then(|v| decode::<ServerEntry>(&v));
        let ours = reservation.is_some_and(|r| r.token_sha256 == hex(&usbwire_server::reservation::digest(token)));
        Ok(entry.zip(device).filter(|(entry, device)| ours && names_its_key(entry, device, server, busid)))
    }

    /// Ends the reservation of `busid` on `server`: only the holder's, when
    /// `token` is given; anyone's otherwise (`usbwire release --force`).
    pub async fn release(
        &mut self,
        server: &str,
        busid: &str,
        token: Option<&ReservationToken>,
    ) -> Result<ReservationEntry, LabError> {
        let key = self.keys.reservation(server, busid);
        let what = format!("{busid} on {server}");
        let response = request::get(&self.client, key.clone(), None).await?;
        let Some(kv) = response.kvs().first() else {
            return Err(LabError::NotReserved { what, by: String::new() });
        };
        let entry = decode::<ReservationEntry>(kv.value())
            .ok_or_else(|| LabError::NotReserved { what: what.clone(), by: " (its record is unreadable)".into() })?;
        if let Some(token) = token {
            if hex(&usbwire_server::reservation::digest(token)) != entry.token_sha256 {
                return Err(LabError::NotReserved { what, by: format!(" by you (held by {})", entry.holder) });
            }
        }
        // Only if it is still the one read (not a new holder's since); gone
        // is ended too (a try whose answer was lost, or its lease ran out).
        let txn = Txn::new()
            .when([Compare::mod_revision(key.clone(), CompareOp::Equal, kv.mod_revision())])
            .and_then([TxnOp::delete(key.clone(), None)])
            .or_else([TxnOp::get(key, Some(GetOptions::new().with_count_only()))]);
        let response = request::txn(&self.client, txn).await?;
        let gone = response.op_responses().iter().any(|op| matches!(op, TxnOpResponse::Get(got) if got.count() == 0));
        if !response.succeeded() && !gone {
            return Err(LabError::NotReserved { what, by: " any more (it changed meanwhile)".into() });
        }
        Ok(entry)
    }
}

impl Reservation {
    /// Resolves if the reservation is lost while held (its lease could not
    /// be renewed for its time to live); never for [`Hold::For`].
    pub async fn lost(&mut self) -> LabError {
        match &mut self.renewing {
            Some(task) => task
                .await
                .unwrap_or_else(|_| LabError::LeaseLost { lease: self.lease, reason: "renewal stopped".into() }),
            None => std::future::pending().await,
        }
    }

    /// Ends the reservation now (revokes its lease).
    pub async fn release(mut self) -> Result<(), LabError> {
        if let Some(task) = self.renewing.take() {
            task.abort();
        }
        request::lease_revoke(&self.client, self.lease).await?;
        tracing::debug!(server = %self.device.server, busid = %self.device.record.busid, "reservation released");
        Ok(())
    }

    /// Leaves the reservation to run out by itself ([`Hold::For`]).
    pub fn keep(mut self) {
        self.renewing.take();
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(task) = self.renewing.take() {
            task.abort();
        }
    }
}

impl FleetWatch {
    /// The next changes; `None` when the watch ended.
    pub async fn next(&mut self) -> Result<Option<Vec<FleetChange>>, LabError> {
        let Some(response) = self.stream.message().await? else { return Ok(None) };
        let revision = response.header().map_or(0, |h| h.revision());
        let changes = response
            .events()
            .iter()
            .filter_map(|event| {
                let kv = event.kv()?;
                let (what, server, busid) = match self.keys.parse(kv.key())? {
                    Key::Server { server } => ("server", server, None),
                    Key::Device { server, busid } => ("device", server, Some(busid)),
                    Key::Reservation { server, busid } => ("reservation", server, Some(busid)),
                };
                let entry = match event.event_type() {
                    EventType::Put => {
                        let mut value: serde_json::Value = serde_json::from_slice(kv.value()).ok()?;
                        // Others see who holds a reservation, not its digest.
                        if let Some(object) = value.as_object_mut() {
                            object.remove("token_sha256");
                        }
                        Some(value)
                    }
                    EventType::Delete => None,
                };
                Some(FleetChange { what, server, busid, entry, revision })
            })
            .collect();
        Ok(Some(changes))
    }
}

/// `user@host`, for others to see who holds a device.
pub(crate) fn holder_name() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|user| !user.is_empty())
        .or_else(user_of_this_process)
        .unwrap_or_else(|| "unknown".to_owned());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default();
    format!("{user}@{host}")
}

/// The name `/etc/passwd` gives this process's real uid (services often run without `$USER`).
fn user_of_this_process() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let uid = status.lines().find_map(|line| line.strip_prefix("Uid:"))?.split_whitespace().next()?.to_owned();
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    let name = passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.get(2) == Some(&uid.as_str())).then(|| fields[0].to_owned())
    });
    Some(name.unwrap_or_else(|| format!("uid {uid}")))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use etcd_client::PutOptions;

    use super::*;
    use crate::entry::{timestamp, Availability, Want, SCHEMA_VERSION};
    use crate::testing::Cluster;

    fn device(server: &str, busid: &str) -> DeviceEntry {
        DeviceEntry {
            schema_version: SCHEMA_VERSION,
            server: server.into(),
            record: usbwire_device::record::DeviceJson {
                busid: busid.into(),
                kind: Some("keyboard".into()),
                vendor_id: "1209".into(),
                product_id: "0001".into(),
                product: Some("planted keyboard".into()),
                speed: "full".into(),
                state: Some("available".into()),
                ..Default::default()
            },
            class: "03".into(),
            interface_classes: vec![],
            labels: vec!["kbd".into()],
        }
    }

    fn server(address: &str, fingerprint: Option<&str>) -> ServerEntry {
        ServerEntry {
            schema_version: SCHEMA_VERSION,
            address: address.into(),
            tls_fingerprint: fingerprint.map(str::to_owned),
            plain: fingerprint.is_none(),
            implementation: "usbwire".into(),
            version: "0.1.0".into(),
            started_at: timestamp(SystemTime::now()),
            catalog: false,
            catalog_terms: Vec::new(),
        }
    }

    /// Writes a server's and a device's records (and the device's index
    /// entries) under the keys of `key_server`, as anyone who can write to
    /// the registry could.
    async fn plant(client: &mut Client, keys: &Keys, key_server: &str, server: &ServerEntry, device: &DeviceEntry) {
        client.put(keys.server(key_server), json(server), None).await.unwrap();
        client.put(keys.device(key_server, &device.record.busid), json(device), None).await.unwrap();
        let mut indexed = device.clone();
        indexed.server = key_server.into();
        for key in keys.index_entries(&indexed) {
            client.put(key, Availability::AVAILABLE, None).await.unwrap();
        }
    }

    fn json<T: serde::Serialize>(value: &T) -> String {
        serde_json::to_string(value).unwrap()
    }

    /// Issue 20: a client imports from the address, and pins the key, that
    /// the records name; records under one server's keys that name another
    /// server are not taken, and a reservation carries its server's entry
    /// (its key) from the keys it reserved.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_that_name_another_server_than_their_keys_are_not_taken() {
        let Some(cluster) = Cluster::start(1, "names_its_key").await else { return };
        let mut client = cluster.client(0).await;
        let keys = Keys::new("test");
        let key = format!("sha256:{}", "cd".repeat(32));
        // Under a's keys, records that send the client to b.
        plant(&mut client, &keys, "a:3240", &server("b:3240", Some(&key)), &device("a:3240", "1-1")).await;
        plant(&mut client, &keys, "c:3240", &server("c:3240", Some(&key)), &device("b:3240", "1-1")).await;
        let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
        let want: Want = "label=kbd".parse().unwrap();
        let hold = Hold::WhileRunning { ttl: Duration::from_secs(5), until: None };
        match lab.reserve(&want, hold, "test").await {
            Err(LabError::NoneFree { .. }) => {}
            Err(other) => panic!("expected none taken, got {other}"),
            Ok(taken) => {
                panic!(
                    "took {} on {} from records naming another server",
                    taken.device.record.busid, taken.server.address
                )
            }
        }
        let reservations =
            client.get(format!("{}reservations/", keys.all()), Some(GetOptions::new().with_prefix())).await.unwrap();
        assert_eq!(reservations.kvs().len(), 0, "the reservations tried were given back");
        // Consistent records are taken, with the server's entry (and key) beside the device.
        plant(&mut client, &keys, "d:3240", &server("d:3240", Some(&key)), &device("d:3240", "2-1")).await;
        let taken = lab.reserve(&want, hold, "test").await.unwrap();
        assert_eq!((taken.server.address.as_str(), taken.device.record.busid.as_str()), ("d:3240", "2-1"));
        assert_eq!(taken.server.tls_fingerprint.as_deref(), Some(key.as_str()));
        let (entry, held) = lab.still_held("d:3240", "2-1", &taken.token).await.unwrap().unwrap();
        assert_eq!((entry.address.as_str(), held.record.busid.as_str()), ("d:3240", "2-1"));
        // A server entry rewritten to name another address no longer counts as held there.
        client.put(keys.server("d:3240"), json(&server("b:3240", Some(&key))), None).await.unwrap();
        assert!(lab.still_held("d:3240", "2-1", &taken.token).await.unwrap().is_none());
        taken.release().await.unwrap();
    }

    /// `delete_all` empties its own prefix and leaves a neighbour's alone,
    /// even one whose name starts the same.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn delete_all_removes_its_prefix_and_nothing_beside_it() {
        let Some(cluster) = Cluster::start(1, "delete_all").await else { return };
        let mut client = cluster.client(0).await;
        let key = format!("sha256:{}", "cd".repeat(32));
        let (mine, neighbour) = (Keys::new("run"), Keys::new("run-2"));
        plant(&mut client, &mine, "a:3240", &server("a:3240", Some(&key)), &device("a:3240", "1-1")).await;
        plant(&mut client, &neighbour, "b:3240", &server("b:3240", Some(&key)), &device("b:3240", "1-1")).await;
        let count = |client: &mut Client, prefix: String| {
            let mut client = client.clone();
            async move { client.get(prefix, Some(GetOptions::new().with_prefix())).await.unwrap().kvs().len() }
        };
        let planted = count(&mut client, mine.all()).await;
        assert!(planted >= 2, "a server and a device under the prefix");
        let mut endpoint = cluster.endpoint(&[0]);
        endpoint.url.prefix = "run".to_owned();
        let mut lab = Lab::connect(endpoint).await.unwrap();
        assert_eq!(lab.delete_all().await.unwrap(), planted as i64);
        assert_eq!(count(&mut client, mine.all()).await, 0);
        assert_eq!(count(&mut client, neighbour.all()).await, planted, "the neighbour's keys stay");
        // In steps smaller than the prefix holds: every key, counted once, the neighbour's kept.
        plant(&mut client, &mine, "a:3240", &server("a:3240", Some(&key)), &device("a:3240", "1-1")).await;
        plant(&mut client, &mine, "c:3240", &server("c:3240", Some(&key)), &device("c:3240", "1-1")).await;
        let planted_twice = count(&mut client, mine.all()).await;
        assert!(planted_twice > 2 * 2, "more keys than two steps of two");
        assert_eq!(lab.delete_all_in_steps_of(2).await.unwrap(), planted_twice as i64);
        assert_eq!(count(&mut client, mine.all()).await, 0);
        assert_eq!(count(&mut client, neighbour.all()).await, planted, "the neighbour's keys stay");
    }

    /// The revision moves with a write anywhere in etcd, and not with a
    /// lease's renewal: what `bench --registry` waits on for servers to be
    /// done writing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_revision_moves_with_writes_and_not_with_renewals() {
        let Some(cluster) = Cluster::start(1, "revision").await else { return };
        let mut client = cluster.client(0).await;
        let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
        let before = lab.revision().await.unwrap();
        let lease = client.lease_grant(10, None).await.unwrap().id();
        client.lease_keep_alive(lease).await.unwrap().0.keep_alive().await.unwrap();
        assert_eq!(lab.revision().await.unwrap(), before, "a grant and a renewal write nothing");
        let put = client.put("elsewhere", "x", None).await.unwrap().header().unwrap().revision();
        assert_eq!((put, lab.revision().await.unwrap()), (before + 1, before + 1));
    }

    /// The README's etcd roles ("Trusting the registry"), as etcd enforces
    /// them: a server writes its own entry, devices and the index, and reads
    /// its own reservations, but cannot plant another server or device, nor
    /// reserve; a client reads everything and writes reservations only.
    /// (Users log in with passwords here; the README's log in by certificate.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_readme_roles_let_a_server_write_only_its_keys_and_a_client_only_reservations() {
        use etcd_client::{ConnectOptions, Permission};
        let Some(cluster) = Cluster::start(1, "roles").await else { return };
        let keys = Keys::new("test");
        let me = "bench-3:3240";
        let mut root = cluster.client(0).await;
        root.role_add("root").await.unwrap();
        root.user_add("root", "root-pw", None).await.unwrap();
        root.user_grant_role("root", "root").await.unwrap();
        let server_role = "usbwire-server-bench-3";
        root.role_add(server_role).await.unwrap();
        for permission in [
            Permission::read_write(keys.server(me)),
            Permission::read_write(format!("test/devices/{me}/")).with_prefix(),
            Permission::read(keys.reservations_of(me)).with_prefix(),
            Permission::read_write("test/index/").with_prefix(),
        ] {
            root.role_grant_permission(server_role, permission).await.unwrap();
        }
        root.user_add("bench-3", "server-pw", None).await.unwrap();
        root.user_grant_role("bench-3", server_role).await.unwrap();
        root.role_add("usbwire-client").await.unwrap();
        for permission in
            [Permission::read("test/").with_prefix(), Permission::read_write("test/reservations/").with_prefix()]
        {
            root.role_grant_permission("usbwire-client", permission).await.unwrap();
        }
        root.user_add("lab-client", "client-pw", None).await.unwrap();
        root.user_grant_role("lab-client", "usbwire-client").await.unwrap();
        root.auth_enable().await.unwrap();
        let login = |user: &'static str, password: &'static str| {
            let url = cluster.url(0);
            async move { Client::connect([url], Some(ConnectOptions::new().with_user(user, password))).await.unwrap() }
        };

        // The server: what `publish` does, under its lease.
        let mut server_client = login("bench-3", "server-pw").await;
        let lease = server_client.lease_grant(5, None).await.unwrap().id();
        let on_lease = || Some(PutOptions::new().with_lease(lease));
        let entry = json(&server(me, Some(&format!("sha256:{}", "ab".repeat(32)))));
        let register = Txn::new()
            .when([Compare::value(keys.server(me), CompareOp::Equal, entry.clone())])
            .or_else([TxnOp::put(keys.server(me), entry, on_lease())]);
        server_client.txn(register).await.expect("a server registers itself");
        let own = device(me, "1-1");
        for busid in ["1-1", "1-2"] {
            let own = device(me, busid);
            server_client.put(keys.device(me, busid), json(&own), on_lease()).await.expect("and its devices");
            for key in keys.index_entries(&own).into_iter().chain(keys.free_entries(&own)) {
                server_client.put(key, Availability::AVAILABLE, on_lease()).await.expect("their index and free keys");
            }
        }
        server_client
            .get(keys.reservations_of(me), Some(GetOptions::new().with_prefix()))
            .await
            .expect("it reads its reservations");
        let other = "other:3240";
        let planted = [
            (keys.server(other), json(&server(other, None))),
            (keys.device(other, "1-1"), json(&device(other, "1-1"))),
            (keys.reservation(me, "1-1"), "{}".to_owned()),
        ];
        for (key, value) in &planted {
            let result = server_client.put(key.clone(), value.clone(), None).await;
            assert!(result.is_err(), "a server wrote {key}");
        }

        // A client: reads the fleet, reserves, cannot plant a server or a device.
        let mut client = login("lab-client", "client-pw").await;
        let mut lab = Lab {
            endpoint: cluster.endpoint(&[0]),
            client: client.clone(),
            keys: keys.clone(),
            reads: Reads::default(),
            takes_free_keys: true,
        };
        let fleet = lab.fleet().await.expect("a client reads the fleet");
        assert_eq!((fleet.servers.len(), fleet.devices.len()), (1, 2));
        let want: Want = "label=kbd".parse().unwrap();
        let hold = Hold::WhileRunning { ttl: Duration::from_secs(5), until: None };
        // It may not delete the free keys its reservation's transaction would: refused
        // once, it takes the device without them (the server deletes them).
        let free_before = client.get(keys.free_of("label", "kbd"), Some(GetOptions::new().with_prefix())).await;
        let before = lab.reads();
        let taken = lab.reserve(&want, hold, "test").await.expect("a client reserves");
        assert_eq!(taken.server.address, me);
        assert_eq!(lab.reads().transactions - before.transactions, 2, "refused once, then taken");
        let free_after = client.get(keys.free_of("label", "kbd"), Some(GetOptions::new().with_prefix())).await;
        assert_eq!(free_after.unwrap().count(), free_before.unwrap().count(), "a client deleted a free key");
        let before = lab.reads();
        let second = lab.reserve(&want, hold, "test").await.expect("a client reserves again");
        assert_eq!(lab.reads().transactions - before.transactions, 1, "not refused again");
        second.release().await.expect("a client releases its reservation");
        for (key, value) in &planted[..2] {
            let result = client.put(key.clone(), value.clone(), None).await;
            assert!(result.is_err(), "a client wrote {key}");
        }
        let index = keys.index_entries(&own).remove(0);
        assert!(client.put(index, Availability::AVAILABLE, None).await.is_err(), "a client wrote the index");
        taken.release().await.expect("a client releases its reservation");
        server_client.lease_revoke(lease).await.expect("a server leaves");
    }
}
