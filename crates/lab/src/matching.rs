//! The filtered list: [`Lab::fleet_matching`], the servers and devices a
//! selector matches and who holds them, at one revision, read by what points
//! at them rather than by the fleet.
//!
//! * When every registered server keeps catalogs per term (`catalog`; its
//!   entry's `catalog_terms` has the kind of one of the selector's terms:
//!   label, VID:PID or class): that term's catalog of each server, a range
//!   per server and [`SERVERS_PER_TXN`] servers a transaction, so etcd reads
//!   a key per 64 matching devices, and each transaction's chunks are
//!   decoded on a blocking thread as it arrives; then, filtered, the whole
//!   catalogs of the servers whose term catalog is a marker to read those
//!   instead (`catalog::READ_WHOLE`: most of their devices have the term).
//! * Otherwise (a selector of a serial alone, a server from before term
//!   catalogs): the index's keys under each indexed term, intersected, then
//!   those devices' own keys, [`GETS_PER_TXN`] a transaction.
//!
//! Then the reservations of the devices found: every reservation in the lab
//! in one range when there are no more than the devices found, else a range
//! of a server's when [`RESERVATIONS_BY_RANGE`] of its devices match and a
//! key each for the rest. Every
//! read is at the revision of the first, [`TXNS_IN_FLIGHT`] at once. A
//! selector without an indexed term (a bus id or a server alone) reads the
//! fleet and filters it.
//!
//! Not for the whole fleet (`pages`), taking a device (`take`), or following
//! changes ([`Lab::watch`]).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;

use etcd_client::{Client, GetResponse, Txn, TxnOp, TxnOpResponse};

use crate::entry::{decode, DeviceEntry, Fleet, FleetDevice, Key, Keys, ReservationEntry, ServerEntry, Want};
use crate::error::LabError;
use crate::lab::{prefix_end, Lab, Reads, PAGE};
use crate::request;

/// How many reads one transaction carries at most (etcd's `--max-txn-ops` is 128 by default).
const GETS_PER_TXN: usize = 128;
/// How many of a filtered list's reads are in flight at once: their round
/// trips overlap, and etcd serves reads on all its cores.
const TXNS_IN_FLIGHT: usize = 8;
/// From how many of a server's devices on a filtered list reads that
/// server's reservations in one range instead of one key each.
const RESERVATIONS_BY_RANGE: usize = 16;
/// How many servers' term catalogs, or reservations, one transaction reads (a range each).
const SERVERS_PER_TXN: usize = 16;
/// How many chunks one range of a term catalog returns (2 048 devices); a
/// bigger catalog is read on in ranges of as many.
const CHUNKS_PER_READ: i64 = 32;

/// Key-value pairs read.
type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// One read of a filtered list.
enum Read {
    /// These keys, in one transaction.
    Keys(Vec<String>),
    /// Every key under each of these prefixes: a range each in one
    /// transaction, `limit` keys a range, read on from the last where there
    /// are more.
    Ranges { prefixes: Vec<String>, limit: i64 },
}

impl Read {
    async fn at(self, client: Client, revision: i64) -> Result<(Pairs, Reads), LabError> {
        let mut reads = Reads::default();
        let mut pairs = Vec::new();
        let mut take = |got: &GetResponse| {
            reads.count(got);
            pairs.extend(got.kvs().iter().map(|kv| (kv.key().to_vec(), kv.value().to_vec())));
        };
        match self {
            Self::Keys(keys) => {
                let at = || Some(request::at(revision));
                let gets: Vec<TxnOp> = keys.into_iter().map(|key| TxnOp::get(key, at())).collect();
                let response = request::txn(&client, Txn::new().and_then(gets)).await?;
                for op in response.op_responses() {
                    if let TxnOpResponse::Get(got) = op {
                        take(&got);
                    }
                }
            }
            Self::Ranges { prefixes, limit } => {
                let range = |prefix: &str| request::at(revision).with_range(prefix_end(prefix)).with_limit(limit);
                let ranges: Vec<TxnOp> =
                    prefixes.iter().map(|prefix| TxnOp::get(prefix.clone(), Some(range(prefix)))).collect();
                let response = request::txn(&client, Txn::new().and_then(ranges)).await?;
                for (prefix, op) in prefixes.iter().zip(response.op_responses()) {
                    let TxnOpResponse::Get(got) = op else { continue };
                    take(&got);
                    if let (true, Some(last)) = (got.more(), got.kvs().last()) {
                        let from = [last.key(), &[0]].concat();
                        read_on(&client, prefix, from, limit, revision, &mut take).await?;
                    }
                }
            }
        }
        Ok((pairs, reads))
    }
}

