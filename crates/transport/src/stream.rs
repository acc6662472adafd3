//! One stream type for plain and TLS connections, and the TLS handshakes that make one.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::handshake;
use crate::tls_stream::TlsStream;

/// Set to `rustls` (or `rustls:BYTES`), TLS connections carry their records through
/// rustls's own record layer (tokio-rustls) instead of ours, with the same handshake,
/// configurations and crypto, over a socket buffered with BYTES each way (none by
/// default): for measuring one beside the other (`usbwire bench --tls`, BENCHMARKS.md),
/// not for use.
pub const RECORD_LAYER_VARIABLE: &str = "USBWIRE_TLS_RECORDS";

/// What [`RECORD_LAYER_VARIABLE`] asks for: `Some(buffer)` for rustls's record layer
/// (said once in the log), `None` for ours.
fn rustls_records() -> Option<usize> {
    static CHOSEN: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let value = std::env::var(RECORD_LAYER_VARIABLE).ok()?;
        let buffer = match value.split_once(':') {
            None if value == "rustls" => 0,
            Some(("rustls", bytes)) => bytes.parse().ok()?,
            _ => return None,
        };
        tracing::warn!(
            buffer,
            "{RECORD_LAYER_VARIABLE}={value}: TLS records go through rustls's own record layer (for measurements)"
        );
        Some(buffer)
    })
}

/// The socket under rustls's record layer: buffered with `buffer` bytes each way (0:
/// none; a buffer of one byte passes every read and write straight through).
fn buffered(tcp: TcpStream, buffer: usize) -> tokio::io::BufStream<TcpStream> {
    tokio::io::BufStream::with_capacity(buffer.max(1), buffer.max(1), tcp)
}

/// Accepts a TLS client on `tcp` ([`handshake::accept`]): the stream, and the client's
/// certificate.
pub async fn accept_tls(
    tcp: TcpStream,
    config: Arc<rustls::ServerConfig>,
) -> io::Result<(PeerStream, Option<CertificateDer<'static>>)> {
    accept_tls_with(rustls_records(), tcp, config).await
}

async fn accept_tls_with(
    rustls_records: Option<usize>,
    tcp: TcpStream,
    config: Arc<rustls::ServerConfig>,
) -> io::Result<(PeerStream, Option<CertificateDer<'static>>)> {
    if let Some(buffer) = rustls_records {
        let stream = tokio_rustls::TlsAcceptor::from(config).accept(buffered(tcp, buffer)).await?;
        let leaf =
            stream.get_ref().1.peer_certificates().and_then(|chain| chain.first()).map(|c| c.clone().into_owned());
        return Ok((PeerStream::Rustls(Box::new(stream.into())), leaf));
    }
    let (stream, leaf) = handshake::accept(tcp, config).await?;
    Ok((PeerStream::Tls(Box::new(stream)), leaf))
}

/// Connects to a TLS server on `tcp` ([`handshake::connect`]).
pub async fn connect_tls(
    tcp: TcpStream,
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
) -> io::Result<PeerStream> {
    connect_tls_with(rustls_records(), tcp, config, name).await
}

async fn connect_tls_with(
    rustls_records: Option<usize>,
    tcp: TcpStream,
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
) -> io::Result<PeerStream> {
    if let Some(buffer) = rustls_records {
        let stream = tokio_rustls::TlsConnector::from(config).connect(name, buffered(tcp, buffer)).await?;
        return Ok(PeerStream::Rustls(Box::new(stream.into())));
    }
    Ok(PeerStream::Tls(Box::new(handshake::connect(tcp, config, name).await?)))
}

/// A connection to a peer, plain or inside TLS.
#[derive(Debug)]
pub enum PeerStream {
    Plain(TcpStream),
    /// TLS 1.3, either side (see [`crate::handshake`]).
    Tls(Box<TlsStream>),
    /// TLS 1.3 through rustls's own record layer ([`RECORD_LAYER_VARIABLE`]).
    Rustls(Box<tokio_rustls::TlsStream<tokio::io::BufStream<TcpStream>>>),
    /// Any of the others carrying negotiated transforms (compression, jitter buffer).
    Transformed(Box<crate::transform::TransformedStream<Self>>),
    /// A connection inside this process (no socket): the fuzz harness and tests drive a
    /// whole server session through one end of a `tokio::io::duplex` pipe.
    InProcess(tokio::io::DuplexStream),
}

