//! The arguments of the verbs that talk to the server running on this machine through its
//! control socket: `bind`, `unbind`, `state`, `type` and `capture`.

use std::path::PathBuf;

use clap::Args;

use super::common::{bus_id, ControlArgs};

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["busid", "device"])))]
pub(crate) struct BindArgs {
    /// Bus id of the device, as `usbwire list -l` shows it (e.g. 1-1.2): that port, now and when
    /// plugged in again.
    #[arg(short = 'b', long = "busid", value_parser = bus_id)]
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
    #[arg(short = 'b', long = "busid", value_parser = bus_id)]
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
pub(crate) struct TypeArgs {
    /// The text to type (US keyboard layout; \n is Enter).
    pub(crate) text: String,
    /// Which keyboard, when the server exports several.
    #[arg(short = 'b', long = "busid", value_parser = bus_id)]
    pub(crate) busid: Option<String>,
    #[command(flatten)]
    pub(crate) control: ControlArgs,
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
