//! `usbwire bind`: exports a device by bus id, or by a `--device` rule the
//! server keeps across restarts.

use anyhow::anyhow;
use usbwire_server::ControlRequest;

use super::{ask, warn_of};
use crate::args::BindArgs;
use crate::commands::common::stdout::outln;
use crate::exit::Failure;

pub(crate) async fn run(args: BindArgs) -> Result<(), Failure> {
    let response = match (&args.busid, &args.device) {
        (Some(busid), _) => {
            let response = ask(&args.control, ControlRequest::Bind { busid: busid.clone() }).await?;
            outln!("bind device on busid {busid}: complete")?;
            response
        }
        (None, Some(device)) => {
            let response = ask(&args.control, ControlRequest::BindDevice { device: device.clone() }).await?;
            let busids = response.busids.clone().unwrap_or_default();
            if busids.is_empty() {
                outln!("bind {device}: no such device is plugged in now; it is exported when one is")?;
            } else {
                outln!("bind {device}: exported {}", busids.join(", "))?;
            }
            outln!("  kept across server restarts until `usbwire unbind --device {device}`")?;
            response
        }
        (None, None) => return Err(Failure::usage(anyhow!("bind needs -b BUSID or --device SELECTOR"))),
    };
    warn_of(&response);
    Ok(())
}
