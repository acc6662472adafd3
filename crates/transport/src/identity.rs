//! Key pairs and fingerprints.
//!
//! An identity is a self-signed certificate and its private key, stored as
//! `identity.crt` and `identity.key` (PEM) in a directory. The key file must
//! be readable by its owner only; a wider mode is refused rather than used.
//! A fingerprint is the SHA-256 of the certificate, written `sha256:` + hex.

use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

use crate::key_files::{write_key_files, Existing, KeyFile, KeyFileError};

/// The line a CA-issued certificate's file starts with: `PREFIX CA for NAME`.
pub(crate) const ISSUED_BY_PREFIX: &str = "# issued by usbwire CA ";

const CERT_FILE: &str = "identity.crt";
const KEY_FILE: &str = "identity.key";

/// Identity problems, each saying what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// No identity in that directory.
    #[error("no identity in {} (create one with `usbwire identity --create --dir {}`)", .0.display(), .0.display())]
    Missing(PathBuf),
    /// The key file can be read by others.
    #[error("{} has mode {mode:o}; secrets must be private: run `chmod 600 {}`", .path.display(), .path.display())]
    KeyTooOpen { path: PathBuf, mode: u32 },
    /// A file is not the PEM we wrote.
    #[error("{} is not a valid {what}", .path.display())]
    Malformed { path: PathBuf, what: &'static str },
    /// The key file holds another key than the certificate's.
    #[error(
        "{}: {KEY_FILE} is not the key of {CERT_FILE} (files from two identities?): put the pair back together, or create a new identity with `usbwire identity --create` and have servers allow its fingerprint",
        .0.display()
    )]
    KeyMismatch(PathBuf),
    /// Key generation failed.
    #[error("cannot generate a key pair: {0}")]
    Generate(String),
    #[error("{}: {source}", .path.display())]
    Io { path: PathBuf, source: io::Error },
    /// Writing the pair was refused or failed (an identity already there, a shared directory).
    #[error(transparent)]
    Files(#[from] KeyFileError),
}

/// SHA-256 of a certificate.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn of(certificate: &[u8]) -> Self {
        Self(Sha256::digest(certificate).into())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("sha256:")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Fingerprint {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let hex = text.strip_prefix("sha256:").unwrap_or(text).replace(':', "");
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("{text:?} is not a fingerprint (sha256: and 64 hex digits)"));
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).map_err(|e| e.to_string())?;
        }
        Ok(Self(out))
    }
}

/// A certificate and its private key.
pub struct Identity {
    pub(crate) certificate: CertificateDer<'static>,
    pub(crate) key: PrivateKeyDer<'static>,
    /// The same two, as written to disk.
    certificate_pem: String,
    key_pem: String,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the key.
        f.debug_struct("Identity").field("fingerprint", &self.fingerprint()).finish_non_exhaustive()
    }
}

impl Identity {
    /// A new ECDSA P-256 key pair with a self-signed certificate for `name`.
    pub fn generate(name: &str) -> Result<Self, IdentityError> {
        let key_pair = rcgen::KeyPair::generate().map_err(|e| IdentityError::Generate(e.to_string()))?;
        let params =
            rcgen::CertificateParams::new(vec![name.to_owned()]).map_err(|e| IdentityError::Generate(e.to_string()))?;
        let certificate = params.self_signed(&key_pair).map_err(|e| IdentityError::Generate(e.to_string()))?;
        Ok(Self {
            certificate: certificate.der().clone(),
            key: PrivateKeyDer::try_from(key_pair.serialize_der())
                .map_err(|e| IdentityError::Generate(e.to_string()))?,
            certificate_pem: certificate.pem(),
            key_pem: key_pair.serialize_pem(),
        })
    }

