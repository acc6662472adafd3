//! A closed stdout, as in `usbwire state | head -1`, with the real binary.
//!
//! Pins three things. A verb that prints a report (completions, man, version,
//! help, udev-rules, list, describe, state, bind/unbind/capture, bench,
//! doctor, the lab registry's verbs) ends quietly when its reader is gone, as
//! `ls | head` does: exit 0, and nothing on stderr about it (no panic, no
//! "Broken pipe"). A service verb (`serve`, `demo`, `redir`) does not die
//! with its stdout: its status lines are best effort, and it goes on serving.
//! And a failure whose error line finds stderr closed still exits with its
//! own code, not a panic's 101.
//!
//! "Closed" is a pipe whose read end was closed before the child started
//! (every write fails at once), or one read up to its first line and then
//! closed while the child still writes (`head -1`).

use std::io::Read as _;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use usbwire_testing::etcd::Etcd;
use usbwire_testing::process::{free_addr, scratch, start, Running};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn command(args: &[&str]) -> Command {
    let mut command = Command::new(BIN);
    // A registry default from the environment running the tests must not leak in.
    command.args(args).env_remove("USBWIRE_REGISTRY").stdin(Stdio::null());
    command
}

/// `usbwire ARGS` with stdout a pipe nobody reads: its read end closed before the child starts.
fn with_closed_stdout(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    command(args).stdout(writer).stderr(Stdio::piped()).output().expect("usbwire runs")
}

/// `usbwire ARGS | head -1`: its first line read, then the pipe closed while it may still write.
/// The pipe is made small (one page) so that a report of a few KiB cannot all fit in it.
fn read_one_line(args: &[&str]) -> Output {
    let (mut reader, writer) = std::io::pipe().expect("a pipe");
    shrink(&writer);
    let mut command = command(args);
    command.stdout(writer).stderr(Stdio::piped());
    let child = command.spawn().expect("usbwire runs");
    // Our copy of the write end goes with the command: the child holds the only one.
    drop(command);
    let mut byte = [0u8; 1];
    while reader.read(&mut byte).is_ok_and(|n| n == 1) && byte[0] != b'\n' {}
    drop(reader);
    child.wait_with_output().expect("usbwire ends")
}

/// The pipe's buffer down to one page (Linux: F_SETPIPE_SZ), so a writer of more blocks on it.
fn shrink(pipe: &impl std::os::fd::AsRawFd) {
    // SAFETY: fcntl on a descriptor we own; F_SETPIPE_SZ only resizes the pipe's buffer.
    let size = unsafe { libc::fcntl(pipe.as_raw_fd(), libc::F_SETPIPE_SZ, 4096) };
    assert!(size >= 4096, "F_SETPIPE_SZ: {}", std::io::Error::last_os_error());
}

/// Exit 0, and stderr says nothing of the closed pipe.
fn ended_quietly(args: &[&str], out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "usbwire {args:?} with its stdout closed: {stderr}");
    said_nothing_of_it(args, &stderr);
}

fn said_nothing_of_it(args: &[&str], stderr: &str) {
    for said in ["panicked", "Broken pipe", "failed printing", "RUST_BACKTRACE"] {
        assert!(!stderr.contains(said), "usbwire {args:?} said {said:?}: {stderr}");
    }
}

/// `usbwire ARGS` ends quietly with its stdout closed, both ways.
fn quiet(args: &[&str]) {
    ended_quietly(args, &with_closed_stdout(args));
    ended_quietly(args, &read_one_line(args));
}

/// For a verb whose outcome depends on this machine (its USB devices, vhci-hcd): one that
/// prints with an open stdout ends quietly with a closed one; one that fails before printing
/// fails the same way.
fn quiet_where_it_prints(args: &[&str]) {
    let open = command(args).output().expect("usbwire runs");
    let closed = with_closed_stdout(args);
    if open.stdout.is_empty() {
        assert_eq!(closed.status.code(), open.status.code(), "usbwire {args:?}");
        said_nothing_of_it(args, &String::from_utf8_lossy(&closed.stderr));
    } else {
        ended_quietly(args, &closed);
    }
}

#[test]
fn completions_man_version_and_help_end_quietly() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        quiet(&["completions", shell]);
    }
    quiet(&["man"]);
    quiet(&["version"]);
    quiet(&["version", "--json"]);
    // clap's own paths: -V, --help, `help VERB`.
    quiet(&["-V"]);
    quiet(&["--help"]);
    quiet(&["help", "serve"]);
    quiet(&["list", "--help"]);
}

