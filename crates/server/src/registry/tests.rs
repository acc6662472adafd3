//! The registry's import rules, waits and releases, with real loopback sockets
//! for the peer probes and a device whose reset takes time.

use std::net::SocketAddr;

use usbwire_proto::op::OpStatus;
use usbwire_proto::reservation::ReservationToken;

use super::*;
use crate::peer::PeerProbe;

fn peer() -> SocketAddr {
    "127.0.0.1:5000".parse().unwrap()
}

fn loopback() -> Box<dyn Device> {
    Box::new(usbwire_gadgets::loopback(usbwire_device::Speed::HIGH))
}

#[test]
fn named_exports_keep_their_bus_id_and_virtual_ones_avoid_it() {
    let registry = Registry::default();
    let busid = BusId::new("1-1").unwrap();
    assert!(registry.add_named("host", busid.clone(), (1, 4), "/sys/devices/x/1-1".into(), loopback()).is_ok());
    assert!(registry.add_named("host", busid, (1, 4), String::new(), loopback()).is_err(), "taken");
    assert_eq!(registry.add("loopback", loopback()).as_str(), "0-1");
    let listed = registry.list();
    assert_eq!((listed[0].record.busnum, listed[0].record.devnum), (1, 4));
    assert_eq!(listed[0].record.path, "/sys/devices/x/1-1");
}

/// Virtual devices took 1-1…1-N (and 2-N for SuperSpeed), the bus ids of
/// the first real devices: a real device at 1-1 on a server that exported a
/// virtual one first was refused as taken.
#[test]
fn a_real_device_at_1_1_is_exported_beside_virtual_devices() {
    let registry = Registry::default();
    let superspeed = Box::new(usbwire_gadgets::loopback(usbwire_device::Speed::SUPER));
    let virtual_ids: Vec<String> = [
        registry.add("loopback", loopback()),
        registry.add("loopback", superspeed),
        registry.add("loopback", loopback()),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    assert_eq!(virtual_ids, ["0-1", "0-2", "0-3"], "every virtual device on bus 0, in export order");
    // Where the kernel puts a real device: bus 1 (or 2), from 1 up.
    for (busid, numbers) in [("1-1", (1, 2)), ("2-1", (2, 2)), ("1-1.2", (1, 3))] {
        let real = BusId::new(busid).unwrap();
        let path = format!("/sys/devices/pci0000:00/usb1/{busid}");
        assert!(registry.add_named("host", real, numbers, path, loopback()).is_ok(), "{busid} refused");
    }
    let listed = registry.list();
    let records: Vec<(&str, u32, u32)> =
        listed.iter().map(|e| (e.record.busid.as_str(), e.record.busnum, e.record.devnum)).collect();
    assert_eq!(
        records,
        [("0-1", 0, 1), ("0-2", 0, 2), ("0-3", 0, 3), ("1-1", 1, 2), ("2-1", 2, 2), ("1-1.2", 1, 3)],
        "the devid a URB header carries is busnum << 16 | devnum: 0x00000001 for 0-1"
    );
    // A withdrawn virtual device's bus id is taken by the next one.
    assert!(registry.remove("0-2"));
    assert_eq!(registry.add("loopback", loopback()).as_str(), "0-2");
}

/// An importer with no socket: always counts as present.
fn importer() -> Importer {
    Importer { client: peer(), identity: None, probe: PeerProbe::none(), reservation: None }
}

/// Both ends of a real loopback TCP connection: the server's end, and the client's.
fn tcp_pair() -> (std::net::TcpStream, std::net::TcpStream) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    (server, client)
}

async fn import(registry: &Registry, busid: &BusId, importer: Importer, wait: Duration) -> Result<Lease, ImportError> {
    registry.import(busid, importer, |_, _, _| true, wait).await
}

/// A device whose reset takes a while, as a real one can.
struct SlowReset(Box<dyn Device>, Duration);

