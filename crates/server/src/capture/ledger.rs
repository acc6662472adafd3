//! The capture files of one capture directory as the writer thread keeps
//! them: their sizes, which are open, and which is oldest (deleted first
//! when the directory's bound is passed). Not for writing or deleting them.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The capture files of one directory, oldest first, and their bytes.
pub(super) struct Ledger {
    pub(super) entries: Vec<Entry>,
    pub(super) total: u64,
    pub(super) max_bytes: u64,
}

pub(super) struct Entry {
    pub(super) path: PathBuf,
    pub(super) bytes: u64,
    /// When it was begun (rotation keeps the time): the oldest go first.
    pub(super) created: SystemTime,
    pub(super) open: bool,
}

impl Ledger {
    /// The capture files already in `dir` (earlier imports, earlier runs).
    pub(super) fn scan(dir: &Path, max_bytes: u64) -> Self {
        let mut ledger = Self { entries: Vec::new(), total: 0, max_bytes };
        let Ok(listing) = std::fs::read_dir(dir) else { return ledger };
        for item in listing.flatten() {
            let name = item.file_name();
            let name = name.to_string_lossy();
            if !name.starts_with("usbwire-") || !name.contains(".pcapng") {
                continue;
            }
            let Ok(meta) = item.metadata() else { continue };
            if meta.is_file() {
                let created = meta.modified().unwrap_or(UNIX_EPOCH);
                ledger.entries.push(Entry { path: item.path(), bytes: meta.len(), created, open: false });
                ledger.total += meta.len();
            }
        }
        ledger
    }

    pub(super) fn opened(&mut self, path: &Path, bytes: u64) {
        if let Some(entry) = self.entries.iter_mut().find(|e| e.path == path) {
            self.total -= entry.bytes;
            entry.bytes = bytes;
            entry.open = true;
        } else {
            self.entries.push(Entry { path: path.to_path_buf(), bytes, created: SystemTime::now(), open: true });
        }
        self.total += bytes;
    }

    pub(super) fn grew(&mut self, path: &Path, bytes: u64) {
        if let Some(entry) = self.entries.iter_mut().find(|e| e.path == path) {
            entry.bytes += bytes;
            self.total += bytes;
        }
    }

    pub(super) fn closed(&mut self, path: &Path) {
        if let Some(entry) = self.entries.iter_mut().find(|e| e.path == path) {
            entry.open = false;
        }
    }

    /// `path` became `to` (rotation): what was at `to` is gone, `path` starts over.
    pub(super) fn renamed(&mut self, path: &Path, to: &Path, headers: u64) {
        if let Some(replaced) = self.entries.iter().position(|e| e.path == to) {
            let entry = self.entries.remove(replaced);
            self.total -= entry.bytes;
        }
        if let Some(entry) = self.entries.iter_mut().find(|e| e.path == path) {
            entry.path = to.to_path_buf();
            entry.open = false;
        }
        self.entries.push(Entry { path: path.to_path_buf(), bytes: headers, created: SystemTime::now(), open: true });
        self.total += headers;
    }

    /// The oldest entry that is open (or closed).
    pub(super) fn oldest(&self, open: bool) -> Option<usize> {
        self.entries.iter().enumerate().filter(|(_, e)| e.open == open).min_by_key(|(_, e)| e.created).map(|(i, _)| i)
    }
}
