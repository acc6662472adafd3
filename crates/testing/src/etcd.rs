//! One real etcd member on free loopback ports, for tests of the lab
//! registry through the real binary: its data in the test's scratch
//! directory, killed and removed when dropped. The binary is
//! `$USBWIRE_ETCD`, else `etcd` on the `PATH` (Debian's etcd-server, which
//! `scripts/test.sh` installs); without one [`Etcd::start`] says so on
//! stderr and the test passes, as it cannot run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::process::free_addr;

/// A running etcd member (see the module docs).
pub struct Etcd {
    child: Child,
    data: PathBuf,
    url: String,
}

impl Etcd {
    /// A member named `name` with its data in `dir`/etcd; `None` (said on
    /// stderr for `test`) without an etcd binary.
    pub fn start(dir: &Path, name: &str) -> Option<Self> {
        let binary = std::env::var_os("USBWIRE_ETCD").unwrap_or_else(|| "etcd".into());
        let (client, peer) = (free_addr(), free_addr());
        let data = dir.join("etcd");
        let spawned = Command::new(&binary)
            .args(["--name", name, "--data-dir"])
            .arg(&data)
            .args(["--listen-client-urls", &format!("http://{client}")])
            .args(["--advertise-client-urls", &format!("http://{client}")])
            .args(["--listen-peer-urls", &format!("http://{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://{peer}")])
            .args(["--initial-cluster", &format!("{name}=http://{peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        match spawned {
            Ok(child) => {
                let etcd = Self { child, data, url: format!("etcd://{client}") };
                etcd.wait_listening(client);
                Some(etcd)
            }
            Err(error) => {
                eprintln!("{name}: skipped, no etcd binary ({error}; install etcd-server or set USBWIRE_ETCD)");
                None
            }
        }
    }

    /// Waits (up to 30 s) until the member takes connections on its client
    /// port, so a test's first request does not race its start.
    fn wait_listening(&self, client: std::net::SocketAddr) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::net::TcpStream::connect(client).is_err() {
            assert!(std::time::Instant::now() < deadline, "etcd does not listen on {client} after 30 s");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// `etcd://HOST:PORT`, as `--registry` takes it.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}
