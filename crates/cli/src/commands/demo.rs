//! `usbwire demo`: the main job on an embedded default. Serves a keyboard, a
//! 64 MiB disk image and a serial port on loopback, lists them back through
//! the USB/IP client (a real round trip over TCP), and says what to try next.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::anyhow;
use usbwire_proto::op::BusId;
use usbwire_server::{default_control_path, ServerConfig, ServerError};

use super::common::stdout::{status, status_line};
use crate::args::DemoArgs;
use crate::config::{SpeedChoice, VirtualSpec};
use crate::exit::Failure;

pub(crate) async fn run(args: DemoArgs) -> Result<(), Failure> {
    let dir = args.dir.clone().unwrap_or_else(default_dir);
    // The disk image and serial link go where another user must not be able to plant anything:
    // a directory of ours (made 0700), and the image opened without following a symlink.
    usbwire_server::private_dir::ensure_private_dir(&dir).map_err(|error| {
        Failure::private_dir(error, format!("demo directory {} (--dir DIR to use another)", dir.display()))
    })?;
    let disk = dir.join("disk.img");
    let serial_link = dir.join("serial");
    let specs = [
        VirtualSpec::Keyboard,
        VirtualSpec::Disk {
            path: disk.clone(),
            size: Some(64 << 20),
            read_only: false,
            speed: SpeedChoice::High,
            bad: None,
        },
        VirtualSpec::Serial { link: Some(serial_link.clone()) },
    ];
    let control = args.control.control.clone().unwrap_or_else(default_control_path);
    let config = ServerConfig { listen: args.listen, control_path: Some(control.clone()), ..ServerConfig::default() };
    let shutdown = super::common::process::shutdown_signal();
    let (server, exported) =
        super::common::local_server::build(config, &specs, super::common::local_server::DiskLinks::Refuse)?;
    let bound = server.bind().await.map_err(|error| match error {
        ServerError::Listen { addr, source } if source.kind() == std::io::ErrorKind::AddrInUse => Failure::os(anyhow!(
            "{addr} is taken (is usbipd or another usbwire running?); pass --listen 127.0.0.1:3241"
        )),
        other => Failure::from(other),
    })?;
    let addr = bound.local_addr();
    super::common::local_server::warn_if_open(addr, bound.security(), false);
    let serving = tokio::spawn(bound.run(shutdown));

    status_line!("usbwire demo: serving on {addr}");
    for line in &exported {
        status_line!("  {line}");
    }
    show_over_usbip(addr, &exported).await?;
    quick_bench().await?;
    let control_flag = match &args.control.control {
        Some(path) => format!(" --control {}", shell_word(&path.to_string_lossy())),
        None => String::new(),
    };
    print_next_steps(addr, &exported, &control_flag, &control, &serial_link);
    status_line!("\nDisk image: {}. Press Ctrl-C to stop.", disk.display());

    serving.await.map_err(|error| Failure::software(error.into()))?;
    Ok(())
}

