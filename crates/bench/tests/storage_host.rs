//! The Bulk-Only host (`usbwire_bench::storage::Host`) against a real
//! in-process server with a virtual disk, through the kernel relay as
//! `usbwire attach` runs it, with the storage accelerator off and on (and
//! with it, the descriptor snapshot answering the enumeration), and through
//! a userspace connection as the usbredir bridge runs one: enumeration, a megabyte written at a random block and read back,
//! READ CAPACITY against the image's size, a read past the end failing
//! with the sense data a kernel expects, and streams written and read back
//! through a proxy that cuts the link mid-pipeline again and again; a
//! connection closed with reads ahead still coming ends its session cleanly
//! through a proxy that passes resets on, as QEMU's user networking does.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, RngCore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use usbwire_bench::proxy::Proxy;
use usbwire_bench::storage::{opcode, Data, Host, HostError, UrbLink, Wire};
use usbwire_bench::target::{local_disk, LocalDisk};
use usbwire_client::relay::{RelayError, Upstream};
use usbwire_client::{kernel_relay, Connection, Security, StorageCounters, RESUME_GIVE_UP};
use usbwire_proto::op::BusId;

const DISK_BYTES: u64 = 8 << 20;

/// Imports the disk and starts the relay on a socket pair, the accelerator
/// as asked (and granted); the host holds the kernel's end.
async fn attach(disk: &LocalDisk, storage: bool) -> (Host<Wire<UnixStream>>, JoinHandle<Result<(), RelayError>>) {
    let (host, relay, _) = attach_counting(disk.addr, &disk.busid, storage).await;
    (host, relay)
}

/// [`attach`], with the accelerator's counters as the relay publishes them.
async fn attach_counting(
    addr: SocketAddr,
    busid: &BusId,
    storage: bool,
) -> (Host<Wire<UnixStream>>, JoinHandle<Result<(), RelayError>>, watch::Receiver<StorageCounters>) {
    let imported = usbwire_client::import_resumable(addr, busid, &Security::Plain, &[]).await.unwrap();
    assert!(imported.storage, "a usbwire server agrees to the storage extension");
    let devid = imported.device.devid();
    let upstream = Upstream {
        addr,
        security: Security::Plain,
        transforms: vec![],
        resume: imported.resume,
        give_up_after: RESUME_GIVE_UP,
        storage: storage && imported.storage,
        // As `usbwire attach` relays: the snapshot with the accelerator, neither without.
        descriptors: imported.descriptors.filter(|_| storage),
    };
    let (kernel, relay_end) = UnixStream::pair().unwrap();
    let (counters_tx, counters) = watch::channel(StorageCounters::default());
    let relay = tokio::spawn(kernel_relay::run(relay_end, imported.stream, devid, upstream, None, Some(counters_tx)));
    (Host::new(kernel, devid), relay, counters)
}

/// Closing the kernel's end detaches: the relay ends with `Ok`.
async fn detach(host: Host<Wire<UnixStream>>, relay: JoinHandle<Result<(), RelayError>>) {
    drop(host.into_inner());
    relay.await.unwrap().unwrap();
}

async fn a_megabyte_written_at_a_random_block_reads_back_the_same(storage: bool) {
    let disk = local_disk(DISK_BYTES).unwrap();
    let (mut host, relay, counters) = attach_counting(disk.addr, &disk.busid, storage).await;
    write_and_read_back_a_megabyte(&mut host, storage).await;
    detach(host, relay).await;
    // The relay's last word on what the accelerator did.
    let done = *counters.borrow();
    match storage {
        true => accelerated(&done),
        false => assert_eq!(done, StorageCounters::default(), "nothing accelerated"),
    }
}

/// What the accelerator must have done for the megabyte's commands.
fn accelerated(done: &StorageCounters) {
    assert!(done.commands_pipelined >= 20, "every command went in one round trip: {done:?}");
    assert!(done.read_ahead_hits >= 5, "the sequential megabyte was read ahead: {done:?}");
}

