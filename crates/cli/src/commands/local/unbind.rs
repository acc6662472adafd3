//! `usbwire unbind`: withdraws a device by bus id, the devices of a `--device`
//! rule (forgetting the rule), or all of them.

use anyhow::anyhow;
use usbwire_proto::display::escape;
use usbwire_server::{ControlRequest, ControlResponse};

use super::{ask, warn_of};
use crate::args::UnbindArgs;
use crate::commands::common::stdout::outln;
use crate::exit::Failure;

pub(crate) async fn run(args: UnbindArgs) -> Result<(), Failure> {
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
