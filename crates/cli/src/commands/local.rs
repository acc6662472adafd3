//! Verbs that talk to the server on this machine through its control socket:
//! `usbwire type`, `usbwire state`, `usbwire bind`, `usbwire unbind` and
//! `usbwire capture`.

use std::path::PathBuf;

use anyhow::anyhow;
use usbwire_proto::display::escape;
use usbwire_server::{
    control_request, default_control_path, BindRuleState, ControlErrorKind, ControlRequest, ControlResponse,
};
use usbwire_transport::devstate::CountedDevice;

use super::common::stdout::outln;
use super::common::usb_names::{display_name, UsbIds};
use crate::args::{BindArgs, CaptureArgs, ControlArgs, StateArgs, TypeArgs, UnbindArgs};
use crate::exit::Failure;

async fn ask(control: &ControlArgs, request: ControlRequest) -> Result<ControlResponse, Failure> {
    let path: PathBuf = control.control.clone().unwrap_or_else(default_control_path);
    let response = control_request(&path, &request).await.map_err(|error| {
        // Not ours to talk to: say exactly that, not "is it running?".
        if error.get_ref().is_some_and(|inner| inner.is::<usbwire_server::private_dir::SocketOwnerError>()) {
            return Failure::not_admitted(anyhow!(error));
        }
        Failure::unavailable(anyhow!(
            "cannot reach a usbwire server through {}: {error} (is `usbwire serve` running? pass --control PATH if it uses another socket)",
            path.display()
        ))
    })?;
    if response.ok {
        return Ok(response);
    }
    let error = anyhow!(response.error.unwrap_or_else(|| "the server refused".into()));
    Err(match response.error_kind {
        Some(ControlErrorKind::Data) => Failure::data(error),
        Some(ControlErrorKind::Os) => Failure::os(error),
        Some(ControlErrorKind::CannotCreate) => Failure::cannot_create(error),
        Some(ControlErrorKind::Config) => Failure::config(error),
        Some(ControlErrorKind::Permission) => Failure::not_admitted(error),
        Some(ControlErrorKind::Internal) => Failure::software(error),
        // Unavailable, and what an older or newer server does not say.
        _ => Failure::unavailable(error),
    })
}

pub(crate) async fn type_text(args: TypeArgs) -> Result<(), Failure> {
    let response = ask(&args.control, ControlRequest::Type { text: args.text, busid: args.busid }).await?;
    tracing::debug!(reports = response.reports, "typed");
    Ok(())
}

pub(crate) async fn state(args: StateArgs) -> Result<(), Failure> {
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
        return super::common::output::print_json(&document, false);
    }
    outln!("{:<6} {:<9} {:<10} {:<10} {:<22} {:<20} device", "busid", "kind", "id", "state", "client", "since")?;
    for (d, record) in devices.into_iter().zip(&records) {
        let since = d.since.map(super::common::output::rfc3339).unwrap_or_default();
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

pub(crate) async fn bind(args: BindArgs) -> Result<(), Failure> {
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

/// What the server did but wants the user to know (a bind it cannot keep across a restart).
fn warn_of(response: &ControlResponse) {
    if let Some(warning) = &response.warning {
        eprintln!("usbwire: warning: {}", usbwire_proto::display::escape(warning));
    }
}

pub(crate) async fn capture(args: CaptureArgs) -> Result<(), Failure> {
    // The server writes the files: an absolute path means the same to it as to us.
    let dir = match &args.dir {
        Some(dir) => Some(std::path::absolute(dir).map_err(|e| Failure::usage(e.into()))?),
        None => None,
    };
    ask(&args.control, ControlRequest::Capture { dir: dir.clone() }).await?;
    match dir {
        Some(dir) => outln!("capturing every import into {} (usbwire capture --stop ends it)", dir.display()),
        None => outln!("capture stopped"),
    }
}

pub(crate) async fn unbind(args: UnbindArgs) -> Result<(), Failure> {
    let response = match (&args.busid, &args.device, args.all) {
        (Some(busid), _, _) => {
            let response = ask(&args.control, ControlRequest::Unbind { busid: busid.clone() }).await?;
            outln!("unbind device on busid {busid}: complete")?;
            response
        }
        (None, Some(device), _) => {
            let response = ask(&args.control, ControlRequest::UnbindDevice { device: device.clone() }).await?;
            outln!("unbind {device}: {}", unbound(&response))?;
            response
        }
        (None, None, true) => {
            let response = ask(&args.control, ControlRequest::UnbindAll).await?;
            outln!("unbind all: {}", unbound(&response))?;
            response
        }
        (None, None, false) => {
            return Err(Failure::usage(anyhow!("unbind needs -b BUSID, --device SELECTOR or --all")))
        }
    };
    warn_of(&response);
    Ok(())
}

/// What an unbind did to rules and devices: `1 rule forgotten (0781:5567),
/// no device was exported`, `withdrew 1-1.2`. An older server does not say
/// which rules it forgot: then only the devices.
fn unbound(response: &ControlResponse) -> String {
    let busids = response.busids.as_deref().unwrap_or_default();
    let devices =
        if busids.is_empty() { "no device was exported".to_owned() } else { format!("withdrew {}", busids.join(", ")) };
    match response.forgotten.as_deref() {
        None => devices,
        Some([]) => format!("no rule was bound by hand, {devices}"),
        Some(rules) => {
            let count = if rules.len() == 1 { "1 rule".to_owned() } else { format!("{} rules", rules.len()) };
            let names: Vec<String> = rules.iter().map(|rule| escape(rule).to_string()).collect();
            format!("{count} forgotten ({}), {devices}", names.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unbind_says_what_happened_to_each_rule_and_device() {
        let said = |busids: &[&str], forgotten: Option<&[&str]>| {
            unbound(&ControlResponse {
                ok: true,
                busids: Some(busids.iter().map(|b| (*b).to_owned()).collect()),
                forgotten: forgotten.map(|rules| rules.iter().map(|r| (*r).to_owned()).collect()),
                ..ControlResponse::default()
            })
        };
        assert_eq!(said(&[], Some(&["0781:5567"])), "1 rule forgotten (0781:5567), no device was exported");
        assert_eq!(said(&["1-1.2"], Some(&["a", "b"])), "2 rules forgotten (a, b), withdrew 1-1.2");
        assert_eq!(said(&["1-1.2"], Some(&[])), "no rule was bound by hand, withdrew 1-1.2");
        assert_eq!(said(&[], None), "no device was exported");
    }
}
