//! A private certificate authority for fleets: one CA key signs client
//! identities that carry a name, and a server that trusts the CA admits any
//! client it issued for a name its `[[allow]]` rules mention (`ca:NAME`),
//! with no per-client fingerprint to collect. Issued certificates expire
//! (`days`); an expired, foreign or misnamed one is refused like an unknown key.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::CertificateError;

use crate::identity::{Identity, IdentityError, ISSUED_BY_PREFIX};
use crate::key_files::{write_key_files, Existing, KeyFile, KeyFileError};

const CA_CERT_FILE: &str = "ca.crt";
const CA_KEY_FILE: &str = "ca.key";

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("no CA in {} (create one with `usbwire identity --dir {} --ca-create NAME`)", .0.display(), .0.display())]
    Missing(PathBuf),
    #[error("{path} is not a {what}")]
    Malformed { path: PathBuf, what: &'static str },
    #[error("{path} is readable by others (mode {mode:o}): chmod 600 it")]
    KeyTooOpen { path: PathBuf, mode: u32 },
    #[error("certificate generation failed: {0}")]
    Generate(String),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// Writing the CA's files was refused or failed (a CA already there, a shared directory).
    #[error(transparent)]
    Files(#[from] KeyFileError),
}

fn generate_error(error: impl std::fmt::Display) -> CaError {
    CaError::Generate(error.to_string())
}

/// The CA's own parameters, rebuilt the same way each time so a loaded CA
/// signs with the subject its stored certificate carries.
fn ca_params(name: &str) -> Result<rcgen::CertificateParams, CaError> {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(generate_error)?;
    params.distinguished_name.push(rcgen::DnType::CommonName, format!("usbwire CA {name}"));
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::DigitalSignature];
    Ok(params)
}

/// A CA able to issue client identities.
pub struct CertificateAuthority {
    name: String,
    key: rcgen::KeyPair,
    certificate: rcgen::Certificate,
}

impl CertificateAuthority {
    /// Creates a CA named `name` and writes `ca.key` (0600) and `ca.crt`
    /// (0644) into `dir` through [`write_key_files`]: a CA already there is
    /// refused (its key signed every certificate its servers trust), or with
    /// [`Existing::KeepAsOld`] kept as `ca.key.old` and `ca.crt.old`.
    /// Returns the CA and where old files were kept.
    pub fn create(dir: &Path, name: &str, existing: Existing) -> Result<(Self, Vec<PathBuf>), CaError> {
        let key = rcgen::KeyPair::generate().map_err(generate_error)?;
        let certificate = ca_params(name)?.self_signed(&key).map_err(generate_error)?;
        let key_text = format!("# usbwire CA {name}\n{}", key.serialize_pem());
        let certificate_text = certificate.pem();
        let files = [
            KeyFile { name: CA_KEY_FILE, contents: key_text.as_bytes(), mode: 0o600 },
            KeyFile { name: CA_CERT_FILE, contents: certificate_text.as_bytes(), mode: 0o644 },
        ];
        let kept = write_key_files(dir, &files, existing)?;
        Ok((Self { name: name.to_owned(), key, certificate }, kept))
    }

    /// Whether `dir` holds a CA's key (`ca.key`), whatever its state.
    pub fn is_in(dir: &Path) -> bool {
        fs::symlink_metadata(dir.join(CA_KEY_FILE)).is_ok()
    }

