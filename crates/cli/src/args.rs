//! The command line, as clap sees it. Verbs a `usbip` user knows keep their
//! names and flags (`list -r`, `--tcp-port`); ours are added beside them.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// `--listen`: `ADDR:PORT`, `ADDR` (port 3240), `HOST:PORT` or `HOST` (the
/// name's first address; `localhost` is always 127.0.0.1, as RFC 6761 has it).
fn listen_address(text: &str) -> Result<SocketAddr, String> {
    use std::net::{IpAddr, ToSocketAddrs as _};
    let port = usbwire_proto::DEFAULT_PORT;
    if let Ok(addr) = text.parse::<SocketAddr>() {
        return Ok(addr);
    }
    if let Ok(ip) = text.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    // A localhost name is this machine's loopback, resolver or not (RFC 6761).
    match text.rsplit_once(':') {
        Some((host, p)) if usbwire_client::is_localhost(host) => {
            let port = p.parse::<u16>().map_err(|_| format!("{p:?} is not a port"))?;
            return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
        }
        None if usbwire_client::is_localhost(text) => return Ok(SocketAddr::from(([127, 0, 0, 1], port))),
        _ => {}
    }
    let resolved = match text.rsplit_once(':') {
        Some((host, p)) if p.parse::<u16>().is_ok() => text.to_socket_addrs().map_err(|e| (host.to_owned(), e)),
        _ => (text, port).to_socket_addrs().map_err(|e| (text.to_owned(), e)),
    };
    match resolved {
        Ok(mut addrs) => addrs.next().ok_or_else(|| format!("{text:?} has no address")),
        Err((host, error)) => Err(format!("{host:?} is not an address or a host name this machine resolves ({error})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_takes_addresses_host_names_and_a_default_port() {
        assert_eq!(listen_address("127.0.0.1:4000"), Ok("127.0.0.1:4000".parse().unwrap()));
        assert_eq!(listen_address("127.0.0.1"), Ok("127.0.0.1:3240".parse().unwrap()));
        assert_eq!(listen_address("::1"), Ok("[::1]:3240".parse().unwrap()));
        assert_eq!(listen_address("[::1]"), Ok("[::1]:3240".parse().unwrap()));
        assert!(listen_address("localhost:4000").is_ok_and(|a| a.port() == 4000 && a.ip().is_loopback()));
        assert!(listen_address("localhost").is_ok_and(|a| a.port() == 3240 && a.ip().is_loopback()));
        assert_eq!(listen_address("LocalHost.:7"), Ok("127.0.0.1:7".parse().unwrap()));
        assert!(listen_address("localhost:x").is_err());
        let error = listen_address("no-such-host.invalid:1").unwrap_err();
        assert!(error.contains("not an address or a host name"), "{error}");
    }
}

/// The version and the commit it was built from (`build.rs`; "unknown" outside a git checkout).
pub(crate) const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("USBWIRE_COMMIT"), ")");

/// The command line with the manual's text (examples; on the program's own
/// help also exit status, environment, files) after each verb's options.
pub(crate) fn command() -> clap::Command {
    use clap::CommandFactory as _;
    let command = Cli::command().after_long_help(crate::manual::after_help(None));
    let verbs: Vec<String> = command.get_subcommands().map(|sub| sub.get_name().to_owned()).collect();
    verbs.iter().fold(command, |command, verb| {
        command.mut_subcommand(verb, |sub| sub.after_long_help(crate::manual::after_help(Some(verb))))
    })
}

#[derive(Parser, Debug)]
#[command(
    name = "usbwire",
    version = crate::commands::version_text(),
    about = "Share USB devices over IP (USB/IP compatible)"
)]
pub(crate) struct Cli {
    /// More log output (-v debug, -vv trace). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub(crate) verbose: u8,
    /// Only warnings and errors.
    #[arg(short, long, global = true)]
    pub(crate) quiet: bool,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Export devices over USB/IP (TCP port 3240 by default).
    Serve(ServeArgs),
    /// List the devices a server exports.
    List(ListArgs),
    /// Import a remote device, print its descriptors (like `lsusb -v`), then release it.
    Describe(DescribeArgs),
    /// Measure throughput and latency against the raw-TCP ceiling of the same path (local loopback device by default).
    Bench(BenchArgs),
    /// Attach a remote device to this machine's kernel (vhci-hcd), like `usbip attach`.
    Attach(AttachArgs),
    /// Show the ports of vhci-hcd and what is attached to them, like `usbip port`.
    Port(PortArgs),
    /// Detach a vhci-hcd port, like `usbip detach`.
    Detach(DetachArgs),
    /// Show (or create) this machine's TLS identity and its fingerprint.
    Identity(IdentityArgs),
    /// Type text on the virtual keyboard of the server running on this machine.
    Type(TypeArgs),
    /// Show the exported devices of the server running on this machine and who holds them.
    State(StateArgs),
    /// Keep the devices named by `[[attach]]` rules attached to this kernel, attaching again after any drop.
    Client(ClientArgs),
    /// Check this machine's setup (vhci-hcd, usbfs access, local server, a remote server's port and TLS) and say what to fix.
    Doctor(DoctorArgs),
    /// Export a real USB device of this machine through the running server, like `usbip bind`
    /// (--device VID:PID: every matching device, kept across restarts, like usbipd-win's --hardware-id).
    Bind(BindArgs),
    /// Stop exporting a real device and give it back to its kernel drivers, like `usbip unbind`.
    Unbind(UnbindArgs),
    /// Start a server with a keyboard, a 64 MiB disk and a serial port on loopback, and show what to do next.
    Demo(DemoArgs),
    /// Offer a remote device to a QEMU/KVM guest through usbredir (QEMU's usb-redir device).
    Redir(RedirArgs),
    /// Start or stop capturing the running server's imports into pcapng files (usbmon, for Wireshark).
    Capture(CaptureArgs),
    /// Take a free device matching a selector in the lab registry, for a while or until Ctrl-C.
    Reserve(ReserveArgs),
    /// Give back a device reserved in the lab registry.
    Release(ReleaseArgs),
    /// Show who holds which device in the lab registry.
    Who(WhoArgs),
    /// Print udev rules that give the server's group the real devices its [[bind]] rules name, and no others.
    UdevRules(UdevRulesArgs),
    /// Print the shell completion script (bash: `source <(usbwire completions bash)`).
    Completions(CompletionsArgs),
    /// Write the man pages (usbwire.1 and one per command) into a directory, or print usbwire.1.
    Man(ManArgs),
    /// Print the version: usbwire's, the USB/IP protocol's (0x0111) and usbwire's own extensions'.
    Version(VersionArgs),
}

