//! The arguments of the verbs about this machine's setup and the program itself: `identity`,
//! `doctor`, `udev-rules`, `completions`, `man` and `version`.

use std::path::PathBuf;

use clap::Args;

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
    /// Replace a key already in --dir (with --create, --ca-create, --ca-issue): the old files are kept
    /// beside the new ones as NAME.old. Without it, a key is never replaced.
    #[arg(long)]
    pub(crate) force: bool,
    /// Days an issued identity stays valid.
    #[arg(long, default_value_t = 365)]
    pub(crate) days: i64,
    /// Machine-readable output: one JSON document with `schema_version` (docs/json.md).
    #[arg(long)]
    pub(crate) json: bool,
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
pub(crate) struct VersionArgs {
    /// Machine-readable output: the versions as one JSON object (docs/json.md).
    #[arg(long)]
    pub(crate) json: bool,
}
