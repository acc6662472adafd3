//! The user's own defaults for every command: `usbwire.toml` in the user's
//! usbwire directory (`$XDG_CONFIG_HOME/usbwire/`, `~/.config/usbwire/`;
//! root's `/etc/usbwire/`, beside the identity). Today it holds `[registry]`:
//! the lab registry `reserve`, `release`, `who` and a bare `--registry` use
//! when `USBWIRE_REGISTRY` names none. Not the server's file (`serve
//! --config`) nor the client service's (`usbwire client --config`), though
//! its `[registry]` table is theirs. `USBWIRE_CONFIG` names another file.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::Deserialize;

use super::server::RegistryTable;

/// The environment variable naming the default lab registry (a `--registry` URL).
pub(crate) const REGISTRY_ENV: &str = "USBWIRE_REGISTRY";

/// What `usbwire.toml` holds.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct UserConfig {
    /// The default lab registry (`endpoints`, `prefix`, `ca`, `cert`, `key`).
    pub(crate) registry: Option<RegistryTable>,
}

impl UserConfig {
    /// The user's `usbwire.toml`: `None` if there is none.
    pub(crate) fn load(path: &Path) -> anyhow::Result<Option<Self>> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(error).with_context(|| format!("cannot read {}", path.display())),
        };
        toml::from_str(&text).map(Some).with_context(|| format!("invalid config {}", path.display()))
    }
}

/// The environment variable naming another `usbwire.toml`.
pub(crate) const CONFIG_ENV: &str = "USBWIRE_CONFIG";

/// Where the user's `usbwire.toml` is: `$USBWIRE_CONFIG`, else in the user's usbwire directory.
pub(crate) fn user_config_path() -> PathBuf {
    match std::env::var_os(CONFIG_ENV).filter(|path| !path.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => usbwire_transport::identity::default_dir().join("usbwire.toml"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_table_is_read_and_unknown_keys_are_refused() {
        let config: UserConfig =
            toml::from_str("[registry]\nendpoints = [\"10.0.0.5:2379\"]\nprefix = \"lab\"\n").unwrap();
        let url = config.registry.unwrap().url().unwrap();
        assert_eq!(url.to_string(), "etcd://10.0.0.5:2379/lab");
        let error = toml::from_str::<UserConfig>("registy = 1\n").unwrap_err().to_string();
        assert!(error.contains("unknown field"), "{error}");
        let missing = std::env::temp_dir().join(format!("usbwire-user-{}-none.toml", std::process::id()));
        assert!(UserConfig::load(&missing).unwrap().is_none());
    }
}