#[derive(Args, Debug)]
pub(crate) struct VersionArgs {
    /// Machine-readable output: the versions as one JSON object (docs/json.md).
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["dir", "stop"])))]
pub(crate) struct CaptureArgs {
    /// Capture every import, running ones included, into DIR (one file per import; the
    /// server's user must be able to write there).
    pub(crate) dir: Option<PathBuf>,
    /// Stop capturing.
    #[arg(long)]
    pub(crate) stop: bool,
    #[command(flatten)]
    pub(crate) control: ControlArgs,
}

#[derive(Args, Debug)]
pub(crate) struct UdevRulesArgs {
    /// The server's config file, whose [[bind]] rules (device and also) name the devices.
    #[arg(long, value_name = "FILE", default_value = "/etc/usbwire/server.toml")]
    pub(crate) config: PathBuf,
    /// The group that gets the devices (the server's unit runs in it).
    #[arg(long, value_name = "NAME", default_value = "usbwire")]
    pub(crate) group: String,
}

#[derive(Args, Debug)]
pub(crate) struct CompletionsArgs {
    #[arg(value_enum)]
    pub(crate) shell: clap_complete::Shell,
}

#[derive(Args, Debug)]
pub(crate) struct ManArgs {
    /// Write usbwire.1 and usbwire-COMMAND.1 here (e.g. /usr/local/share/man/man1) instead of printing usbwire.1.
    #[arg(long, value_name = "DIR")]
    pub(crate) dir: Option<PathBuf>,
}

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
    /// A virtual device: keyboard, mouse, disk=PATH[,size=64M][,ro][,speed=super], serial[=LINK], loopback[,speed=super], dfu=FILE[,size=1M]. Repeatable.
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
    /// connects to a Unix socket only this user may open (unix:/run/usbwire/redir.sock=2-1), or to
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

