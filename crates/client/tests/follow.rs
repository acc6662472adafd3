//! Following a device through re-enumerations as `usbwire attach --follow`
//! does, without a kernel: the relay's kernel end is a socket pair the test
//! drives with raw URBs (as relay_reenumeration.rs does), the relay's end
//! says why the device went, and the bus id is imported again through
//! [`Reimport`], which `attach --follow` and the usbredir bridge share.
//!
//! * Through TLS: a DFU board flashed through two re-enumerations (into its
//!   bootloader, back into the new firmware), each import again TLS with the
//!   server's key pinned, at once after the server's END.
//! * From a stock usbipd (a scripted one: the connection just closes when
//!   the device is unplugged, no END): the bus id is tried again with a
//!   backoff capped at 1 s and imported when the device returns; when it does
//!   not, following ends after [`FALLBACK_WINDOW`] with an error naming it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::Digest as _;
use tokio::net::UnixStream;
use tokio::task::JoinHandle;
use usbwire_client::follow::{FollowError, Reimport, WentAway, FALLBACK_WINDOW};
use usbwire_client::kernel_relay;
use usbwire_client::relay::{RelayError, Upstream};
use usbwire_client::{ClientError, Imported, Security, TlsClient};
use usbwire_gadgets::dfu::{DfuDevice, DfuOptions, Firmware, DFU_PRODUCT_ID, RUNTIME_PRODUCT_ID, TRANSFER_SIZE};
use usbwire_proto::op::{BusId, OpStatus};
use usbwire_proto::Direction;
use usbwire_server::{PlainPolicy, Security as ServerSecurity};
use usbwire_testing::dfu::{Reply, UrbHost};
use usbwire_testing::process::scratch;
use usbwire_testing::{StockUsbipd, TestServer};
use usbwire_transport::access::{AccessRules, Admission, Rule};
use usbwire_transport::known_servers::KnownServers;
use usbwire_transport::Identity;

mod support;

/// The backoff's cap, and what an attempt and the scheduler may add to it on loopback.
const RETRY_AT_LEAST_EVERY: Duration = Duration::from_millis(1250);

/// Relays `imported` as `attach` does: the returned host is the kernel's end.
fn relayed(imported: Imported, reimport: &Reimport) -> (UrbHost<UnixStream>, JoinHandle<Result<(), RelayError>>) {
    let devid = imported.device.devid();
    let upstream = Upstream {
        addr: reimport.addr,
        security: reimport.security.clone(),
        transforms: reimport.transforms.clone(),
        resume: imported.resume,
        give_up_after: Duration::from_secs(10),
        storage: false,
        descriptors: None,
    };
    let (kernel, relay_end) = UnixStream::pair().unwrap();
    let relay = tokio::spawn(kernel_relay::run(relay_end, imported.stream, devid, upstream, None, None));
    (UrbHost::new(kernel, devid), relay)
}

/// Why the device went, from how its relay ended, as `follow` reads it.
async fn went_away(relay: JoinHandle<Result<(), RelayError>>) -> WentAway {
    match relay.await.unwrap() {
        Err(RelayError::Reenumerated { .. }) => WentAway::Reenumerated,
        Err(RelayError::SessionLost { reason, .. }) => WentAway::ConnectionEnded(reason),
        other => panic!("the relay ended otherwise: {other:?}"),
    }
}

/// A TLS server with the DFU device at 0-1 that only `client`'s key may use,
/// and that client's security, pinning the server's key.
async fn tls_dfu_server(dir: &std::path::Path) -> (TestServer, Security) {
    let (server, client) = (Identity::generate("server").unwrap(), Identity::generate("follower").unwrap());
    let rules =
        AccessRules { rules: vec![Rule { client: client.fingerprint().to_string(), devices: vec!["0-1".into()] }] };
    let security = ServerSecurity::tls(&server, PlainPolicy::Never, Admission { rules, ca: None }).unwrap();
    let device = DfuDevice::open(&dir.join("fw.bin"), &DfuOptions::default()).unwrap();
    let running = TestServer::builder().security(security).device("dfu", Box::new(device)).start().await;
    let known = KnownServers::in_dir(&dir.join("known"));
    let tls = TlsClient { identity: client, known, trust_new: false, pinned: Some(server.fingerprint()) };
    (running, Security::Tls(Arc::new(tls)))
}

