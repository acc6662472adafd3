//! The record layer end to end over loopback TCP: our two sides, and ours against a
//! stock rustls peer (tokio-rustls), through key updates (asked for, or at the record
//! limit), closes and a failed write.

use std::future::Future;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::TlsStream;
use crate::access::{AccessRules, Admission, Rule};
use crate::tls::{client_config, server_config, server_name, ServerTrust};
use crate::{handshake, Identity};

struct Pair {
    client_config: Arc<rustls::ClientConfig>,
    server_config: Arc<rustls::ServerConfig>,
    listener: TcpListener,
}

async fn pair() -> Pair {
    let (server, client) = (Identity::generate("server").unwrap(), Identity::generate("client").unwrap());
    let rules =
        AccessRules { rules: vec![Rule { client: client.fingerprint().to_string(), devices: vec!["*".into()] }] };
    let server_config = server_config(&server, Admission { rules, ca: None }).unwrap();
    let (client_config, _) = client_config(&client, ServerTrust::Pinned(server.fingerprint())).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    Pair { client_config, server_config, listener }
}

/// A client and a server, made by `connect` and `accept` from the two ends of one TCP
/// connection.
async fn joined<C: Future, S: Future>(
    pair: &Pair,
    connect: impl FnOnce(TcpStream) -> C,
    accept: impl FnOnce(TcpStream) -> S,
) -> (C::Output, S::Output) {
    let addr = pair.listener.local_addr().unwrap();
    let client = async { connect(TcpStream::connect(addr).await.unwrap()).await };
    let server = async { accept(pair.listener.accept().await.unwrap().0).await };
    tokio::join!(client, server)
}

/// Both sides ours, connected.
async fn connected(pair: &Pair) -> (TlsStream, TlsStream) {
    let connect = |tcp| handshake::connect(tcp, pair.client_config.clone(), server_name());
    let accept = |tcp| handshake::accept(tcp, pair.server_config.clone());
    let (client, accepted) = joined(pair, connect, accept).await;
    let (client, (server, leaf)) = (client.unwrap(), accepted.unwrap());
    assert!(leaf.is_some(), "the server sees the client's certificate");
    (client, server)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// `len` bytes of `pattern(len, seed)` written by `from`, flushed, and read whole by `to`.
async fn transfer(from: &mut (impl AsyncWriteExt + Unpin), to: &mut (impl AsyncReadExt + Unpin), len: usize, seed: u8) {
    from.write_all(&pattern(len, seed)).await.unwrap();
    from.flush().await.unwrap();
    let mut got = vec![0; len];
    to.read_exact(&mut got).await.unwrap();
    assert!(got == pattern(len, seed), "{len} bytes arrived whole");
}

#[tokio::test]
async fn bytes_written_in_many_slices_arrive_whole_both_ways() {
    let pair = pair().await;
    let (mut client, mut server) = connected(&pair).await;
    let parts: Vec<Vec<u8>> = vec![pattern(48, 1), pattern(3 << 20, 2), vec![], pattern(16385, 3), pattern(7, 4)];
    let expected = parts.concat();
    let writer = async {
        crate::write_all_parts(&mut client, &parts).await.unwrap();
        client.flush().await.unwrap();
        client
    };
    let reader = async {
        let mut got = vec![0; expected.len()];
        server.read_exact(&mut got).await.unwrap();
        assert!(got == expected, "the server read what the client wrote");
        server.write_all(&got[..1 << 20]).await.unwrap();
        server.flush().await.unwrap();
        server
    };
    let (mut client, _server) = tokio::join!(writer, reader);
    let mut back = vec![0; 1 << 20];
    client.read_exact(&mut back).await.unwrap();
    assert!(back == expected[..1 << 20]);
}

/// Replies of 64 KiB URBs (a 48-byte header, then the data) go to the socket one at a
/// time, so the peer opens the first while the next is sealed: a write that is offered
/// four takes the first whole and no more.
#[tokio::test]
async fn sealed_bytes_go_to_the_socket_about_64_kib_at_a_time() {
    let pair = pair().await;
    let (mut client, mut server) = connected(&pair).await;
    let parts: Vec<Vec<u8>> = (0..8u8).map(|i| pattern(if i % 2 == 0 { 48 } else { 64 << 10 }, i)).collect();
    let slices: Vec<std::io::IoSlice<'_>> = parts.iter().map(|p| std::io::IoSlice::new(p)).collect();
    let taken = client.write_vectored(&slices).await.unwrap();
    assert_eq!(taken, 48 + (64 << 10), "one reply's worth per write");
    let expected = parts.concat();
    client.write_all(&expected[taken..]).await.unwrap();
    client.flush().await.unwrap();
    let mut got = vec![0; expected.len()];
    server.read_exact(&mut got).await.unwrap();
    assert!(got == expected, "everything arrives, in order");
}

#[tokio::test]
async fn a_key_update_either_way_keeps_the_stream_going() {
    let pair = pair().await;
    let (mut client, mut server) = connected(&pair).await;
    for round in 0..3u8 {
        client.tx.update_key();
        // A short slice (gathered, sealed in place), then a long one (sealed from where it lies).
        let parts = [pattern(100, round), pattern(40_000, round)];
        crate::write_all_parts(&mut client, &parts).await.unwrap();
        client.flush().await.unwrap();
        assert_eq!(client.tx.sequence(), 4, "four records under a key that starts at 0");
        let mut got = vec![0; 40_100];
        server.read_exact(&mut got).await.unwrap();
        assert!(got == parts.concat());
        server.tx.update_key();
        server.write_all(b"reply").await.unwrap();
        server.flush().await.unwrap();
        let mut reply = [0; 5];
        client.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"reply");
    }
}