    /// Loads the CA in `dir` (its key must be 0600).
    pub fn load(dir: &Path) -> Result<Self, CaError> {
        let key_path = dir.join(CA_KEY_FILE);
        let text = fs::read_to_string(&key_path).map_err(|_| CaError::Missing(dir.to_path_buf()))?;
        let mode = fs::metadata(&key_path).map(|m| m.permissions().mode() & 0o777).unwrap_or(0);
        if mode & 0o077 != 0 {
            return Err(CaError::KeyTooOpen { path: key_path, mode });
        }
        let name = text.lines().next().and_then(|l| l.strip_prefix("# usbwire CA ")).unwrap_or("usbwire").to_owned();
        let key = rcgen::KeyPair::from_pem(&text)
            .map_err(|_| CaError::Malformed { path: key_path.clone(), what: "PEM private key" })?;
        let certificate = ca_params(&name)?.self_signed(&key).map_err(generate_error)?;
        Ok(Self { name, key, certificate })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Issues a client identity for `name`, valid from yesterday for `days` days.
    pub fn issue(&self, name: &str, days: i64) -> Result<Identity, CaError> {
        let now = time::OffsetDateTime::now_utc();
        self.issue_valid(name, now - time::Duration::days(1), now + time::Duration::days(days))
    }

    /// Issues a client identity for `name` valid between the two times.
    pub fn issue_valid(
        &self,
        name: &str,
        not_before: time::OffsetDateTime,
        not_after: time::OffsetDateTime,
    ) -> Result<Identity, CaError> {
        let key = rcgen::KeyPair::generate().map_err(generate_error)?;
        let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).map_err(generate_error)?;
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        params.not_before = not_before;
        params.not_after = not_after;
        let certificate = params.signed_by(&key, &self.certificate, &self.key).map_err(generate_error)?;
        // Beside the PEM (parsers skip text before it): what a refusal names (`Identity::issued_by`).
        let certificate_pem = format!("{ISSUED_BY_PREFIX}{} for {name}\n{}", self.name, certificate.pem());
        Ok(Identity::from_parts(certificate.der().clone(), &certificate_pem, &key)?)
    }
}

/// A CA certificate a server trusts for client identities.
#[derive(Clone, Debug)]
pub struct TrustedCa {
    certificate: CertificateDer<'static>,
}

impl TrustedCa {
    /// Loads `ca.crt` (a directory holding it, or the file itself).
    pub fn load(path: &Path) -> Result<Self, CaError> {
        let file = if path.is_dir() { path.join(CA_CERT_FILE) } else { path.to_path_buf() };
        let pem = fs::read(&file).map_err(|source| CaError::Io { path: file.clone(), source })?;
        let certificate = CertificateDer::from_pem_slice(&pem)
            .map_err(|_| CaError::Malformed { path: file, what: "PEM certificate" })?;
        Ok(Self { certificate })
    }

