//! The kernel relay across network cuts: a stand-in for vhci-hcd speaks raw
//! USB/IP on one end of a socket pair, the relay ([`usbwire_client::relay`])
//! carries it through a proxy that cuts every connection again and again to
//! a real server with a loopback device. Sequence-numbered payloads go out on
//! the loop pair and must all come back, in order, none lost or doubled, and
//! the "kernel" socket must never see the link go.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use usbwire_bench::proxy::{Cut, Proxy};
use usbwire_client::kernel_relay;
use usbwire_client::relay::{self, RelayError, Upstream};
use usbwire_client::{Security, TransformSpec};
use usbwire_proto::client_session::{ClientSession, Event, READ_CHUNK};
use usbwire_proto::op::BusId;
use usbwire_proto::urb::CmdSubmit;
use usbwire_proto::{Budget, Direction, Limits, RecvBuffer, Status};
use usbwire_testing::TestServer;

const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];
const PAYLOAD: usize = 1024;

fn round_payload(round: u32) -> Bytes {
    let mut data = vec![0u8; PAYLOAD];
    data[..4].copy_from_slice(&round.to_be_bytes());
    for (i, byte) in data[4..].iter_mut().enumerate() {
        *byte = (round as usize + i) as u8;
    }
    data.into()
}

/// Plays vhci-hcd: configures the device, then runs `rounds` OUT+IN pairs on
/// the loop endpoints with up to 16 rounds in flight, checking every reply.
/// `progress` counts the rounds whose IN came back.
async fn kernel(
    mut socket: UnixStream,
    devid: u32,
    rounds: u32,
    progress: Arc<AtomicU32>,
) -> Result<UnixStream, String> {
    let mut codec: ClientSession<(u32, bool)> = ClientSession::new(devid, Limits::default(), Budget::default());
    let mut input = RecvBuffer::with_capacity(READ_CHUNK);
    let mut seqnum = 1;
    codec
        .submit(CmdSubmit::new(seqnum, devid, Direction::Out, 0, 0, SET_CONFIGURATION_1, Bytes::new()), (0, false))
        .unwrap();
    seqnum += 1;
    let (mut sent, mut next_in) = (0u32, 0u32);
    let mut configured = false;
    loop {
        while configured && sent < rounds && sent - next_in < 16 {
            let out = CmdSubmit::new(seqnum, devid, Direction::Out, 3, PAYLOAD as u32, [0; 8], round_payload(sent));
            codec.submit(out, (sent, false)).unwrap();
            let inn = CmdSubmit::new(seqnum + 1, devid, Direction::In, 3, PAYLOAD as u32, [0; 8], Bytes::new());
            codec.submit(inn, (sent, true)).unwrap();
            seqnum += 2;
            sent += 1;
        }
        while !codec.outbox().is_empty() {
            let chunk: Vec<u8> = codec.outbox().slices(64).iter().flat_map(|s| s.to_vec()).collect();
            socket.write_all(&chunk).await.map_err(|e| format!("kernel write: {e}"))?;
            codec.outbox().advance(chunk.len());
        }
        if configured && next_in == rounds {
            return Ok(socket);
        }
        let n = socket.read_buf(&mut *input).await.map_err(|e| format!("kernel read: {e}"))?;
        if n == 0 {
            return Err("the relay closed the kernel's socket".into());
        }
        let mut events = Vec::new();
        codec.handle_input(&mut input, |event| events.push(event)).map_err(|e| e.to_string())?;
        for event in events {
            let Event::Completed { reply, tag: (round, is_in) } = event else { return Err("unexpected unlink".into()) };
            if reply.status != Status::OK {
                return Err(format!("round {round}: status {:?}", reply.status));
            }
            if round == 0 && !is_in && !configured {
                configured = true;
                continue;
            }
            if is_in {
                if round != next_in {
                    return Err(format!("IN of round {round} came before round {next_in}'s"));
                }
                if reply.data != round_payload(round) {
                    return Err(format!("round {round}: loop data differs"));
                }
                next_in += 1;
                progress.store(next_in, Ordering::Relaxed);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loop_data_survives_repeated_cuts_without_the_kernel_noticing() {
    cuts_through_the_relay(vec![]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loop_data_survives_repeated_cuts_with_compression_and_the_jitter_buffer() {
    cuts_through_the_relay(vec![TransformSpec::Zstd, TransformSpec::Jitter(Duration::from_millis(5))]).await;
}

async fn cuts_through_the_relay(transforms: Vec<TransformSpec>) {
    let test_server = TestServer::builder().resume_grace(Duration::from_secs(30)).loopback().start().await;
    let server = test_server.addr();
    let proxy = Proxy::start(server, Duration::ZERO, Duration::ZERO).await.unwrap();
    let busid = BusId::new("0-1").unwrap();
    let imported = usbwire_client::import_resumable(proxy.addr, &busid, &Security::Plain, &transforms).await.unwrap();
    assert!(imported.resume.is_some(), "a usbwire server grants resume");
    let (kernel_end, relay_end) = UnixStream::pair().unwrap();
    let devid = imported.device.devid();
    let upstream = Upstream {
        addr: proxy.addr,
        security: Security::Plain,
        transforms,
        resume: imported.resume,
        give_up_after: Duration::from_secs(20),
        storage: false,
        descriptors: None,
    };
    let (state, mut states) = tokio::sync::watch::channel(relay::RelayState::Connected);
    let relay = tokio::spawn(kernel_relay::run(relay_end, imported.stream, devid, upstream, Some(state), None));
    let resumes = tokio::spawn(async move {
        let mut resumes = 0;
        while states.changed().await.is_ok() {
            if matches!(*states.borrow_and_update(), relay::RelayState::Resuming { .. }) {
                resumes += 1;
            }
        }
        resumes
    });
    let rounds = 3000;
    let progress = Arc::new(AtomicU32::new(0));
    let kernel = tokio::spawn(kernel(kernel_end, devid, rounds, progress.clone()));
    // Cuts spread over the rounds by progress, not by time, so however fast the
    // relay runs, each cut lands mid-stream with the session resumed since the last.
    const CUTS: u32 = 15;
    let mut cuts = 0;
    while cuts < CUTS {
        let due = (cuts + 1) * rounds / (CUTS + 2);
        while progress.load(Ordering::Relaxed) < due && !kernel.is_finished() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // No cut once the rounds are done: the detach below must find the link up.
        if kernel.is_finished() {
            break;
        }
        proxy.cut_all();
        cuts += 1;
    }
    let socket = tokio::time::timeout(Duration::from_secs(60), kernel).await.expect("rounds finish").unwrap();
    let socket = socket.expect("every round came back in order through the cuts");
    assert!(cuts >= 10, "only {cuts} cuts happened before the rounds finished; make the run longer");
    // Detach: the kernel closes its socket and the relay ends cleanly.
    drop(socket);
    let ended = tokio::time::timeout(Duration::from_secs(5), relay).await.expect("relay ends on detach").unwrap();
    assert!(ended.is_ok(), "relay: {ended:?}");
    let resumes = resumes.await.unwrap();
    assert!(resumes >= 10, "the relay resumed {resumes} times for {cuts} cuts");
    // The relay said goodbye: the server releases the device now, not after its grace period.
    let mut last = None;
    for _ in 0..40 {
        let states = usbwire_client::device_states(server, &Security::Plain).await.unwrap().unwrap();
        let state = states.into_iter().find(|s| s.busid == "0-1").unwrap();
        if state.state == "available" {
            return;
        }
        last = Some(state);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("device not released within 2 s of the detach (grace period is 30 s): {last:?}");
}

/// Links that die without a word: the proxy stops forwarding with both
/// sockets left open, or resets only the server's side. Neither end is told;
/// keep-alive notices the silence within seconds (the server's grace period
/// is 30 s), the relay resumes, and every round comes back in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_gone_silent_is_noticed_and_resumed_well_within_the_grace_period() {
    let test_server = TestServer::builder().resume_grace(Duration::from_secs(30)).loopback().start().await;
    let server = test_server.addr();
    let proxy = Proxy::start(server, Duration::ZERO, Duration::ZERO).await.unwrap();
    let busid = BusId::new("0-1").unwrap();
    let imported = usbwire_client::import_resumable(proxy.addr, &busid, &Security::Plain, &[]).await.unwrap();
    assert!(imported.resume.is_some_and(|grant| grant.keepalive), "a usbwire server pings");
    let (kernel_end, relay_end) = UnixStream::pair().unwrap();
    let devid = imported.device.devid();
    let upstream = Upstream {
        addr: proxy.addr,
        security: Security::Plain,
        transforms: vec![],
        resume: imported.resume,
        give_up_after: Duration::from_secs(20),
        storage: false,
        descriptors: None,
    };
    let (state, mut states) = tokio::sync::watch::channel(relay::RelayState::Connected);
    let relay = tokio::spawn(kernel_relay::run(relay_end, imported.stream, devid, upstream, Some(state), None));
    let rounds = 100_000;
    let progress = Arc::new(AtomicU32::new(0));
    let kernel = tokio::spawn(kernel(kernel_end, devid, rounds, progress.clone()));
    let mut outages = vec![];
    for cut in [Cut::Silence, Cut::ResetServerSide, Cut::Silence, Cut::ResetServerSide] {
        // Mid-stream: rounds are flowing when the link dies.
        let before = progress.load(Ordering::Relaxed);
        while progress.load(Ordering::Relaxed) < before + 200 {
            assert!(!kernel.is_finished(), "the rounds ended early: {:?}", kernel.await);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let cut_at = std::time::Instant::now();
        proxy.cut_all_as(cut);
        let resumed = tokio::time::timeout(Duration::from_secs(25), async {
            loop {
                states.changed().await.expect("relay runs");
                if *states.borrow_and_update() == relay::RelayState::Connected {
                    return;
                }
            }
        })
        .await;
        assert!(resumed.is_ok(), "{cut:?}: not resumed within 25 s (the grace period is 30 s)");
        outages.push((cut, cut_at.elapsed()));
        let resumed_at = progress.load(Ordering::Relaxed);
        while progress.load(Ordering::Relaxed) < resumed_at + 100 {
            assert!(!kernel.is_finished(), "the rounds ended: {:?}", kernel.await);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    eprintln!("outages from cut to resumed: {outages:?}");
    // Far below the grace period: the busy bound is 2 s; a loaded machine may add some.
    for (cut, outage) in &outages {
        assert!(*outage < Duration::from_secs(10), "{cut:?}: resumed only after {outage:?}");
    }
    kernel.abort();
    let _ = relay.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_resume_a_cut_ends_the_relay_with_what_to_do() {
    let test_server = TestServer::builder().resume_grace(Duration::ZERO).loopback().start().await;
    let server = test_server.addr();
    let proxy = Proxy::start(server, Duration::ZERO, Duration::ZERO).await.unwrap();
    let busid = BusId::new("0-1").unwrap();
    let imported = usbwire_client::import_resumable(proxy.addr, &busid, &Security::Plain, &[]).await.unwrap();
    assert!(imported.resume.is_none(), "--resume-grace 0 grants no resume");
    let (kernel_end, relay_end) = UnixStream::pair().unwrap();
    let upstream = Upstream {
        addr: proxy.addr,
        security: Security::Plain,
        transforms: vec![],
        resume: None,
        give_up_after: Duration::from_secs(5),
        storage: false,
        descriptors: None,
    };
    let relay =
        tokio::spawn(kernel_relay::run(relay_end, imported.stream, imported.device.devid(), upstream, None, None));
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.cut_all();
    let ended = tokio::time::timeout(Duration::from_secs(5), relay).await.expect("relay ends").unwrap();
    assert!(matches!(ended, Err(RelayError::SessionLost { .. })), "{ended:?}");
    drop(kernel_end);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_shuts_down_ends_the_session_and_the_relay_at_once() {
    let mut test_server = TestServer::builder().resume_grace(Duration::from_secs(30)).loopback().start().await;
    let server = test_server.addr();
    let busid = BusId::new("0-1").unwrap();
    let imported = usbwire_client::import_resumable(server, &busid, &Security::Plain, &[]).await.unwrap();
    assert!(imported.resume.is_some());
    let (kernel_end, relay_end) = UnixStream::pair().unwrap();
    let upstream = Upstream {
        addr: server,
        security: Security::Plain,
        transforms: vec![],
        resume: imported.resume,
        // Without the server's end the relay would retry this long.
        give_up_after: Duration::from_secs(60),
        storage: false,
        descriptors: None,
    };
    let relay =
        tokio::spawn(kernel_relay::run(relay_end, imported.stream, imported.device.devid(), upstream, None, None));
    tokio::time::sleep(Duration::from_millis(100)).await;
    test_server.stop();
    let ended = tokio::time::timeout(Duration::from_secs(3), relay).await.expect("relay ends at once").unwrap();
    match ended {
        Err(RelayError::SessionLost { reason, .. }) => assert!(reason.contains("ended the session"), "{reason}"),
        other => panic!("{other:?}"),
    }
    drop(kernel_end);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_session_shows_as_resuming_then_is_released_after_the_grace_period() {
    let test_server = TestServer::builder().resume_grace(Duration::from_secs(2)).loopback().start().await;
    let server = test_server.addr();
    let busid = BusId::new("0-1").unwrap();
    let imported = usbwire_client::import_resumable(server, &busid, &Security::Plain, &[]).await.unwrap();
    assert!(imported.resume.is_some());
    drop(imported.stream);
    let state = |states: Vec<usbwire_device::devstate::DeviceStateEntry>| {
        let s = states.into_iter().find(|s| s.busid == "0-1").unwrap();
        (s.state, s.resuming_since.is_some())
    };
    let mut seen_resuming = false;
    for _ in 0..20 {
        let states = usbwire_client::device_states(server, &Security::Plain).await.unwrap().unwrap();
        if state(states) == ("in_use".into(), true) {
            seen_resuming = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(seen_resuming, "the server shows the device held for a resuming client");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let states = usbwire_client::device_states(server, &Security::Plain).await.unwrap().unwrap();
    assert_eq!(state(states), ("available".into(), false), "released after the grace period");
    // The session is gone: resuming it now is refused with what to do.
    let refused =
        usbwire_client::resume_session(server, &Security::Plain, &[], &imported.resume.unwrap().token, 0).await;
    assert!(matches!(refused, Err(usbwire_client::ClientError::ResumeRefused { .. })), "{:?}", refused.err());
}

/// A plain OP_REQ_IMPORT from `source`: the server's status.
async fn import_from(source: std::net::IpAddr, server: SocketAddr, busid: &BusId) -> usbwire_proto::op::OpStatus {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(source, 0)).unwrap();
    let mut stream = socket.connect(server).await.unwrap();
    let mut request = BytesMut::new();
    usbwire_proto::op::OpRequest::Import { busid: busid.clone() }.encode(&mut request);
    stream.write_all(&request).await.unwrap();
    let mut reply = BytesMut::new();
    loop {
        if let Some(answer) = usbwire_proto::op::decode_import_reply(&mut reply).unwrap() {
            return match answer {
                Ok(_) => usbwire_proto::op::OpStatus::OK,
                Err(status) => status,
            };
        }
        assert!(stream.read_buf(&mut reply).await.unwrap() > 0, "closed without answering");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_client_importing_afresh_takes_its_parked_device_back() {
    // A client whose relay died (killed, rebooted) attaches again: it must not
    // wait out the 30 s grace period its own old session is parked for.
    let test_server = TestServer::builder().resume_grace(Duration::from_secs(30)).loopback().start().await;
    let server = test_server.addr();
    let busid = BusId::new("0-1").unwrap();
    let imported = usbwire_client::import_resumable(server, &busid, &Security::Plain, &[]).await.unwrap();
    assert!(imported.resume.is_some());
    drop(imported.stream);
    // Parked: another host finds it busy at once.
    let mut parked = false;
    for _ in 0..40 {
        let states = usbwire_client::device_states(server, &Security::Plain).await.unwrap().unwrap();
        if states.iter().any(|s| s.busid == "0-1" && s.resuming_since.is_some()) {
            parked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(parked, "the session parks when its connection drops");
    let started = std::time::Instant::now();
    let elsewhere = import_from("127.0.0.2".parse().unwrap(), server, &busid).await;
    assert_eq!(elsewhere, usbwire_proto::op::OpStatus::DEV_BUSY, "another host");
    assert!(started.elapsed() < Duration::from_secs(2), "another host is refused at once: {:?}", started.elapsed());
    // The same client (host and identity) takes it back.
    let started = std::time::Instant::now();
    let again = usbwire_client::import_resumable(server, &busid, &Security::Plain, &[]).await;
    assert!(again.is_ok(), "{:?}", again.err());
    assert!(started.elapsed() < Duration::from_secs(3), "took {:?}", started.elapsed());
    // The old session is over: its token no longer resumes anything.
    let refused =
        usbwire_client::resume_session(server, &Security::Plain, &[], &imported.resume.unwrap().token, 0).await;
    assert!(matches!(refused, Err(usbwire_client::ClientError::ResumeRefused { .. })), "{:?}", refused.err());
}
