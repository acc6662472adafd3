//! The relay status file of a port, `/var/run/vhci_hcd/usbwire-portN.json`:
//! written by `attach`'s relay ([`RelayStatusFile`]), read by `port`
//! ([`relay_status`]). Not for vhci-hcd's own record of the port
//! (`usbwire_client::vhci::read_record`).

use serde_json::json;
use usbwire_client::follow::FollowStatus;
use usbwire_client::vhci;

/// `/var/run/vhci_hcd/usbwire-portN.json`: the relay behind a port and what
/// it is doing (and, with `--follow`, the bus id it follows and how often it
/// attached it again), for `usbwire port`. Moves with a followed device to
/// its new port; removed when the relay ends.
pub(super) struct RelayStatusFile {
    /// Where the files go: [`vhci::RECORD_DIR`] (another directory in tests).
    dir: std::path::PathBuf,
    path: std::path::PathBuf,
    server: String,
    followed: Option<String>,
    auto_attach: bool,
}

impl RelayStatusFile {
    /// The file of the relay to `server`; `followed`: the bus id followed, and
    /// whether it is kept attached whatever ends it (`--auto-attach`).
    pub(super) fn create(
        first: FollowStatus,
        server: std::net::SocketAddr,
        followed: Option<(&usbwire_proto::op::BusId, bool)>,
    ) -> Self {
        Self::create_in(std::path::Path::new(vhci::RECORD_DIR), first, server, followed)
    }

    fn create_in(
        dir: &std::path::Path,
        first: FollowStatus,
        server: std::net::SocketAddr,
        followed: Option<(&usbwire_proto::op::BusId, bool)>,
    ) -> Self {
        let mut file = Self {
            dir: dir.to_owned(),
            path: relay_status_path(dir, first.port),
            server: server.to_string(),
            followed: followed.map(|(busid, _)| busid.to_string()),
            auto_attach: followed.is_some_and(|(_, forever)| forever),
        };
        file.write(first);
        file
    }

    pub(super) fn write(&mut self, status: FollowStatus) {
        let path = relay_status_path(&self.dir, status.port);
        // Away, the port may be someone else's soon: nothing to say about it until attached again.
        if path != self.path || !status.attached {
            let _ = std::fs::remove_file(&self.path);
            self.path = path;
        }
        if !status.attached {
            return;
        }
        let (name, since) = match status.relay {
            usbwire_client::relay::RelayState::Connected => ("connected", None),
            usbwire_client::relay::RelayState::Resuming { since } => {
                let ago = since.elapsed();
                let at = std::time::SystemTime::now() - ago;
                ("resuming", at.duration_since(std::time::UNIX_EPOCH).ok().map(|d| d.as_secs()))
            }
        };
        let mut body =
            json!({ "pid": std::process::id(), "server": self.server, "state": name, "resuming_since": since });
        if let Some(busid) = &self.followed {
            body["follow"] = json!({
                "busid": busid,
                "reattached": status.reattached,
                "vendor_id": format!("{:04x}", status.vendor_id),
                "product_id": format!("{:04x}", status.product_id),
            });
        }
        if self.auto_attach {
            body["auto_attach"] = json!(true);
        }
        if let Some(storage) = status.storage {
            body["storage"] = json!(storage);
        }
        // 0644: `usbwire port` reads it as any user, as vhci-hcd's own records.
        let _ = usbwire_server::private_dir::replace_file(&self.path, body.to_string().as_bytes(), 0o644);
    }
}

impl Drop for RelayStatusFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn relay_status_path(dir: &std::path::Path, port: u32) -> std::path::PathBuf {
    dir.join(format!("usbwire-port{port}.json"))
}

/// The relay status of a port, if a live relay serves it.
pub(super) fn relay_status(port: u32) -> Option<serde_json::Value> {
    relay_status_in(std::path::Path::new(vhci::RECORD_DIR), port)
}

fn relay_status_in(dir: &std::path::Path, port: u32) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(relay_status_path(dir, port)).ok()?;
    let status: serde_json::Value = serde_json::from_str(&text).ok()?;
    let pid = status.get("pid")?.as_u64()?;
    // A relay that died without cleaning up left a stale file.
    std::path::Path::new(&format!("/proc/{pid}")).exists().then_some(status)
}

#[cfg(test)]
mod tests;
