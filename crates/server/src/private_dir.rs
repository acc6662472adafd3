//! Directories for local files that only this user may change: the control
//! socket's, the usbredir sockets', the demo's disk image's, the bind state
//! file's; [`bind_socket`], which makes a Unix socket in one, and
//! [`write_private_file`] / [`read_private_file`] for a small state file in one.
//!
//! A directory in a shared place (`/tmp/usbwire-UID`) can be made by another
//! user before us. If we used it, they could replace our socket with theirs
//! and read what `usbwire type` sends, or plant a symlink where we open a
//! file. So, like `mkdtemp`: a missing directory is created with mode 0700;
//! one that exists is used only if it is a real directory (not a symlink),
//! owned by us, and writable by nobody else, inside a parent where nobody
//! else can rename it away (not writable by others, or sticky like `/tmp`).
//! Anything else is refused with what to do, never repaired: a directory
//! someone else made is not ours to chmod.

use std::io;
use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// Why a directory cannot hold our local files.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PrivateDirError {
    /// The path is a symbolic link (which another user may have planted).
    #[error("{} is a symbolic link, not a directory of ours; remove it (or use another path)", .path.display())]
    Symlink { path: PathBuf },
    /// Something other than a directory is in the way.
    #[error("{} is not a directory; remove it (or use another path)", .path.display())]
    NotDirectory { path: PathBuf },
    /// Another user made the directory first.
    #[error(
        "{} belongs to uid {owner}, not to this user (uid {us}): another user may have made it to catch \
         our files; remove it (as root or its owner) and start again, or use another path",
        .path.display()
    )]
    NotOwned { path: PathBuf, owner: u32, us: u32 },
    /// Other users may create, replace or delete files in it. The advice
    /// never touches the directory itself: it may be the system's (`/tmp`)
    /// or shared on purpose, and its mode is not ours to change.
    #[error("{} is writable by other users (mode {mode:04o}), who could plant or swap files in it; {}", .path.display(), private_instead(.path, *.mode))]
    Writable { path: PathBuf, mode: u32 },
    /// Other users may rename the directory away and put theirs in its place.
    #[error(
        "{} is in {}, which other users own or may write to (mode {mode:04o}, not sticky): they could swap \
         the directory; use a path in a directory only you (or root) can write",
        .path.display(), .parent.display()
    )]
    WritableParent { path: PathBuf, parent: PathBuf, mode: u32 },
    /// Creating or inspecting it failed.
    #[error("cannot use directory {}: {source}", .path.display())]
    Io { path: PathBuf, source: io::Error },
}

/// What to use instead of a directory others may write to: in a sticky
/// one (`/tmp`), a private directory of our own inside it (nobody else may
/// rename or remove it there); elsewhere, a directory of our own somewhere
/// only we can write, since one made inside could be swapped away.
fn private_instead(path: &Path, mode: u32) -> String {
    if mode & 0o1000 != 0 {
        format!(
            "use a private directory inside it instead: `mkdir -m 700 {}`, and give that path",
            path.join("usbwire").display()
        )
    } else {
        "use a directory only you can write instead (`mkdir -m 700 DIR` in a place of your own, \
         /var/lib/usbwire for a service), and give that path"
            .to_owned()
    }
}

/// This process's effective uid.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Makes sure `dir` is a directory only this user can change: created with
/// mode 0700 (its missing parents with the default mode) if absent, else
/// checked as the module docs say.
pub fn ensure_private_dir(dir: &Path) -> Result<(), PrivateDirError> {
    let io_error = |source| PrivateDirError::Io { path: dir.to_path_buf(), source };
    match std::fs::symlink_metadata(dir) {
        Ok(_) => {}
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(io_error)?;
            }
            // Nothing is made where it could be swapped away.
            check_parent(dir)?;
            match std::fs::DirBuilder::new().mode(0o700).create(dir) {
                Ok(()) => {}
                // Someone made it between our look and our mkdir: check theirs below.
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {}
                Err(error) => return Err(io_error(error)),
            }
        }
        Err(error) => return Err(io_error(error)),
    }
    check_private_dir(dir)
}

/// The directory for a socket the user named (`--control PATH`): a shared
/// sticky directory owned by us or root, like `/tmp`, is fine too — nobody
/// else may remove or rename our socket in it, a file already at the path is
/// not ours to remove (binding then fails), and the socket is made 0600 with
/// every peer checked by `SO_PEERCRED`. Anything else must be private
/// ([`ensure_private_dir`]).
pub fn ensure_socket_dir(dir: &Path) -> Result<(), PrivateDirError> {
    if let Ok(meta) = std::fs::symlink_metadata(dir) {
        let sticky = meta.mode() & 0o1000 != 0;
        let trusted_owner = meta.uid() == effective_uid() || meta.uid() == 0;
        if meta.is_dir() && !meta.file_type().is_symlink() && sticky && trusted_owner {
            return Ok(());
        }
    }
    ensure_private_dir(dir)
}