/// Enumerates, checks the disk's size, writes a megabyte of random bytes at
/// a random block in usb-storage's largest commands and reads it back.
async fn write_and_read_back_a_megabyte<L: UrbLink>(host: &mut Host<L>, storage: bool) {
    let found = host.enumerate().await.unwrap().clone();
    assert_eq!((found.bulk_in, found.bulk_out, found.max_lun), (0x81, 0x02, 0));
    let inquiry = host.inquiry().await.unwrap();
    assert_eq!(inquiry.device_type, 0, "a direct-access block device");
    host.test_unit_ready().await.unwrap();
    let (last_lba, block_len) = host.read_capacity().await.unwrap();
    assert_eq!((u64::from(last_lba) + 1) * u64::from(block_len), DISK_BYTES);

    let mut rng = rand::thread_rng();
    let mut data = vec![0u8; 1 << 20];
    rng.fill_bytes(&mut data);
    let blocks = (data.len() / block_len as usize) as u32;
    let lba = rng.gen_range(0..=last_lba + 1 - blocks);
    // usb-storage's largest command is 120 KiB; a megabyte takes several.
    let per_command = 240usize * block_len as usize;
    for (i, chunk) in data.chunks(per_command).enumerate() {
        host.write10(lba + (i * 240) as u32, chunk).await.unwrap();
    }
    let mut back = Vec::with_capacity(data.len());
    for (i, chunk) in data.chunks(per_command).enumerate() {
        let blocks = (chunk.len() / block_len as usize) as u16;
        back.extend_from_slice(&host.read10(lba + (i * 240) as u32, blocks).await.unwrap());
    }
    assert!(back == data, "storage {storage}: the megabyte at LBA {lba} did not read back the same");
}

#[tokio::test]
async fn a_megabyte_written_at_a_random_block_reads_back_the_same_without_the_accelerator() {
    a_megabyte_written_at_a_random_block_reads_back_the_same(false).await;
}

#[tokio::test]
async fn a_megabyte_written_at_a_random_block_reads_back_the_same_with_the_accelerator() {
    a_megabyte_written_at_a_random_block_reads_back_the_same(true).await;
}

async fn a_read_past_the_end_fails_with_illegal_request_lba_out_of_range(storage: bool) {
    let disk = local_disk(DISK_BYTES).unwrap();
    let (mut host, relay) = attach(&disk, storage).await;
    read_past_the_end(&mut host, storage).await;
    detach(host, relay).await;
}

/// A READ past the last block fails as a local disk's does, and the disk still works after.
async fn read_past_the_end<L: UrbLink>(host: &mut Host<L>, storage: bool) {
    host.enumerate().await.unwrap();
    let (last_lba, _) = host.read_capacity().await.unwrap();
    let [l0, l1, l2, l3] = (last_lba + 1).to_be_bytes();
    let cdb = [opcode::READ_10, 0, l0, l1, l2, l3, 0, 0, 8, 0];
    let outcome = host.command(0, &cdb, Data::In(8 * 512)).await.unwrap();
    assert_eq!(outcome.csw.status, 1, "storage {storage}: {outcome:?}");
    let sense = host.request_sense().await.unwrap();
    assert_eq!((sense.key, sense.asc), (0x05, 0x21), "ILLEGAL REQUEST, LBA out of range");
    // The typed error of the helper says the same.
    let failed = host.read10(last_lba, 2).await;
    assert!(matches!(failed, Err(HostError::CommandFailed { opcode: opcode::READ_10, status: 1, .. })), "{failed:?}");
    // And the disk still works.
    assert_eq!(host.read10(last_lba, 1).await.unwrap().len(), 512);
}

#[tokio::test]
async fn a_read_past_the_end_fails_with_illegal_request_without_the_accelerator() {
    a_read_past_the_end_fails_with_illegal_request_lba_out_of_range(false).await;
}

