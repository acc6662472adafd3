//! `usbwire bench`: throughput and latency per URB size, queue depth and
//! emulated RTT, each as a ratio to raw TCP over the same path (the matrix is
//! [`usbwire_bench::matrix`]; here its flags, progress bar and printing), and
//! `--periodic` and `--cuts`; with `--storage`, a disk through the attach
//! relay ([`storage`]); with `--registry`, the lab registry at scale instead
//! ([`lab`]).

mod lab;
mod progress;
mod storage;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::anyhow;
use serde_json::json;
use usbwire_bench::matrix::{self, Plan};
use usbwire_bench::measure::Payload;
use usbwire_bench::target::{local_loopback, open};
use usbwire_bench::{measure, plot, proxy};
use usbwire_client::{Security, TransformSpec};
use usbwire_proto::op::BusId;

use super::common::peer::transforms;
use super::common::stdout::{out, outln};
use crate::args::BenchArgs;
use crate::config::parse_size;
use crate::exit::Failure;
use progress::Bar;

/// The matrix the flags ask for: `--quick`'s or the full one, unless sizes and depths are named.
fn matrix_plan(args: &BenchArgs) -> Result<Plan, Failure> {
    let sizes = if args.sizes.is_empty() {
        if args.quick {
            vec![512, 64 << 10, 1 << 20]
        } else {
            vec![512, 2 << 10, 8 << 10, 64 << 10, 256 << 10, 1 << 20]
        }
    } else {
        args.sizes
            .iter()
            .map(|s| parse_size(s).map(|n| n as usize))
            .collect::<Result<_, _>>()
            .map_err(Failure::usage)?
    };
    let depths = if args.depths.is_empty() {
        if args.quick {
            vec![1, 8, 32]
        } else {
            vec![1, 2, 4, 8, 16, 32]
        }
    } else {
        args.depths.clone()
    };
    if sizes.iter().any(|&s| s == 0 || s > 16 << 20) || depths.iter().any(|&d| d == 0 || d > 1024) {
        return Err(Failure::usage(anyhow!("sizes must be 1 B..16 MiB and depths 1..1024")));
    }
    Ok(Plan {
        sizes,
        depths,
        rtts_ms: if args.rtt_ms.is_empty() { vec![0.0] } else { args.rtt_ms.clone() },
        jitter_ms: args.jitter_ms,
        seconds: args.seconds.unwrap_or(if args.quick { 0.1 } else { 0.5 }),
        repeat: args.repeat.unwrap_or(if args.quick { 1 } else { 3 }).max(1),
        transforms: transforms(args.compress.as_deref(), args.jitter_buffer),
        payload: if args.payload == "random" { Payload::Random } else { Payload::Constant },
        resume: args.resume,
    })
}

pub(crate) async fn run(args: BenchArgs) -> Result<(), Failure> {
    if args.registry.registry.is_some() {
        return lab::run(&args).await;
    }
    if args.storage {
        return storage::run(&args).await;
    }
    let plan = matrix_plan(&args)?;
    let security = super::common::peer::client_security(&args.security)?;
    let (target, busid) = match (&args.remote, &args.busid) {
        (Some(remote), Some(busid)) if !args.local => {
            let busid = BusId::new(busid).ok_or_else(|| Failure::usage(anyhow!("invalid bus id {busid:?}")))?;
            (super::common::peer::resolve(remote, None).await?, busid)
        }
        _ => local_loopback()?,
    };
    if let Some(endpoint) = args.periodic {
        return periodic(&plan, target, &busid, &security, endpoint, args.json).await;
    }
    if let Some(cuts) = args.cuts {
        let size = if args.sizes.is_empty() { 512 } else { plan.sizes[0] };
        let depth = if args.depths.is_empty() { 8 } else { plan.depths[0] };
        let endpoints = (args.in_ep, args.out_ep);
        return resume_time(&plan, target, &busid, &security, endpoints, (size, depth, cuts), args.json).await;
    }
    let endpoints = (args.in_ep, args.out_ep);
    let report = if !args.json && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        matrix::execute(&plan, target, &busid, &security, endpoints, Bar::new()).await?
    } else {
        matrix::execute(&plan, target, &busid, &security, endpoints, matrix::Quiet).await?
    };
    if let Some(dir) = &args.plot {
        let files = plot::write_all(dir, &report.records, &report.latencies)
            .map_err(|e| Failure::io(anyhow!("plots in {}: {e}", dir.display())))?;
        eprintln!("wrote {} charts to {}", files.len(), dir.display());
    }
    if let Some(path) = &args.csv {
        std::fs::write(path, report.csv()).map_err(|e| Failure::io(anyhow!("{}: {e}", path.display())))?;
    }
    if args.json {
        super::common::output::print_json(&report.json(), true)
    } else {
        out!("{}", report.table())
    }
}

