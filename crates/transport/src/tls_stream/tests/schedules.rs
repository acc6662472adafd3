//! Issue 35: our sending side under every kind of socket trouble, against a stock rustls
//! peer. A scripted socket under our [`TlsStream`] takes a few bytes of a write, or says
//! it would block, or fails a write (once: the socket would take bytes again after); the
//! caller sometimes gives up a write or a flush it was told to wait for (the future
//! dropped mid-way), asks for key updates, or runs with AES-GCM's record limit set low.
//! Thousands of random schedules, each checked for:
//! * no (key, sequence number) sealed twice, whatever was resent, given up or failed;
//! * when nothing failed: the peer reads back exactly the bytes whose writes returned
//!   `Ok(n)`, all of them, in order, then our close_notify;
//! * when a write failed: every later write, flush and shutdown fails, not one more byte
//!   reaches the socket (though it would take them), and what the peer read is a prefix
//!   of what was accepted and the failed write's bytes.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, DuplexStream, ReadBuf};

use super::super::{Socket, TlsStream};
use super::pair;
use crate::handshake;
use crate::record::testing::take_sealed;
use crate::tls::server_name;

/// SplitMix64: the schedule's dice, from its seed.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    /// A write's length: mostly short (URB headers, small replies), some a record or
    /// more, a few a large URB's.
    fn length(&mut self) -> usize {
        (match self.below(32) {
            0..=11 => self.below(64),
            12..=21 => self.below(4096),
            22..=30 => self.below(40_000),
            _ => 256 * 1024 + self.below(100_000),
        }) as usize
    }
}

/// Our end of the link, as the schedule says (see the module docs).
struct Scripted {
    inner: DuplexStream,
    dice: Dice,
    /// Off during the handshake.
    scripting: bool,
    /// One write in this many fails (0: none).
    fail_one_in: u64,
    failed: bool,
    /// Bytes the stream handed the socket after a write failed.
    after_failure: usize,
}

impl Scripted {
    fn write_through(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let (true, Poll::Ready(Ok(n))) = (self.failed, &written) {
            self.after_failure += n;
        }
        written
    }
}

