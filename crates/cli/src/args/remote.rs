//! The arguments of the verbs that look at or use a server's devices without the kernel:
//! `list`, `describe` and `redir`.

use clap::Args;

use super::common::{ClientSecurityArgs, RegistryArgs, RemoteDevice};

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
    /// With --registry: only the devices this selector matches (as `attach --device`), read from
    /// each server's catalog of the selector's label, VID:PID or class (else the registry's index)
    /// rather than the whole fleet; with --watch, only their changes.
    #[arg(long, value_name = "SELECTOR", requires = "registry")]
    pub(crate) device: Option<String>,
    /// With --registry: one JSON object per line, printed as the fleet is read: `what` is `fleet`
    /// (with its `revision`), then `server` and `device` (each server before its devices), then
    /// `listed` (the counts); with --watch, the changes after it, one per line.
    #[arg(long = "json-lines", requires = "registry", conflicts_with = "json")]
    pub(crate) json_lines: bool,
    /// Port, as `usbip --tcp-port` (when HOST has none).
    #[arg(long = "tcp-port", value_name = "PORT")]
    pub(crate) tcp_port: Option<u16>,
    /// Machine-readable output.
    #[arg(long)]
    pub(crate) json: bool,
    /// One line per device, as `usbip list -p`: `busid=1-1#usbid=046d:c52b#`. With -l byte for byte
    /// what `usbip list -p -l` prints (hubs and devices attached through vhci-hcd left out); with -r
    /// the same lines for the server's devices (where `usbip list -r` ignores -p).
    #[arg(short = 'p', long = "parsable", conflicts_with_all = ["json", "discover", "registry"])]
    pub(crate) parsable: bool,
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
    /// Do not follow the device through re-enumerations. By default, when it disconnects and comes
    /// back at the same bus id (a DFU board entering its bootloader, then its new firmware), with
    /// any VID:PID, the guest sees it unplugged and plugged in again (as `attach --follow`).
    #[arg(long)]
    pub(crate) no_follow: bool,
}
