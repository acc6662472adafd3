//! The client service's file (`usbwire client --config`): `[[attach]]`
//! rules, discovery, TLS and the registry it takes devices from.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _};
use serde::Deserialize;

use super::server::RegistryTable;
use super::units::{selector_field, selector_list};

/// The client service's file (`usbwire client --config FILE`):
///
/// ```toml
/// identity = "/etc/usbwire"        # for rules with tls = true
///
/// [[attach]]
/// server = "192.168.1.5:3240"      # or "discover" (needs tls = true): any pinned server that answers mDNS
/// device = "0483:5740"              # bus id, VID:PID, serial=TEXT or class=HEX
/// also = ["0483:df11"]              # the same device in another mode (its DFU bootloader)
/// tls = false
/// follow = false                    # attach again after a re-enumeration; default: true for a bus id
/// accelerate = "off"                # "auto" (default): descriptor snapshot, pipelined mass storage
///
/// [registry]                        # a lab registry on etcd, for server = "registry" rules
/// endpoints = ["10.0.0.5:2379"]
/// plain = false                     # true: also servers whose entry has no TLS key, over plain USB/IP
///
/// [[attach]]
/// server = "registry"              # a free matching device, wherever it is, reserved while attached
/// device = "0483:374b"
/// labels = ["nucleo"]               # and carrying these labels
/// ```
///
/// `server = "discover"` without TLS is refused at load: any machine on the LAN
/// could answer mDNS and have its "device" (a keyboard that types commands)
/// attached to this kernel. With TLS, only servers whose key is pinned in the
/// identity's `known_servers` are accepted (the service never pins on first use).
/// `server = "registry"` rules always use TLS pinned to the key in the reserved
/// server's registry entry (whatever `tls` says); a server whose entry has no
/// key is refused unless `[registry] plain = true`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClientConfig {
    pub(crate) identity: Option<PathBuf>,
    #[serde(default)]
    pub(crate) attach: Vec<AttachRule>,
    /// The lab registry `server = "registry"` rules reserve from (its `address` and `ttl` are a server's, unused here).
    pub(crate) registry: Option<RegistryTable>,
}

/// Keep a device matching `device` (or any of `also`) on `server` attached.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AttachRule {
    pub(crate) server: String,
    #[serde(deserialize_with = "selector_field")]
    pub(crate) device: usbwire_device::Selector,
    #[serde(default, deserialize_with = "selector_list")]
    pub(crate) also: Vec<usbwire_device::Selector>,
    #[serde(default)]
    pub(crate) tls: bool,
    /// With `server = "registry"`: the device must carry these labels too.
    #[serde(default)]
    pub(crate) labels: Vec<String>,
    /// Keep the attachment through re-enumerations (attach the bus id again
    /// with whatever VID:PID comes back there). Default: on for a bus-id
    /// `device`, off otherwise.
    #[serde(default)]
    pub(crate) follow: Option<bool>,
    /// `auto` (the default): answer enumeration from the server's descriptor
    /// snapshot and pipeline mass storage, where the server is usbwire;
    /// `off`: relay every transfer as it comes (`attach --accelerate`).
    #[serde(default)]
    pub(crate) accelerate: Accelerate,
}

/// `accelerate = "auto" | "off"` of an `[[attach]]` rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Accelerate {
    #[default]
    Auto,
    Off,
}

impl AttachRule {
    /// Whether the attachment follows the device through re-enumerations.
    pub(crate) fn follows(&self) -> bool {
        self.follow.unwrap_or(matches!(self.device, usbwire_device::Selector::BusId(_)))
    }

    /// Whether the rule's imports ask for the accelerator's extensions.
    pub(crate) fn accelerates(&self) -> bool {
        self.accelerate == Accelerate::Auto
    }

    /// Every identity the device may show up under.
    pub(crate) fn selectors(&self) -> impl Iterator<Item = &usbwire_device::Selector> {
        std::iter::once(&self.device).chain(&self.also)
    }
}

impl AttachRule {
    /// A `server = "registry"` rule: what it asks the registry for.
    pub(crate) fn wanted(&self) -> anyhow::Result<usbwire_lab::Want> {
        let mut text = self.device.to_string();
        for label in &self.labels {
            text.push_str(&format!(",label={label}"));
        }
        text.parse().with_context(|| format!("[[attach]] rule {self}"))
    }
}

impl std::fmt::Display for AttachRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.device)?;
        for other in &self.also {
            write!(f, "|{other}")?;
        }
        for label in &self.labels {
            write!(f, ",label={label}")?;
        }
        write!(f, " on {}", self.server)
    }
}

