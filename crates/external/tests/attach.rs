//! `attach` against device processes over a real socket pair: the echo device
//! end to end, and hostile ones (silent, flooding, oversized, wrong revision)
//! that must give errors, never a hang or unbounded memory.

use std::future::poll_fn;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use usbwire_device::{Completion, Device, Direction, Status, TransferFlags, Urb};
use usbwire_external::codec::{decode, Message, MAX_FRAME_LEN};
use usbwire_external::process::{serve, Echo};
use usbwire_external::{attach, AttachError, EnumerationError, ExternalDevice, Gone, Options};

fn options() -> Options {
    Options { hello_timeout: Duration::from_secs(2), reply_timeout: Duration::from_secs(2) }
}

fn urb(seqnum: u32, endpoint: u8, direction: Direction, setup: [u8; 8], length: u32, data: &[u8]) -> Urb {
    Urb {
        seqnum,
        endpoint,
        direction,
        setup,
        flags: TransferFlags(0),
        length,
        data: Bytes::copy_from_slice(data),
        start_frame: 0,
        interval: 0,
        number_of_packets: 0,
        iso_packets: Vec::new(),
    }
}

async fn next(device: &mut ExternalDevice) -> Completion {
    tokio::time::timeout(Duration::from_secs(10), poll_fn(|cx| device.poll_complete(cx)))
        .await
        .expect("a completion, not a hang")
}

const SET_CONFIGURATION_1: [u8; 8] = [0x00, 0x09, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00];

async fn echo() -> (ExternalDevice, usbwire_external::Attached, tokio::task::JoinHandle<()>) {
    let (server_end, device_end) = UnixStream::pair().unwrap();
    let process = tokio::spawn(async move {
        let _ = serve(device_end, &mut Echo::new("E-1")).await;
    });
    let (device, attached) = attach(server_end, &options()).await.unwrap();
    (device, attached, process)
}

#[tokio::test]
async fn the_echo_device_is_described_and_echoes() {
    let (mut device, attached, process) = echo().await;
    let summary = device.summary();
    assert_eq!((summary.vendor_id, summary.product_id), (0x1209, 0x000e));
    assert_eq!((summary.product.as_str(), summary.serial.as_str()), ("usbwire echo", "E-1"));
    assert_eq!(summary.interfaces, [(0xff, 0, 0)]);
    device.submit(urb(1, 0, Direction::Out, SET_CONFIGURATION_1, 0, b""));
    assert_eq!(next(&mut device).await.status, Status::OK);
    device.submit(urb(2, 1, Direction::In, [0; 8], 512, b""));
    device.submit(urb(3, 2, Direction::Out, [0; 8], 5, b"hello"));
    let out = next(&mut device).await;
    assert_eq!((out.seqnum, out.status, out.actual_length), (3, Status::OK, 5));
    let back = next(&mut device).await;
    assert_eq!((back.seqnum, &back.data[..]), (2, &b"hello"[..]), "the IN request waited (NAK) for the data");
    drop(device);
    assert_eq!(attached.ended().await, Gone::Dropped);
    process.await.unwrap();
}

#[tokio::test]
async fn a_waiting_in_request_is_cancelled_and_the_process_exit_ends_the_device() {
    let (mut device, attached, process) = echo().await;
    device.submit(urb(1, 0, Direction::Out, SET_CONFIGURATION_1, 0, b""));
    next(&mut device).await;
    device.submit(urb(2, 1, Direction::In, [0; 8], 512, b""));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!device.is_gone(), "a NAKed IN request may wait past the reply timeout");
    device.cancel(2);
    assert_eq!(next(&mut device).await.status, Status::ECONNRESET);
    process.abort();
    assert_eq!(attached.ended().await, Gone::Closed);
    assert!(device.is_gone());
    device.submit(urb(3, 1, Direction::In, [0; 8], 512, b""));
    assert_eq!(next(&mut device).await.status, Status::ESHUTDOWN);
}

/// A device process that says hello, then runs `script` on the raw socket.
async fn hostile<F, Fut>(script: F) -> Result<(ExternalDevice, usbwire_external::Attached), AttachError>
where
    F: FnOnce(UnixStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let (server_end, mut device_end) = UnixStream::pair().unwrap();
    tokio::spawn(async move {
        let mut hello = BytesMut::new();
        Message::Hello { version: 1, speed: usbwire_device::Speed::HIGH, ep0_max_packet: 64 }.encode(&mut hello);
        device_end.write_all(&hello).await.unwrap();
        script(device_end).await;
    });
    attach(server_end, &options()).await
}

