//! The pages of a fleet whose servers all publish catalogs: each page, 16
//! servers' catalogs, is read in one transaction and decoded on a blocking
//! thread, [`AHEAD`] pages ahead of the caller, so that etcd, the decoding
//! and the caller's printing overlap. What `FleetPages` merges the
//! reservations into and shows.
//!
//! Not for fleets with a server from before catalogs (`FleetPages` reads
//! their device keys), nor for reading any one device's truth (its key).

use std::collections::VecDeque;
use std::sync::Arc;

use etcd_client::{Client, KeyValue, Txn, TxnOp, TxnOpResponse};
use tokio::task::JoinHandle;

use crate::entry::{FleetDevice, Keys, ServerEntry};
use crate::error::LabError;
use crate::lab::{prefix_end, Reads};
use crate::request;

/// How many servers' catalogs one page holds (a range each, in one
/// transaction); the first page holds one, so that the first line shows
/// before 16 servers' devices are decoded (16 000 of them take 0.2 s).
const SERVERS_PER_PAGE: usize = 16;
/// How many chunks of a server's catalog its page reads (2 048 devices);
/// a bigger server's are read on in ranges of as many.
const CHUNKS_PER_READ: i64 = 32;
/// Pages read and decoded before the caller asks for them: what a list
/// holds beyond the page it shows.
const AHEAD: usize = 2;

/// A device of a page, with the part of its key after `devices/`
/// (`SERVER/BUSID`) and its server's entry.
pub(super) type PageDevice = (Vec<u8>, Arc<ServerEntry>, FleetDevice);

/// A page read and decoded: its servers (each with `SERVER/`, how its keys
/// sort) in key order, their devices in key order, and what it cost.
pub(super) struct CatalogPage {
    pub(super) servers: Vec<(String, Arc<ServerEntry>)>,
    pub(super) devices: Vec<PageDevice>,
    pub(super) reads: Reads,
}

/// The pages under way, in order.
pub(super) struct Catalogs {
    client: Client,
    keys: Keys,
    revision: i64,
    ahead: VecDeque<JoinHandle<Result<CatalogPage, LabError>>>,
    /// Pages requested so far.
    requested: usize,
}

impl Catalogs {
    pub(super) fn new(client: Client, keys: Keys, revision: i64) -> Self {
        Self { client, keys, revision, ahead: VecDeque::new(), requested: 0 }
    }

    /// Whether a page is under way.
    pub(super) fn pending(&self) -> bool {
        !self.ahead.is_empty()
    }

    /// Starts pages of the servers `unlisted` begins with, until [`AHEAD`]
    /// are under way or none is left.
    pub(super) fn top_up(&mut self, unlisted: &mut VecDeque<(String, Arc<ServerEntry>)>) {
        while self.ahead.len() < AHEAD && !unlisted.is_empty() {
            let count = unlisted.len().min(if self.requested == 0 { 1 } else { SERVERS_PER_PAGE });
            self.requested += 1;
            let servers: Vec<(String, Arc<ServerEntry>)> = unlisted.drain(..count).collect();
            let (client, keys, revision) = (self.client.clone(), self.keys.clone(), self.revision);
            self.ahead.push_back(tokio::spawn(read_page(client, keys, revision, servers)));
        }
    }

    /// The next page, once read and decoded.
    pub(super) async fn next(&mut self) -> Option<Result<CatalogPage, LabError>> {
        let under_way = self.ahead.pop_front()?;
        Some(under_way.await.unwrap_or_else(|error| Err(etcd_client::Error::IoError(error.into()).into())))
    }
}

impl Drop for Catalogs {
    fn drop(&mut self) {
        for under_way in self.ahead.drain(..) {
            under_way.abort();
        }
    }
}

/// Reads the catalogs of `servers` at `revision` and decodes them.
async fn read_page(
    client: Client,
    keys: Keys,
    revision: i64,
    servers: Vec<(String, Arc<ServerEntry>)>,
) -> Result<CatalogPage, LabError> {
    let read = |prefix: &str| request::at(revision).with_range(prefix_end(prefix)).with_limit(CHUNKS_PER_READ);
    let ranges: Vec<TxnOp> = servers
        .iter()
        .map(|(_, entry)| {
            let prefix = keys.catalog_of(&entry.address);
            TxnOp::get(prefix.clone(), Some(read(&prefix)))
        })
        .collect();
    let response = request::txn(&client, Txn::new().and_then(ranges)).await?;
    let mut reads = Reads::default();
    let mut chunks: Vec<Vec<KeyValue>> = Vec::with_capacity(servers.len());
    for ((_, entry), op) in servers.iter().zip(response.op_responses()) {
        let TxnOpResponse::Get(mut got) = op else { continue };
        reads.count(&got);
        let mut more = got.more();
        let mut kvs = got.take_kvs();
        // More chunks than one read takes: read on from the last.
        let prefix = keys.catalog_of(&entry.address);
        while let (true, Some(last)) = (more, kvs.last()) {
            let from = [last.key(), &[0]].concat();
            let mut got = request::get(&client, from, Some(read(&prefix))).await?;
            reads.count(&got);
            more = got.more();
            kvs.append(&mut got.take_kvs());
        }
        chunks.push(kvs);
    }
    let decoding = tokio::task::spawn_blocking(move || {
        let devices = decode(&servers, &chunks);
        CatalogPage { servers, devices, reads }
    });
    decoding.await.map_err(|error| etcd_client::Error::IoError(error.into()).into())
}

/// The devices of each server's chunks, in key order; a device two chunks
/// hold (its server was rewriting them) is shown once.
fn decode(servers: &[(String, Arc<ServerEntry>)], chunks: &[Vec<KeyValue>]) -> Vec<PageDevice> {
    let mut devices = Vec::new();
    for ((_, entry), kvs) in servers.iter().zip(chunks) {
        let mut mine: Vec<PageDevice> = kvs
            .iter()
            .flat_map(|kv| crate::catalog::read_chunk(&entry.address, kv.value()))
            .map(|device| {
                let suffix = format!("{}/{}", entry.address, device.record.busid).into_bytes();
                (suffix, Arc::clone(entry), FleetDevice { device, reservation: None })
            })
            .collect();
        mine.sort_by(|a, b| a.0.cmp(&b.0));
        mine.dedup_by(|a, b| a.0 == b.0);
        devices.append(&mut mine);
    }
    devices
}
