//! `usbwire describe`: a remote device's descriptor tree, read over USB/IP.

use anyhow::anyhow;
use usbwire_proto::op::BusId;

use super::common::description::{fetch, format};
use crate::args::DescribeArgs;
use crate::exit::Failure;

pub(crate) async fn run(args: DescribeArgs) -> Result<(), Failure> {
    let busid = BusId::new(&args.device.busid)
        .ok_or_else(|| Failure::usage(anyhow!("invalid bus id {:?}", args.device.busid)))?;
    let addr = super::common::peer::resolve(&args.device.remote, args.device.tcp_port).await?;
    let security = super::common::peer::client_security(&args.device.security)?;
    let description = fetch(addr, &busid, &security).await?;
    if args.json {
        super::common::output::print_json(&description, true);
    } else {
        print!("{}", format(&busid, &description, &super::common::usb_names::UsbIds::load()));
    }
    Ok(())
}