/// Reads the keys under `prefix` from `from` on, `limit` a request, at
/// `revision`, giving each response to `take`.
async fn read_on(
    client: &Client,
    prefix: &str,
    mut from: Vec<u8>,
    limit: i64,
    revision: i64,
    take: &mut impl FnMut(&GetResponse),
) -> Result<(), LabError> {
    let end = prefix_end(prefix);
    loop {
        let options = request::at(revision).with_range(end.clone()).with_limit(limit);
        let got = request::get(client, from.clone(), Some(options)).await?;
        take(&got);
        match got.kvs().last() {
            Some(last) if got.more() => from = [last.key(), &[0]].concat(),
            _ => return Ok(()),
        }
    }
}

/// Runs `tasks`, [`TXNS_IN_FLIGHT`] at once, and gives their results in the
/// order they finish; the first failure fails it all.
async fn in_flight<T, F>(tasks: impl IntoIterator<Item = F>) -> Result<Vec<T>, LabError>
where
    T: Send + 'static,
    F: Future<Output = Result<T, LabError>> + Send + 'static,
{
    let mut running = tokio::task::JoinSet::new();
    let mut done = Vec::new();
    let joined = |result: Result<Result<T, LabError>, tokio::task::JoinError>| {
        result.map_err(|error| LabError::from(etcd_client::Error::IoError(error.into())))?
    };
    for task in tasks {
        if running.len() == TXNS_IN_FLIGHT {
            if let Some(result) = running.join_next().await {
                done.push(joined(result)?);
            }
        }
        running.spawn(task);
    }
    while let Some(result) = running.join_next().await {
        done.push(joined(result)?);
    }
    Ok(done)
}

impl Lab {
    /// The servers and devices `want` matches, and who holds them, at one
    /// revision: see [`crate::matching`]. Its cost grows with the devices
    /// that match, not with the lab.
    pub async fn fleet_matching(&mut self, want: &Want) -> Result<Fleet, LabError> {
        if want.index_prefixes(&self.keys).is_empty() {
            let mut fleet = self.fleet().await?;
            fleet.devices.retain(|d| want.matches(&d.device));
            let devices = &fleet.devices;
            fleet.servers.retain(|server| devices.iter().any(|d| d.device.server == server.address));
            return Ok(fleet);
        }
        if let Some(fleet) = self.matching_from_term_catalogs(want).await? {
            return Ok(fleet);
        }
        self.matching_from_index(want).await
    }

    /// From the servers' catalogs of one of the selector's terms (the first
    /// of `catalog::terms_of` whose kind every registered server keeps);
    /// `None` when there is none.
    async fn matching_from_term_catalogs(&mut self, want: &Want) -> Result<Option<Fleet>, LabError> {
        let terms = crate::catalog::terms_of(want);
        if terms.is_empty() {
            return Ok(None);
        }
        let [servers_prefix, ..] = self.keys.fleet_prefixes();
        let (revision, kvs) = self.range(&servers_prefix, None, false).await?;
        let mut servers = BTreeMap::new();
        for kv in &kvs {
            if let (Some(Key::Server { server }), Some(entry)) =
                (self.keys.parse(kv.key()), decode::<ServerEntry>(kv.value()))
            {
                servers.insert(server, entry);
            }
        }
        let kept_by_all =
            |kind: &str| servers.values().all(|entry| entry.catalog_terms.iter().any(|kept| kept == kind));
        let Some((kind, value)) = terms.into_iter().find(|(kind, _)| kept_by_all(kind)) else { return Ok(None) };
        let names: Vec<&String> = servers.keys().collect();
        let term_catalogs: Vec<String> =
            names.iter().map(|server| self.keys.term_catalog_of(server, kind, &value)).collect();
        let mut batches = Vec::new();
        // Servers most devices of which have the term keep a marker instead
        // (`catalog::READ_WHOLE`): their whole catalogs are read and filtered then.
        let mut whole = Vec::new();
        for (entries, read_whole, reads) in in_flight(self.catalog_reads(&term_catalogs, want, revision)).await? {
            self.reads.add(reads);
            batches.push(entries);
            whole.extend(read_whole);
        }
        let whole: Vec<String> = whole.iter().map(|server| self.keys.catalog_of(server)).collect();
        for (entries, _, reads) in in_flight(self.catalog_reads(&whole, want, revision)).await? {
            self.reads.add(reads);
            batches.push(entries);
        }
        // Built once: `append` would rebuild the whole map each batch.
        let found: BTreeMap<_, _> = batches.into_iter().flatten().collect();
        let with_devices: BTreeSet<&String> = found.keys().map(|(server, _)| server).collect();
        servers.retain(|server, _| with_devices.contains(server));
        Ok(Some(self.with_reservations(revision, servers, found).await?))
    }

