//! The command line, as clap sees it. Verbs a `usbip` user knows keep their
//! names and flags (`list -r`, `--tcp-port`); ours are added beside them.
//!
//! Here: [`Cli`] and its [`Command`]s. Each verb's arguments live beside the verbs they
//! belong with, in groups: `server` (serve, demo), `local` (what talks to the local server:
//! bind, unbind, state, type, capture; as `commands/local/`), `kernel` (attach, port, detach,
//! client: `commands/attach/` and `commands::service`), `remote` (list, describe, redir), `lab`
//! (reserve, release, who), `bench`, and `setup` (identity, doctor, udev-rules, completions,
//! man, version); `common` has the flag groups and value parsers several verbs share. Not
//! here: what the flags mean once parsed (`config` and `commands`).

mod bench;
mod common;
mod kernel;
mod lab;
mod local;
mod remote;
mod server;
mod setup;

use clap::{Parser, Subcommand};

pub(crate) use bench::BenchArgs;
pub(crate) use common::{ClientSecurityArgs, ControlArgs, RegistryArgs};
pub(crate) use kernel::{AttachArgs, ClientArgs, DetachArgs, PortArgs};
pub(crate) use lab::{ReleaseArgs, ReserveArgs, WhoArgs};
pub(crate) use local::{BindArgs, CaptureArgs, StateArgs, TypeArgs, UnbindArgs};
pub(crate) use remote::{DescribeArgs, ListArgs, RedirArgs};
pub(crate) use server::{DemoArgs, ServeArgs};
pub(crate) use setup::{CompletionsArgs, DoctorArgs, IdentityArgs, ManArgs, UdevRulesArgs, VersionArgs};

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
    version = crate::version::version_text(),
    about = "Share USB devices over IP (USB/IP compatible)"
)]
pub(crate) struct Cli {
    /// More log output (-v debug, -vv trace). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub(crate) verbose: u8,
    /// Only warnings and errors.
    #[arg(short, long, global = true)]
    pub(crate) quiet: bool,
    /// The server's port, where usbip puts it (`usbwire --tcp-port 3241 list -r HOST`): the same as
    /// the verb's own --tcp-port, for list, attach, describe, redir and doctor.
    #[arg(long = "tcp-port", value_name = "PORT")]
    pub(crate) tcp_port: Option<u16>,
    #[command(subcommand)]
    pub(crate) command: Command,
}

impl Cli {
    /// The verb, with a `--tcp-port` given before it (`usbip --tcp-port PORT
    /// list -r HOST`) moved to the verb's own. Given in both places it must
    /// name the same port; a verb that reaches no server by HOST takes none.
    /// The error is for the user, as a usage error.
    pub(crate) fn into_command(self) -> Result<Command, String> {
        let mut command = self.command;
        let Some(port) = self.tcp_port else { return Ok(command) };
        let own = match &mut command {
            Command::List(args) => &mut args.tcp_port,
            Command::Attach(args) => &mut args.tcp_port,
            Command::Describe(args) => &mut args.device.tcp_port,
            Command::Redir(args) => &mut args.device.tcp_port,
            Command::Doctor(args) => &mut args.tcp_port,
            Command::Serve(_) | Command::Demo(_) => {
                return Err(format!(
                    "--tcp-port {port} is for the verbs that reach a server; a server listens where --listen \
                     says (usbipd's --tcp-port {port} is --listen 0.0.0.0:{port})"
                ))
            }
            _ => {
                return Err(format!(
                    "--tcp-port {port} is for the verbs that reach a server by HOST: list -r, attach, describe, \
                     redir, doctor -r"
                ))
            }
        };
        match *own {
            Some(after) if after != port => Err(format!(
                "--tcp-port {port} before the verb and --tcp-port {after} after it name different ports: give one"
            )),
            _ => {
                *own = Some(port);
                Ok(command)
            }
        }
    }
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
