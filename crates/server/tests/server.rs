//! The server over real loopback TCP: device list, exclusive import, URB
//! traffic, unlink semantics, and what happens after every kind of bad input.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use usbwire_client::{Connection, Security, Transfer};
use usbwire_device::Speed;
use usbwire_proto::op::{BusId, OpStatus};
use usbwire_proto::urb::{CmdSubmit, CmdUnlink};
use usbwire_proto::{Direction, Status};
use usbwire_testing::TestServer;
use usbwire_transport::PeerStream;

const GET_DEVICE_DESCRIPTOR: [u8; 8] = [0x80, 0x06, 0x00, 0x01, 0x00, 0x00, 0x12, 0x00];
const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];

/// Starts a server with a loopback device (0-1) and a keyboard (0-2) on an ephemeral port.
async fn start() -> SocketAddr {
    let (keyboard, _handle) = usbwire_gadgets::keyboard();
    TestServer::builder().loopback().device("keyboard", Box::new(keyboard)).start().await.keep_running()
}

fn busid(text: &str) -> BusId {
    BusId::new(text).unwrap()
}

async fn configured(addr: SocketAddr, id: &str) -> Connection {
    let (stream, record) = usbwire_client::import(addr, &busid(id), &Security::Plain).await.unwrap();
    let conn = Connection::new(stream, &record);
    let ret = conn.transfer(Transfer::control_out(SET_CONFIGURATION_1, Bytes::new())).await.unwrap();
    assert_eq!(ret.status, Status::OK);
    conn
}

/// Waits until `busid` is listed again (the server resets it after a disconnect).
async fn wait_listed(addr: SocketAddr, id: &str) {
    for _ in 0..100 {
        let devices = usbwire_client::list_devices(addr, &Security::Plain).await.unwrap();
        if devices.iter().any(|d| d.busid.as_str() == id) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{id} was not listed as available again");
}

async fn read_to_end_within(stream: &mut (impl tokio::io::AsyncRead + Unpin)) -> Vec<u8> {
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out))
        .await
        .expect("server closes the connection")
        .ok();
    out
}

/// Imports by raw bytes and returns the socket positioned at the URB phase.
async fn raw_import(addr: SocketAddr, id: &str) -> (PeerStream, u32) {
    let (stream, record) = usbwire_client::import(addr, &busid(id), &Security::Plain).await.unwrap();
    (stream, record.devid())
}

#[tokio::test]
async fn devlist_shows_devices_with_interfaces() {
    let addr = start().await;
    let devices = usbwire_client::list_devices(addr, &Security::Plain).await.unwrap();
    assert_eq!(devices.len(), 2);
    let loopback = &devices[0];
    assert_eq!(loopback.busid.as_str(), "0-1");
    assert_eq!((loopback.id_vendor, loopback.id_product), (0x1209, 0x0005));
    assert_eq!(loopback.speed, Speed::HIGH);
    assert_eq!(loopback.devid(), 0x0000_0001, "bus 0, device 1");
    assert_eq!(loopback.interfaces[0].b_interface_class, 0xff);
    let keyboard = &devices[1];
    assert_eq!(keyboard.busid.as_str(), "0-2");
    assert_eq!(
        (
            keyboard.interfaces[0].b_interface_class,
            keyboard.interfaces[0].b_interface_sub_class,
            keyboard.interfaces[0].b_interface_protocol
        ),
        (3, 1, 1)
    );
}

#[tokio::test]
async fn device_state_says_who_holds_what_since_when() {
    let addr = start().await;
    let states = usbwire_client::device_states(addr, &Security::Plain).await.unwrap().expect("a usbwire server");
    assert_eq!(states.len(), 2);
    assert!(states.iter().all(|s| s.state == "available" && s.client.is_none()), "{states:?}");
    let keyboard = states.iter().find(|s| s.busid == "0-2").unwrap();
    assert_eq!((keyboard.vendor_id.as_str(), keyboard.product_id.as_str()), ("1209", "0001"));
    assert!(!keyboard.serial.is_empty(), "virtual devices have serial numbers");

    let held = configured(addr, "0-1").await;
    let states = usbwire_client::device_states(addr, &Security::Plain).await.unwrap().unwrap();
    let loopback = states.iter().find(|s| s.busid == "0-1").unwrap();
    assert_eq!(loopback.state, "in_use");
    let client = loopback.client.as_deref().unwrap();
    assert!(client.starts_with("127.0.0.1:"), "{client}");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert!(now.abs_diff(loopback.since.unwrap()) <= 5);
    assert_eq!(loopback.identity, None, "a plain client has no identity");
    drop(held);
    wait_listed(addr, "0-1").await;
}

