//! The fleet read a page at a time: [`Lab::fleet_pages`] and [`FleetPages`].
//!
//! What `usbwire list --registry` prints as it reads. Every registered server
//! first (servers are few: one read), then the devices in pages of [`PAGE`]
//! keys, all at the revision of that first read, so a key written meanwhile
//! is not shown (a watch from [`FleetPages::revision`] shows it). Each device
//! comes joined with its server's entry and its reservation: device keys
//! (`devices/SERVER/BUSID`) and reservation keys (`reservations/SERVER/BUSID`)
//! sort alike, so the reservations of a page are those up to its last key,
//! read after it and merged in step. Devices come in key order, each server
//! just before its first device (a server without devices where its devices
//! would be), and what [`Fleet::from_pairs`](crate::Fleet::from_pairs) leaves
//! out is left out here too: devices of unregistered servers, unreadable
//! records. What it holds is the servers and two pages (the next page is
//! requested as soon as this one arrives, so it travels while the caller
//! prints), never the fleet.
//!
//! Not for a filtered list ([`Lab::fleet_matching`] reads the index), taking a
//! device (`take`), or following changes ([`Lab::watch`]). An etcd that
//! compacts away the revision while the pages are read fails the next page.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use etcd_client::{GetOptions, GetResponse, KeyValue};
use tokio::task::JoinHandle;

use crate::entry::{decode, DeviceEntry, FleetDevice, Key, ReservationEntry, ServerEntry};
use crate::error::LabError;
use crate::lab::{prefix_end, Lab};
use crate::request;

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
    /// The next page of devices, under way; `None` after the last.
    next: Option<JoinHandle<Result<GetResponse, etcd_client::Error>>>,
}

impl Lab {
    /// The fleet a page at a time, at the revision of its first read (the
    /// servers'): see [`crate::pages`]. Its requests count in [`Lab::reads`].
    pub async fn fleet_pages(&mut self) -> Result<FleetPages<'_>, LabError> {
        self.fleet_pages_of(PAGE).await
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
        };
        pages.request_devices(devices_prefix.into_bytes());
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
        let options =
            GetOptions::new().with_range(self.devices_end.clone()).with_limit(self.page).with_revision(self.revision);
        self.next = Some(tokio::spawn(async move { request::get(&client, from, Some(options)).await }));
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
            let device = FleetDevice { device, reservation: None, mod_revision: kv.mod_revision() };
            shown.push((after(kv.key(), self.devices_prefix), entry, device));
        }
        shown
    }

    /// Reads the reservations not read yet up to `reservations/THROUGH` (a
    /// page's last key, after `devices/`), in pages, and gives each to the
    /// device of the same `SERVER/BUSID`. Both lists are in key order, so one
    /// pass over each does it; a reservation of no device shown is dropped.
    async fn merge_reservations(
        &mut self,
        through: &[u8],
        devices: &mut [(&[u8], Arc<ServerEntry>, FleetDevice)],
    ) -> Result<(), LabError> {
        let mut end = self.reservations_prefix.clone();
        end.extend_from_slice(through);
        end.push(0);
        let mut at = 0;
        while self.reservations_from < end {
            let options = GetOptions::new().with_range(end.clone()).with_limit(self.page).with_revision(self.revision);
            let mut response = request::get(&self.lab.client, self.reservations_from.clone(), Some(options)).await?;
            self.lab.reads.count(&response);
            let kvs = response.take_kvs();
            self.reservations_from = match (response.more(), kvs.last()) {
                (true, Some(last)) => [last.key(), &[0]].concat(),
                _ => end.clone(),
            };
            for kv in &kvs {
                let suffix = after(kv.key(), self.reservations_prefix.len());
                while devices.get(at).is_some_and(|(key, _, _)| *key < suffix) {
                    at += 1;
                }
                let Some((key, _, device)) = devices.get_mut(at) else { break };
                if *key == suffix {
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