#[tokio::test]
async fn close_notify_is_an_end_and_a_bare_hang_up_an_error() {
    let pair = pair().await;
    let (mut client, mut server) = connected(&pair).await;
    client.write_all(b"last words").await.unwrap();
    client.shutdown().await.unwrap();
    let mut got = Vec::new();
    server.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"last words");
    assert!(client.write_all(b"more").await.is_err(), "nothing may follow close_notify");

    let (mut client, mut server) = connected(&pair).await;
    // Read past the session tickets first: a socket closed with unread bytes resets.
    server.write_all(b"x").await.unwrap();
    server.flush().await.unwrap();
    client.read_exact(&mut [0]).await.unwrap();
    drop(client);
    let error = server.read_to_end(&mut Vec::new()).await.unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::UnexpectedEof);
}

/// Our server with a stock rustls client: data both ways, and the client's key update
/// with a request for ours, which rustls must then accept.
#[tokio::test]
async fn a_stock_rustls_peer_understands_our_records_and_key_updates() {
    let pair = pair().await;
    let connect = |tcp| tokio_rustls::TlsConnector::from(pair.client_config.clone()).connect(server_name(), tcp);
    let accept = |tcp| handshake::accept(tcp, pair.server_config.clone());
    let (client, server) = joined(&pair, connect, accept).await;
    let (mut client, mut server) = (client.unwrap(), server.unwrap().0);
    for round in 0..2u8 {
        client.get_mut().1.refresh_traffic_keys().unwrap();
        transfer(&mut client, &mut server, 100_000, round).await;
        transfer(&mut server, &mut client, 70_000, round).await;
    }
    server.shutdown().await.unwrap();
    assert_eq!(client.read(&mut [0; 8]).await.unwrap(), 0, "our close_notify is a clean end to rustls");
}

/// The rustls alert an error carries, if it is one.
fn received_alert(error: &std::io::Error) -> Option<rustls::AlertDescription> {
    match error.get_ref()?.downcast_ref::<rustls::Error>()? {
        rustls::Error::AlertReceived(alert) => Some(*alert),
        _ => None,
    }
}