#[tokio::test]
async fn device_state_from_a_server_without_the_extension_is_none() {
    // A peer that hangs up on an unknown op code, as usbipd does.
    let addr = usbwire_testing::stock_peer().await;
    assert_eq!(usbwire_client::device_states(addr, &Security::Plain).await.unwrap(), None);
}

#[tokio::test]
async fn import_is_exclusive_and_released_on_disconnect() {
    let addr = start().await;
    let first = configured(addr, "0-1").await;
    // A second importer is refused; the device is not listed while in use.
    match usbwire_client::import(addr, &busid("0-1"), &Security::Plain).await {
        Err(usbwire_client::ClientError::Refused { status, .. }) => assert_eq!(status, OpStatus::DEV_BUSY),
        other => panic!("expected DEV_BUSY, got {:?}", other.map(|(_, r)| r)),
    }
    assert!(usbwire_client::list_devices(addr, &Security::Plain)
        .await
        .unwrap()
        .iter()
        .all(|d| d.busid.as_str() != "0-1"));
    // The first importer is unaffected.
    let ret = first.transfer(Transfer::control_in(GET_DEVICE_DESCRIPTOR)).await.unwrap();
    assert_eq!(ret.actual_length, 18);
    // Unknown bus ids get ST_NODEV.
    match usbwire_client::import(addr, &busid("9-9"), &Security::Plain).await {
        Err(usbwire_client::ClientError::Refused { status, .. }) => assert_eq!(status, OpStatus::NODEV),
        other => panic!("expected NODEV, got {:?}", other.map(|(_, r)| r)),
    }
    drop(first);
    wait_listed(addr, "0-1").await;
    // Importable again, and reset: unconfigured until the new client configures it.
    let (stream, record) = usbwire_client::import(addr, &busid("0-1"), &Security::Plain).await.unwrap();
    let conn = Connection::new(stream, &record);
    let config = conn.transfer(Transfer::control_in([0x80, 0x08, 0, 0, 0, 0, 1, 0])).await.unwrap();
    assert_eq!(&config.data[..], &[0]);
}

#[tokio::test]
async fn many_urbs_in_flight_and_no_head_of_line_blocking() {
    let addr = start().await;
    let conn = configured(addr, "0-1").await;
    // An IN on the loop endpoint pends (nothing queued yet)...
    let (_, pending_in) = conn.submit(Transfer::bulk_in(0x83, 4096)).await.unwrap();
    // ...while ep0 and the source endpoint keep working.
    let ret = conn.transfer(Transfer::control_in(GET_DEVICE_DESCRIPTOR)).await.unwrap();
    assert_eq!(ret.status, Status::OK);
    let mut replies = Vec::new();
    for _ in 0..32 {
        replies.push(conn.submit(Transfer::bulk_in(0x81, 16384)).await.unwrap().1);
    }
    for reply in replies {
        let ret = reply.await.unwrap();
        assert_eq!(ret.actual_length, 16384);
        assert!(ret.data.iter().enumerate().all(|(i, &b)| b == (i % 63) as u8));
    }
    // Feeding the loop pair completes the pending IN with the same bytes.
    let payload = Bytes::from((0..3000u32).map(|i| (i * 7) as u8).collect::<Vec<_>>());
    let out = conn.transfer(Transfer::bulk_out(0x03, payload.clone())).await.unwrap();
    assert_eq!(out.actual_length, 3000);
    let ret = tokio::time::timeout(Duration::from_secs(5), pending_in).await.unwrap().unwrap();
    assert_eq!(ret.data, payload);
}

