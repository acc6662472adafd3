//! The fleet read a page at a time: [`Lab::fleet_pages`] and [`FleetPages`].
//!
//! What `usbwire list --registry` prints as it reads. Every registered server
//! first (servers are few: one read), then their devices, all at the
//! revision of that first read, so a key written meanwhile is not shown (a
//! watch from [`FleetPages::revision`] shows it). When every server publishes
//! a catalog (`catalog`), a page is 16 servers' catalogs (the first page
//! one server's: `catalogs`), read in one transaction (a range per server): a key per 64 devices, so
//! etcd's work and bytes are a fraction of the device keys'. Otherwise (a
//! server from before catalogs is registered) the device keys are read, in
//! pages of [`PAGE`] keys. Each device
//! comes joined with its server's entry and its reservation: device keys
//! (`devices/SERVER/BUSID`) and reservation keys (`reservations/SERVER/BUSID`)
//! sort alike, so the reservations of a page are those up to its last key,
//! read after it and merged in step. Devices come in key order, each server
//! just before its first device (a server without devices where its devices
//! would be), and what [`Fleet::from_pairs`](crate::Fleet::from_pairs) leaves
//! out is left out here too: devices of unregistered servers, unreadable
//! records. What it holds is the servers and a few pages (device keys: the
//! next page is requested as soon as this one arrives, so it travels while
//! the caller prints; catalogs: two pages are read and decoded ahead), never
//! the fleet.
//!
//! Not for a filtered list ([`Lab::fleet_matching`] reads the index), taking a
//! device (`take`), or following changes ([`Lab::watch`]). An etcd that
//! compacts away the revision while the pages are read fails the next page.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use etcd_client::{GetResponse, KeyValue};
use tokio::task::JoinHandle;

use crate::entry::{decode, DeviceEntry, Fleet, FleetDevice, Key, ReservationEntry, ServerEntry};
use crate::error::LabError;
use crate::lab::{prefix_end, Lab};
use crate::request;

mod catalogs;
use catalogs::{CatalogPage, Catalogs};

/// How many device keys one page holds (as many as `Lab::range` reads at once).
pub(crate) const PAGE: i64 = 2000;

/// One thing a page of the fleet shows.
#[derive(Clone, Debug, PartialEq, Eq)]
// Nearly every item is a device: boxing each, for the few servers' sake,
// would cost an allocation per device.
#[allow(clippy::large_enum_variant)]
pub enum Listed {
    /// A registered server, before its devices (its entry under `servers/SERVER`).
    Server(Arc<ServerEntry>),
    /// A device, with the entry of the server whose keys it is under (the
    /// same `Arc` as that server's [`Listed::Server`]) and its reservation.
    Device { server: Arc<ServerEntry>, device: FleetDevice },
}

/// The fleet at one revision, a page at a time: see the module docs. Dropping
/// it cancels the page under way.
pub struct FleetPages<'a> {
    lab: &'a mut Lab,
    revision: i64,
    page: i64,
    /// Every registered server, by the server part of its key.
    servers: BTreeMap<String, Arc<ServerEntry>>,
    /// Those not yet shown, by `SERVER/` (how their devices' keys sort).
    unlisted: VecDeque<(String, Arc<ServerEntry>)>,
    devices_prefix: usize,
    devices_end: Vec<u8>,
    reservations_prefix: Vec<u8>,
    /// Where the next read of reservations starts: every key before it has been merged.
    reservations_from: Vec<u8>,
    /// The next page of device keys, under way; `None` after the last,
    /// and when the catalogs are read.
    next: Option<JoinHandle<Result<GetResponse, etcd_client::Error>>>,
    /// The pages of catalogs under way, when every server has one.
    catalogs: Option<Catalogs>,
}

