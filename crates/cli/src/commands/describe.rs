//! `usbwire describe`: a remote device's descriptor tree, read over USB/IP,
//! with the device's record (docs/json.md) as `list -r` shows it.

use anyhow::anyhow;
use usbwire_proto::op::BusId;

use super::common::description::{fetch, format};
use super::common::device_json::described;
use super::common::usb_names::{display_name, UsbIds};
use crate::args::DescribeArgs;
use crate::exit::Failure;

pub(crate) async fn run(args: DescribeArgs) -> Result<(), Failure> {
    let busid = BusId::new(&args.device.busid)
        .ok_or_else(|| Failure::usage(anyhow!("invalid bus id {:?}", args.device.busid)))?;
    let addr = super::common::peer::resolve(&args.device.remote, args.device.tcp_port).await?;
    let security = super::common::peer::client_security(&args.device.security)?;
    // What the server says of the device (its kind, its state), asked
    // before the import below holds it; a stock server says nothing.
    let state = match usbwire_client::server_state(addr, &security).await {
        Ok(document) => document.and_then(|d| d.devices.into_iter().find(|s| s.busid == busid.as_str())),
        Err(error) => {
            tracing::debug!(%error, "no device state from this server");
            None
        }
    };
    let (record, description) = fetch(addr, &busid, &security).await?;
    let names = UsbIds::load();
    let device = described(&record, &description, state.as_ref(), &names);
    if args.json {
        super::common::output::print_json(&document(&device, &description), true)
    } else {
        super::common::stdout::out!("{}", format(&busid, &display_name(&device), &description, &names))
    }
}

/// The device's record (docs/json.md), then its descriptors: the fields of
/// the descriptor tree the record does not already hold.
fn document(
    device: &usbwire_device::record::DeviceJson,
    description: &usbwire_client::describe::Description,
) -> serde_json::Value {
    let mut document = serde_json::to_value(device).unwrap_or_default();
    if let (Some(fields), Ok(serde_json::Value::Object(tree))) =
        (document.as_object_mut(), serde_json::to_value(description))
    {
        for (key, value) in tree {
            fields.entry(key).or_insert(value);
        }
    }
    document
}