impl Device for SlowReset {
    fn summary(&self) -> DeviceSummary {
        self.0.summary()
    }
    fn endpoint_type(&self, direction: usbwire_proto::Direction, number: u8) -> Option<usbwire_device::TransferType> {
        self.0.endpoint_type(direction, number)
    }
    fn submit(&mut self, urb: usbwire_device::Urb) {
        self.0.submit(urb);
    }
    fn poll_complete(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<usbwire_device::Completion> {
        self.0.poll_complete(cx)
    }
    fn cancel(&mut self, seqnum: u32) {
        self.0.cancel(seqnum);
    }
    fn reset(&mut self) {
        std::thread::sleep(self.1);
        self.0.reset();
    }
}

#[tokio::test]
async fn a_device_held_by_a_live_connection_on_another_host_is_busy_at_once() {
    let registry = Registry::default();
    let busid = registry.add("loopback", loopback());
    let (server_end, _client_end) = tcp_pair();
    let probe = PeerProbe::of(&server_end);
    let _lease = import(
        &registry,
        &busid,
        Importer { client: peer(), identity: None, probe, reservation: None },
        Duration::ZERO,
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let elsewhere = Importer {
        client: "10.0.0.2:5000".parse().unwrap(),
        identity: None,
        probe: PeerProbe::none(),
        reservation: None,
    };
    let refused = import(&registry, &busid, elsewhere, Duration::from_secs(30)).await.err().unwrap();
    assert!(matches!(refused, ImportError::InUse { holder } if holder == peer()), "{refused:?}");
    assert_eq!(refused.status(), OpStatus::DEV_BUSY);
    assert!(started.elapsed() < Duration::from_secs(5), "a live holder is not waited for: {:?}", started.elapsed());
    assert!(refused.to_string().contains("detach it there first"), "{refused}");
}

#[tokio::test]
async fn the_holders_own_host_is_refused_only_after_the_wait() {
    let registry = Registry::default();
    let busid = registry.add("loopback", loopback());
    let (server_end, _client_end) = tcp_pair();
    let probe = PeerProbe::of(&server_end);
    let _lease = import(
        &registry,
        &busid,
        Importer { client: peer(), identity: None, probe, reservation: None },
        Duration::ZERO,
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let refused = import(&registry, &busid, importer(), Duration::from_millis(300)).await.err().unwrap();
    assert!(matches!(refused, ImportError::InUse { .. }), "{refused:?}");
    assert!(started.elapsed() >= Duration::from_millis(300), "waited for a late close first");
}

#[tokio::test]
async fn an_import_waits_for_a_holder_that_hung_up_and_then_gets_the_device() {
    let registry = Registry::default();
    let busid = registry.add("loopback", loopback());
    let (server_end, client_end) = tcp_pair();
    let lease = import(
        &registry,
        &busid,
        Importer { client: peer(), identity: None, probe: PeerProbe::of(&server_end), reservation: None },
        Duration::ZERO,
    )
    .await
    .unwrap();
    // The client hangs up; the holder's task has not noticed yet, then does 300 ms later.
    drop(client_end);
    let holder = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(server_end);
        lease.release().await;
    });
    let started = std::time::Instant::now();
    let lease = import(&registry, &busid, importer(), Duration::from_secs(30)).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(250), "waited for the release: {:?}", started.elapsed());
    assert_eq!(lease.record().busid, busid);
    holder.await.unwrap();
}

#[tokio::test]
async fn an_import_waits_while_the_device_is_being_reset() {
    let registry = Registry::default();
    let busid = registry.add("slow", Box::new(SlowReset(loopback(), Duration::from_millis(400))));
    let lease = import(&registry, &busid, importer(), Duration::ZERO).await.unwrap();
    // The lease ends in another task; the reset holds the device in Releasing for 400 ms.
    let releasing = tokio::spawn(lease.release());
    while registry.list()[0].state != DeviceState::Available {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(matches!(*lock(&lock(&registry.exports)[0].slot), Slot::Releasing), "listed while resetting");
    let lease = import(&registry, &busid, importer(), Duration::from_secs(30)).await;
    assert!(lease.is_ok(), "{:?}", lease.err());
    releasing.await.unwrap();
}

#[tokio::test]
async fn a_release_resets_the_device_off_the_runtime_and_resolves_when_it_is_back() {
    // One worker thread (tokio::test's runtime): a reset run on it would stop the ticker.
    let registry = Registry::default();
    let busid = registry.add("slow", Box::new(SlowReset(loopback(), Duration::from_millis(400))));
    let lease = import(&registry, &busid, importer(), Duration::ZERO).await.unwrap();
    let started = std::time::Instant::now();
    let ticker = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        started.elapsed()
    };
    let ((), ticked) = tokio::join!(lease.release(), ticker);
    assert!(ticked < Duration::from_millis(300), "the runtime ran on during the reset: {ticked:?}");
    assert!(started.elapsed() >= Duration::from_millis(400), "resolved after the reset: {:?}", started.elapsed());
    assert!(matches!(*lock(&lock(&registry.exports)[0].slot), Slot::Available(_)), "listed again");
}

