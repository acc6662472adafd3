use std::collections::BTreeSet;
use std::time::Duration;

use etcd_client::{Client, GetOptions};

use super::*;
use crate::entry::{timestamp, Fleet, Keys, SCHEMA_VERSION};
use crate::testing::{fleet_from_keys, plant, plant_as, server_entry, Cluster};

/// A reservation of `busid` on `server` by `holder`, put straight into the registry.
async fn reserve(client: &mut Client, keys: &Keys, server: &str, busid: &str, holder: &str) {
    let entry = ReservationEntry {
        schema_version: SCHEMA_VERSION,
        holder: holder.to_owned(),
        client: "usbwire reserve".to_owned(),
        pid: 1,
        token_sha256: "00".repeat(32),
        since_at: timestamp(std::time::SystemTime::now()),
        until_at: None,
    };
    client.put(keys.reservation(server, busid), serde_json::to_string(&entry).unwrap(), None).await.unwrap();
}

/// Every device key under the prefix, in key order, as (server, bus id).
async fn device_keys(client: &mut Client, keys: &Keys) -> Vec<(String, String)> {
    let options = GetOptions::new().with_prefix().with_keys_only();
    let response = client.get(format!("{}devices/", keys.all()), Some(options)).await.unwrap();
    response
        .kvs()
        .iter()
        .filter(|kv| !kv.key().windows(2).any(|part| part == b"/!"))
        .map(|kv| match keys.parse(kv.key()) {
            Some(Key::Device { server, busid }) => (server, busid),
            other => panic!("not a device key: {other:?}"),
        })
        .collect()
}

/// [`Lab::fleet`], checked against what the device keys say at its revision.
async fn checked_fleet(lab: &mut Lab, client: &mut Client, keys: &Keys) -> Fleet {
    let fleet = lab.fleet().await.unwrap();
    let reference = fleet_from_keys(client, keys, fleet.revision).await;
    assert_eq!(fleet.servers, reference.servers);
    assert_eq!(fleet.devices.len(), reference.devices.len());
    for (listed, keyed) in fleet.devices.iter().zip(&reference.devices) {
        assert_eq!(listed, keyed);
    }
    fleet
}

/// Everything a stream in pages of `page` yields, page by page.
async fn read_all(lab: &mut Lab, page: i64) -> (i64, Vec<Vec<Listed>>) {
    let mut pages = lab.fleet_pages_of(page).await.unwrap();
    let mut read = Vec::new();
    while let Some(listed) = pages.next_page().await.unwrap() {
        read.push(listed);
    }
    assert!(pages.next_page().await.unwrap().is_none(), "the end stays the end");
    (pages.revision(), read)
}

/// Checks a stream's pages against the fleet read whole: the same servers and
/// devices (with the same reservations), each once, every device after its
/// server's entry and joined with it.
fn assert_same(pages: &[Vec<Listed>], fleet: &Fleet) {
    let mut servers = Vec::new();
    let mut devices = Vec::new();
    for listed in pages.iter().flatten() {
        match listed {
            Listed::Server(entry) => servers.push((**entry).clone()),
            Listed::Device { server, device } => {
                assert!(servers.last() == Some(&**server), "{} before its server", device.device.record.busid);
                assert_eq!(server.address, device.device.server, "joined with its own server");
                devices.push(device.clone());
            }
        }
    }
    assert_eq!(servers, fleet.servers);
    assert_eq!(devices.len(), fleet.devices.len());
    for (streamed, whole) in devices.iter().zip(&fleet.devices) {
        assert_eq!(streamed, whole);
    }
}