#[tokio::test]
async fn a_follower_stays_with_a_board_through_both_reenumerations_of_a_flash_over_tls() {
    let dir = scratch("client-follow", "tls");
    let (server, security) = tls_dfu_server(&dir).await;
    let busid = BusId::new("0-1").unwrap();
    let reimport = Reimport {
        addr: server.addr(),
        security: security.clone(),
        transforms: vec![],
        busid: busid.clone(),
        resumable: true,
        reservation: None,
        persistence: usbwire_client::follow::Persistence::Bounded,
        accelerate: true,
    };
    let plain = usbwire_client::import_resumable(server.addr(), &busid, &Security::Plain, &[]).await;
    assert!(plain.is_err(), "the server takes TLS only");

    let runtime = usbwire_client::import_resumable(server.addr(), &busid, &security, &[]).await.unwrap();
    assert!(runtime.stream.is_tls() && runtime.resume.is_some());
    assert_eq!(runtime.device.id_product, RUNTIME_PRODUCT_ID);
    let devid = runtime.device.devid();
    let (mut kernel, relay) = relayed(runtime, &reimport);
    kernel.detach().await;
    let went = went_away(relay).await;
    assert_eq!(went, WentAway::Reenumerated, "the server said why");
    assert_eq!(kernel.next(Direction::In).await, Reply::Closed, "the kernel's port lets go");
    let noticed = Instant::now();
    let bootloader = reimport.after(&went).await.expect("the bootloader is imported");
    let into_bootloader = noticed.elapsed();
    assert!(bootloader.stream.is_tls() && bootloader.resume.is_some(), "imported again over TLS, resumable");
    assert_eq!((bootloader.device.id_product, bootloader.device.devid()), (DFU_PRODUCT_ID, devid));

    let image: Vec<u8> = (0..5 * usize::from(TRANSFER_SIZE) + 77).map(|i| (i * 13 + i / 509) as u8).collect();
    let (mut kernel, relay) = relayed(bootloader, &reimport);
    kernel.download(&image).await;
    let went = went_away(relay).await;
    assert_eq!(went, WentAway::Reenumerated, "manifestation ends in the new firmware");
    let noticed = Instant::now();
    let runtime = reimport.after(&went).await.expect("the new firmware is imported");
    let into_runtime = noticed.elapsed();
    assert!(runtime.stream.is_tls(), "imported again over TLS");
    assert_eq!((runtime.device.id_product, runtime.device.devid()), (RUNTIME_PRODUCT_ID, devid));
    eprintln!(
        "over TLS, imported again {} ms after the END into the bootloader, {} ms after the END into the new firmware",
        into_bootloader.as_millis(),
        into_runtime.as_millis()
    );
    assert!(
        into_bootloader.max(into_runtime) < Duration::from_secs(1),
        "the follower waited on the server, not on a timer"
    );

    assert_eq!(std::fs::read(dir.join("fw.bin")).unwrap(), image, "FILE holds the image");
    let states = usbwire_client::device_states(server.addr(), &security).await.unwrap().unwrap();
    let product = states.iter().find(|s| s.busid == "0-1").map(|s| s.product.clone());
    let firmware = Firmware::Image { len: image.len(), sha256: sha2::Sha256::digest(&image).into() };
    assert_eq!(product, Some(firmware.product()), "the new firmware runs the image");
}

