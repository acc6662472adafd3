//! Habits from usbip and usbipd-win, with the real binary: `bind --device`
//! kept across a server restart (usbipd-win's `bind --hardware-id`), `unbind
//! --all`, `usbwire version` / `-V` with the protocol's version, the default
//! lab registry from `USBWIRE_REGISTRY` or the user's usbwire.toml, and `list
//! -p` (usbip's parsable lines). Then issue 32's item 10: the HTTP limits
//! logged only with HTTP. Then issue 32's item 10: `state` lists the bind
//! rules and the HTTP limits logged only with HTTP. Then issue 32's item 10:
//! `state` lists the bind rules, `unbind --all` says what it did to each and
//! the HTTP limits logged only with HTTP. Then issue 32's item 10: `state`
//! lists the bind rules, `unbind --all` says what it did to each, `--tcp-
//! port` before the verb (as usbip places it) and the HTTP limits logged only
//! with HTTP. Then issue 32's item 10: `state` lists the bind rules, `unbind
//! --all` says what it did to each, `--tcp-port` before the verb (as usbip
//! places it), `[[virtual]]` typos at their own line and the HTTP limits
//! logged only with HTTP. Then issue 32's item 10: `state` lists the bind
//! rules, `unbind --all` says what it did to each, `--tcp-port` before the
//! verb (as usbip places it), `[[virtual]]` in usbwire.toml(5) and its typos
//! at their own line and the HTTP limits logged only with HTTP. Then issue
//! 32's item 10: `state` lists the bind rules, `unbind --all` says what it
//! did to each, `--tcp-port` before the verb (as usbip places it),
//! `[[virtual]]` in usbwire.toml(5) and its typos at their own line, `redir`
//! of a bus id the server does not export and its socket after SIGINT and the
//! HTTP limits logged only with HTTP.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Output};

