//! The server's side: register in the lab registry, keep the registration
//! alive and current, and enforce the reservations made there.
//!
//! One task per server ([`publish`]). It grants a lease, puts the server's
//! entry and one entry per exported device under it (with the device's index
//! keys, and its free-device keys while it is available and not reserved:
//! `entry`), then follows three things at once: the server's device list
//! (each change is published as it happens), the lease (renewed every third
//! of its time to live, through another member when one goes away) and the
//! reservations of this server's devices (handed to the server, which refuses
//! imports without the reservation's token; the reservation changes that came
//! while the server was writing are taken in together and written in one
//! transaction). One lease for as long as the server runs: a lost
//! connection is set up again under the same lease while etcd keeps it, and
//! only a lease that expired (etcd unreachable for its time to live) is
//! replaced. When etcd cannot be reached the server serves on as if it had
//! no registry (reservations are not enforced meanwhile) and registers
//! again once etcd answers. Stopping the task the way [`publish`] says
//! revokes the lease, so the server leaves the registry at once. Its writes are
//! paced by how long etcd takes to answer them (`pace`), so that a lab's
//! servers registering all at once do not hold up each other's renewals.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions, WatchResponse,
};
use futures_util::{FutureExt as _, StreamExt as _};
use tracing::{debug, info, warn};
use usbwire_device::devstate::ReservedFor;
use usbwire_device::record::DeviceJson;
use usbwire_device::{DeviceFacts, Selector};
use usbwire_proto::retry::Retry;
use usbwire_server::reservation::ReservationDigest;
use usbwire_server::{state_entry, ExportInfo, Registry, Reservation};

use crate::entry::{decode, Availability, DeviceEntry, Key, Keys, ReservationEntry, ServerEntry, SCHEMA_VERSION};
use crate::error::LabError;
use crate::etcd::{keep_alive, Endpoint};
use crate::pace::Pace;

mod lease;
use crate::request;
use lease::{Lease, UNKNOWN};

/// Operations in one of a server's transactions (etcd's default limit is
/// 128). A thousand servers starting at once each keep one transaction in
/// flight, and etcd answers a lease renewal only after applying what it
/// committed before it: with 100 a 100 000-device storm (1 000 × 100) lost
/// leases on two vCPUs, with 25 it registered in 30–36 s and lost none; 100
/// registers 10 000 devices from 100 servers in 1.65 s, 25 in 2.58 s
/// (BENCHMARKS, "Reservations at 100 000 devices").
const OPS_PER_TXN: usize = 25;
/// Operations in a transaction that writes what reservations changed (a
/// device's index keys and free keys, 6-10 operations a device): the
/// reservations a server takes in at once are few but come in bursts (every
/// client reserving before a release), each transaction is a proposal every
/// etcd member applies, and this fits a burst of ten devices in one where
/// [`OPS_PER_TXN`] would make three or four (etcd's default limit is 128).
const OPS_PER_TXN_OF_RESERVATIONS: usize = 100;
/// A registration that ended sooner than this counts as a failed attempt, so a
/// registry that accepts and drops at once is retried with [`Retry::PATIENT`]'s
/// waits, not in a tight loop.
const SETTLED: Duration = Duration::from_secs(1);
/// The deadline of the server's requests: long, so that in a registration
/// storm (every server of a lab starting at once) a write is waited for
/// while etcd works through the queue, never sent again meanwhile (see
/// [`Endpoint::connect_with`]).
const WRITE_DEADLINE: Duration = Duration::from_secs(30);

/// What a server registers, and where.
#[derive(Clone, Debug)]
pub struct Registration {
    pub endpoint: Endpoint,
    /// The lease's time to live: how long a dead server stays listed.
    pub ttl: Duration,
    pub server: ServerEntry,
    /// Labels for devices that match a selector (`[[bind]] labels`, `[[virtual]] labels`).
    pub labels: Vec<(Selector, Vec<String>)>,
}

/// Registers the server and keeps the registry current until `stop`
/// resolves, then revokes the lease (for at most `lease::DEREGISTER_WITHIN`), so
/// the server's entries leave the registry at once. Never fails: an
/// unreachable registry is logged once and retried. Aborting the task
/// instead leaves the entries to expire with the lease.
pub async fn publish(registration: Registration, registry: Registry, stop: impl Future<Output = ()>) {
    let mut lease = None;
    tokio::select! {
        never = register(&registration, &registry, &mut lease) => match never {},
        () = stop => {}
    }
    if let Some(lease) = lease {
        lease.revoke(&registration.endpoint).await;
    }
}

