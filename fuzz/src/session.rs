//! The `server_session` harness: a whole server session, from the first OP request
//! through transform negotiation to the URB phase with unlinks, against virtual devices
//! (keyboard, mouse, two loopback devices, a small disk), as a hostile client would drive
//! it, with the server's memory checked after every input.
//!
//! Input: `[chunking, mode] ++ stream`. `stream` is what the client sends, written in
//! pieces (`chunking`, as in the decoder harnesses; a transform offer at the start goes
//! alone, as a client waits for its answer). `mode & 1`: the client also reads
//! the replies (otherwise it never does, as an attacker that wants the server to buffer
//! would); `mode & 2`: the client half-closes once it has written everything.
//!
//! The server runs with small budgets ([`budgets`]) on a current-thread runtime whose
//! clock is paused: timers fire as soon as everything else is idle, so the OP deadlines
//! and a device's periodic endpoints cost no wall time, and a session that waits
//! forever (a client that never reads, say) ends at [`SESSION_LIMIT`] of virtual time.
//!
//! Invariants, checked after every input:
//! - no panic;
//! - the bytes the server allocated and had not freed never exceed [`MEMORY_BOUND`]
//!   above what it held before the session (a counting allocator, [`CountingAllocator`],
//!   installed by the fuzz target and by `replay`);
//! - once the session is over, every device is available again (nothing leaked a lease).
//!
//! `USBWIRE_FUZZ_LOG=1` prints the server's log and each session's peak (to reproduce a
//! failure: `replay --target server_session FILE`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use usbwire_server::{DeviceState, InProcessServer, Server, ServerConfig};

/// How long (virtual time) one session may run.
pub const SESSION_LIMIT: Duration = Duration::from_secs(120);

/// Live bytes the server may hold for one session above its idle state: the budgets
/// ([`budgets`]) plus one message of each kind in the making plus the fixed cost of a
/// connection (read buffer, transform contexts). A compression bomb or an unbounded
/// reply queue goes far past it.
pub const MEMORY_BOUND: usize = 24 << 20;

/// Counts live heap bytes and remembers the peak since [`reset_peak`].
pub struct CountingAllocator;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// Set once an allocator that counts is installed (otherwise the bound is not checked).
static COUNTING: AtomicUsize = AtomicUsize::new(0);

impl CountingAllocator {
    fn grew(size: usize) {
        let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
        PEAK.fetch_max(live, Ordering::Relaxed);
        COUNTING.store(1, Ordering::Relaxed);
    }
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            Self::grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            Self::grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as ours.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            Self::grew(new_size);
        }
        new
    }
}

/// Live heap bytes now, when a counting allocator is installed (the fuzz
/// target's or `replay`'s); `None` otherwise.
pub(crate) fn live_bytes() -> Option<usize> {
    (COUNTING.load(Ordering::Relaxed) != 0).then(|| LIVE.load(Ordering::Relaxed))
}