#[tokio::test]
async fn a_dropped_lease_resets_on_a_blocking_thread_and_the_next_import_waits_for_it() {
    let registry = Registry::default();
    let busid = registry.add("slow", Box::new(SlowReset(loopback(), Duration::from_millis(400))));
    let lease = import(&registry, &busid, importer(), Duration::ZERO).await.unwrap();
    let started = std::time::Instant::now();
    // As when a connection task is cancelled or panics.
    drop(lease);
    assert!(started.elapsed() < Duration::from_millis(200), "the drop did not wait: {:?}", started.elapsed());
    let lease = import(&registry, &busid, importer(), Duration::from_secs(30)).await;
    assert!(lease.is_ok(), "{:?}", lease.err());
    assert!(started.elapsed() >= Duration::from_millis(400), "waited for the reset: {:?}", started.elapsed());
}

#[tokio::test]
async fn the_wait_for_a_release_is_bounded_and_then_says_busy() {
    let registry = Registry::default();
    let busid = registry.add("loopback", loopback());
    let (server_end, client_end) = tcp_pair();
    let _stuck = import(
        &registry,
        &busid,
        Importer { client: peer(), identity: None, probe: PeerProbe::of(&server_end), reservation: None },
        Duration::ZERO,
    )
    .await
    .unwrap();
    drop(client_end);
    // The holder hung up but never gives the device back.
    let started = std::time::Instant::now();
    let refused = import(&registry, &busid, importer(), Duration::from_millis(300)).await.err().unwrap();
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    assert!(matches!(refused, ImportError::StillReleasing { waited } if waited == Duration::from_millis(300)));
    assert_eq!(refused.status(), OpStatus::DEV_BUSY);
    let message = refused.to_string();
    assert!(message.contains("still being released") && message.contains("300 ms"), "{message}");
}

#[tokio::test]
async fn withdrawing_a_device_ends_the_wait_for_it() {
    let registry = Registry::default();
    let busid = registry.add("loopback", loopback());
    let (server_end, client_end) = tcp_pair();
    let _held = import(
        &registry,
        &busid,
        Importer { client: peer(), identity: None, probe: PeerProbe::of(&server_end), reservation: None },
        Duration::ZERO,
    )
    .await
    .unwrap();
    drop(client_end);
    let unbind = {
        let registry = registry.clone();
        let busid = busid.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            registry.remove(busid.as_str());
        })
    };
    let refused = import(&registry, &busid, importer(), Duration::from_secs(30)).await.err().unwrap();
    assert!(matches!(refused, ImportError::NoDevice), "{refused:?}");
    unbind.await.unwrap();
}

#[tokio::test]
async fn withdrawing_an_imported_device_signals_its_importer_and_does_not_put_it_back() {
    let registry = Registry::default();
    let busid = registry.add("loopback", loopback());
    let lease = import(&registry, &busid, importer(), Duration::ZERO).await.unwrap();
    let holder = lease.holder();
    let told = || tokio::time::timeout(Duration::ZERO, holder.withdrawn());
    assert!(told().await.is_err());
    assert!(registry.remove(busid.as_str()));
    assert!(told().await.is_ok(), "the importer is told");
    assert!(registry.list().is_empty());
    lease.release().await;
    assert!(registry.list().is_empty(), "not put back after the import ends");
    let gone = import(&registry, &busid, importer(), Duration::from_secs(30)).await;
    assert!(matches!(gone, Err(ImportError::NoDevice)));
    assert!(!registry.remove(busid.as_str()));
}

#[tokio::test]
async fn a_reserved_device_imports_only_with_its_reservation() {
    let registry = Registry::default();
    let busid = registry.add("loopback", loopback());
    let token = ReservationToken([7; 32]);
    let mut changes = registry.changes();
    registry.set_reservations(HashMap::from([(busid.to_string(), reserved(&token))]));
    assert!(registry.is_reserved(busid.as_str()));
    let without = import(&registry, &busid, importer(), Duration::ZERO).await;
    assert!(matches!(without, Err(ImportError::Reserved)), "no token");
    let other = Importer { reservation: Some(ReservationToken([8; 32])), ..importer() };
    assert!(matches!(import(&registry, &busid, other, Duration::ZERO).await, Err(ImportError::Reserved)));
    assert_eq!(ImportError::Reserved.status(), OpStatus::DEV_BUSY, "what a stock client understands");
    let holder = Importer { reservation: Some(token), ..importer() };
    let lease = import(&registry, &busid, holder, Duration::ZERO).await.expect("the holder imports");
    assert!(changes.has_changed().unwrap(), "an import is a change a publisher sees");
    changes.mark_unchanged();
    lease.release().await;
    assert!(changes.has_changed().unwrap(), "so is the release");
    // The registry unreachable: reservations are not enforced, anyone imports directly.
    registry.forget_reservations();
    assert!(!registry.is_reserved(busid.as_str()));
    let _direct = import(&registry, &busid, importer(), Duration::ZERO).await.expect("direct import");
}

