//! The userspace client across network cuts: an application holding a
//! resumable [`Connection`] streams sequence-numbered payloads through the
//! loopback device's loop pair while a proxy cuts the link 100 times. Every
//! payload must come back, in order, none lost or doubled, and no transfer
//! may fail: the application sees delays, never errors. Without resume on the
//! server, a cut fails what is pending with `Disconnected`, as before.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use usbwire_bench::proxy::Proxy;
use usbwire_client::relay::RelayState;
use usbwire_client::{is_ok, Connection, Security, Transfer, TransferError};
use usbwire_device::Speed;
use usbwire_proto::op::BusId;
use usbwire_server::{Server, ServerConfig};
use usbwire_testing::TestServer;

const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];
const LOOP_OUT: u8 = 0x03;
const LOOP_IN: u8 = 0x83;
const PAYLOAD: usize = 4096;
/// Rounds (an OUT and its IN) in flight at once.
const IN_FLIGHT: u32 = 8;

/// Round `n`'s payload: its number, then bytes that differ from every other round's.
fn payload(round: u32) -> Bytes {
    let mut data = vec![0u8; PAYLOAD];
    data[..4].copy_from_slice(&round.to_be_bytes());
    for (i, byte) in data[4..].iter_mut().enumerate() {
        *byte = (round as usize).wrapping_mul(31).wrapping_add(i) as u8;
    }
    data.into()
}

