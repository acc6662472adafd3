//! The lab registry's own verbs: `reserve`, `release`, `who`. Reaching the
//! registry, the reservation `attach --registry` takes and the saved tokens
//! are in `common::registry`; `list --registry` is in `list`.

use anyhow::anyhow;
use usbwire_lab::{FleetDevice, Hold, Lab, LabError, Reservation, DEFAULT_TTL};
use usbwire_proto::display::escape;

use super::common::output::print_json;
use super::common::registry::{failure, required, reserve_failure, want, TokenStore};
use super::common::stdout::outln;
use crate::args::{ReleaseArgs, ReserveArgs, WhoArgs};
use crate::exit::Failure;

/// `usbwire reserve --registry URL --device SELECTOR [--for DURATION] [--json]`.
pub(crate) async fn reserve(args: ReserveArgs) -> Result<(), Failure> {
    let want = want(&args.device)?;
    let endpoint = required(&args.registry)?;
    let url = endpoint.url.to_string();
    let mut lab = Lab::connect(endpoint).await.map_err(failure)?;
    let hold = match args.hold_for {
        Some(duration) => Hold::For(duration),
        None => Hold::WhileRunning { ttl: DEFAULT_TTL, until: None },
    };
    let reservation = lab.reserve(&want, hold, "usbwire reserve").await.map_err(|e| reserve_failure(e, &url))?;
    let store = TokenStore::for_user();
    if args.hold_for.is_some() {
        store.save(&url, &reservation).map_err(|e| Failure::io(e.into()))?;
    }
    let printed = say_reserved(&reservation, &url, args.json);
    if args.hold_for.is_some() {
        // Saved and kept whether or not anyone read about it.
        reservation.keep();
        return printed;
    }
    // Held until stopped, the reservation is what this command is for: a closed stdout
    // does not end it, its lines were best effort (common::stdout).
    hold_until_stopped(reservation).await
}

/// What `reserve` took, and how to attach it.
fn say_reserved(reservation: &Reservation, url: &str, json: bool) -> Result<(), Failure> {
    let device = &reservation.device;
    if json {
        let value = serde_json::json!({
            "registry": url,
            "server": device.server,
            "busid": device.record.busid,
            "device": device,
            "holder": reservation.entry.holder,
            "since_at": reservation.entry.since_at,
            "until_at": reservation.entry.until_at,
            "lease": format!("{:x}", reservation.lease),
        });
        print_json(&value, false)
    } else {
        outln!(
            "reserved {} on {} ({} {}:{}){}",
            escape(&device.record.busid),
            escape(&device.server),
            escape(device.name()),
            escape(&device.record.vendor_id),
            escape(&device.record.product_id),
            match &reservation.entry.until_at {
                Some(until) => format!(" until {until}"),
                None => " until this command stops (Ctrl-C)".to_owned(),
            }
        )?;
        outln!(
            "  attach it: usbwire attach --registry {url} --device server={},{}",
            escape(&device.server),
            escape(&device.record.busid)
        )
    }
}

/// Holds a reservation made without `--for` until SIGINT/SIGTERM, then gives it back.
async fn hold_until_stopped(mut reservation: Reservation) -> Result<(), Failure> {
    let stop = super::common::process::shutdown_signal();
    tokio::select! {
        () = stop => {
            reservation.release().await.map_err(failure)?;
            eprintln!("released");
            Ok(())
        }
        lost = reservation.lost() => Err(failure(lost)),
    }
}

/// `usbwire release --registry URL --device SELECTOR [--force]`.
pub(crate) async fn release(args: ReleaseArgs) -> Result<(), Failure> {
    let want = want(&args.device)?;
    let endpoint = required(&args.registry)?;
    let url = endpoint.url.to_string();
    let mut lab = Lab::connect(endpoint).await.map_err(failure)?;
    let fleet = lab.fleet().await.map_err(failure)?;
    let store = TokenStore::for_user();
    let mine = store.load(&url);
    let mut released = 0;
    let mut others = Vec::new();
    for device in fleet.devices.iter().filter(|d| d.reservation.is_some() && want.matches(&d.device)) {
        let (server, busid) = (&device.device.server, &device.device.record.busid);
        let token = mine.iter().find(|t| &t.server == server && &t.busid == busid).and_then(|t| t.token());
        if token.is_none() && !args.force {
            others.push(device);
            continue;
        }
        let token = if args.force { None } else { token };
        match lab.release(server, busid, token.as_ref()).await {
            Ok(entry) => {
                store.forget(&url, server, busid);
                released += 1;
                outln!("released {} on {} (was held by {})", escape(busid), escape(server), escape(&entry.holder))?;
            }
            Err(error @ LabError::NotReserved { .. }) => eprintln!("usbwire: {error}"),
            Err(error) => return Err(failure(error)),
        }
    }
    if released > 0 {
        return Ok(());
    }
    let held_by: Vec<String> = others
        .iter()
        .filter_map(|d| d.reservation.as_ref())
        .map(|r| format!("{} ({})", escape(&r.holder), escape(&r.client)))
        .collect();
    // Nothing to release is the selector's fault (65); someone else's reservations are not ours to end (77).
    Err(if held_by.is_empty() {
        Failure::data(anyhow!(
            "no reserved device matches {want} (`usbwire who --registry {url}` shows what is reserved)"
        ))
    } else {
        Failure::not_admitted(anyhow!(
            "none of the reserved devices matching {want} is yours (held by {}); --force releases them anyway",
            held_by.join(", ")
        ))
    })
}

/// `usbwire who --registry URL [--json]`.
pub(crate) async fn who(args: WhoArgs) -> Result<(), Failure> {
    let mut lab = Lab::connect(required(&args.registry)?).await.map_err(failure)?;
    let fleet = lab.fleet().await.map_err(failure)?;
    let held: Vec<&FleetDevice> = fleet.devices.iter().filter(|d| d.reservation.is_some()).collect();
    if args.json {
        return print_json(&serde_json::json!({ "reservations": held }), true);
    }
    if held.is_empty() {
        return outln!("no device is reserved ({} registered)", fleet.devices.len());
    }
    for device in held {
        let Some(reservation) = &device.reservation else { continue };
        let entry = &device.device;
        outln!(
            "{} {:<6} {:<22} {} ({}, pid {}) since {}{}",
            escape(&entry.server),
            escape(&entry.record.busid),
            escape(entry.name()),
            escape(&reservation.holder),
            escape(&reservation.client),
            reservation.pid,
            escape(&reservation.since_at),
            reservation.until_at.as_ref().map(|u| format!(" until {}", escape(u))).unwrap_or_default()
        )?;
    }
    Ok(())
}
