//! Local files another user on the same machine could subvert, through the
//! real `usbwire` binary: the control socket's directory, the control
//! socket's peers (`SO_PEERCRED`), the socket the CLI sends to, and the
//! demo's disk image. The tests that need a second user run the binary as
//! uid 65534 (nobody) and need root; without root they say so and skip.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use usbwire_testing::process::Scratch;

use usbwire_testing::process::{start, Started};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");
const NOBODY: u32 = 65534;

fn scratch(name: &str) -> Scratch {
    let dir = usbwire_testing::process::scratch("local", name);
    chmod(&dir, 0o755);
    dir
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn chown(path: &Path, uid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid)).unwrap();
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

macro_rules! require_root {
    () => {
        if !is_root() {
            eprintln!("SKIPPED: this test runs the binary as uid {NOBODY} (nobody), which needs root");
            return;
        }
    };
}

/// `usbwire serve` as nobody, with the default control socket path, TMPDIR=`tmp`.
fn serve_as_nobody(tmp: &Path, xdg_runtime_dir: Option<&Path>) -> Started {
    let mut command = Command::new(BIN);
    command.args(["serve", "--listen", "127.0.0.1:0", "--no-advertise", "--virtual", "keyboard"]);
    command.uid(NOBODY).gid(NOBODY).env("TMPDIR", tmp).env_remove("XDG_RUNTIME_DIR");
    if let Some(dir) = xdg_runtime_dir {
        command.env("XDG_RUNTIME_DIR", dir);
    }
    start(command, "usbwire serving on ")
}

/// The server must have refused to start, saying `needle`.
fn assert_refused(started: Started, needle: &str) -> String {
    match started {
        Started::Ready(running) => {
            let stderr = running.stop();
            panic!("the server started with an unsafe control directory: {stderr}");
        }
        Started::Exited { code, stderr } => {
            assert_eq!(code, Some(78), "an unsafe directory is a configuration error: {stderr}");
            assert!(stderr.contains(needle), "expected {needle:?} in: {stderr}");
            stderr
        }
    }
}

fn socket_in(dir: &Path) -> bool {
    std::fs::read_dir(dir).map(|entries| entries.flatten().any(|e| e.file_name() == "control.sock")).unwrap_or(false)
}

#[test]
fn a_control_directory_another_user_made_or_can_change_is_refused() {
    require_root!();
    // TMPDIR for the server: sticky and world-writable, like /tmp.
    let tmp = scratch("tmpdir");
    chmod(&tmp, 0o1777);
    let dir = tmp.join(format!("usbwire-{NOBODY}"));

    // Another user (root here) made it first, open to everyone: the attack in the issue.
    std::fs::create_dir(&dir).unwrap();
    chmod(&dir, 0o777);
    let stderr = assert_refused(serve_as_nobody(&tmp, None), "belongs to uid 0");
    assert!(stderr.contains("another user"), "{stderr}");
    assert!(!socket_in(&dir), "no socket may be created in another user's directory");
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, 0o777, "left as it was");

    // Ours, but writable by everyone.
    chown(&dir, NOBODY);
    let stderr = assert_refused(serve_as_nobody(&tmp, None), "writable by other users");
    assert!(stderr.contains("mkdir -m 700") && !stderr.contains("chmod"), "{stderr}");
    assert!(!socket_in(&dir));

    // A symlink to a private directory of ours: still refused (whoever planted it chose where it points).
    std::fs::remove_dir(&dir).unwrap();
    let real = tmp.join("real");
    std::fs::create_dir(&real).unwrap();
    chmod(&real, 0o700);
    chown(&real, NOBODY);
    std::os::unix::fs::symlink(&real, &dir).unwrap();
    chown(&dir, NOBODY);
    assert_refused(serve_as_nobody(&tmp, None), "is a symbolic link");
    assert!(!socket_in(&real));

    // $XDG_RUNTIME_DIR that anyone may write to (without the sticky bit): our directory in it could be swapped.
    let xdg = tmp.join("xdg");
    std::fs::create_dir(&xdg).unwrap();
    chmod(&xdg, 0o777);
    assert_refused(serve_as_nobody(&tmp, Some(&xdg)), "other users own or may write to");
    assert!(!xdg.join("usbwire").exists(), "nothing is made in a directory others may swap");

    // Absent: created 0700, and the socket 0600, both the server's.
    std::fs::remove_file(&dir).unwrap();
    let Started::Ready(running) = serve_as_nobody(&tmp, None) else {
        panic!("the server must start in a fresh TMPDIR")
    };
    let meta = std::fs::symlink_metadata(&dir).unwrap();
    assert!(meta.is_dir());
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (NOBODY, 0o700));
    let socket = std::fs::symlink_metadata(dir.join("control.sock")).unwrap();
    assert_eq!((socket.uid(), socket.mode() & 0o777), (NOBODY, 0o600));
    running.stop();
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn a_control_client_running_as_another_user_is_refused_by_so_peercred() {
    require_root!();
    let dir = scratch("peercred");
    let control = dir.join("control.sock");
    let mut command = Command::new(BIN);
    command.args(["serve", "--listen", "127.0.0.1:0", "--virtual", "keyboard", "--control"]).arg(&control);
    let Started::Ready(server) = start(command, "usbwire serving on ") else { panic!("server did not start") };
    // Open the socket file to everyone: only the peer check stands between nobody and the server.
    chmod(&control, 0o666);
    let out = Command::new(BIN)
        .args(["state", "--json", "--control"])
        .arg(&control)
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "uid {NOBODY} must be refused: {}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.contains("answers only uid 0 and root, not uid 65534"), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("keyboard"), "nothing answered to nobody");
    // The server's own user still gets its answer.
    let out = Command::new(BIN).args(["state", "--json", "--control"]).arg(&control).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("keyboard"));
    let log = server.stop();
    assert!(log.contains("control connection refused") && log.contains("peer_uid=65534"), "{log}");
}