/// Checks, without creating or changing anything, that `dir` is a directory
/// only this user can change.
pub fn check_private_dir(dir: &Path) -> Result<(), PrivateDirError> {
    let path = dir.to_path_buf();
    let meta = std::fs::symlink_metadata(dir).map_err(|source| PrivateDirError::Io { path: path.clone(), source })?;
    if meta.file_type().is_symlink() {
        return Err(PrivateDirError::Symlink { path });
    }
    if !meta.is_dir() {
        return Err(PrivateDirError::NotDirectory { path });
    }
    let us = effective_uid();
    if meta.uid() != us {
        return Err(PrivateDirError::NotOwned { path, owner: meta.uid(), us });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(PrivateDirError::Writable { path, mode });
    }
    check_parent(dir)
}

/// A parent others may write to lets them rename `dir` away, unless it is
/// sticky (then only `dir`'s owner, the parent's owner or root may).
fn check_parent(dir: &Path) -> Result<(), PrivateDirError> {
    let parent = match dir.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let meta = std::fs::metadata(&parent).map_err(|source| PrivateDirError::Io { path: parent.clone(), source })?;
    let (mode, owner, us) = (meta.mode() & 0o7777, meta.uid(), effective_uid());
    let sticky = mode & 0o1000 != 0;
    let others_may_rename = (owner != us && owner != 0) || mode & 0o002 != 0 || (mode & 0o020 != 0 && owner != us);
    if others_may_rename && !sticky {
        return Err(PrivateDirError::WritableParent { path: dir.to_path_buf(), parent, mode });
    }
    Ok(())
}

/// Replaces `path` with `contents`: written to a new 0600 file beside it
/// (`O_EXCL | O_NOFOLLOW`), synced, then renamed over it, in a directory
/// [`ensure_private_dir`] accepts (created 0700 if missing). A symlink
/// planted at `path` is replaced, never followed, and a reader sees the old
/// file or the new one, never half of one.
pub fn write_private_file(path: &Path, contents: &[u8]) -> io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    ensure_private_dir(dir).map_err(|error| io::Error::new(io::ErrorKind::PermissionDenied, error.to_string()))?;
    replace_file(path, contents, 0o600)
}

/// Writes `contents` to a new file of `mode` beside `path` (`O_EXCL |
/// O_NOFOLLOW`, synced) and renames it over `path`: a symlink planted at
/// `path` or at the new file's name is replaced, never followed, and a
/// reader sees the old file or the new one, never half of one. The directory
/// is the caller's to vouch for ([`write_private_file`] checks it).
pub fn replace_file(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(format!(".{}.new", std::process::id()));
    let new = path.with_file_name(name);
    let _ = std::fs::remove_file(&new); // one of ours, left by a crash
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&new)?;
        file.write_all(contents)?;
        file.sync_all()?;
        std::fs::rename(&new, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&new);
    }
    written
}

/// The text of a state file [`write_private_file`] wrote: `None` if there is
/// none; refused if its directory is not one only we can change (someone
/// else could have written it) or it is a symlink.
pub fn read_private_file(path: &Path) -> io::Result<Option<String>> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let mut file = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(error),
    };
    check_private_dir(dir).map_err(|error| io::Error::new(io::ErrorKind::PermissionDenied, error.to_string()))?;
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    Ok(Some(text))
}

/// Why a private Unix socket could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SocketError {
    /// Its directory is not one only we can change; the message says what to do.
    #[error("{}: {reason}", .path.display())]
    Dir { path: PathBuf, reason: PrivateDirError },
    /// A live server already listens there.
    #[error("{} is in use by another running program; stop it, or use another path", .path.display())]
    InUse { path: PathBuf },
    /// Binding, or setting its mode or group, failed.
    #[error("cannot make socket {}: {source}", .path.display())]
    Io { path: PathBuf, source: io::Error },
}

/// Makes a Unix socket at `path` only this user can connect to (mode 0600),
/// or also `group` (0660: the group QEMU or libvirt runs as), in a directory
/// checked by [`ensure_socket_dir`] (created 0700 if missing; another user's,
/// one others may write to, or a symlink is refused). A stale socket left by
/// a program that is gone is replaced; one something still answers on is not.
/// (With a group, the group must also
/// be able to enter the directory: `chgrp GROUP DIR; chmod 0710 DIR`.)
pub fn bind_socket(path: &Path, group: Option<u32>) -> Result<std::os::unix::net::UnixListener, SocketError> {
    let failed = |source| SocketError::Io { path: path.to_path_buf(), source };
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    ensure_socket_dir(dir).map_err(|reason| SocketError::Dir { path: path.to_path_buf(), reason })?;
    if std::fs::symlink_metadata(path).is_ok() {
        // A live server answers; a stale socket from a crashed one does not.
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(SocketError::InUse { path: path.to_path_buf() });
        }
        std::fs::remove_file(path).map_err(failed)?;
    }
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(failed)?;
    // bind(2) applies the umask: the mode is set right after, and until then
    // the directory (ours, written by nobody else) keeps others out.
    let mode = match group {
        Some(gid) => {
            std::os::unix::fs::chown(path, None, Some(gid)).map_err(failed)?;
            0o660
        }
        None => 0o600,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(failed)?;
    Ok(listener)
}

