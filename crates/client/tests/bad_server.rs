//! The client against servers that misbehave, over real loopback TCP: malformed,
//! oversized or cut-off replies and silence end in a clear error (within the OP
//! timeout at worst), never a hang or a panic, and a URB is never completed with
//! what a broken reply carried.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use usbwire_client::{ClientError, Connection, Security, Transfer, TransferError};
use usbwire_proto::op::{self, BusId, DeviceRecord};
use usbwire_proto::urb::RetSubmit;
use usbwire_proto::{DecodeError, Status};

mod support;
use support::record;

/// Longer than any answer takes on loopback, shorter than a hang.
const PATIENCE: Duration = Duration::from_secs(20);

/// A one-connection server that runs `script` on the accepted socket.
async fn server<F, Fut>(script: F) -> SocketAddr
where
    F: FnOnce(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        script(socket).await;
    });
    addr
}

async fn list(addr: SocketAddr) -> Result<Vec<DeviceRecord>, ClientError> {
    tokio::time::timeout(PATIENCE, usbwire_client::list_devices(addr, &Security::Plain))
        .await
        .expect("the client gave up by itself")
}

#[tokio::test]
async fn garbage_instead_of_a_device_list_is_a_protocol_error() {
    let addr = server(|mut socket| async move {
        let mut request = [0u8; 8];
        socket.read_exact(&mut request).await.unwrap();
        socket.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await.unwrap();
        let _ = socket.read(&mut request).await;
    })
    .await;
    let result = list(addr).await;
    assert!(matches!(result, Err(ClientError::Protocol(_))), "{result:?}");
}

#[tokio::test]
async fn a_device_count_beyond_the_limits_is_refused_before_allocating() {
    let addr = server(|mut socket| async move {
        let mut request = [0u8; 8];
        socket.read_exact(&mut request).await.unwrap();
        let mut reply = BytesMut::new();
        reply.put_u16(0x0111);
        reply.put_u16(0x0005); // OP_REP_DEVLIST
        reply.put_u32(0);
        reply.put_u32(u32::MAX);
        socket.write_all(&reply).await.unwrap();
        let _ = socket.read(&mut request).await;
    })
    .await;
    let result = list(addr).await;
    assert!(matches!(result, Err(ClientError::Protocol(DecodeError::TooManyDevices { .. }))), "{result:?}");
}

#[tokio::test]
async fn a_reply_cut_off_mid_message_is_a_clear_error() {
    let addr = server(|mut socket| async move {
        let mut request = [0u8; 8];
        socket.read_exact(&mut request).await.unwrap();
        let mut reply = BytesMut::new();
        op::encode_devlist_reply(&[record()], &mut reply);
        socket.write_all(&reply[..reply.len() / 2]).await.unwrap();
        // and hangs up
    })
    .await;
    let result = list(addr).await;
    assert!(matches!(result, Err(ClientError::ClosedWithoutAnswer { .. })), "{result:?}");
    assert!(result.unwrap_err().to_string().contains("closed the connection without answering"));
}

#[tokio::test]
async fn a_server_that_never_answers_times_out() {
    let addr = server(|mut socket| async move {
        // Reads the request, then says nothing and keeps the connection open.
        let mut sink = Vec::new();
        let _ = socket.read_to_end(&mut sink).await;
    })
    .await;
    let started = std::time::Instant::now();
    let result = list(addr).await;
    assert!(matches!(result, Err(ClientError::Timeout { .. })), "{result:?}");
    assert!(started.elapsed() < PATIENCE);
}

/// How a URB-phase server ends after its reply.
#[derive(Clone, Copy)]
enum Then {
    KeepOpen,
    HangUp,
}