/// Registers, and again each time the connection is lost; `lease` is the
/// server's lease while it has one.
async fn register(registration: &Registration, registry: &Registry, lease: &mut Option<Lease>) -> Infallible {
    let url = registration.endpoint.url.to_string();
    let mut backoff = Retry::PATIENT.backoff();
    let mut registered_before = false;
    let mut said_unreachable = false;
    loop {
        tokio::time::sleep(backoff.next_delay()).await;
        let error = match Session::start(registration, registry, lease).await {
            Ok((mut session, held)) => {
                info!(
                    registry = %url,
                    server = %registration.server.address,
                    devices = session.devices,
                    ttl_secs = registration.ttl.as_secs(),
                    lease = format_args!("{:x}", held.id),
                    "{}",
                    if registered_before { "registered again in the lab registry" } else { "registered in the lab registry" }
                );
                registered_before = true;
                said_unreachable = false;
                let started = tokio::time::Instant::now();
                let error = session.run(registration, registry, held).await;
                // The member we talked to went away (or the lease or watch ended):
                // register again at once through another, under the same lease if
                // etcd still keeps it, reservations still in force meanwhile; only
                // a cluster that does not answer at all makes the server serve
                // without them.
                info!(registry = %url, %error, "lost the lab registry connection; registering again");
                if started.elapsed() >= SETTLED {
                    backoff.reset();
                }
                continue;
            }
            Err(error) => error,
        };
        // Not enforceable while the registry cannot be read: serve directly.
        registry.forget_reservations();
        if said_unreachable {
            debug!(registry = %url, %error, "lab registry still unreachable");
        } else {
            warn!(registry = %url, %error, "lab registry unreachable; serving directly and trying again");
            said_unreachable = true;
        }
    }
}

/// One connection's registration: a client, and what it follows.
struct Session {
    client: Client,
    keys: Keys,
    devices: usize,
    reservations: HashMap<String, Reservation>,
    /// Each device's keys and values as the last sync made them (by bus id):
    /// a reservation's change recomputes only its device's.
    desired: HashMap<String, HashMap<String, Vec<u8>>>,
    /// Each device's term catalogs (`catalog`), by bus id, as the last sync made them.
    term_catalogs: HashMap<String, Vec<String>>,
    revision: i64,
    /// The reservations' changes after `revision`, set up by `start`.
    watch: Option<etcd_client::WatchStream>,
    /// How long to wait before each write: longer while etcd is behind (`pace`).
    pace: Pace,
}

