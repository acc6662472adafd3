//! A fixed number of URBs through one userspace [`Connection`] to an
//! in-process server with a loopback device, IN then OUT: the client's URB
//! path for an instruction counter, where `usbwire bench`'s timed runs (and
//! their raw-TCP ceiling in the same process) would blur a per-URB figure.
//!
//! The client runs on this thread's single-threaded runtime, the server on a
//! thread of its own (`usbwire-server`), as in `usbwire bench --local`. Run it
//! twice with different counts under callgrind and divide the difference by
//! the difference in URBs (both directions):
//!
//! ```sh
//! cargo build --release --example urb_path_count -p usbwire-client
//! valgrind --tool=callgrind --separate-threads=yes \
//!     target/release/examples/urb_path_count 512 32 20000 [resume]
//! ```
//!
//! Prints the URBs moved and their rate; asserts nothing about speed.

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::{bail, Context as _};
use usbwire_bench::{measure, target};
use usbwire_client::{Connection, Security, Transfer};
use usbwire_proto::Direction;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |at: usize, what: &str| -> anyhow::Result<usize> {
        args.get(at)
            .with_context(|| format!("usage: urb_path_count SIZE DEPTH COUNT [resume] (missing {what})"))?
            .parse::<usize>()
            .with_context(|| format!("{what} must be a number"))
    };
    let (size, depth, count) = (number(0, "SIZE")?, number(1, "DEPTH")?, number(2, "COUNT")?);
    let resume = args.get(3).is_some_and(|mode| mode == "resume");
    let (addr, busid) = target::local_loopback()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let (conn, _) = target::open(addr, &busid, &Security::Plain, &[], resume).await?;
        let endpoints = measure::prepare(&conn).await.map_err(anyhow::Error::msg)?;
        let source = endpoints.source.context("the loopback device has no bulk IN endpoint")?;
        let sink = endpoints.sink.context("the loopback device has no bulk OUT endpoint")?;
        for (direction, endpoint) in [(Direction::In, source), (Direction::Out, sink)] {
            let started = Instant::now();
            run(&conn, endpoint, direction, size, depth, count).await?;
            let seconds = started.elapsed().as_secs_f64();
            println!(
                "{direction:?} {size} B x{depth}: {count} URBs in {seconds:.3} s ({:.0} URBs/s)",
                count as f64 / seconds
            );
        }
        conn.close().await;
        Ok(())
    })
}

/// Moves `count` URBs of `size` bytes on `endpoint`, `depth` in flight, as
/// `usbwire bench` does (one queue, topped up after each batch of completions).
async fn run(
    conn: &Connection,
    endpoint: u8,
    direction: Direction,
    size: usize,
    depth: usize,
    count: usize,
) -> anyhow::Result<()> {
    let payload = bytes::Bytes::from(vec![0xa5u8; size]);
    let mut queue = conn.queue();
    let mut in_flight: VecDeque<u32> = VecDeque::with_capacity(depth);
    let (mut submitted, mut done) = (0usize, 0usize);
    while done < count {
        while submitted < count && queue.pending() < depth {
            let transfer = match direction {
                Direction::In => Transfer::bulk_in(endpoint, size as u32),
                Direction::Out => Transfer::bulk_out(endpoint, payload.clone()),
            };
            in_flight.push_back(queue.submit(transfer)?);
            submitted += 1;
        }
        let Some(first) = queue.next_complete().await else { bail!("the queue ran dry at {done} of {count}") };
        let mut next = Some(first?);
        while let Some(ret) = next {
            if !ret.status.is_ok() || in_flight.pop_front() != Some(ret.seqnum) {
                bail!("URB {} came back out of order or failed: {}", ret.seqnum, ret.status);
            }
            done += 1;
            next = queue.try_next_complete();
        }
    }
    Ok(())
}