#[test]
fn udev_rules_end_quietly() {
    let dir = scratch("closed_pipe", "udev");
    let config = dir.join("server.toml");
    std::fs::write(&config, "[[bind]]\ndevice = \"0781:5567\"\nalso = [\"serial=4C530001\", \"1-1.2\"]\n").unwrap();
    quiet(&["udev-rules", "--config", config.to_str().unwrap()]);
}

#[test]
fn this_machines_reports_end_quietly() {
    for args in [&["list", "-l"][..], &["list", "-l", "--json"], &["list", "-l", "-p"], &["port"], &["port", "--json"]]
    {
        quiet_where_it_prints(args);
    }
    // doctor prints every check, failed ones too (then exits 69): with nobody reading, 0.
    quiet(&["doctor", "--control", "/nonexistent/usbwire.sock"]);
    quiet(&["doctor", "--json", "--control", "/nonexistent/usbwire.sock"]);
}

/// `usbwire serve` with `devices` loopback devices, its control socket and bind state in `dir`.
fn serve(dir: &Path, devices: usize) -> (Running, String) {
    let addr = free_addr().to_string();
    let mut command = Command::new(BIN);
    command.args(["serve", "--no-advertise", "--listen", &addr, "--control"]).arg(dir.join("control.sock"));
    command.arg("--bind-state").arg(dir.join("binds"));
    for _ in 0..devices {
        command.args(["--virtual", "loopback"]);
    }
    (start(command, "usbwire serving on").ready(), addr)
}

#[test]
fn reports_from_a_server_end_quietly() {
    let dir = scratch("closed_pipe", "server");
    let (_server, addr) = serve(&dir, 1);
    let control = dir.join("control.sock");
    let control = control.to_str().unwrap();
    let capture = dir.join("capture");
    let capture = capture.to_str().unwrap();
    let cases: &[&[&str]] = &[
        &["list", "-r", &addr],
        &["list", "-r", &addr, "--json"],
        &["list", "-r", &addr, "-p"],
        &["-v", "list", "-r", &addr],
        &["describe", "-r", &addr, "-b", "0-1"],
        &["describe", "-r", &addr, "-b", "0-1", "--json"],
        &["state", "--control", control],
        &["state", "--json", "--control", control],
        &["bind", "--device", "0781:5567", "--control", control],
        &["unbind", "--device", "0781:5567", "--control", control],
        &["bind", "--device", "0781:5567", "--control", control],
        &["unbind", "--all", "--control", control],
        &["capture", capture, "--control", control],
        &["capture", "--stop", "--control", control],
    ];
    for args in cases {
        ended_quietly(args, &with_closed_stdout(args));
    }
    for args in [&["list", "-r", &addr][..], &["describe", "-r", &addr, "-b", "0-1"], &["state", "--control", control]]
    {
        ended_quietly(args, &read_one_line(args));
    }
    let bench =
        ["bench", "-r", &addr, "-b", "0-1", "--sizes", "512", "--depths", "1", "--seconds", "0.05", "--repeat", "1"];
    ended_quietly(&bench, &with_closed_stdout(&bench));
    let bench: Vec<&str> = bench.iter().copied().chain(["--json"]).collect();
    ended_quietly(&bench, &with_closed_stdout(&bench));
}

/// A report longer than the pipe holds: the write that fails comes after others went through.
#[test]
fn a_long_state_ends_quietly_when_its_reader_goes_midway() {
    let dir = scratch("closed_pipe", "long");
    let (_server, _) = serve(&dir, 192);
    let control = dir.join("control.sock");
    let args = ["state", "--control", control.to_str().unwrap()];
    let whole = command(&args).output().expect("usbwire runs");
    assert!(whole.status.success(), "{}", String::from_utf8_lossy(&whole.stderr));
    assert!(whole.stdout.len() > 2 * 4096, "{} bytes fit in the pipe", whole.stdout.len());
    ended_quietly(&args, &read_one_line(&args));
    ended_quietly(&args, &with_closed_stdout(&args));
}

/// Spawns `usbwire ARGS` with its stdout closed and its stderr in `dir`/stderr (read it with [`stderr_of`]).
fn spawn_with_closed_stdout(args: &[&str], dir: &Path) -> Child {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let stderr = std::fs::File::create(dir.join("stderr")).unwrap();
    command(args).stdout(writer).stderr(stderr).spawn().expect("usbwire runs")
}

fn stderr_of(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("stderr")).unwrap_or_default()
}