    /// Whether `leaf` was issued by this CA for `name`, is for client
    /// authentication and is valid now; if not, why (the reason a refused
    /// client is sent, as a TLS alert).
    pub fn check(&self, leaf: &CertificateDer<'_>, name: &str) -> Result<(), CertificateError> {
        let end_entity = webpki::EndEntityCert::try_from(leaf).map_err(|_| CertificateError::BadEncoding)?;
        let subject = ServerName::try_from(name).map_err(|_| CertificateError::NotValidForName)?;
        // The name first: a certificate for another name is not this rule's, whatever its dates.
        end_entity.verify_is_valid_for_subject_name(&subject).map_err(|_| CertificateError::NotValidForName)?;
        let anchor =
            webpki::anchor_from_trusted_cert(&self.certificate).map_err(|_| CertificateError::UnknownIssuer)?;
        end_entity
            .verify_for_usage(
                webpki::ALL_VERIFICATION_ALGS,
                &[anchor],
                &[],
                UnixTime::now(),
                webpki::KeyUsage::client_auth(),
                None,
                None,
            )
            .map(drop)
            .map_err(|error| match error {
                webpki::Error::CertExpired { .. } => CertificateError::Expired,
                webpki::Error::CertNotValidYet { .. } => CertificateError::NotValidYet,
                webpki::Error::RequiredEkuNotFoundContext(_) => CertificateError::InvalidPurpose,
                _ => CertificateError::UnknownIssuer,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> crate::ScratchDir {
        crate::ScratchDir::new(&format!("ca-{name}"))
    }

    #[test]
    fn issued_identities_are_vouched_for_by_name_validity_and_issuer() {
        let dir = scratch("fleet");
        let dir = dir.path();
        let ca = CertificateAuthority::create(&dir, "fleet", Existing::Refuse).unwrap().0;
        let trusted = TrustedCa::load(&dir).unwrap();
        let bob = ca.issue("bob", 30).unwrap();
        assert_eq!(trusted.check(bob.certificate(), "bob"), Ok(()));
        assert_eq!(bob.issued_by(), Some(("fleet", "bob")));
        assert_eq!(Identity::generate("bob").unwrap().issued_by(), None, "self-made");
        // The note survives a save and a load, and the certificate still parses.
        let saved = scratch("fleet-bob");
        bob.save(&saved.path(), Existing::Refuse).unwrap();
        let loaded = Identity::load(&saved.path()).unwrap();
        assert_eq!((loaded.issued_by(), loaded.fingerprint()), (Some(("fleet", "bob")), bob.fingerprint()));
        assert_eq!(trusted.check(bob.certificate(), "eve"), Err(CertificateError::NotValidForName));
        let now = time::OffsetDateTime::now_utc();
        let expired = ca.issue_valid("bob", now - time::Duration::days(10), now - time::Duration::days(1)).unwrap();
        assert_eq!(trusted.check(expired.certificate(), "bob"), Err(CertificateError::Expired));
        let early = ca.issue_valid("bob", now + time::Duration::days(1), now + time::Duration::days(10)).unwrap();
        assert_eq!(trusted.check(early.certificate(), "bob"), Err(CertificateError::NotValidYet));
        let other_dir = scratch("other");
        let other = CertificateAuthority::create(&other_dir.path(), "other", Existing::Refuse).unwrap().0;
        let foreign = other.issue("bob", 30).unwrap();
        assert_eq!(trusted.check(foreign.certificate(), "bob"), Err(CertificateError::UnknownIssuer), "another CA");
        // A reloaded CA still issues what the stored certificate vouches for.
        let reloaded = CertificateAuthority::load(&dir).unwrap();
        assert_eq!(reloaded.name(), "fleet");
        assert_eq!(trusted.check(reloaded.issue("carol", 1).unwrap().certificate(), "carol"), Ok(()));
        // A self-signed identity is not CA-issued.
        let own = Identity::generate("bob").unwrap();
        assert!(trusted.check(own.certificate(), "bob").is_err());
    }

    #[test]
    fn an_open_ca_key_is_refused() {
        let dir = scratch("open");
        let dir = dir.path();
        CertificateAuthority::create(&dir, "open", Existing::Refuse).unwrap();
        fs::set_permissions(dir.join(CA_KEY_FILE), fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(CertificateAuthority::load(&dir), Err(CaError::KeyTooOpen { .. })));
    }

    #[test]
    fn a_ca_is_never_replaced_unless_forced_and_its_certificates_still_verify_against_the_kept_one() {
        let dir = scratch("replace");
        let dir = dir.path();
        let (first, _) = CertificateAuthority::create(&dir, "fleet", Existing::Refuse).unwrap();
        let bob = first.issue("bob", 30).unwrap();
        let error = CertificateAuthority::create(&dir, "fleet", Existing::Refuse).err().unwrap();
        assert!(matches!(error, CaError::Files(KeyFileError::Exists { .. })), "{error}");
        assert_eq!(TrustedCa::load(&dir).unwrap().check(bob.certificate(), "bob"), Ok(()), "the CA is untouched");

        let (_, kept) = CertificateAuthority::create(&dir, "fleet", Existing::KeepAsOld).unwrap();
        assert_eq!(kept, [dir.join("ca.key.old"), dir.join("ca.crt.old")]);
        assert!(TrustedCa::load(&dir).unwrap().check(bob.certificate(), "bob").is_err(), "a new CA");
        let old = TrustedCa::load(&dir.join("ca.crt.old")).unwrap();
        assert_eq!(old.check(bob.certificate(), "bob"), Ok(()), "the kept certificate still vouches for bob");
        assert_eq!(fs::metadata(dir.join("ca.key.old")).unwrap().permissions().mode() & 0o777, 0o600);
    }
}
