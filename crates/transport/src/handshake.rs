//! The TLS 1.3 handshake on a TCP socket, run by rustls's unbuffered API, ending in a
//! [`TlsStream`] that holds the traffic keys.
//!
//! Owns the handshake's buffers and its socket I/O; the decisions (certificates, access
//! rules, alerts) are rustls's and our verifiers' (`tls`). A failed handshake sends the
//! alert rustls chose and ends in an `io::Error` whose inner error is the `rustls::Error`,
//! as tokio-rustls's did, so callers tell a refused identity from a broken link the same way.

use std::io;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, ServerName};
use rustls::unbuffered::{ConnectionState, EncodeError, UnbufferedStatus};
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::tls_stream::{Established, Session, TlsStream};

/// Handshake bytes buffered at most (rustls limits a handshake message to 64 KiB).
const HANDSHAKE_BUFFER: usize = 80 * 1024;

/// What the driver must do after a state has been handled.
enum Step {
    Again,
    Read,
    Write,
    Done,
    Failed(rustls::Error),
}

/// Accepts a TLS client on `tcp`. Returns the stream and the client's certificate (the
/// first of its chain; `None` if it sent none, which our server config never allows).
pub async fn accept(
    mut tcp: TcpStream,
    config: Arc<ServerConfig>,
) -> io::Result<(TlsStream, Option<CertificateDer<'static>>)> {
    let mut conn = rustls::server::UnbufferedServerConnection::new(config).map_err(invalid)?;
    let mut buffers = Buffers::default();
    drive(&mut tcp, &mut buffers, |incoming, outgoing, plaintext| {
        let incoming = until_established(conn.is_handshaking(), incoming);
        step(conn.process_tls_records(incoming), outgoing, plaintext)
    })
    .await?;
    let client = conn.peer_certificates().and_then(|chain| chain.first()).map(|c| c.clone().into_owned());
    let (secrets, kernel) = conn.dangerous_into_kernel_connection().map_err(invalid)?;
    let established = buffers.established(Session::Server(kernel), secrets);
    Ok((TlsStream::new(tcp, established)?, client))
}

/// Connects to a TLS server on `tcp` as `name`.
pub async fn connect(
    mut tcp: TcpStream,
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
) -> io::Result<TlsStream> {
    let mut conn = rustls::client::UnbufferedClientConnection::new(config, name).map_err(invalid)?;
    let mut buffers = Buffers::default();
    drive(&mut tcp, &mut buffers, |incoming, outgoing, plaintext| {
        let incoming = until_established(conn.is_handshaking(), incoming);
        step(conn.process_tls_records(incoming), outgoing, plaintext)
    })
    .await?;
    let (secrets, kernel) = conn.dangerous_into_kernel_connection().map_err(invalid)?;
    let established = buffers.established(Session::Client(kernel), secrets);
    TlsStream::new(tcp, established)
}

/// What rustls may read: everything while it handshakes, nothing once the handshake is
/// done. Records after the last handshake message (a KeyUpdate in the same segment as
/// the client's Finished, a session ticket, data) are left for our `Reader`: rustls would
/// act on them (queue its own KeyUpdate, move its keys on) in ways the hand-over cannot
/// carry, and a KeyUpdate it queued would be lost while its new key went on.
fn until_established(handshaking: bool, incoming: &mut [u8]) -> &mut [u8] {
    match handshaking {
        true => incoming,
        false => &mut [],
    }
}

fn invalid(error: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, error)
}

#[derive(Default)]
struct Buffers {
    incoming: Vec<u8>,
    used: usize,
    outgoing: Vec<u8>,
    /// Application data that arrived with the handshake (a client's first request).
    plaintext: Vec<u8>,
}

impl Buffers {
    fn established(self, session: Session, secrets: rustls::ExtractedSecrets) -> Established {
        Established {
            session,
            tx: secrets.tx,
            rx: secrets.rx,
            plaintext: self.plaintext,
            ciphertext: self.incoming[..self.used].to_vec(),
        }
    }
}

