//! Mass-storage rates through the kernel relay (`usbwire bench --storage`):
//! a [`Host`] plays vhci-hcd and usb-storage on one end of a socket pair,
//! the relay (`usbwire_client::kernel_relay`) carries its URBs through the
//! delay proxy (straight at 0 ms, as in the matrix) to the server, and
//! sequential 120 KiB READ(10)s, then WRITE(10)s, run one command at a time
//! for a few seconds, with the relay's storage accelerator off and then on,
//! per emulated RTT. It owns the runs, their records and their [`table`]; the
//! flags, the JSON and the printing are the CLI's, the host is
//! [`crate::storage`]'s.
//!
//! Benchmarks are not tests: nothing here asserts on the rates. A run writes
//! over the disk it measures.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::net::UnixStream;
use usbwire_client::relay::Upstream;
use usbwire_client::{kernel_relay, Security, RESUME_GIVE_UP};
use usbwire_proto::op::BusId;

use crate::matrix::Progress;
use crate::proxy::Proxy;
use crate::storage::{Host, Wire};
use crate::{BenchError, Direction};

/// Blocks per command: usb-storage's `max_sectors` (240 × 512 B = 120 KiB).
pub const BLOCKS_PER_COMMAND: u16 = 240;

/// What to measure.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Emulated round-trip times, each behind the delay proxy.
    pub rtts_ms: Vec<f64>,
    /// How long each direction runs, per RTT and accelerator setting (at least one command).
    pub seconds: f64,
}

/// One measured run: a direction at an RTT, the accelerator off or on.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    pub rtt_ms: f64,
    /// `in`: READ(10); `out`: WRITE(10).
    pub direction: Direction,
    /// The accelerator was asked for.
    pub accelerate: bool,
    /// It was asked for and the server agreed to the storage extension.
    pub accelerated: bool,
    /// Bytes each command moves.
    pub command_bytes: u64,
    pub commands: u64,
    pub seconds: f64,
    pub mib_per_s: f64,
    pub ms_per_command: f64,
}

/// Runs the plan against the disk `busid` on `target`, on a client thread of
/// its own (see [`crate::client_thread`]): per RTT, accelerator off then on,
/// each a fresh import through the proxy. Records in that order, reads before writes.
pub async fn execute(
    plan: &Plan,
    target: SocketAddr,
    busid: &BusId,
    security: &Security,
    progress: impl Progress + 'static,
) -> Result<Vec<Record>, BenchError> {
    let (plan, busid, security) = (plan.clone(), busid.clone(), security.clone());
    let runs = move || async move {
        progress.begin(plan.rtts_ms.len() * 2);
        let mut records = Vec::new();
        for &rtt_ms in &plan.rtts_ms {
            let rtt = Duration::from_secs_f64(rtt_ms / 1000.0);
            // No proxy at 0 ms, as in the matrix: its timer rounds each release up to the
            // next millisecond, which would be most of what a command costs on loopback.
            let proxy = if rtt.is_zero() { None } else { Some(Proxy::start(target, rtt, Duration::ZERO).await?) };
            let addr = proxy.as_ref().map_or(target, |proxy| proxy.addr);
            for accelerate in [false, true] {
                progress.point(format!("rtt {rtt_ms} ms, accelerator {}", if accelerate { "on" } else { "off" }));
                let run = Run { addr, busid: &busid, security: &security, rtt_ms, accelerate };
                records.extend(run.measure(plan.seconds).await?);
                progress.advance(1);
            }
        }
        progress.finish();
        Ok(records)
    };
    crate::client_thread("usbwire-bench", runs).await.map_err(|e| BenchError::Internal(e.into()))?
}

/// The records as a table: per RTT, MiB/s with the accelerator off and on
/// and their ratio, for reads and writes, then milliseconds per command.
pub fn table(records: &[Record]) -> String {
    let mut text = format!(
        "{:>7} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6} | {:>13} {:>13}\n",
        "rtt ms", "read off", "read on", "x", "write off", "write on", "x", "ms/rd off/on", "ms/wr off/on"
    );
    let mut rtts: Vec<f64> = Vec::new();
    for record in records {
        if !rtts.contains(&record.rtt_ms) {
            rtts.push(record.rtt_ms);
        }
    }
    for rtt_ms in rtts {
        let find = |direction, accelerate| {
            records.iter().find(|r| r.rtt_ms == rtt_ms && r.direction == direction && r.accelerate == accelerate)
        };
        let mut row = format!("{rtt_ms:>7} |");
        let mut times = String::new();
        for direction in [Direction::In, Direction::Out] {
            let (off, on) = (find(direction, false), find(direction, true));
            let rate = |r: Option<&Record>| r.map_or("-".into(), |r| format!("{:.1}", r.mib_per_s));
            let ratio = match (off, on) {
                (Some(off), Some(on)) if off.mib_per_s > 0.0 => format!("{:.2}", on.mib_per_s / off.mib_per_s),
                _ => "-".into(),
            };
            let _ = write!(row, " {:>9} {:>9} {:>6} |", rate(off), rate(on), ratio);
            let ms = |r: Option<&Record>| r.map_or("-".into(), |r| format!("{:.2}", r.ms_per_command));
            let _ = write!(times, " {:>13}", format!("{}/{}", ms(off), ms(on)));
        }
        let _ = writeln!(text, "{row}{times}");
    }
    text
}

/// One import through the proxy, with the accelerator asked for or not.
struct Run<'a> {
    addr: SocketAddr,
    busid: &'a BusId,
    security: &'a Security,
    rtt_ms: f64,
    accelerate: bool,
}

