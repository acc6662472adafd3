//! A lab reservation holds while its device re-enumerates: through the real
//! binary (`usbwire serve --virtual dfu=FILE --registry etcd://…`) and a
//! real etcd, a DFU board reserved in the registry is flashed through both
//! re-enumerations by a follower that imports the bus id again with its
//! reservation's token each time (`usbwire_client::follow::Reimport`, as
//! `usbwire attach --follow --registry` does), while another client, trying
//! the bus id all along and right after each re-enumeration, never gets it.

use std::str::FromStr as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use usbwire_client::follow::{Reimport, WentAway};
use usbwire_client::{ClientError, Security};
use usbwire_gadgets::dfu::{DFU_PRODUCT_ID, RUNTIME_PRODUCT_ID, TRANSFER_SIZE};
use usbwire_lab::{Endpoint, Hold, Lab, LabError, RegistryUrl, Reservation, Want, DEFAULT_TTL};
use usbwire_proto::op::BusId;
use usbwire_proto::resume::EndReason;
use usbwire_proto::Direction;
use usbwire_testing::dfu::{Reply, UrbHost};
use usbwire_testing::etcd::Etcd;
use usbwire_testing::process::{free_addr, scratch, start};
use usbwire_transport::PeerStream;

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");
/// How long the server takes to register its device, or to learn of a reservation.
const SETTLE: Duration = Duration::from_secs(30);

/// Reserves 0-1 once the server has registered it.
async fn reserve(registry: &str) -> Reservation {
    let endpoint = Endpoint::plain(RegistryUrl::from_str(registry).unwrap());
    let mut lab = Lab::connect(endpoint).await.unwrap();
    let want = Want::from_str("0-1").unwrap();
    let deadline = Instant::now() + SETTLE;
    loop {
        match lab.reserve(&want, Hold::WhileRunning { ttl: DEFAULT_TTL, until: None }, "follow test").await {
            Ok(reservation) => return reservation,
            Err(LabError::NoMatch { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("reserving 0-1: {error}"),
        }
    }
}

/// Another client's import of 0-1, without the token: what the server says.
async fn contender(addr: std::net::SocketAddr) -> Result<(), ClientError> {
    usbwire_client::import(addr, &BusId::new("0-1").unwrap(), &Security::Plain).await.map(drop)
}

fn refused_as_reserved(result: &Result<(), ClientError>) -> bool {
    matches!(result, Err(error @ ClientError::Refused { .. }) if error.to_string().contains("reserved in the lab registry"))
}

/// The END that says the device re-enumerated, after the last reply.
async fn reenumerated(host: &mut UrbHost<PeerStream>) -> WentAway {
    assert_eq!(host.next(Direction::In).await, Reply::End(EndReason::REENUMERATED));
    WentAway::Reenumerated
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reservation_holds_across_both_reenumerations_and_the_follower_imports_with_its_token() {
    let dir = scratch("follow-registry", "lab");
    let Some(etcd) = Etcd::start(&dir, "follow-registry") else { return };
    let addr = free_addr();
    let firmware = dir.join("fw.bin");
    let mut command = std::process::Command::new(BIN);
    command.args(["serve", "--no-advertise", "--listen", &addr.to_string(), "--control"]).arg(dir.join("c.sock"));
    command.args(["--virtual", &format!("dfu={}", firmware.display()), "--registry", etcd.url()]);
    let served = start(command, "usbwire serving on").ready();

    let reservation = reserve(etcd.url()).await;
    assert_eq!(reservation.device.record.busid, "0-1");
    let deadline = Instant::now() + SETTLE;
    while !refused_as_reserved(&contender(addr).await) {
        assert!(Instant::now() < deadline, "the server never learned of the reservation");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Another client tries the bus id all along.
    let (stop, taken, tried) =
        (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let hammer = tokio::spawn({
        let (stop, taken, tried) = (stop.clone(), taken.clone(), tried.clone());
        async move {
            while !stop.load(Ordering::Relaxed) {
                let result = contender(addr).await;
                tried.fetch_add(1, Ordering::Relaxed);
                if result.is_ok() {
                    taken.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });

    let busid = BusId::new("0-1").unwrap();
    let reimport = Reimport {
        addr,
        security: Security::Plain,
        transforms: vec![],
        busid: busid.clone(),
        resumable: true,
        reservation: Some(reservation.token),
        persistence: usbwire_client::follow::Persistence::Bounded,
        accelerate: true,
    };
    let runtime =
        usbwire_client::import_reserved(addr, &busid, &Security::Plain, &[], &reservation.token).await.unwrap();
    let mut host = UrbHost::new(runtime.stream, runtime.device.devid());
    host.detach().await;
    let went = reenumerated(&mut host).await;
    // Between the re-enumeration and the follower's import: the bus id is the bootloader's, and still reserved.
    let between = contender(addr).await;
    assert!(refused_as_reserved(&between), "another client got the device in between: {between:?}");
    let bootloader = reimport.after(&went).await.expect("the follower imports the bootloader with its token");
    assert_eq!(bootloader.device.id_product, DFU_PRODUCT_ID);

    let image: Vec<u8> = (0..4 * usize::from(TRANSFER_SIZE) + 3).map(|i| (i * 31 + i / 97) as u8).collect();
    let mut host = UrbHost::new(bootloader.stream, bootloader.device.devid());
    host.download(&image).await;
    let went = reenumerated(&mut host).await;
    let between = contender(addr).await;
    assert!(refused_as_reserved(&between), "another client got the device in between: {between:?}");
    let runtime = reimport.after(&went).await.expect("the follower imports the new firmware with its token");
    assert_eq!(runtime.device.id_product, RUNTIME_PRODUCT_ID);

    stop.store(true, Ordering::Relaxed);
    hammer.await.unwrap();
    let (taken, tried) = (taken.load(Ordering::Relaxed), tried.load(Ordering::Relaxed));
    eprintln!("another client tried 0-1 {tried} times during the flash, got it {taken} times");
    assert_eq!(taken, 0, "the reservation held throughout");
    assert!(tried >= 10, "the other client kept trying: {tried} attempts");
    assert_eq!(std::fs::read(&firmware).unwrap(), image, "FILE holds the image");
    drop(runtime);
    reservation.release().await.unwrap();
    drop(served);
}