/// Runs `process` (one `process_tls_records` and the handling of its state) until the
/// handshake is done, reading and writing the socket as it asks.
async fn drive(
    tcp: &mut TcpStream,
    buffers: &mut Buffers,
    mut process: impl FnMut(&mut [u8], &mut Vec<u8>, &mut Vec<u8>) -> (usize, Step),
) -> io::Result<()> {
    buffers.incoming.resize(HANDSHAKE_BUFFER, 0);
    let mut failed = None;
    loop {
        let (discard, step) =
            process(&mut buffers.incoming[..buffers.used], &mut buffers.outgoing, &mut buffers.plaintext);
        buffers.incoming.copy_within(discard..buffers.used, 0);
        buffers.used -= discard;
        if buffers.plaintext.len() > HANDSHAKE_BUFFER {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "too much data with the TLS handshake"));
        }
        match step {
            Step::Again => {}
            Step::Write => {
                tcp.write_all(&buffers.outgoing).await?;
                buffers.outgoing.clear();
            }
            Step::Read if failed.is_some() => break,
            Step::Read => {
                if buffers.used == buffers.incoming.len() {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "TLS handshake message too large"));
                }
                let n = tcp.read(&mut buffers.incoming[buffers.used..]).await?;
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the TLS peer closed during the handshake",
                    ));
                }
                buffers.used += n;
            }
            Step::Done if failed.is_none() => return Ok(()),
            Step::Done => break,
            // The first error: rustls queued an alert, which the next calls encode.
            Step::Failed(error) if failed.is_none() => failed = Some(error),
            Step::Failed(_) => break,
        }
    }
    // Send the alert (best effort: the peer may be gone already).
    if !buffers.outgoing.is_empty() {
        let _ = tcp.write_all(&buffers.outgoing).await;
    }
    Err(invalid(failed.unwrap_or(rustls::Error::HandshakeNotComplete)))
}

/// Handles one state of the unbuffered connection: what to discard and what to do next.
fn step<Data>(
    status: UnbufferedStatus<'_, '_, Data>,
    outgoing: &mut Vec<u8>,
    plaintext: &mut Vec<u8>,
) -> (usize, Step) {
    let UnbufferedStatus { discard, state } = status;
    let step = match state {
        Err(error) => Step::Failed(error),
        Ok(ConnectionState::EncodeTlsData(mut encode)) => {
            let at = outgoing.len();
            outgoing.resize(at + 4096, 0);
            let mut encoded = encode.encode(&mut outgoing[at..]);
            if let Err(EncodeError::InsufficientSize(need)) = &encoded {
                if need.required_size <= HANDSHAKE_BUFFER {
                    outgoing.resize(at + need.required_size, 0);
                    encoded = encode.encode(&mut outgoing[at..]);
                }
            }
            match encoded {
                Ok(n) => {
                    outgoing.truncate(at + n);
                    Step::Again
                }
                Err(error) => {
                    outgoing.truncate(at);
                    Step::Failed(rustls::Error::General(format!("TLS handshake record: {error}")))
                }
            }
        }
        Ok(ConnectionState::TransmitTlsData(transmit)) => {
            transmit.done();
            Step::Write
        }
        Ok(ConnectionState::BlockedHandshake) => Step::Read,
        Ok(ConnectionState::WriteTraffic(_)) => Step::Done,
        Ok(ConnectionState::ReadTraffic(mut traffic)) => loop {
            match traffic.next_record() {
                Some(Ok(record)) => plaintext.extend_from_slice(record.payload),
                Some(Err(error)) => break Step::Failed(error),
                None => break Step::Again,
            }
        },
        Ok(ConnectionState::PeerClosed | ConnectionState::Closed) => {
            Step::Failed(rustls::Error::General("the TLS peer closed during the handshake".into()))
        }
        Ok(_) => Step::Failed(rustls::Error::General("unexpected TLS state during the handshake".into())),
    };
    (discard, step)
}

#[cfg(test)]
mod tests {
    /// The rustls release the hand-over was reviewed against: what
    /// `dangerous_into_kernel_connection` refuses to hand over, and what rustls may hold
    /// (queued records, a partly deframed message) when the handshake ends.
    const REVIEWED_RUSTLS: &str = "0.23.46";

    #[test]
    fn the_hand_over_was_reviewed_against_the_rustls_this_build_locks() {
        let lock = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../Cargo.lock"));
        let versions: Vec<&str> = lock
            .split("[[package]]")
            .filter(|package| package.contains("\nname = \"rustls\"\n"))
            .filter_map(|package| package.lines().find_map(|line| line.strip_prefix("version = \"")))
            .map(|version| version.trim_end_matches('"'))
            .collect();
        assert_eq!(
            versions,
            [REVIEWED_RUSTLS],
            "rustls is not the release the TLS hand-over was reviewed against: read handshake.rs and \
             tls_stream.rs against the new one (what it refuses to hand over, what it may still hold \
             when the handshake ends), then set REVIEWED_RUSTLS to it"
        );
    }
}