#[tokio::test]
async fn a_reservation_ending_while_its_importer_is_away_lets_the_parked_session_go() {
    let registry = Registry::default();
    let busid = registry.add("loopback", loopback());
    let token = ReservationToken([1; 32]);
    registry.set_reservations(HashMap::from([(busid.to_string(), reserved(&token))]));
    let lease =
        import(&registry, &busid, Importer { reservation: Some(token), ..importer() }, Duration::ZERO).await.unwrap();
    let holder = lease.holder();
    holder.set_resuming(Some(SystemTime::now()));
    let abandoned = tokio::spawn(async move { holder.abandoned().await });
    tokio::task::yield_now().await;
    // Another reservation ending changes nothing for it.
    registry.set_reservations(HashMap::from([
        (busid.to_string(), reserved(&token)),
        ("9-9".to_owned(), reserved(&ReservationToken([0; 32]))),
    ]));
    registry.set_reservations(HashMap::from([(busid.to_string(), reserved(&token))]));
    tokio::task::yield_now().await;
    assert!(!abandoned.is_finished());
    registry.set_reservations(HashMap::new());
    tokio::time::timeout(Duration::from_secs(5), abandoned).await.expect("the parked session is told").unwrap();
    drop(lease);
}

#[tokio::test]
async fn a_notice_nobody_took_during_one_absence_does_not_end_the_next() {
    let registry = Registry::default();
    let busid = registry.add("loopback", loopback());
    let token = ReservationToken([1; 32]);
    registry.set_reservations(HashMap::from([(busid.to_string(), reserved(&token))]));
    let lease =
        import(&registry, &busid, Importer { reservation: Some(token), ..importer() }, Duration::ZERO).await.unwrap();
    let holder = lease.holder();
    // Away, and the reservation ends while the session is busy resuming (nobody
    // waits on the notice), then the client is back in time: the session goes on.
    holder.set_resuming(Some(SystemTime::now()));
    registry.set_reservations(HashMap::new());
    holder.set_resuming(None);
    // The next absence starts clean: nothing tells it to give up.
    holder.set_resuming(Some(SystemTime::now()));
    let waited = tokio::time::timeout(Duration::from_millis(300), holder.abandoned()).await;
    assert!(waited.is_err(), "an old notice ended a new absence");
    drop(lease);
}

#[tokio::test]
async fn an_unplug_from_a_port_a_bind_rule_names_is_a_reenumeration_and_an_unbind_is_not() {
    let registry = Registry::default();
    let named = BusId::new("3-1").unwrap();
    let other = BusId::new("3-2").unwrap();
    for busid in [&named, &other] {
        registry.add_named("host", busid.clone(), (3, 1), String::new(), loopback()).map_err(|_| ()).unwrap();
    }
    registry.set_followed_ports(["3-1".to_owned()].into());
    let on_named = import(&registry, &named, importer(), Duration::ZERO).await.unwrap().holder();
    let on_other = import(&registry, &other, importer(), Duration::ZERO).await.unwrap().holder();
    assert!(on_named.left_a_followed_port(true), "gone from a followed port");
    assert!(!on_other.left_a_followed_port(true), "no rule names this port");
    assert!(!on_named.left_a_followed_port(false), "still plugged in");
    registry.unplugged("3-1");
    on_named.withdrawn().await;
    assert!(on_named.left_a_followed_port(false), "withdrawn because it was unplugged");

    let unbound = BusId::new("3-3").unwrap();
    registry.add_named("host", unbound.clone(), (3, 3), String::new(), loopback()).map_err(|_| ()).unwrap();
    registry.set_followed_ports(["3-1".to_owned(), "3-3".to_owned()].into());
    let on_unbound = import(&registry, &unbound, importer(), Duration::ZERO).await.unwrap().holder();
    registry.remove("3-3");
    on_unbound.withdrawn().await;
    assert!(!on_unbound.left_a_followed_port(false), "unbound by hand: withdrawn for good");
}

