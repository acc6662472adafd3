//! The arguments of `bench`: the throughput matrix, the resume cuts, periodic spacing, mass
//! storage through the attach relay and the lab registry at scale.

use std::path::PathBuf;

use clap::Args;

use super::common::{bus_id, ClientSecurityArgs, RegistryArgs};

#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    /// Bench a device on this server instead of an in-process loopback device.
    #[arg(short = 'r', long = "remote", value_name = "HOST[:PORT]", requires = "busid")]
    pub(crate) remote: Option<String>,
    /// Bus id of the device on the server (it needs a bulk IN source and/or a bulk OUT sink).
    #[arg(short = 'b', long = "busid", value_parser = bus_id)]
    pub(crate) busid: Option<String>,
    /// Bench an in-process server with a loopback device (what you get without -r).
    #[arg(long, conflicts_with = "remote")]
    pub(crate) local: bool,
    /// Bulk IN endpoint to read from [default: the first bulk IN].
    #[arg(long, value_name = "ADDR", value_parser = parse_endpoint)]
    pub(crate) in_ep: Option<u8>,
    /// Bulk OUT endpoint to write to [default: the first bulk OUT].
    #[arg(long, value_name = "ADDR", value_parser = parse_endpoint)]
    pub(crate) out_ep: Option<u8>,
    /// A small matrix (512 B, 64 KiB, 1 MiB x depths 1, 8, 32; 0.1 s a point) for a first look.
    #[arg(long)]
    pub(crate) quick: bool,
    /// URB sizes in bytes [default: 512 2K 8K 64K 256K 1M].
    #[arg(long, value_delimiter = ',', value_name = "BYTES")]
    pub(crate) sizes: Vec<String>,
    /// Queue depths [default: 1,2,4,8,16,32].
    #[arg(long, value_delimiter = ',', value_name = "N")]
    pub(crate) depths: Vec<usize>,
    /// Emulated round-trip times in ms, each a run of the matrix behind the delay proxy [default: 0].
    #[arg(long, value_delimiter = ',', value_name = "MS")]
    pub(crate) rtt_ms: Vec<f64>,
    /// Random extra delay per direction, up to this many ms (never reordering).
    #[arg(long, default_value_t = 0.0, value_name = "MS")]
    pub(crate) jitter_ms: f64,
    /// Seconds per run of a measured point.
    #[arg(long, value_name = "S")]
    pub(crate) seconds: Option<f64>,
    /// Runs per point, alternating with the ceiling; the median is reported [default: 3, --quick 1].
    #[arg(long, value_name = "N")]
    pub(crate) repeat: Option<usize>,
    /// Print one JSON document: `records` (one per measured point, with the runs behind its median)
    /// and `model` (the fit per direction and RTT).
    #[arg(long)]
    pub(crate) json: bool,
    /// Write PNG charts into DIR: throughput vs URB size per direction and RTT, latency CDF.
    #[arg(long, value_name = "DIR")]
    pub(crate) plot: Option<PathBuf>,
    /// Also write the records as CSV.
    #[arg(long, value_name = "FILE")]
    pub(crate) csv: Option<PathBuf>,
    /// Compress the stream (usbwire servers): zstd or lz4. Frames that do not shrink travel as they are.
    #[arg(long, value_name = "ALGO", value_parser = ["zstd", "lz4"])]
    pub(crate) compress: Option<String>,
    /// Re-time what the server sends to its original spacing, holding it up to MS (usbwire servers).
    #[arg(long, value_name = "MS")]
    pub(crate) jitter_buffer: Option<u64>,
    /// What OUT URBs carry: `constant` (compresses to nothing) or `random` (does not compress).
    #[arg(long, value_name = "KIND", default_value = "constant", value_parser = ["constant", "random"])]
    pub(crate) payload: String,
    /// Import resumably (usbwire servers), as `usbwire attach` and the userspace client do: the
    /// URBs go through the resuming relay, so this measures what resume costs.
    #[arg(long)]
    pub(crate) resume: bool,
    /// With --resume, instead of the throughput matrix: cut the link N times [default: 50] at random
    /// moments of a URB stream (the first --sizes, default 512 B; the first --depths, default 8, on the
    /// bulk source and sink) and report the stall from each cut to the first URB completing after the resume.
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "50", requires = "resume", conflicts_with = "periodic")]
    pub(crate) cuts: Option<usize>,
    /// Instead of the throughput matrix, measure the spacing of periodic completions on this
    /// interrupt IN endpoint (the loopback device's 0x84 stamps its own time) against the device's.
    #[arg(long, value_name = "ADDR", value_parser = parse_endpoint)]
    pub(crate) periodic: Option<u8>,
    /// Instead of the throughput matrix: sequential 120 KiB READ(10)s, then WRITE(10)s, one command at
    /// a time as usb-storage sends them, through the relay `usbwire attach` runs, its storage
    /// accelerator off and then on, per --rtt-ms (behind the delay proxy), --seconds each [default: 3].
    /// Against an in-process 64 MiB virtual disk, or with -r/-b a server's disk, WHOSE CONTENTS ARE
    /// OVERWRITTEN.
    #[arg(long, conflicts_with_all = ["periodic", "cuts", "resume", "quick", "plot", "csv", "compress", "jitter_buffer"])]
    pub(crate) storage: bool,
    #[command(flatten)]
    pub(crate) security: ClientSecurityArgs,
    /// With --registry, instead of the throughput matrix: bench the lab registry with a simulated
    /// fleet of this many in-process servers (each with its own etcd connection) [default: 100].
    #[arg(long, value_name = "N", requires = "registry")]
    pub(crate) servers: Option<usize>,
    /// With --registry: virtual devices per simulated server; every 10th is labelled `nucleo` [default: 10].
    #[arg(long, value_name = "M", requires = "registry")]
    pub(crate) devices_per_server: Option<usize>,
    /// With --registry: every Nth device of the fleet is a keyboard (1209:0001), the others loopback
    /// devices [default: 10]. At 2 no VID:PID or class is held by more than half of a server's
    /// devices, so each device is written to a catalog of each (the catalogs' worst case).
    #[arg(long, value_name = "N", requires = "registry")]
    pub(crate) keyboard_every: Option<usize>,
    /// With --registry: clients reserving `label=nucleo` at once, each with its own etcd connection [default: 100].
    #[arg(long, value_name = "K", requires = "registry")]
    pub(crate) clients: Option<usize>,
    /// With --registry: the etcd cluster to bench (a prefix of its own under PREFIX, deleted afterwards).
    #[command(flatten)]
    pub(crate) registry: RegistryArgs,
}

fn parse_endpoint(text: &str) -> Result<u8, String> {
    let value = match text.strip_prefix("0x") {
        Some(hex) => u8::from_str_radix(hex, 16),
        None => text.parse(),
    };
    value.map_err(|_| format!("{text:?} is not an endpoint address (e.g. 0x81)"))
}