impl AsyncRead for Scripted {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Scripted {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if !self.scripting || buf.is_empty() {
            return self.write_through(cx, buf);
        }
        let fail_one_in = self.fail_one_in;
        if fail_one_in > 0 && self.dice.one_in(fail_one_in) {
            self.failed = true;
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "scripted write failure")));
        }
        match self.dice.below(8) {
            0 => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            1..=3 => {
                let take = 1 + self.dice.below(buf.len() as u64) as usize;
                self.write_through(cx, &buf[..take])
            }
            _ => self.write_through(cx, buf),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Socket for Scripted {
    fn try_write_now(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self.write_through(&mut Context::from_waker(Waker::noop()), buf) {
            Poll::Ready(written) => written,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

/// What our side did in one schedule.
#[derive(Default)]
struct Sent {
    /// The bytes of every write that returned `Ok(n)`: their first `n`.
    accepted: Vec<u8>,
    /// A write, flush or shutdown failed.
    failed: bool,
    /// The bytes of the write that failed: sealed before its records met the failure,
    /// some of them may have reached the peer (as over TCP, a failed write says nothing
    /// of how much went).
    failed_write: Vec<u8>,
    /// Writes and flushes given up while they waited.
    given_up: usize,
}

/// Polls `op` on `stream` until it is ready, giving up (as a dropped future) after a
/// random number of `Pending`s when `patient` is false.
async fn attempt<T>(
    stream: &mut TlsStream<Scripted>,
    dice_says_give_up: impl Fn(&mut TlsStream<Scripted>) -> bool,
    mut op: impl FnMut(Pin<&mut TlsStream<Scripted>>, &mut Context<'_>) -> Poll<io::Result<T>>,
) -> Option<io::Result<T>> {
    loop {
        let polled = std::future::poll_fn(|cx| Poll::Ready(op(Pin::new(&mut *stream), cx))).await;
        match polled {
            Poll::Ready(result) => return Some(result),
            Poll::Pending if dice_says_give_up(stream) => return None,
            // Lets the peer read meanwhile.
            Poll::Pending => tokio::task::yield_now().await,
        }
    }
}

fn give_up_sometimes(stream: &mut TlsStream<Scripted>) -> bool {
    stream.tcp.dice.one_in(3)
}

fn never_give_up(_: &mut TlsStream<Scripted>) -> bool {
    false
}

/// Our side's part of a schedule: writes, flushes and key updates, then a close.
async fn send(stream: &mut TlsStream<Scripted>, ops: usize) -> Sent {
    let mut sent = Sent::default();
    for _ in 0..ops {
        match stream.tcp.dice.below(10) {
            0 => stream.tx.update_key(),
            1 => match attempt(stream, give_up_sometimes, |s, cx| s.poll_flush(cx)).await {
                Some(Err(_)) => sent.failed = true,
                Some(Ok(())) => {}
                None => sent.given_up += 1,
            },
            _ => {
                let slices = 1 + stream.tcp.dice.below(4);
                let data: Vec<Vec<u8>> = (0..slices)
                    .map(|_| {
                        let len = stream.tcp.dice.length();
                        (0..len).map(|_| stream.tcp.dice.next() as u8).collect()
                    })
                    .collect();
                let bufs: Vec<IoSlice<'_>> = data.iter().map(|d| IoSlice::new(d)).collect();
                match attempt(stream, give_up_sometimes, |s, cx| s.poll_write_vectored(cx, &bufs)).await {
                    Some(Ok(n)) => sent.accepted.extend(data.concat().into_iter().take(n)),
                    Some(Err(_)) => (sent.failed, sent.failed_write) = (true, data.concat()),
                    None => sent.given_up += 1,
                }
            }
        }
        if sent.failed {
            break;
        }
    }
    let close = [
        attempt(stream, never_give_up, |s, cx| s.poll_flush(cx)).await,
        attempt(stream, never_give_up, |s, cx| s.poll_shutdown(cx)).await,
    ];
    let closed = close.iter().all(|result| matches!(result, Some(Ok(()))));
    if sent.failed {
        assert!(close.iter().all(|result| matches!(result, Some(Err(_)))), "a flush or shutdown after a failure");
        assert!(attempt(stream, never_give_up, |s, cx| s.poll_write(cx, b"more")).await.unwrap().is_err());
    } else {
        // The last flush or the close_notify may meet the scripted failure too.
        sent.failed = !closed;
    }
    sent
}

/// The peer reads until the stream ends: what it read, and whether the end was our close_notify.
async fn receive(peer: &mut (impl AsyncRead + Unpin)) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let mut buf = vec![0; 64 * 1024];
    loop {
        match peer.read(&mut buf).await {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (got, false),
        }
    }
}

/// What a schedule went through, so the test can tell it covered each kind of trouble.
#[derive(Default)]
struct Coverage {
    schedules: u64,
    failed: u64,
    given_up: usize,
    /// Keys changed (ours: asked for, or at the record limit).
    rekeys: usize,
    bytes: usize,
}

/// One schedule from `seed`: our side the server (even seeds) or the client (odd), a
/// stock rustls peer on the other.
async fn schedule(pair: &super::Pair, seed: u64, coverage: &mut Coverage) {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let mut dice = Dice(seed);
    let fail_one_in = [0, 0, 40, 400][dice.below(4) as usize];
    let ops = 5 + dice.below(40) as usize;
    let rekey_at = [None, Some(1), Some(3), Some(17)][dice.below(4) as usize];
    let socket = Scripted { inner: ours, dice, scripting: false, fail_one_in, failed: false, after_failure: 0 };
    let ((ours, sent), (received, clean)) = if seed.is_multiple_of(2) {
        let connector = tokio_rustls::TlsConnector::from(pair.client_config.clone());
        let (ours, theirs) = tokio::join!(
            handshake::accept(socket, pair.server_config.clone()),
            connector.connect(server_name(), theirs)
        );
        run(ours.unwrap().0, theirs.unwrap(), rekey_at, ops).await
    } else {
        let acceptor = tokio_rustls::TlsAcceptor::from(pair.server_config.clone());
        let (ours, theirs) = tokio::join!(
            handshake::connect(socket, pair.client_config.clone(), server_name()),
            acceptor.accept(theirs)
        );
        run(ours.unwrap(), theirs.unwrap(), rekey_at, ops).await
    };
    let sealed = take_sealed();
    let mut unique = sealed.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), sealed.len(), "seed {seed}: a (key, sequence number) was sealed twice");
    if sent.failed {
        assert_eq!(ours.tcp.after_failure, 0, "seed {seed}: bytes went to the socket after a failed write");
        let offered = [&sent.accepted[..], &sent.failed_write].concat();
        assert!(offered.starts_with(&received), "seed {seed}: the peer read what was never written");
    } else {
        assert!(clean, "seed {seed}: the peer saw no close_notify");
        assert_eq!(received.len(), sent.accepted.len(), "seed {seed}: all the bytes arrived");
        assert!(received == sent.accepted, "seed {seed}: the bytes arrived as written, in order");
    }
    let mut keys: Vec<_> = sealed.iter().map(|(iv, _)| *iv).collect();
    keys.dedup();
    coverage.schedules += 1;
    coverage.failed += u64::from(sent.failed);
    coverage.given_up += sent.given_up;
    coverage.rekeys += keys.len().saturating_sub(1);
    coverage.bytes += sent.accepted.len();
}

/// Runs our side's schedule on `ours` while the peer reads, then hangs up.
async fn run<P: AsyncRead + Unpin>(
    mut ours: TlsStream<Scripted>,
    mut peer: P,
    rekey_at: Option<u64>,
    ops: usize,
) -> ((TlsStream<Scripted>, Sent), (Vec<u8>, bool)) {
    take_sealed();
    ours.tcp.scripting = true;
    if let Some(records) = rekey_at {
        ours.tx.set_rekey_at(records);
    }
    let ours_then_hang_up = async {
        let sent = send(&mut ours, ops).await;
        // The peer sees the end of the stream (a hang-up after a failure).
        let _ = Pin::new(&mut ours.tcp.inner).poll_shutdown(&mut Context::from_waker(Waker::noop()));
        (ours, sent)
    };
    tokio::join!(ours_then_hang_up, receive(&mut peer))
}

#[tokio::test]
async fn no_nonce_is_used_twice_and_a_stock_rustls_peer_reads_every_accepted_byte_under_any_schedule() {
    let pair = pair().await;
    // More with TLS_SCHEDULES=N (the seeds 0..N; a failure names its seed).
    let seeds: u64 = std::env::var("TLS_SCHEDULES").ok().and_then(|n| n.parse().ok()).unwrap_or(1000);
    let mut coverage = Coverage::default();
    for seed in 0..seeds {
        schedule(&pair, seed, &mut coverage).await;
    }
    let Coverage { schedules, failed, given_up, rekeys, bytes } = coverage;
    eprintln!("{schedules} schedules: {failed} with a failed write, {given_up} writes given up, {rekeys} key updates, {bytes} bytes accepted");
    if seeds >= 1000 {
        assert!(failed >= 50 && schedules - failed >= 500, "{failed} of {schedules} schedules failed a write");
        assert!(given_up >= 200 && rekeys >= 500, "{given_up} given up, {rekeys} key updates");
    }
}
