//! Reaching the lab registry from a command: the endpoint the registry
//! flags name, the exit code of a registry error, the reservation `attach
//! --registry` and `usbwire client` take, how they reach the reserved
//! device's server ([`RegistryTrust`]: TLS pinned to the key in the server's
//! entry, plain only when allowed), and the tokens of this user's
//! reservations, kept so a later `attach` can use what `reserve --for` took.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::anyhow;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use usbwire_client::{Security, TlsClient};
use usbwire_lab::{Endpoint, EtcdTls, Hold, Lab, LabError, Reservation, ServerEntry, Want, DEFAULT_TTL};
use usbwire_proto::display::escape;
use usbwire_proto::reservation::ReservationToken;
use usbwire_transport::known_servers::KnownServers;
use usbwire_transport::Fingerprint;

use crate::args::RegistryArgs;
use crate::exit::Failure;

pub(crate) fn failure(error: LabError) -> Failure {
    match error {
        LabError::NoneFree { .. } => Failure::temporary(error.into()),
        // The selector names no device of the fleet at all.
        LabError::NoMatch { .. } => Failure::data(error.into()),
        LabError::Tls(_) => Failure::config(error.into()),
        _ => Failure::unavailable(error.into()),
    }
}

/// The registry `--registry` (and the TLS flags beside it) names: `None`
/// when the flag is not given; a bare `--registry` is the user's default
/// ([`default_endpoint`]).
pub(crate) fn endpoint(args: &RegistryArgs) -> Result<Option<Endpoint>, Failure> {
    match &args.registry {
        None => Ok(None),
        Some(Some(url)) => Ok(Some(with_tls(url.clone(), args, None))),
        Some(None) => default_endpoint(args).map(Some),
    }
}

/// The registry of a verb that always needs one (`reserve`, `release`,
/// `who`): `--registry`'s, else the user's default.
pub(crate) fn required(args: &RegistryArgs) -> Result<Endpoint, Failure> {
    match endpoint(args)? {
        Some(endpoint) => Ok(endpoint),
        None => default_endpoint(args),
    }
}

/// The user's default registry: `$USBWIRE_REGISTRY`, else `[registry]` in
/// the user's `usbwire.toml` (whose `ca`, `cert` and `key` apply unless the
/// flags say otherwise).
fn default_endpoint(args: &RegistryArgs) -> Result<Endpoint, Failure> {
    use crate::config::{user_config_path, UserConfig, REGISTRY_ENV};
    if let Some(text) = std::env::var_os(REGISTRY_ENV).filter(|value| !value.is_empty()) {
        let text = text.to_string_lossy();
        let url = text
            .parse()
            .map_err(|error| Failure::config(anyhow!("{REGISTRY_ENV}={text:?} is not a lab registry URL: {error}")))?;
        return Ok(with_tls(url, args, None));
    }
    let path = user_config_path();
    let table = UserConfig::load(&path).map_err(Failure::config)?.and_then(|config| config.registry);
    let Some(table) = table else {
        return Err(Failure::usage(anyhow!(
            "no lab registry named: pass --registry etcd://HOST:PORT, set {REGISTRY_ENV}=etcd://HOST:PORT, or put \
             [registry] endpoints = [\"HOST:PORT\"] in {}",
            path.display()
        )));
    };
    let from_file = table.endpoint().map_err(|error| Failure::config(error.context(path.display().to_string())))?;
    Ok(with_tls(from_file.url, args, from_file.tls))
}

/// `url` with TLS as the flags say, else as `fallback` (the config's) says.
fn with_tls(url: usbwire_lab::RegistryUrl, args: &RegistryArgs, fallback: Option<EtcdTls>) -> Endpoint {
    let flags = (args.registry_ca.is_some() || args.registry_cert.is_some()).then(|| EtcdTls {
        ca: args.registry_ca.clone(),
        cert: args.registry_cert.clone(),
        key: args.registry_key.clone(),
    });
    Endpoint { url, tls: flags.or(fallback) }
}

/// A reservation that failed, with the command that shows why, naming the
/// registry it asked (not a placeholder): what it holds when nothing
/// matched, who holds the matching devices when none is free.
pub(crate) fn reserve_failure(error: LabError, url: &str) -> Failure {
    match error {
        LabError::NoMatch { .. } => {
            Failure::unavailable(anyhow!("{error}; see what it has: `usbwire list --registry {url}`"))
        }
        LabError::NoneFree { .. } => {
            Failure::temporary(anyhow!("{error}; see who holds them: `usbwire who --registry {url}`"))
        }
        other => failure(other),
    }
}

pub(crate) fn want(text: &str) -> Result<Want, Failure> {
    text.parse().map_err(|e: usbwire_lab::WantError| Failure::usage(e.into()))
}