/// Whether the peer of a local socket (`what`: control, external device) is
/// the server's own user or root; anyone else is refused (and logged), with a
/// reason to send back.
pub(crate) fn check_peer(stream: &tokio::net::UnixStream, what: &str) -> Result<(), String> {
    let us = crate::private_dir::effective_uid();
    match stream.peer_cred() {
        Ok(peer) if peer.uid() == us || peer.uid() == 0 => Ok(()),
        Ok(peer) => {
            tracing::warn!(
                peer_uid = peer.uid(),
                peer_pid = peer.pid(),
                "{what} connection refused: only uid {us} (this server's user) and root may use it"
            );
            Err(format!(
                "refused: this server's {what} socket answers only uid {us} and root, not uid {}; \
                 run the command as that user",
                peer.uid()
            ))
        }
        Err(error) => {
            tracing::warn!(%error, "{what} connection refused: cannot tell who is asking (SO_PEERCRED)");
            Err(format!("refused: the server could not check who is asking ({error})"))
        }
    }
}

/// Why the CLI will not talk to a control socket.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SocketOwnerError {
    /// The socket (or its directory) belongs to another non-root user, who would get what we send.
    #[error(
        "{} belongs to uid {owner}, neither this user (uid {us}) nor root: refusing to send to it (another \
         user may have put it there to catch what is typed); remove it, or pass --control PATH of your server",
        .path.display()
    )]
    NotOwned { path: PathBuf, owner: u32, us: u32 },
    /// Its directory lets other users replace the socket.
    #[error(
        "{} is writable by other users (mode {mode:04o}), who could replace the socket in it: refusing to \
         send; run the server with its control socket in a private directory (--control PATH)",
        .path.display()
    )]
    Writable { path: PathBuf, mode: u32 },
}

/// System accounts (below `SYS_UID_MAX + 1` of Debian's login.defs): only an
/// administrator creates them, like the `usbwire` user the server's unit runs as.
const FIRST_LOGIN_UID: u32 = 1000;

