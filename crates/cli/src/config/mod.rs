//! Configuration: the server's TOML file and `--virtual` specs, and the
//! client service's `[[attach]]` rules, parsed into plain values. Nothing
//! here touches the system; `commands::serve` and `commands::service` do.
//!
//! One file per thing configured: [`server`] (the server's file),
//! [`virtual_spec`] (virtual devices), [`redir`] (usbredir rules),
//! [`client`] (the client service's file), [`user`] (the user's own
//! defaults, usbwire.toml), and [`units`] for the values they share (sizes,
//! durations, selectors).

mod client;
mod redir;
mod server;
mod units;
mod user;
mod virtual_spec;

pub(crate) use client::{AttachRule, ClientConfig};
pub(crate) use redir::{group_id, RedirListen, RedirRule};
pub(crate) use server::FileConfig;
pub(crate) use units::parse_size;
pub(crate) use user::{user_config_path, UserConfig, REGISTRY_ENV};
pub(crate) use virtual_spec::{
    ReplayMode, ReplayTiming, SpeedChoice, VirtualKey, VirtualSpec, VIRTUAL_KEYS, VIRTUAL_KINDS,
};