    /// Reads of the catalogs under `prefixes`, [`SERVERS_PER_TXN`] a
    /// transaction, each giving the entries `want` matches, the servers whose
    /// catalog was a marker ([`crate::catalog::READ_WHOLE`]), and what it read.
    fn catalog_reads(
        &self,
        prefixes: &[String],
        want: &Want,
        revision: i64,
    ) -> Vec<impl Future<Output = Result<CatalogRead, LabError>> + Send + 'static> {
        prefixes
            .chunks(SERVERS_PER_TXN)
            .map(|batch| {
                let (client, keys, want, prefixes) =
                    (self.client.clone(), self.keys.clone(), want.clone(), batch.to_vec());
                async move {
                    let read = Read::Ranges { prefixes, limit: CHUNKS_PER_READ };
                    let (pairs, reads) = read.at(client, revision).await?;
                    let decoding = tokio::task::spawn_blocking(move || matching_entries(&keys, &want, &pairs));
                    let (found, read_whole) =
                        decoding.await.map_err(|error| etcd_client::Error::IoError(error.into()))?;
                    Ok((found, read_whole, reads))
                }
            })
            .collect()
    }

    /// From the index: the keys under each indexed term, intersected, then
    /// the devices' own keys and their servers'.
    async fn matching_from_index(&mut self, want: &Want) -> Result<Fleet, LabError> {
        let mut revision = None;
        let mut found: Option<BTreeSet<(String, String)>> = None;
        for prefix in &want.index_prefixes(&self.keys) {
            let (at, kvs) = self.range(prefix, revision, true).await?;
            revision = Some(at);
            let here: BTreeSet<(String, String)> = kvs
                .iter()
                .filter_map(|kv| self.keys.parse_index_entry(prefix, kv.key()))
                .filter(|(server, busid)| want.matches_place(server, busid))
                .collect();
            found = Some(match found {
                None => here,
                Some(before) => before.intersection(&here).cloned().collect(),
            });
        }
        let revision = revision.unwrap_or(0);
        let found = found.unwrap_or_default();
        let servers: BTreeSet<&str> = found.iter().map(|(server, _)| server.as_str()).collect();
        let mut keys: Vec<String> = servers.iter().map(|server| self.keys.server(server)).collect();
        keys.extend(found.iter().map(|(server, busid)| self.keys.device(server, busid)));
        let reading =
            keys.chunks(GETS_PER_TXN).map(|batch| Read::Keys(batch.to_vec()).at(self.client.clone(), revision));
        let mut pairs = Vec::new();
        for (mut got, reads) in in_flight(reading).await? {
            self.reads.add(reads);
            pairs.append(&mut got);
        }
        let (mut servers, mut devices) = (BTreeMap::new(), BTreeMap::new());
        for (key, value) in &pairs {
            match self.keys.parse(key) {
                Some(Key::Server { server }) => {
                    servers.extend(decode::<ServerEntry>(value).map(|entry| (server, entry)));
                }
                Some(Key::Device { server, busid }) => {
                    // The index is its servers' word; the records decide.
                    let device = decode::<DeviceEntry>(value).filter(|device| want.matches(device));
                    devices.extend(device.map(|device| ((server, busid), device)));
                }
                _ => {}
            }
        }
        devices.retain(|(server, _), _| servers.contains_key(server));
        self.with_reservations(revision, servers, devices).await
    }

    /// The fleet of `servers` and `devices` (by the server and bus id of
    /// their keys), with the devices' reservations read at `revision`.
    async fn with_reservations(
        &mut self,
        revision: i64,
        servers: BTreeMap<String, ServerEntry>,
        devices: BTreeMap<(String, String), DeviceEntry>,
    ) -> Result<Fleet, LabError> {
        let reservations = match self.every_reservation_within(revision, devices.len()).await? {
            Some(every) => every,
            None => self.reservations_of(revision, &devices).await?,
        };
        let devices = devices
            .into_iter()
            .map(|(at, device)| FleetDevice { device, reservation: reservations.get(&at).map(Into::into) })
            .collect();
        Ok(Fleet { revision, servers: servers.into_values().collect(), devices })
    }

    /// Every reservation in the lab at `revision`, in one range, when there
    /// are no more than `most` (a lab's reservations are usually far fewer
    /// than its devices); `None` when there are more, after reading `most`.
    async fn every_reservation_within(
        &mut self,
        revision: i64,
        most: usize,
    ) -> Result<Option<BTreeMap<(String, String), ReservationEntry>>, LabError> {
        let [_, _, prefix] = self.keys.fleet_prefixes();
        let limit = i64::try_from(most.max(1)).unwrap_or(i64::MAX);
        let options = request::at(revision).with_range(prefix_end(&prefix)).with_limit(limit);
        let got = request::get(&self.client, prefix, Some(options)).await?;
        self.reads.count(&got);
        if got.more() {
            return Ok(None);
        }
        Ok(Some(self.reservation_entries(got.kvs().iter().map(|kv| (kv.key(), kv.value())))))
    }

    /// The reservations of `devices` at `revision`: a range of a server's
    /// when [`RESERVATIONS_BY_RANGE`] of its devices are there, else a key each.
    async fn reservations_of(
        &mut self,
        revision: i64,
        devices: &BTreeMap<(String, String), DeviceEntry>,
    ) -> Result<BTreeMap<(String, String), ReservationEntry>, LabError> {
        let mut per_server: BTreeMap<&str, usize> = BTreeMap::new();
        for (server, _) in devices.keys() {
            *per_server.entry(server).or_default() += 1;
        }
        let by_range = |server: &str| per_server.get(server).is_some_and(|n| *n >= RESERVATIONS_BY_RANGE);
        let keys: Vec<String> = devices
            .keys()
            .filter(|(server, _)| !by_range(server))
            .map(|(server, busid)| self.keys.reservation(server, busid))
            .collect();
        let ranges: Vec<String> = per_server
            .keys()
            .filter(|server| by_range(server))
            .map(|server| self.keys.reservations_of(server))
            .collect();
        let ranges = ranges.chunks(SERVERS_PER_TXN).map(|batch| Read::Ranges { prefixes: batch.to_vec(), limit: PAGE });
        let reads = keys.chunks(GETS_PER_TXN).map(|batch| Read::Keys(batch.to_vec())).chain(ranges);
        let reading = reads.map(|read| read.at(self.client.clone(), revision));
        let mut reservations = BTreeMap::new();
        for (pairs, reads) in in_flight(reading).await? {
            self.reads.add(reads);
            reservations.extend(self.reservation_entries(pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice()))));
        }
        Ok(reservations)
    }

    /// The readable reservations among key-value pairs, by server and bus id.
    fn reservation_entries<'a>(
        &self,
        pairs: impl Iterator<Item = (&'a [u8], &'a [u8])>,
    ) -> BTreeMap<(String, String), ReservationEntry> {
        let mut reservations = BTreeMap::new();
        for (key, value) in pairs {
            if let (Some(Key::Reservation { server, busid }), Some(entry)) =
                (self.keys.parse(key), decode::<ReservationEntry>(value))
            {
                reservations.insert((server, busid), entry);
            }
        }
        reservations
    }
}

/// Devices by the server of their key and their bus id.
type Found = BTreeMap<(String, String), DeviceEntry>;

/// What one transaction of catalog reads gives: the entries matched, the
/// servers whose term catalog is a marker, and what it read.
type CatalogRead = (Found, Vec<String>, Reads);

/// The entries in catalog chunks (`pairs`) that `want` matches, by the
/// server of the chunk's key and the bus id (an entry two chunks hold, its
/// server rewriting them, is kept once); and the servers whose term catalog
/// is a marker to read their whole catalog instead.
fn matching_entries(keys: &Keys, want: &Want, pairs: &Pairs) -> (Found, Vec<String>) {
    let mut found = BTreeMap::new();
    let mut read_whole = Vec::new();
    for (key, value) in pairs {
        let Some(server) = keys.chunk_server(key) else { continue };
        if key.ends_with(crate::catalog::READ_WHOLE.as_bytes()) {
            read_whole.push(server.to_owned());
            continue;
        }
        for device in crate::catalog::read_chunk(server, value) {
            if want.matches(&device) {
                found.insert((server.to_owned(), device.record.busid.clone()), device);
            }
        }
    }
    (found, read_whole)
}

#[cfg(test)]
mod tests;
