//! Real etcd for the tests that need one: members of a cluster on free
//! loopback ports, each in its own directory, killed and removed when the
//! cluster is dropped. The binary is `$USBWIRE_ETCD`, else `etcd` on the
//! `PATH` (Debian's etcd-server, which `scripts/test.sh` installs); without
//! one these tests say so on stderr and pass, as they cannot run.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use etcd_client::{Client, PutOptions, Txn, TxnOp};

use crate::entry::{timestamp, DeviceEntry, Fleet, Keys, ServerEntry, SCHEMA_VERSION};

use crate::etcd::Endpoint;

pub(crate) struct Cluster {
    etcd: PathBuf,
    dir: PathBuf,
    initial: String,
    members: Vec<Member>,
}

struct Member {
    client_port: u16,
    peer_port: u16,
    process: Option<Child>,
}

impl Cluster {
    /// `n` members, started and answering; `None` when etcd is not installed.
    pub(crate) async fn start(n: usize, test: &str) -> Option<Self> {
        let Some(etcd) = etcd_binary() else {
            eprintln!("{test}: skipped, no etcd binary (install etcd-server or set USBWIRE_ETCD)");
            return None;
        };
        let dir = std::env::temp_dir().join(format!(
            "usbwire-lab-{test}-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).expect("test directory");
        let members: Vec<Member> =
            (0..n).map(|_| Member { client_port: free_port(), peer_port: free_port(), process: None }).collect();
        let initial = members
            .iter()
            .enumerate()
            .map(|(i, m)| format!("m{i}=http://127.0.0.1:{}", m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Self { etcd, dir, initial, members };
        for i in 0..n {
            cluster.start_member(i);
        }
        for i in 0..n {
            cluster.wait_answers(i).await;
        }
        Some(cluster)
    }

    fn start_member(&mut self, i: usize) {
        let (client, peer) = (self.members[i].client_port, self.members[i].peer_port);
        let log = std::fs::File::create(self.dir.join(format!("m{i}.log"))).expect("etcd log");
        let process = Command::new(&self.etcd)
            .args(["--name", &format!("m{i}")])
            .arg("--data-dir")
            .arg(self.dir.join(format!("m{i}")))
            .args(["--listen-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--advertise-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &self.initial, "--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "usbwire-lab-unit-test"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("etcd log"))
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        self.members[i].process = Some(process);
    }

    /// Waits until member `i` serves requests (the cluster has a leader).
    async fn wait_answers(&self, i: usize) {
        let url = format!("http://127.0.0.1:{}", self.members[i].client_port);
        for _ in 0..300 {
            if let Ok(Ok(mut client)) =
                tokio::time::timeout(Duration::from_secs(1), Client::connect([&url], None)).await
            {
                if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(1), client.get("probe", None)).await {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("etcd member {i} did not answer within 30 s (log in {})", self.dir.display());
    }

    /// The registry on `members`, under the key prefix `test`.
    pub(crate) fn endpoint(&self, members: &[usize]) -> Endpoint {
        let hosts: Vec<String> =
            members.iter().map(|&i| format!("127.0.0.1:{}", self.members[i].client_port)).collect();
        Endpoint::plain(format!("etcd://{}/test", hosts.join(",")).parse().expect("registry URL"))
    }

    /// Member `i`'s client URL (`http://127.0.0.1:PORT`).
    pub(crate) fn url(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client_port)
    }

    /// A client of member `i` alone.
    pub(crate) async fn client(&self, i: usize) -> Client {
        self.endpoint(&[i]).connect().await.expect("etcd member answers")
    }

    /// A member that is not the leader.
    pub(crate) async fn follower(&self) -> usize {
        let mut client = self.client(0).await;
        let leader = client.status().await.expect("etcd status").leader();
        for i in 0..self.members.len() {
            let mut client = self.client(i).await;
            if client.status().await.expect("etcd status").header().map(|h| h.member_id()) != Some(leader) {
                return i;
            }
        }
        panic!("every member is the leader");
    }

    /// Kills member `i` at once (SIGKILL: no goodbye to its clients).
    pub(crate) fn kill(&mut self, i: usize) {
        if let Some(mut process) = self.members[i].process.take() {
            let _ = process.kill();
            let _ = process.wait();
        }
    }

    /// Stops member `i` (SIGSTOP) or lets it go on (SIGCONT): a member too
    /// busy to answer, with its connections open.
    pub(crate) fn signal(&self, i: usize, signal: &str) {
        let pid = self.members[i].process.as_ref().expect("member running").id();
        let sent = Command::new("kill").args([signal, &pid.to_string()]).status().expect("kill runs");
        assert!(sent.success(), "kill {signal} {pid}");
        if signal == "-STOP" {
            // kill returns once the signal is sent; a thread already running
            // may answer one more request before it stops: wait until all have.
            let stopped = || {
                let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the member's threads");
                tasks.flatten().all(|task| {
                    let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
                    let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
                    matches!(state, Some(Some('T' | 't')) | None)
                })
            };
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while !stopped() {
                assert!(std::time::Instant::now() < deadline, "etcd {pid} did not stop");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// Starts member `i` again on its data, and waits until it answers.
    pub(crate) async fn restart(&mut self, i: usize) {
        self.kill(i);
        self.start_member(i);
        self.wait_answers(i).await;
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn etcd_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("USBWIRE_ETCD") {
        return Some(path.into());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join("etcd")).find(|candidate| candidate.is_file())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

/// A plain usbwire server's entry at `address`.
pub(crate) fn server_entry(address: &str) -> ServerEntry {
    ServerEntry {
        schema_version: SCHEMA_VERSION,
        address: address.to_owned(),
        tls_fingerprint: None,
        plain: true,
        implementation: "usbwire".to_owned(),
        version: "test".to_owned(),
        started_at: timestamp(std::time::SystemTime::now()),
        catalog: false,
        catalog_terms: Vec::new(),
    }
}

/// The fleet as its device keys say, at `revision`: every key under the
/// prefix, through [`Fleet::from_pairs`]. What lists are checked against.
pub(crate) async fn fleet_from_keys(client: &mut Client, keys: &Keys, revision: i64) -> Fleet {
    let mut kvs = Vec::new();
    for prefix in keys.fleet_prefixes() {
        let end = crate::lab::prefix_end(&prefix);
        let mut from = prefix.into_bytes();
        loop {
            let options =
                etcd_client::GetOptions::new().with_range(end.clone()).with_limit(1000).with_revision(revision);
            let mut page = client.get(from.clone(), Some(options)).await.expect("read the registry");
            let more = page.more();
            let mut got = page.take_kvs();
            if let Some(last) = got.last() {
                from = [last.key(), &[0]].concat();
            }
            kvs.append(&mut got);
            if !more {
                break;
            }
        }
    }
    Fleet::from_pairs(keys, revision, kvs.iter().map(|kv| (kv.key(), kv.value())))
}

/// Puts `devices` devices of one server straight into the registry (every
/// `every`th labelled `nucleo`, the others `other`), with their
/// index and free-device keys (as a server before catalogs would), in
/// transactions of 128 puts.
pub(crate) async fn plant(client: &mut Client, keys: &Keys, server: &str, devices: usize, every: usize) {
    plant_as(client, keys, server, devices, every, false).await;
}

/// The same, and with `catalog` the server's catalog too (as a server does now).
pub(crate) async fn plant_as(
    client: &mut Client,
    keys: &Keys,
    server: &str,
    devices: usize,
    every: usize,
    catalog: bool,
) {
    let lease = client.lease_grant(60, None).await.unwrap().id();
    let on_lease = || Some(PutOptions::new().with_lease(lease));
    let catalog_terms = if catalog { crate::catalog::TERM_KINDS.map(String::from).to_vec() } else { Vec::new() };
    let entry = ServerEntry { catalog, catalog_terms, ..server_entry(server) };
    client.put(keys.server(server), serde_json::to_string(&entry).unwrap(), on_lease()).await.unwrap();
    let mut ops = Vec::new();
    let mut entries = std::collections::BTreeMap::new();
    for i in 0..devices {
        let busid = format!("{}-{}", 1 + i / 100, 1 + i % 100);
        let mut entry: DeviceEntry = serde_json::from_value(serde_json::json!({
            "schema_version": SCHEMA_VERSION, "server": server, "busid": busid,
            "vendor_id": "0483", "product_id": "374b", "state": "available",
            "labels": [if i % every == 0 { "nucleo" } else { "other" }], "class": "ef", "interface_classes": ["02", "0a"]
        }))
        .unwrap();
        entry.server = server.to_owned();
        ops.push(TxnOp::put(keys.device(server, &busid), serde_json::to_string(&entry).unwrap(), on_lease()));
        let json = serde_json::to_vec(&entry).unwrap();
        entries.insert(busid.clone(), (entry.clone(), json));
        for key in keys.index_entries(&entry) {
            ops.push(TxnOp::put(key, "available", on_lease()));
        }
        for key in keys.free_entries(&entry) {
            ops.push(TxnOp::put(key, "available", on_lease()));
        }
    }
    if catalog {
        // Every entry, and those of each term, as a server writes them.
        let prefixes: Vec<(String, Vec<String>)> = entries
            .values()
            .map(|(entry, _)| (entry.record.busid.clone(), crate::catalog::term_catalogs(keys, entry)))
            .collect();
        let whole = keys.catalog_of(server);
        let mut catalogs: std::collections::BTreeMap<&str, Vec<(&str, &[u8])>> = std::collections::BTreeMap::new();
        for ((_, json), (busid, terms)) in entries.values().zip(&prefixes) {
            for prefix in std::iter::once(&whole).chain(terms) {
                catalogs.entry(prefix.as_str()).or_default().push((busid.as_str(), json.as_slice()));
            }
        }
        let (published, mut layouts) = (std::collections::HashMap::new(), crate::catalog::Layouts::new());
        for (key, value) in crate::catalog::changes(&catalogs, &keys.catalogs_of(server), &published, &mut layouts) {
            ops.push(TxnOp::put(key, value.unwrap_or_default(), on_lease()));
        }
    }
    for batch in ops.chunks(128) {
        client.txn(Txn::new().and_then(batch.to_vec())).await.unwrap();
    }
}
