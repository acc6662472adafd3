//! `bench --storage`: a disk's sequential READ(10) and WRITE(10) rates
//! through the attach relay, its storage accelerator off and on, per emulated
//! RTT (the runs are [`usbwire_bench::storage_rate`]'s; here the flags, the
//! in-process disk's lifetime, the progress bar and the printing).

use anyhow::anyhow;
use serde_json::json;
use usbwire_bench::matrix;
use usbwire_bench::storage_rate::{self, Plan, BLOCKS_PER_COMMAND};
use usbwire_bench::target::local_disk;
use usbwire_proto::op::BusId;

use super::progress::Bar;
use crate::args::BenchArgs;
use crate::commands::common::output::print_json;
use crate::commands::common::peer::{client_security, resolve};
use crate::commands::common::stdout::{out, outln};
use crate::exit::Failure;

/// The in-process disk's size (what `usbwire demo` serves).
const LOCAL_DISK_BYTES: u64 = 64 << 20;
/// Seconds per direction, RTT and accelerator setting without --seconds.
const DEFAULT_SECONDS: f64 = 3.0;

pub(super) async fn run(args: &BenchArgs) -> Result<(), Failure> {
    let plan = plan(args)?;
    let security = client_security(&args.security)?;
    // Without -r: a disk of our own, its image removed when `local` is dropped at the end.
    let local;
    let (target, busid) = match (&args.remote, &args.busid) {
        (Some(remote), Some(busid)) if !args.local => {
            let busid = BusId::new(busid).ok_or_else(|| Failure::usage(anyhow!("invalid bus id {busid:?}")))?;
            (resolve(remote, None).await?, busid)
        }
        _ => {
            local = local_disk(LOCAL_DISK_BYTES)?;
            (local.addr, local.busid.clone())
        }
    };
    let records = if !args.json && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        storage_rate::execute(&plan, target, &busid, &security, Bar::new()).await?
    } else {
        storage_rate::execute(&plan, target, &busid, &security, matrix::Quiet).await?
    };
    if records.iter().any(|r| r.accelerate && !r.accelerated) {
        eprintln!("the server did not agree to the storage extension: the accelerator's runs went unaccelerated");
    }
    if args.json {
        return print_json(&json!({ "storage": records }), true);
    }
    outln!(
        "storage {busid}: sequential {} KiB READ(10) and WRITE(10), one command at a time, {} s each, MiB/s \
         with the accelerator off and on",
        u32::from(BLOCKS_PER_COMMAND) / 2,
        plan.seconds
    )?;
    out!("{}", storage_rate::table(&records))
}

/// The runs the flags ask for.
fn plan(args: &BenchArgs) -> Result<Plan, Failure> {
    let seconds = args.seconds.unwrap_or(DEFAULT_SECONDS);
    if !(0.0..=3600.0).contains(&seconds) {
        return Err(Failure::usage(anyhow!("--seconds must be 0..3600 (0: one command each)")));
    }
    let rtts_ms = if args.rtt_ms.is_empty() { vec![0.0] } else { args.rtt_ms.clone() };
    if rtts_ms.iter().any(|rtt| !(0.0..=10_000.0).contains(rtt)) {
        return Err(Failure::usage(anyhow!("--rtt-ms values must be 0..10000")));
    }
    Ok(Plan { rtts_ms, seconds })
}
