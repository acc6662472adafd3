//! Discovery between two network namespaces joined by a veth pair (multicast
//! does not cross loopback): `usbwire list --discover` in one finds the server
//! running in the other, with its TXT records and devices; started with
//! `--no-advertise`, the server is not found. Needs root and iproute2.

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

/// Two namespaces, `a` (10.231.N.1) and `b` (10.231.N.2), deleted on drop.
struct Namespaces {
    a: String,
    b: String,
}

fn ip(args: &[&str]) -> Output {
    Command::new("ip").args(args).output().expect("iproute2 installed")
}

impl Namespaces {
    fn create() -> Option<Self> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let tag = std::process::id() % 100_000;
        let (a, b) = (format!("uwa{tag}"), format!("uwb{tag}"));
        let namespaces = Self { a: a.clone(), b: b.clone() };
        let subnet = tag % 250;
        let (va, vb) = (format!("uwva{tag}"), format!("uwvb{tag}"));
        for args in [
            vec!["netns", "add", &a],
            vec!["netns", "add", &b],
            vec!["link", "add", &va, "type", "veth", "peer", "name", &vb],
            vec!["link", "set", &va, "netns", &a],
            vec!["link", "set", &vb, "netns", &b],
        ] {
            let out = ip(&args);
            assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        for (ns, dev, host) in [(&a, &va, 1), (&b, &vb, 2)] {
            let address = format!("10.231.{subnet}.{host}/24");
            for args in [
                vec!["addr", "add", &address, "dev", dev],
                vec!["link", "set", dev, "up"],
                vec!["link", "set", "lo", "up"],
            ] {
                let out = Command::new("nsenter").arg(net(ns)).arg("ip").args(&args).output().unwrap();
                assert!(out.status.success(), "ip {args:?} in {ns}: {}", String::from_utf8_lossy(&out.stderr));
            }
        }
        Some(namespaces)
    }

    /// `BIN args` in the network namespace `ns`. nsenter switches only the
    /// network namespace; `ip netns exec` (and `ip -n`) also remount `/sys`,
    /// which fails where `/` is not a mount point (a chroot).
    fn run_in(&self, ns: &str, args: &[&str]) -> Command {
        let mut command = Command::new("nsenter");
        command.arg(net(ns)).arg(BIN).args(args);
        command
    }
}

/// nsenter's option for the named network namespace `ip netns add` made.
fn net(ns: &str) -> String {
    format!("--net=/run/netns/{ns}")
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it, and with it the pair.
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(namespaces: &Namespaces, control: &std::path::Path, extra: &[&str]) -> Server {
    let mut args =
        vec!["serve", "--listen", "0.0.0.0:3240", "--virtual", "keyboard", "--virtual", "loopback", "--control"];
    let control = control.to_str().unwrap();
    args.push(control);
    args.extend(extra);
    let child = namespaces.run_in(&namespaces.a, &args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    // Ready once the control socket answers.
    for _ in 0..100 {
        if std::os::unix::net::UnixStream::connect(control).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Server(child)
}

fn discover(namespaces: &Namespaces) -> serde_json::Value {
    let out = namespaces.run_in(&namespaces.b, &["list", "--discover", "--json", "--timeout", "4"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_client_in_another_namespace_finds_the_server_and_its_devices_unless_it_stays_quiet() {
    let Some(namespaces) = Namespaces::create() else {
        eprintln!("SKIPPED: discovery test needs root to create network namespaces");
        return;
    };
    let dir = usbwire_testing::process::scratch("discovery", "advertised");

    let server = serve(&namespaces, &dir.join("advertised.sock"), &[]);
    let found = discover(&namespaces);
    let servers = found["servers"].as_array().unwrap();
    assert_eq!(servers.len(), 1, "{found}");
    let server_record = &servers[0];
    assert_eq!(server_record["port"], 3240);
    assert!(server_record["addresses"].as_array().unwrap().iter().any(|a| a.as_str().unwrap().ends_with(".1")));
    assert_eq!(server_record["txt"]["version"], "0111");
    assert_eq!(server_record["txt"]["tls"], "off");
    assert_eq!(server_record["txt"]["devices"], "2");
    assert_eq!(server_record["txt"]["impl"], "usbwire");
    let ids: Vec<String> = server_record["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| format!("{}:{}", d["vendor_id"].as_str().unwrap(), d["product_id"].as_str().unwrap()))
        .collect();
    assert_eq!(ids, ["1209:0001", "1209:0005"], "{server_record}");
    drop(server);

    let quiet = serve(&namespaces, &dir.join("quiet.sock"), &["--no-advertise"]);
    let found = discover(&namespaces);
    assert_eq!(found["servers"].as_array().unwrap().len(), 0, "a --no-advertise server was found: {found}");
    drop(quiet);
    let _ = std::fs::remove_dir_all(&dir);
}