/// Where the lab registry (etcd) is.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct RegistryArgs {
    /// The lab registry: etcd://HOST:PORT[,HOST:PORT…][/PREFIX] (an etcd cluster; prefix `usbwire` by
    /// default). Without a value: $USBWIRE_REGISTRY, else [registry] in the user's usbwire.toml.
    #[arg(long, value_name = "etcd://HOST:PORT[,…][/PREFIX]", num_args = 0..=1)]
    pub(crate) registry: Option<Option<usbwire_lab::RegistryUrl>>,
    /// TLS towards etcd: the CA certificate (PEM) its members' certificates are issued by.
    #[arg(long, value_name = "FILE", requires = "registry")]
    pub(crate) registry_ca: Option<PathBuf>,
    /// TLS towards etcd: this machine's client certificate (PEM), when the cluster requires one.
    #[arg(long, value_name = "FILE", requires_all = ["registry", "registry_key"])]
    pub(crate) registry_cert: Option<PathBuf>,
    /// TLS towards etcd: the client certificate's key (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["registry", "registry_cert"])]
    pub(crate) registry_key: Option<PathBuf>,
}

/// A duration: `90s`, `30m`, `2h`, `1h30m` (humantime).
fn duration(text: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{text:?} is not a duration (e.g. 30m, 2h, 1h30m): {e}"))
}

#[derive(Args, Debug)]
pub(crate) struct ReserveArgs {
    #[command(flatten)]
    pub(crate) registry: RegistryArgs,
    /// Which device: terms joined by commas, each a bus id, VID:PID, serial=TEXT, class=HEX,
    /// label=NAME or server=HOST:PORT (e.g. 0483:374b,label=nucleo).
    #[arg(long, value_name = "SELECTOR")]
    pub(crate) device: String,
    /// Keep it this long (then it is free again by itself) and return at once; without, hold it
    /// until this command is stopped (Ctrl-C), or dies.
    #[arg(long = "for", value_name = "DURATION", value_parser = duration)]
    pub(crate) hold_for: Option<std::time::Duration>,
    /// Machine-readable output: one JSON document with `schema_version` (docs/json.md).
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct ReleaseArgs {
    #[command(flatten)]
    pub(crate) registry: RegistryArgs,
    /// Which reserved devices (same selector as `reserve`): yours among them are released.
    #[arg(long, value_name = "SELECTOR")]
    pub(crate) device: String,
    /// Release them whoever holds them (for a lab's administrators).
    #[arg(long)]
    pub(crate) force: bool,
}

#[derive(Args, Debug)]
pub(crate) struct WhoArgs {
    #[command(flatten)]
    pub(crate) registry: RegistryArgs,
    /// Machine-readable output: one JSON document with `schema_version` (docs/json.md).
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug, Clone)]
pub(crate) struct ControlArgs {
    /// Local control socket [default: /run/usbwire/control.sock for root, else under $XDG_RUNTIME_DIR or /tmp].
    #[arg(long, value_name = "PATH")]
    pub(crate) control: Option<PathBuf>,
}

/// How a client reaches a server: plain USB/IP, or TLS 1.3 with this machine's identity.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct ClientSecurityArgs {
    /// Use TLS 1.3 with mutual authentication (the server must run with --tls and allow our identity).
    #[arg(long)]
    pub(crate) tls: bool,
    /// Identity directory [default: /etc/usbwire for root, else ~/.config/usbwire].
    #[arg(long, value_name = "DIR")]
    pub(crate) identity: Option<PathBuf>,
    /// Pin the server's key if it is not known yet (trust on first use).
    #[arg(long)]
    pub(crate) trust_new: bool,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["remote", "local", "discover", "registry"])))]
