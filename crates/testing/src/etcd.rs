//! One real etcd member for tests of the lab registry through the real
//! binary: on free loopback ports, its data in the test's directory, killed
//! when dropped. The binary is `$USBWIRE_ETCD`, else `etcd` on the `PATH`
//! (Debian's etcd-server, which `scripts/test.sh` installs); without one,
//! [`Etcd::start`] says on stderr that the test skipped and returns `None`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::process::free_addr;

/// A running single-member etcd; killed (and its data removed) when dropped.
pub struct Etcd {
    process: Child,
    data: PathBuf,
    url: String,
}

impl Etcd {
    /// Starts a member named `name` with its data under `dir`; `None` (having
    /// said why on stderr) when there is no etcd binary.
    pub fn start(dir: &Path, name: &str) -> Option<Self> {
        let Some(binary) = binary() else {
            eprintln!("{name}: skipped, no etcd binary (install etcd-server or set USBWIRE_ETCD)");
            return None;
        };
        let (client, peer) = (free_addr(), free_addr());
        let data = dir.join(format!("etcd-{name}"));
        let process = Command::new(&binary)
            .args(["--name", name, "--data-dir"])
            .arg(&data)
            .args(["--listen-client-urls", &format!("http://{client}")])
            .args(["--advertise-client-urls", &format!("http://{client}")])
            .args(["--listen-peer-urls", &format!("http://{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://{peer}")])
            .args(["--initial-cluster", &format!("{name}=http://{peer}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("{} does not start: {error}", binary.display()));
        Some(Self { process, data, url: format!("etcd://{client}") })
    }

    /// The registry URL for `--registry` (`etcd://127.0.0.1:PORT`), without a prefix.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// `$USBWIRE_ETCD`, else the first `etcd` on the `PATH`.
fn binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("USBWIRE_ETCD") {
        return Some(PathBuf::from(path));
    }
    std::env::var_os("PATH")?.to_str()?.split(':').map(|dir| Path::new(dir).join("etcd")).find(|p| p.exists())
}