/// How a registry attach reaches the server of the device it reserved. The
/// registry is not trusted to name a server: anyone who can write to it
/// could plant one. So the server's entry must carry its TLS key, and the
/// connection accepts only that key ([`TlsClient::pinned`]; `known_servers`
/// is neither read nor written); an entry without one (a plain server) is
/// refused unless `allow_plain` (`attach --allow-plain`, `plain = true` in
/// the client's `[registry]`) says plain USB/IP from this registry is fine.
#[derive(Clone, Debug)]
pub(crate) struct RegistryTrust {
    /// This client's identity directory (`--identity`, `identity =`), default when `None`.
    pub(crate) identity: Option<PathBuf>,
    pub(crate) allow_plain: bool,
}

impl RegistryTrust {
    /// TLS pinned to the entry's key; plain for an entry without one if
    /// allowed. Refused (69) for a plain entry otherwise, with what to do;
    /// an entry whose key is not a fingerprint is the registry's fault (65).
    pub(crate) fn security(&self, entry: &ServerEntry) -> Result<Security, Failure> {
        let server = escape(&entry.address);
        let Some(text) = &entry.tls_fingerprint else {
            if self.allow_plain {
                tracing::warn!(%server, "plain USB/IP to a server the lab registry names (--allow-plain): not authenticated");
                return Ok(Security::Plain);
            }
            return Err(Failure::unavailable(anyhow!(
                "refused: the lab registry lists {server} as a plain USB/IP server (its entry carries no TLS key to \
                 check it against), and anyone who can write to the registry could have planted it; serve it \
                 with `usbwire serve --tls --registry …` so its entry carries its key, or accept plain servers \
                 from this registry with --allow-plain (`plain = true` in [registry] for `usbwire client`)"
            )));
        };
        let pinned: Fingerprint = text.parse().map_err(|error: String| {
            Failure::protocol(anyhow!(
                "the lab registry entry of {server} has an invalid TLS key: {}; refused",
                escape(&error)
            ))
        })?;
        let (identity, dir) = super::peer::client_identity(self.identity.as_deref())?;
        Ok(Security::Tls(std::sync::Arc::new(TlsClient {
            identity,
            known: KnownServers::in_dir(&dir),
            trust_new: false,
            pinned: Some(pinned),
        })))
    }
}

/// What `attach --registry` imports: a reservation of ours that matches
/// (from `reserve --for`) if one is still held, else a new one held while
/// the relay runs. Returns the reservation's server (its entry: address and
/// TLS key), bus id, token and, when new, the reservation to keep alive.
pub(crate) struct Taken {
    pub(crate) server: ServerEntry,
    pub(crate) busid: String,
    pub(crate) token: ReservationToken,
    pub(crate) held: Option<Reservation>,
    pub(crate) until: Option<SystemTime>,
}

pub(crate) async fn take(args: &RegistryArgs, device: &str, hold_for: Option<Duration>) -> Result<Taken, Failure> {
    let want = want(device)?;
    let endpoint = required(args)?;
    let url = endpoint.url.to_string();
    let mut lab = Lab::connect(endpoint).await.map_err(failure)?;
    let store = TokenStore::for_user();
    for saved in store.load(&url) {
        let Some(token) = saved.token() else { continue };
        let held = lab.still_held(&saved.server, &saved.busid, &token).await.map_err(failure)?;
        let Some((server, device)) = held else {
            // Run out, or someone else's since: the token is worth nothing now.
            store.forget(&url, &saved.server, &saved.busid);
            continue;
        };
        if want.matches(&device) {
            tracing::info!(server = %saved.server, busid = %saved.busid, "using the reservation made earlier");
            return Ok(Taken { server, busid: saved.busid, token, held: None, until: None });
        }
    }
    let until = hold_for.map(|d| SystemTime::now() + d);
    let reservation = lab
        .reserve(&want, Hold::WhileRunning { ttl: DEFAULT_TTL, until }, "usbwire attach")
        .await
        .map_err(|e| reserve_failure(e, &url))?;
    Ok(Taken {
        server: reservation.server.clone(),
        busid: reservation.device.record.busid.clone(),
        token: reservation.token,
        held: Some(reservation),
        until,
    })
}

/// This user's reservation tokens, one file each (mode 0600 in a private
/// 0700 directory, refused if a symlink, another user's or open to others'
/// writes): root's in `/var/lib/usbwire-client/reservations`, whatever the
/// environment says (a `sudo` that kept `HOME` must not write root's tokens
/// into a user's directory, nor into the server's user's `/var/lib/usbwire`);
/// others' in `$XDG_STATE_HOME/usbwire/reservations`, else
/// `~/.local/state/usbwire/reservations`. Each is written to a new file
/// beside it and renamed into place: never through a symlink.
pub(crate) struct TokenStore {
    dir: PathBuf,
}