/// Issue 36 item 2: a fleet of thousands of devices across pages of the
/// default size lists every device once, joined with its server and its
/// reservation, where a page ends between a device and its reservation too;
/// what the whole fleet leaves out (an unregistered server's device, an
/// unreadable record, a reservation of no device) is left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_across_pages_lists_every_device_once_with_its_server_and_reservation() {
    let Some(cluster) = Cluster::start(1, "fleet_pages").await else { return };
    let keys = Keys::new("test");
    let mut client = cluster.client(0).await;
    for (server, devices) in [("10.0.0.1:3240", 2500), ("10.0.0.2:3240", 1600), ("10.0.0.3:3240", 0)] {
        plant(&mut client, &keys, server, devices, 50).await;
    }
    // An unreadable record, and a device under the keys of a server that is not registered.
    client.put(keys.device("10.0.0.1:3240", "99-9"), "{not json", None).await.unwrap();
    let planted = client.get(keys.device("10.0.0.1:3240", "1-1"), None).await.unwrap();
    let record = planted.kvs()[0].value().to_vec();
    client.put(keys.device("10.0.0.9:3240", "1-1"), record, None).await.unwrap();
    let keyed = device_keys(&mut client, &keys).await;
    assert_eq!(keyed.len(), 2500 + 1600 + 2);
    // The first and last devices, those either side of each page's end, and
    // reservations of no device shown among them.
    let page = PAGE as usize;
    let mut reserved: Vec<&(String, String)> = vec![&keyed[0], &keyed[keyed.len() - 2], &keyed[keyed.len() - 1]];
    reserved.extend([page - 1, page, 2 * page - 1, 2 * page].map(|i| &keyed[i]));
    for (i, (server, busid)) in reserved.iter().enumerate() {
        reserve(&mut client, &keys, server, busid, &format!("holder-{i}@lab")).await;
    }
    for (server, busid) in [("10.0.0.1:3240", "1-1a"), ("10.0.0.1:3240", "99-1"), ("10.0.0.4:3240", "1-1")] {
        reserve(&mut client, &keys, server, busid, "nobody@lab").await;
    }
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let fleet = checked_fleet(&mut lab, &mut client, &keys).await;
    let whole = lab.reads();
    let (revision, pages) = read_all(&mut lab, PAGE).await;
    let streamed = lab.reads().bytes - whole.bytes;
    assert_eq!(revision, fleet.revision, "nothing changed in between");
    assert_eq!(pages.len(), 3, "{} device keys in pages of {PAGE}", keyed.len());
    assert_same(&pages, &fleet);
    assert_eq!(fleet.devices.len(), 2500 + 1600);
    let held: BTreeSet<(String, String, String)> = fleet
        .devices
        .iter()
        .filter_map(|d| {
            let holder = d.reservation.as_ref()?.holder.clone();
            Some((d.device.server.clone(), d.device.record.busid.clone(), holder))
        })
        .collect();
    let shown: BTreeSet<(&str, &str)> =
        fleet.devices.iter().map(|d| (d.device.server.as_str(), d.device.record.busid.as_str())).collect();
    let expected: BTreeSet<(String, String, String)> = reserved
        .iter()
        .enumerate()
        .filter(|(_, (server, busid))| shown.contains(&(server.as_str(), busid.as_str())))
        .map(|(i, (server, busid))| (server.clone(), busid.clone(), format!("holder-{i}@lab")))
        .collect();
    assert_eq!(expected.len(), reserved.len() - 1, "all but the unregistered server's device are shown");
    assert_eq!(held, expected);
    assert!(streamed <= whole.bytes, "the stream read {streamed} bytes, the whole fleet {}", whole.bytes);
}

/// Every page size, from one key a page: the page's end falls everywhere,
/// between a device and its reservation, after a reservation of no device,
/// before a server's first device and after its last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_size_lists_the_same_fleet() {
    let Some(cluster) = Cluster::start(1, "fleet_page_sizes").await else { return };
    let keys = Keys::new("test");
    let mut client = cluster.client(0).await;
    for (server, devices) in [("10.0.0.1:3240", 12), ("10.0.0.10:3240", 0), ("10.0.0.2:3240", 9)] {
        plant(&mut client, &keys, server, devices, 3).await;
    }
    for (i, (server, busid)) in device_keys(&mut client, &keys).await.iter().enumerate() {
        if i % 3 != 1 {
            reserve(&mut client, &keys, server, busid, &format!("h{i}@lab")).await;
        }
        if i % 4 == 0 {
            reserve(&mut client, &keys, server, &format!("{busid}.9"), "nobody@lab").await;
        }
    }
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let fleet = checked_fleet(&mut lab, &mut client, &keys).await;
    for page in 1..=22 {
        let (revision, pages) = read_all(&mut lab, page).await;
        assert_eq!(revision, fleet.revision);
        assert_same(&pages, &fleet);
    }
    // No devices at all: the servers, then the end.
    let empty = Keys::new("empty");
    plant(&mut client, &empty, "10.0.0.5:3240", 0, 1).await;
    let mut endpoint = cluster.endpoint(&[0]);
    endpoint.url.prefix = "empty".to_owned();
    let mut lab = Lab::connect(endpoint).await.unwrap();
    let (_, pages) = read_all(&mut lab, 5).await;
    assert_eq!(pages, [vec![Listed::Server(Arc::new(lab.fleet().await.unwrap().servers.remove(0)))]]);
}

