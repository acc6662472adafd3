//! `usbwire port`: the used ports of vhci-hcd, what is attached to each
//! and, where a relay serves it, what the relay is doing.

use serde_json::json;
use usbwire_client::vhci;
use usbwire_device::record::DeviceJson;

use self::prometheus::RelayedPort;
use super::status_file::relay_status;
use crate::args::PortArgs;
use crate::commands::common::stdout::outln;
use crate::commands::common::usb_names::UsbIds;
use crate::exit::Failure;

/// One used port in `port --json`: the port's own fields, and the device
/// record (docs/json.md) of what is attached there: its bus id on the
/// server, its ids and strings as this machine enumerated it.
fn port_json(p: &vhci::PortStatus, here: &[usbwire_host::LocalDevice], names: &UsbIds) -> serde_json::Value {
    let record = vhci::read_record(p.port);
    let mut device = match here.iter().find(|d| d.busid == p.local_busid) {
        Some(local) => crate::commands::common::device_json::local(local, names).device,
        None => DeviceJson::default(),
    };
    device.busid = record.as_ref().map(|r| r.busid.clone()).unwrap_or_default();
    device.speed = p.speed.name().to_owned();
    let mut value = serde_json::to_value(device).unwrap_or_default();
    if let Some(fields) = value.as_object_mut() {
        let port = json!({
            "port": p.port,
            "hub": p.hub,
            "status": p.status,
            "devid": format!("{:08x}", p.devid),
            "local_busid": p.local_busid,
            "server": record.as_ref().map(|r| format!("{}:{}", r.host, r.service)),
            "remote_host": record.as_ref().map(|r| r.host.clone()),
            "remote_port": record.as_ref().map(|r| r.service.clone()),
            "remote_busid": record.as_ref().map(|r| r.busid.clone()),
            "relay": relay_status(p.port),
        });
        if let serde_json::Value::Object(port) = port {
            fields.extend(port);
        }
    }
    value
}

pub(crate) fn run(args: PortArgs) -> Result<(), Failure> {
    let ports = vhci::ports()?;
    let used: Vec<_> = ports.iter().filter(|p| !p.is_free()).collect();
    if args.prometheus {
        let relayed: Vec<RelayedPort> = used
            .iter()
            .filter_map(|p| {
                let relay = relay_status(p.port)?;
                let busid = vhci::read_record(p.port).map(|r| r.busid).unwrap_or_default();
                Some(RelayedPort { port: p.port, busid, relay })
            })
            .collect();
        outln!("{}", prometheus::render(&relayed).trim_end())?;
        return Ok(());
    }
    if args.json {
        let here = usbwire_host::list().unwrap_or_default();
        let names = crate::commands::common::usb_names::UsbIds::load();
        let list: Vec<serde_json::Value> = used.iter().map(|p| port_json(p, &here, &names)).collect();
        return crate::commands::common::output::print_json(&json!({ "ports": list }), false);
    }
    outln!("Imported USB devices\n====================")?;
    for p in used {
        outln!(
            "Port {:02}: <{}> at {} speed",
            p.port,
            if p.status == 6 { "Port in Use" } else { "Port Initializing" },
            p.speed.name()
        )?;
        match vhci::read_record(p.port) {
            Some(r) => outln!("       -> usbip://{}:{}/{}", r.host, r.service, r.busid)?,
            None => outln!("       -> (no record of the remote device)")?,
        }
        outln!("       local bus id {}", p.local_busid)?;
        if let Some(relay) = relay_status(p.port) {
            let state = relay.get("state").and_then(|s| s.as_str()).unwrap_or("unknown");
            let pid = relay.get("pid").and_then(serde_json::Value::as_u64).unwrap_or(0);
            outln!("       relay (pid {pid}): {state}")?;
            if let Some(follow) = relay.get("follow") {
                let busid = follow.get("busid").and_then(|b| b.as_str()).unwrap_or("?");
                let times = follow.get("reattached").and_then(serde_json::Value::as_u64).unwrap_or(0);
                outln!("       following {busid} through re-enumerations: attached again {times} time(s)")?;
            }
            if relay.get("auto_attach").and_then(serde_json::Value::as_bool) == Some(true) {
                outln!("       auto-attach: imported anew after every loss, until pid {pid} is stopped")?;
            }
            if let Some(storage) = relay.get("storage") {
                let count = |name: &str| storage.get(name).and_then(serde_json::Value::as_u64).unwrap_or(0);
                let mib = |name: &str| count(name) as f64 / (1024.0 * 1024.0);
                outln!(
                    "       storage accelerated: {} commands pipelined, {} read-ahead hits ({:.1} MiB), {:.1} MiB read ahead for nothing, {} scan-ahead hits",
                    count("commands_pipelined"),
                    count("read_ahead_hits"),
                    mib("bytes_read_ahead"),
                    mib("bytes_wasted"),
                    count("scan_hits")
                )?;
            }
        }
    }
    Ok(())
}

mod prometheus;