/// A reservation of `token` for someone else than the importers here.
fn reserved(token: &ReservationToken) -> Reservation {
    let reserved_for = ReservedFor {
        holder: "ada@lab".into(),
        client: "usbwire reserve".into(),
        since_at: Some("2026-11-26T02:00:00Z".into()),
        until_at: Some("2026-11-26T03:00:00Z".into()),
    };
    Reservation { digest: crate::reservation::digest(token), reserved_for }
}

#[tokio::test]
async fn a_reservation_says_for_whom_and_until_when() {
    let registry = Registry::default();
    let busid = registry.add("loopback", loopback());
    assert_eq!(registry.reserved_for(busid.as_str()), None);
    registry.set_reservations(HashMap::from([(busid.to_string(), reserved(&ReservationToken([3; 32])))]));
    let shown = registry.reserved_for(busid.as_str()).expect("reserved");
    assert_eq!((shown.holder.as_str(), shown.until_at.as_deref()), ("ada@lab", Some("2026-11-26T03:00:00Z")));
    let entries = crate::devstate::entries(&registry, |_, _, _| true);
    assert_eq!(entries[0].reservation.as_ref().map(|r| r.holder.as_str()), Some("ada@lab"));
}

#[tokio::test]
async fn withdrawn_devices_are_remembered_newest_first_bounded_until_exported_again() {
    let registry = Registry::default();
    let kept = refusal_facts::WITHDRAWN_KEPT;
    let busids: Vec<BusId> = (0..kept + 3).map(|_| registry.add("loopback", loopback())).collect();
    for busid in &busids {
        assert!(registry.remove(busid.as_str()));
    }
    let withdrawn = registry.recently_withdrawn();
    assert_eq!(withdrawn.len(), kept, "bounded");
    assert_eq!(withdrawn[0].shown.busid, busids[kept + 2].as_str(), "newest first");
    assert_eq!((withdrawn[0].shown.why.as_str(), withdrawn[0].shown.kind.as_str()), ("unbound", "loopback"));
    let unplugged = registry.add("loopback", loopback());
    assert_eq!(unplugged, busids[0], "the first free bus id again");
    assert!(registry.recently_withdrawn().iter().all(|w| w.shown.busid != unplugged.as_str()), "exported again");
    assert!(registry.unplugged(unplugged.as_str()));
    assert_eq!(registry.recently_withdrawn()[0].shown.why, "unplugged");
    let document = crate::devstate::document(&registry, |_, _, _| true);
    assert_eq!(document.withdrawn.len(), kept);
    let hidden = crate::devstate::document(&registry, |_, record, _| record.busid != unplugged);
    assert!(hidden.withdrawn.iter().all(|w| w.busid != unplugged.as_str()), "the access rules apply");
}

/// A device that has gone away (its process disconnected, or it was unplugged).
struct Unplugged(Box<dyn Device>);

impl Device for Unplugged {
    fn summary(&self) -> DeviceSummary {
        self.0.summary()
    }
    fn endpoint_type(&self, direction: usbwire_proto::Direction, number: u8) -> Option<usbwire_device::TransferType> {
        self.0.endpoint_type(direction, number)
    }
    fn submit(&mut self, urb: usbwire_device::Urb) {
        self.0.submit(urb);
    }
    fn poll_complete(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<usbwire_device::Completion> {
        self.0.poll_complete(cx)
    }
    fn cancel(&mut self, seqnum: u32) {
        self.0.cancel(seqnum);
    }
    fn reset(&mut self) {}
    fn is_gone(&self) -> bool {
        true
    }
}

#[tokio::test]
async fn the_release_of_a_gone_device_does_not_withdraw_what_came_back_under_its_bus_id() {
    let registry = Registry::default();
    let (busid, devnum) = registry.reserve();
    let path = || "/sys/devices/usbwire/external/0-1".to_owned();
    assert!(registry
        .add_named("external", busid.clone(), (VIRTUAL_BUS, devnum), path(), Box::new(Unplugged(loopback())))
        .is_ok());
    let lease = import(&registry, &busid, importer(), Duration::ZERO).await.unwrap();
    // Its process left and came back before the old import let go of the device.
    assert!(registry.unplugged(busid.as_str()));
    assert!(registry.add_named("external", busid.clone(), (VIRTUAL_BUS, devnum), path(), loopback()).is_ok());
    lease.release().await;
    assert_eq!(registry.list().len(), 1, "the device that came back stays exported");
    assert_eq!(registry.add("loopback", loopback()).as_str(), "0-2", "a reserved bus id is not handed out");
}
