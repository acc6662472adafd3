//! A userspace delay proxy: each direction of each connection is delayed by
//! half the RTT plus random jitter, without ever reordering bytes.

use std::net::SocketAddr;
use std::time::Duration;

use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Release times for chunks that arrive at given instants: arrival + delay +
/// jitter, but never before the previous chunk's release (bytes stay in order).
#[derive(Debug)]
pub struct Schedule {
    delay: Duration,
    jitter: Duration,
    last: Option<Instant>,
}

impl Schedule {
    pub fn new(delay: Duration, jitter: Duration) -> Self {
        Self { delay, jitter, last: None }
    }

    pub fn release(&mut self, arrival: Instant, rng: &mut impl Rng) -> Instant {
        let extra = if self.jitter.is_zero() { Duration::ZERO } else { rng.gen_range(Duration::ZERO..=self.jitter) };
        let at = arrival + self.delay + extra;
        let at = self.last.map_or(at, |last| at.max(last));
        self.last = Some(at);
        at
    }
}

/// Starts a proxy on 127.0.0.1 in front of `target` adding `rtt` (split across
/// both directions) and up to `jitter` per direction. Returns its address.
pub async fn start(target: SocketAddr, rtt: Duration, jitter: Duration) -> std::io::Result<SocketAddr> {
    let proxy = Proxy::start(target, rtt, jitter).await?;
    let addr = proxy.addr;
    // Keep it serving for the life of the process.
    std::mem::forget(proxy);
    Ok(addr)
}

/// A running delay proxy that can also cut every connection through it (a
/// network drop, for reattach and resume tests: closed, reset on one side,
/// or silent). Dropping it stops accepting; connections
/// already open keep going until either side closes.
pub struct Proxy {
    pub addr: SocketAddr,
    cut: watch::Sender<(u64, Cut)>,
}

/// How [`Proxy::cut_all`] ends the connections through the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Both sockets closed: each end sees the link go.
    Close,
    /// Nothing forwarded any more, both sockets left open: a pulled cable
    /// as both ends see it, neither told anything.
    Silence,
    /// The server's side reset (RST), the client's side left open without a
    /// word: what the client sees of a link lost beyond its own network.
    ResetServerSide,
}

impl Proxy {
    pub async fn start(target: SocketAddr, rtt: Duration, jitter: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (cut, cuts) = watch::channel((0u64, Cut::Close));
        let mut stopped = cuts.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    // The Proxy was dropped: stop accepting (open connections keep going).
                    () = async { while stopped.changed().await.is_ok() {} } => break,
                };
                let Ok((client, _)) = accepted else { break };
                let Ok(server) = TcpStream::connect(target).await else { continue };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let mut cuts = cuts.clone();
                cuts.mark_unchanged();
                tokio::spawn(async move {
                    let cut = {
                        let both = async {
                            tokio::join!(
                                pipe(&mut cr, &mut sw, rtt / 2, jitter),
                                pipe(&mut sr, &mut cw, rtt / 2, jitter)
                            )
                        };
                        tokio::select! {
                            _ = both => None,
                            Ok(()) = cuts.changed() => Some(cuts.borrow().1),
                        }
                    };
                    let keep_client_open = match cut {
                        None | Some(Cut::Close) => false,
                        Some(Cut::Silence) => true,
                        Some(Cut::ResetServerSide) => {
                            if let Ok(server) = sr.reunite(sw) {
                                let _ = server.set_zero_linger();
                            }
                            return hold_until_changed(cuts, (cr, cw)).await;
                        }
                    };
                    if keep_client_open {
                        hold_until_changed(cuts, (cr, cw, sr, sw)).await;
                    }
                });
            }
        });
        Ok(Self { addr, cut })
    }

    /// Closes every connection open through the proxy now; new ones are accepted.
    pub fn cut_all(&self) {
        self.cut_all_as(Cut::Close);
    }

    /// Ends every connection open through the proxy now, the way `cut` says;
    /// new ones are accepted. Sockets left open stay open, silent, until the
    /// next cut or until the proxy is dropped.
    pub fn cut_all_as(&self, cut: Cut) {
        self.cut.send_modify(|(n, kind)| {
            *n += 1;
            *kind = cut;
        });
    }
}

/// Keeps `sockets` open, forwarding nothing, until the next cut or the proxy's end.
async fn hold_until_changed<T>(mut cuts: watch::Receiver<(u64, Cut)>, sockets: T) {
    let _ = cuts.changed().await;
    drop(sockets);
}

async fn pipe(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
    jitter: Duration,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut schedule = Schedule::new(delay, jitter);
        let mut rng = rand::rngs::StdRng::from_entropy();
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let at = schedule.release(Instant::now(), &mut rng);
            if tx.send((at, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let writer = async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

use rand::SeedableRng as _;
use tokio::sync::watch;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_never_reorder_and_respect_the_delay() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut schedule = Schedule::new(Duration::from_millis(10), Duration::from_millis(50));
        let start = Instant::now();
        let mut previous = start;
        for i in 0..1000u64 {
            let arrival = start + Duration::from_micros(i * 100);
            let at = schedule.release(arrival, &mut rng);
            assert!(at >= previous, "reordered at {i}");
            assert!(at >= arrival + Duration::from_millis(10));
            assert!(at <= arrival + Duration::from_millis(60) || at == previous);
            previous = at;
        }
    }
}