#[tokio::test]
async fn a_read_past_the_end_fails_with_illegal_request_with_the_accelerator() {
    a_read_past_the_end_fails_with_illegal_request_lba_out_of_range(true).await;
}

/// A userspace connection to the disk, as the usbredir bridge makes for a VM
/// (`usbwire redir`): resumable, and so accelerated by a usbwire server.
async fn connect(addr: SocketAddr, busid: &BusId) -> Host<Connection> {
    let (connection, _) = Connection::import_resumable(addr, busid, &Security::Plain, &[]).await.unwrap();
    assert_eq!(
        connection.storage_counters(),
        Some(StorageCounters::default()),
        "a usbwire server agrees to the storage extension: the connection runs the accelerator"
    );
    Host::over(connection)
}

#[tokio::test]
async fn a_megabyte_through_a_userspace_connection_is_accelerated_and_reads_back_the_same() {
    let disk = local_disk(DISK_BYTES).unwrap();
    let mut host = connect(disk.addr, &disk.busid).await;
    write_and_read_back_a_megabyte(&mut host, true).await;
    let connection = host.into_link();
    accelerated(&connection.storage_counters().unwrap());
    connection.close().await;
}

#[tokio::test]
async fn a_read_past_the_end_through_a_userspace_connection_fails_as_a_local_disks() {
    let disk = local_disk(DISK_BYTES).unwrap();
    let mut host = connect(disk.addr, &disk.busid).await;
    read_past_the_end(&mut host, true).await;
    let connection = host.into_link();
    assert!(connection.storage_counters().unwrap().commands_pipelined > 0);
    connection.close().await;
}

/// Writes and reads back sequential streams while `proxy` cuts the link
/// every few milliseconds: every cut lands with commands, status reads and
/// reads ahead in flight, the session resumes, and every byte read is the
/// one written. Returns how many cuts there were.
async fn streams_through_cuts<L: UrbLink>(host: &mut Host<L>, proxy: &Proxy) -> u32 {
    host.enumerate().await.unwrap();
    host.read_capacity().await.unwrap();
    let mut cuts = 0;
    let cutting = async {
        #[allow(clippy::infinite_loop)]
        loop {
            tokio::time::sleep(Duration::from_millis(rand::thread_rng().gen_range(5..40))).await;
            proxy.cut_all();
            cuts += 1;
        }
    };
    let streams = async {
        for round in 0..4u8 {
            // 2 MiB at a block of its own per round, in usb-storage's largest commands.
            let lba = u32::from(round) * 4096 + 8;
            let mut data = vec![0u8; 2 << 20];
            rand::thread_rng().fill_bytes(&mut data);
            for (i, chunk) in data.chunks(240 * 512).enumerate() {
                host.write10(lba + (i * 240) as u32, chunk).await.unwrap();
            }
            let mut back = Vec::with_capacity(data.len());
            for (i, chunk) in data.chunks(240 * 512).enumerate() {
                back.extend_from_slice(&host.read10(lba + (i * 240) as u32, (chunk.len() / 512) as u16).await.unwrap());
            }
            assert!(back == data, "round {round}: the stream at LBA {lba} did not read back the same through the cuts");
        }
    };
    tokio::select! {
        () = streams => {}
        () = cutting => unreachable!("the cuts go on until the streams are done"),
    }
    cuts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_mid_pipeline_loses_nothing_through_the_kernel_relay() {
    let disk = local_disk(DISK_BYTES * 2).unwrap();
    let proxy = Proxy::start(disk.addr, Duration::ZERO, Duration::ZERO).await.unwrap();
    let (mut host, relay, counters) = attach_counting(proxy.addr, &disk.busid, true).await;
    let cuts = streams_through_cuts(&mut host, &proxy).await;
    assert!(cuts >= 5, "only {cuts} cuts: make the streams longer");
    detach(host, relay).await;
    accelerated(&counters.borrow());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_mid_pipeline_loses_nothing_through_a_userspace_connection() {
    let disk = local_disk(DISK_BYTES * 2).unwrap();
    let proxy = Proxy::start(disk.addr, Duration::ZERO, Duration::ZERO).await.unwrap();
    let mut host = connect(proxy.addr, &disk.busid).await;
    let cuts = streams_through_cuts(&mut host, &proxy).await;
    assert!(cuts >= 5, "only {cuts} cuts: make the streams longer");
    let connection = host.into_link();
    assert!(connection.is_resumable());
    accelerated(&connection.storage_counters().unwrap());
    connection.close().await;
}

/// A proxy that holds what the client sends for `delay` and, like QEMU's user
/// networking, passes a reset on: when the client's side resets, what it still
/// holds for the server is dropped and the server's side is reset. Counts the
/// client's resets.
async fn resetting_proxy(target: SocketAddr, delay: Duration) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let resets = Arc::new(AtomicUsize::new(0));
    let counted = resets.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let server = TcpStream::connect(target).await.unwrap();
            let resets = counted.clone();
            tokio::spawn(async move {
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let (held_tx, mut held) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
                let take = async {
                    let mut buf = vec![0; 64 * 1024];
                    loop {
                        let n = cr.read(&mut buf).await?;
                        if n == 0 {
                            drop(held_tx);
                            return Ok::<_, std::io::Error>(());
                        }
                        let _ = held_tx.send((Instant::now() + delay, buf[..n].to_vec()));
                    }
                };
                let pass_on = async {
                    while let Some((at, chunk)) = held.recv().await {
                        tokio::time::sleep_until(at.into()).await;
                        sw.write_all(&chunk).await?;
                    }
                    sw.shutdown().await
                };
                let down = async {
                    tokio::io::copy(&mut sr, &mut cw).await?;
                    cw.shutdown().await
                };
                if tokio::try_join!(take, pass_on, down).is_err() {
                    resets.fetch_add(1, Ordering::Relaxed);
                    if let Ok(server) = sr.reunite(sw) {
                        let _ = server.set_zero_linger();
                    }
                }
            });
        }
    });
    (addr, resets)
}

