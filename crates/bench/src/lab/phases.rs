//! The phases of a lab bench run, one function each, in the order they run:
//! registration, list (whole, then filtered), connect, reserve, release. Each measures its own
//! operations and reads etcd's counters around them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use usbwire_lab::{Endpoint, Hold, Lab, LabError, Reservation, Want};

use super::error::LabBenchError;
use super::etcd_metrics::Metrics;
use super::fleet::{Scale, SimulatedFleet, KEYBOARD, LABEL};
use super::progress::Progress;
use super::report::{Phase, Report};

const LIST_CALLS: usize = 20;
/// Longer than any run: a reservation left behind by a failed run still ends by itself.
const HOLD: Duration = Duration::from_secs(600);
/// How long the whole fleet may take to show up before the bench gives up.
const REGISTRATION_TIMEOUT: Duration = Duration::from_secs(600);
/// How long the registry's revision must stay put for the servers to count
/// as done writing; and how often it is read meanwhile.
const SETTLED_AFTER: Duration = Duration::from_secs(2);
const SETTLE_POLL: Duration = Duration::from_millis(100);

/// Every phase, with `observer` (one client of its own) to watch and list.
pub(super) async fn run(
    endpoint: &Endpoint,
    metrics: &Metrics,
    fleet: &mut SimulatedFleet,
    scale: Scale,
    progress: &dyn Progress,
) -> Result<Report, LabBenchError> {
    let mut observer = Lab::connect(endpoint.clone()).await?;
    let mut phases = Vec::new();
    let (registration, matching, registration_lost, started) =
        register(&mut observer, endpoint, metrics, fleet, scale, progress).await?;
    phases.push(registration);
    let settled_seconds = settle(&mut observer, started).await?;
    let parse =
        |text: String| text.parse().map_err(|e: usbwire_lab::WantError| LabBenchError::Inconsistent(e.to_string()));
    let (want, keyboards): (Want, Want) = (parse(format!("label={LABEL}"))?, parse(KEYBOARD.to_owned())?);
    phases.push(list(&mut observer, metrics, None, "list").await?);
    phases.push(list(&mut observer, metrics, Some(&want), "list-filtered").await?);
    phases.push(list(&mut observer, metrics, Some(&keyboards), "list-filtered-id").await?);
    check_filtered(&mut observer, &want).await?;
    check_filtered(&mut observer, &keyboards).await?;
    let (connect, labs) = connect(endpoint, metrics, scale.clients, progress).await?;
    phases.push(connect);
    let (reserve, reserving) = reserve(labs, &want, metrics, progress).await?;
    phases.push(reserve);
    check_exclusive(&reserving.held, &mut observer).await?;
    check_filtered(&mut observer, &want).await?;
    let reserved = reserving.held.len();
    phases.push(release(reserving.held, metrics, progress).await?);
    drop(reserving.labs);
    Ok(Report {
        servers: scale.servers,
        per_server: scale.devices_per_server,
        keyboard_every: scale.keyboard_every,
        clients: scale.clients,
        prefix: endpoint.url.prefix.clone(),
        want: want.to_string(),
        matching,
        reserved,
        registration_lost,
        settled_seconds,
        reserved_ms: reserving.reserved_ms,
        reserve_seconds: reserving.seconds,
        none_free: reserving.none_free,
        failed: reserving.failed,
        errors: reserving.errors,
        phases,
    })
}