pub(crate) struct ListArgs {
    #[command(flatten)]
    pub(crate) security: ClientSecurityArgs,
    /// List the devices exported by HOST[:PORT].
    #[arg(
        short = 'r',
        long = "remote",
        value_name = "HOST[:PORT]",
        conflicts_with_all = ["local", "discover"]
    )]
    pub(crate) remote: Option<String>,
    /// List the USB devices plugged into this machine, with the kernel driver of each interface.
    #[arg(short = 'l', long = "local", conflicts_with = "discover")]
    pub(crate) local: bool,
    /// Find servers on the local network (mDNS/DNS-SD `_usbip._tcp`) and list their devices.
    #[arg(long)]
    pub(crate) discover: bool,
    /// With --discover: how long to listen for answers, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 3.0)]
    pub(crate) timeout: f64,
    /// List every server and device of a lab registry, with state, holder and reservation.
    #[command(flatten)]
    pub(crate) registry: RegistryArgs,
    /// With --registry: then follow the changes live, one line (or JSON object) each.
    #[arg(long, requires = "registry")]
    pub(crate) watch: bool,
    /// Port, as `usbip --tcp-port` (when HOST has none).
    #[arg(long = "tcp-port", value_name = "PORT")]
    pub(crate) tcp_port: Option<u16>,
    /// Machine-readable output.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct TypeArgs {
    /// The text to type (US keyboard layout; \n is Enter).
    pub(crate) text: String,
    /// Which keyboard, when the server exports several.
    #[arg(short = 'b', long = "busid")]
    pub(crate) busid: Option<String>,
    #[command(flatten)]
    pub(crate) control: ControlArgs,
}

#[derive(Args, Debug)]
pub(crate) struct ClientArgs {
    /// TOML file with `[[attach]]` rules (server, device selector, other identities, tls); SIGHUP re-reads it.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: PathBuf,
}

#[derive(Args, Debug)]
pub(crate) struct DoctorArgs {
    /// Also check this server: port reachable, USB/IP answers, TLS required.
    #[arg(short = 'r', long = "remote", value_name = "HOST[:PORT]")]
    pub(crate) remote: Option<String>,
    /// Port, when HOST has none.
    #[arg(long = "tcp-port", value_name = "PORT")]
    pub(crate) tcp_port: Option<u16>,
    /// Identity directory to check [default: /etc/usbwire for root, else ~/.config/usbwire].
    #[arg(long, value_name = "DIR")]
    pub(crate) identity: Option<PathBuf>,
    /// Local server's control socket to check.
    #[arg(long, value_name = "PATH")]
    pub(crate) control: Option<PathBuf>,
    /// Machine-readable output: one JSON document with `schema_version` (docs/json.md).
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["busid", "device"])))]
pub(crate) struct BindArgs {
    /// Bus id of the device, as `usbwire list -l` shows it (e.g. 1-1.2): that port, now and when
    /// plugged in again.
    #[arg(short = 'b', long = "busid")]
    pub(crate) busid: Option<String>,
    /// Every device this selector matches (VID:PID, serial=TEXT, class=HEX or a bus id), present now
    /// or plugged in later, wherever it is plugged in, kept across server restarts until `usbwire
    /// unbind --device` (like usbipd-win's `bind --hardware-id`).
    #[arg(long, value_name = "SELECTOR")]
    pub(crate) device: Option<String>,
    #[command(flatten)]
    pub(crate) control: ControlArgs,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["busid", "device", "all"])))]
pub(crate) struct UnbindArgs {
    /// Bus id of the device, as `usbwire state` shows it.
    #[arg(short = 'b', long = "busid")]
    pub(crate) busid: Option<String>,
    /// A `bind --device` rule to forget; the devices it matches are withdrawn.
    #[arg(long, value_name = "SELECTOR")]
    pub(crate) device: Option<String>,
    /// Every real device: forget every bind made by hand and withdraw them all (devices the
    /// config's [[bind]] rules name come back when plugged in again or the config is reloaded).
    #[arg(long)]
    pub(crate) all: bool,
    #[command(flatten)]
    pub(crate) control: ControlArgs,
}

#[derive(Args, Debug)]
pub(crate) struct StateArgs {
    /// Machine-readable output: one JSON document with `schema_version` (docs/json.md).
    #[arg(long)]
    pub(crate) json: bool,
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
    #[arg(short = 'b', long = "busid", required_unless_present = "registry", conflicts_with = "registry")]
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
    /// Keep the relay (resume, TLS, transforms) in this process instead of in the background, for
    /// service managers; it ends when the port is detached.
    #[arg(long)]
    pub(crate) foreground: bool,
    /// Keep the attachment through re-enumerations: when the device comes back at the same bus id
    /// (a DFU board entering its bootloader, then its new firmware), with any VID:PID, attach it
    /// again, on the same port if free. Always relayed; `usbwire port` shows the count.
    #[arg(long)]
    pub(crate) follow: bool,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("guest").required(true).args(["listen", "connect"])))]
