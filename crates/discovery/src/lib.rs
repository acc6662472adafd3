//! Finding USB/IP servers on the local network: DNS-SD over mDNS, service
//! type `_usbip._tcp` (the name the USB/IP paper's tool used).
//!
//! A server [`advertise`]s itself with TXT records saying what a client needs
//! before connecting — protocol version, whether TLS is required, how many
//! devices it exports, which implementation it is; a client [`browse`]s for a
//! while and gets every server that answered. mdns-sd does the multicast (its
//! own thread, no runtime); this crate only decides names and records.
//!
//! Not for listing a server's devices: that is USB/IP itself (`usbwire-client`).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use mdns_sd::{ServiceDaemon, ServiceEvent, ServiceInfo};

/// The DNS-SD service type.
pub const SERVICE_TYPE: &str = "_usbip._tcp.local.";

/// Whether a server takes plain USB/IP from the network (TXT key `tls`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsMode {
    /// Plain USB/IP only.
    Off,
    /// TLS, and plain USB/IP too.
    Optional,
    /// TLS only (plain at most from loopback).
    Required,
}

impl TlsMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Optional => "optional",
            Self::Required => "required",
        }
    }
}

/// What a server announces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announcement {
    /// Instance name, unique on the network (e.g. the host name and port).
    pub name: String,
    pub port: u16,
    pub tls: TlsMode,
    pub devices: usize,
}

impl Announcement {
    /// The TXT records: `version=0111`, `tls=…`, `devices=N`, `impl=usbwire`.
    pub fn txt(&self) -> Vec<(String, String)> {
        vec![
            ("version".into(), format!("{:04x}", usbwire_proto::USBIP_VERSION)),
            ("tls".into(), self.tls.as_str().into()),
            ("devices".into(), self.devices.to_string()),
            ("impl".into(), "usbwire".into()),
        ]
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("mDNS: {0}")]
    Mdns(#[from] mdns_sd::Error),
}

/// A running advertisement; dropping it withdraws the service (goodbye packets).
pub struct Advertisement {
    daemon: ServiceDaemon,
    announcement: Announcement,
    fullname: String,
}

/// Starts announcing `announcement` on every multicast-capable interface.
pub fn advertise(announcement: Announcement) -> Result<Advertisement, DiscoveryError> {
    let daemon = ServiceDaemon::new()?;
    let fullname = register(&daemon, &announcement)?;
    Ok(Advertisement { daemon, announcement, fullname })
}

fn register(daemon: &ServiceDaemon, announcement: &Announcement) -> Result<String, DiscoveryError> {
    let host = format!("{}.local.", announcement.name.replace(['.', ' '], "-"));
    let info =
        ServiceInfo::new(SERVICE_TYPE, &announcement.name, &host, "", announcement.port, &announcement.txt()[..])?
            .enable_addr_auto();
    let fullname = info.get_fullname().to_owned();
    daemon.register(info)?;
    Ok(fullname)
}

impl Advertisement {
    /// Re-announces with a new device count (no-op if unchanged).
    pub fn set_devices(&mut self, devices: usize) -> Result<(), DiscoveryError> {
        if devices == self.announcement.devices {
            return Ok(());
        }
        self.announcement.devices = devices;
        self.fullname = register(&self.daemon, &self.announcement)?;
        Ok(())
    }

    pub fn fullname(&self) -> &str {
        &self.fullname
    }
}

impl Drop for Advertisement {
    fn drop(&mut self) {
        if let Ok(done) = self.daemon.unregister(&self.fullname) {
            let _ = done.recv_timeout(Duration::from_secs(1));
        }
        if let Ok(done) = self.daemon.shutdown() {
            let _ = done.recv_timeout(Duration::from_secs(1));
        }
    }
}

/// A server that answered a browse. Every string is as the network sent it
/// (any machine on the LAN can answer): show them through
/// `usbwire_proto::display::escape`, never raw.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FoundServer {
    /// The DNS-SD instance name.
    pub name: String,
    /// Its mDNS host name.
    pub host: String,
    /// IPv4 first.
    pub addresses: Vec<IpAddr>,
    pub port: u16,
    pub txt: BTreeMap<String, String>,
}

impl FoundServer {
    /// Whether the server said it takes only TLS from the network.
    pub fn requires_tls(&self) -> bool {
        self.txt.get("tls").map(String::as_str) == Some(TlsMode::Required.as_str())
    }
}

/// Listens for `_usbip._tcp` servers for `wait`, then returns those found, sorted by name.
pub fn browse(wait: Duration) -> Result<Vec<FoundServer>, DiscoveryError> {
    let daemon = ServiceDaemon::new()?;
    let events = daemon.browse(SERVICE_TYPE)?;
    let deadline = Instant::now() + wait;
    let mut found: BTreeMap<String, FoundServer> = BTreeMap::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match events.recv_timeout(left) {
            Ok(ServiceEvent::ServiceResolved(service)) => {
                let mut addresses: Vec<IpAddr> = service.get_addresses().iter().map(|a| a.to_ip_addr()).collect();
                addresses.sort_by_key(|a| (a.is_ipv6(), *a));
                addresses.dedup();
                let txt =
                    service.get_properties().iter().map(|p| (p.key().to_owned(), p.val_str().to_owned())).collect();
                let server = FoundServer {
                    name: instance_name(service.get_fullname()),
                    host: service.get_hostname().trim_end_matches('.').to_owned(),
                    addresses,
                    port: service.get_port(),
                    txt,
                };
                found.insert(service.get_fullname().to_owned(), server);
            }
            Ok(ServiceEvent::ServiceRemoved(_, fullname)) => {
                found.remove(&fullname);
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let _ = daemon.stop_browse(SERVICE_TYPE);
    if let Ok(done) = daemon.shutdown() {
        let _ = done.recv_timeout(Duration::from_secs(1));
    }
    Ok(found.into_values().collect())
}

/// `my server._usbip._tcp.local.` → `my server`.
fn instance_name(fullname: &str) -> String {
    fullname.strip_suffix(SERVICE_TYPE).map_or(fullname, |n| n.trim_end_matches('.')).replace("\\.", ".")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn txt_records_say_version_tls_devices_and_implementation() {
        let a = Announcement { name: "lab-3240".into(), port: 3240, tls: TlsMode::Required, devices: 3 };
        let txt: BTreeMap<_, _> = a.txt().into_iter().collect();
        assert_eq!(txt["version"], "0111");
        assert_eq!(txt["tls"], "required");
        assert_eq!(txt["devices"], "3");
        assert_eq!(txt["impl"], "usbwire");
    }

    #[test]
    fn instance_names_come_back_unescaped() {
        assert_eq!(instance_name("lab-3240._usbip._tcp.local."), "lab-3240");
        assert_eq!(instance_name("a\\.b._usbip._tcp.local."), "a.b");
        let found = FoundServer {
            name: "x".into(),
            host: "x.local".into(),
            addresses: vec![],
            port: 3240,
            txt: [("tls".to_owned(), "required".to_owned())].into(),
        };
        assert!(found.requires_tls());
    }
}