/// SplitMix64: the cut schedule, reproducible from the printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loop_stream_survives_100_random_cuts_without_a_transfer_error() {
    let test_server = TestServer::builder().resume_grace(Duration::from_secs(30)).loopback().start().await;
    let server = test_server.addr();
    let proxy = Proxy::start(server, Duration::ZERO, Duration::ZERO).await.unwrap();
    let busid = BusId::new("0-1").unwrap();
    let (connection, _) = Connection::import_resumable(proxy.addr, &busid, &Security::Plain, &[]).await.unwrap();
    assert!(connection.is_resumable(), "a usbwire server grants resume");
    connection.transfer_checked(Transfer::control_out(SET_CONFIGURATION_1, Bytes::new())).await.unwrap();

    let mut states = connection.relay_states().unwrap();
    let resumes = tokio::spawn(async move {
        let mut resumes = 0u32;
        while states.changed().await.is_ok() {
            if matches!(*states.borrow_and_update(), RelayState::Resuming { .. }) {
                resumes += 1;
            }
        }
        resumes
    });

    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    println!("cut schedule seed {seed}");
    let cutter = tokio::spawn(async move {
        let mut rng = Rng(seed);
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(10 + rng.next() % 91)).await;
            proxy.cut_all();
        }
        proxy
    });

    // seqnum -> (round, is IN)
    let mut submitted: HashMap<u32, (u32, bool)> = HashMap::new();
    let (mut sent, mut next_in, mut outs_done) = (0u32, 0u32, 0u32);
    let mut queue = connection.queue();
    let mut cuts_done = false;
    while !cuts_done || next_in < sent {
        cuts_done = cuts_done || cutter.is_finished();
        while !cuts_done && sent - next_in < IN_FLIGHT {
            let out = queue.submit(Transfer::bulk_out(LOOP_OUT, payload(sent))).unwrap();
            let inn = queue.submit(Transfer::bulk_in(LOOP_IN, PAYLOAD as u32)).unwrap();
            submitted.insert(out, (sent, false));
            submitted.insert(inn, (sent, true));
            sent += 1;
        }
        let completion = tokio::time::timeout(Duration::from_secs(30), queue.next_complete())
            .await
            .unwrap_or_else(|_| panic!("no completion for 30 s (round {next_in} of {sent})"));
        let Some(reply) = completion else { break };
        let reply = reply.unwrap_or_else(|error| panic!("round {next_in}: transfer failed: {error}"));
        let (round, is_in) = submitted
            .remove(&reply.seqnum)
            .unwrap_or_else(|| panic!("reply to seqnum {} twice or unasked", reply.seqnum));
        assert!(is_ok(&reply), "round {round} ({}): status {:?}", if is_in { "IN" } else { "OUT" }, reply.status);
        if is_in {
            assert_eq!(round, next_in, "IN of round {round} came before round {next_in}'s");
            assert!(reply.data == payload(round), "round {round}: loop data differs (lost or doubled payload)");
            next_in += 1;
        } else {
            outs_done += 1;
        }
    }
    let proxy = cutter.await.unwrap();
    assert!(submitted.is_empty(), "{} transfers never completed", submitted.len());
    assert_eq!((next_in, outs_done), (sent, sent));
    assert!(sent >= 200, "only {sent} rounds ran across the cuts");
    drop(queue);
    connection.close().await;
    let resumes = tokio::time::timeout(Duration::from_secs(5), resumes).await.expect("relay ends on close").unwrap();
    println!("{sent} rounds of {PAYLOAD} B across 100 cuts; the relay resumed {resumes} times");
    assert!(resumes >= 50, "the relay resumed only {resumes} times for 100 cuts");
    drop(proxy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_resume_a_cut_fails_pending_transfers_as_disconnected() {
    let test_server = TestServer::builder().resume_grace(Duration::ZERO).loopback().start().await;
    let server = test_server.addr();
    let proxy = Proxy::start(server, Duration::ZERO, Duration::ZERO).await.unwrap();
    let busid = BusId::new("0-1").unwrap();
    let (connection, _) = Connection::import_resumable(proxy.addr, &busid, &Security::Plain, &[]).await.unwrap();
    assert!(!connection.is_resumable(), "--resume-grace 0 grants no resume");
    assert!(connection.relay_states().is_none());
    connection.transfer_checked(Transfer::control_out(SET_CONFIGURATION_1, Bytes::new())).await.unwrap();
    // Nothing was looped: this IN waits until the cut.
    let (_, pending) = connection.submit(Transfer::bulk_in(LOOP_IN, PAYLOAD as u32)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.cut_all();
    let failed = tokio::time::timeout(Duration::from_secs(5), pending).await.expect("fails soon after the cut");
    assert!(matches!(failed, Err(TransferError::Disconnected)), "{failed:?}");
    assert!(connection.is_closed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_session_fails_pending_transfers_as_disconnected() {
    // The server restarts on the same port: the new one does not know the
    // session, refuses to resume it, and the relay gives up.
    let mut test_server = TestServer::builder().resume_grace(Duration::from_secs(30)).loopback().start().await;
    let server = test_server.addr();
    let proxy = Proxy::start(server, Duration::ZERO, Duration::ZERO).await.unwrap();
    let busid = BusId::new("0-1").unwrap();
    let (connection, _) = Connection::import_resumable(proxy.addr, &busid, &Security::Plain, &[]).await.unwrap();
    assert!(connection.is_resumable());
    connection.transfer_checked(Transfer::control_out(SET_CONFIGURATION_1, Bytes::new())).await.unwrap();
    let (_, pending) = connection.submit(Transfer::bulk_in(LOOP_IN, PAYLOAD as u32)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    test_server.stop();
    let mut restarted = None;
    let started = Instant::now();
    while restarted.is_none() && started.elapsed() < Duration::from_secs(5) {
        let config = ServerConfig { listen: server, control_path: None, ..ServerConfig::default() };
        let mut new_server = Server::new(config);
        new_server.export("loopback", Box::new(usbwire_gadgets::loopback(Speed::HIGH)));
        match new_server.bind().await {
            Ok(bound) => restarted = Some(tokio::spawn(bound.run(std::future::pending()))),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert!(restarted.is_some(), "the port is free again after the server stopped");
    proxy.cut_all();
    let failed = tokio::time::timeout(Duration::from_secs(10), pending).await.expect("fails once the session is lost");
    assert!(matches!(failed, Err(TransferError::Disconnected)), "{failed:?}");
    assert!(connection.is_closed());
    connection.close().await;
}
