//! Writing the files of a key pair (an identity's, a CA's) so that no key is
//! ever lost or exposed on the way:
//!
//! - an existing key is never replaced unless the caller says so
//!   ([`Existing::KeepAsOld`]), and then the old file stays beside the new one
//!   as `NAME.old` (`NAME.old.2`, … when that is taken);
//! - each file is written to a fresh temporary name in the same directory
//!   (created exclusively, so a planted file or link there is never opened),
//!   synced, and renamed into place: a reader sees the old file or the whole
//!   new one, and a link planted at the final name is replaced, not followed;
//! - the directory is made 0700 when missing, and refused when another user
//!   owns it or may write to it (they could swap the key under us).
//!
//! Not for reading keys (each owner parses its own files), nor for state
//! files that are not secrets.

use std::ffi::OsString;
use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// What to do when a file to write is already there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Existing {
    /// Write nothing and say so ([`KeyFileError::Exists`]).
    Refuse,
    /// Replace it, keeping the old file beside it as `NAME.old`.
    KeepAsOld,
}

/// One file of a key pair: its name in the directory, its text and its mode.
#[derive(Clone, Copy, Debug)]
pub struct KeyFile<'a> {
    pub name: &'a str,
    pub contents: &'a [u8],
    pub mode: u32,
}

/// Why key files were not written. Nothing was replaced in any case but
/// [`KeyFileError::Io`] half-way through a pair (each file is whole either way).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyFileError {
    /// A key is already there and the caller did not ask to replace it.
    #[error(
        "{} already exists; refusing to replace it, which would cut off every peer that trusts it \
         (keep it, or pass --force to replace it: the old file is kept as {}.old)",
        .path.display(), .path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()
    )]
    Exists { path: PathBuf },
    /// The directory belongs to another user, who could swap the keys.
    #[error(
        "{} belongs to uid {owner}, not to this user (uid {us}): keep keys in a directory of your own \
         (`mkdir -m 700 DIR`, then --dir DIR)",
        .dir.display()
    )]
    ForeignDir { dir: PathBuf, owner: u32, us: u32 },
    /// Other users may create, rename or delete files in the directory.
    #[error(
        "{} is writable by other users (mode {mode:04o}), who could replace the keys in it: keep keys in a \
         private directory (`mkdir -m 700 DIR`, then --dir DIR)",
        .dir.display()
    )]
    SharedDir { dir: PathBuf, mode: u32 },
    /// Something other than a directory is at the path.
    #[error("{} is not a directory: name a directory for the key files", .dir.display())]
    NotDirectory { dir: PathBuf },
    /// Creating, writing, syncing or renaming failed.
    #[error("{}: {source}", .path.display())]
    Io { path: PathBuf, source: io::Error },
}

/// Writes `files` into `dir` as the module docs say. Returns the paths the
/// replaced files were kept at (empty unless [`Existing::KeepAsOld`] replaced some).
pub fn write_key_files(dir: &Path, files: &[KeyFile<'_>], existing: Existing) -> Result<Vec<PathBuf>, KeyFileError> {
    prepare_dir(dir)?;
    let targets: Vec<PathBuf> = files.iter().map(|file| dir.join(file.name)).collect();
    if existing == Existing::Refuse {
        // Checked for the whole pair first, so a refusal writes nothing at all.
        if let Some(path) = targets.iter().find(|path| present(path)) {
            return Err(KeyFileError::Exists { path: path.clone() });
        }
    }
    let mut staged = Vec::with_capacity(files.len());
    for file in files {
        staged.push(stage(dir, file)?);
    }
    let mut kept = Vec::new();
    for (temporary, target) in staged.into_iter().zip(&targets) {
        let io_error = |source| KeyFileError::Io { path: target.clone(), source };
        match existing {
            Existing::Refuse => {
                // No replacing even if a file appeared since the check above.
                temporary.persist_noclobber(target).map_err(|e| match e.error.kind() {
                    io::ErrorKind::AlreadyExists => KeyFileError::Exists { path: target.clone() },
                    _ => io_error(e.error),
                })?;
            }
            Existing::KeepAsOld => {
                if present(target) {
                    kept.push(keep_old(target)?);
                }
                temporary.persist(target).map_err(|e| io_error(e.error))?;
            }
        }
    }
    // The renames are durable once the directory is.
    fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|source| KeyFileError::Io { path: dir.into(), source })?;
    Ok(kept)
}

