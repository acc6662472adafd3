//! The client's memory budget against a hostile server, over real loopback TCP: a
//! server that accepts compression and answers with a compression bomb must not
//! make the client hold more than its decode budget, and one that imports a
//! device and then never reads must not make it buffer what the application
//! submits beyond its budget of bytes in flight.
//!
//! Its own test binary because it installs a global allocator that counts live
//! bytes; the tests take turns (`SERIAL`) so nothing else allocates concurrently.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use usbwire_client::{Connection, Security, Transfer};
use usbwire_proto::op::{self, BusId};
use usbwire_proto::Budget;
use usbwire_transport::transform::{Frame, Pipeline, Side, TransformSpec, MAX_FRAME_PAYLOAD};

mod support;
use support::record;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator, only counting sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= layout.size() {
            let live = LIVE.fetch_add(new_size - layout.size(), Ordering::Relaxed) + new_size - layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        } else {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Held by each test for its whole run: one measurement at a time (a tokio
/// mutex: no poisoning, so a failed test does not fail the other).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Frames of 1 MiB of zeros the hostile server sends: 500 MiB decompressed from
/// about 30 KB.
const BOMB_FRAMES: usize = 500;
/// What the client may hold above where it started: its 8 MiB decode budget, one
/// frame being decoded, read buffers and the zstd context, with room to spare.
const BOUND: usize = 32 << 20;

#[tokio::test]
async fn a_compression_bomb_from_the_server_is_decoded_only_within_the_budget() {
    let _turn = SERIAL.lock().await;
    // Built before measuring: the bomb itself is the server's memory, not the client's.
    let mut pipeline = Pipeline::new(&[TransformSpec::Zstd], Side::Server);
    let mut frame = Frame { flags: 0, sent_at_us: 0, payload: BytesMut::zeroed(MAX_FRAME_PAYLOAD) };
    pipeline.encode(&mut frame);
    let mut one = frame.header().to_vec();
    one.extend_from_slice(&frame.payload);
    let bomb = one.repeat(BOMB_FRAMES);
    drop(frame);

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        // OP_REQ_TRANSFORMS: header, length, offer.
        let mut head = [0u8; op::OP_HEADER_LEN + 4];
        socket.read_exact(&mut head).await.unwrap();
        let mut offer = vec![0u8; u32::from_be_bytes(head[8..12].try_into().unwrap()) as usize];
        socket.read_exact(&mut offer).await.unwrap();
        let mut reply = BytesMut::new();
        op::encode_transforms_reply("zstd", &mut reply);
        socket.write_all(&reply).await.unwrap();
        // The "import reply": frames of zeros, as fast as the client takes them.
        let _ = socket.write_all(&bomb).await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), socket.read_to_end(&mut sink)).await;
    });

    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let result = tokio::time::timeout(
        Duration::from_secs(20),
        usbwire_client::import_with(addr, &BusId::new("1-1").unwrap(), &Security::Plain, &[TransformSpec::Zstd]),
    )
    .await
    .expect("the client gave up by itself");
    let held = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    eprintln!("a {BOMB_FRAMES} MiB bomb: the client held at most {held} bytes");
    assert!(result.is_err(), "zeros are no import reply");
    assert!(held < BOUND, "the client held {held} bytes (bound {BOUND})");
    server.abort();
}

/// OUT transfers of this size the application submits, each its own allocation.
const OUT_URB: usize = 1 << 20;
/// How many it tries: 256 MiB, four times the budget of bytes in flight.
const OUT_URBS: usize = 256;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_reads_makes_submits_wait_instead_of_growing_the_client() {
    let _turn = SERIAL.lock().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut request = [0u8; op::OP_HEADER_LEN + 32];
        socket.read_exact(&mut request).await.unwrap();
        let mut reply = BytesMut::new();
        op::encode_import_reply(Ok(&record()), &mut reply);
        socket.write_all(&reply).await.unwrap();
        // Imported; from now on nothing is read and nothing answered.
        tokio::time::sleep(Duration::from_secs(60)).await;
        drop(socket);
    });
    let (stream, device) = usbwire_client::import(addr, &BusId::new("1-1").unwrap(), &Security::Plain).await.unwrap();
    let connection = Connection::new(stream, &device);

    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let mut replies = Vec::new();
    for round in 0..OUT_URBS {
        let data = Bytes::from(vec![round as u8; OUT_URB]);
        match tokio::time::timeout(Duration::from_secs(1), connection.submit(Transfer::bulk_out(0x02, data))).await {
            Ok(submitted) => replies.push(submitted.expect("the connection is open").1),
            Err(_) => break,
        }
    }
    let held = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    let accepted = replies.len();
    eprintln!("a server that never reads: {accepted} MiB accepted, the client held at most {held} bytes");
    let budget = Budget::default();
    assert!(accepted > 0, "nothing was accepted");
    assert!(
        accepted * OUT_URB <= budget.in_flight_bytes,
        "{accepted} MiB accepted past the budget of {} bytes in flight",
        budget.in_flight_bytes
    );
    // The accepted URBs themselves, the one waiting for room, and buffers.
    let bound = budget.in_flight_bytes + 16 * OUT_URB;
    assert!(held < bound, "the client held {held} bytes (bound {bound})");
    assert!(!connection.is_closed(), "a slow server is no reason to give up");
    server.abort();
}