/// Root's token directory: root-owned all the way down.
const ROOT_TOKEN_DIR: &str = "/var/lib/usbwire-client/reservations";

#[derive(Serialize, Deserialize)]
pub(crate) struct SavedToken {
    registry: String,
    pub(crate) server: String,
    pub(crate) busid: String,
    token: String,
    until: Option<String>,
}

impl SavedToken {
    pub(crate) fn token(&self) -> Option<ReservationToken> {
        ReservationToken::from_hex(&self.token)
    }
}

impl TokenStore {
    pub(crate) fn for_user() -> Self {
        let uid = usbwire_server::private_dir::effective_uid();
        Self { dir: Self::dir_for(uid, std::env::var_os("XDG_STATE_HOME"), std::env::var_os("HOME")) }
    }

    fn dir_for(uid: u32, xdg_state_home: Option<std::ffi::OsString>, home: Option<std::ffi::OsString>) -> PathBuf {
        if uid == 0 {
            return PathBuf::from(ROOT_TOKEN_DIR);
        }
        let base = match xdg_state_home.filter(|d| !d.is_empty()) {
            Some(dir) => PathBuf::from(dir),
            None => Path::new(&home.unwrap_or_else(|| "/".into())).join(".local/state"),
        };
        base.join("usbwire").join("reservations")
    }

    fn path(&self, registry: &str, server: &str, busid: &str) -> PathBuf {
        let digest = Sha256::digest(format!("{registry}\n{server}\n{busid}"));
        let name: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("{name}.json"))
    }

    pub(crate) fn save(&self, registry: &str, reservation: &Reservation) -> std::io::Result<()> {
        let device = &reservation.device;
        self.write(&SavedToken {
            registry: registry.to_owned(),
            server: device.server.clone(),
            busid: device.record.busid.clone(),
            token: reservation.token.hex(),
            until: reservation.entry.until_at.clone(),
        })
    }

    /// Writes `saved` to a new 0600 file (`O_EXCL | O_NOFOLLOW`) in the
    /// private directory and renames it over its place: a symlink planted
    /// there is replaced, never followed.
    fn write(&self, saved: &SavedToken) -> std::io::Result<()> {
        let path = self.path(&saved.registry, &saved.server, &saved.busid);
        let json = serde_json::to_string(saved).map_err(std::io::Error::other)?;
        usbwire_server::private_dir::write_private_file(&path, json.as_bytes()).map_err(|error| match error.kind() {
            std::io::ErrorKind::PermissionDenied => {
                std::io::Error::new(error.kind(), format!("reservation tokens: {error}"))
            }
            _ => error,
        })
    }

    /// The saved tokens for `registry` that have not run out; run-out ones are deleted.
    pub(crate) fn load(&self, registry: &str) -> Vec<SavedToken> {
        if !self.dir.exists() {
            return Vec::new();
        }
        if let Err(error) = usbwire_server::private_dir::check_private_dir(&self.dir) {
            tracing::warn!(%error, "reservation tokens not read");
            return Vec::new();
        }
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return Vec::new() };
        let mut saved = Vec::new();
        for entry in entries.flatten() {
            let Ok(text) = read_no_follow(&entry.path()) else { continue };
            let Ok(token) = serde_json::from_str::<SavedToken>(&text) else { continue };
            let ended = token
                .until
                .as_deref()
                .and_then(|u| humantime::parse_rfc3339(u).ok())
                .is_some_and(|until| until < SystemTime::now());
            if ended {
                let _ = std::fs::remove_file(entry.path());
            } else if token.registry == registry {
                saved.push(token);
            }
        }
        saved
    }

    pub(crate) fn forget(&self, registry: &str, server: &str, busid: &str) {
        let _ = std::fs::remove_file(self.path(registry, server, busid));
    }
}