use usbwire_testing::process::{free_addr, scratch, start, Running};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn usbwire(args: &[&str]) -> Output {
    // A registry default from the environment running the tests must not leak in.
    Command::new(BIN).args(args).env_remove("USBWIRE_REGISTRY").output().expect("usbwire runs")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// An empty server (real devices only, like usbipd) keeping its binds in `dir/state/binds`.
fn serve(dir: &Path) -> Running {
    serve_with(dir, &[])
}

/// [`serve`] with `extra` arguments.
fn serve_with(dir: &Path, extra: &[&str]) -> Running {
    let mut command = Command::new(BIN);
    command
        .args(["serve", "--no-advertise", "--listen", &free_addr().to_string(), "--control"])
        .arg(dir.join("control.sock"))
        .arg("--bind-state")
        .arg(dir.join("state/binds"))
        .args(extra);
    start(command, "usbwire serving").ready()
}

#[test]
fn a_bind_by_device_is_kept_across_a_restart_until_unbound() {
    let dir = scratch("habits", "bind");
    let control = dir.join("control.sock");
    let control = control.to_str().expect("path");
    let state = dir.join("state/binds");
    let server = serve(&dir);
    // No such device is plugged in (this machine's real devices are not ours to take): the rule waits.
    let out = usbwire(&["bind", "--device", "0781:5567", "--control", control]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("exported when one is") && text(&out).contains("kept across server restarts"));
    let kept = std::fs::read_to_string(&state).expect("the bind state file");
    assert!(kept.lines().any(|line| line == "0781:5567"), "{kept}");
    assert_eq!(std::fs::metadata(&state).expect("state file").permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::metadata(dir.join("state")).expect("state dir").permissions().mode() & 0o777, 0o700);
    let stderr = server.stop();
    assert!(!stderr.contains("cannot write the bind state file"), "{stderr}");

    // A new server reads the rule back: it is there to unbind.
    let server = serve(&dir);
    let out = usbwire(&["unbind", "--device", "0781:5567", "--control", control]);
    assert!(out.status.success(), "the rule came back with the restart: {}", text(&out));
    assert!(!std::fs::read_to_string(&state).expect("state").contains("0781:5567"), "forgotten for good");
    let out = usbwire(&["unbind", "--device", "0781:5567", "--control", control]);
    assert_eq!(out.status.code(), Some(65), "{}", text(&out));
    assert!(text(&out).contains("no bind matches 0781:5567"), "{}", text(&out));

    // unbind --all forgets every rule, kept or not.
    for rule in ["serial=NOT-HERE-1", "class=fe"] {
        let out = usbwire(&["bind", "--device", rule, "--control", control]);
        assert!(out.status.success(), "{}", text(&out));
    }
    let out = usbwire(&["unbind", "--all", "--control", control]);
    assert!(out.status.success(), "{}", text(&out));
    let left = std::fs::read_to_string(&state).expect("state");
    assert!(left.lines().all(|line| line.starts_with('#')), "{left}");
    drop(server);
    let server = serve(&dir);
    let out = usbwire(&["unbind", "--device", "class=fe", "--control", control]);
    assert_eq!(out.status.code(), Some(65), "unbind --all was kept too: {}", text(&out));
    drop(server);

    // Neither flag, or both: a usage error.
    assert_eq!(usbwire(&["bind", "--control", control]).status.code(), Some(64));
    assert_eq!(usbwire(&["unbind", "--all", "-b", "1-1", "--control", control]).status.code(), Some(64));
}

#[test]
fn a_bind_state_file_others_could_write_is_not_read() {
    let dir = scratch("habits", "open-state");
    std::fs::create_dir(dir.join("state")).expect("state dir");
    std::fs::write(dir.join("state/binds"), "0781:5567\n").expect("planted binds");
    std::fs::set_permissions(dir.join("state"), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let server = serve(&dir);
    let control = dir.join("control.sock");
    let out = usbwire(&["unbind", "--device", "0781:5567", "--control", control.to_str().expect("path")]);
    assert_eq!(out.status.code(), Some(65), "a planted bind was taken: {}", text(&out));
    let stderr = server.stop();
    assert!(stderr.contains("cannot read the bind state file"), "{stderr}");
}

#[test]
fn version_names_the_usbip_protocol_and_our_extensions() {
    for args in [&["version"][..], &["-V"][..]] {
        let out = usbwire(args);
        assert!(out.status.success());
        let said = text(&out);
        assert!(said.starts_with("usbwire 0."), "{said}");
        assert!(said.contains("USB/IP protocol 1.1.1 (0x0111)"), "{said}");
        assert!(said.contains("devstate 2 (OP 0x80f1)") && said.contains("resume 2 (OP 0x80f3)"), "{said}");
    }
    let out = usbwire(&["version", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("version --json");
    assert_eq!(json["usbip_version_code"], "0x0111");
    assert_eq!(json["extensions"][1]["name"], "transforms");
}

#[test]
fn registry_verbs_default_to_usbwire_registry_then_the_users_usbwire_toml() {
    let dir = scratch("habits", "registry");
    let config = dir.join("usbwire.toml");
    let run = |args: &[&str], registry: Option<&str>| {
        let mut command = Command::new(BIN);
        command.args(args).env("USBWIRE_CONFIG", &config).env_remove("USBWIRE_REGISTRY");
        if let Some(url) = registry {
            command.env("USBWIRE_REGISTRY", url);
        }
        command.output().expect("usbwire runs")
    };
    // Nothing named: a usage error that says every way to name one.
    let out = run(&["who"], None);
    assert_eq!(out.status.code(), Some(64), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains("--registry") && said.contains("USBWIRE_REGISTRY") && said.contains("usbwire.toml"),
        "{said}"
    );
    // The environment (nothing listens on port 1: the error names the registry it tried).
    let out = run(&["who"], Some("etcd://127.0.0.1:1/from-env"));
    assert_eq!(out.status.code(), Some(69), "{}", text(&out));
    assert!(text(&out).contains("127.0.0.1:1"), "{}", text(&out));
    // The user's usbwire.toml, for a bare --registry too.
    std::fs::write(&config, "[registry]\nendpoints = [\"127.0.0.1:2\"]\nprefix = \"from-file\"\n").expect("config");
    for args in [&["who"][..], &["list", "--registry"][..], &["release", "--device", "1-1"][..]] {
        let out = run(args, None);
        assert_eq!(out.status.code(), Some(69), "{args:?}: {}", text(&out));
        assert!(text(&out).contains("127.0.0.1:2"), "{args:?}: {}", text(&out));
    }
    // The flag wins over both.
    let out = run(&["who", "--registry", "etcd://127.0.0.1:3"], Some("etcd://127.0.0.1:1"));
    assert!(text(&out).contains("127.0.0.1:3") && !text(&out).contains("127.0.0.1:1"), "{}", text(&out));
    // A config with a typo says where.
    std::fs::write(&config, "[registy]\n").expect("config");
    let out = run(&["who"], None);
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(text(&out).contains("usbwire.toml"), "{}", text(&out));
    // `who --help` does not call --registry required.
    let help = String::from_utf8_lossy(&usbwire(&["who", "--help"]).stdout).to_lowercase();
    assert!(!help.contains("required") && help.contains("usbwire_registry"), "{help}");
}

#[test]
fn list_p_prints_usbips_parsable_lines() {
    let dir = scratch("habits", "list-p");
    let addr = free_addr().to_string();
    let mut command = Command::new(BIN);
    command.args(["serve", "--no-advertise", "--listen", &addr, "--control"]).arg(dir.join("control.sock"));
    for device in ["keyboard", "mouse", "loopback", "serial"] {
        command.args(["--virtual", device]);
    }
    let _server = start(command, "usbwire serving").ready();
    // Golden: `usbip list -p`'s "busid=%s#usbid=%.4s:%.4s#\n" for each device, nothing else.
    let golden = "busid=0-1#usbid=1209:0001#\n\
                  busid=0-2#usbid=1209:0002#\n\
                  busid=0-3#usbid=1209:0005#\n\
                  busid=0-4#usbid=1209:0004#\n";
    for args in [&["list", "-p", "-r", &addr][..], &["list", "-r", &addr, "--parsable"][..]] {
        let out = usbwire(args);
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        assert_eq!(String::from_utf8_lossy(&out.stdout), golden, "{args:?}");
        assert!(out.stderr.is_empty(), "{}", text(&out));
    }
    // A device in use is not exportable, so not listed (as usbipd lists it).
    let held = std::net::TcpStream::connect(&addr).expect("connect");
    import(&held, "0-2");
    let out = usbwire(&["list", "-p", "-r", &addr]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), golden.replace("busid=0-2#usbid=1209:0002#\n", ""));
    // This machine: exactly usbip's lines for what it has plugged in (here: whatever that is, one per line).
    let out = usbwire(&["list", "-p", "-l"]);
    assert!(out.status.success(), "{}", text(&out));
    let local = String::from_utf8_lossy(&out.stdout);
    assert!(local.lines().all(|line| line.starts_with("busid=") && line.contains("#usbid=")), "{local}");
    // -p is a format of its own: not with --json.
    assert_eq!(usbwire(&["list", "-p", "--json", "-r", &addr]).status.code(), Some(64));
}

/// Imports `busid` on `stream` (OP_REQ_IMPORT) and checks the server agreed.
fn import(mut stream: &std::net::TcpStream, busid: &str) {
    use std::io::{Read as _, Write as _};
    let mut request = vec![0x01, 0x11, 0x80, 0x03, 0, 0, 0, 0];
    let mut name = [0u8; 32];
    name[..busid.len()].copy_from_slice(busid.as_bytes());
    request.extend_from_slice(&name);
    stream.write_all(&request).expect("import request");
    let mut reply = [0u8; 8];
    stream.read_exact(&mut reply).expect("import reply");
    assert_eq!(&reply[4..], &[0, 0, 0, 0], "import of {busid} refused");
}

/// The server's bind rules, as `state --json` shows them.
fn bind_rules(control: &str) -> serde_json::Value {
    let out = usbwire(&["state", "--json", "--control", control]);
    assert!(out.status.success(), "{}", text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("state --json");
    json["bind_rules"].clone()
}

#[test]
fn state_lists_the_bind_rules_and_what_each_exported() {
    let dir = scratch("habits", "state-rules");
    let control = dir.join("control.sock");
    let control = control.to_str().expect("path");
    // A rule from the server's command line, one by hand; no such device is plugged in here.
    let _server = serve_with(&dir, &["--bind", "0781:5568"]);
    let out = usbwire(&["bind", "--device", "0781:5567", "--control", control]);
    assert!(out.status.success(), "{}", text(&out));

    let out = usbwire(&["state", "--control", control]);
    assert!(out.status.success(), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let section = said.split("bind rules:").nth(1).unwrap_or_else(|| panic!("no bind rules section: {said}"));
    let line = |rule: &str| section.lines().find(|l| l.contains(rule)).unwrap_or_else(|| panic!("{rule}: {said}"));
    assert!(line("0781:5568").contains("config") && line("0781:5568").contains("waiting"), "{said}");
    assert!(line("0781:5567").contains("bind") && line("0781:5567").contains("waiting"), "{said}");

    let waiting = |rule: &str, source: &str| serde_json::json!({ "rule": rule, "source": source, "state": "waiting", "busids": [] });
    assert_eq!(bind_rules(control), serde_json::json!([waiting("0781:5568", "config"), waiting("0781:5567", "bind")]));
    let out = usbwire(&["unbind", "--device", "0781:5567", "--control", control]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(bind_rules(control), serde_json::json!([waiting("0781:5568", "config")]));
}

#[test]
fn unbind_all_says_what_happened_to_each_rule_and_device() {
    let dir = scratch("habits", "unbind-all");
    let control = dir.join("control.sock");
    let control = control.to_str().expect("path");
    let _server = serve(&dir);
    let out = usbwire(&["bind", "--device", "0781:5567", "--control", control]);
    assert!(out.status.success(), "{}", text(&out));
    let out = usbwire(&["unbind", "--all", "--control", control]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "unbind all: 1 rule forgotten (0781:5567), no device was exported\n"
    );
    for rule in ["serial=NOT-HERE-1", "class=fe"] {
        let out = usbwire(&["bind", "--device", rule, "--control", control]);
        assert!(out.status.success(), "{}", text(&out));
    }
    let out = usbwire(&["unbind", "--all", "--control", control]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "unbind all: 2 rules forgotten (serial=NOT-HERE-1, class=fe), no device was exported\n"
    );
    let out = usbwire(&["unbind", "--all", "--control", control]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "unbind all: no rule was bound by hand, no device was exported\n");
    let out = usbwire(&["bind", "--device", "0781:5567", "--control", control]);
    assert!(out.status.success(), "{}", text(&out));
    let out = usbwire(&["unbind", "--device", "0781:5567", "--control", control]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "unbind 0781:5567: 1 rule forgotten (0781:5567), no device was exported\n"
    );
}

/// A server of a keyboard (0-1) on a free port, with its control socket in `dir`
/// (the default one is every other test's, and other checkouts' too).
fn keyboard_server(dir: &Path, extra: &[&str]) -> (Running, std::net::SocketAddr) {
    let addr = free_addr();
    let mut command = Command::new(BIN);
    command
        .args(["serve", "--no-advertise", "--listen", &addr.to_string(), "--virtual", "keyboard", "--control"])
        .arg(dir.join("control.sock"))
        .args(extra);
    (start(command, "usbwire serving").ready(), addr)
}

/// `usbwire ARGS` that must end within 20 seconds (killed, and the test failed, if not).
fn usbwire_ending(args: &[&str]) -> Output {
    let mut command = Command::new(BIN);
    command.args(args);
    ending(command)
}

/// The output of `command`, which must end within 20 seconds (killed, and the test failed, if not).
fn ending(mut command: Command) -> Output {
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("usbwire runs");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!("{command:?} still ran after 20 s: {}", text(&out));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

#[test]
fn tcp_port_before_the_verb_means_what_it_means_after_it() {
    let dir = scratch("habits", "tcp-port");
    let (_server, addr) = keyboard_server(&dir, &[]);
    let port = addr.port().to_string();
    let other = free_addr().port().to_string();
    for args in [
        &["--tcp-port", &port, "list", "-p", "-r", "127.0.0.1"][..],
        &["list", "-p", "-r", "127.0.0.1", "--tcp-port", &port][..],
        &["--tcp-port", &port, "list", "-p", "-r", "127.0.0.1", "--tcp-port", &port][..],
        &["-q", "--tcp-port", &port, "list", "-p", "-r", "127.0.0.1"][..],
    ] {
        let out = usbwire(args);
        assert!(out.status.success(), "{args:?}: {}", text(&out));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "busid=0-1#usbid=1209:0001#\n", "{args:?}");
    }
    // Two different ports, or a port in HOST:PORT too: which one was meant is not ours to guess.
    for args in [
        &["--tcp-port", &other, "list", "-r", "127.0.0.1", "--tcp-port", &port][..],
        &["--tcp-port", &other, "list", "-r", &addr.to_string()][..],
    ] {
        let out = usbwire(args);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {}", text(&out));
        assert!(text(&out).contains(&other), "{args:?}: {}", text(&out));
    }
    // A verb that reaches no server by HOST takes none.
    let out = usbwire(&["--tcp-port", &port, "state"]);
    assert_eq!(out.status.code(), Some(64), "{}", text(&out));
    assert!(text(&out).contains("list -r"), "{}", text(&out));
}

/// `usbwire serve --config FILE` with `config` in FILE, which must be refused (78).
fn refused_config(dir: &Path, config: &str) -> String {
    let path = dir.join("server.toml");
    std::fs::write(&path, config).expect("config");
    let mut command = Command::new(BIN);
    command
        .args(["serve", "--no-advertise", "--listen", &free_addr().to_string(), "--config"])
        .arg(&path)
        .arg("--control")
        .arg(dir.join("control.sock"));
    let out = ending(command);
    assert_eq!(out.status.code(), Some(78), "{config}: {}", text(&out));
    text(&out)
}

#[test]
fn a_config_typo_is_reported_at_its_own_line() {
    let dir = scratch("habits", "typo");
    for (config, line, key) in [
        ("listen = \"127.0.0.1:1\"\n\n[[virtual]]\nkind = \"disk\"\npath = \"d.img\"\nsise = \"1M\"\n", 6, "sise"),
        // Before its kind: no kind has such a key.
        ("[[virtual]]\nsise = \"1M\"\nkind = \"disk\"\npath = \"d.img\"\n", 2, "sise"),
        // A key of another kind.
        (
            "[[virtual]]\nkind = \"keyboard\"\n\n[[virtual]]\nkind = \"disk\"\npath = \"d.img\"\nlink = \"/tmp/x\"\n",
            7,
            "link",
        ),
        ("[[virtual]]\nkind = \"keyboard\"\nspeed = \"super\"\n", 3, "speed"),
    ] {
        let said = refused_config(&dir, config);
        assert!(said.contains(&format!("line {line}, column 1")), "{config}: {said}");
        assert!(said.contains(&format!("`{key}`")), "{config}: {said}");
    }
    // An unknown kind, at its value.
    let said = refused_config(&dir, "[[virtual]]\nkind = \"webcam\"\n");
    assert!(said.contains("line 2, column 8") && said.contains("\"webcam\""), "{said}");
}

#[test]
fn usbwire_toml_5_documents_every_virtual_kind_and_key_the_parser_takes() {
    let dir = scratch("habits", "man5");
    let out = usbwire(&["man", "--dir", dir.to_str().expect("path")]);
    assert!(out.status.success(), "{}", text(&out));
    let page = std::fs::read_to_string(dir.join("usbwire.toml.5")).expect("usbwire.toml(5)");
    let section = page.split(".SS \"[[virtual]]\"").nth(1).expect("a [[virtual]] section");
    let section = section.split(".SS").next().unwrap_or_default();
    // What the parser takes, in its own words: the kinds an unknown one is told, the keys of each.
    let said = refused_config(&dir, "[[virtual]]\nkind = \"no-such-kind\"\n");
    let kinds: Vec<&str> = said.split("one of ").nth(1).expect("kinds listed").split('`').skip(1).step_by(2).collect();
    for kind in ["keyboard", "mouse", "disk", "serial", "loopback", "dfu", "external"] {
        assert!(kinds.contains(&kind), "{kind} not among the parser's kinds: {said}");
    }
    let kind_line = section.lines().find(|l| l.starts_with("\\fBkind = ")).expect("kind documented");
    for kind in &kinds {
        assert!(kind_line.contains(&format!("\"{kind}\"")), "{kind} missing from {kind_line}");
        let said = refused_config(&dir, &format!("[[virtual]]\nkind = \"{kind}\"\nno_such_key = 1\n"));
        let keys: Vec<&str> =
            said.split("it takes ").nth(1).expect("keys listed").split('`').skip(1).step_by(2).collect();
        for key in keys {
            assert!(section.contains(&format!("\\fB{key} = ")), "{kind}'s {key} missing from:\n{section}");
        }
    }
    assert!(section.contains("\\fBsocket = ") && section.contains("external: "), "{section}");
}

#[test]
fn redir_refuses_a_bus_id_the_server_does_not_export() {
    let dir = scratch("habits", "redir");
    let (_server, addr) = keyboard_server(&dir, &[]);
    let addr = addr.to_string();
    let socket = dir.join("redir.sock");
    let listen = format!("unix:{}", socket.display());
    let out = usbwire_ending(&["redir", "-r", &addr, "-b", "0-9", "--listen", &listen]);
    assert_eq!(out.status.code(), Some(65), "{}", text(&out));
    assert!(text(&out).contains("exports no device 0-9") && text(&out).contains("0-1"), "{}", text(&out));
    assert!(!socket.exists(), "a socket was made for a device that is not there");
}

#[test]
fn redir_removes_its_socket_on_sigint_and_sigterm() {
    use std::os::unix::process::ExitStatusExt as _;
    let dir = scratch("habits", "redir-signal");
    let (_server, addr) = keyboard_server(&dir, &[]);
    let addr = addr.to_string();
    let socket = dir.join("redir.sock");
    let listen = format!("unix:{}", socket.display());
    for signal in [libc::SIGINT, libc::SIGTERM] {
        let mut command = Command::new(BIN);
        command.args(["redir", "-r", &addr, "-b", "0-1", "--listen", &listen]);
        let mut bridge = start(command, "usbredir for").ready();
        assert!(socket.exists(), "no socket while it listens");
        let pid = i32::try_from(bridge.child().id()).expect("pid");
        // SAFETY: a signal to our own child, which is still running (not reaped).
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
        let status = bridge.child().wait().expect("redir ends");
        assert_eq!((status.code(), status.signal()), (Some(0), None), "signal {signal}");
        assert!(!socket.exists(), "the socket was left behind after signal {signal}");
    }
}

#[test]
fn the_http_limits_are_logged_only_with_an_http_listener() {
    let dir = scratch("habits", "http-limits");
    for (extra, logged) in [(None, false), (Some("--http"), true), (Some("--metrics"), true)] {
        let http = free_addr().to_string();
        let extra: Vec<&str> = extra.map(|flag| vec![flag, http.as_str()]).unwrap_or_default();
        let (server, addr) = keyboard_server(&dir, &extra);
        // Once it answers USB/IP, it has set up (or not) its HTTP listeners.
        let out = usbwire(&["list", "-p", "-r", &addr.to_string()]);
        assert!(out.status.success(), "{}", text(&out));
        let stderr = server.stop();
        assert_eq!(stderr.contains("HTTP limits"), logged, "{extra:?}: {stderr}");
    }
}
