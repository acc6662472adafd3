use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use rand::{Rng, SeedableRng};

use crate::entry::{DeviceEntry, Keys, Want};
use crate::lab::{Hold, Lab, Reservation};
use crate::publish::{publish, Registration};
use crate::testing::{fleet_from_keys, plant, server_entry, Cluster};
use crate::LabError;

const LEASE: Duration = Duration::from_secs(2);

/// A usbwire server exporting `devices` loopback devices, registered at
/// `address` while its task runs (aborted: its entries expire with its lease).
struct Publisher {
    address: String,
    server: usbwire_server::Server,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Publisher {
    fn new(address: &str, devices: usize) -> Self {
        let mut server = usbwire_server::Server::new(usbwire_server::ServerConfig::default());
        for _ in 0..devices {
            server.export("loopback", Box::new(usbwire_gadgets::loopback(usbwire_device::Speed::HIGH)));
        }
        Self { address: address.to_owned(), server, task: None }
    }

    fn start(&mut self, cluster: &Cluster) {
        let registration = Registration {
            endpoint: cluster.endpoint(&[0]),
            ttl: LEASE,
            server: server_entry(&self.address),
            labels: vec![("1209:0005".parse().unwrap(), vec!["bench".into()])],
        };
        let registry = self.server.registry().clone();
        self.task = Some(tokio::spawn(publish(registration, registry, std::future::pending())));
    }

    /// Dies without a word: its lease runs out.
    fn kill(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// What the registry says: device entries (server, busid) → state, reservations,
/// and the free-device keys as (prefix kind/value, server, busid).
struct Snapshot {
    devices: HashMap<(String, String), DeviceEntry>,
    reserved: BTreeSet<(String, String)>,
    free: BTreeSet<String>,
    /// Index keys (not free keys) and their values.
    index: BTreeMap<String, String>,
}

async fn snapshot(client: &mut Client, keys: &Keys) -> Snapshot {
    let all = client.get(keys.all(), Some(GetOptions::new().with_prefix())).await.expect("read the registry");
    let mut snapshot =
        Snapshot { devices: HashMap::new(), reserved: BTreeSet::new(), free: BTreeSet::new(), index: BTreeMap::new() };
    let (index_root, free_root) = (format!("{}index/", keys.all()), format!("{}index/free/", keys.all()));
    for kv in all.kvs() {
        let key = String::from_utf8_lossy(kv.key()).into_owned();
        if key.starts_with(&free_root) {
            snapshot.free.insert(key);
            continue;
        }
        if key.starts_with(&index_root) {
            snapshot.index.insert(key, String::from_utf8_lossy(kv.value()).into_owned());
            continue;
        }
        match keys.parse(kv.key()) {
            Some(crate::entry::Key::Device { server, busid }) => {
                let entry: DeviceEntry = serde_json::from_slice(kv.value()).expect("a device entry");
                snapshot.devices.insert((server, busid), entry);
            }
            Some(crate::entry::Key::Reservation { server, busid }) => {
                snapshot.reserved.insert((server, busid));
            }
            _ => {}
        }
    }
    snapshot
}

/// The free-device keys the registry should hold: every term's key of each
/// device that is available and not reserved, and no other.
fn expected_free(snapshot: &Snapshot, keys: &Keys) -> BTreeSet<String> {
    snapshot
        .devices
        .iter()
        .filter(|(place, entry)| entry.state() == "available" && !snapshot.reserved.contains(*place))
        .flat_map(|(_, entry)| keys.free_entries(entry))
        .collect()
}

/// The index keys the registry should hold: every term's key of each
/// device, saying its state (whether reserved or not).
fn expected_index(snapshot: &Snapshot, keys: &Keys) -> BTreeMap<String, String> {
    snapshot
        .devices
        .values()
        .flat_map(|entry| keys.index_entries(entry).into_iter().map(|key| (key, entry.state().to_owned())))
        .collect()
}

/// Waits (up to 10 s) for the free-device keys and the index keys to agree
/// with the device entries and reservations, and returns the snapshot they
/// agree in.
async fn index_agrees(client: &mut Client, keys: &Keys, step: &str) -> Snapshot {
    let mut last = String::new();
    for _ in 0..100 {
        let now = snapshot(client, keys).await;
        let (expected, index) = (expected_free(&now, keys), expected_index(&now, keys));
        if now.free == expected && now.index == index {
            return now;
        }
        let wrong: Vec<_> = now.index.iter().filter(|(key, value)| index.get(*key) != Some(*value)).collect();
        last = format!(
            "stale free keys {:?}, missing {:?}; index keys not as the devices say {:?}, missing {:?}",
            now.free.difference(&expected).collect::<Vec<_>>(),
            expected.difference(&now.free).collect::<Vec<_>>(),
            wrong,
            index.keys().filter(|key| !now.index.contains_key(*key)).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("after {step}: the free-device index does not agree with the devices and reservations: {last}");
}

/// Waits (up to 10 s) for the list ([`Lab::fleet`], from the servers'
/// catalogs) and the filtered list of `want` (from their catalogs of its
/// term) to show what the device keys and reservations say at their
/// revisions (a server writes a chunk just before the keys it repeats).
async fn list_agrees(lab: &mut Lab, client: &mut Client, keys: &Keys, want: &Want, step: &str) {
    let mut last = String::new();
    for _ in 0..100 {
        let fleet = lab.fleet().await.unwrap();
        let reference = fleet_from_keys(client, keys, fleet.revision).await;
        let filtered = lab.fleet_matching(want).await.unwrap();
        let mut matching = fleet_from_keys(client, keys, filtered.revision).await;
        matching.devices.retain(|d| want.matches(&d.device));
        let servers: BTreeSet<&String> = matching.devices.iter().map(|d| &d.device.server).collect();
        matching.servers.retain(|server| servers.contains(&server.address));
        if fleet.servers == reference.servers
            && fleet.devices == reference.devices
            && filtered.servers == matching.servers
            && filtered.devices == matching.devices
        {
            return;
        }
        let names = |fleet: &crate::entry::Fleet| -> Vec<String> {
            fleet
                .devices
                .iter()
                .map(|d| format!("{}/{} {:?}", d.device.server, d.device.record.busid, d.reservation.is_some()))
                .collect()
        };
        last = format!(
            "listed {:?}, the keys say {:?}; filtered {:?}, the keys say {:?}",
            names(&fleet),
            names(&reference),
            names(&filtered),
            names(&matching)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("after {step}: the list does not show what the device keys say: {last}");
}

/// Waits (up to 10 s) for `devices` device entries, and the index to agree with them.
async fn all_registered(client: &mut Client, keys: &Keys, devices: usize, step: &str) -> Snapshot {
    for _ in 0..100 {
        let now = index_agrees(client, keys, step).await;
        if now.devices.len() == devices {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("after {step}: {devices} devices not registered within 10 s");
}

/// Issue 36: the free-device index stays true while servers die and come
/// back, reservations are taken (several at once), released (one at once
/// after it was taken) and left to expire; no device is ever held twice, and a reservation reads a page of
/// the index, not every matching device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_free_index_stays_true_and_no_device_is_held_twice() {
    let Some(cluster) = Cluster::start(1, "free_index").await else { return };
    let keys = Keys::new("test");
    let mut publishers: Vec<Publisher> =
        (0..3).map(|i| Publisher::new(&format!("127.0.0.{}:3240", i + 1), 3 + i)).collect();
    for publisher in &mut publishers {
        publisher.start(&cluster);
    }
    let mut client = cluster.client(0).await;
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let first = all_registered(&mut client, &keys, 12, "registration").await;
    assert_eq!(first.free.len(), 12 * keys.free_entries(first.devices.values().next().unwrap()).len());
    let want: Want = "label=bench".parse().unwrap();
    let hold = Hold::WhileRunning { ttl: LEASE, until: None };
    let mut held: Vec<Reservation> = Vec::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
    let mut steps = Vec::new();
    for step in 0..24 {
        let action = rng.gen_range(0..7);
        let what = match action {
            // Several clients at once.
            0 | 1 => {
                let racing = rng.gen_range(1..5);
                let mut racers = Vec::new();
                for _ in 0..racing {
                    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
                    let want = want.clone();
                    racers.push(tokio::spawn(async move { lab.reserve(&want, hold, "test").await }));
                }
                for racer in racers {
                    match racer.await.unwrap() {
                        Ok(reservation) => held.push(reservation),
                        // All taken, or every server dead.
                        Err(LabError::NoneFree { .. } | LabError::NoMatch { .. }) => {}
                        Err(error) => panic!("step {step}: reserving failed: {error}"),
                    }
                }
                format!("{racing} reserve")
            }
            2 if !held.is_empty() => {
                let reservation = held.swap_remove(rng.gen_range(0..held.len()));
                reservation.release().await.unwrap();
                "release".to_owned()
            }
            3 if !held.is_empty() => {
                // Its holder died: the reservation expires with its lease.
                drop(held.swap_remove(rng.gen_range(0..held.len())));
                tokio::time::sleep(LEASE + Duration::from_secs(1)).await;
                "expire".to_owned()
            }
            4 => {
                let i = rng.gen_range(0..publishers.len());
                if publishers[i].task.is_some() {
                    publishers[i].kill();
                    tokio::time::sleep(LEASE + Duration::from_secs(1)).await;
                    // Reservations of its devices outlive it; the device entries went.
                    format!("kill {}", publishers[i].address)
                } else {
                    publishers[i].start(&cluster);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    format!("restart {}", publishers[i].address)
                }
            }
            5 => {
                // Taken and given back at once, likely before its server saw it: the
                // free keys its transaction deleted come back.
                match lab.reserve(&want, hold, "test").await {
                    Ok(reservation) => reservation.release().await.unwrap(),
                    Err(LabError::NoneFree { .. } | LabError::NoMatch { .. }) => {}
                    Err(error) => panic!("step {step}: reserving failed: {error}"),
                }
                "reserve and release".to_owned()
            }
            _ => "nothing".to_owned(),
        };
        steps.push(what);
        let now = index_agrees(&mut client, &keys, &steps.join(", ")).await;
        list_agrees(&mut lab, &mut client, &keys, &want, &steps.join(", ")).await;
        // No device held twice: every reservation we hold is ours alone and still there.
        let mut places = BTreeSet::new();
        held.retain(|r| now.reserved.contains(&(r.server.address.clone(), r.device.record.busid.clone())));
        for reservation in &held {
            let place = (reservation.server.address.clone(), reservation.device.record.busid.clone());
            assert!(places.insert(place.clone()), "after {steps:?}: {place:?} held twice");
            // (A device whose server died is gone with it; its reservation stays until it ends.)
            if now.devices.contains_key(&place) {
                let mine = lab.still_held(&place.0, &place.1, &reservation.token).await.unwrap();
                assert!(mine.is_some(), "after {steps:?}: {place:?} is no longer ours");
            }
        }
    }
    // One reservation, uncontended, reads one short page.
    while let Some(reservation) = held.pop() {
        reservation.release().await.unwrap();
    }
    for publisher in publishers.iter_mut().filter(|p| p.task.is_none()) {
        publisher.start(&cluster);
    }
    all_registered(&mut client, &keys, 12, "all back").await;
    let before = lab.reads();
    let reservation = lab.reserve(&want, hold, "test").await.unwrap();
    let read = lab.reads();
    // A page: a window of buckets from a random one on, and the rest of the prefix when the
    // window is short, as in a lab this small (each two ranges when it wraps).
    assert!(read.requests - before.requests <= 4, "one page of free devices: {:?} then {read:?}", before);
    reservation.release().await.unwrap();
    for publisher in &mut publishers {
        publisher.kill();
    }
}

/// A reservation among thousands of matching devices reads one page of the
/// free-device index (a few KiB), where reading the index in full (the way
/// for a selector without an indexed term) reads every matching device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_among_thousands_reads_one_page() {
    let Some(cluster) = Cluster::start(1, "one_page").await else { return };
    let keys = Keys::new("test");
    let mut client = cluster.client(0).await;
    for server in ["10.0.0.1:3240", "10.0.0.2:3240"] {
        plant(&mut client, &keys, server, 1500, 1).await;
    }
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let hold = Hold::WhileRunning { ttl: Duration::from_secs(5), until: None };
    let mut taken = BTreeSet::new();
    for _ in 0..20 {
        let before = lab.reads();
        let reservation = lab.reserve(&"label=nucleo,0483:374b".parse().unwrap(), hold, "test").await.unwrap();
        let read = lab.reads();
        let (requests, bytes) = (read.requests - before.requests, read.bytes - before.bytes);
        assert!(requests <= 2 && bytes < 10 * 1024, "{requests} range requests, {bytes} bytes for one reservation");
        assert!(taken.insert((reservation.server.address.clone(), reservation.device.record.busid.clone())));
        reservation.keep();
    }
    // The full read, for comparison: a server term alone has no index.
    let before = lab.reads();
    let reservation = lab.reserve(&"server=10.0.0.1:3240".parse().unwrap(), hold, "test").await.unwrap();
    let full = lab.reads().bytes - before.bytes;
    assert!(full > 500 * 1024, "the full read took {full} bytes");
    reservation.keep();
}

/// Racing clients leave free keys behind until their servers see the
/// reservations: a transaction tries a chain of the page's devices, and a
/// chain lost also says which others of the page are reserved by then, so a
/// client skips them rather than losing to each in turn (and reading page
/// after page).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_try_tells_which_others_of_the_page_are_reserved() {
    let Some(cluster) = Cluster::start(1, "lost_try").await else { return };
    let keys = Keys::new("test");
    let mut client = cluster.client(0).await;
    let server = "10.0.0.1:3240";
    // 30 matching devices: one page holds them all.
    plant(&mut client, &keys, server, 30, 1).await;
    // 25 reserved by others whose server has not caught up: their free keys are still there.
    let busids: Vec<String> = (0..30).map(|i| format!("1-{}", 1 + i)).collect();
    for busid in &busids[..25] {
        client.put(keys.reservation(server, busid), "someone else's", None).await.unwrap();
    }
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let hold = Hold::WhileRunning { ttl: Duration::from_secs(5), until: None };
    let mut taken = BTreeSet::new();
    for _ in 0..5 {
        let before = lab.reads();
        let reservation = lab.reserve(&"label=nucleo".parse().unwrap(), hold, "test").await.unwrap();
        let requests = lab.reads().requests - before.requests;
        // One page of a small lab: its window, then the rest of the prefix (each two ranges when it wraps).
        assert!(requests <= 4, "{requests} range requests: more than the one page");
        // A chain of 8 of the page's devices, then one of those a lost chain said are free.
        let transactions = lab.reads().transactions - before.transactions;
        assert!(transactions <= 2, "{transactions} transactions for one reservation");
        let busid = reservation.device.record.busid.clone();
        assert!(busids[25..].contains(&busid), "took {busid}, reserved by someone else");
        assert!(taken.insert(busid));
        reservation.keep();
    }
    // All 30 taken, every free key still there: the pages' chains lose, then the
    // full read counts the reservations themselves and tries none of them.
    let before = lab.reads();
    let none = lab.reserve(&"label=nucleo".parse().unwrap(), hold, "test").await;
    assert!(matches!(none, Err(LabError::NoneFree { matching: 30, reserved: 30, in_use: 0, .. })), "{:?}", none.err());
    let transactions = lab.reads().transactions - before.transactions;
    assert!(
        transactions <= super::FREE_PAGES as u64,
        "{transactions} transactions: the full read tried reserved devices"
    );
}

/// One transaction takes the first free device of its chain: with every
/// device of a page but one reserved by others (their free keys still
/// there), a reservation of a page that fits in one chain takes that one in
/// a single transaction, and the chain's answer says which device it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_takes_its_one_free_device_in_one_transaction() {
    let Some(cluster) = Cluster::start(1, "chain").await else { return };
    let keys = Keys::new("test");
    let mut client = cluster.client(0).await;
    let server = "10.0.0.1:3240";
    plant(&mut client, &keys, server, super::CHAIN, 1).await;
    let busids: Vec<String> = (0..super::CHAIN).map(|i| format!("1-{}", 1 + i)).collect();
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let hold = Hold::WhileRunning { ttl: Duration::from_secs(5), until: None };
    for free in 0..super::CHAIN {
        for (i, busid) in busids.iter().enumerate() {
            let key = keys.reservation(server, busid);
            if i == free {
                client.delete(key, None).await.unwrap();
            } else {
                client.put(key, "someone else's", None).await.unwrap();
            }
        }
        let before = lab.reads();
        let reservation = lab.reserve(&"label=nucleo".parse().unwrap(), hold, "test").await.unwrap();
        assert_eq!(reservation.device.record.busid, busids[free], "took a device reserved by someone else");
        assert_eq!(lab.reads().transactions - before.transactions, 1);
        let held = client.get(keys.reservation(server, &busids[free]), None).await.unwrap();
        assert_ne!(held.kvs()[0].value(), b"someone else's");
        reservation.keep();
    }
}

/// Class `00` ("given per interface", nearly every device's) has no index,
/// free keys or catalog; a selector with it reads the devices themselves,
/// alone or with an indexed term, and takes only a device it matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn class_00_has_no_index_and_a_selector_with_it_reads_the_devices() {
    let Some(cluster) = Cluster::start(1, "class_00").await else { return };
    let keys = Keys::new("test");
    let mut publisher = Publisher::new("127.0.0.1:3240", 2);
    publisher.start(&cluster);
    let mut client = cluster.client(0).await;
    // Class ef devices (interfaces 02 and 0a), all labelled nucleo.
    plant(&mut client, &keys, "10.0.0.1:3240", 10, 1).await;
    let registered = all_registered(&mut client, &keys, 12, "registration").await;
    let loopbacks: BTreeSet<String> = registered
        .devices
        .values()
        .filter(|entry| entry.class == "00")
        .map(|entry| entry.record.busid.clone())
        .collect();
    assert_eq!(loopbacks.len(), 2, "the loopback devices are of class 00");
    let all = client.get(keys.all(), Some(GetOptions::new().with_prefix().with_keys_only())).await.unwrap();
    let class_00: Vec<String> = all
        .kvs()
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .filter(|key| key.contains("/class/00/"))
        .collect();
    assert_eq!(class_00, Vec::<String>::new(), "no index, free key or catalog of class 00");
    assert!(all.kvs().iter().any(|kv| kv.key().starts_with(keys.free_of("class", "ff").as_bytes())));

    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let want: Want = "class=00".parse().unwrap();
    let listed = lab.fleet_matching(&want).await.unwrap();
    let listed: BTreeSet<String> = listed.devices.iter().map(|d| d.device.record.busid.clone()).collect();
    assert_eq!(listed, loopbacks);
    let hold = Hold::WhileRunning { ttl: LEASE, until: None };
    let reservation = lab.reserve(&want, hold, "test").await.unwrap();
    assert!(loopbacks.contains(&reservation.device.record.busid));
    assert_eq!(reservation.server.address, "127.0.0.1:3240");
    // The planted devices are labelled nucleo but of class ef: none matches.
    match lab.reserve(&"label=nucleo,class=00".parse().unwrap(), hold, "test").await {
        Err(LabError::NoMatch { .. }) => {}
        other => {
            panic!("label=nucleo,class=00 matches nothing here: {:?}", other.map(|r| r.device.record.busid.clone()))
        }
    }
    assert_eq!(snapshot(&mut client, &keys).await.reserved.len(), 1, "only the class=00 reservation");
    reservation.release().await.unwrap();
    publisher.kill();
}

/// A reservation's transaction deletes its device's free keys under the
/// selector's terms (racing clients' pages no longer show it); those of its
/// other terms are its server's to delete once it sees the reservation
/// (here there is none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_takes_its_free_keys_under_the_selectors_terms() {
    let Some(cluster) = Cluster::start(1, "takes_free_keys").await else { return };
    let keys = Keys::new("test");
    let mut client = cluster.client(0).await;
    let server = "10.0.0.1:3240";
    plant(&mut client, &keys, server, 4, 1).await;
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let hold = Hold::WhileRunning { ttl: Duration::from_secs(5), until: None };
    let free_keys = |snapshot: &Snapshot, busid: &str| -> BTreeSet<String> {
        snapshot.free.iter().filter(|key| key.ends_with(&format!("/{server}/{busid}"))).cloned().collect()
    };
    for (selector, taken) in [("label=nucleo", vec!["label"]), ("label=nucleo,0483:374b", vec!["label", "id"])] {
        let before = snapshot(&mut client, &keys).await;
        let reservation = lab.reserve(&selector.parse().unwrap(), hold, "test").await.unwrap();
        let busid = reservation.device.record.busid.clone();
        let after = snapshot(&mut client, &keys).await;
        let (had, has) = (free_keys(&before, &busid), free_keys(&after, &busid));
        let gone: BTreeSet<&String> = had.difference(&has).collect();
        let expected: BTreeSet<&String> = had
            .iter()
            .filter(|key| taken.iter().any(|kind| key.starts_with(&format!("{}index/free/{kind}/", keys.all()))))
            .collect();
        assert_eq!(gone, expected, "{selector}: the free keys its reservation deleted");
        assert!(!has.is_empty(), "{selector}: the device's other terms keep their free keys: {had:?}");
        assert_eq!(before.free.len() - after.free.len(), taken.len(), "{selector}: no other device's free key went");
        reservation.keep();
    }
}