/// Keys written while the stream is between pages do not show (every page is
/// read at the first read's revision), and a watch from that revision shows
/// each of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_changed_between_pages_do_not_show_and_a_watch_from_its_revision_does() {
    let Some(cluster) = Cluster::start(1, "fleet_pages_revision").await else { return };
    let keys = Keys::new("test");
    let mut client = cluster.client(0).await;
    plant(&mut client, &keys, "10.0.0.1:3240", 60, 2).await;
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let before = checked_fleet(&mut lab, &mut client, &keys).await;
    let keyed = device_keys(&mut client, &keys).await;
    let mut pages = lab.fleet_pages_of(10).await.unwrap();
    let mut read = vec![pages.next_page().await.unwrap().unwrap()];
    // Meanwhile, in pages not read yet: a device goes, one comes, one is
    // reserved, a new server registers, and the first server's entry changes.
    let (gone, taken) = (&keyed[30], &keyed[40]);
    client.delete(keys.device(&gone.0, &gone.1), None).await.unwrap();
    let mut added = before.devices[0].device.clone();
    added.record.busid = "9-99".to_owned();
    client.put(keys.device("10.0.0.1:3240", "9-99"), serde_json::to_string(&added).unwrap(), None).await.unwrap();
    reserve(&mut client, &keys, &taken.0, &taken.1, "late@lab").await;
    plant(&mut client, &keys, "10.0.0.2:3240", 3, 1).await;
    let mut renamed = server_entry("10.0.0.1:3240");
    renamed.version = "changed".to_owned();
    client.put(keys.server("10.0.0.1:3240"), serde_json::to_string(&renamed).unwrap(), None).await.unwrap();
    while let Some(listed) = pages.next_page().await.unwrap() {
        read.push(listed);
    }
    let revision = pages.revision();
    drop(pages);
    assert_eq!(revision, before.revision);
    assert_same(&read, &before);
    let after = checked_fleet(&mut lab, &mut client, &keys).await;
    assert_eq!(after.devices.len(), 60 + 3, "one gone, one added, three of a new server");
    // The watch from the stream's revision starts with the first change made.
    let mut watch = lab.watch(revision).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let batch = tokio::time::timeout(Duration::from_secs(10), watch.next()).await.unwrap().unwrap().unwrap();
        seen.extend(batch.into_iter().map(|change| (change.what, change.busid, change.entry.is_some())));
    }
    assert_eq!(
        seen[..3],
        [
            ("device", Some(gone.1.clone()), false),
            ("device", Some("9-99".to_owned()), true),
            ("reservation", Some(taken.1.clone()), true),
        ]
    );
}

/// Issue 36 item 2: servers that publish catalogs are listed from them, 16
/// servers a page (a transaction), with what their device keys say: the
/// same servers, devices and reservations, each device once and after its
/// server, a server of more chunks than one read takes included; etcd sends a
/// fraction of the device keys' bytes. A fleet where one server has no
/// catalog (a server from before them) is listed from the device keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_with_catalogs_list_what_their_device_keys_say() {
    let Some(cluster) = Cluster::start(1, "fleet_catalogs").await else { return };
    let keys = Keys::new("test");
    let mut client = cluster.client(0).await;
    // 2 100 devices: 33 chunks, one more than a page reads of a server.
    plant_as(&mut client, &keys, "10.0.0.1:3240", 2100, 7, true).await;
    for i in 2..22 {
        plant_as(&mut client, &keys, &format!("10.0.0.{i}:3240"), i % 5 * 30, 2, true).await;
    }
    for (i, (server, busid)) in device_keys(&mut client, &keys).await.iter().enumerate() {
        if i % 7 == 3 {
            reserve(&mut client, &keys, server, busid, &format!("h{i}@lab")).await;
        }
    }
    reserve(&mut client, &keys, "10.0.0.2:3240", "77-7", "nobody@lab").await;
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let before = lab.reads();
    let (revision, pages) = read_all(&mut lab, PAGE).await;
    let read = lab.reads().bytes - before.bytes;
    let reference = fleet_from_keys(&mut client, &keys, revision).await;
    assert_same(&pages, &reference);
    assert_eq!(pages.len(), 3, "21 servers: one first, then 16 a page");
    assert_eq!(pages[0].iter().filter(|listed| matches!(listed, Listed::Server(_))).count(), 1);
    assert_eq!(reference.devices.len(), 2100 + (2..22).map(|i| i % 5 * 30).sum::<usize>());
    assert!(reference.devices.iter().filter(|d| d.reservation.is_some()).count() > 300);
    let entries: u64 = reference.devices.iter().map(|d| serde_json::to_vec(&d.device).unwrap().len() as u64).sum();
    assert!(read * 5 < entries, "the catalogs took {read} bytes, the entries are {entries}");
    checked_fleet(&mut lab, &mut client, &keys).await;

    plant(&mut client, &keys, "10.0.0.99:3240", 5, 1).await;
    let (revision, pages) = read_all(&mut lab, PAGE).await;
    let reference = fleet_from_keys(&mut client, &keys, revision).await;
    assert_same(&pages, &reference);
    assert!(reference.devices.iter().any(|d| d.device.server == "10.0.0.99:3240"));
}
