//! `usbwire identity`: this machine's key pair and the fingerprint peers pin,
//! and a private CA's keys (`--ca-create`, `--ca-issue`). No key is ever
//! replaced without `--force` (then the old one is kept as `NAME.old`).

use std::path::{Path, PathBuf};

use serde_json::json;
use usbwire_transport::ca::{CaError, CertificateAuthority};
use usbwire_transport::key_files::{Existing, KeyFileError};
use usbwire_transport::{Identity, IdentityError};

use super::common::stdout::outln;
use crate::args::IdentityArgs;
use crate::exit::Failure;

pub(crate) fn run(args: IdentityArgs) -> Result<(), Failure> {
    let dir = args.dir.clone().unwrap_or_else(usbwire_transport::identity::default_dir);
    let existing = if args.force { Existing::KeepAsOld } else { Existing::Refuse };
    if let Some(name) = &args.ca_create {
        let (_, kept) = CertificateAuthority::create(&dir, name, existing).map_err(|e| ca_failure(e, &dir))?;
        outln!("created CA {name} in {} (servers trust it with --ca {})", dir.display(), dir.display())?;
        print_kept(&kept)?;
        return Ok(());
    }
    if let (Some(name), Some(ca_dir)) = (&args.ca_issue, &args.ca) {
        let ca = CertificateAuthority::load(ca_dir).map_err(|e| ca_failure(e, ca_dir))?;
        let identity = ca.issue(name, args.days).map_err(|e| Failure::software(e.into()))?;
        let kept = identity.save(&dir, existing).map_err(|e| identity_failure(e, &dir))?;
        if args.json {
            super::common::output::print_json(
                &json!({ "fingerprint": identity.fingerprint().to_string(), "dir": dir, "name": name, "days": args.days, "kept": kept }),
                false,
            )?;
        } else {
            outln!(
                "issued {name} by CA {} into {} (valid {} days; admit it with --allow ca:{name})",
                ca.name(),
                dir.display(),
                args.days
            )?;
            print_kept(&kept)?;
        }
        return Ok(());
    }
    let (identity, created, kept) = if args.create && args.force {
        // A new key on purpose: the old pair is kept beside it.
        let identity =
            Identity::generate(&super::common::process::hostname()).map_err(|e| identity_failure(e, &dir))?;
        let kept = identity.save(&dir, Existing::KeepAsOld).map_err(|e| identity_failure(e, &dir))?;
        (identity, true, kept)
    } else if args.create {
        let (identity, created) = Identity::load_or_create(&dir, &super::common::process::hostname())
            .map_err(|e| identity_failure(e, &dir))?;
        (identity, created, Vec::new())
    } else {
        (Identity::load(&dir).map_err(|e| identity_failure(e, &dir))?, false, Vec::new())
    };
    if args.json {
        super::common::output::print_json(
            &json!({ "fingerprint": identity.fingerprint().to_string(), "dir": dir, "created": created, "kept": kept }),
            false,
        )?;
    } else {
        if created {
            outln!("created a new identity in {}", dir.display())?;
        }
        print_kept(&kept)?;
        outln!("{}", identity.fingerprint())?;
    }
    Ok(())
}

/// Says where replaced files were kept, so nobody thinks them gone.
fn print_kept(kept: &[PathBuf]) -> Result<(), Failure> {
    for path in kept {
        outln!("  the replaced file is kept as {}", path.display())?;
    }
    Ok(())
}

/// A key already there, or key files that cannot be made (a directory that
/// cannot be created), is 73; a directory not safe for keys, or a broken
/// identity, is configuration (78); no identity at all is unavailable (69),
/// and a CA's directory is named as one.
fn identity_failure(error: IdentityError, dir: &Path) -> Failure {
    match error {
        IdentityError::Files(files) => key_files_failure(files),
        IdentityError::Missing(_) if CertificateAuthority::is_in(dir) => Failure::unavailable(anyhow::anyhow!(
            "{dir} holds a CA (ca.key), not an identity: servers trust it with `--ca {dir}`, and \
             `usbwire identity --ca {dir} --ca-issue NAME --dir OTHER_DIR` issues an identity from it",
            dir = dir.display()
        )),
        IdentityError::Missing(_) => Failure::unavailable(error.into()),
        other => Failure::config(anyhow::Error::from(other).context(format!("identity in {}", dir.display()))),
    }
}

fn ca_failure(error: CaError, dir: &Path) -> Failure {
    match error {
        CaError::Files(files) => key_files_failure(files),
        CaError::Identity(identity) => identity_failure(identity, dir),
        CaError::Missing(_) => Failure::unavailable(error.into()),
        other => Failure::config(other.into()),
    }
}

fn key_files_failure(error: KeyFileError) -> Failure {
    match error {
        KeyFileError::Exists { .. } | KeyFileError::Io { .. } => Failure::cannot_create(error.into()),
        other => Failure::config(other.into()),
    }
}