/// Runs `usbwire type --control SOCKET secret` against a listener the test
/// holds; returns the exit code, stderr, and whether the listener was contacted.
fn type_into(socket: &Path, listener: &std::os::unix::net::UnixListener) -> (Option<i32>, String, bool) {
    listener.set_nonblocking(true).unwrap();
    let mut child = Command::new(BIN)
        .args(["type", "--control"])
        .arg(socket)
        .arg("secret")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut contacted = false;
    while child.try_wait().unwrap().is_none() {
        if listener.accept().is_ok() {
            // Whatever it sent is what another user would have read; end the exchange.
            contacted = true;
        }
        if Instant::now() > deadline || contacted {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned(), contacted)
}

#[test]
fn the_cli_sends_nothing_to_a_socket_another_user_owns() {
    require_root!();
    let base = scratch("planted");
    // Another (non-root) user's directory and socket where the server's socket should be.
    let theirs = base.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    chmod(&theirs, 0o755);
    let socket = theirs.join("control.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    chown(&socket, NOBODY);
    let (code, stderr, contacted) = type_into(&socket, &listener);
    assert!(!contacted, "the text was sent to uid {NOBODY}'s socket");
    assert_eq!(code, Some(77), "{stderr}");
    assert!(stderr.contains("belongs to uid 65534") && stderr.contains("refusing to send"), "{stderr}");
    // Their directory, with a socket that looks like ours: refused as well.
    chown(&socket, 0);
    chown(&theirs, NOBODY);
    let (code, stderr, contacted) = type_into(&socket, &listener);
    assert!(!contacted, "the text was sent through uid {NOBODY}'s directory");
    assert_eq!(code, Some(77), "{stderr}");
    assert!(stderr.contains(&format!("{} belongs to uid 65534", theirs.display())), "{stderr}");
}

/// `usbwire demo --dir DIR` on a free loopback port, its control socket in `control_dir`.
fn demo(dir: &Path, control_dir: &Path, tmp: Option<&Path>) -> Started {
    let mut command = Command::new(BIN);
    command.args(["demo", "--listen", "127.0.0.1:0", "--control"]).arg(control_dir.join("control.sock"));
    match tmp {
        Some(tmp) => {
            command.env("TMPDIR", tmp);
        }
        None => {
            command.arg("--dir").arg(dir);
        }
    }
    start(command, "usbwire demo: serving on ")
}

#[test]
fn a_symlink_planted_as_the_demo_disk_image_is_refused_and_its_target_left_alone() {
    let base = scratch("demo");
    let control = base.join("control");
    std::fs::create_dir(&control).unwrap();
    let dir = base.join("demo");
    std::fs::create_dir(&dir).unwrap();
    chmod(&dir, 0o700);
    // A victim of exactly the demo disk's size, so following the link would serve (and write) it.
    let victim = base.join("victim");
    let file = std::fs::File::create(&victim).unwrap();
    file.set_len(64 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, b"precious bytes", 0).unwrap();
    drop(file);
    let before = std::fs::metadata(&victim).unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("disk.img")).unwrap();

    let (code, stderr) = match demo(&dir, &control, None) {
        Started::Ready(running) => panic!("the demo served the symlinked image: {}", running.stop()),
        Started::Exited { code, stderr } => (code, stderr),
    };
    assert_eq!(code, Some(78), "{stderr}");
    assert!(stderr.contains("disk.img is a symbolic link; refusing to follow it"), "{stderr}");
    assert!(stderr.contains("remove it"), "{stderr}");
    let after = std::fs::metadata(&victim).unwrap();
    assert_eq!((after.len(), after.mtime(), after.mtime_nsec()), (before.len(), before.mtime(), before.mtime_nsec()));
    assert_eq!(&std::fs::read(&victim).unwrap()[..14], b"precious bytes");
    assert!(std::fs::symlink_metadata(dir.join("disk.img")).unwrap().file_type().is_symlink(), "left in place");
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_demo_directory_another_user_made_is_refused() {
    require_root!();
    let base = scratch("demo-dir");
    let control = base.join("control");
    std::fs::create_dir(&control).unwrap();
    // The default directory (TMPDIR/usbwire-demo-0), made first by another user and open to all.
    let tmp = base.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    chmod(&tmp, 0o1777);
    let planted = tmp.join("usbwire-demo-0");
    std::fs::create_dir(&planted).unwrap();
    chmod(&planted, 0o777);
    chown(&planted, NOBODY);
    let (code, stderr) = match demo(&planted, &control, Some(&tmp)) {
        Started::Ready(running) => panic!("the demo used another user's directory: {}", running.stop()),
        Started::Exited { code, stderr } => (code, stderr),
    };
    assert_eq!(code, Some(78), "{stderr}");
    assert!(stderr.contains("belongs to uid 65534"), "{stderr}");
    assert!(std::fs::read_dir(&planted).unwrap().next().is_none(), "nothing created in it");
    // Made fresh when absent: 0700 and ours, with the disk image in it.
    std::fs::remove_dir(&planted).unwrap();
    let Started::Ready(running) = demo(&planted, &control, Some(&tmp)) else { panic!("the demo must start") };
    assert!(running.line().contains("127.0.0.1:"), "{}", running.line());
    let meta = std::fs::symlink_metadata(&planted).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o700));
    assert!(planted.join("disk.img").is_file());
    running.stop();
    let _ = std::fs::remove_dir_all(&base);
}
