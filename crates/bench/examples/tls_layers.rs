//! Our TLS record layer beside rustls's own, on the same transport: two threads, one
//! single-threaded runtime each (as the server runs a connection and the relay runs
//! `attach`), a TLS 1.3 connection over loopback TCP between them with the same
//! configurations (usbwire's, aws-lc-rs, AES-256-GCM), one side writing `SIZE`-byte
//! writes as fast as the other reads them. Both ends ours (`handshake::accept` /
//! `connect`, then `TlsStream`), or both ends tokio-rustls over the bare socket, or
//! tokio-rustls over a `BufStream` with `BUF` bytes each way (rustls reads a record at a
//! time from what it is given; a larger buffer saves syscalls). IN is the server
//! writing, OUT the client. Rounds alternate the layers; each point is the median.
//!
//! ```text
//! cargo run --release -p usbwire-bench --example tls_layers -- [SECONDS_PER_RUN] [ROUNDS]
//! cargo run --release -p usbwire-bench --example tls_layers -- SECONDS 1 ours|rustls|rustls+BUF in|out SIZE
//! ```
//!
//! Not a product surface: BENCHMARKS.md ("Our record layer or rustls's") says what it
//! measured and what it decided.

use std::error::Error;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufStream};
use tokio::net::{TcpListener, TcpStream};
use usbwire_transport::access::{AccessRules, Admission, Rule};
use usbwire_transport::tls::{client_config, server_config, server_name, ServerTrust};
use usbwire_transport::{handshake, Identity};

/// Which record layer both ends run.
#[derive(Clone, Copy, Debug)]
enum Layer {
    Ours,
    Rustls,
    /// tokio-rustls over a `BufStream` with this many bytes each way.
    RustlsBuffered(usize),
}