impl ClientConfig {
    pub(crate) fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read config {}", path.display()))?;
        let config: Self = toml::from_str(&text).with_context(|| format!("invalid config {}", path.display()))?;
        if config.attach.is_empty() {
            bail!("{} has no [[attach]] rules: nothing to keep attached", path.display());
        }
        config.check().with_context(|| format!("refusing config {}", path.display()))?;
        Ok(config)
    }

    /// Refuses rules that would attach what an unauthenticated peer offers.
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        for rule in self.attach.iter().filter(|r| r.server == "registry") {
            if self.registry.is_none() {
                bail!("[[attach]] rule {rule}: server = \"registry\" needs a [registry] table (endpoints = [\"HOST:PORT\"])");
            }
            if !rule.also.is_empty() {
                bail!("[[attach]] rule {rule}: `also` does not apply to server = \"registry\" (a reservation is of one device)");
            }
            rule.wanted()?;
        }
        if let Some(rule) = self.attach.iter().find(|r| r.server != "registry" && !r.labels.is_empty()) {
            bail!("[[attach]] rule {rule}: labels apply only to server = \"registry\" rules");
        }
        if let Some(rule) = self.attach.iter().find(|r| r.server == "discover" && !r.tls) {
            bail!(
                "[[attach]] rule {rule}: server = \"discover\" needs tls = true: without TLS any machine on the \
                 local network can answer mDNS and have its device (a keyboard that types commands) attached to \
                 this kernel; write tls = true and pin each server's key first (`usbwire list -r HOST:PORT --tls \
                 --trust-new`), or name the server: server = \"HOST:PORT\""
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_config_rules() {
        let config: ClientConfig = toml::from_str(
            r#"
            [[attach]]
            server = "10.0.2.2:3240"
            device = "0483:5740"
            also = ["0483:df11", "serial=X"]
            [[attach]]
            server = "host"
            device = "2-1"
            tls = true
            "#,
        )
        .unwrap();
        assert_eq!(config.attach.len(), 2);
        assert_eq!(config.attach[0].to_string(), "0483:5740|0483:df11|serial=X on 10.0.2.2:3240");
        assert_eq!(config.attach[0].selectors().count(), 3);
        assert!(config.attach[1].tls && !config.attach[0].tls);
        assert!(!config.attach[0].follows() && config.attach[1].follows(), "bus-id rules follow by default");
        let explicit: ClientConfig =
            toml::from_str("[[attach]]\nserver = \"h:1\"\ndevice = \"1-1\"\nfollow = false").unwrap();
        assert!(!explicit.attach[0].follows());
        assert!(config.attach[0].accelerates(), "accelerated unless told otherwise");
        let off: ClientConfig =
            toml::from_str("[[attach]]\nserver = \"h:1\"\ndevice = \"1-1\"\naccelerate = \"off\"").unwrap();
        assert!(!off.attach[0].accelerates());
        let wrong = toml::from_str::<ClientConfig>("[[attach]]\nserver = \"h\"\ndevice = \"1-1\"\naccelerate = \"on\"");
        assert!(wrong.unwrap_err().to_string().contains("expected `auto` or `off`"));
        let bad = toml::from_str::<ClientConfig>("[[attach]]\nserver = \"h\"\ndevice = \"1-1\"\nalso = [\"nope\"]");
        assert!(bad.unwrap_err().to_string().contains("not a device selector"));
    }

    #[test]
    fn registry_rules_need_the_registry_and_take_labels() {
        let rule = "[[attach]]\nserver = \"registry\"\ndevice = \"0483:374b\"\nlabels = [\"nucleo\"]\n";
        let without: ClientConfig = toml::from_str(rule).unwrap();
        assert!(without.check().unwrap_err().to_string().contains("needs a [registry] table"));
        let with: ClientConfig =
            toml::from_str(&format!("{rule}[registry]\nendpoints = [\"127.0.0.1:2379\"]\n")).unwrap();
        with.check().unwrap();
        assert_eq!(with.attach[0].wanted().unwrap().to_string(), "0483:374b,label=nucleo");
        let labels_elsewhere: ClientConfig =
            toml::from_str("[[attach]]\nserver = \"h:1\"\ndevice = \"1-1\"\nlabels = [\"x\"]").unwrap();
        assert!(labels_elsewhere.check().unwrap_err().to_string().contains("only to server = \"registry\""));
    }

    #[test]
    fn discover_needs_tls() {
        let rule = |tls: bool| format!("[[attach]]\nserver = \"discover\"\ndevice = \"1-1\"\ntls = {tls}\n");
        let plain: ClientConfig = toml::from_str(&rule(false)).unwrap();
        let message = plain.check().unwrap_err().to_string();
        assert!(message.contains("needs tls = true") && message.contains("server = \"HOST:PORT\""), "{message}");
        let secure: ClientConfig = toml::from_str(&rule(true)).unwrap();
        secure.check().unwrap();
        let named: ClientConfig = toml::from_str("[[attach]]\nserver = \"h:1\"\ndevice = \"1-1\"").unwrap();
        named.check().unwrap();
    }
}
