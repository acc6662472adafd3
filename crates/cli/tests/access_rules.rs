//! Access rules apply to every client, through the real `usbwire` binary: a
//! plain client on a TLS server is the identity `plain`, `--allow '*'` must be
//! asked for by name, `server = "discover"` needs TLS and a pinned key, and a
//! plain server on a non-loopback address says what it exposes.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use usbwire_testing::process::Scratch;

use usbwire_testing::process::{start, Running, Started};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn scratch(name: &str) -> Scratch {
    usbwire_testing::process::scratch("access", name)
}

fn usbwire(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A running `usbwire serve`, killed when dropped.
struct Served {
    running: Running,
    addr: String,
}

impl Served {
    /// Stops the server and returns everything it wrote to stderr.
    fn stop(self) -> String {
        self.running.stop()
    }
}

/// `usbwire serve ARGS --control DIR/control.sock`: the server once it
/// listens, or its exit code and stderr when it refused to start.
fn serve(dir: &Path, args: &[&str]) -> Result<Served, (Option<i32>, String)> {
    let mut command = Command::new(BIN);
    command.arg("serve").args(args).arg("--control").arg(dir.join("control.sock"));
    match start(command, "usbwire serving on ") {
        Started::Ready(running) => {
            let addr = running.line().trim_start_matches("usbwire serving on ").trim().to_owned();
            Ok(Served { running, addr })
        }
        Started::Exited { code, stderr } => Err((code, stderr)),
    }
}

/// A client identity directory and its fingerprint.
fn identity(dir: &Path) -> String {
    let out = usbwire(&["identity", "--create", "--json", "--dir", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["fingerprint"].as_str().unwrap().to_owned()
}

fn busids(out: &Output) -> Vec<String> {
    assert!(out.status.success(), "list failed: {}", stderr_of(out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json["devices"].as_array().unwrap().iter().map(|d| d["busid"].as_str().unwrap().to_owned()).collect()
}

/// A TLS server (plain accepted from loopback) exporting loopback devices 0-1
/// and 0-2, where `alice` may use 0-1 and `extra` rules follow.
fn tls_server(dir: &Path, alice: &str, extra: &str) -> Served {
    let config = dir.join("server.toml");
    std::fs::write(
        &config,
        format!(
            "tls = true\nallow_plain = \"loopback\"\nidentity = {:?}\n\n[[allow]]\nclient = \"{alice}\"\ndevices = [\"0-1\"]\n{extra}",
            dir.join("server-identity").to_str().unwrap()
        ),
    )
    .unwrap();
    let args = ["--listen", "127.0.0.1:0", "--config", config.to_str().unwrap(), "--virtual", "loopback"];
    serve(dir, &[&args[..], &["--virtual", "loopback"]].concat()).unwrap_or_else(|e| panic!("server: {e:?}"))
}

#[test]
fn a_plain_client_on_a_tls_server_sees_and_imports_nothing_unless_a_rule_names_plain() {
    let dir = scratch("plain-on-tls");
    let alice_dir = dir.join("alice");
    let alice = identity(&alice_dir);
    let served = tls_server(&dir, &alice, "");
    // Alice, over TLS, sees exactly her device: the rules are in force.
    let tls = ["--tls", "--trust-new", "--identity", alice_dir.to_str().unwrap()];
    assert_eq!(busids(&usbwire(&[&["list", "-r", &served.addr, "--json"][..], &tls[..]].concat())), ["0-1"]);
    // A plain client from 127.0.0.1 is accepted (--allow-plain loopback) but is the identity
    // `plain`, which no rule names: it sees nothing and its import is refused, and since the
    // server shows its devices to TLS clients only, it is told to add --tls rather than shown
    // an empty list (exit 77, not admitted).
    for list in [
        &["list", "-r", &served.addr][..],
        &["list", "-r", &served.addr, "--json"],
        &["list", "-r", &served.addr, "-p"],
    ] {
        let out = usbwire(list);
        assert_eq!(out.status.code(), Some(77), "{list:?}: {}", stderr_of(&out));
        assert!(stderr_of(&out).contains("TLS clients only: add --tls"), "{list:?}: {}", stderr_of(&out));
        assert!(out.stdout.is_empty(), "{list:?}: no empty list printed");
    }
    for busid in ["0-1", "0-2"] {
        let out = usbwire(&["describe", "-r", &served.addr, "-b", busid]);
        assert!(
            !out.status.success(),
            "plain import of {busid} must be refused: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(stderr_of(&out).contains("add --tls"), "the refusal says why: {}", stderr_of(&out));
    }
    let doctor = usbwire(&["doctor", "-r", &served.addr, "--identity", alice_dir.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&doctor.stdout);
    assert!(said.contains("shows its devices to TLS clients only"), "{said}");
    assert!(!said.contains("0 devices available"), "{said}");
    // An identity that has not pinned this server yet: the suggested command carries it.
    let carol_dir = dir.join("carol");
    identity(&carol_dir);
    let doctor = usbwire(&["doctor", "-r", &served.addr, "--identity", carol_dir.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&doctor.stdout);
    let suggested = format!("--tls --trust-new --identity {}`", carol_dir.display());
    assert!(said.contains(&suggested), "{said}");
    drop(served);

    // A rule naming `plain` gives it that device, and only that one.
    let dir = scratch("plain-rule");
    let served = tls_server(&dir, &alice, "\n[[allow]]\nclient = \"plain\"\ndevices = [\"0-2\"]\n");
    assert_eq!(busids(&usbwire(&["list", "-r", &served.addr, "--json"])), ["0-2"]);
    let out = usbwire(&["describe", "-r", &served.addr, "-b", "0-2"]);
    assert!(out.status.success(), "plain import of 0-2 must work: {}", stderr_of(&out));
    let out = usbwire(&["describe", "-r", &served.addr, "-b", "0-1"]);
    assert!(!out.status.success(), "0-1 is Alice's only");
    drop(served);

    // A rule naming `plain` that gives it nothing: an empty list is the server's real answer.
    let dir = scratch("plain-nothing");
    let served = tls_server(&dir, &alice, "\n[[allow]]\nclient = \"plain\"\ndevices = [\"9-9\"]\n");
    assert!(busids(&usbwire(&["list", "-r", &served.addr, "--json"])).is_empty());
}

#[test]
fn allow_star_is_refused_without_allow_any_client() {
    let dir = scratch("star");
    let server_identity = dir.join("server-identity");
    let base = ["--listen", "127.0.0.1:0", "--tls", "--identity", server_identity.to_str().unwrap()];
    let base = [&base[..], &["--virtual", "loopback", "--allow", "*"]].concat();
    let (code, stderr) = serve(&dir, &base).err().expect("--allow '*' alone must be refused");
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("add --allow-any-client"), "{stderr}");

    // Asked for by name: accepted, and any self-made key is then admitted.
    let served = serve(&dir, &[&base[..], &["--allow-any-client"]].concat()).expect("--allow-any-client");
    let stranger = dir.join("stranger");
    identity(&stranger);
    let out = usbwire(&[
        "list",
        "-r",
        &served.addr,
        "--json",
        "--tls",
        "--trust-new",
        "--identity",
        stranger.to_str().unwrap(),
    ]);
    assert_eq!(busids(&out), ["0-1"]);
    drop(served);

    // The same rule in the config file needs allow_any_client = true.
    let config = dir.join("star.toml");
    let rules = "tls = true\n[[allow]]\nclient = \"*\"\ndevices = [\"*\"]\n";
    std::fs::write(&config, rules).unwrap();
    let file_args = [
        "--listen",
        "127.0.0.1:0",
        "--config",
        config.to_str().unwrap(),
        "--identity",
        server_identity.to_str().unwrap(),
    ];
    let (code, stderr) = serve(&dir, &file_args).err().expect("client = \"*\" alone must be refused");
    assert_eq!(code, Some(78), "{stderr}");
    assert!(stderr.contains("allow_any_client = true"), "{stderr}");
    std::fs::write(&config, format!("allow_any_client = true\n{rules}")).unwrap();
    serve(&dir, &file_args).expect("allow_any_client = true").stop();
}

/// Runs `usbwire client --config FILE`, killing it if it is still running after 30 s.
fn client_service(config: &Path) -> (Option<i32>, String) {
    let mut child = Command::new(BIN)
        .args(["client", "--config", config.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the client service kept running instead of refusing its config");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code(), stderr_of(&out))
}

#[test]
fn discover_without_tls_or_without_a_pinned_key_is_refused_at_load() {
    let dir = scratch("discover");
    let identity_dir = dir.join("identity");
    let config = dir.join("client.toml");
    let rule = "[[attach]]\nserver = \"discover\"\ndevice = \"0483:5740\"\n";
    std::fs::write(&config, format!("identity = {:?}\n{rule}tls = false\n", identity_dir.to_str().unwrap())).unwrap();
    let (code, stderr) = client_service(&config);
    assert_eq!(code, Some(78), "{stderr}");
    assert!(stderr.contains("server = \"discover\" needs tls = true"), "{stderr}");
    assert!(stderr.contains("any machine on the local network"), "the reason: {stderr}");
    assert!(stderr.contains("--trust-new"), "what to do: {stderr}");

    // TLS, but no server key pinned: every discovered server would be refused.
    std::fs::write(&config, format!("identity = {:?}\n{rule}tls = true\n", identity_dir.to_str().unwrap())).unwrap();
    let (code, stderr) = client_service(&config);
    assert_eq!(code, Some(78), "{stderr}");
    assert!(stderr.contains("pins none"), "{stderr}");
    assert!(stderr.contains("usbwire list -r HOST:PORT --tls --trust-new"), "{stderr}");
}

const OPEN_WARNING: &str = "any host that can reach this port can list, import and use";

#[test]
fn a_plain_server_on_a_non_loopback_address_warns_once() {
    let dir = scratch("open");
    // 0.0.0.0 with a free port (nothing but loopback connects to it here).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let open = format!("0.0.0.0:{port}");
    let served = serve(&dir, &["--listen", &open, "--no-advertise", "--virtual", "loopback"]).expect("plain server");
    let local = format!("127.0.0.1:{port}");
    assert_eq!(busids(&usbwire(&["list", "-r", &local, "--json"])), ["0-1"]);
    let stderr = served.stop();
    assert_eq!(stderr.matches(OPEN_WARNING).count(), 1, "{stderr}");
    assert!(stderr.contains("WARN"), "{stderr}");
    assert!(stderr.contains("every device this server exports"), "{stderr}");

    // Loopback only: nobody else can reach it, nothing to say.
    let served = serve(&dir, &["--listen", "127.0.0.1:0", "--virtual", "loopback"]).expect("loopback server");
    let stderr = served.stop();
    assert!(!stderr.contains(OPEN_WARNING), "{stderr}");

    // TLS with plain from loopback only: not open either.
    let id = dir.join("id");
    let tls = ["--tls", "--identity", id.to_str().unwrap(), "--allow-plain", "loopback"];
    let served =
        serve(&dir, &[&["--listen", open.as_str(), "--no-advertise"][..], &tls[..]].concat()).expect("tls server");
    let stderr = served.stop();
    assert!(!stderr.contains(OPEN_WARNING), "{stderr}");
}