/// Waits (up to 60 s) until `ready` says yes, failing early if `child` exits.
fn until(child: &mut Child, dir: &Path, what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{what}: exited ({status}) with its stdout closed: {}", stderr_of(dir));
        }
        assert!(Instant::now() < deadline, "{what}: not ready after 60 s: {}", stderr_of(dir));
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn lists(addr: &str) -> bool {
    command(&["list", "-r", addr]).output().is_ok_and(|out| out.status.success())
}

/// Still running a while after it was ready; then stopped, having said nothing of its stdout.
fn runs_on(mut child: Child, dir: &Path, what: &str) {
    std::thread::sleep(Duration::from_millis(500));
    let ended = child.try_wait().unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let stderr = stderr_of(dir);
    assert!(ended.is_none(), "{what} exited ({ended:?}) with its stdout closed: {stderr}");
    said_nothing_of_it(&[what], &stderr);
}

#[test]
fn serve_keeps_serving_with_its_stdout_closed() {
    let dir = scratch("closed_pipe", "serve");
    let addr = free_addr().to_string();
    let control = dir.join("control.sock");
    let args = ["serve", "--no-advertise", "--virtual", "loopback", "--listen", &addr, "--control"];
    let mut child = spawn_with_closed_stdout(&[&args[..], &[control.to_str().unwrap()]].concat(), &dir);
    until(&mut child, &dir, "serve", || lists(&addr));
    let state = command(&["state", "--control", control.to_str().unwrap()]).output().unwrap();
    assert!(String::from_utf8_lossy(&state.stdout).contains("0-1"), "{}", String::from_utf8_lossy(&state.stderr));
    runs_on(child, &dir, "serve");
}

#[test]
fn demo_and_redir_keep_running_with_their_stdout_closed() {
    let dir = scratch("closed_pipe", "demo");
    let addr = free_addr().to_string();
    let control = dir.join("control.sock");
    let demo_dir = dir.join("demo");
    let args = ["demo", "--listen", &addr, "--control", control.to_str().unwrap(), "--dir", demo_dir.to_str().unwrap()];
    let mut child = spawn_with_closed_stdout(&args, &dir);
    until(&mut child, &dir, "demo", || lists(&addr));
    // The demo prints its listing, descriptors and a short benchmark after it listens.
    std::thread::sleep(Duration::from_secs(3));
    runs_on(child, &dir, "demo");

    let dir = scratch("closed_pipe", "redir");
    let (_server, addr) = serve(&dir, 1);
    let socket = dir.join("redir.sock");
    let listen = format!("unix:{}", socket.display());
    let mut child = spawn_with_closed_stdout(&["redir", "-r", &addr, "-b", "0-1", "--listen", &listen], &dir);
    until(&mut child, &dir, "redir", || socket.exists());
    runs_on(child, &dir, "redir");
}

/// The lab registry's verbs, with a real etcd (skipped without one).
#[test]
fn lab_registry_reports_end_quietly() {
    let dir = scratch("closed_pipe", "lab");
    let Some(etcd) = Etcd::start(&dir, "closed-pipe") else { return };
    let url = etcd.url().to_owned();
    let addr = free_addr().to_string();
    let mut command_line = Command::new(BIN);
    command_line
        .args(["serve", "--no-advertise", "--virtual", "loopback", "--listen", &addr, "--control"])
        .arg(dir.join("control.sock"))
        .args(["--registry", &url]);
    let _server = start(command_line, "usbwire serving on").ready();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !String::from_utf8_lossy(&command(&["who", "--registry", &url]).output().unwrap().stdout)
        .contains("1 registered")
    {
        assert!(Instant::now() < deadline, "the server did not register");
        std::thread::sleep(Duration::from_millis(200));
    }
    for args in [
        &["list", "--registry", &url][..],
        &["list", "--registry", &url, "--json"],
        &["list", "--registry", &url, "--watch"],
        &["list", "--registry", &url, "--watch", "--json"],
        &["list", "--registry", &url, "--json-lines"],
        &["list", "--registry", &url, "--watch", "--json-lines"],
        &["who", "--registry", &url, "--json"],
        &["reserve", "--registry", &url, "--device", "0-1", "--for", "1m"],
        &["who", "--registry", &url],
        &["release", "--registry", &url, "--device", "0-1"],
    ] {
        ended_quietly(args, &with_closed_stdout(args));
    }
}

/// The error line goes to a closed stderr: the exit code is still the failure's (69), not a
/// panic's (101).
#[test]
fn a_failure_with_its_stderr_closed_keeps_its_exit_code() {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = command(&["state", "--control", "/nonexistent/usbwire.sock"])
        .stdout(Stdio::piped())
        .stderr(writer)
        .output()
        .expect("usbwire runs");
    assert_eq!(out.status.code(), Some(69));
}