    pub fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(&self.certificate)
    }

    /// For an identity `usbwire identity --ca-issue` made: the CA's name and
    /// the name it was issued for, as noted beside the certificate (`None`
    /// for a self-made identity, or one issued before the note was written).
    pub fn issued_by(&self) -> Option<(&str, &str)> {
        self.certificate_pem.lines().next()?.strip_prefix(ISSUED_BY_PREFIX)?.rsplit_once(" for ")
    }

    /// The certificate presented to peers.
    pub fn certificate(&self) -> &CertificateDer<'static> {
        &self.certificate
    }

    /// An identity from a certificate issued elsewhere (a CA) and its key pair.
    pub(crate) fn from_parts(
        certificate: CertificateDer<'static>,
        certificate_pem: &str,
        key_pair: &rcgen::KeyPair,
    ) -> Result<Self, IdentityError> {
        Ok(Self {
            certificate,
            key: PrivateKeyDer::try_from(key_pair.serialize_der())
                .map_err(|e| IdentityError::Generate(e.to_string()))?,
            certificate_pem: certificate_pem.to_owned(),
            key_pem: key_pair.serialize_pem(),
        })
    }

    /// Loads `identity.crt` and `identity.key` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, IdentityError> {
        let cert_path = dir.join(CERT_FILE);
        let key_path = dir.join(KEY_FILE);
        if !cert_path.exists() || !key_path.exists() {
            return Err(IdentityError::Missing(dir.to_path_buf()));
        }
        let mode = fs::metadata(&key_path)
            .map_err(|source| IdentityError::Io { path: key_path.clone(), source })?
            .permissions()
            .mode()
            & 0o777;
        if mode & 0o077 != 0 {
            return Err(IdentityError::KeyTooOpen { path: key_path, mode });
        }
        let read =
            |path: &Path| fs::read(path).map_err(|source| IdentityError::Io { path: path.to_path_buf(), source });
        let certificate_pem = read(&cert_path)?;
        let key_pem = read(&key_path)?;
        let certificate = CertificateDer::from_pem_slice(&certificate_pem)
            .map_err(|_| IdentityError::Malformed { path: cert_path.clone(), what: "PEM certificate" })?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|_| IdentityError::Malformed { path: key_path.clone(), what: "PEM private key" })?;
        let provider = rustls::crypto::ring::default_provider();
        match rustls::sign::CertifiedKey::from_der(vec![certificate.clone()], key.clone_key(), &provider) {
            Ok(_) => {}
            Err(rustls::Error::InconsistentKeys(_)) => return Err(IdentityError::KeyMismatch(dir.to_path_buf())),
            Err(_) => return Err(IdentityError::Malformed { path: key_path, what: "private key of a supported type" }),
        }
        Ok(Self {
            certificate,
            key,
            certificate_pem: String::from_utf8_lossy(&certificate_pem).into_owned(),
            key_pem: String::from_utf8_lossy(&key_pem).into_owned(),
        })
    }

    /// Loads the identity in `dir`, creating one named `name` if there is none.
    /// Returns whether it was created.
    pub fn load_or_create(dir: &Path, name: &str) -> Result<(Self, bool), IdentityError> {
        match Self::load(dir) {
            Ok(identity) => Ok((identity, false)),
            Err(IdentityError::Missing(_)) => {
                let identity = Self::generate(name)?;
                match identity.save(dir, Existing::Refuse) {
                    Ok(_) => Ok((identity, true)),
                    // Another process created one first: that one is the identity.
                    Err(IdentityError::Files(KeyFileError::Exists { .. })) => Ok((Self::load(dir)?, false)),
                    Err(other) => Err(other),
                }
            }
            Err(other) => Err(other),
        }
    }

    /// Writes the key (0600) and the certificate (0644) into `dir` (created
    /// 0700) through [`write_key_files`]: an identity already there is
    /// refused, or with [`Existing::KeepAsOld`] kept as `identity.key.old`
    /// and `identity.crt.old`. Returns where old files were kept.
    pub fn save(&self, dir: &Path, existing: Existing) -> Result<Vec<PathBuf>, IdentityError> {
        let files = [
            KeyFile { name: KEY_FILE, contents: self.key_pem.as_bytes(), mode: 0o600 },
            KeyFile { name: CERT_FILE, contents: self.certificate_pem.as_bytes(), mode: 0o644 },
        ];
        Ok(write_key_files(dir, &files, existing)?)
    }
}