impl PeerStream {
    pub fn is_tls(&self) -> bool {
        match self {
            Self::Plain(_) | Self::InProcess(_) => false,
            Self::Transformed(s) => s.get_ref().is_tls(),
            _ => true,
        }
    }

    /// The address of the peer at the other end of the TCP connection
    /// underneath (an in-process stream has none).
    pub fn peer_addr(&self) -> io::Result<std::net::SocketAddr> {
        match self {
            Self::Plain(tcp) => tcp.peer_addr(),
            Self::Tls(tls) => tls.get_ref().peer_addr(),
            Self::Rustls(tls) => tls.get_ref().0.get_ref().peer_addr(),
            Self::Transformed(s) => s.get_ref().peer_addr(),
            Self::InProcess(_) => Err(io::ErrorKind::NotConnected.into()),
        }
    }

    /// Byte counters of the transforms, if any were negotiated.
    pub fn transform_stats(&self) -> Option<std::sync::Arc<crate::transform::TransformStats>> {
        match self {
            Self::Transformed(s) => Some(s.stats()),
            _ => None,
        }
    }

    /// The transforms in use (empty unless negotiated).
    pub fn transforms(&self) -> Vec<&'static str> {
        match self {
            Self::Transformed(s) => s.transforms(),
            _ => Vec::new(),
        }
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Self::Rustls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Self::Transformed(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Self::InProcess(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Self::Rustls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Self::Transformed(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Self::InProcess(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            Self::Rustls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            Self::Transformed(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            Self::InProcess(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s) => s.is_write_vectored(),
            Self::Rustls(s) => s.is_write_vectored(),
            Self::Transformed(s) => s.is_write_vectored(),
            Self::InProcess(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Self::Rustls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Self::Transformed(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Self::InProcess(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Self::Rustls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Self::Transformed(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Self::InProcess(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// iovecs per `writev` in [`write_all_parts`].
const MAX_WRITE_SLICES: usize = 512;

/// iovecs per `writev` in [`poll_write_outbox`].
const MAX_OUTBOX_SLICES: usize = 64;

/// Writes from a URB-phase [`usbwire_proto::Outbox`] (the server's replies, a
/// client session's commands) until the writer would block or all is out, for
/// hand-written poll loops. `Ready(Ok(wrote))` says whether any byte went out;
/// `Pending` only when none could. Does not flush.
pub fn poll_write_outbox<W: tokio::io::AsyncWrite + Unpin + ?Sized>(
    outbox: &mut usbwire_proto::Outbox,
    cx: &mut Context<'_>,
    writer: &mut W,
) -> Poll<io::Result<bool>> {
    let mut wrote = false;
    while !outbox.is_empty() {
        let written = match Pin::new(&mut *writer).poll_write_vectored(cx, &outbox.slices(MAX_OUTBOX_SLICES)) {
            Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
            Poll::Ready(Ok(n)) => n,
            Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
            Poll::Pending if wrote => return Poll::Ready(Ok(true)),
            Poll::Pending => return Poll::Pending,
        };
        outbox.advance(written);
        wrote = true;
    }
    Poll::Ready(Ok(wrote))
}

/// Writes every byte of `parts`, in order, with as few `writev` calls as the
/// socket allows (headers and payloads of many messages in one call, no copy).
pub async fn write_all_parts<W, P>(writer: &mut W, parts: &[P]) -> std::io::Result<()>
where
    W: tokio::io::AsyncWrite + Unpin + ?Sized,
    P: AsRef<[u8]>,
{
    use tokio::io::AsyncWriteExt;
    let (mut index, mut offset) = (0usize, 0usize);
    while index < parts.len() {
        if parts[index].as_ref().len() == offset {
            index += 1;
            offset = 0;
            continue;
        }
        let slices: Vec<std::io::IoSlice<'_>> = std::iter::once(&parts[index].as_ref()[offset..])
            .chain(parts[index + 1..].iter().map(AsRef::as_ref))
            .filter(|p| !p.is_empty())
            .take(MAX_WRITE_SLICES)
            .map(std::io::IoSlice::new)
            .collect();
        let mut written = writer.write_vectored(&slices).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while written > 0 {
            let left = parts[index].as_ref().len() - offset;
            if written < left {
                offset += written;
                written = 0;
            } else {
                written -= left;
                index += 1;
                offset = 0;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that takes at most `step` bytes and at most two slices per call.
    struct Stingy {
        out: Vec<u8>,
        step: usize,
        calls: usize,
    }

    impl tokio::io::AsyncWrite for Stingy {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            let n = buf.len().min(self.step);
            self.out.extend_from_slice(&buf[..n]);
            self.calls += 1;
            Poll::Ready(Ok(n))
        }
        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[io::IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            self.calls += 1;
            let mut n = 0;
            for buf in bufs.iter().take(2) {
                let take = buf.len().min(self.step - n);
                self.out.extend_from_slice(&buf[..take]);
                n += take;
                if n == self.step {
                    break;
                }
            }
            Poll::Ready(Ok(n))
        }
        fn is_write_vectored(&self) -> bool {
            true
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn every_byte_goes_out_in_order_whatever_the_writer_takes() {
        let parts: Vec<Vec<u8>> = vec![b"head".to_vec(), vec![], (0..=255).collect(), vec![], b"tail".to_vec()];
        let expected: Vec<u8> = parts.concat();
        for step in [1, 3, 4, 100, 10_000] {
            let mut writer = Stingy { out: Vec::new(), step, calls: 0 };
            write_all_parts(&mut writer, &parts).await.unwrap();
            assert_eq!(writer.out, expected, "step {step}");
        }
        let mut writer = Stingy { out: Vec::new(), step: 1 << 20, calls: 0 };
        write_all_parts(&mut writer, &[Vec::<u8>::new(), Vec::new()]).await.unwrap();
        assert_eq!(writer.calls, 0);
    }

    /// Either record layer on either side: a client of one talks to a server of the other,
    /// each side's certificate reaching the other, data both ways.
    #[tokio::test]
    async fn our_record_layer_and_rustlss_serve_each_other_either_way() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        use crate::access::{AccessRules, Admission, Rule};
        use crate::tls::{client_config, server_config, server_name, ServerTrust};
        use crate::Identity;

        let (server, client) = (Identity::generate("server").unwrap(), Identity::generate("client").unwrap());
        let rules =
            AccessRules { rules: vec![Rule { client: client.fingerprint().to_string(), devices: vec!["*".into()] }] };
        let server_config = server_config(&server, Admission { rules, ca: None }).unwrap();
        let (client_config, _) = client_config(&client, ServerTrust::Pinned(server.fingerprint())).unwrap();
        for (server_rustls, client_rustls) in [(None, Some(0)), (Some(65536), None), (Some(0), Some(4096))] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let accept = async {
                let tcp = listener.accept().await.unwrap().0;
                accept_tls_with(server_rustls, tcp, server_config.clone()).await.unwrap()
            };
            let connect = async {
                let tcp = TcpStream::connect(addr).await.unwrap();
                connect_tls_with(client_rustls, tcp, client_config.clone(), server_name()).await.unwrap()
            };
            let ((mut server_side, leaf), mut client_side) = tokio::join!(accept, connect);
            assert!(leaf.is_some(), "the server sees the client's certificate");
            assert_eq!(matches!(server_side, PeerStream::Rustls(_)), server_rustls.is_some());
            assert_eq!(matches!(client_side, PeerStream::Rustls(_)), client_rustls.is_some());
            assert!(server_side.is_tls() && client_side.is_tls() && server_side.peer_addr().is_ok());
            let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
            client_side.write_all(&data).await.unwrap();
            client_side.flush().await.unwrap();
            let mut got = vec![0; data.len()];
            server_side.read_exact(&mut got).await.unwrap();
            assert!(got == data, "server {server_rustls:?} client {client_rustls:?}: the client's bytes");
            server_side.write_all(&data[..70_000]).await.unwrap();
            server_side.shutdown().await.unwrap();
            let mut back = Vec::new();
            client_side.read_to_end(&mut back).await.unwrap();
            assert!(
                back == data[..70_000],
                "server {server_rustls:?} client {client_rustls:?}: the server's bytes, then its close"
            );
        }
    }
}