/// Whether anything (a dangling link too) is at `path`.
fn present(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

/// Creates `dir` 0700 if missing; refuses one another user owns or may write to.
fn prepare_dir(dir: &Path) -> Result<(), KeyFileError> {
    let io_error = |source| KeyFileError::Io { path: dir.to_path_buf(), source };
    if !present(dir) {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io_error)?;
    }
    // A link the user made to their key directory is theirs to make: what
    // counts is the directory the files land in.
    let meta = fs::metadata(dir).map_err(io_error)?;
    if !meta.is_dir() {
        return Err(KeyFileError::NotDirectory { dir: dir.to_path_buf() });
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let us = unsafe { libc::geteuid() };
    if meta.uid() != us && meta.uid() != 0 {
        return Err(KeyFileError::ForeignDir { dir: dir.to_path_buf(), owner: meta.uid(), us });
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(KeyFileError::SharedDir { dir: dir.to_path_buf(), mode });
    }
    Ok(())
}

/// The file's contents under a fresh name in `dir`, synced.
fn stage(dir: &Path, file: &KeyFile<'_>) -> Result<tempfile::NamedTempFile, KeyFileError> {
    let io_error = |source| KeyFileError::Io { path: dir.join(file.name), source };
    let mut temporary = tempfile::Builder::new()
        .prefix(&format!(".{}.", file.name))
        .suffix(".tmp")
        .permissions(fs::Permissions::from_mode(file.mode))
        .tempfile_in(dir)
        .map_err(io_error)?;
    // The umask may have narrowed the mode asked for at creation; a key never widens it.
    temporary.as_file().set_permissions(fs::Permissions::from_mode(file.mode)).map_err(io_error)?;
    temporary.write_all(file.contents).map_err(io_error)?;
    temporary.as_file().sync_all().map_err(io_error)?;
    Ok(temporary)
}

/// A second name for the file at `target` (`NAME.old`, else the first free
/// `NAME.old.N`), made with a hard link so `target` itself never goes missing.
fn keep_old(target: &Path) -> Result<PathBuf, KeyFileError> {
    const MOST: u32 = 1000;
    for n in 1..=MOST {
        let candidate = old_name(target, n);
        match fs::hard_link(target, &candidate) {
            Ok(()) => return Ok(candidate),
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(source) => return Err(KeyFileError::Io { path: candidate, source }),
        }
    }
    let full = io::Error::new(io::ErrorKind::AlreadyExists, format!("{MOST} old copies are kept already: remove some"));
    Err(KeyFileError::Io { path: old_name(target, MOST), source: full })
}

/// `NAME.old` for `n` = 1, `NAME.old.N` after.
fn old_name(target: &Path, n: u32) -> PathBuf {
    let mut name = target.file_name().map(OsString::from).unwrap_or_default();
    name.push(".old");
    if n > 1 {
        name.push(format!(".{n}"));
    }
    target.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn pair<'a>(key: &'a [u8], cert: &'a [u8]) -> [KeyFile<'a>; 2] {
        [KeyFile { name: "x.key", contents: key, mode: 0o600 }, KeyFile { name: "x.crt", contents: cert, mode: 0o644 }]
    }

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path).unwrap().permissions().mode() & 0o777
    }

    /// Names in `dir`, sorted: no temporary file may be left behind.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn a_new_pair_is_written_private_into_a_new_private_directory() {
        let scratch = crate::ScratchDir::new("keyfiles-new");
        let dir = scratch.path().join("nested");
        let kept = write_key_files(&dir, &pair(b"K1", b"C1"), Existing::Refuse).unwrap();
        assert!(kept.is_empty());
        assert_eq!(fs::read(dir.join("x.key")).unwrap(), b"K1");
        assert_eq!(fs::read(dir.join("x.crt")).unwrap(), b"C1");
        assert_eq!(mode(&dir.join("x.key")), 0o600);
        assert_eq!(mode(&dir.join("x.crt")), 0o644);
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(names(&dir), ["x.crt", "x.key"]);
    }

    #[test]
    fn an_existing_key_is_refused_and_nothing_of_the_pair_is_written() {
        let scratch = crate::ScratchDir::new("keyfiles-refuse");
        let dir = scratch.path();
        write_key_files(&dir, &pair(b"K1", b"C1"), Existing::Refuse).unwrap();
        // Only the certificate missing: the key's presence alone refuses.
        fs::remove_file(dir.join("x.crt")).unwrap();
        let error = write_key_files(&dir, &pair(b"K2", b"C2"), Existing::Refuse).unwrap_err();
        assert!(matches!(&error, KeyFileError::Exists { path } if path.ends_with("x.key")), "{error}");
        assert!(error.to_string().contains("--force"), "{error}");
        assert_eq!(fs::read(dir.join("x.key")).unwrap(), b"K1");
        assert_eq!(names(&dir), ["x.key"], "no certificate, no temporary file");
    }

    #[test]
    fn a_forced_replacement_keeps_each_old_file_and_never_loses_an_earlier_one() {
        let scratch = crate::ScratchDir::new("keyfiles-force");
        let dir = scratch.path();
        write_key_files(&dir, &pair(b"K1", b"C1"), Existing::Refuse).unwrap();
        let kept = write_key_files(&dir, &pair(b"K2", b"C2"), Existing::KeepAsOld).unwrap();
        assert_eq!(kept, [dir.join("x.key.old"), dir.join("x.crt.old")]);
        let kept = write_key_files(&dir, &pair(b"K3", b"C3"), Existing::KeepAsOld).unwrap();
        assert_eq!(kept, [dir.join("x.key.old.2"), dir.join("x.crt.old.2")]);
        assert_eq!(fs::read(dir.join("x.key")).unwrap(), b"K3");
        assert_eq!(fs::read(dir.join("x.key.old")).unwrap(), b"K1");
        assert_eq!(fs::read(dir.join("x.key.old.2")).unwrap(), b"K2");
        assert_eq!(fs::read(dir.join("x.crt.old.2")).unwrap(), b"C2");
        assert_eq!(mode(&dir.join("x.key.old")), 0o600, "a kept key stays private");
        assert_eq!(names(&dir).len(), 6, "{:?}", names(&dir));
    }

    #[test]
    fn a_link_planted_at_the_key_is_replaced_not_followed() {
        let scratch = crate::ScratchDir::new("keyfiles-link");
        let dir = scratch.path();
        fs::create_dir_all(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).unwrap();
        let victim = scratch.path().with_file_name("victim");
        fs::write(&victim, b"not yours").unwrap();
        symlink(&victim, dir.join("x.key")).unwrap();
        // Refused: something is at the name.
        assert!(matches!(write_key_files(&dir, &pair(b"K", b"C"), Existing::Refuse), Err(KeyFileError::Exists { .. })));
        // Forced: the link is kept as the old entry and a real file takes its place.
        write_key_files(&dir, &pair(b"K", b"C"), Existing::KeepAsOld).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"not yours", "written through the link");
        assert!(fs::symlink_metadata(dir.join("x.key")).unwrap().file_type().is_file());
        assert!(fs::symlink_metadata(dir.join("x.key.old")).unwrap().file_type().is_symlink());
    }

    #[test]
    fn a_directory_others_may_write_to_is_refused() {
        let scratch = crate::ScratchDir::new("keyfiles-shared");
        let dir = scratch.path();
        fs::create_dir_all(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o1777)).unwrap();
        let error = write_key_files(&dir, &pair(b"K", b"C"), Existing::Refuse).unwrap_err();
        assert!(matches!(error, KeyFileError::SharedDir { mode: 0o1777, .. }), "{error}");
        assert!(error.to_string().contains("mkdir -m 700") && !error.to_string().contains("chmod"), "{error}");
        assert!(names(&dir).is_empty());
    }

    #[test]
    fn a_file_where_the_directory_should_be_is_refused() {
        let scratch = crate::ScratchDir::new("keyfiles-notdir");
        let dir = scratch.path();
        fs::write(&dir, b"").unwrap();
        let error = write_key_files(&dir, &pair(b"K", b"C"), Existing::Refuse).unwrap_err();
        assert!(matches!(error, KeyFileError::NotDirectory { .. }), "{error}");
    }
}
