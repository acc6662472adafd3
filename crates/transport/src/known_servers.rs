//! The client's pinned server fingerprints (like ssh's known_hosts): one
//! `HOST:PORT sha256:…` line per server, in `known_servers` beside the identity.

use std::fs;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use crate::Fingerprint;

/// The pinned fingerprints file.
#[derive(Clone, Debug)]
pub struct KnownServers {
    path: PathBuf,
}

impl KnownServers {
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }

    /// `known_servers` in an identity directory.
    pub fn in_dir(dir: &Path) -> Self {
        Self::new(dir.join("known_servers"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The fingerprint pinned for `server` (`HOST:PORT`).
    pub fn lookup(&self, server: &str) -> Option<Fingerprint> {
        let text = fs::read_to_string(&self.path).ok()?;
        text.lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .filter_map(|l| l.split_once(char::is_whitespace))
            .find(|(name, _)| *name == server)
            .and_then(|(_, fp)| fp.trim().parse().ok())
    }

    /// Whether no server is pinned (no file, or no valid line in it).
    pub fn is_empty(&self) -> bool {
        let Ok(text) = fs::read_to_string(&self.path) else { return true };
        !text
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .filter_map(|l| l.split_once(char::is_whitespace))
            .any(|(_, fp)| fp.trim().parse::<Fingerprint>().is_ok())
    }

    /// Pins `fingerprint` for `server` (appends; an older line for it is dropped).
    pub fn add(&self, server: &str, fingerprint: Fingerprint) -> io::Result<()> {
        let old = fs::read_to_string(&self.path).unwrap_or_default();
        let mut kept: Vec<&str> = old.lines().filter(|l| l.split_whitespace().next() != Some(server)).collect();
        let line = format!("{server} {fingerprint}");
        kept.push(&line);
        if let Some(dir) = self.path.parent() {
            fs::create_dir_all(dir)?;
        }
        let mut file = fs::File::create(&self.path)?;
        for l in kept {
            writeln!(file, "{l}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_and_lookup() {
        let path = std::env::temp_dir().join(format!("usbwire-known-{}", std::process::id()));
        let _ = fs::remove_file(&path);
        let known = KnownServers::new(path.clone());
        let a = Fingerprint([1; 32]);
        let b = Fingerprint([2; 32]);
        assert_eq!(known.lookup("h:1"), None);
        assert!(known.is_empty());
        known.add("h:1", a).unwrap();
        assert!(!known.is_empty());
        known.add("h:2", b).unwrap();
        known.add("h:1", b).unwrap();
        assert_eq!(known.lookup("h:1"), Some(b));
        assert_eq!(known.lookup("h:2"), Some(b));
        assert_eq!(fs::read_to_string(&path).unwrap().lines().count(), 2);
        let _ = fs::remove_file(&path);
    }
}