/// A userspace connection closed while reads ahead still stream in (a VM
/// letting a disk go mid-read through the usbredir bridge) ends its session:
/// the server releases the disk at once rather than hold it for a resume. The
/// client reads its link to the server's close instead of resetting it, so a
/// proxy that passes resets on cannot drop the end on its way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_with_reads_ahead_coming_the_session_ends_and_the_disk_is_free_again() {
    let disk = local_disk(DISK_BYTES).unwrap();
    let (proxy, resets) = resetting_proxy(disk.addr, Duration::from_millis(25)).await;
    let mut host = connect(proxy, &disk.busid).await;
    host.enumerate().await.unwrap();
    host.read_capacity().await.unwrap();
    for i in 0..24u32 {
        host.read10(i * 240, 240).await.unwrap();
    }
    let connection = host.into_link();
    let counters = connection.storage_counters().unwrap();
    assert!(counters.read_ahead_hits >= 10, "a sequential stream is read ahead: {counters:?}");
    connection.close().await;
    let deadline = Instant::now() + Duration::from_secs(3);
    let state = loop {
        let states = usbwire_client::device_states(disk.addr, &Security::Plain).await.unwrap().unwrap();
        let state = states.into_iter().find(|entry| entry.busid == disk.busid.to_string()).unwrap();
        if state.state == "available" || Instant::now() > deadline {
            break state;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(resets.load(Ordering::Relaxed), 0, "the client reset its link");
    assert_eq!(state.state, "available", "the server still holds the disk: {state:?}");
    assert_eq!(state.resuming_since, None);
}

#[tokio::test]
async fn a_command_before_enumeration_is_a_typed_error() {
    let (kernel, _other) = UnixStream::pair().unwrap();
    let mut host = Host::new(kernel, 1);
    assert!(matches!(host.test_unit_ready().await, Err(HostError::NotEnumerated)));
}