#[tokio::test]
async fn transfer_queue_delivers_every_completion_once_in_order() {
    let addr = start().await;
    let conn = configured(addr, "0-1").await;
    let mut queue = conn.queue();
    assert!(queue.next_complete().await.is_none(), "nothing pending");
    // Small and large (uncopied) OUT payloads on the loop pair, then IN on the
    // source and the loop: everything goes out in one batch, in order.
    let small = Bytes::from(vec![1u8; 100]);
    let large = Bytes::from((0..40_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    let mut seqnums = vec![
        queue.submit(Transfer::bulk_out(0x03, small.clone())).unwrap(),
        queue.submit(Transfer::bulk_out(0x03, large.clone())).unwrap(),
    ];
    for _ in 0..20 {
        seqnums.push(queue.submit(Transfer::bulk_in(0x81, 512)).unwrap());
    }
    seqnums.push(queue.submit(Transfer::bulk_in(0x83, 100)).unwrap());
    seqnums.push(queue.submit(Transfer::bulk_in(0x83, 40_000)).unwrap());
    assert_eq!(queue.pending(), 24);
    let mut completed = Vec::new();
    while let Some(ret) = tokio::time::timeout(Duration::from_secs(5), queue.next_complete()).await.unwrap() {
        completed.push(ret.unwrap());
        completed.extend(std::iter::from_fn(|| queue.try_next_complete()));
    }
    assert_eq!(queue.pending(), 0);
    assert_eq!(completed.iter().map(|r| r.seqnum).collect::<Vec<_>>(), seqnums);
    assert!(completed.iter().all(|r| r.status == Status::OK));
    assert_eq!((completed[0].actual_length, completed[1].actual_length), (100, 40_000));
    assert!(completed[2..22].iter().all(|r| r.data.iter().enumerate().all(|(i, &b)| b == (i % 63) as u8)));
    assert_eq!((&completed[22].data, &completed[23].data), (&small, &large));
    // The future-per-URB API still works beside it.
    assert_eq!(conn.transfer(Transfer::bulk_in(0x81, 8)).await.unwrap().actual_length, 8);
}

#[tokio::test]
async fn transfer_queue_reports_a_lost_connection() {
    let mut server = usbwire_testing::TestServer::loopback().await;
    let addr = server.addr();
    let conn = configured(addr, "0-1").await;
    let mut queue = conn.queue();
    // Loop IN URBs pend until data arrives, which it never will.
    queue.submit(Transfer::bulk_in(0x83, 64)).unwrap();
    queue.submit(Transfer::bulk_in(0x83, 64)).unwrap();
    let waiting = tokio::spawn(async move {
        let first = queue.next_complete().await;
        (first, queue.next_complete().await, queue.submit(Transfer::bulk_in(0x81, 8)))
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    server.stop();
    let (first, after, submit) = tokio::time::timeout(Duration::from_secs(5), waiting).await.unwrap().unwrap();
    assert_eq!(first.map(|r| r.map(|ret| ret.seqnum)), Some(Err(usbwire_client::TransferError::Disconnected)));
    assert!(after.is_none(), "every pending URB was reported lost at once");
    assert_eq!(submit, Err(usbwire_client::TransferError::Disconnected));
}

#[tokio::test]
async fn unlink_of_pending_urb_answers_like_the_kernel_stub() {
    let addr = start().await;
    let (mut stream, devid) = raw_import(addr, "0-1").await;
    let mut wire = BytesMut::new();
    CmdSubmit::new(1, devid, Direction::Out, 0, 0, SET_CONFIGURATION_1, Bytes::new()).encode(&mut wire);
    CmdSubmit::new(2, devid, Direction::In, 3, 512, [0; 8], Bytes::new()).encode(&mut wire); // pends
    wire.extend_from_slice(&CmdUnlink { seqnum: 3, devid, unlink_seqnum: 2 }.header());
    wire.extend_from_slice(&CmdUnlink { seqnum: 4, devid, unlink_seqnum: 77 }.header()); // unknown
    stream.write_all(&wire).await.unwrap();
    let mut replies = vec![0u8; 48 * 3];
    tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut replies)).await.unwrap().unwrap();
    let words = |at: usize| -> Vec<u32> {
        (0..6).map(|i| u32::from_be_bytes(replies[at + i * 4..at + i * 4 + 4].try_into().unwrap())).collect()
    };
    // Replies come in completion order: (command, seqnum, status word).
    let mut seen: Vec<(u32, u32, i32)> =
        [0, 48, 96].iter().map(|&at| (words(at)[0], words(at)[1], words(at)[5] as i32)).collect();
    seen.sort();
    // RET_SUBMIT(1) for SET_CONFIGURATION; RET_UNLINK(3) = -ECONNRESET for the cancelled
    // target (and no RET_SUBMIT for it); RET_UNLINK(4) = 0 for the unknown target.
    assert_eq!(seen, vec![(3, 1, 0), (4, 3, -104), (4, 4, 0)]);
    // And no RET_SUBMIT for seqnum 2 follows.
    let mut extra = [0u8; 1];
    assert!(tokio::time::timeout(Duration::from_millis(300), stream.read(&mut extra)).await.is_err());
}

/// Each malformed input closes only its own connection; the device is reset
/// and importable again at once, and other clients keep working.
#[tokio::test]
async fn bad_input_closes_only_that_connection() {
    let addr = start().await;
    let bystander = configured(addr, "0-2").await;
    fn header(edit: fn(&mut [u8; 48], u32)) -> impl Fn(u32) -> Vec<u8> {
        move |devid| {
            let mut h = CmdSubmit::new(1, devid, Direction::In, 1, 64, [0; 8], Bytes::new()).header();
            edit(&mut h, devid);
            h.to_vec()
        }
    }
    type Case = (&'static str, Box<dyn Fn(u32) -> Vec<u8>>);
    let cases: Vec<Case> = vec![
        (
            "truncated header",
            Box::new(|devid| {
                CmdSubmit::new(1, devid, Direction::In, 1, 64, [0; 8], Bytes::new()).header()[..20].to_vec()
            }),
        ),
        ("unknown command", Box::new(header(|h, _| h[3] = 9))),
        ("bad direction", Box::new(header(|h, _| h[15] = 7))),
        ("endpoint 16", Box::new(header(|h, _| h[19] = 16))),
        ("oversized transfer", Box::new(header(|h, _| h[0x18..0x1c].copy_from_slice(&0x7fff_ffffu32.to_be_bytes())))),
        ("negative transfer", Box::new(header(|h, _| h[0x18..0x1c].copy_from_slice(&(-5i32).to_be_bytes())))),
        ("devid mismatch", Box::new(header(|h, devid| h[8..12].copy_from_slice(&(devid ^ 0x55).to_be_bytes())))),
        (
            "duplicate seqnum",
            Box::new(|devid| {
                let mut w = BytesMut::new();
                CmdSubmit::new(5, devid, Direction::In, 3, 64, [0; 8], Bytes::new()).encode(&mut w);
                CmdSubmit::new(5, devid, Direction::In, 3, 64, [0; 8], Bytes::new()).encode(&mut w);
                w.to_vec()
            }),
        ),
    ];
    for (name, bytes) in cases {
        let (mut stream, devid) = raw_import(addr, "0-1").await;
        stream.write_all(&bytes(devid)).await.unwrap();
        if name == "truncated header" {
            // The client vanishes mid-header.
            drop(stream);
        } else {
            let rest = read_to_end_within(&mut stream).await;
            assert!(rest.is_empty(), "{name}: no reply expected, got {} bytes", rest.len());
        }
        wait_listed(addr, "0-1").await;
        let ret = bystander.transfer(Transfer::control_in(GET_DEVICE_DESCRIPTOR)).await.unwrap();
        assert_eq!(ret.actual_length, 18, "{name}: bystander still served");
    }
    // The device works for the next importer.
    let conn = configured(addr, "0-1").await;
    assert_eq!(conn.transfer(Transfer::bulk_in(0x81, 100)).await.unwrap().actual_length, 100);
}

#[tokio::test]
async fn op_phase_rejects_garbage_and_urbs_to_missing_endpoints_stall() {
    let addr = start().await;
    for garbage in
        [&[0x01u8, 0x06, 0x80, 0x05, 0, 0, 0, 0][..], &[0x01, 0x11, 0x80, 0x02, 0, 0, 0, 0], b"GET / HTTP/1.1\r\n\r\n"]
    {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(garbage).await.unwrap();
        assert!(read_to_end_within(&mut stream).await.is_empty());
    }
    let conn = configured(addr, "0-1").await;
    let ret = conn.transfer(Transfer::bulk_in(0x86, 64)).await.unwrap();
    assert_eq!(ret.status, Status::EPIPE);
    assert_eq!(conn.transfer_checked(Transfer::bulk_in(0x86, 64)).await, Err(usbwire_client::TransferError::Stall));
    assert_eq!(conn.transfer(Transfer::bulk_in(0x81, 10)).await.unwrap().actual_length, 10);
}

/// A userspace client reads and writes sectors of a served disk through
/// Bulk-Only + SCSI over TCP, and the bytes match the image file.
#[tokio::test]
async fn disk_sectors_over_the_network_match_the_image() {
    let dir = usbwire_testing::process::scratch("server", "disk");
    let image = dir.join("disk.img");
    let options =
        usbwire_gadgets::DiskOptions { size: Some(1 << 20), read_only: false, speed: Speed::SUPER, bad_blocks: None };
    let disk = usbwire_gadgets::MassStorage::open(&image, &options).unwrap();
    let pattern: Vec<u8> = (0..8192u32).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
    std::fs::write(&image, [&pattern[..], &vec![0u8; (1 << 20) - 8192][..]].concat()).unwrap();

    let server = TestServer::builder().device("disk", Box::new(disk)).start().await;
    assert_eq!(server.busids()[0].as_str(), "0-1");
    let addr = server.keep_running();
    let conn = configured(addr, "0-1").await;

    let cbw = |tag: u32, len: u32, data_in: bool, cdb: &[u8]| {
        let mut raw = vec![0u8; 31];
        raw[0..4].copy_from_slice(&0x4342_5355u32.to_le_bytes());
        raw[4..8].copy_from_slice(&tag.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12] = if data_in { 0x80 } else { 0 };
        raw[14] = cdb.len() as u8;
        raw[15..15 + cdb.len()].copy_from_slice(cdb);
        Bytes::from(raw)
    };
    // READ(10) of 16 sectors.
    conn.transfer(Transfer::bulk_out(0x02, cbw(1, 8192, true, &[0x28, 0, 0, 0, 0, 0, 0, 0, 16, 0]))).await.unwrap();
    let data = conn.transfer(Transfer::bulk_in(0x81, 8192)).await.unwrap();
    let csw = conn.transfer(Transfer::bulk_in(0x81, 13)).await.unwrap();
    assert_eq!(&data.data[..], &pattern[..]);
    assert_eq!(csw.data[12], 0);
    // WRITE(10) of one sector at LBA 100, then it is in the file.
    let sector = Bytes::from(vec![0xa5u8; 512]);
    conn.transfer(Transfer::bulk_out(0x02, cbw(2, 512, false, &[0x2a, 0, 0, 0, 0, 100, 0, 0, 1, 0]))).await.unwrap();
    conn.transfer(Transfer::bulk_out(0x02, sector.clone())).await.unwrap();
    let csw = conn.transfer(Transfer::bulk_in(0x81, 13)).await.unwrap();
    assert_eq!(csw.data[12], 0);
    let file = std::fs::read(&image).unwrap();
    assert_eq!(&file[100 * 512..101 * 512], &sector[..]);
    let _ = std::fs::remove_file(&image);
}

/// Our client against our server for the serial and mouse classes (the disk,
/// loopback and keyboard have their own tests above).
#[tokio::test]
async fn serial_and_mouse_over_the_network() {
    use std::io::{Read, Write};
    let (serial, pty) = usbwire_gadgets::serial(None).unwrap();
    let (mouse, mouse_handle) = usbwire_gadgets::mouse();
    let server =
        TestServer::builder().device("serial", Box::new(serial)).device("mouse", Box::new(mouse)).start().await;
    let busids: Vec<&str> = server.busids().iter().map(|b| b.as_str()).collect();
    assert_eq!(busids, ["0-1", "0-2"]);
    let addr = server.keep_running();

    // CDC-ACM: SET_LINE_CODING, then bytes both ways between bulk endpoints and the pty.
    let conn = configured(addr, "0-1").await;
    let coding = Bytes::from_static(&[0x00, 0xc2, 0x01, 0x00, 0, 0, 8]); // 115200 8N1
    let ret = conn.transfer(Transfer::control_out([0x21, 0x20, 0, 0, 0, 0, 7, 0], coding.clone())).await.unwrap();
    assert_eq!(ret.status, Status::OK);
    let got = conn.transfer(Transfer::control_in([0xa1, 0x21, 0, 0, 0, 0, 7, 0])).await.unwrap();
    assert_eq!(got.data, coding);
    let mut slave = std::fs::OpenOptions::new().read(true).write(true).open(&pty).unwrap();
    conn.transfer(Transfer::bulk_out(0x02, Bytes::from_static(b"to-the-pty\n"))).await.unwrap();
    let mut buf = [0u8; 11];
    slave.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"to-the-pty\n");
    let (_, pending) = conn.submit(Transfer::bulk_in(0x81, 512)).await.unwrap();
    slave.write_all(b"from-the-pty").unwrap();
    let ret = tokio::time::timeout(Duration::from_secs(5), pending).await.unwrap().unwrap();
    assert_eq!(&ret.data[..], b"from-the-pty");

    // Mouse: a queued movement completes the pending interrupt IN.
    let mouse_conn = configured(addr, "0-2").await;
    let (_, report) = mouse_conn.submit(Transfer::bulk_in(0x81, 8)).await.unwrap();
    for _ in 0..100 {
        if mouse_handle.is_attached() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(mouse_handle.move_by(5, -3, 1, 0));
    let ret = tokio::time::timeout(Duration::from_secs(5), report).await.unwrap().unwrap();
    assert_eq!(&ret.data[..3], &[1, 5, (-3i8) as u8]);
}

/// Sends `OP_REQ_RESUME` with `token` from a socket bound to `source`; the server's answer.
async fn resume_from(source: std::net::Ipv4Addr, addr: SocketAddr, token: &usbwire_proto::resume::Token) -> bool {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((source, 0))).unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    let mut out = BytesMut::new();
    usbwire_proto::op::OpRequest::Resume { token: *token, replies_received: 0 }.encode(&mut out);
    stream.write_all(&out).await.unwrap();
    let mut header = [0u8; usbwire_proto::op::OP_HEADER_LEN];
    tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut header)).await.unwrap().unwrap();
    // A refusal is the header alone (ST_NODEV); a handover goes on with the count.
    !matches!(usbwire_proto::op::decode_resume_reply(&mut BytesMut::from(&header[..])), Ok(Some(Err(_))))
}