impl Session {
    /// Connects, takes up `lease` again if etcd still keeps it (else grants
    /// a new one), and puts the server's entry and its devices under it.
    async fn start<'l>(
        registration: &Registration,
        registry: &Registry,
        lease: &'l mut Option<Lease>,
    ) -> Result<(Self, &'l mut Lease), LabError> {
        let mut client = registration.endpoint.connect_with(WRITE_DEADLINE).await?;
        let keys = Keys::new(&registration.endpoint.url.prefix);
        let alive = match lease.as_ref() {
            Some(held) => held.alive(&mut client).await?,
            None => false,
        };
        let kept = if alive { lease.take() } else { None };
        let taken_up_again = kept.is_some();
        let held = match kept {
            Some(mut held) => {
                held.client = client.clone();
                if held.renewing.is_finished() {
                    held.renewing = tokio::spawn(keep_alive(
                        registration.endpoint.clone(),
                        client.clone(),
                        held.id,
                        registration.ttl,
                    ));
                }
                lease.insert(held)
            }
            None => {
                // Dropping the old one stops its renewal.
                *lease = None;
                let ttl = i64::try_from(registration.ttl.as_secs().max(1)).unwrap_or(i64::MAX);
                let id = request::lease_grant(&client, ttl).await?;
                let renewing =
                    tokio::spawn(keep_alive(registration.endpoint.clone(), client.clone(), id, registration.ttl));
                lease.insert(Lease {
                    id,
                    client: client.clone(),
                    renewing,
                    published: HashMap::new(),
                    layouts: HashMap::new(),
                    unsure: false,
                })
            }
        };
        // Its devices go in catalogs too (`catalog`), which lists read.
        let server = &ServerEntry {
            catalog: true,
            catalog_terms: crate::catalog::TERM_KINDS.map(String::from).to_vec(),
            ..registration.server.clone()
        };
        let key = keys.server(&server.address);
        let entry = serde_json::to_string(server).unwrap_or_default();
        // Put only if not already there under this lease (a connection set up
        // again): watchers see a change only when there is one.
        let put = Txn::new()
            .when([
                Compare::value(key.clone(), CompareOp::Equal, entry.clone()),
                Compare::lease(key.clone(), CompareOp::Equal, held.id),
            ])
            .or_else([TxnOp::put(key, entry, Some(PutOptions::new().with_lease(held.id)))]);
        request::txn(&client, put).await?;
        let mut session = Self {
            client,
            keys,
            devices: 0,
            reservations: HashMap::new(),
            desired: HashMap::new(),
            term_catalogs: HashMap::new(),
            revision: 0,
            watch: None,
            pace: Pace::new(),
        };
        // Reservations now (the index shows them), then every change after them.
        let reserved = request::get(
            &session.client,
            session.keys.reservations_of(&server.address),
            Some(GetOptions::new().with_prefix()),
        )
        .await?;
        session.revision = reserved.header().map_or(0, |h| h.revision());
        for kv in reserved.kvs() {
            session.reservation_changed(kv.key(), Some(kv.value()));
        }
        registry.set_reservations(session.reservations.clone());
        // Watched from right after that read, before the devices are put: a
        // watch that starts far behind the current revision makes etcd scan
        // every change since (a storm's worth of other servers' writes),
        // which holds up every write and every lease renewal meanwhile.
        let options = WatchOptions::new().with_prefix().with_start_revision(session.revision + 1);
        let watch = session.client.watch(session.keys.reservations_of(&server.address), Some(options)).await?;
        session.watch = Some(watch);
        if held.unsure {
            held.read_back_catalogs(&session.client, &session.keys, &server.address).await?;
        }
        // After the reservations' read: what changed since is in the watch.
        if taken_up_again {
            held.read_back_free_keys(&session.client, &session.keys).await?;
        }
        session.sync(registration, registry, held).await?;
        Ok((session, held))
    }

    /// Follows the device list, the lease and the reservations until one of them fails.
    async fn run(&mut self, registration: &Registration, registry: &Registry, lease: &mut Lease) -> LabError {
        let mut changes = registry.changes();
        let Some(mut watch) = self.watch.take() else {
            return LabError::Unreachable {
                url: registration.endpoint.url.to_string(),
                reason: "no reservation watch".into(),
                tls: false,
            };
        };
        loop {
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return LabError::Unreachable { url: registration.endpoint.url.to_string(), reason: "server stopped".into(), tls: false };
                    }
                    if let Err(error) = self.sync(registration, registry, lease).await {
                        return error;
                    }
                }
                lost = &mut lease.renewing => {
                    return lost.unwrap_or_else(|_| LabError::LeaseLost { lease: lease.id, reason: "renewal stopped".into() });
                }
                message = watch.message() => {
                    let mut reserved_or_not = Vec::new();
                    if let Err(error) = self.take_in(registration, message, &mut reserved_or_not) {
                        return error;
                    }
                    // What came meanwhile is taken in too: one write for a burst of reservations.
                    while let Some(message) = watch.next().now_or_never() {
                        let message = message.transpose();
                        if let Err(error) = self.take_in(registration, message, &mut reserved_or_not) {
                            return error;
                        }
                    }
                    reserved_or_not.sort();
                    reserved_or_not.dedup();
                    registry.set_reservations(self.reservations.clone());
                    // The index says which devices are reserved: only theirs change.
                    if let Err(error) = self.sync_devices(registration, registry, lease, &reserved_or_not).await {
                        return error;
                    }
                }
            }
        }
    }

    /// Takes in one message of the reservation watch: the bus ids of the
    /// devices whose reservations changed go to `changed`.
    fn take_in(
        &mut self,
        registration: &Registration,
        message: Result<Option<WatchResponse>, etcd_client::Error>,
        changed: &mut Vec<String>,
    ) -> Result<(), LabError> {
        let unreachable =
            |reason: String| LabError::Unreachable { url: registration.endpoint.url.to_string(), reason, tls: false };
        let response = message?.ok_or_else(|| unreachable("the reservation watch ended".into()))?;
        if response.canceled() {
            return Err(unreachable(format!("the reservation watch was cancelled: {}", response.cancel_reason())));
        }
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            let value = (event.event_type() == EventType::Put).then(|| kv.value());
            changed.extend(self.reservation_changed(kv.key(), value));
        }
        Ok(())
    }

    /// Puts what changed in the device list and its index under `lease`, and
    /// deletes what went, in as few transactions as fit. What a failed
    /// transaction may or may not have done is put (or deleted) again next time.
    async fn sync(
        &mut self,
        registration: &Registration,
        registry: &Registry,
        lease: &mut Lease,
    ) -> Result<(), LabError> {
        let exports = registry.list();
        let mut desired = HashMap::with_capacity(exports.len());
        let mut term_catalogs = HashMap::with_capacity(exports.len());
        for export in &exports {
            let (keys, catalogs) = self.keys_of(registration, export);
            let busid = export.record.busid.as_str().to_owned();
            term_catalogs.insert(busid.clone(), catalogs);
            desired.insert(busid, keys);
        }
        (self.desired, self.term_catalogs) = (desired, term_catalogs);
        // The catalog before the device keys it repeats: see `catalog`.
        let catalog = self.catalog_changes(registration, lease);
        self.write(catalog, lease).await?;
        // Key → the value to put, or `None` to delete it.
        let mut changes: Vec<(String, Option<Vec<u8>>)> = Vec::new();
        for (key, value) in self.desired.values().flatten() {
            if lease.published.get(key) != Some(value) {
                changes.push((key.clone(), Some(value.clone())));
            }
        }
        let now: std::collections::HashSet<&String> = self.desired.values().flat_map(|keys| keys.keys()).collect();
        let catalogs_of = self.keys.catalogs_of(&registration.server.address);
        for key in lease.published.keys().filter(|key| !now.contains(key) && !key.starts_with(&catalogs_of)) {
            changes.push((key.clone(), None));
        }
        self.devices = exports.len();
        self.write(changes, lease).await
    }

    /// What to write of the catalogs (`catalog`) for the device entries of
    /// `desired` (`catalog::changes`); notes the layouts written in `lease`.
    fn catalog_changes(&self, registration: &Registration, lease: &mut Lease) -> Vec<(String, Option<Vec<u8>>)> {
        let address = &registration.server.address;
        let mut busids: Vec<&String> = self.desired.keys().collect();
        busids.sort();
        // Catalog prefix → its devices' bus ids and entries, in bus id order.
        let all = self.keys.catalog_of(address);
        let mut catalogs: BTreeMap<&str, Vec<(&str, &[u8])>> = BTreeMap::from([(all.as_str(), Vec::new())]);
        for busid in busids {
            let Some(entry) = self.desired.get(busid).and_then(|keys| keys.get(&self.keys.device(address, busid)))
            else {
                continue;
            };
            let terms = self.term_catalogs.get(busid).into_iter().flatten().map(String::as_str);
            for prefix in std::iter::once(all.as_str()).chain(terms) {
                catalogs.entry(prefix).or_default().push((busid.as_str(), entry.as_slice()));
            }
        }
        crate::catalog::changes(&catalogs, &self.keys.catalogs_of(address), &lease.published, &mut lease.layouts)
    }

    /// [`Session::sync`] for the devices `busids` alone (their reservations
    /// changed): their keys are made again and what changed is written; the
    /// other devices' are as the last sync left them. Their free keys are
    /// written whatever was published: a reservation's transaction deletes
    /// those under its selector's terms (`take`), and one released before
    /// this server saw it leaves them deleted.
    async fn sync_devices(
        &mut self,
        registration: &Registration,
        registry: &Registry,
        lease: &mut Lease,
        busids: &[String],
    ) -> Result<(), LabError> {
        let exports = registry.list();
        let mut changes: Vec<(String, Option<Vec<u8>>)> = Vec::new();
        for busid in busids {
            let Some(export) = exports.iter().find(|export| export.record.busid.as_str() == busid) else { continue };
            let (keys, catalogs) = self.keys_of(registration, export);
            self.term_catalogs.insert(busid.clone(), catalogs);
            let before = self.desired.remove(busid).unwrap_or_default();
            for (key, value) in &keys {
                if lease.published.get(key) != Some(value) || self.keys.is_free_entry(key) {
                    changes.push((key.clone(), Some(value.clone())));
                }
            }
            for key in before.keys().filter(|key| {
                !keys.contains_key(*key) && (lease.published.contains_key(*key) || self.keys.is_free_entry(key))
            }) {
                changes.push((key.clone(), None));
            }
            self.desired.insert(busid.clone(), keys);
        }
        // An entry that changed changes its chunk, written first.
        let address = &registration.server.address;
        if busids.iter().any(|busid| {
            let key = self.keys.device(address, busid);
            changes.iter().any(|(changed, _)| *changed == key)
        }) {
            let catalog = self.catalog_changes(registration, lease);
            self.write(catalog, lease).await?;
        }
        self.write_in(changes, lease, Some(OPS_PER_TXN_OF_RESERVATIONS)).await
    }

    /// A device's keys and values: its entry, its index keys with its state,
    /// and its free keys while it is available and not reserved; and the
    /// term catalogs its entry goes in. A reservation or its end so changes
    /// the free keys alone (its three or so deletions or puts, not as many
    /// again for the index).
    fn keys_of(&self, registration: &Registration, export: &ExportInfo) -> (HashMap<String, Vec<u8>>, Vec<String>) {
        let address = &registration.server.address;
        let entry = device_entry(address, export, &registration.labels);
        let state = entry.state().as_bytes().to_vec();
        let mut keys: HashMap<String, Vec<u8>> =
            self.keys.index_entries(&entry).into_iter().map(|key| (key, state.clone())).collect();
        let availability = Availability::of(entry.state(), self.reservations.contains_key(&entry.record.busid));
        if availability == Availability::AVAILABLE {
            keys.extend(
                self.keys
                    .free_entries(&entry)
                    .into_iter()
                    .map(|key| (key, Availability::AVAILABLE.as_bytes().to_vec())),
            );
        }
        keys.insert(self.keys.device(address, &entry.record.busid), serde_json::to_vec(&entry).unwrap_or_default());
        (keys, crate::catalog::term_catalogs(&self.keys, &entry))
    }

    /// Writes `changes` (a key's new value, or `None` to delete it) under
    /// `lease`, as many to a transaction as [`Pace::window`] allows, at
    /// most [`OPS_PER_TXN`], each after the pause [`Pace`] asks for, and
    /// notes what was published.
    async fn write(&mut self, changes: Vec<(String, Option<Vec<u8>>)>, lease: &mut Lease) -> Result<(), LabError> {
        self.write_in(changes, lease, None).await
    }

    /// [`Session::write`], `per_txn` operations to a transaction if given.
    async fn write_in(
        &mut self,
        changes: Vec<(String, Option<Vec<u8>>)>,
        lease: &mut Lease,
        per_txn: Option<usize>,
    ) -> Result<(), LabError> {
        let count = changes.len();
        let mut rest = changes.as_slice();
        while !rest.is_empty() {
            let size = per_txn.unwrap_or_else(|| self.pace.window(OPS_PER_TXN));
            let (batch, after) = rest.split_at(size.clamp(1, rest.len()));
            rest = after;
            let ops: Vec<TxnOp> = batch
                .iter()
                .map(|(key, value)| match value {
                    Some(value) => TxnOp::put(key.clone(), value.clone(), Some(PutOptions::new().with_lease(lease.id))),
                    None => TxnOp::delete(key.clone(), None),
                })
                .collect();
            tokio::time::sleep(self.pace.wait()).await;
            let sent = tokio::time::Instant::now();
            let done = request::txn(&self.client, Txn::new().and_then(ops)).await;
            self.pace.answered_in(sent.elapsed());
            for (key, value) in batch {
                match (value, &done) {
                    (Some(value), Ok(_)) => lease.published.insert(key.clone(), value.clone()),
                    (Some(_), Err(_)) => lease.published.insert(key.clone(), UNKNOWN.to_vec()),
                    (None, Ok(_)) => lease.published.remove(key),
                    // Still listed: deleted again next time.
                    (None, Err(_)) => None,
                };
            }
            if done.is_err() {
                lease.unsure = true;
            }
            done?;
        }
        if count > 0 {
            debug!(changed = count, "published device changes");
        }
        Ok(())
    }

    /// Takes in a change of a reservation of this server's: the device's bus
    /// id, if the key is one.
    fn reservation_changed(&mut self, key: &[u8], value: Option<&[u8]>) -> Option<String> {
        let Some(Key::Reservation { busid, .. }) = self.keys.parse(key) else { return None };
        let reservation = value.and_then(decode::<ReservationEntry>).and_then(|entry| {
            let digest = digest_from_hex(&entry.token_sha256)?;
            let ReservationEntry { holder, client, since_at, until_at, .. } = entry;
            Some(Reservation {
                digest,
                reserved_for: ReservedFor { holder, client, since_at: Some(since_at), until_at },
            })
        });
        match reservation {
            Some(reservation) => {
                info!(%busid, holder = %reservation.reserved_for.holder, "device reserved in the lab registry");
                self.reservations.insert(busid.clone(), reservation);
            }
            // Gone; an unreadable one counts as none (and is logged).
            None => {
                if value.is_some() {
                    warn!(%busid, "unreadable reservation in the lab registry; ignored");
                }
                if self.reservations.remove(&busid).is_some() {
                    info!(%busid, "reservation ended");
                }
            }
        }
        Some(busid)
    }
}