async fn read_message(stream: &mut UnixStream, input: &mut BytesMut) -> Option<Message> {
    loop {
        if let Some(message) = decode(input).unwrap() {
            return Some(message);
        }
        if stream.read_buf(input).await.ok()? == 0 {
            return None;
        }
    }
}

#[tokio::test]
async fn a_silent_device_process_fails_within_the_reply_timeout() {
    let started = std::time::Instant::now();
    let result = hostile(|stream| async move {
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(stream);
    })
    .await;
    let Err(AttachError::Enumeration(EnumerationError::Failed { status, .. })) = result else { panic!("{result:?}") };
    assert_eq!(status, Status::ETIMEDOUT.0);
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
}

#[tokio::test]
async fn no_hello_no_device() {
    let (server_end, _device_end) = UnixStream::pair().unwrap();
    let result = attach(server_end, &Options { hello_timeout: Duration::from_millis(200), ..options() }).await;
    assert!(matches!(result, Err(AttachError::NoHello(_))), "{result:?}");
}

#[tokio::test]
async fn another_revision_is_refused_with_the_reason() {
    let (server_end, mut device_end) = UnixStream::pair().unwrap();
    let mut hello = BytesMut::new();
    Message::Hello { version: 9, speed: usbwire_device::Speed::HIGH, ep0_max_packet: 64 }.encode(&mut hello);
    device_end.write_all(&hello).await.unwrap();
    let result = attach(server_end, &options()).await;
    assert!(matches!(result, Err(AttachError::Version(9))), "{result:?}");
    let Some(Message::Refuse { reason }) = read_message(&mut device_end, &mut BytesMut::new()).await else { panic!() };
    assert!(reason.contains("revision 9"), "{reason}");
}

#[tokio::test]
async fn an_oversized_frame_is_refused_before_it_is_read() {
    let result = hostile(|mut stream| async move {
        let mut input = BytesMut::new();
        while let Some(message) = read_message(&mut stream, &mut input).await {
            if let Message::Setup { .. } = message {
                // A DATA frame claiming more than the maximum; its body never comes.
                let _ = stream.write_all(&(MAX_FRAME_LEN + 1).to_le_bytes()).await;
                let _ = stream.write_all(&[0x11]).await;
            }
        }
    })
    .await;
    let Err(AttachError::Enumeration(EnumerationError::Failed { status, .. })) = result else { panic!("{result:?}") };
    assert_eq!(status, Status::ESHUTDOWN.0);
}

#[tokio::test]
async fn a_flood_of_answers_to_requests_never_made_drops_the_process() {
    let result = hostile(|mut stream| async move {
        let mut frames = BytesMut::new();
        for id in 1000..2000u32 {
            Message::Data { id, data: Bytes::from(vec![0u8; 4096]) }.encode(&mut frames);
        }
        let _ = stream.write_all(&frames).await;
        let mut input = BytesMut::new();
        let refusal = read_message(&mut stream, &mut input).await;
        assert!(matches!(refusal, Some(Message::Welcome { .. })));
        let refusal = read_message(&mut stream, &mut input).await;
        assert!(matches!(&refusal, Some(Message::Setup { .. }) | Some(Message::Refuse { .. })), "{refusal:?}");
    })
    .await;
    assert!(matches!(result, Err(AttachError::Enumeration(_))), "{result:?}");
}

#[tokio::test]
async fn a_huge_configuration_descriptor_is_read_whole_and_truncated_answers_do_not_overflow() {
    let result = hostile(|mut stream| async move {
        let mut input = BytesMut::new();
        let mut device = usbwire_device::descriptor::DeviceDescriptor::for_speed(usbwire_device::Speed::HIGH, 1, 2);
        device.manufacturer_index = 0;
        device.product_index = 0;
        device.serial_index = 0;
        while let Some(message) = read_message(&mut stream, &mut input).await {
            let Message::Setup { id, setup, .. } = message else { continue };
            let data = match setup[3] {
                1 => device.to_bytes(),
                2 => {
                    // 64 KiB of configuration: wTotalLength 0xffff, then padding descriptors.
                    let mut config = vec![9, 2, 0xff, 0xff, 1, 1, 0, 0x80, 50];
                    config.resize(1 << 20, 0);
                    config
                }
                _ => vec![],
            };
            let mut out = BytesMut::new();
            Message::Data { id, data: data.into() }.encode(&mut out);
            stream.write_all(&out).await.unwrap();
        }
    })
    .await;
    let (device, _attached) = result.unwrap();
    assert_eq!(device.descriptors().configurations.len(), 1);
    assert_eq!(device.summary().vendor_id, 1);
}