/// A plain client's resume token crosses the wire in clear: sniffed and sent
/// from another address, it is refused — while its owner is connected and
/// after it dropped — and the owner still resumes from its own address.
#[tokio::test]
async fn a_sniffed_plain_resume_token_from_another_address_is_refused() {
    let addr = start().await;
    let imported = usbwire_client::import_resumable(addr, &busid("0-1"), &Security::Plain, &[]).await.unwrap();
    let token = imported.resume.expect("resume granted to a plain client").token;
    let sniffer = std::net::Ipv4Addr::new(127, 0, 0, 2);
    assert!(!resume_from(sniffer, addr, &token).await, "taken over from 127.0.0.2 while the owner is connected");
    drop(imported.stream);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!resume_from(sniffer, addr, &token).await, "taken over from 127.0.0.2 after the owner dropped");
    let (_stream, commands_received) =
        usbwire_client::resume_session(addr, &Security::Plain, &[], &token, 0).await.expect("the owner resumes");
    assert_eq!(commands_received, 0);
}

/// An import written right behind a transform offer that offers no stream
/// transforms is served (the client saves a round trip); behind an offer of
/// stream transforms it cannot be, as it was not transformed: the server
/// answers the offer and closes.
#[tokio::test]
async fn an_import_behind_an_offer_without_stream_transforms_is_served_and_behind_one_with_them_is_not() {
    use usbwire_proto::op::{self, OpRequest};
    let addr = start().await;
    // A resumable import keeps its device held after the close: one device each.
    for (offer, id, served) in [("resume", "0-2", true), ("zstd", "0-1", false)] {
        let mut out = BytesMut::new();
        OpRequest::Transforms { offer: offer.into() }.encode(&mut out);
        OpRequest::Import { busid: busid(id) }.encode(&mut out);
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(&out).await.unwrap();
        let mut head = [0u8; op::OP_HEADER_LEN + 4];
        stream.read_exact(&mut head).await.unwrap();
        let mut answer = BytesMut::from(&head[..]);
        answer.resize(head.len() + u32::from_be_bytes([head[8], head[9], head[10], head[11]]) as usize, 0);
        stream.read_exact(&mut answer[head.len()..]).await.unwrap();
        let accepted = op::decode_transforms_reply(&mut answer).unwrap().unwrap();
        assert!(accepted.contains(offer), "{offer}: {accepted}");
        if served {
            let mut reply = vec![0u8; op::OP_HEADER_LEN + op::DEVICE_RECORD_LEN];
            stream.read_exact(&mut reply).await.unwrap();
            let mut reply = BytesMut::from(&reply[..]);
            let device = op::decode_import_reply(&mut reply).unwrap().unwrap().unwrap();
            assert_eq!(device.busid.as_str(), id);
        } else {
            assert!(read_to_end_within(&mut stream).await.is_empty(), "{offer}: closed after the answer");
            wait_listed(addr, id).await;
        }
    }
}