/// What the registry shows of an exported device: its device record (the
/// same as `usbwire state` shows), its classes for the index, and its labels.
pub fn device_entry(server: &str, export: &ExportInfo, labels: &[(Selector, Vec<String>)]) -> DeviceEntry {
    let record = &export.record;
    let facts = export_facts(export);
    let mut device_labels: Vec<String> = Vec::new();
    for (selector, names) in labels {
        if selector.matches(&facts) {
            for name in names {
                if !device_labels.contains(name) {
                    device_labels.push(name.clone());
                }
            }
        }
    }
    DeviceEntry {
        schema_version: SCHEMA_VERSION,
        server: server.to_owned(),
        record: DeviceJson::from(&state_entry(export.clone())),
        class: format!("{:02x}", record.b_device_class),
        interface_classes: record.interfaces.iter().map(|i| format!("{:02x}", i.b_interface_class)).collect(),
        labels: device_labels,
    }
}

/// What a selector can ask of an exported device: its record, and its
/// serial number where it has one.
fn export_facts(export: &ExportInfo) -> DeviceFacts<'_> {
    let serial = &export.summary.serial;
    DeviceFacts::of_record(&export.record, (!serial.is_empty()).then_some(serial.as_str()))
}

fn digest_from_hex(hex: &str) -> Option<ReservationDigest> {
    usbwire_proto::reservation::ReservationToken::from_hex(hex).map(|token| token.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::timestamp;
    use crate::testing::Cluster;

    fn registration(endpoint: Endpoint, ttl: Duration) -> Registration {
        Registration {
            endpoint,
            ttl,
            server: ServerEntry {
                schema_version: SCHEMA_VERSION,
                address: "127.0.0.1:3240".to_owned(),
                tls_fingerprint: None,
                plain: true,
                implementation: "usbwire".to_owned(),
                version: "test".to_owned(),
                started_at: timestamp(std::time::SystemTime::now()),
                catalog: false,
                catalog_terms: Vec::new(),
            },
            labels: Vec::new(),
        }
    }

    fn loopback() -> Box<dyn usbwire_device::Device> {
        Box::new(usbwire_gadgets::loopback(usbwire_device::Speed::HIGH))
    }

    fn exporting_loopbacks(devices: usize) -> usbwire_server::Server {
        let mut server = usbwire_server::Server::new(usbwire_server::ServerConfig::default());
        for _ in 0..devices {
            server.export("loopback", loopback());
        }
        server
    }

    /// Every key under the test prefix: (key, lease, revision it was last put at).
    async fn published(client: &mut Client) -> Vec<(String, i64, i64)> {
        let all = client.get("test/", Some(GetOptions::new().with_prefix())).await.expect("read the registry");
        all.kvs()
            .iter()
            .map(|kv| (String::from_utf8_lossy(kv.key()).into_owned(), kv.lease(), kv.mod_revision()))
            .collect()
    }

    /// Waits until the server's entry, its `devices` device entries and their index are there.
    async fn registered(client: &mut Client, devices: usize) -> Vec<(String, i64, i64)> {
        for _ in 0..100 {
            let keys = published(client).await;
            let device_keys = keys.iter().filter(|(key, ..)| key.starts_with("test/devices/") && !key.contains("/!"));
            if device_keys.count() == devices && keys.iter().any(|(key, ..)| key.starts_with("test/servers/")) {
                return keys;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("not registered with {devices} device(s) within 10 s: {:?}", published(client).await);
    }

    fn one_lease(keys: &[(String, i64, i64)]) -> i64 {
        let leases: std::collections::HashSet<i64> = keys.iter().map(|(_, lease, _)| *lease).collect();
        assert_eq!(leases.len(), 1, "every entry under one lease: {keys:?}");
        leases.into_iter().next().unwrap_or_default()
    }

    /// Issue 18: an idle server lost its lease every time to live and put
    /// everything again under a new one (watchers saw the fleet vanish and
    /// come back every 10 s); and a stopped server stayed listed until its
    /// lease expired.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_quiet_server_keeps_its_lease_and_leaves_at_once_when_stopped() {
        let Some(cluster) = Cluster::start(1, "quiet_server").await else { return };
        let mut server = usbwire_server::Server::new(usbwire_server::ServerConfig::default());
        server.export("loopback", loopback());
        let ttl = Duration::from_secs(2);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stopped = async move {
            let _ = stopped.await;
        };
        let publishing =
            tokio::spawn(publish(registration(cluster.endpoint(&[0]), ttl), server.registry().clone(), stopped));
        let mut client = cluster.client(0).await;
        let first = registered(&mut client, 1).await;
        let lease = one_lease(&first);
        tokio::time::sleep(ttl * 4).await;
        assert_eq!(published(&mut client).await, first, "nothing put again, nothing under another lease");
        assert!(client.lease_time_to_live(lease, None).await.expect("ttl").ttl() > 0);

        let stopping = tokio::time::Instant::now();
        let _ = stop.send(());
        publishing.await.expect("publishing ends");
        assert!(stopping.elapsed() < Duration::from_secs(1), "left in {:?}", stopping.elapsed());
        assert_eq!(published(&mut client).await, [], "the lease is revoked with everything under it");
    }

    /// A connection lost and set up again (here: etcd restarted within the
    /// time to live) keeps the lease: entries are not put again, and changes
    /// after it are published under the same lease.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_connection_registers_again_under_the_same_lease() {
        let Some(mut cluster) = Cluster::start(1, "same_lease").await else { return };
        let mut server = usbwire_server::Server::new(usbwire_server::ServerConfig::default());
        server.export("loopback", loopback());
        let ttl = Duration::from_secs(6);
        let publishing = tokio::spawn(publish(
            registration(cluster.endpoint(&[0]), ttl),
            server.registry().clone(),
            std::future::pending(),
        ));
        let mut client = cluster.client(0).await;
        let first = registered(&mut client, 1).await;
        let lease = one_lease(&first);
        cluster.restart(0).await;
        let mut client = cluster.client(0).await;
        server.export("loopback", loopback());
        let now = registered(&mut client, 2).await;
        assert_eq!(one_lease(&now), lease, "the same lease after the connection came back");
        // The catalog's chunk changed with the second device; nothing else did.
        for entry in first.iter().filter(|(key, ..)| !key.contains("/!")) {
            assert!(now.contains(entry), "{entry:?} put again: {now:?}");
        }
        publishing.abort();
    }

    /// Waits (up to 10 s) for the server's catalog to be `chunks` chunks
    /// that hold its device entries, in key order, its catalog of each term
    /// to hold the entries with that term, and its entry to say so.
    async fn catalog_agrees(client: &mut Client, chunks: usize) {
        let keys = Keys::new("test");
        let mut last = String::new();
        for _ in 0..100 {
            let all = client.get("test/devices/", Some(GetOptions::new().with_prefix())).await.expect("read");
            let (catalogs, devices): (Vec<_>, Vec<_>) =
                all.kvs().iter().partition(|kv| kv.key().starts_with(keys.catalogs_of("127.0.0.1:3240").as_bytes()));
            let keyed: Vec<DeviceEntry> =
                devices.iter().map(|kv| serde_json::from_slice(kv.value()).expect("an entry")).collect();
            // Catalog prefix → the entries its chunks hold, and should.
            let mut held: BTreeMap<String, Vec<DeviceEntry>> = BTreeMap::new();
            for kv in &catalogs {
                let key = String::from_utf8_lossy(kv.key());
                // A marker: the whole catalog's devices with the term, as a reader takes it.
                if let Some(prefix) = key.strip_suffix(crate::catalog::READ_WHOLE) {
                    let with_term =
                        keyed.iter().filter(|e| crate::catalog::term_catalogs(&keys, e).iter().any(|p| p == prefix));
                    held.entry(prefix.to_owned()).or_default().extend(with_term.cloned());
                    continue;
                }
                let prefix = key[..key.len() - 6].to_owned();
                held.entry(prefix).or_default().extend(crate::catalog::read_chunk("127.0.0.1:3240", kv.value()));
            }
            let mut expected = BTreeMap::from([(keys.catalog_of("127.0.0.1:3240"), keyed.clone())]);
            for entry in &keyed {
                for prefix in crate::catalog::term_catalogs(&keys, entry) {
                    expected.entry(prefix).or_default().push(entry.clone());
                }
            }
            let full = catalogs.iter().filter(|kv| kv.key().starts_with(keys.catalog_of("127.0.0.1:3240").as_bytes()));
            let server = client.get(keys.server("127.0.0.1:3240"), None).await.expect("read");
            let entry: Option<ServerEntry> = server.kvs().first().and_then(|kv| decode(kv.value()));
            let says = entry.is_some_and(|entry| entry.catalog && entry.catalog_terms == crate::catalog::TERM_KINDS);
            if full.count() == chunks && held == expected && says {
                return;
            }
            let sizes = |catalogs: &BTreeMap<String, Vec<DeviceEntry>>| -> Vec<String> {
                catalogs.iter().map(|(prefix, entries)| format!("{prefix}: {}", entries.len())).collect()
            };
            last = format!("the chunks hold {:?}, the device keys say {:?}", sizes(&held), sizes(&expected));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the catalogs are not {chunks} chunk(s) of the device entries and theirs of each term: {last}");
    }

    /// Issue 36: a server's catalog repeats its device entries, 64 a chunk,
    /// in bus id order, as devices come: 60 in one chunk, then 70 in two
    /// (devices `0-61`… sort among the first chunk's, which changes too);
    /// and its catalogs of each label, VID:PID and class hold the entries
    /// with that term.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_catalog_repeats_the_device_entries_as_devices_come() {
        let Some(cluster) = Cluster::start(1, "catalog").await else { return };
        let mut server = exporting_loopbacks(60);
        let mut registration = registration(cluster.endpoint(&[0]), Duration::from_secs(6));
        registration.labels = vec![("class=03".parse().unwrap(), vec!["kbd".to_owned(), "desk".to_owned()])];
        let publishing = tokio::spawn(publish(registration, server.registry().clone(), std::future::pending()));
        let mut client = cluster.client(0).await;
        registered(&mut client, 60).await;
        catalog_agrees(&mut client, 1).await;
        for _ in 0..9 {
            server.export("loopback", loopback());
        }
        server.export("keyboard", Box::new(usbwire_gadgets::keyboard().0));
        registered(&mut client, 70).await;
        catalog_agrees(&mut client, 2).await;
        publishing.abort();
    }

    /// Issue 36: the reservations a server takes in at once (here sixteen
    /// in one transaction, as a burst of clients makes them) take their
    /// devices' free keys away in one transaction, not one for every 25
    /// operations: each is a proposal every etcd member applies. The index
    /// keys still say the devices' state (a reservation does not rewrite
    /// them), and nothing else was written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_of_reservations_is_written_to_the_index_in_one_transaction() {
        let Some(cluster) = Cluster::start(1, "burst").await else { return };
        let server = exporting_loopbacks(16);
        let publishing = tokio::spawn(publish(
            registration(cluster.endpoint(&[0]), Duration::from_secs(6)),
            server.registry().clone(),
            std::future::pending(),
        ));
        let mut client = cluster.client(0).await;
        let keys = Keys::new("test");
        let before = registered(&mut client, 16).await;
        let free = |published: &[(String, i64, i64)]| {
            published.iter().filter(|(key, ..)| key.starts_with("test/index/free/")).count()
        };
        let index = |published: &[(String, i64, i64)]| -> Vec<(String, i64)> {
            published
                .iter()
                .filter(|(key, ..)| key.starts_with("test/index/") && !key.starts_with("test/index/free/"))
                .map(|(key, _, revision)| (key.clone(), *revision))
                .collect()
        };
        let ops_a_device = free(&before) / 16;
        assert!(16 * ops_a_device > OPS_PER_TXN, "the burst takes more than one of the usual transactions");
        assert_eq!(free(&before), index(&before).len());
        let json = reservation_json();
        let puts: Vec<TxnOp> = server
            .registry()
            .list()
            .iter()
            .map(|export| {
                TxnOp::put(keys.reservation("127.0.0.1:3240", export.record.busid.as_str()), json.clone(), None)
            })
            .collect();
        let reserved_at = client.txn(Txn::new().and_then(puts)).await.unwrap().header().unwrap().revision();
        let mut after = Vec::new();
        for _ in 0..100 {
            after = published(&mut client).await;
            if free(&after) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(free(&after), 0, "every device reserved, none free: {after:?}");
        assert_eq!(index(&after), index(&before), "the index keys not rewritten");
        let now = client.get("test/", Some(GetOptions::new().with_count_only())).await.unwrap();
        assert_eq!(now.header().unwrap().revision(), reserved_at + 1, "one transaction and nothing else");
        for key in index(&after).iter().map(|(key, _)| key) {
            let value = client.get(key.as_str(), None).await.unwrap();
            assert_eq!(value.kvs()[0].value(), b"available", "{key} says the device's state");
        }
        publishing.abort();
    }

    /// A reservation's record, as a client writes it.
    fn reservation_json() -> Vec<u8> {
        let entry = ReservationEntry {
            schema_version: SCHEMA_VERSION,
            holder: "test@here".to_owned(),
            client: "usbwire reserve".to_owned(),
            pid: 1,
            token_sha256: "5a".repeat(32),
            since_at: timestamp(std::time::SystemTime::now()),
            until_at: None,
        };
        serde_json::to_vec(&entry).unwrap()
    }

    /// What a client's reservation does to one device of the server's: its
    /// reservation key put and its free keys of one term deleted, in one
    /// transaction (`take`); given back at once by deleting the key.
    async fn reserve_and_give_back(client: &mut Client, keys: &Keys, busid: &str) -> String {
        let free_key = keys.free_entry("id", "1209:0005", "127.0.0.1:3240", busid);
        let reservation = keys.reservation("127.0.0.1:3240", busid);
        let take = Txn::new().and_then([
            TxnOp::put(reservation.clone(), reservation_json(), None),
            TxnOp::delete(free_key.clone(), None),
        ]);
        client.txn(take).await.unwrap();
        client.delete(reservation, None).await.unwrap();
        free_key
    }

    /// Waits (up to 30 s: a server whose member was down retries with waits
    /// of up to 5 s) for `key` to be there, and says under which lease.
    async fn comes_back(client: &mut Client, key: &str, what: &str) -> i64 {
        for _ in 0..300 {
            if let Some(kv) = client.get(key, None).await.unwrap().kvs().first() {
                return kv.lease();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{what}: the free key {key} did not come back within 30 s");
    }

    /// A server of two devices registered through a follower of a
    /// three-member cluster, and a client of another member.
    struct FollowerServer {
        server: usbwire_server::Server,
        member: usize,
        publishing: tokio::task::JoinHandle<()>,
        client: Client,
        lease: i64,
    }

    impl FollowerServer {
        async fn start(cluster: &Cluster) -> Self {
            let server = exporting_loopbacks(2);
            let member = cluster.follower().await;
            let publishing = tokio::spawn(publish(
                registration(cluster.endpoint(&[member]), Duration::from_secs(20)),
                server.registry().clone(),
                std::future::pending(),
            ));
            let mut client = cluster.client((member + 1) % 3).await;
            let lease = one_lease(&registered(&mut client, 2).await);
            Self { server, member, publishing, client, lease }
        }
    }

    /// Issue 36: a reservation's transaction deletes free keys of its device
    /// that the server published. Taken and given back while the server was
    /// not connected (its member down, its lease kept by the others), the
    /// server sees neither; once connected again under the same lease it
    /// reads back what etcd holds under it and puts the free keys back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn free_keys_deleted_while_the_server_was_away_come_back() {
        let Some(mut cluster) = Cluster::start(3, "free_keys_away").await else { return };
        let FollowerServer { server, member, publishing, mut client, lease } = FollowerServer::start(&cluster).await;
        let keys = Keys::new("test");
        let busid = server.registry().list()[0].record.busid.to_string();
        cluster.kill(member);
        let free_key = reserve_and_give_back(&mut client, &keys, &busid).await;
        cluster.restart(member).await;
        let under = comes_back(&mut client, &free_key, "after the connection came back").await;
        assert_eq!(under, lease, "the server took its lease up again (not a new one, which puts everything)");
        publishing.abort();
    }

    /// Issue 36: a reservation taken and given back before the server wrote
    /// anything for it (both changes in the server's hands at once: its
    /// member was stopped meanwhile) leaves the device free, and its free
    /// keys there, whatever the server had published.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn free_keys_of_a_reservation_given_back_at_once_come_back() {
        let Some(cluster) = Cluster::start(3, "free_keys_at_once").await else { return };
        let FollowerServer { server, member, publishing, mut client, .. } = FollowerServer::start(&cluster).await;
        let keys = Keys::new("test");
        for export in server.registry().list() {
            cluster.signal(member, "-STOP");
            let free_key = reserve_and_give_back(&mut client, &keys, export.record.busid.as_str()).await;
            cluster.signal(member, "-CONT");
            comes_back(&mut client, &free_key, "after a reservation given back at once").await;
        }
        publishing.abort();
    }

    #[test]
    fn device_entries_carry_identity_state_and_labels() {
        let mut server = usbwire_server::Server::new(usbwire_server::ServerConfig::default());
        let disk = server.export("loopback", Box::new(usbwire_gadgets::loopback(usbwire_device::Speed::HIGH)));
        let keyboard = server.export("keyboard", Box::new(usbwire_gadgets::keyboard().0));
        let labels = vec![
            (Selector::BusId(disk.to_string()), vec!["nucleo".to_owned(), "bench-3".to_owned()]),
            ("class=03".parse().unwrap(), vec!["hid".to_owned(), "nucleo".to_owned()]),
        ];
        let entries: Vec<DeviceEntry> =
            server.registry().list().iter().map(|export| device_entry("10.0.0.5:3240", export, &labels)).collect();
        let by_busid =
            |busid: &usbwire_proto::op::BusId| entries.iter().find(|e| e.record.busid == busid.as_str()).unwrap();
        let loopback = by_busid(&disk);
        assert_eq!(loopback.labels, ["nucleo", "bench-3"]);
        assert_eq!(
            (loopback.server.as_str(), loopback.state(), loopback.record.holder.as_deref()),
            ("10.0.0.5:3240", "available", None)
        );
        assert_eq!(loopback.schema_version, SCHEMA_VERSION);
        let hid = by_busid(&keyboard);
        assert_eq!(hid.labels, ["hid", "nucleo"], "each label once, in rule order");
        assert_eq!((hid.record.vendor_id.as_str(), hid.record.product_id.as_str()), ("1209", "0001"));
        assert_eq!(hid.interface_classes, ["03"]);
        assert_eq!(hid.record.speed, "high");
        let json: serde_json::Value = serde_json::to_value(hid).unwrap();
        assert_eq!(json["product"], "usbwire keyboard");
    }

    #[test]
    fn reservation_digests_parse_from_their_hex() {
        let token = usbwire_proto::reservation::ReservationToken([0x5a; 32]);
        let digest = usbwire_server::reservation::digest(&token);
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(digest_from_hex(&hex), Some(digest));
        assert_eq!(digest_from_hex("00"), None);
    }
}