/// RFC 8446 §5.2, §6.2: a record that fails authentication is answered with bad_record_mac
/// before the connection closes, and nothing more is written after it.
#[tokio::test]
async fn rfc8446_5_2_a_tampered_record_is_answered_with_bad_record_mac() {
    let pair = pair().await;
    let (mut client, mut server) = connected(&pair).await;
    // Past the server's session tickets, so the alert is the next record the client reads.
    server.write_all(b"x").await.unwrap();
    server.flush().await.unwrap();
    client.read_exact(&mut [0]).await.unwrap();
    client
        .tcp
        .write_all(&[23, 3, 3, 0, 20, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
        .await
        .unwrap();
    let error = server.read(&mut [0; 64]).await.unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::InvalidData);
    assert!(server.read(&mut [0; 64]).await.is_err(), "the failure stays");
    assert!(server.write_all(b"more").await.is_err(), "nothing is sent after a fatal alert");
    let error = client.read(&mut [0; 64]).await.unwrap_err();
    assert_eq!(received_alert(&error), Some(rustls::AlertDescription::BadRecordMac));
}

/// Our client with a stock rustls server: data both ways, the server's key update with a
/// request for ours, ours with theirs, tickets, and an alert rustls understands.
#[tokio::test]
async fn our_client_and_a_stock_rustls_server_understand_each_other() {
    let pair = pair().await;
    let connect = |tcp| handshake::connect(tcp, pair.client_config.clone(), server_name());
    let accept = |tcp| tokio_rustls::TlsAcceptor::from(pair.server_config.clone()).accept(tcp);
    let (client, server) = joined(&pair, connect, accept).await;
    let (mut client, mut server) = (client.unwrap(), server.unwrap());
    for round in 0..3u8 {
        server.get_mut().1.refresh_traffic_keys().unwrap();
        transfer(&mut server, &mut client, 90_000, round).await;
        if round == 1 {
            client.tx.update_key();
        }
        transfer(&mut client, &mut server, 120_000, round).await;
    }
    // A tampered record: rustls answers bad_record_mac, and we read it as such.
    client.tcp.write_all(&[23, 3, 3, 0, 17, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]).await.unwrap();
    assert!(server.read(&mut [0; 64]).await.is_err());
    let error = client.read(&mut [0; 64]).await.unwrap_err();
    assert_eq!(received_alert(&error), Some(rustls::AlertDescription::BadRecordMac));
}

/// RFC 8446 §5.5 and issue 35: with the record limit set low, our server updates its key
/// every few records, and a stock rustls client follows each update and reads every byte.
#[tokio::test]
async fn rfc8446_5_5_a_stock_rustls_peer_follows_our_key_updates_at_the_record_limit() {
    let pair = pair().await;
    let connect = |tcp| tokio_rustls::TlsConnector::from(pair.client_config.clone()).connect(server_name(), tcp);
    let accept = |tcp| handshake::accept(tcp, pair.server_config.clone());
    let (client, server) = joined(&pair, connect, accept).await;
    let (mut client, mut server) = (client.unwrap(), server.unwrap().0);
    server.tx.set_rekey_at(4);
    for round in 0..3u8 {
        // 13 records a round, a new key every 4.
        transfer(&mut server, &mut client, 200_000, round).await;
        transfer(&mut client, &mut server, 50_000, round).await;
    }
    assert!(server.tx.sequence() <= 4, "39 records sealed, never more than 4 under one key");
    server.shutdown().await.unwrap();
    assert_eq!(client.read(&mut [0; 8]).await.unwrap(), 0, "and the stream ends cleanly");
}

/// Issue 35: a write the socket refuses ends the connection: later writes, flushes and
/// the shutdown fail, and nothing sealed before goes out.
#[tokio::test]
async fn a_failed_socket_write_ends_the_connection() {
    let pair = pair().await;
    let (mut client, server) = connected(&pair).await;
    // The server closes with unread bytes, so its end resets the connection.
    client.write_all(b"unread").await.unwrap();
    client.flush().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    drop(server);
    let data = pattern(64 << 10, 1);
    let mut error = None;
    for _ in 0..1000 {
        if let Err(failed) = client.write_all(&data).await {
            error = Some(failed);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    assert!(error.is_some(), "the reset reaches the writer");
    assert!(client.tx.has_failed() && client.tx.pending().is_empty(), "nothing sealed is kept to send");
    let error = client.write_all(b"more").await.unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::BrokenPipe);
    assert!(client.flush().await.is_err());
    assert!(client.shutdown().await.is_err(), "no close_notify after a failed write");
}

/// A stock rustls client driven by hand over a blocking socket: it completes its side of
/// the handshake, asks for a key update before its Finished leaves, and sends both in one
/// write; then sends `len` bytes and reads as many back.
fn client_that_updates_keys_with_its_finished(
    config: Arc<rustls::ClientConfig>,
    addr: std::net::SocketAddr,
    len: usize,
) -> Result<Vec<u8>, std::io::Error> {
    use std::io::{Read, Write};
    let mut tcp = std::net::TcpStream::connect(addr)?;
    let mut conn = rustls::ClientConnection::new(config, server_name()).map_err(std::io::Error::other)?;
    while conn.is_handshaking() {
        while conn.wants_write() {
            conn.write_tls(&mut tcp)?;
        }
        conn.read_tls(&mut tcp)?;
        conn.process_new_packets().map_err(std::io::Error::other)?;
    }
    conn.refresh_traffic_keys().map_err(std::io::Error::other)?;
    conn.writer().write_all(&pattern(len, 9))?;
    let mut segment = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut segment)?;
    }
    tcp.write_all(&segment)?;
    let mut got = vec![0; len];
    let mut at = 0;
    while at < len {
        match conn.reader().read(&mut got[at..]) {
            Ok(n) => at += n,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                conn.read_tls(&mut tcp)?;
                conn.process_new_packets().map_err(std::io::Error::other)?;
                while conn.wants_write() {
                    conn.write_tls(&mut tcp)?;
                }
            }
            Err(error) => return Err(error),
        }
    }
    Ok(got)
}