impl Lab {
    /// The fleet a page at a time, at the revision of its first read (the
    /// servers'): see [`crate::pages`]. Its requests count in [`Lab::reads`].
    pub async fn fleet_pages(&mut self) -> Result<FleetPages<'_>, LabError> {
        self.fleet_pages_of(PAGE).await
    }

    /// Every server and device, and who holds what, at one revision: the
    /// pages of [`Lab::fleet_pages`], gathered (any fleet size fits).
    pub async fn fleet(&mut self) -> Result<Fleet, LabError> {
        let mut pages = self.fleet_pages().await?;
        let revision = pages.revision();
        let (mut servers, mut devices) = (Vec::new(), Vec::new());
        while let Some(page) = pages.next_page().await? {
            for listed in page {
                match listed {
                    Listed::Server(entry) => servers.push(Arc::unwrap_or_clone(entry)),
                    Listed::Device { device, .. } => devices.push(device),
                }
            }
        }
        servers.sort_by(|a: &ServerEntry, b| a.address.cmp(&b.address));
        devices.sort_by(|a: &FleetDevice, b| {
            (&a.device.server, &a.device.record.busid).cmp(&(&b.device.server, &b.device.record.busid))
        });
        Ok(Fleet { revision, servers, devices })
    }

    /// The same, in pages of `page` device keys.
    pub(crate) async fn fleet_pages_of(&mut self, page: i64) -> Result<FleetPages<'_>, LabError> {
        let [servers_prefix, devices_prefix, reservations_prefix] = self.keys.fleet_prefixes();
        let (revision, kvs) = self.range(&servers_prefix, None, false).await?;
        let mut servers = BTreeMap::new();
        for kv in &kvs {
            if let (Some(Key::Server { server }), Some(entry)) =
                (self.keys.parse(kv.key()), decode::<ServerEntry>(kv.value()))
            {
                servers.insert(server, Arc::new(entry));
            }
        }
        let mut unlisted: Vec<(String, Arc<ServerEntry>)> =
            servers.iter().map(|(server, entry)| (format!("{server}/"), Arc::clone(entry))).collect();
        unlisted.sort_by(|a, b| a.0.cmp(&b.0));
        let mut pages = FleetPages {
            lab: self,
            revision,
            page: page.max(1),
            servers,
            unlisted: unlisted.into(),
            devices_prefix: devices_prefix.len(),
            devices_end: prefix_end(&devices_prefix),
            reservations_from: reservations_prefix.clone().into_bytes(),
            reservations_prefix: reservations_prefix.into_bytes(),
            next: None,
            catalogs: None,
        };
        if pages.servers.values().all(|server| server.catalog) {
            let mut catalogs = Catalogs::new(pages.lab.client.clone(), pages.lab.keys.clone(), revision);
            catalogs.top_up(&mut pages.unlisted);
            pages.catalogs = Some(catalogs);
        } else {
            pages.request_devices(devices_prefix.into_bytes());
        }
        Ok(pages)
    }
}

