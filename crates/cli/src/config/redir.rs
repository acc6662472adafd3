//! `[[redir]]` rules and `--redir` flags: which device a QEMU guest gets
//! through usbredir, and where the guest connects (a Unix socket, its
//! group; TCP only with the opt-in).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context as _};
use serde::Deserialize;

use super::units::selector_field;

/// `[[redir]] device = "SELECTOR" listen = "unix:PATH"`: a usbredir bridge
/// for a device of this server (`--redir unix:PATH=SELECTOR` on the command line).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RedirRule {
    #[serde(deserialize_with = "selector_field")]
    pub(crate) device: usbwire_device::Selector,
    #[serde(deserialize_with = "redir_listen_field")]
    pub(crate) listen: RedirListen,
    /// A group (name or number) that may also open the Unix socket (0660).
    #[serde(default)]
    pub(crate) group: Option<String>,
    /// A TCP listener: usbredir has no authentication, so whoever reaches
    /// the port gets the device. Only when this says so.
    #[serde(default)]
    pub(crate) allow_unauthenticated: bool,
    /// Keep the guest's device through re-enumerations (the guest sees an
    /// unplug and a plug of whatever comes back at the bus id, with any
    /// VID:PID), as `[[attach]] follow`. Default: on for a bus-id `device`,
    /// off otherwise.
    #[serde(default)]
    pub(crate) follow: Option<bool>,
}

impl std::str::FromStr for RedirRule {
    type Err = anyhow::Error;

    /// `unix:PATH=SELECTOR` or `ADDR:PORT=SELECTOR`, e.g.
    /// `unix:/run/usbwire/disk.sock=2-1` or `[::1]:4000=serial=A1`.
    fn from_str(text: &str) -> anyhow::Result<Self> {
        let Some((listen, device)) = text.split_once('=') else {
            bail!("--redir {text:?}: expected unix:PATH=SELECTOR, e.g. unix:/run/usbwire/redir.sock=2-1");
        };
        let listen = listen.parse().with_context(|| format!("--redir {text:?}"))?;
        let device = device.parse().with_context(|| format!("--redir {text:?}: bad device selector"))?;
        Ok(Self { device, listen, group: None, allow_unauthenticated: false, follow: None })
    }
}

impl RedirRule {
    /// Whether the bridge follows its device through re-enumerations.
    pub(crate) fn follows(&self) -> bool {
        self.follow.unwrap_or(matches!(self.device, usbwire_device::Selector::BusId(_)))
    }

    /// Refuses a TCP listener unless the rule opts in to an unauthenticated
    /// port, and always on a server that takes no plain USB/IP
    /// (`plain_never`): its bridge would be a plain door to the device.
    pub(crate) fn check(&self, plain_never: bool) -> anyhow::Result<()> {
        let RedirListen::Tcp(addr) = &self.listen else { return Ok(()) };
        let unix = format!("--redir unix:PATH={} (listen = \"unix:PATH\")", self.device);
        if self.group.is_some() {
            bail!("[[redir]] for {}: group is for a Unix socket, not {addr}; use {unix}", self.device);
        }
        if plain_never {
            bail!(
                "[[redir]] for {} on {addr}: usbredir has no authentication, and this server takes no plain \
                 USB/IP (allow_plain = \"never\"); a TCP port would hand the device to anyone who reaches it. \
                 Use a Unix socket: {unix}",
                self.device
            );
        }
        if !self.allow_unauthenticated {
            bail!(
                "[[redir]] for {} on {addr}: usbredir has no authentication, so anyone who reaches a TCP port \
                 gets the device (and reads what it carries). Use a Unix socket, {unix}, which only this \
                 user (or a `group`) may open; or, if every process that can reach {addr} may have the \
                 device, say so with allow_unauthenticated = true (--redir-tcp-unauthenticated)",
                self.device
            );
        }
        Ok(())
    }
}

/// Where a usbredir bridge waits for its guest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RedirListen {
    /// `unix:PATH`: a socket only this user (or a configured group) may open.
    Unix(PathBuf),
    /// `ADDR:PORT`: whoever reaches it gets the device.
    Tcp(SocketAddr),
}

impl std::str::FromStr for RedirListen {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> anyhow::Result<Self> {
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                bail!("{text:?}: unix: needs a path, e.g. unix:/run/usbwire/redir.sock");
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let addr = text.parse().with_context(|| {
            format!("{text:?} is neither unix:PATH nor an ADDR:PORT (e.g. unix:/run/usbwire/redir.sock)")
        })?;
        Ok(Self::Tcp(addr))
    }
}