/// `bench --periodic EP`: spacing of interrupt completions at the client
/// against the device's own, per emulated RTT, with the plan's jitter and transforms.
async fn periodic(
    plan: &Plan,
    target: SocketAddr,
    busid: &BusId,
    security: &Security,
    endpoint: u8,
    json: bool,
) -> Result<(), Failure> {
    let count = (plan.seconds * 1000.0 / 8.0).max(64.0) as usize;
    // The jitter buffer holds completions for up to its playout: the queue must cover that too.
    let playout_ms = plan
        .transforms
        .iter()
        .map(|t| if let TransformSpec::Jitter(playout) = t { playout.as_secs_f64() * 1000.0 } else { 0.0 })
        .sum::<f64>();
    // On a client thread of its own, like the throughput matrix: the reader and the
    // measuring task then share one thread, and a completion costs one wake-up, not two.
    let (plan_, busid_, security_) = (plan.clone(), busid.clone(), security.clone());
    let measured = move || async move {
        let (plan, busid, security) = (&plan_, &busid_, &security_);
        let mut results = Vec::new();
        for &rtt_ms in &plan.rtts_ms {
            let rtt = Duration::from_secs_f64(rtt_ms / 1000.0);
            let jitter = Duration::from_secs_f64(plan.jitter_ms / 1000.0);
            let addr = if rtt.is_zero() && jitter.is_zero() {
                target
            } else {
                proxy::start(target, rtt, jitter).await.map_err(|e| Failure::io(e.into()))?
            };
            let (conn, _) = open(addr, busid, security, &plan.transforms, plan.resume).await?;
            measure::prepare(&conn).await.map_err(|e| Failure::unavailable(anyhow!(e)))?;
            // Enough URBs queued to cover the RTT, the jitter and the playout (Eq. 2 with room to spare).
            let depth = ((rtt_ms + 2.0 * plan.jitter_ms + playout_ms) / 8.0).ceil() as usize + 4;
            let spacing = usbwire_bench::periodic::measure(&conn, endpoint, count, depth)
                .await
                .map_err(|e| Failure::unavailable(anyhow!("{busid} endpoint {endpoint:#04x}: {e}")))?;
            conn.close().await;
            results.push((rtt_ms, spacing));
        }
        Ok::<_, Failure>(results)
    };
    let results =
        usbwire_bench::client_thread("usbwire-bench", measured).await.map_err(|e| Failure::software(e.into()))??;
    let transforms = TransformSpec::list_text(&plan.transforms);
    if json {
        let records: Vec<_> = results
            .iter()
            .map(|(rtt_ms, s)| json!({ "rtt_ms": rtt_ms, "jitter_ms": plan.jitter_ms, "transforms": transforms, "spacing": s }))
            .collect();
        return super::common::output::print_json(&json!({ "periodic": records }), true);
    }
    outln!("periodic completions on {endpoint:#04x}, jitter up to {} ms, transforms [{transforms}]", plan.jitter_ms)?;
    outln!(
        "{:>7} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "rtt ms",
        "n",
        "device us",
        "err p50",
        "err p90",
        "err p99",
        "err max"
    )?;
    for (rtt_ms, s) in &results {
        outln!(
            "{rtt_ms:>7} {:>6} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>10.0}",
            s.completions,
            s.device_interval_us,
            s.error_us.p50,
            s.error_us.p90,
            s.error_us.p99,
            s.error_us.max
        )?;
    }
    Ok(())
}

/// `bench --resume --cuts N`: the stall each cut of the link causes a
/// resumable connection, through a proxy that also adds the plan's RTT and jitter.
async fn resume_time(
    plan: &Plan,
    target: SocketAddr,
    busid: &BusId,
    security: &Security,
    endpoints: (Option<u8>, Option<u8>),
    (size, depth, cuts): (usize, usize, usize),
    json: bool,
) -> Result<(), Failure> {
    if cuts == 0 {
        return Err(Failure::usage(anyhow!("--cuts must be at least 1")));
    }
    let rtt_ms = plan.rtts_ms[0];
    // On a client thread of its own, like the throughput matrix; the proxy runs there too.
    let (plan_, busid_, security_) = (plan.clone(), busid.clone(), security.clone());
    let measured = move || async move {
        let (plan, busid, security) = (&plan_, &busid_, &security_);
        let rtt = Duration::from_secs_f64(rtt_ms / 1000.0);
        let jitter = Duration::from_secs_f64(plan.jitter_ms / 1000.0);
        let proxy = proxy::Proxy::start(target, rtt, jitter).await.map_err(|e| Failure::io(e.into()))?;
        let (conn, _) = open(proxy.addr, busid, security, &plan.transforms, plan.resume).await?;
        let found = measure::prepare(&conn).await.map_err(|e| Failure::unavailable(anyhow!(e)))?;
        let endpoints = measure::Endpoints { source: endpoints.0.or(found.source), sink: endpoints.1.or(found.sink) };
        let times = usbwire_bench::resume_time::measure(&conn, &proxy, endpoints, size, depth, cuts)
            .await
            .map_err(|e| Failure::unavailable(anyhow!("{busid}: {e}")))?;
        conn.close().await;
        Ok::<_, Failure>(times)
    };
    let times =
        usbwire_bench::client_thread("usbwire-bench", measured).await.map_err(|e| Failure::software(e.into()))??;
    if json {
        let record = json!({
            "rtt_ms": rtt_ms,
            "jitter_ms": plan.jitter_ms,
            "transforms": TransformSpec::list_text(&plan.transforms),
            "urb_size": size,
            "depth": depth,
            "times": times,
        });
        return super::common::output::print_json(&json!({ "resume": record }), true);
    }
    outln!(
        "resume after {} cuts: {size} B URBs, {depth} in flight per bulk endpoint, rtt {rtt_ms} ms, {} URBs",
        times.cuts,
        times.urbs
    )?;
    outln!("{:<22} {:>6} {:>8} {:>8} {:>8} {:>8}", "ms from the cut to", "n", "p50", "p90", "p99", "max")?;
    for (what, p) in [("first URB completed", &times.stall_us), ("relay resumed", &times.resumed_us)] {
        outln!(
            "{what:<22} {:>6} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
            times.cuts,
            p.p50 / 1e3,
            p.p90 / 1e3,
            p.p99 / 1e3,
            p.max / 1e3
        )?;
    }
    Ok(())
}