/// The client's KeyUpdate(update_requested) arrives with its Finished: rustls's handshake
/// ends with our KeyUpdate to send, which the hand-over carries.
#[tokio::test]
async fn a_key_update_asked_for_with_the_clients_finished_is_followed() {
    let pair = pair().await;
    let (config, addr) = (pair.client_config.clone(), pair.listener.local_addr().unwrap());
    let client = tokio::task::spawn_blocking(move || client_that_updates_keys_with_its_finished(config, addr, 50_000));
    let tcp = pair.listener.accept().await.unwrap().0;
    let (mut server, _) = handshake::accept(tcp, pair.server_config.clone()).await.unwrap();
    let mut got = vec![0; 50_000];
    server.read_exact(&mut got).await.unwrap();
    assert!(got == pattern(50_000, 9), "the client's bytes, under its new key");
    server.write_all(&got).await.unwrap();
    server.flush().await.unwrap();
    let echoed = client.await.unwrap().expect("the server's reply decrypts: its KeyUpdate was not lost");
    assert!(echoed == pattern(50_000, 9));
}

/// A server configured to send session tickets (ours sends none) would hand our record
/// layer an AES-GCM key rustls already sealed under: refused with an error that says so.
#[tokio::test]
async fn a_server_that_sent_session_tickets_is_refused_at_the_hand_over() {
    let pair = pair().await;
    let mut server_config = (*pair.server_config).clone();
    assert_eq!(server_config.send_tls13_tickets, 0, "ours sends none");
    server_config.send_tls13_tickets = 2;
    let (config, addr) = (pair.client_config.clone(), pair.listener.local_addr().unwrap());
    let client = tokio::task::spawn_blocking(move || client_that_updates_keys_with_its_finished(config, addr, 10));
    let tcp = pair.listener.accept().await.unwrap().0;
    let Err(error) = handshake::accept(tcp, Arc::new(server_config)).await else {
        panic!("the hand-over took an AES-GCM key rustls had already sealed tickets under")
    };
    assert!(error.to_string().contains("session tickets"), "{error}");
    drop(client);
}

mod schedules;
