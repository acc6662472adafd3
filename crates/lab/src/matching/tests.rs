//! The filtered list against real etcd: what it shows is what the fleet
//! shows, filtered, whichever way it reads.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use crate::entry::{timestamp, Fleet, Keys, ReservationEntry, Want};
use crate::lab::{Hold, Lab};
use crate::testing::{plant_as, Cluster};

fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap()
}

/// A reservation by `holder`, as `usbwire reserve` writes it.
fn reservation_by(holder: String) -> ReservationEntry {
    ReservationEntry {
        schema_version: crate::entry::SCHEMA_VERSION,
        holder,
        client: "usbwire reserve".to_owned(),
        pid: 1,
        token_sha256: "00".repeat(32),
        since_at: timestamp(SystemTime::now()),
        until_at: None,
    }
}

/// Plants three servers (with catalogs or not), reserves, and checks that
/// filtered lists show exactly what the filtered fleet shows; returns the
/// bytes the `label=nucleo` list read.
async fn filtered_lists_show_what_the_fleet_shows(cluster: &Cluster, catalogs: bool) -> u64 {
    let keys = Keys::new("test");
    let mut client = cluster.client(0).await;
    for server in ["10.0.0.1:3240", "10.0.0.2:3240"] {
        plant_as(&mut client, &keys, server, 1000, 20, catalogs).await;
    }
    // Three matching devices: their reservations are read a key each, the
    // others' (50 a server) in a range per server.
    plant_as(&mut client, &keys, "10.0.0.3:3240", 60, 20, catalogs).await;
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let hold = Hold::WhileRunning { ttl: Duration::from_secs(5), until: None };
    let taken = lab.reserve(&"label=nucleo".parse().unwrap(), hold, "test").await.unwrap();
    // Others' reservations, of matching devices and not, on each server.
    // (Matching devices other than the one taken: `1-21` and `1-41` match.)
    let others =
        [("10.0.0.1:3240", ["1-21", "1-41"]), ("10.0.0.1:3240", ["1-22", "1-22"]), ("10.0.0.3:3240", ["1-41", "1-21"])];
    let mine = (taken.server.address.as_str(), taken.device.record.busid.as_str());
    let others =
        others.map(|(server, busids)| (server, busids.into_iter().find(|busid| (server, *busid) != mine).unwrap()));
    for (server, busid) in others {
        client
            .put(keys.reservation(server, busid), json(&reservation_by(format!("someone@{busid}"))), None)
            .await
            .unwrap();
    }
    let everything = lab.fleet().await.unwrap();
    assert_eq!(everything.devices.len(), 2060);
    let reserved = |fleet: &Fleet| fleet.devices.iter().filter(|d| d.reservation.is_some()).count();
    assert_eq!(reserved(&everything), 4);
    let mut nucleo_read = 0;
    for selector in [
        "label=nucleo",
        "label=nucleo,server=10.0.0.2:3240",
        "0483:374b,label=nucleo",
        "0483:374b",
        "class=0a,2-7",
        "2-7",
        "label=none",
    ] {
        let want: Want = selector.parse().unwrap();
        let before = lab.reads();
        let filtered = lab.fleet_matching(&want).await.unwrap();
        let read = lab.reads().bytes - before.bytes;
        let expected: Vec<_> = everything.devices.iter().filter(|d| want.matches(&d.device)).collect();
        let got: Vec<_> = filtered.devices.iter().collect();
        assert_eq!(got, expected, "{selector}");
        let servers: BTreeSet<_> = expected.iter().map(|d| d.device.server.clone()).collect();
        assert_eq!(filtered.servers.iter().map(|s| s.address.clone()).collect::<BTreeSet<_>>(), servers);
        // (The index path reads the index of every term; the catalogs, the label's.)
        if selector.starts_with("label=nucleo") || (catalogs && selector.contains("label=nucleo")) {
            assert!(read < 60 * 1024, "{selector}: read {read} bytes");
        }
        if selector == "label=nucleo" {
            nucleo_read = read;
        }
    }
    // Up to here the lab held fewer reservations than most lists match, so
    // they were read in one range of all of them. With more reservations
    // than matching devices, they are read by server and by key instead.
    let not_nucleo = (1..1000).filter(|i| i % 20 != 0).take(110);
    for i in not_nucleo {
        let busid = format!("{}-{}", 1 + i / 100, 1 + i % 100);
        let entry = reservation_by(format!("many@{busid}"));
        client.put(keys.reservation("10.0.0.2:3240", &busid), json(&entry), None).await.unwrap();
    }
    let everything = lab.fleet().await.unwrap();
    assert_eq!(reserved(&everything), 114);
    let want: Want = "label=nucleo".parse().unwrap();
    let expected: Vec<_> = everything.devices.iter().filter(|d| want.matches(&d.device)).cloned().collect();
    let mine = lab.fleet_matching(&want).await.unwrap();
    assert_eq!(mine.devices, expected);
    let held: Vec<_> = mine.devices.iter().filter(|d| d.reservation.is_some()).collect();
    assert_eq!(held.len(), 3, "the reservations of matching devices are shown");
    assert!(held.iter().any(|d| d.device.record.busid == taken.device.record.busid));
    assert_eq!(mine.devices.len(), 103);
    taken.release().await.unwrap();
    nucleo_read
}

/// Issue 36 item 2: a filtered list of servers from before term catalogs
/// reads the index and the matching devices' records only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filtered_list_reads_only_what_the_index_points_at() {
    let Some(cluster) = Cluster::start(1, "filtered_list").await else { return };
    filtered_lists_show_what_the_fleet_shows(&cluster, false).await;
}

/// Issue 36 item 2: when every server keeps catalogs per term, a filtered
/// list reads the term's catalogs instead, a fraction of the bytes; once a
/// server without them registers, it reads the index again, and shows the
/// same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filtered_list_reads_the_terms_catalogs_when_every_server_keeps_them() {
    let Some(cluster) = Cluster::start(1, "filtered_catalogs").await else { return };
    let from_catalogs = filtered_lists_show_what_the_fleet_shows(&cluster, true).await;
    let keys = Keys::new("test");
    let mut client = cluster.client(0).await;
    plant_as(&mut client, &keys, "10.0.0.4:3240", 1, 20, false).await;
    let mut lab = Lab::connect(cluster.endpoint(&[0])).await.unwrap();
    let want: Want = "label=nucleo".parse().unwrap();
    let everything = lab.fleet().await.unwrap();
    let from_index = lab.fleet_matching(&want).await.unwrap();
    let expected: Vec<_> = everything.devices.iter().filter(|d| want.matches(&d.device)).cloned().collect();
    assert_eq!(from_index.devices, expected);
    assert_eq!(from_index.devices.len(), 104);
    let index_read = lab.reads().bytes;
    assert!(from_catalogs * 4 < index_read, "the catalogs took {from_catalogs} bytes, the index {index_read}");
}
