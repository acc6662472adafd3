//! `usbwire identity`: this machine's key pair and the fingerprint peers pin.

use serde_json::json;
use usbwire_transport::{Identity, IdentityError};

use crate::args::IdentityArgs;
use crate::exit::Failure;

pub(crate) fn run(args: IdentityArgs) -> Result<(), Failure> {
    let dir = args.dir.clone().unwrap_or_else(usbwire_transport::identity::default_dir);
    let (identity, created) = if args.create {
        Identity::load_or_create(&dir, &super::hostname())
    } else {
        Identity::load(&dir).map(|i| (i, false))
    }
    .map_err(|error| match error {
        IdentityError::Missing(_) => Failure::unavailable(error.into()),
        other => Failure::config(anyhow::Error::from(other).context(format!("identity in {}", dir.display()))),
    })?;
    if args.json {
        println!("{}", json!({ "fingerprint": identity.fingerprint().to_string(), "dir": dir, "created": created }));
    } else {
        if created {
            println!("created a new identity in {}", dir.display());
        }
        println!("{}", identity.fingerprint());
    }
    Ok(())
}
