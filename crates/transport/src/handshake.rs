//! The TLS 1.3 handshake on a TCP socket, run by rustls's unbuffered API, ending in a
//! [`TlsStream`] that holds the traffic keys.
//!
//! Owns the handshake's buffers and its socket I/O; the decisions (certificates, access
//! rules, alerts) are rustls's and our verifiers' (`tls`). A failed handshake sends the
//! alert rustls chose and ends in an `io::Error` whose inner error is the `rustls::Error`,
//! as tokio-rustls's did, so callers tell a refused identity from a broken link the same way.

use std::io;
use std::sync::Arc;

use crate::tls_stream::{Established, Session, Socket, TlsStream};
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::unbuffered::{ConnectionState, EncodeError, UnbufferedStatus};
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
pub async fn accept<S: Socket>(
    mut tcp: S,
    config: Arc<ServerConfig>,
) -> io::Result<(TlsStream<S>, Option<CertificateDer<'static>>)> {
    let mut conn = rustls::server::UnbufferedServerConnection::new(config).map_err(invalid)?;
    let mut buffers = Buffers::default();
    drive(&mut tcp, &mut buffers, |incoming, outgoing, plaintext| {
        let (discard, step) = step(conn.process_tls_records(incoming), outgoing, plaintext);
        (discard, step, conn.is_handshaking())
    })
    .await?;
    let client = conn.peer_certificates().and_then(|chain| chain.first()).map(|c| c.clone().into_owned());
    let (secrets, kernel) = conn.dangerous_into_kernel_connection().map_err(invalid)?;
    let established = buffers.established(Session::Server(kernel), secrets);
    Ok((TlsStream::new(tcp, established)?, client))
}

/// Connects to a TLS server on `tcp` as `name`.
pub async fn connect<S: Socket>(
    mut tcp: S,
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
) -> io::Result<TlsStream<S>> {
    let mut conn = rustls::client::UnbufferedClientConnection::new(config, name).map_err(invalid)?;
    let mut buffers = Buffers::default();
    drive(&mut tcp, &mut buffers, |incoming, outgoing, plaintext| {
        let (discard, step) = step(conn.process_tls_records(incoming), outgoing, plaintext);
        (discard, step, conn.is_handshaking())
    })
    .await?;
    let (secrets, kernel) = conn.dangerous_into_kernel_connection().map_err(invalid)?;
    let established = buffers.established(Session::Client(kernel), secrets);
    TlsStream::new(tcp, established)
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

/// Runs `process` (one `process_tls_records` and the handling of its state; it says
/// whether rustls still handshakes) until the handshake is done, reading and writing the
/// socket as it asks.
///
/// rustls is shown the buffered records one at a time, and none once its handshake is
/// done: whatever follows the last handshake record (a KeyUpdate in the same segment as
/// the client's Finished, a session ticket, data) is left for our `Reader`. rustls would
/// act on it in ways the hand-over cannot carry: a KeyUpdate(update_requested) makes it
/// queue its own KeyUpdate, which `dangerous_into_kernel_connection` drops, while its
/// sending key moves on.
async fn drive<S: Socket>(
    tcp: &mut S,
    buffers: &mut Buffers,
    mut process: impl FnMut(&mut [u8], &mut Vec<u8>, &mut Vec<u8>) -> (usize, Step, bool),
) -> io::Result<()> {
    buffers.incoming.resize(HANDSHAKE_BUFFER, 0);
    let mut failed = None;
    let (mut handshaking, mut shown) = (true, 0);
    loop {
        let offer = if handshaking { next_record_end(&buffers.incoming[..buffers.used], shown) } else { 0 };
        let (discard, step, still) =
            process(&mut buffers.incoming[..offer], &mut buffers.outgoing, &mut buffers.plaintext);
        handshaking = still;
        shown = offer - discard;
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
            // The next record is buffered already: shown on the next turn.
            Step::Read if handshaking && shown < buffers.used => {}
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

/// Where the record that starts at `from` ends in `buffered` (its end, if it is not all
/// there yet: rustls then asks for more).
fn next_record_end(buffered: &[u8], from: usize) -> usize {
    match buffered.get(from + 3..from + 5) {
        Some(len) => (from + 5 + usize::from(u16::from_be_bytes([len[0], len[1]]))).min(buffered.len()),
        None => buffered.len(),
    }
}

/// Handles one state of the unbuffered connection: what to discard and what to do next.
fn step<Data>(
    status: UnbufferedStatus<'_, '_, Data>,
    outgoing: &mut Vec<u8>,
    plaintext: &mut Vec<u8>,
) -> (usize, Step) {
    let UnbufferedStatus { mut discard, state } = status;
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
                // rustls: each record's `discard` MUST be added to the status's.
                Some(Ok(record)) => {
                    discard += record.discard;
                    plaintext.extend_from_slice(record.payload);
                }
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
    use super::next_record_end;

    #[test]
    fn records_are_shown_one_at_a_time_and_a_partial_one_whole_as_far_as_it_came() {
        let buffered = [22, 3, 3, 0, 2, 0xaa, 0xbb, 23, 3, 3, 0, 4, 1, 2];
        assert_eq!(next_record_end(&buffered, 0), 7);
        assert_eq!(next_record_end(&buffered, 7), buffered.len(), "the second is not all there yet");
        assert_eq!(next_record_end(&buffered[..9], 7), 9, "nor is its header");
        assert_eq!(next_record_end(&buffered, buffered.len()), buffered.len());
    }

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