/// What a USB/IP client sees of the demo server: its device list, and the disk's descriptors
/// read by importing it (real round trips over TCP).
async fn show_over_usbip(addr: SocketAddr, exported: &[String]) -> Result<(), Failure> {
    use super::common::usb_names::{display_name, format_like_usbip, UsbIds};
    status_line!("\nWhat a USB/IP client sees (usbwire list -r {addr}):\n");
    let security = usbwire_client::Security::Plain;
    let devices = usbwire_client::list_devices(addr, &security).await?;
    // The devices' own strings and kinds, as `list -r` asks for them.
    let states = usbwire_client::server_state(addr, &security).await.ok().flatten().map(|d| d.devices);
    let names = UsbIds::load();
    let listed = super::common::device_json::listed(&devices, states.as_deref(), &names);
    let named: Vec<_> = listed.iter().map(|l| &l.device).collect();
    status!("{}", format_like_usbip(&addr.to_string(), &devices, &named, &names, true));

    let disk_busid = exported
        .iter()
        .find(|l| l.contains("disk"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(BusId::new)
        .ok_or_else(|| Failure::software(anyhow!("the demo disk was not exported")))?;
    status_line!("The disk's descriptors, read over USB/IP (usbwire describe -r {addr} -b {disk_busid}):\n");
    let (record, description) = super::common::description::fetch(addr, &disk_busid, &security).await?;
    let state = states.iter().flatten().find(|s| s.busid == disk_busid.as_str());
    let device = super::common::device_json::described(&record, &description, state, &names);
    status!("{}", super::common::description::format(&disk_busid, &display_name(&device), &description, &names));
    status_line!();
    Ok(())
}

/// A small benchmark matrix against an in-process loopback device, beside raw TCP.
async fn quick_bench() -> Result<(), Failure> {
    status_line!("A short benchmark (usbwire bench --quick for more): a loopback device, our client and server, next to raw TCP:\n");
    let plan = usbwire_bench::matrix::Plan {
        sizes: vec![512, 64 << 10],
        depths: vec![1, 8],
        rtts_ms: vec![0.0],
        jitter_ms: 0.0,
        seconds: 0.2,
        repeat: 1,
        transforms: Vec::new(),
        payload: usbwire_bench::measure::Payload::Constant,
        resume: false,
    };
    let (loopback, loopback_busid) = usbwire_bench::target::local_loopback()?;
    let report = usbwire_bench::matrix::execute(
        &plan,
        loopback,
        &loopback_busid,
        &usbwire_client::Security::Plain,
        (None, None),
        usbwire_bench::matrix::Quiet,
    )
    .await?;
    status_line!("{}", report.table());
    Ok(())
}

/// The commands to try next against the demo server. `control_flag` names the control socket
/// again when `--control` named one (or the follow-up commands would miss it).
fn print_next_steps(addr: SocketAddr, exported: &[String], control_flag: &str, control: &Path, serial_link: &Path) {
    let host = addr.ip();
    let port = addr.port();
    let port_flag = if port == usbwire_proto::DEFAULT_PORT { String::new() } else { format!(" --tcp-port {port}") };
    let busid_of = |kind: &str| {
        exported.iter().find(|l| l.contains(kind)).and_then(|l| l.split_whitespace().next()).unwrap_or("0-1").to_owned()
    };
    status_line!("Next steps (on a Linux machine with the usbip tools; root for attach):");
    status_line!("  sudo modprobe vhci-hcd");
    status_line!(
        "  sudo usbip{port_flag} attach -r {host} -b {}      # the disk appears as /dev/sdX",
        busid_of("disk")
    );
    status_line!("  sudo usbip{port_flag} attach -r {host} -b {}      # the keyboard", busid_of("keyboard"));
    status_line!(
        "  usbwire type{control_flag} 'hello from usbwire'      # types on the attached keyboard (control socket {})",
        control.display()
    );
    status_line!(
        "  sudo usbip{port_flag} attach -r {host} -b {}      # /dev/ttyACM0 <-> {}",
        busid_of("serial"),
        serial_link.display()
    );
    status_line!("  usbwire state{control_flag}                          # who holds which device");
}

/// `text` as one shell word: as it is when that is safe, else in single quotes.
fn shell_word(text: &str) -> String {
    let plain = !text.is_empty() && text.bytes().all(|b| b.is_ascii_alphanumeric() || b"/._-+:=,@%".contains(&b));
    if plain {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

fn default_dir() -> PathBuf {
    let uid = usbwire_server::private_dir::effective_uid();
    std::env::temp_dir().join(format!("usbwire-demo-{uid}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_becomes_one_shell_word() {
        assert_eq!(shell_word("/run/user/1000/usbwire.sock"), "/run/user/1000/usbwire.sock");
        assert_eq!(shell_word("/tmp/my dir/c.sock"), "'/tmp/my dir/c.sock'");
        assert_eq!(shell_word("/tmp/it's"), r"'/tmp/it'\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
