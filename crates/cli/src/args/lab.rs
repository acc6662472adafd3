//! The arguments of the lab registry's verbs: `reserve`, `release` and `who`.

use clap::Args;

use super::common::{duration, RegistryArgs};

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
