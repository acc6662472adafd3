//! For tests of the real `usbwire` binary: a scratch directory per test, a
//! free loopback port, a started process that is killed when dropped
//! (with everything it wrote to stderr kept for the test to read), and the
//! verbs its `--help` lists.

use std::io::{BufRead as _, BufReader, Read as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;

/// An empty directory `usbwire-{suite}-{pid}-{name}` under the temporary
/// directory (emptied first if an earlier run left one), removed with
/// everything in it when dropped: keep it alive as long as the test uses it.
pub fn scratch(suite: &str, name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("usbwire-{suite}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|error| panic!("scratch directory {}: {error}", dir.display()));
    Scratch { dir }
}

/// A test's scratch directory ([`scratch`]); derefs to its path and is
/// removed when dropped, so test runs leave nothing behind in `/tmp`.
#[derive(Debug)]
pub struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    /// The directory's path.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.dir
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // A test may have taken permissions away to provoke an error; give
        // them back so the directory can go.
        restore_permissions(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Makes every directory under `dir` (and `dir` itself) writable by its
/// owner again, without following symbolic links.
fn restore_permissions(dir: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    let Ok(meta) = std::fs::symlink_metadata(dir) else { return };
    if !meta.is_dir() {
        return;
    }
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(meta.permissions().mode() | 0o700));
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            restore_permissions(&entry.path());
        }
    }
}

/// A loopback address whose port was free a moment ago, for a process that
/// must be told where to listen.
pub fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .unwrap_or_else(|error| panic!("no free loopback port: {error}"))
}

/// A started process: either it printed its ready line (and runs until
/// stopped or dropped), or it exited first.
pub enum Started {
    Ready(Running),
    Exited { code: Option<i32>, stderr: String },
}

impl Started {
    /// The running process; panics with its stderr if it exited instead.
    pub fn ready(self) -> Running {
        match self {
            Self::Ready(running) => running,
            Self::Exited { code, stderr } => panic!("exited ({code:?}) before it was ready: {stderr}"),
        }
    }
}

/// A process that printed its ready line; killed when dropped.
pub struct Running {
    child: Child,
    line: String,
    /// Every line of stdout up to the ready line, that one included.
    printed: Vec<String>,
    stderr: Option<JoinHandle<String>>,
}

impl Running {
    /// The line it printed when ready.
    pub fn line(&self) -> &str {
        &self.line
    }

    /// What it printed on stdout up to and with its ready line.
    pub fn printed(&self) -> &[String] {
        &self.printed
    }

    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Stops the process and returns everything it wrote to stderr.
    pub fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr.take().and_then(|reader| reader.join().ok()).unwrap_or_default()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Spawns `command` and reads its stdout until a line starting with `ready`;
/// the rest of its stdout is read and dropped, its stderr kept.
pub fn start(mut command: Command, ready: &str) -> Started {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("{command:?} did not start: {error}"));
    let (Some(stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        panic!("{command:?} has no stdout or stderr pipe");
    };
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let mut lines = BufReader::new(stdout).lines();
    let mut printed = Vec::new();
    let found = lines.by_ref().map_while(Result::ok).find(|l| {
        printed.push(l.clone());
        l.starts_with(ready)
    });
    match found {
        Some(line) => {
            std::thread::spawn(move || for _ in lines {});
            Started::Ready(Running { child, line, printed, stderr: Some(stderr) })
        }
        None => {
            let code = child.wait().ok().and_then(|status| status.code());
            Started::Exited { code, stderr: stderr.join().unwrap_or_default() }
        }
    }
}

/// The verbs `usbwire --help` lists under "Commands:" (without clap's `help`).
/// Panics when the text has no such section, as a test should.
pub fn verbs_in_help(help: &str) -> Vec<String> {
    help.split("Commands:")
        .nth(1)
        .and_then(|rest| rest.split("Options:").next())
        .expect("the verbs")
        .lines()
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .filter(|verb| verb != "help")
        .collect()
}