/// Where identities live by default: `/etc/usbwire` for root, else
/// `$XDG_CONFIG_HOME/usbwire` or `~/.config/usbwire`.
pub fn default_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/etc/usbwire");
    }
    if let Some(dir) = std::env::var_os("XDG_CONFIG_HOME").filter(|d| !d.is_empty()) {
        return Path::new(&dir).join("usbwire");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/".into());
    Path::new(&home).join(".config/usbwire")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> crate::ScratchDir {
        crate::ScratchDir::new(&format!("identity-{name}"))
    }

    #[test]
    fn save_and_load_keep_the_fingerprint_and_the_key_private() {
        let dir = scratch("roundtrip");
        let dir = dir.path();
        let (created, was_new) = Identity::load_or_create(&dir, "test").unwrap();
        assert!(was_new);
        let mode = fs::metadata(dir.join(KEY_FILE)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (loaded, was_new) = Identity::load_or_create(&dir, "test").unwrap();
        assert!(!was_new);
        assert_eq!(created.fingerprint(), loaded.fingerprint());
        assert!(!format!("{loaded:?}").contains("PRIVATE"));
    }

    #[test]
    fn a_readable_key_is_refused() {
        let dir = scratch("open");
        let dir = dir.path();
        Identity::generate("x").unwrap().save(&dir, Existing::Refuse).unwrap();
        fs::set_permissions(dir.join(KEY_FILE), fs::Permissions::from_mode(0o644)).unwrap();
        let error = Identity::load(&dir).unwrap_err();
        assert!(error.to_string().contains("chmod 600"), "{error}");
    }

    #[test]
    fn a_key_from_another_identity_is_refused() {
        let dir = scratch("mismatch");
        let dir = dir.path();
        Identity::generate("x").unwrap().save(&dir, Existing::Refuse).unwrap();
        let other = scratch("mismatch-other");
        let other = other.path();
        Identity::generate("y").unwrap().save(&other, Existing::Refuse).unwrap();
        fs::copy(other.join(KEY_FILE), dir.join(KEY_FILE)).unwrap();
        let Err(error) = Identity::load(&dir) else { panic!("a mismatched pair was loaded") };
        assert!(matches!(error, IdentityError::KeyMismatch(_)), "{error}");
        assert!(error.to_string().contains("is not the key of"), "{error}");
    }

    #[test]
    fn an_identity_is_never_replaced_unless_forced_and_then_the_old_one_is_kept() {
        let dir = scratch("replace");
        let dir = dir.path();
        let first = Identity::generate("first").unwrap();
        first.save(&dir, Existing::Refuse).unwrap();
        let second = Identity::generate("second").unwrap();
        let error = second.save(&dir, Existing::Refuse).unwrap_err();
        assert!(matches!(error, IdentityError::Files(KeyFileError::Exists { .. })), "{error}");
        assert_eq!(Identity::load(&dir).unwrap().fingerprint(), first.fingerprint(), "untouched");
        // load_or_create never replaces either.
        assert_eq!(Identity::load_or_create(&dir, "third").unwrap().0.fingerprint(), first.fingerprint());

        let kept = second.save(&dir, Existing::KeepAsOld).unwrap();
        assert_eq!(kept, [dir.join("identity.key.old"), dir.join("identity.crt.old")]);
        assert_eq!(Identity::load(&dir).unwrap().fingerprint(), second.fingerprint());
        // The kept pair, put back under its own names, is the first identity, key and all.
        let restored = scratch("replace-restored");
        let restored = restored.path();
        fs::create_dir(&restored).unwrap();
        fs::copy(dir.join("identity.key.old"), restored.join(KEY_FILE)).unwrap();
        fs::copy(dir.join("identity.crt.old"), restored.join(CERT_FILE)).unwrap();
        assert_eq!(Identity::load(&restored).unwrap().fingerprint(), first.fingerprint());
    }

    #[test]
    fn fingerprints_parse_and_print() {
        let fp = Identity::generate("x").unwrap().fingerprint();
        let text = fp.to_string();
        assert!(text.starts_with("sha256:") && text.len() == 71);
        assert_eq!(text.parse::<Fingerprint>().unwrap(), fp);
        assert!("sha256:1234".parse::<Fingerprint>().is_err());
    }
}
