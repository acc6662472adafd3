//! The arguments of the verbs that attach devices to this machine's kernel (vhci-hcd):
//! `attach`, `port`, `detach`, and `client`, which keeps `[[attach]]` rules attached.

use std::path::PathBuf;

use clap::Args;

use super::common::{bus_id, duration, ClientSecurityArgs, RegistryArgs};

#[derive(Args, Debug)]
pub(crate) struct AttachArgs {
    #[command(flatten)]
    pub(crate) security: ClientSecurityArgs,
    /// The server, HOST[:PORT].
    #[arg(
        short = 'r',
        long = "remote",
        value_name = "HOST[:PORT]",
        required_unless_present = "registry",
        conflicts_with = "registry"
    )]
    pub(crate) remote: Option<String>,
    /// Bus id of the device on the server.
    #[arg(short = 'b', long = "busid", value_parser = bus_id, required_unless_present = "registry", conflicts_with = "registry")]
    pub(crate) busid: Option<String>,
    /// Port, as `usbip --tcp-port` (when HOST has none).
    #[arg(long = "tcp-port", value_name = "PORT")]
    pub(crate) tcp_port: Option<u16>,
    /// Instead of -r/-b: take a free device matching --device in this lab registry, wherever it is.
    #[command(flatten)]
    pub(crate) registry: RegistryArgs,
    /// With --registry: which device (as `usbwire reserve --device`). A reservation of yours that
    /// matches (from `usbwire reserve --for`) is used first.
    #[arg(long, value_name = "SELECTOR", requires = "registry")]
    pub(crate) device: Option<String>,
    /// With --registry: detach and give the device back after this long (e.g. 1h).
    #[arg(long = "for", value_name = "DURATION", value_parser = duration, requires = "registry")]
    pub(crate) hold_for: Option<std::time::Duration>,
    /// With --registry: import from a server whose registry entry carries no TLS key, over plain
    /// USB/IP (refused otherwise: anyone who can write to the registry could have planted it). A
    /// server with a key in its entry is always reached over TLS, pinned to that key.
    #[arg(long, requires = "registry")]
    pub(crate) allow_plain: bool,
    /// Compress the stream (usbwire servers): zstd or lz4; the kernel gets it through a local relay.
    #[arg(long, value_name = "ALGO", value_parser = ["zstd", "lz4"])]
    pub(crate) compress: Option<String>,
    /// Re-time the device's completions to their original spacing, holding them up to MS (usbwire servers).
    #[arg(long, value_name = "MS")]
    pub(crate) jitter_buffer: Option<u64>,
    /// Do not ask a usbwire server to keep the session through a dropped connection: the kernel then
    /// gets the socket itself (plain USB/IP) and sees a disconnect when the link drops.
    #[arg(long)]
    pub(crate) no_resume: bool,
    /// A slow link (usbwire servers): `auto` answers the kernel's descriptor requests from the copy the
    /// server sends with the import, and pipelines each Bulk-Only mass-storage command so it costs one
    /// round trip instead of three; `off` asks for neither and relays every transfer as it comes.
    #[arg(long, value_name = "WHEN", value_parser = ["auto", "off"], default_value = "auto")]
    pub(crate) accelerate: String,
    /// Keep the relay (resume, TLS, transforms) in this process instead of in the background, for
    /// service managers; it ends when the port is detached.
    #[arg(long)]
    pub(crate) foreground: bool,
    /// Keep the attachment through re-enumerations: when the device comes back at the same bus id
    /// (a DFU board entering its bootloader, then its new firmware), with any VID:PID, attach it
    /// again, on the same port if free. Always relayed; `usbwire port` shows the count.
    #[arg(long)]
    pub(crate) follow: bool,
    /// Keep the device attached until stopped, as usbipd-win's `attach --auto-attach`: whenever the
    /// attachment is lost (the server restarts, the network goes, the device is unplugged or unbound
    /// on the server) attach it again once it is back, trying at most every 5 s, forever; a server
    /// that is not there yet is waited for too. Implies --follow (re-enumerations) and --foreground:
    /// Ctrl-C, SIGTERM or `usbwire detach -p PORT` detaches it and exits 0.
    #[arg(long, conflicts_with = "registry")]
    pub(crate) auto_attach: bool,
}

#[derive(Args, Debug)]
pub(crate) struct PortArgs {
    /// Machine-readable output: one JSON document with `schema_version` (docs/json.md).
    #[arg(long)]
    pub(crate) json: bool,
    /// Each relayed port's counters in the Prometheus text format, for node_exporter's textfile
    /// collector: the relay's state and what the storage accelerator did (commands pipelined,
    /// read-ahead hits, bytes read ahead and wasted).
    #[arg(long, conflicts_with = "json")]
    pub(crate) prometheus: bool,
}

#[derive(Args, Debug)]
pub(crate) struct DetachArgs {
    /// The vhci port (see `usbwire port`).
    #[arg(short = 'p', long = "port")]
    pub(crate) port: u32,
}

#[derive(Args, Debug)]
pub(crate) struct ClientArgs {
    /// TOML file with `[[attach]]` rules (server, device selector, other identities, tls); SIGHUP re-reads it.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: PathBuf,
}
