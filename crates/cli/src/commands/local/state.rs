//! `usbwire state`: the server's devices, who holds each, and its bind rules.

use usbwire_device::devstate::CountedDevice;
use usbwire_proto::display::escape;
use usbwire_server::{BindRuleState, ControlRequest};

use super::ask;
use crate::args::StateArgs;
use crate::commands::common::stdout::outln;
use crate::commands::common::usb_names::{display_name, UsbIds};
use crate::exit::Failure;

pub(crate) async fn run(args: StateArgs) -> Result<(), Failure> {
    let response = ask(&args.control, ControlRequest::State).await?;
    let devices = response.devices.unwrap_or_default();
    // Named from this machine's usb.ids, as `list -r` names them (docs/json.md).
    let names = UsbIds::load();
    let records: Vec<CountedDevice> = devices
        .iter()
        .map(|entry| {
            let mut record = CountedDevice::from(entry);
            record.device.fill_names(&names);
            record
        })
        .collect();
    if args.json {
        let document = serde_json::json!({ "devices": records, "bind_rules": response.bind_rules });
        return crate::commands::common::output::print_json(&document, false);
    }
    outln!("{:<6} {:<9} {:<10} {:<10} {:<22} {:<20} device", "busid", "kind", "id", "state", "client", "since")?;
    for (d, record) in devices.into_iter().zip(&records) {
        let since = d.since.map(crate::commands::common::output::rfc3339).unwrap_or_default();
        outln!(
            "{:<6} {:<9} {:<10} {:<10} {:<22} {:<20} {}",
            d.busid,
            d.kind,
            format!("{}:{}", d.vendor_id, d.product_id),
            d.state,
            d.client.unwrap_or_else(|| "-".into()),
            since,
            display_name(&record.device)
        )?;
    }
    print_bind_rules(&response.bind_rules.unwrap_or_default())
}

/// The server's bind rules under its devices: each with where it comes from
/// and what it exported, or that it waits for a device.
fn print_bind_rules(rules: &[BindRuleState]) -> Result<(), Failure> {
    if rules.is_empty() {
        return Ok(());
    }
    outln!("\nbind rules:")?;
    outln!("  {:<24} {:<7} exported", "rule", "from")?;
    for rule in rules {
        let exported = if rule.busids.is_empty() {
            "none yet: waiting for a matching device".to_owned()
        } else {
            rule.busids.join(", ")
        };
        let from = if rule.source == "bind" { "bind" } else { "config" };
        outln!("  {:<24} {:<7} {}", escape(&rule.rule).to_string(), from, exported)?;
    }
    Ok(())
}