impl Run<'_> {
    /// Imports, relays as `usbwire attach` does, reads then writes for
    /// `seconds` each, detaches (closes the kernel's end) and waits for the relay to end.
    async fn measure(&self, seconds: f64) -> Result<[Record; 2], BenchError> {
        let imported = usbwire_client::import_resumable(self.addr, self.busid, self.security, &[]).await?;
        let accelerated = self.accelerate && imported.storage;
        let devid = imported.device.devid();
        let upstream = Upstream {
            addr: self.addr,
            security: self.security.clone(),
            transforms: vec![],
            resume: imported.resume,
            give_up_after: RESUME_GIVE_UP,
            storage: accelerated,
            descriptors: imported.descriptors.filter(|_| accelerated),
        };
        let (kernel, relay_end) = UnixStream::pair()?;
        let relay = kernel_relay::run(relay_end, imported.stream, devid, upstream, None, None);
        let host = async move {
            let mut host = Host::new(kernel, devid);
            let rates = self.rates(&mut host, seconds).await;
            // Closing the kernel's end is a detach: the relay ends with `Ok`.
            drop(host);
            rates
        };
        let (relayed, rates) = tokio::join!(relay, host);
        // A relay that failed closed the host's socket: its reason comes first.
        relayed.map_err(|e| BenchError::Unavailable(format!("{}: the relay ended: {e}", self.busid)))?;
        let [read, write] = rates?;
        Ok([self.record(Direction::In, accelerated, read), self.record(Direction::Out, accelerated, write)])
    }

    /// Enumerates, then the reads and the writes: what each moved, in how long.
    async fn rates(&self, host: &mut Host<Wire<UnixStream>>, seconds: f64) -> Result<[Moved; 2], BenchError> {
        let failed = |what: &str, e: crate::storage::HostError| {
            BenchError::Unavailable(format!("{} (rtt {} ms): {what}: {e}", self.busid, self.rtt_ms))
        };
        host.enumerate().await.map_err(|e| failed("enumerating", e))?;
        host.inquiry().await.map_err(|e| failed("INQUIRY", e))?;
        let (last_lba, block_len) = host.read_capacity().await.map_err(|e| failed("READ CAPACITY", e))?;
        let blocks = u64::from(last_lba) + 1;
        let per_command = u64::from(BLOCKS_PER_COMMAND);
        if blocks < per_command {
            return Err(BenchError::Unavailable(format!(
                "{}: the disk has {blocks} blocks, fewer than one command's {per_command}",
                self.busid
            )));
        }
        let limit = Duration::from_secs_f64(seconds);
        let command_bytes = per_command * u64::from(block_len);
        let pattern: Vec<u8> = (0..command_bytes).map(|i| (i % 251) as u8).collect();
        let mut moved = [Moved { command_bytes, commands: 0, elapsed: Duration::ZERO }; 2];
        for (direction, moved) in moved.iter_mut().enumerate() {
            let (started, mut lba) = (Instant::now(), 0u64);
            loop {
                if lba + per_command > blocks {
                    lba = 0;
                }
                // `lba` < `blocks` ≤ 2^32 (READ CAPACITY(10)'s last LBA is a u32).
                let at = lba as u32;
                if direction == 0 {
                    host.read10(at, BLOCKS_PER_COMMAND).await.map_err(|e| failed(&format!("READ(10) at {at}"), e))?;
                } else {
                    host.write10(at, &pattern).await.map_err(|e| failed(&format!("WRITE(10) at {at}"), e))?;
                }
                lba += per_command;
                moved.commands += 1;
                moved.elapsed = started.elapsed();
                if moved.elapsed >= limit {
                    break;
                }
            }
        }
        Ok(moved)
    }

    fn record(&self, direction: Direction, accelerated: bool, moved: Moved) -> Record {
        let seconds = moved.elapsed.as_secs_f64().max(f64::MIN_POSITIVE);
        let bytes = moved.commands as f64 * moved.command_bytes as f64;
        Record {
            rtt_ms: self.rtt_ms,
            direction,
            accelerate: self.accelerate,
            accelerated,
            command_bytes: moved.command_bytes,
            commands: moved.commands,
            seconds,
            mib_per_s: bytes / seconds / f64::from(1 << 20),
            ms_per_command: seconds * 1000.0 / moved.commands.max(1) as f64,
        }
    }
}

/// What one direction moved.
#[derive(Clone, Copy, Debug)]
struct Moved {
    command_bytes: u64,
    commands: u64,
    elapsed: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(rtt_ms: f64, direction: Direction, accelerate: bool, mib_per_s: f64) -> Record {
        Record {
            rtt_ms,
            direction,
            accelerate,
            accelerated: accelerate,
            command_bytes: 120 << 10,
            commands: 10,
            seconds: 1.0,
            mib_per_s,
            ms_per_command: 100.0,
        }
    }

    #[test]
    fn the_table_has_a_row_per_rtt_with_the_ratio_of_on_to_off() {
        let records = [
            record(10.0, Direction::In, false, 4.0),
            record(10.0, Direction::Out, false, 2.0),
            record(10.0, Direction::In, true, 8.0),
            record(10.0, Direction::Out, true, 5.0),
        ];
        let text = table(&records);
        let row = text.lines().nth(1).unwrap_or_default();
        assert!(row.contains(" 2.00 ") && row.contains(" 2.50 "), "{text}");
        assert_eq!(text.lines().count(), 2, "{text}");
    }
}
