//! `usbwire bench --registry etcd://…`: the lab registry at scale. The run
//! itself (a simulated fleet in a prefix of its own, `PREFIX/bench-PID`,
//! and its phases) is `usbwire_bench::lab`; this takes the flags, shows
//! progress bars, deletes the run's prefix at the end and prints the report.

use std::sync::Mutex;

use anyhow::anyhow;
use serde_json::json;
use usbwire_bench::lab::{LabBenchError, Progress, Quiet, Scale};
use usbwire_lab::{Endpoint, Lab, LabError};

use crate::args::BenchArgs;
use crate::commands::common::registry::failure;
use crate::commands::common::stdout::{out, outln};
use crate::exit::Failure;

pub(super) async fn run(args: &BenchArgs) -> Result<(), Failure> {
    let scale = Scale {
        servers: args.servers.unwrap_or(100),
        devices_per_server: args.devices_per_server.unwrap_or(10),
        clients: args.clients.unwrap_or(100),
        keyboard_every: args.keyboard_every.unwrap_or(10),
    };
    let counts = [scale.devices_per_server, scale.clients, scale.keyboard_every];
    if scale.servers == 0 || counts.contains(&0) || scale.servers > 250 * 250 {
        return Err(Failure::usage(anyhow!(
            "--servers (1..62500), --devices-per-server, --clients and --keyboard-every must be at least 1"
        )));
    }
    let mut endpoint = crate::commands::common::registry::required(&args.registry)?;
    let base = endpoint.url.to_string();
    endpoint.url.prefix = format!("{}/bench-{}", endpoint.url.prefix, std::process::id());
    let progress = !args.json && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let bars = Bars(Mutex::new(None));
    let progress: &dyn Progress = if progress { &bars } else { &Quiet };
    let outcome = usbwire_bench::lab::run(&endpoint, scale, progress).await;
    let deleted = delete_prefix(&endpoint).await;
    let report = outcome.map_err(bench_failure)?;
    let deleted = deleted.map_err(|e| Failure::unavailable(anyhow!("deleting {}/: {e}", endpoint.url.prefix)))?;
    if args.json {
        let mut document = report.json();
        document["registry"] = json!(base);
        document["keys_deleted"] = json!(deleted);
        crate::commands::common::output::print_json(&document, true)
    } else {
        out!("{}", report.table(&base))?;
        outln!("deleted {deleted} keys under {}/", endpoint.url.prefix)
    }
}

/// Deletes everything under the run's prefix (what the leases have not taken yet); the number of keys.
async fn delete_prefix(endpoint: &Endpoint) -> Result<i64, LabError> {
    Lab::connect(endpoint.clone()).await?.delete_all().await
}

fn bench_failure(error: LabBenchError) -> Failure {
    match error {
        LabBenchError::Registry(error) => failure(error),
        LabBenchError::Unavailable(_) => Failure::unavailable(error.into()),
        _ => Failure::software(error.into()),
    }
}

/// A progress bar on stderr per stage.
struct Bars(Mutex<Option<indicatif::ProgressBar>>);

impl Bars {
    fn with(&self, action: impl FnOnce(&mut Option<indicatif::ProgressBar>)) {
        // A poisoned lock only means a bar update panicked: there is nothing to show then.
        if let Ok(mut bar) = self.0.lock() {
            action(&mut bar);
        }
    }
}

impl Progress for Bars {
    fn begin(&self, len: usize, message: &'static str) {
        let bar = indicatif::ProgressBar::new(len as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg} ({elapsed})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(message);
        self.with(|current| *current = Some(bar));
    }

    fn advance(&self) {
        self.with(|current| current.iter().for_each(|bar| bar.inc(1)));
    }

    fn finish(&self) {
        self.with(|current| current.take().iter().for_each(indicatif::ProgressBar::finish_and_clear));
    }
}