/// Before the CLI sends anything to the control socket at `socket`: the
/// socket and its directory must be this user's, root's or a system
/// account's (the packaged server runs as the system user `usbwire`), and
/// the directory not open to other users' writes (unless sticky, like
/// `/tmp`). Another login user's socket is refused: what we send (text to
/// type) would go to them. A missing socket is not an error here
/// (connecting will say so).
pub fn check_socket_owner(socket: &Path) -> Result<(), SocketOwnerError> {
    let us = effective_uid();
    let trusted = |owner: u32| owner == us || owner < FIRST_LOGIN_UID;
    if let Ok(meta) = std::fs::metadata(socket) {
        if !trusted(meta.uid()) {
            return Err(SocketOwnerError::NotOwned { path: socket.to_path_buf(), owner: meta.uid(), us });
        }
    }
    let dir = match socket.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    if let Ok(meta) = std::fs::metadata(dir) {
        if !trusted(meta.uid()) {
            return Err(SocketOwnerError::NotOwned { path: dir.to_path_buf(), owner: meta.uid(), us });
        }
        let mode = meta.mode() & 0o7777;
        if mode & 0o002 != 0 && mode & 0o1000 == 0 {
            return Err(SocketOwnerError::Writable { path: dir.to_path_buf(), mode });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    /// An empty directory (mode 0755) for one test, removed when the guard is dropped.
    fn scratch(name: &str) -> tempfile::TempDir {
        let dir = tempfile::Builder::new().prefix(&format!("usbwire-private-{name}-")).tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    #[test]
    fn a_socket_may_go_in_a_sticky_shared_directory_but_not_a_plain_writable_one() {
        let base = scratch("socket-dir");
        let base = base.path();
        let sticky = base.join("tmp");
        std::fs::create_dir(&sticky).unwrap();
        std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
        ensure_socket_dir(&sticky).unwrap();
        assert_eq!(std::fs::metadata(&sticky).unwrap().mode() & 0o7777, 0o1777, "left as it was");
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(ensure_socket_dir(&open), Err(PrivateDirError::Writable { .. })));
        let link = base.join("link");
        std::os::unix::fs::symlink(&sticky, &link).unwrap();
        assert!(matches!(ensure_socket_dir(&link), Err(PrivateDirError::Symlink { .. })));
    }

    #[test]
    fn a_missing_directory_is_created_0700() {
        let base = scratch("create");
        let base = base.path();
        let dir = base.join("usbwire");
        ensure_private_dir(&dir).unwrap();
        let meta = std::fs::symlink_metadata(&dir).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o777, 0o700);
        // Existing and ours: used as it is.
        ensure_private_dir(&dir).unwrap();
    }

    #[test]
    fn a_directory_others_may_write_is_refused_and_left_alone() {
        let base = scratch("writable");
        let base = base.path();
        let dir = base.join("usbwire");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let error = ensure_private_dir(&dir).unwrap_err();
        assert!(matches!(error, PrivateDirError::Writable { mode: 0o777, .. }), "{error}");
        assert!(error.to_string().contains("mkdir -m 700 DIR"), "{error}");
        assert!(!error.to_string().contains("chmod"), "never advise changing a directory's mode: {error}");
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o777, "not repaired behind the user's back");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
        assert!(matches!(ensure_private_dir(&dir), Err(PrivateDirError::Writable { .. })));
        // A shared sticky directory like /tmp: a private one inside it, never a chmod of it.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let error = ensure_private_dir(&dir).unwrap_err().to_string();
        assert!(error.contains(&format!("mkdir -m 700 {}/usbwire", dir.display())), "{error}");
        assert!(!error.contains("chmod"), "{error}");
    }

    #[test]
    fn a_symlink_is_refused_even_to_a_private_directory() {
        let base = scratch("symlink");
        let base = base.path();
        let real = base.join("real");
        ensure_private_dir(&real).unwrap();
        let link = base.join("usbwire");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let error = ensure_private_dir(&link).unwrap_err();
        assert!(matches!(error, PrivateDirError::Symlink { .. }), "{error}");
        let file = base.join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(ensure_private_dir(&file), Err(PrivateDirError::NotDirectory { .. })));
    }

    #[test]
    fn a_state_file_is_written_0600_through_no_planted_link_and_read_back() {
        let base = scratch("state-file");
        let base = base.path();
        let dir = base.join("state");
        let path = dir.join("binds");
        assert_eq!(read_private_file(&path).unwrap(), None, "no file yet");
        write_private_file(&path, b"1-1\n").unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        assert_eq!(read_private_file(&path).unwrap().as_deref(), Some("1-1\n"));
        // A link planted where the file goes is replaced, and its target left alone.
        let target = base.join("target");
        std::fs::write(&target, b"theirs").unwrap();
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert!(read_private_file(&path).is_err(), "a symlink is not read through");
        write_private_file(&path, b"0781:5567\n").unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"theirs");
        assert!(!std::fs::symlink_metadata(&path).unwrap().file_type().is_symlink());
        // A directory others may write: neither read nor written.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(read_private_file(&path).is_err());
        assert!(write_private_file(&path, b"x").is_err());
    }

    #[test]
    fn a_parent_anyone_may_write_without_the_sticky_bit_is_refused() {
        let base = scratch("parent");
        let base = base.path();
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let error = ensure_private_dir(&open.join("usbwire")).unwrap_err();
        assert!(matches!(error, PrivateDirError::WritableParent { mode: 0o777, .. }), "{error}");
        // Sticky, like /tmp: others cannot rename what is ours.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        ensure_private_dir(&open.join("usbwire")).unwrap();
    }

    #[test]
    fn the_cli_trusts_sockets_of_its_own_user_in_private_or_sticky_directories() {
        let base = scratch("socket");
        let base = base.path();
        let socket = base.join("control.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        check_socket_owner(&socket).unwrap();
        std::fs::set_permissions(base, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(check_socket_owner(&socket), Err(SocketOwnerError::Writable { .. })));
        std::fs::set_permissions(base, std::fs::Permissions::from_mode(0o1777)).unwrap();
        check_socket_owner(&socket).unwrap();
    }

    #[test]
    fn a_system_accounts_socket_is_trusted_a_login_users_is_not() {
        if effective_uid() != 0 {
            eprintln!("skipped: changing a file's owner needs root");
            return;
        }
        let base = scratch("system-user");
        let base = base.path();
        let socket = base.join("control.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        // The packaged server's user is a system account (< 1000), like this one.
        std::os::unix::fs::lchown(&socket, Some(999), None).unwrap();
        std::os::unix::fs::lchown(base, Some(999), None).unwrap();
        check_socket_owner(&socket).unwrap();
        std::os::unix::fs::lchown(&socket, Some(65534), None).unwrap();
        assert!(matches!(check_socket_owner(&socket), Err(SocketOwnerError::NotOwned { owner: 65534, .. })));
    }
}