impl std::fmt::Display for RedirListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
            Self::Tcp(addr) => write!(f, "{addr}"),
        }
    }
}

fn redir_listen_field<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<RedirListen, D::Error> {
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(|e: anyhow::Error| serde::de::Error::custom(format!("{e:#}")))
}

/// The gid of `group`, a name or a number.
pub(crate) fn group_id(group: &str) -> anyhow::Result<u32> {
    if let Ok(gid) = group.parse() {
        return Ok(gid);
    }
    let name = std::ffi::CString::new(group).with_context(|| format!("group {group:?}: not a group name"))?;
    // SAFETY: libc::group is plain data (integers and pointers), valid all zero.
    let mut entry: libc::group = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::group = std::ptr::null_mut();
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: every pointer is valid for the call and buf's length is passed; the
    // result points into entry and buf, which we read only for gr_gid (a copy).
    let status = unsafe { libc::getgrnam_r(name.as_ptr(), &mut entry, buf.as_mut_ptr(), buf.len(), &mut found) };
    if status != 0 {
        bail!("group {group:?}: cannot look it up: {}", std::io::Error::from_raw_os_error(status));
    }
    if found.is_null() {
        bail!("group {group:?} does not exist on this machine (`getent group` lists them); give its name or number");
    }
    Ok(entry.gr_gid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::*;

    #[test]
    fn redir_rules_from_the_file_and_the_flag() {
        let config: FileConfig =
            toml::from_str("[[redir]]\ndevice = \"1209:0003\"\nlisten = \"unix:/run/u/r.sock\"").unwrap();
        assert_eq!(config.redir, vec!["unix:/run/u/r.sock=1209:0003".parse::<RedirRule>().unwrap()]);
        assert_eq!(config.redir[0].listen, RedirListen::Unix("/run/u/r.sock".into()));
        let flag: RedirRule = "[::1]:4000=serial=A1".parse().unwrap();
        assert_eq!(
            (flag.listen, flag.device),
            (RedirListen::Tcp("[::1]:4000".parse().unwrap()), "serial=A1".parse().unwrap())
        );
        assert!("127.0.0.1:4000".parse::<RedirRule>().unwrap_err().to_string().contains("unix:PATH=SELECTOR"));
        assert!("localhost=2-1".parse::<RedirRule>().is_err());
        assert!("unix:=2-1".parse::<RedirRule>().is_err());
    }

    #[test]
    fn bus_id_redir_rules_follow_their_device_by_default() {
        let config: FileConfig = toml::from_str(
            "[[redir]]\ndevice = \"1209:0006\"\nlisten = \"unix:/a.sock\"\n\
             [[redir]]\ndevice = \"0-1\"\nlisten = \"unix:/b.sock\"\n\
             [[redir]]\ndevice = \"0-1\"\nlisten = \"unix:/c.sock\"\nfollow = false\n\
             [[redir]]\ndevice = \"class=fe\"\nlisten = \"unix:/d.sock\"\nfollow = true",
        )
        .unwrap();
        let follows: Vec<bool> = config.redir.iter().map(RedirRule::follows).collect();
        assert_eq!(follows, [false, true, false, true]);
        assert!("unix:/e.sock=0-2".parse::<RedirRule>().unwrap().follows(), "--redir by bus id follows too");
    }

    #[test]
    fn a_tcp_redir_listener_needs_the_opt_in_and_never_with_plain_never() {
        let unix: RedirRule = "unix:/run/u/r.sock=2-1".parse().unwrap();
        assert!(unix.check(true).is_ok());
        let tcp: RedirRule = "127.0.0.1:4000=2-1".parse().unwrap();
        let refused = format!("{:#}", tcp.check(false).unwrap_err());
        assert!(refused.contains("no authentication") && refused.contains("unix:PATH"), "{refused}");
        let opted: FileConfig =
            toml::from_str("[[redir]]\ndevice = \"2-1\"\nlisten = \"127.0.0.1:4000\"\nallow_unauthenticated = true")
                .unwrap();
        assert!(opted.redir[0].check(false).is_ok());
        let never = format!("{:#}", opted.redir[0].check(true).unwrap_err());
        assert!(never.contains("allow_plain = \"never\"") && never.contains("unix:PATH"), "{never}");
        let grouped: FileConfig =
            toml::from_str("[[redir]]\ndevice = \"2-1\"\nlisten = \"unix:/r.sock\"\ngroup = \"kvm\"").unwrap();
        assert_eq!(grouped.redir[0].group.as_deref(), Some("kvm"));
        assert_eq!(group_id("0").unwrap(), 0);
        assert!(group_id("no-such-group-usbwire").is_err());
    }
}