/// A token file's text; a symlink is not read through.
fn read_no_follow(path: &Path) -> std::io::Result<String> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut text = String::new();
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path)?.read_to_string(&mut text)?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};

    use super::*;

    /// An empty directory (mode 0755) for one test, removed when the guard is dropped.
    fn scratch(name: &str) -> tempfile::TempDir {
        let dir = tempfile::Builder::new().prefix(&format!("usbwire-tokens-{name}-")).tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    fn saved(token: &str) -> SavedToken {
        SavedToken {
            registry: "http://etcd:2379".into(),
            server: "bench3:3240".into(),
            busid: "1-1".into(),
            token: token.into(),
            until: None,
        }
    }

    fn entry(fingerprint: Option<&str>) -> ServerEntry {
        ServerEntry {
            schema_version: usbwire_lab::entry::SCHEMA_VERSION,
            address: "bench3:3240".into(),
            tls_fingerprint: fingerprint.map(str::to_owned),
            plain: fingerprint.is_none(),
            implementation: "usbwire".into(),
            version: "0.1.0".into(),
            started_at: "2026-01-01T00:00:00Z".into(),
            catalog: false,
            catalog_terms: Vec::new(),
        }
    }

    #[test]
    fn a_plain_server_entry_is_refused_unless_plain_is_allowed() {
        let dir = scratch("trust-plain");
        let dir = dir.path();
        let trust = RegistryTrust { identity: Some(dir.join("identity")), allow_plain: false };
        let Err(failure) = trust.security(&entry(None)) else { panic!("a plain entry is refused") };
        assert_eq!(failure.code(), std::process::ExitCode::from(69));
        let text = failure.error.to_string();
        assert!(text.contains("plain USB/IP server") && text.contains("bench3:3240"), "{text}");
        assert!(text.contains("--allow-plain") && text.contains("plain = true") && text.contains("--tls"), "{text}");
        assert!(!dir.join("identity").exists(), "no identity made for a refused server");
        let allowed = RegistryTrust { allow_plain: true, ..trust };
        assert!(matches!(allowed.security(&entry(None)), Ok(Security::Plain)));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_tls_server_entry_is_reached_over_tls_pinned_to_its_key_even_where_plain_is_allowed() {
        let dir = scratch("trust-tls");
        let dir = dir.path();
        let key = format!("sha256:{}", "ab".repeat(32));
        for allow_plain in [false, true] {
            let trust = RegistryTrust { identity: Some(dir.join("identity")), allow_plain };
            let Ok(Security::Tls(tls)) = trust.security(&entry(Some(&key))) else { panic!("TLS expected") };
            assert_eq!(tls.pinned, Some(key.parse().unwrap()));
            assert!(!tls.trust_new);
        }
        let trust = RegistryTrust { identity: Some(dir.join("identity")), allow_plain: true };
        let Err(failure) = trust.security(&entry(Some("sha256:nonsense"))) else { panic!("an invalid key is refused") };
        assert_eq!(failure.code(), std::process::ExitCode::from(65));
        assert!(failure.error.to_string().contains("invalid TLS key"), "{}", failure.error);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn roots_tokens_live_in_a_root_directory_whatever_the_environment_says() {
        let dir = TokenStore::dir_for(0, Some("/home/mallory/.state".into()), Some("/home/mallory".into()));
        assert_eq!(dir, PathBuf::from(ROOT_TOKEN_DIR));
        assert!(!dir.starts_with("/var/lib/usbwire/"), "not in the server user's state directory");
        let dir = TokenStore::dir_for(1000, None, Some("/home/alice".into()));
        assert_eq!(dir, PathBuf::from("/home/alice/.local/state/usbwire/reservations"));
        let dir = TokenStore::dir_for(1000, Some("/home/alice/st".into()), Some("/home/alice".into()));
        assert_eq!(dir, PathBuf::from("/home/alice/st/usbwire/reservations"));
    }

    #[test]
    fn a_planted_symlink_is_replaced_not_followed() {
        let base = scratch("symlink");
        let base = base.path();
        let store = TokenStore { dir: base.join("reservations") };
        store.write(&saved("aa")).unwrap();
        let victim = base.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let path = store.path("http://etcd:2379", "bench3:3240", "1-1");
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        assert!(store.load("http://etcd:2379").is_empty(), "a link is not read through");
        store.write(&saved("bb")).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious", "the link's target is untouched");
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.is_file(), "the link itself was replaced by the token file");
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(&store.dir).unwrap().mode() & 0o777, 0o700);
        let loaded = store.load("http://etcd:2379");
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].token, "bb");
        let leftovers: Vec<_> = std::fs::read_dir(&store.dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers.len(), 1, "no temporary file left: {leftovers:?}");
        let _ = std::fs::remove_dir_all(base);
    }

    #[test]
    fn a_token_directory_that_is_a_symlink_or_open_to_others_is_refused() {
        let base = scratch("dir");
        let base = base.path();
        let elsewhere = base.join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&elsewhere, base.join("reservations")).unwrap();
        let store = TokenStore { dir: base.join("reservations") };
        let error = store.write(&saved("aa")).unwrap_err();
        assert!(error.to_string().contains("symbolic link"), "{error}");
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "nothing written through the link");
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let error = TokenStore { dir: open }.write(&saved("aa")).unwrap_err();
        assert!(error.to_string().contains("writable by other users"), "{error}");
        let _ = std::fs::remove_dir_all(base);
    }
}
