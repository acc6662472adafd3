//! The usbredir listeners of `usbwire serve --redir` through the real binary:
//! a Unix socket 0600 (0660 for a group) that serves a usbredir guest, a TCP
//! listener refused at config load unless the rule opts in (and always on a
//! server without plain USB/IP), a socket directory another user owns
//! refused (that test needs root to make one; without root it says so), and
//! the server's own key, which its bridges import with, limited to their devices.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use usbwire_testing::process::Scratch;

use bytes::BytesMut;
use usbwire_redir::{Caps, Codec, Packet};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn scratch(name: &str) -> Scratch {
    let dir = usbwire_testing::process::scratch("redir", name);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

fn free_addr() -> String {
    format!("127.0.0.1:{}", TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port())
}

/// `usbwire serve` of a loopback device with `extra` arguments, which must fail.
fn serve_refused(dir: &Path, extra: &[&str]) -> Output {
    let output = Command::new(BIN)
        .args(["serve", "--no-advertise", "--listen", &free_addr(), "--virtual", "loopback", "--control"])
        .arg(dir.join("control.sock"))
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!output.status.success(), "the server started: {}", String::from_utf8_lossy(&output.stdout));
    output
}

struct Serving {
    child: Child,
    addr: String,
    lines: Vec<String>,
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `usbwire serve` of a loopback device with `extra` arguments, once it has
/// printed its usbredir line.
fn serve(dir: &Path, extra: &[&str]) -> Serving {
    let addr = free_addr();
    let mut child = Command::new(BIN)
        .args(["serve", "--no-advertise", "--listen", &addr, "--virtual", "loopback", "--control"])
        .arg(dir.join("control.sock"))
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    let mut reader = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in reader.by_ref() {
        let line = line.unwrap();
        let done = line.contains("usbredir for");
        lines.push(line);
        if done {
            break;
        }
    }
    std::thread::spawn(move || for _ in reader {});
    assert!(lines.iter().any(|l| l.contains("usbredir for")), "no usbredir line: {lines:?}");
    Serving { child, addr, lines }
}

/// TLS only, no plain USB/IP, no client allowed: the issue's server.
fn tls_only(identity: &Path) -> Vec<String> {
    ["--tls", "--allow-plain", "never", "--identity"]
        .map(String::from)
        .into_iter()
        .chain([identity.display().to_string()])
        .collect()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn a_tcp_redir_listener_without_the_opt_in_is_refused_at_config_load() {
    let dir = scratch("tcp-refused");
    let listen = free_addr();
    let output = serve_refused(&dir, &["--redir", &format!("{listen}=0-1")]);
    assert_eq!(output.status.code(), Some(78), "{}", stderr(&output));
    let message = stderr(&output);
    assert!(message.contains("no authentication") && message.contains("unix:PATH"), "{message}");
    assert!(TcpStream::connect(&listen).is_err(), "the refused port was opened anyway");

    // The same rule in the config file.
    let config = dir.join("server.toml");
    std::fs::write(&config, format!("[[redir]]\ndevice = \"0-1\"\nlisten = \"{listen}\"\n")).unwrap();
    let output = serve_refused(&dir, &["--config", config.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(78), "{}", stderr(&output));
    assert!(stderr(&output).contains("allow_unauthenticated = true"), "{}", stderr(&output));

    // Never on a server that takes no plain USB/IP, even with the opt-in.
    let tls = tls_only(&dir.join("identity"));
    let redir = format!("{listen}=0-1");
    let args: Vec<&str> =
        tls.iter().map(String::as_str).chain(["--redir-tcp-unauthenticated", "--redir", &redir]).collect();
    let output = serve_refused(&dir, &args);
    assert_eq!(output.status.code(), Some(78), "{}", stderr(&output));
    let message = stderr(&output);
    assert!(message.contains("allow_plain = \"never\"") && message.contains("unix:PATH"), "{message}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tcp_redir_listener_with_the_opt_in_is_served() {
    let dir = scratch("tcp-opted-in");
    let listen = free_addr();
    let serving = serve(&dir, &["--redir-tcp-unauthenticated", "--redir", &format!("{listen}=0-1")]);
    assert!(serving.lines.iter().any(|l| l.contains(&listen)), "{:?}", serving.lines);
    let mut stream = TcpStream::connect(&listen).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    guest_sees_the_device(&mut stream);
    drop(serving);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_unix_redir_socket_is_0600_and_serves_a_usbredir_guest() {
    let dir = scratch("unix");
    let socket = dir.join("sockets/redir.sock");
    let serving = serve(&dir, &["--redir", &format!("unix:{}=0-1", socket.display())]);
    let meta = std::fs::metadata(&socket).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o600, "the socket is private");
    let parent = std::fs::metadata(socket.parent().unwrap()).unwrap();
    assert_eq!(parent.mode() & 0o777, 0o700, "its missing directory is created private");
    let mut stream = UnixStream::connect(&socket).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    guest_sees_the_device(&mut stream);
    drop(stream);
    // The bridge serves the next guest too.
    let mut stream = UnixStream::connect(&socket).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    guest_sees_the_device(&mut stream);
    drop(serving);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_unix_redir_socket_with_a_group_is_0660_for_that_group() {
    let dir = scratch("group");
    let socket = dir.join("redir.sock");
    // SAFETY: getegid has no preconditions and cannot fail.
    let gid = unsafe { libc::getegid() };
    let config = dir.join("server.toml");
    std::fs::write(
        &config,
        format!("[[redir]]\ndevice = \"0-1\"\nlisten = \"unix:{}\"\ngroup = \"{gid}\"\n", socket.display()),
    )
    .unwrap();
    let serving = serve(&dir, &["--config", config.to_str().unwrap()]);
    let meta = std::fs::metadata(&socket).unwrap();
    assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, gid));
    drop(serving);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_unix_redir_socket_in_another_users_directory_is_refused() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: making a directory another user owns needs root");
        return;
    }
    let dir = scratch("other-user");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let theirs = dir.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::lchown(&theirs, Some(65534), Some(65534)).unwrap();
    let socket = theirs.join("redir.sock");
    let output = serve_refused(&dir, &["--redir", &format!("unix:{}=0-1", socket.display())]);
    assert_eq!(output.status.code(), Some(78), "{}", stderr(&output));
    assert!(stderr(&output).contains("belongs to uid 65534"), "{}", stderr(&output));
    assert!(!socket.exists(), "a socket was made in another user's directory");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_servers_own_key_gets_only_its_bridges_devices() {
    // The issue's setup: TLS only, no plain USB/IP, no client allowed, a keyboard and a bridge.
    let dir = scratch("own-key");
    let identity = dir.join("identity");
    let socket = dir.join("redir.sock");
    let tls = tls_only(&identity);
    let redir = format!("unix:{}=0-1", socket.display());
    let args: Vec<&str> = tls.iter().map(String::as_str).chain(["--virtual", "keyboard", "--redir", &redir]).collect();
    let serving = serve(&dir, &args);
    // Whoever holds the server's key (its bridges) sees the bridge's device, not the keyboard.
    let list =
        |args: &[&str]| Command::new(BIN).args(["list", "-r", &serving.addr, "--json"]).args(args).output().unwrap();
    let own = list(&["--tls", "--identity", identity.to_str().unwrap()]);
    let listed = String::from_utf8_lossy(&own.stdout);
    assert!(own.status.success(), "{}", stderr(&own));
    assert!(listed.contains("\"0-1\"") && !listed.contains("\"0-2\""), "{listed}");
    assert_eq!(std::fs::metadata(&socket).unwrap().mode() & 0o777, 0o600);
    drop(serving);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Says usbredir hello as a guest and waits for the device to be announced.
fn guest_sees_the_device(stream: &mut (impl Read + Write)) {
    let caps = [Caps::CONNECT_DEVICE_VERSION, Caps::EP_INFO_MAX_PACKET_SIZE, Caps::IDS_64, Caps::BULK_LENGTH_32];
    let mut codec = Codec::new(usbwire_redir::Side::Guest, caps.into_iter().fold(Caps(0), Caps::with), u32::MAX);
    let mut out = BytesMut::new();
    codec.encode(0, &codec.hello("test guest"), &mut out).unwrap();
    stream.write_all(&out).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut inbuf = BytesMut::new();
    let mut chunk = [0u8; 4096];
    loop {
        while let Some((_, packet)) = codec.decode(&mut inbuf).unwrap() {
            if let Packet::DeviceConnect { .. } = packet {
                return;
            }
        }
        assert!(Instant::now() < deadline, "no device_connect in 20 s");
        let n = stream.read(&mut chunk).unwrap();
        assert!(n > 0, "the bridge closed the guest's connection");
        inbuf.extend_from_slice(&chunk[..n]);
    }
}
