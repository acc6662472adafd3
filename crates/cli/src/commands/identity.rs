//! `usbwire identity`: this machine's key pair and the fingerprint peers pin.

use serde_json::json;
use usbwire_transport::ca::CertificateAuthority;
use usbwire_transport::{Identity, IdentityError};

use crate::args::IdentityArgs;
use crate::exit::Failure;

pub(crate) fn run(args: IdentityArgs) -> Result<(), Failure> {
    let dir = args.dir.clone().unwrap_or_else(usbwire_transport::identity::default_dir);
    if let Some(name) = &args.ca_create {
        CertificateAuthority::create(&dir, name).map_err(|e| Failure::config(e.into()))?;
        println!("created CA {name} in {} (servers trust it with --ca {})", dir.display(), dir.display());
        return Ok(());
    }
    if let (Some(name), Some(ca_dir)) = (&args.ca_issue, &args.ca) {
        let ca = CertificateAuthority::load(ca_dir).map_err(|e| Failure::config(e.into()))?;
        let identity = ca.issue(name, args.days).map_err(|e| Failure::software(e.into()))?;
        identity.save(&dir).map_err(|e| Failure::config(e.into()))?;
        if args.json {
            super::common::output::print_json(
                &json!({ "fingerprint": identity.fingerprint().to_string(), "dir": dir, "name": name, "days": args.days }),
                false,
            );
        } else {
            println!(
                "issued {name} by CA {} into {} (valid {} days; admit it with --allow ca:{name})",
                ca.name(),
                dir.display(),
                args.days
            );
        }
        return Ok(());
    }
    let (identity, created) = if args.create {
        Identity::load_or_create(&dir, &super::common::process::hostname())
    } else {
        Identity::load(&dir).map(|i| (i, false))
    }
    .map_err(|error| match error {
        IdentityError::Missing(_) => Failure::unavailable(error.into()),
        other => Failure::config(anyhow::Error::from(other).context(format!("identity in {}", dir.display()))),
    })?;
    if args.json {
        super::common::output::print_json(
            &json!({ "fingerprint": identity.fingerprint().to_string(), "dir": dir, "created": created }),
            false,
        );
    } else {
        if created {
            println!("created a new identity in {}", dir.display());
        }
        println!("{}", identity.fingerprint());
    }
    Ok(())
}