impl FleetPages<'_> {
    /// The revision every page is read at: a watch from it shows what came after.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// Every registered server (read before the first page), by address.
    pub fn servers(&self) -> impl Iterator<Item = &ServerEntry> {
        self.servers.values().map(|entry| &**entry)
    }

    /// The next page: its devices in key order, each server just before its
    /// first device; `None` once the fleet has been read. A page may be
    /// empty when none of its keys is a device this view shows.
    pub async fn next_page(&mut self) -> Result<Option<Vec<Listed>>, LabError> {
        if self.catalogs.as_ref().is_some_and(Catalogs::pending) {
            return self.catalog_page().await;
        }
        let Some(under_way) = self.next.take() else {
            return Ok(self.remaining_servers());
        };
        let mut response = under_way.await.map_err(|error| etcd_client::Error::IoError(error.into()))??;
        self.lab.reads.count(&response);
        let more = response.more();
        let kvs = response.take_kvs();
        if let (true, Some(last)) = (more, kvs.last()) {
            let mut from = last.key().to_vec();
            from.push(0);
            self.request_devices(from);
        }
        let mut devices = self.devices(&kvs);
        if let Some(last) = kvs.last() {
            let through = after(last.key(), self.devices_prefix).to_vec();
            self.merge_reservations(&through, &mut devices).await?;
        }
        let mut listed = Vec::with_capacity(devices.len() + 1);
        for (suffix, server, device) in devices {
            while self.unlisted.front().is_some_and(|(before, _)| before.as_bytes() <= suffix) {
                listed.extend(self.unlisted.pop_front().map(|(_, entry)| Listed::Server(entry)));
            }
            listed.push(Listed::Device { server, device });
        }
        if self.next.is_none() {
            listed.extend(self.remaining_servers().into_iter().flatten());
        }
        Ok(Some(listed))
    }

    /// The servers not shown yet, once no device is left to show them before.
    fn remaining_servers(&mut self) -> Option<Vec<Listed>> {
        (!self.unlisted.is_empty()).then(|| self.unlisted.drain(..).map(|(_, entry)| Listed::Server(entry)).collect())
    }

    /// Starts reading the page of devices that begins at key `from`.
    fn request_devices(&mut self, from: Vec<u8>) {
        let client = self.lab.client.clone();
        let options = request::at(self.revision).with_range(self.devices_end.clone()).with_limit(self.page);
        self.next = Some(tokio::spawn(async move { request::get(&client, from, Some(options)).await }));
    }

    /// A page of servers with catalogs (read and decoded ahead: `catalogs`):
    /// each server, then its devices in bus id order with their reservations.
    async fn catalog_page(&mut self) -> Result<Option<Vec<Listed>>, LabError> {
        let Some(catalogs) = self.catalogs.as_mut() else { return Ok(None) };
        let Some(page) = catalogs.next().await else { return Ok(None) };
        catalogs.top_up(&mut self.unlisted);
        let CatalogPage { servers, mut devices, reads } = page?;
        self.lab.reads.add(reads);
        if let Some(through) = devices.last().map(|(suffix, ..)| suffix.clone()) {
            self.merge_reservations(&through, &mut devices).await?;
        }
        let mut listed = Vec::with_capacity(servers.len() + devices.len());
        let mut devices = devices.into_iter().peekable();
        for (before, entry) in servers {
            listed.push(Listed::Server(Arc::clone(&entry)));
            while let Some((_, _, device)) = devices.next_if(|(suffix, ..)| suffix.starts_with(before.as_bytes())) {
                listed.push(Listed::Device { server: Arc::clone(&entry), device });
            }
        }
        Ok(Some(listed))
    }

    /// The devices of a page this view shows, each with the part of its key
    /// after `devices/` (`SERVER/BUSID`) and its server's entry.
    fn devices<'k>(&self, kvs: &'k [KeyValue]) -> Vec<(&'k [u8], Arc<ServerEntry>, FleetDevice)> {
        let mut shown = Vec::with_capacity(kvs.len());
        let mut last: Option<(String, Arc<ServerEntry>)> = None;
        for kv in kvs {
            let Some(Key::Device { server, .. }) = self.lab.keys.parse(kv.key()) else { continue };
            let Some(device) = decode::<DeviceEntry>(kv.value()) else { continue };
            let entry = match &last {
                Some((name, entry)) if *name == server => Arc::clone(entry),
                _ => {
                    let Some(entry) = self.servers.get(&server) else { continue };
                    last = Some((server, Arc::clone(entry)));
                    Arc::clone(entry)
                }
            };
            let device = FleetDevice { device, reservation: None };
            shown.push((after(kv.key(), self.devices_prefix), entry, device));
        }
        shown
    }

    /// Reads the reservations not read yet up to `reservations/THROUGH` (a
    /// page's last key, after `devices/`), in pages, and gives each to the
    /// device of the same `SERVER/BUSID`. Both lists are in key order, so one
    /// pass over each does it; a reservation of no device shown is dropped.
    async fn merge_reservations<K: AsRef<[u8]>>(
        &mut self,
        through: &[u8],
        devices: &mut [(K, Arc<ServerEntry>, FleetDevice)],
    ) -> Result<(), LabError> {
        let mut end = self.reservations_prefix.clone();
        end.extend_from_slice(through);
        end.push(0);
        let mut at = 0;
        while self.reservations_from < end {
            let options = request::at(self.revision).with_range(end.clone()).with_limit(self.page);
            let mut response = request::get(&self.lab.client, self.reservations_from.clone(), Some(options)).await?;
            self.lab.reads.count(&response);
            let kvs = response.take_kvs();
            self.reservations_from = match (response.more(), kvs.last()) {
                (true, Some(last)) => [last.key(), &[0]].concat(),
                _ => end.clone(),
            };
            for kv in &kvs {
                let suffix = after(kv.key(), self.reservations_prefix.len());
                while devices.get(at).is_some_and(|(key, _, _)| key.as_ref() < suffix) {
                    at += 1;
                }
                let Some((key, _, device)) = devices.get_mut(at) else { break };
                if key.as_ref() == suffix {
                    device.reservation = decode::<ReservationEntry>(kv.value()).as_ref().map(Into::into);
                }
            }
        }
        Ok(())
    }
}

/// The part of `key` after its first `n` bytes (the prefix its range read
/// asked for; none if etcd sent a shorter key).
fn after(key: &[u8], n: usize) -> &[u8] {
    key.get(n..).unwrap_or_default()
}

impl Drop for FleetPages<'_> {
    fn drop(&mut self) {
        if let Some(under_way) = self.next.take() {
            under_way.abort();
        }
    }
}

#[cfg(test)]
mod tests;