/// Live bytes now, and starts a new peak from here.
fn reset_peak() -> usize {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

/// The budgets the harness's server runs with: small, so that a few KiB of input can
/// reach every one of them.
pub fn budgets(config: &mut ServerConfig) {
    config.limits.max_transfer_length = 256 * 1024;
    config.budget = usbwire_proto::Budget {
        queued_reply_bytes: 1 << 20,
        unacked_reply_bytes: 2 << 20,
        decoded_bytes: 2 << 20,
        in_flight_bytes: 2 << 20,
        in_flight_urbs: 64,
    };
    // A session that offered resume is held this long (virtual time) after its client goes.
    config.resume_grace = Duration::from_secs(5);
}

struct Harness {
    runtime: tokio::runtime::Runtime,
    server: InProcessServer,
    _disk: tempfile_dir::TempDir,
}

thread_local! {
    static HARNESS: RefCell<Option<Harness>> = const { RefCell::new(None) };
}

fn harness() -> Harness {
    if std::env::var_os("USBWIRE_FUZZ_LOG").is_some() {
        // Reproducing a failure: the server's own log, and the peak per session.
        let _ = tracing_subscriber::fmt().with_max_level(tracing::Level::DEBUG).try_init();
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    let disk = tempfile_dir::TempDir::new();
    let server = runtime.block_on(async {
        let mut config = ServerConfig { control_path: None, ..ServerConfig::default() };
        budgets(&mut config);
        let mut server = Server::new(config);
        let (keyboard, _typing) = usbwire_gadgets::keyboard();
        server.export("keyboard", Box::new(keyboard));
        let (mouse, _moving) = usbwire_gadgets::mouse();
        server.export("mouse", Box::new(mouse));
        server.export("loopback", Box::new(usbwire_gadgets::loopback(usbwire_device::Speed::HIGH)));
        server.export("loopback", Box::new(usbwire_gadgets::loopback(usbwire_device::Speed::SUPER)));
        let options = usbwire_gadgets::DiskOptions {
            size: Some(1 << 20),
            read_only: false,
            speed: usbwire_device::Speed::HIGH,
            bad_blocks: None,
        };
        let image = disk.path().join("disk.img");
        let device = usbwire_gadgets::MassStorage::open(&image, &options).expect("a 1 MiB disk image in a temp dir");
        server.export("disk", Box::new(device));
        server.in_process()
    });
    Harness { runtime, server, _disk: disk }
}

/// One session: see the module docs.
pub fn server_session(data: &[u8]) {
    let Some((&[chunking, mode], stream)) = crate::split_control::<2>(data) else { return };
    // A transform offer goes alone and first, as a real client sends it (one that sends
    // more before the answer is closed at once, which the fuzzer finds by itself).
    let mut buf = bytes::BytesMut::from(stream);
    let offer_len = match usbwire_proto::op::decode_request(&mut buf, &usbwire_proto::Limits::default()) {
        Ok(Some(usbwire_proto::op::OpRequest::Transforms { .. })) => stream.len() - buf.len(),
        _ => 0,
    };
    let (offer, rest) = stream.split_at(offer_len);
    let mut pieces = vec![offer];
    pieces.extend(crate::chunks(rest, chunking));
    pieces.retain(|piece| !piece.is_empty());
    HARNESS.with(|cell| {
        let mut cell = cell.borrow_mut();
        let harness = cell.get_or_insert_with(harness);
        let before = reset_peak();
        harness.runtime.block_on(async {
            let (client, server_end) = tokio::io::duplex(64 * 1024);
            let (mut replies, mut client) = tokio::io::split(client);
            let peer = SocketAddr::from(([192, 0, 2, 1], 40000));
            let serve = harness.server.serve(server_end, peer);
            let drive = async {
                let reads = mode & 1 != 0;
                let mut sink = vec![0u8; 16 * 1024];
                let mut pieces = pieces.iter();
                if offer_len > 0 {
                    // Like a real client: the offer, then its answer, then the rest.
                    let Some(offer) = pieces.next() else { return };
                    if client.write_all(offer).await.is_err() {
                        return;
                    }
                    let mut answer = bytes::BytesMut::new();
                    loop {
                        match usbwire_proto::op::decode_transforms_reply(&mut answer) {
                            Ok(Some(_)) => break,
                            Ok(None) => {}
                            Err(_) => return,
                        }
                        if !matches!(replies.read_buf(&mut answer).await, Ok(n) if n > 0) {
                            return;
                        }
                    }
                }
                for piece in pieces {
                    if reads {
                        // Write while draining replies, so a server that answers as it reads
                        // never blocks on a full pipe.
                        let mut piece = *piece;
                        while !piece.is_empty() {
                            tokio::select! {
                                written = client.write(piece) => match written {
                                    Ok(n) if n > 0 => piece = &piece[n..],
                                    _ => return,
                                },
                                read = replies.read(&mut sink) => if matches!(read, Ok(0) | Err(_)) { return },
                            }
                        }
                    } else if client.write_all(piece).await.is_err() {
                        return;
                    }
                    tokio::task::yield_now().await;
                }
                if mode & 2 != 0 {
                    let _ = client.shutdown().await;
                }
                if reads {
                    while matches!(replies.read(&mut sink).await, Ok(n) if n > 0) {}
                } else {
                    std::future::pending::<()>().await;
                }
            };
            // The session ends when the server closes it, or at the limit (dropping it
            // is what a vanished client does to a server).
            let _ = tokio::time::timeout(SESSION_LIMIT, async {
                tokio::join!(serve, drive);
            })
            .await;
        });
        if std::env::var_os("USBWIRE_FUZZ_LOG").is_some() {
            eprintln!("session held at most {} bytes", PEAK.load(Ordering::Relaxed).saturating_sub(before));
        }
        if COUNTING.load(Ordering::Relaxed) != 0 {
            let peak = PEAK.load(Ordering::Relaxed).saturating_sub(before);
            assert!(peak <= MEMORY_BOUND, "a session held {peak} bytes (bound {MEMORY_BOUND})");
        }
        for export in harness.server.registry().list() {
            assert_eq!(export.state, DeviceState::Available, "{} still held after its session", export.record.busid);
        }
    });
}

/// A directory removed when dropped (no dependency for one temp dir).
mod tempfile_dir {
    use std::path::{Path, PathBuf};

    pub(crate) struct TempDir(PathBuf);

    impl TempDir {
        pub(crate) fn new() -> Self {
            let path = std::env::temp_dir().join(format!("usbwire-fuzz-{}", std::process::id()));
            std::fs::create_dir_all(&path).expect("a temp dir for the fuzz disk image");
            Self(path)
        }

        pub(crate) fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