pub(crate) struct RedirArgs {
    #[command(flatten)]
    pub(crate) device: RemoteDevice,
    /// Wait for QEMU to connect here, one guest at a time: a Unix socket only this user may open
    /// (`unix:PATH`; QEMU: `-chardev socket,path=PATH`), or ADDR:PORT with --redir-tcp-unauthenticated.
    #[arg(long, value_name = "unix:PATH")]
    pub(crate) listen: Option<String>,
    /// With --listen unix:PATH: let this group (name or number) open the socket too (mode 0660),
    /// e.g. the group QEMU or libvirt runs as.
    #[arg(long, value_name = "GROUP", requires = "listen")]
    pub(crate) group: Option<String>,
    /// Let --listen be a TCP port: usbredir has no authentication, so anyone who reaches it gets the device.
    #[arg(long)]
    pub(crate) redir_tcp_unauthenticated: bool,
    /// Connect to a QEMU listening here (`-chardev socket,…,server=on,wait=off`), again whenever it goes.
    #[arg(long, value_name = "ADDR:PORT")]
    pub(crate) connect: Option<String>,
}

#[derive(Args, Debug)]
pub(crate) struct PortArgs {
    /// Machine-readable output: one JSON document with `schema_version` (docs/json.md).
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct DetachArgs {
    /// The vhci port (see `usbwire port`).
    #[arg(short = 'p', long = "port")]
    pub(crate) port: u32,
}

#[derive(Args, Debug)]
pub(crate) struct DescribeArgs {
    #[command(flatten)]
    pub(crate) device: RemoteDevice,
    /// Machine-readable output.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct IdentityArgs {
    /// Identity directory [default: /etc/usbwire for root, else ~/.config/usbwire].
    #[arg(long, value_name = "DIR")]
    pub(crate) dir: Option<PathBuf>,
    /// Create the identity if there is none.
    #[arg(long)]
    pub(crate) create: bool,
    /// Create a private CA named NAME in --dir (ca.crt, ca.key): servers trust it with --ca.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["create", "ca_issue"])]
    pub(crate) ca_create: Option<String>,
    /// Issue a client identity for NAME from the CA in --ca into --dir; servers admit it with `--allow ca:NAME`.
    #[arg(long, value_name = "NAME", requires = "ca")]
    pub(crate) ca_issue: Option<String>,
    /// The CA directory for --ca-issue.
    #[arg(long, value_name = "DIR")]
    pub(crate) ca: Option<PathBuf>,
    /// Days an issued identity stays valid.
    #[arg(long, default_value_t = 365)]
    pub(crate) days: i64,
    /// Machine-readable output: one JSON document with `schema_version` (docs/json.md).
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    /// Bench a device on this server instead of an in-process loopback device.
    #[arg(short = 'r', long = "remote", value_name = "HOST[:PORT]", requires = "busid")]
    pub(crate) remote: Option<String>,
    /// Bus id of the device on the server (it needs a bulk IN source and/or a bulk OUT sink).
    #[arg(short = 'b', long = "busid")]
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
    #[command(flatten)]
    pub(crate) security: ClientSecurityArgs,
    /// With --registry, instead of the throughput matrix: bench the lab registry with a simulated
    /// fleet of this many in-process servers (each with its own etcd connection) [default: 100].
    #[arg(long, value_name = "N", requires = "registry")]
    pub(crate) servers: Option<usize>,
    /// With --registry: virtual devices per simulated server; every 10th is labelled `nucleo` [default: 10].
    #[arg(long, value_name = "M", requires = "registry")]
    pub(crate) devices_per_server: Option<usize>,
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

/// A device on a server, and how to reach the server.
#[derive(Args, Debug)]
pub(crate) struct RemoteDevice {
    #[command(flatten)]
    pub(crate) security: ClientSecurityArgs,
    /// The server, HOST[:PORT].
    #[arg(short = 'r', long = "remote", value_name = "HOST[:PORT]")]
    pub(crate) remote: String,
    /// Bus id of the device on the server.
    #[arg(short = 'b', long = "busid")]
    pub(crate) busid: String,
    /// Port, as `usbip --tcp-port` (when HOST has none).
    #[arg(long = "tcp-port", value_name = "PORT")]
    pub(crate) tcp_port: Option<u16>,
}
