//! The ceiling: an ideal server that answers each 48-byte request with 48
//! bytes + the IN payload, or takes 48 bytes + the OUT payload and answers 48
//! bytes — no device, no decoding beyond two fields — and a client that keeps
//! the same number in flight. Whatever usbwire reaches is measured against it.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, Semaphore};

use crate::{Direction, Percentiles};

const HEADER: usize = 48;

/// Starts the ideal server on 127.0.0.1; returns its address.
pub async fn start_server() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve(stream));
        }
    });
    Ok(addr)
}

async fn serve(stream: TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let (read_half, mut write_half) = stream.into_split();
    let mut reader = BufReader::with_capacity(256 * 1024, read_half);
    let payload = vec![0x5au8; 16 * 1024 * 1024];
    let mut sink = vec![0u8; 16 * 1024 * 1024];
    let mut out = BytesMut::with_capacity(1024 * 1024);
    let mut header = [0u8; HEADER];
    loop {
        reader.read_exact(&mut header).await?;
        let is_in = u32::from_be_bytes(header[12..16].try_into().unwrap_or_default()) == 1;
        let len = (u32::from_be_bytes(header[24..28].try_into().unwrap_or_default()) as usize).min(payload.len());
        if !is_in {
            reader.read_exact(&mut sink[..len]).await?;
        }
        let mut reply = header;
        reply[0..4].copy_from_slice(&3u32.to_be_bytes());
        reply[24..28].copy_from_slice(&(len as u32).to_be_bytes());
        out.put_slice(&reply);
        if is_in {
            out.put_slice(&payload[..len]);
        }
        // Answer everything already received in one write.
        if reader.buffer().is_empty() {
            write_half.write_all(&out).await?;
            out.clear();
        }
    }
}

/// Result of one ceiling run.
#[derive(Clone, Debug)]
pub struct Measured {
    pub mib_per_s: f64,
    pub urbs_per_s: f64,
    pub latency: Percentiles,
    /// Every URB's latency in µs, sorted (for CDF plots).
    pub samples: Vec<f64>,
}

/// Runs `depth`-deep request/reply traffic of `size`-byte payloads for `duration`.
pub async fn measure(
    addr: SocketAddr,
    direction: Direction,
    size: usize,
    depth: usize,
    duration: Duration,
) -> std::io::Result<Measured> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut read_half, mut write_half) = stream.into_split();
    let permits = Arc::new(Semaphore::new(depth));
    let sent_at = Arc::new(Mutex::new(VecDeque::<Instant>::new()));
    let mut request = BytesMut::new();
    let mut header = [0u8; HEADER];
    header[0..4].copy_from_slice(&1u32.to_be_bytes());
    header[12..16].copy_from_slice(&u32::from(direction == Direction::In).to_be_bytes());
    header[24..28].copy_from_slice(&(size as u32).to_be_bytes());
    request.put_slice(&header);
    if direction == Direction::Out {
        request.put_bytes(0xa5, size);
    }
    let request = request.freeze();
    let stop = Instant::now() + duration;

    let writer = {
        let permits = permits.clone();
        let sent_at = sent_at.clone();
        tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.acquire().await else { break };
                permit.forget();
                if Instant::now() >= stop {
                    break;
                }
                sent_at.lock().await.push_back(Instant::now());
                if write_half.write_all(&request).await.is_err() {
                    break;
                }
            }
            write_half
        })
    };
    let reply_len = HEADER + if direction == Direction::In { size } else { 0 };
    let mut buf = vec![0u8; reply_len];
    let mut done = 0u64;
    let mut latencies = Vec::new();
    let started = Instant::now();
    let mut finished = started;
    loop {
        if Instant::now() >= stop && sent_at.lock().await.is_empty() {
            break;
        }
        match tokio::time::timeout(Duration::from_secs(5), read_half.read_exact(&mut buf)).await {
            Ok(Ok(_)) => {}
            _ => break,
        }
        if let Some(at) = sent_at.lock().await.pop_front() {
            latencies.push(at.elapsed().as_secs_f64() * 1e6);
        }
        done += 1;
        finished = Instant::now();
        permits.add_permits(1);
    }
    permits.close();
    let _ = writer.await;
    let seconds = finished.duration_since(started).as_secs_f64().max(1e-9);
    Ok(Measured {
        mib_per_s: done as f64 * size as f64 / seconds / (1024.0 * 1024.0),
        urbs_per_s: done as f64 / seconds,
        latency: Percentiles::of(&mut latencies),
        samples: latencies,
    })
}