/// Registration: from spawning every publisher at once until a watch has
/// seen each server and each of its devices (event-driven, so the bench adds
/// no polling load to what it measures). Also how many devices carry the
/// label, how many entries left the registry meanwhile (a server whose
/// lease ran out before it was done, which then registers again), and when
/// the publishers were spawned.
async fn register(
    observer: &mut Lab,
    endpoint: &Endpoint,
    metrics: &Metrics,
    fleet: &mut SimulatedFleet,
    scale: Scale,
    progress: &dyn Progress,
) -> Result<(Phase, usize, usize, Instant), LabBenchError> {
    let Scale { servers, devices_per_server: per_server, .. } = scale;
    let devices = servers * per_server;
    let (registrations, matching) = fleet.build(endpoint, servers, per_server, scale.keyboard_every);
    let start_revision = observer.fleet().await?.revision;
    let mut watch = observer.watch(start_revision).await?;
    let before = metrics.begin().await;
    let started = Instant::now();
    fleet.start(registrations);
    progress.begin(devices, "devices registered");
    // What the registry holds now, and what it has ever shown: the phase
    // ends when every server and device is there at once, so a server whose
    // lease ran out is waited for until it is back.
    let mut registered: HashSet<String> = HashSet::new();
    let mut present: HashSet<(String, String)> = HashSet::new();
    let mut seen: HashSet<(String, String)> = HashSet::new();
    let mut per_server_seen: HashMap<String, usize> = HashMap::new();
    let mut server_done_ms = Vec::with_capacity(servers);
    let mut lost = 0;
    while present.len() < devices || registered.len() < servers {
        let next = tokio::time::timeout(REGISTRATION_TIMEOUT.saturating_sub(started.elapsed()), watch.next()).await;
        let Ok(batch) = next else {
            return Err(LabBenchError::Unavailable(format!(
                "only {} of {devices} devices and {} of {servers} servers were registered at once within {REGISTRATION_TIMEOUT:?} ({} devices shown at some point)",
                present.len(),
                registered.len(),
                seen.len()
            )));
        };
        let Some(batch) = batch? else {
            return Err(LabBenchError::Unavailable("the lab registry ended the watch during registration".to_owned()));
        };
        for change in batch {
            let place = change.busid.map(|busid| (change.server.clone(), busid));
            match (change.what, change.entry.is_some(), place) {
                ("server", true, _) => {
                    registered.insert(change.server);
                }
                ("server", false, _) => {
                    lost += 1;
                    registered.remove(&change.server);
                }
                ("device", false, Some(place)) => {
                    lost += 1;
                    present.remove(&place);
                }
                ("device", true, Some(place)) => {
                    present.insert(place.clone());
                    // A server that registers again puts its devices again: count each once.
                    if !seen.insert(place) {
                        continue;
                    }
                    progress.advance();
                    let count = per_server_seen.entry(change.server).or_default();
                    *count += 1;
                    if *count == per_server {
                        server_done_ms.push(millis(started));
                    }
                }
                _ => {}
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    progress.finish();
    // A publisher sets up its reservation watch after its devices are listed:
    // count that too (not in the time), one watch each.
    metrics.settle(before.etcd.as_ref(), "Watch", servers).await;
    let phase = Phase {
        name: "registration",
        unit: "device",
        ops: devices,
        seconds,
        latencies_ms: server_done_ms,
        cost: metrics.end(before).await,
    };
    drop(watch);
    let listed = observer.fleet().await?;
    if listed.devices.len() != devices || listed.servers.len() != servers {
        return Err(LabBenchError::Inconsistent(format!(
            "the fleet lists {} servers and {} devices, registered were {servers} and {devices}",
            listed.servers.len(),
            listed.devices.len()
        )));
    }
    Ok((phase, matching, lost, started))
}

/// Waits until the servers have written their last keys: the index and
/// free-device keys follow the device keys registration waits for, and the
/// servers pace their writes, so a list right after registration would
/// measure etcd's backlog of them (a linearizable read waits until etcd has
/// applied what was committed before it). Done when the registry's
/// revision has not moved for [`SETTLED_AFTER`]; seconds from `started`
/// until it last moved.
async fn settle(observer: &mut Lab, started: Instant) -> Result<f64, LabBenchError> {
    let mut revision = observer.revision().await?;
    let mut moved = started.elapsed();
    while started.elapsed() - moved < SETTLED_AFTER {
        if started.elapsed() > REGISTRATION_TIMEOUT {
            return Err(LabBenchError::Unavailable(format!(
                "the registry's revision was still moving {REGISTRATION_TIMEOUT:?} after the fleet started: some server keeps writing"
            )));
        }
        tokio::time::sleep(SETTLE_POLL).await;
        let now = observer.revision().await?;
        if now != revision {
            (revision, moved) = (now, started.elapsed());
        }
    }
    Ok(moved.as_secs_f64())
}

/// List latency (phase `name`): one client, one call after another; the
/// whole fleet, or with `want` the devices it matches (`list --registry
/// --device`, read from the servers' catalogs of one of its terms).
async fn list(
    observer: &mut Lab,
    metrics: &Metrics,
    want: Option<&Want>,
    name: &'static str,
) -> Result<Phase, LabBenchError> {
    let before = metrics.begin().await;
    let started = Instant::now();
    let mut list_ms = Vec::with_capacity(LIST_CALLS);
    for _ in 0..LIST_CALLS {
        let call = Instant::now();
        let listed = match want {
            Some(want) => observer.fleet_matching(want).await?,
            None => observer.fleet().await?,
        };
        list_ms.push(millis(call));
        std::hint::black_box(listed);
    }
    Ok(Phase {
        name,
        unit: "list",
        ops: LIST_CALLS,
        seconds: started.elapsed().as_secs_f64(),
        latencies_ms: list_ms,
        cost: metrics.end(before).await,
    })
}

/// K clients, each with its own connection, as K machines would have.
async fn connect(
    endpoint: &Endpoint,
    metrics: &Metrics,
    clients: usize,
    progress: &dyn Progress,
) -> Result<(Phase, Vec<Lab>), LabBenchError> {
    let before = metrics.begin().await;
    let started = Instant::now();
    progress.begin(clients, "clients connected");
    let mut connecting = JoinSet::new();
    for _ in 0..clients {
        let endpoint = endpoint.clone();
        connecting.spawn(async move {
            let call = Instant::now();
            Lab::connect(endpoint).await.map(|lab| (lab, millis(call)))
        });
    }
    let mut labs = Vec::with_capacity(clients);
    let mut connect_ms = Vec::with_capacity(clients);
    while let Some(joined) = connecting.join_next().await {
        let (lab, ms) = joined??;
        labs.push(lab);
        connect_ms.push(ms);
        progress.advance();
    }
    progress.finish();
    let phase = Phase {
        name: "connect",
        unit: "client",
        ops: clients,
        seconds: started.elapsed().as_secs_f64(),
        latencies_ms: connect_ms,
        cost: metrics.end(before).await,
    };
    Ok((phase, labs))
}

/// What the reserve phase leaves: the reservations held, the clients, and
/// how the attempts went.
struct Reserving {
    held: Vec<Reservation>,
    labs: Vec<Lab>,
    /// Milliseconds each successful `reserve` took.
    reserved_ms: Vec<f64>,
    seconds: f64,
    none_free: usize,
    /// Other failures of `reserve`, and how many failed with each error.
    failed: usize,
    errors: BTreeMap<String, usize>,
}

/// Every client reserves one matching device at once.
async fn reserve(
    labs: Vec<Lab>,
    want: &Want,
    metrics: &Metrics,
    progress: &dyn Progress,
) -> Result<(Phase, Reserving), LabBenchError> {
    let clients = labs.len();
    let before = metrics.begin().await;
    let started = Instant::now();
    progress.begin(clients, "reservations tried");
    let mut reserving = JoinSet::new();
    for mut lab in labs {
        let want = want.clone();
        reserving.spawn(async move {
            let call = Instant::now();
            let result = lab.reserve(&want, Hold::For(HOLD), "usbwire bench").await;
            (lab, result, millis(call))
        });
    }
    let mut outcome = Reserving {
        held: Vec::new(),
        labs: Vec::with_capacity(clients),
        reserved_ms: Vec::new(),
        seconds: 0.0,
        none_free: 0,
        failed: 0,
        errors: BTreeMap::new(),
    };
    let mut attempt_ms = Vec::with_capacity(clients);
    while let Some(joined) = reserving.join_next().await {
        let (lab, result, ms) = joined?;
        outcome.labs.push(lab);
        progress.advance();
        attempt_ms.push(ms);
        match result {
            Ok(reservation) => {
                outcome.reserved_ms.push(ms);
                outcome.held.push(reservation);
            }
            Err(LabError::NoneFree { .. }) => outcome.none_free += 1,
            Err(error) => {
                outcome.failed += 1;
                *outcome.errors.entry(error.to_string()).or_insert(0) += 1;
            }
        }
    }
    outcome.seconds = started.elapsed().as_secs_f64();
    progress.finish();
    // Per attempt: a client that finds none free has paid its read, lease and transactions too.
    let phase = Phase {
        name: "reserve",
        unit: "attempt",
        ops: clients,
        seconds: outcome.seconds,
        latencies_ms: attempt_ms,
        cost: metrics.end(before).await,
    };
    Ok((phase, outcome))
}

/// Exclusivity, twice: no device in two successes, and etcd holds as many reservations.
async fn check_exclusive(held: &[Reservation], observer: &mut Lab) -> Result<(), LabBenchError> {
    let distinct: HashSet<(&str, &str)> =
        held.iter().map(|r| (r.device.server.as_str(), r.device.record.busid.as_str())).collect();
    if distinct.len() != held.len() {
        return Err(LabBenchError::Inconsistent(format!(
            "{} reservations succeeded for only {} distinct devices: a device was reserved twice",
            held.len(),
            distinct.len()
        )));
    }
    let shown = observer.fleet().await?.devices.iter().filter(|d| d.reservation.is_some()).count();
    if shown != held.len() {
        return Err(LabBenchError::Inconsistent(format!(
            "{} reservations succeeded but the fleet shows {shown}",
            held.len()
        )));
    }
    Ok(())
}

/// How many times the filtered list and the fleet are read again when the
/// registry changed between them (a lease that ran out, a server back).
const SAME_REVISION_TRIES: usize = 10;

/// The filtered list shows what the whole fleet, filtered here, shows at the
/// same revision: the same servers, devices and reservations.
async fn check_filtered(observer: &mut Lab, want: &Want) -> Result<(), LabBenchError> {
    for _ in 0..SAME_REVISION_TRIES {
        let matching = observer.fleet_matching(want).await?;
        let mut fleet = observer.fleet().await?;
        if fleet.revision != matching.revision {
            continue;
        }
        fleet.devices.retain(|d| want.matches(&d.device));
        let with_devices: HashSet<&str> = fleet.devices.iter().map(|d| d.device.server.as_str()).collect();
        fleet.servers.retain(|server| with_devices.contains(server.address.as_str()));
        let addresses =
            |servers: &[usbwire_lab::ServerEntry]| servers.iter().map(|s| s.address.clone()).collect::<Vec<_>>();
        if addresses(&fleet.servers) != addresses(&matching.servers) || fleet.devices != matching.devices {
            return Err(LabBenchError::Inconsistent(format!(
                "at revision {} the list of {want} shows {} devices on {} servers, the fleet filtered {} on {}",
                fleet.revision,
                matching.devices.len(),
                matching.servers.len(),
                fleet.devices.len(),
                fleet.servers.len()
            )));
        }
        return Ok(());
    }
    Err(LabBenchError::Unavailable(format!(
        "the registry changed between every one of {SAME_REVISION_TRIES} filtered lists and the fleet read after it: it should be quiet after registration"
    )))
}

/// The holders let go, all at once.
async fn release(held: Vec<Reservation>, metrics: &Metrics, progress: &dyn Progress) -> Result<Phase, LabBenchError> {
    let reserved = held.len();
    let before = metrics.begin().await;
    let started = Instant::now();
    progress.begin(reserved, "reservations released");
    let mut releasing = JoinSet::new();
    for reservation in held {
        releasing.spawn(async move {
            let call = Instant::now();
            reservation.release().await.map(|()| millis(call))
        });
    }
    let mut release_ms = Vec::with_capacity(reserved);
    while let Some(joined) = releasing.join_next().await {
        release_ms.push(joined??);
        progress.advance();
    }
    progress.finish();
    Ok(Phase {
        name: "release",
        unit: "reservation",
        ops: reserved,
        seconds: started.elapsed().as_secs_f64(),
        latencies_ms: release_ms,
        cost: metrics.end(before).await,
    })
}

fn millis(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}
