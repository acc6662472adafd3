//! The arguments of the verbs that run a server: `serve` and `demo`.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;

use super::common::{listen_address, ControlArgs, RegistryArgs};

#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// Address (or host name) and port to listen on; without a port, 3240 [default: 0.0.0.0:3240].
    #[arg(long, value_name = "ADDR[:PORT]", value_parser = listen_address)]
    pub(crate) listen: Option<SocketAddr>,
    /// TOML configuration file (flags override it).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Require TLS 1.3 with client certificates (plain USB/IP then only from loopback, see --allow-plain).
    #[arg(long)]
    pub(crate) tls: bool,
    /// Server identity directory [default: /etc/usbwire for root, else ~/.config/usbwire]; created if missing.
    #[arg(long, value_name = "DIR")]
    pub(crate) identity: Option<PathBuf>,
    /// With --tls: accept plain USB/IP from `never`, `loopback` (default) or `always`. A plain client then
    /// sees only the devices `[[allow]] client = "plain"` rules give it.
    #[arg(long, value_name = "WHO")]
    pub(crate) allow_plain: Option<String>,
    /// With --tls: let the client with this fingerprint (or `ca:NAME`, issued by --ca) use every device
    /// (repeatable; finer rules go in --config).
    #[arg(long = "allow", value_name = "FINGERPRINT")]
    pub(crate) allow: Vec<String>,
    /// Let `--allow '*'` (or `[[allow]] client = "*"`) admit any client key at all, self-made ones included:
    /// anyone who reaches the port. Refused without this flag.
    #[arg(long)]
    pub(crate) allow_any_client: bool,
    /// With --tls: trust client identities issued by this private CA (its directory or ca.crt).
    #[arg(long = "ca", value_name = "PATH")]
    pub(crate) ca: Option<PathBuf>,
    /// A virtual device: keyboard, mouse, disk=PATH[,size=64M][,ro][,speed=super], serial[=LINK], loopback[,speed=super], dfu=FILE[,size=1M], external=unix:PATH (a device served by a process connected there), replay=FILE[,mode=strict|lenient][,timing=asap|recorded][,report=PATH] (a device recorded by --capture, served back). Repeatable.
    #[arg(long = "virtual", value_name = "SPEC")]
    pub(crate) virtual_devices: Vec<String>,
    /// Do not announce this server with mDNS/DNS-SD (`_usbip._tcp`).
    #[arg(long)]
    pub(crate) no_advertise: bool,
    /// Export real USB devices of this machine matching a bus id (1-1.2), VID:PID, serial=TEXT or class=HEX,
    /// now and whenever one is plugged in. Repeatable.
    #[arg(long = "bind", value_name = "SELECTOR")]
    pub(crate) bind: Vec<String>,
    /// Offer a device of this server to QEMU guests through usbredir: QEMU's usb-redir chardev
    /// connects to a Unix socket only this user may open (unix:/run/usbwire/redir.sock=0-2: the second
    /// --virtual device; a real one by its bus id, VID:PID, serial=TEXT or class=HEX, as --bind), or to
    /// ADDR:PORT with --redir-tcp-unauthenticated. Repeatable; like `usbwire redir --listen`.
    #[arg(long = "redir", value_name = "unix:PATH=SELECTOR")]
    pub(crate) redir: Vec<String>,
    /// Let --redir listen on TCP: usbredir has no authentication, so anyone who reaches the port gets
    /// the device. Refused on a server with --allow-plain never.
    #[arg(long)]
    pub(crate) redir_tcp_unauthenticated: bool,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics: per device URBs, bytes and errors,
    /// in-flight depth, holder, imports, resumes; connections and refusals.
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) metrics: Option<SocketAddr>,
    /// Serve a status page at http://ADDR:PORT/: devices, state, holders, live throughput per
    /// device, and /metrics beside it. Plain HTTP: bind it to loopback or a management network.
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) http: Option<SocketAddr>,
    /// Capture every import's URBs into DIR, one pcapng file per import (Linux usbmon format, for
    /// Wireshark/tshark; TLS sessions too). Files rotate at 64 MiB, keeping the previous as NAME.1.
    #[arg(long, value_name = "DIR")]
    pub(crate) capture: Option<PathBuf>,
    /// Keep `usbwire bind`s here across restarts [default: beside --config, FILE.binds; else
    /// /var/lib/usbwire/binds for root, $XDG_STATE_HOME/usbwire/binds (~/.local/state) for others].
    #[arg(long, value_name = "FILE")]
    pub(crate) bind_state: Option<PathBuf>,
    /// Keep an import whose connection dropped this long for a usbwire client to resume it (URBs in
    /// flight finish, their completions are held); 0 turns resume off [default: 30].
    #[arg(long, value_name = "SECS")]
    pub(crate) resume_grace: Option<u64>,
    #[command(flatten)]
    pub(crate) registry: RegistryArgs,
    /// The address clients import from, as published in the lab registry [default: --listen, or
    /// this machine's host name when listening on every address].
    #[arg(long, value_name = "HOST:PORT", requires = "registry")]
    pub(crate) registry_address: Option<String>,
    #[command(flatten)]
    pub(crate) control: ControlArgs,
}

#[derive(Args, Debug)]
pub(crate) struct DemoArgs {
    /// Address (or host name) to serve on; without a port, 3240.
    #[arg(long, default_value = "127.0.0.1:3240", value_name = "ADDR[:PORT]", value_parser = listen_address)]
    pub(crate) listen: SocketAddr,
    /// Directory for the demo's disk image and serial link [default: a per-user directory under /tmp].
    #[arg(long, value_name = "DIR")]
    pub(crate) dir: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) control: ControlArgs,
}