/// A server that imports `1-1`, reads one CMD_SUBMIT and answers it with `reply`
/// (raw bytes, given the seqnum it read).
async fn urb_server(reply: fn(u32) -> Vec<u8>, then: Then) -> SocketAddr {
    server(move |mut socket| async move {
        let mut request = [0u8; 8 + 32];
        socket.read_exact(&mut request).await.unwrap();
        let mut out = BytesMut::new();
        op::encode_import_reply(Ok(&record()), &mut out);
        socket.write_all(&out).await.unwrap();
        let mut submit = [0u8; 48];
        socket.read_exact(&mut submit).await.unwrap();
        let seqnum = u32::from_be_bytes(submit[4..8].try_into().unwrap());
        socket.write_all(&reply(seqnum)).await.unwrap();
        match then {
            Then::KeepOpen => {
                let mut sink = Vec::new();
                let _ = socket.read_to_end(&mut sink).await;
            }
            Then::HangUp => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    })
    .await
}

/// Imports `1-1` from `addr` and reads 64 bytes from bulk IN 0x81.
async fn read_64(addr: SocketAddr) -> Result<RetSubmit, TransferError> {
    let (stream, device) =
        usbwire_client::import(addr, &BusId::new("1-1").unwrap(), &Security::Plain).await.expect("import");
    let connection = Connection::new(stream, &device);
    tokio::time::timeout(PATIENCE, connection.transfer(Transfer::bulk_in(0x81, 64)))
        .await
        .expect("the transfer ended by itself")
}

fn ret_submit(seqnum: u32, actual_length: u32, data: &[u8]) -> Vec<u8> {
    let ret = RetSubmit {
        seqnum,
        status: Status::OK,
        actual_length,
        start_frame: 0,
        number_of_packets: 0,
        error_count: 0,
        data: bytes::Bytes::copy_from_slice(data),
        iso_packets: Vec::new(),
    };
    let mut out = BytesMut::new();
    ret.encode(&mut out);
    out.to_vec()
}

#[tokio::test]
async fn more_data_than_was_asked_for_drops_the_connection_not_the_process() {
    // 128 bytes for a 64-byte read: the reply is refused, the URB is not completed with it.
    let addr = urb_server(|seqnum| ret_submit(seqnum, 128, &[0xee; 128]), Then::KeepOpen).await;
    assert_eq!(read_64(addr).await, Err(TransferError::Disconnected));
}

#[tokio::test]
async fn a_urb_reply_cut_off_mid_message_fails_the_urb() {
    // The header promises 64 bytes, 10 arrive, a pause, then the server hangs up:
    // the URB fails, nothing partial is delivered.
    let addr = urb_server(|seqnum| ret_submit(seqnum, 64, &[0xab; 64])[..48 + 10].to_vec(), Then::HangUp).await;
    assert_eq!(read_64(addr).await, Err(TransferError::Disconnected));
}

#[tokio::test]
async fn a_reply_for_a_urb_never_submitted_drops_the_connection() {
    let addr = urb_server(|seqnum| ret_submit(seqnum.wrapping_add(1000), 64, &[0x11; 64]), Then::KeepOpen).await;
    assert_eq!(read_64(addr).await, Err(TransferError::Disconnected));
}

/// A server that reads nothing until told, then reads every command and
/// answers only the last: the client's writes block on a full socket
/// meanwhile. The command submitted while they are blocked (its caller first
/// waiting for room: the outbox was over its budget) still goes out once the
/// socket drains, though no reply comes to wake the relay.
#[tokio::test]
async fn a_command_submitted_while_the_socket_is_full_goes_out_once_it_drains() {
    const LARGE: usize = 12 << 20;
    let (go, went) = tokio::sync::oneshot::channel::<()>();
    let addr = server(move |mut socket| async move {
        let mut request = [0u8; 8 + 32];
        socket.read_exact(&mut request).await.unwrap();
        let mut out = BytesMut::new();
        op::encode_import_reply(Ok(&record()), &mut out);
        socket.write_all(&out).await.unwrap();
        let _ = went.await;
        // An IN the device never completes, the large OUT, and the last IN.
        let mut header = [0u8; 48];
        socket.read_exact(&mut header).await.unwrap();
        socket.read_exact(&mut header).await.unwrap();
        let mut payload = vec![0u8; LARGE];
        socket.read_exact(&mut payload).await.unwrap();
        socket.read_exact(&mut header).await.unwrap();
        let seqnum = u32::from_be_bytes(header[4..8].try_into().unwrap());
        socket.write_all(&ret_submit(seqnum, 4, &[1, 2, 3, 4])).await.unwrap();
        let mut sink = Vec::new();
        let _ = socket.read_to_end(&mut sink).await;
    })
    .await;
    let (stream, device) =
        usbwire_client::import(addr, &BusId::new("1-1").unwrap(), &Security::Plain).await.expect("import");
    let connection = Connection::new(stream, &device);
    let (_, _never) = connection.submit(Transfer::bulk_in(0x81, 64)).await.unwrap();
    let large = Transfer::bulk_out(0x02, bytes::Bytes::from(vec![0xa5; LARGE]));
    let (_, _unanswered) = connection.submit(large).await.unwrap();
    let asked = std::time::Instant::now();
    let (_, last) = tokio::time::timeout(PATIENCE, connection.submit(Transfer::bulk_in(0x81, 4)))
        .await
        .expect("room once the relay took the outbox's bytes")
        .unwrap();
    // Told as soon as there was room, not found out later.
    assert!(asked.elapsed() < Duration::from_secs(5), "waited {:?} for room", asked.elapsed());
    // The relay was woken for it while its write was blocked.
    tokio::time::sleep(Duration::from_millis(100)).await;
    go.send(()).unwrap();
    let ret = tokio::time::timeout(PATIENCE, last).await.expect("the last command went out").unwrap();
    assert_eq!(&ret.data[..], [1, 2, 3, 4]);
}
