//! `usbwire describe`: a remote device's descriptor tree, read over USB/IP.

use anyhow::anyhow;
use usbwire_proto::op::BusId;

use super::common::description::{fetch, format};
use super::common::device_json::described;
use super::common::usb_names::UsbIds;
use crate::args::DescribeArgs;
use crate::exit::Failure;

pub(crate) async fn run(args: DescribeArgs) -> Result<(), Failure> {
    let busid = BusId::new(&args.device.busid)
        .ok_or_else(|| Failure::usage(anyhow!("invalid bus id {:?}", args.device.busid)))?;
    let addr = super::common::peer::resolve(&args.device.remote, args.device.tcp_port).await?;
    let security = super::common::peer::client_security(&args.device.security)?;
    let (record, description) = fetch(addr, &busid, &security).await?;
    let names = UsbIds::load();
    if args.json {
        super::common::output::print_json(&document(&record, &description, &names), true)
    } else {
        super::common::stdout::out!("{}", format(&busid, &description, &names))
    }
}

/// The device's record (docs/json.md), then its descriptors: the fields of
/// the descriptor tree the record does not already hold.
fn document(
    record: &usbwire_proto::op::DeviceRecord,
    description: &usbwire_client::describe::Description,
    names: &UsbIds,
) -> serde_json::Value {
    let mut document = serde_json::to_value(described(record, description, names)).unwrap_or_default();
    if let (Some(fields), Ok(serde_json::Value::Object(tree))) =
        (document.as_object_mut(), serde_json::to_value(description))
    {
        for (key, value) in tree {
            fields.entry(key).or_insert(value);
        }
    }
    document
}