/// A stock usbipd exporting the device, imported and relayed; then the device is unplugged.
async fn unplugged_from_stock_usbipd() -> (StockUsbipd, Reimport, WentAway) {
    let usbipd = StockUsbipd::start(support::record()).await;
    let busid = support::record().busid;
    let reimport = Reimport {
        addr: usbipd.addr(),
        security: Security::Plain,
        transforms: vec![],
        busid: busid.clone(),
        resumable: true,
        reservation: None,
        persistence: usbwire_client::follow::Persistence::Bounded,
        accelerate: true,
    };
    let imported = usbwire_client::import_resumable(usbipd.addr(), &busid, &Security::Plain, &[]).await.unwrap();
    assert!(imported.resume.is_none(), "a stock server grants no resume");
    let (_kernel, relay) = relayed(imported, &reimport);
    usbipd.unplug();
    let went = went_away(relay).await;
    assert!(matches!(went, WentAway::ConnectionEnded(_)), "no word from a stock server: {went:?}");
    assert_eq!(went.window(), FALLBACK_WINDOW);
    (usbipd, reimport, went)
}

/// The gaps between the import attempts after the first import.
fn gaps(imports: &[Instant]) -> Vec<Duration> {
    imports.windows(2).skip(1).map(|pair| pair[1] - pair[0]).collect()
}

#[tokio::test]
async fn from_a_stock_server_the_bus_id_is_imported_again_when_the_device_returns() {
    let (usbipd, reimport, went) = unplugged_from_stock_usbipd().await;
    let following = tokio::spawn(async move { reimport.after(&went).await });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let tried = usbipd.imports().len() - 1;
    usbipd.plug();
    let plugged = Instant::now();
    let imported = following.await.unwrap().expect("imported again once the device is back");
    let back = plugged.elapsed();
    assert_eq!(imported.device, support::record());
    let gaps = gaps(&usbipd.imports());
    eprintln!(
        "stock usbipd: {tried} attempts in 3 s while unplugged, gaps {:?} ms; imported {} ms after the device returned",
        gaps.iter().map(Duration::as_millis).collect::<Vec<_>>(),
        back.as_millis()
    );
    assert!((5..=12).contains(&tried), "at once, then backing off: {tried} attempts");
    assert!(gaps.first().is_some_and(|gap| *gap < Duration::from_millis(300)), "the first retries come fast: {gaps:?}");
    assert!(gaps.iter().all(|gap| *gap < RETRY_AT_LEAST_EVERY), "backoff capped at 1 s: {gaps:?}");
    assert!(back < RETRY_AT_LEAST_EVERY, "imported {back:?} after the device returned");
}

#[tokio::test]
async fn from_a_stock_server_following_ends_after_the_window_when_the_device_stays_away() {
    let (usbipd, reimport, went) = unplugged_from_stock_usbipd().await;
    let started = Instant::now();
    let ended = reimport.after(&went).await;
    let took = started.elapsed();
    let Err(error @ FollowError::NotBack { .. }) = ended else {
        panic!("followed nothing: {:?}", ended.map(|i| i.device))
    };
    let FollowError::NotBack { window, last, .. } = &error else { unreachable!() };
    assert_eq!(*window, FALLBACK_WINDOW);
    assert!(matches!(last, ClientError::Refused { status: OpStatus::NODEV, .. }), "{last:?}");
    let said = error.to_string();
    assert!(said.starts_with("1-1 did not come back within 30 s after the connection ended ("), "{said}");
    assert!(took >= FALLBACK_WINDOW && took < FALLBACK_WINDOW + RETRY_AT_LEAST_EVERY, "gave up after {took:?}");
    let gaps = gaps(&usbipd.imports());
    assert!(gaps.len() >= 30, "tried about every second: {} attempts", gaps.len());
    assert!(gaps.iter().all(|gap| *gap < RETRY_AT_LEAST_EVERY), "backoff capped at 1 s: {gaps:?}");
    eprintln!("stock usbipd: gave up after {} ms and {} attempts: {said}", took.as_millis(), gaps.len());
}