impl Layer {
    fn name(self) -> String {
        match self {
            Self::Ours => "ours".into(),
            Self::Rustls => "rustls".into(),
            Self::RustlsBuffered(buf) => format!("rustls+{}K", buf / 1024),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Way {
    /// The server writes.
    In,
    /// The client writes.
    Out,
}

struct Configs {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

fn configs() -> Result<Configs, Box<dyn Error>> {
    let (server, client) = (Identity::generate("server")?, Identity::generate("client")?);
    let rules =
        AccessRules { rules: vec![Rule { client: client.fingerprint().to_string(), devices: vec!["*".into()] }] };
    let server_config = server_config(&server, Admission { rules, ca: None })?;
    let (client_config, _) = client_config(&client, ServerTrust::Pinned(server.fingerprint()))?;
    Ok(Configs { server: server_config, client: client_config })
}

type Stream = Box<dyn Duplex>;
trait Duplex: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Duplex for T {}

async fn accept(layer: Layer, tcp: TcpStream, config: Arc<rustls::ServerConfig>) -> std::io::Result<Stream> {
    tcp.set_nodelay(true)?;
    Ok(match layer {
        Layer::Ours => Box::new(handshake::accept(tcp, config).await?.0),
        Layer::Rustls => Box::new(tokio_rustls::TlsAcceptor::from(config).accept(tcp).await?),
        Layer::RustlsBuffered(buf) => {
            Box::new(tokio_rustls::TlsAcceptor::from(config).accept(BufStream::with_capacity(buf, buf, tcp)).await?)
        }
    })
}

async fn connect(layer: Layer, tcp: TcpStream, config: Arc<rustls::ClientConfig>) -> std::io::Result<Stream> {
    tcp.set_nodelay(true)?;
    let connector = tokio_rustls::TlsConnector::from(config);
    Ok(match layer {
        Layer::Ours => Box::new(handshake::connect(tcp, connector.config().clone(), server_name()).await?),
        Layer::Rustls => Box::new(connector.connect(server_name(), tcp).await?),
        Layer::RustlsBuffered(buf) => {
            Box::new(connector.connect(server_name(), BufStream::with_capacity(buf, buf, tcp)).await?)
        }
    })
}

/// Writes `size`-byte writes for `seconds`, then closes (close_notify) and waits for the reader to.
async fn write_for(mut stream: Stream, size: usize, seconds: f64) -> std::io::Result<(u64, f64)> {
    let data = vec![0x5au8; size];
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < until {
        stream.write_all(&data).await?;
    }
    stream.flush().await?;
    stream.shutdown().await?;
    // Until the reader hangs up: closing with the peer's tickets unread would reset the
    // connection under the reader's last reads.
    let _ = stream.read_to_end(&mut Vec::new()).await;
    Ok((0, 0.0))
}

/// Reads until the end: the bytes, and the seconds from the first to the last.
async fn read_all(mut stream: Stream, size: usize) -> std::io::Result<(u64, f64)> {
    let mut buf = vec![0u8; size];
    let (mut total, mut first) = (0u64, None);
    loop {
        let read = stream.read(&mut buf).await;
        let first = *first.get_or_insert_with(Instant::now);
        match read {
            Ok(0) => return Ok((total, first.elapsed().as_secs_f64())),
            Ok(n) => total += n as u64,
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Ok((total, first.elapsed().as_secs_f64()))
            }
            Err(error) => return Err(error),
        }
    }
}

/// One run: MiB/s from the first byte to the last.
fn run(layer: Layer, way: Way, size: usize, seconds: f64, configs: &Configs) -> Result<f64, Box<dyn Error>> {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    std_listener.set_nonblocking(true)?;
    let addr: SocketAddr = std_listener.local_addr()?;
    let server_config = configs.server.clone();
    let runtime = || tokio::runtime::Builder::new_current_thread().enable_all().build();
    let server = std::thread::spawn(move || -> std::io::Result<(u64, f64)> {
        runtime()?.block_on(async move {
            let listener = TcpListener::from_std(std_listener)?;
            let (tcp, _) = listener.accept().await?;
            let stream = accept(layer, tcp, server_config).await?;
            match way {
                Way::In => write_for(stream, size, seconds).await,
                Way::Out => read_all(stream, size).await,
            }
        })
    });
    let client_config = configs.client.clone();
    let client = std::thread::spawn(move || -> std::io::Result<(u64, f64)> {
        runtime()?.block_on(async move {
            let stream = connect(layer, TcpStream::connect(addr).await?, client_config).await?;
            match way {
                Way::In => read_all(stream, size).await,
                Way::Out => write_for(stream, size, seconds).await,
            }
        })
    });
    let (server, client) = (server.join().map_err(|_| "server thread")??, client.join().map_err(|_| "client thread")??);
    let (bytes, took) = (server.0 + client.0, server.1 + client.1);
    Ok(bytes as f64 / took / f64::from(1 << 20))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let seconds: f64 = args.first().map_or(Ok(1.0), |s| s.parse())?;
    let rounds: usize = args.get(1).map_or(Ok(5), |s| s.parse())?;
    let configs = configs()?;
    if let [_, _, layer, way, size] = args.as_slice() {
        // One point, once (for a profiler).
        let layer = match layer.as_str() {
            "ours" => Layer::Ours,
            "rustls" => Layer::Rustls,
            buffered => Layer::RustlsBuffered(buffered.trim_start_matches("rustls+").parse()?),
        };
        let way = if way == "in" { Way::In } else { Way::Out };
        println!("{:.0} MiB/s", run(layer, way, size.parse()?, seconds, &configs)?);
        return Ok(());
    }
    let layers = [Layer::Ours, Layer::Rustls, Layer::RustlsBuffered(64 * 1024), Layer::RustlsBuffered(256 * 1024)];
    println!("| layer | IN 64K | IN 1M | OUT 64K | OUT 1M |");
    println!("|---|---|---|---|---|");
    let points = [(Way::In, 64 << 10), (Way::In, 1 << 20), (Way::Out, 64 << 10), (Way::Out, 1 << 20)];
    let mut results = vec![vec![Vec::new(); points.len()]; layers.len()];
    for _ in 0..rounds {
        for (p, &(way, size)) in points.iter().enumerate() {
            for (l, &layer) in layers.iter().enumerate() {
                results[l][p].push(run(layer, way, size, seconds, &configs)?);
            }
        }
    }
    let ours: Vec<f64> = results[0].iter_mut().map(|runs| median(runs)).collect();
    for (l, layer) in layers.iter().enumerate() {
        let cells: Vec<String> = results[l]
            .iter_mut()
            .zip(&ours)
            .map(|(runs, ours)| {
                let (low, high) =
                    (runs.iter().copied().fold(f64::MAX, f64::min), runs.iter().copied().fold(0.0, f64::max));
                let m = median(runs);
                format!("{m:.0} ({low:.0}–{high:.0}; {:.2}× ours)", m / ours)
            })
            .collect();
        println!("| {} | {} |", layer.name(), cells.join(" | "));
    }
    Ok(())
}
