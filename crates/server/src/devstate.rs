//! The device-state document (`usbwire state`, `OP_REP_DEVSTATE`, the status
//! page's `/status.json`): every exported device a viewer may see, with who
//! holds it and its counters, from the [`Registry`].
//!
//! The document's shape is `usbwire_transport::devstate`'s; this file only
//! fills it in. Who may see what is the caller's `visible`.

use std::time::UNIX_EPOCH;

use usbwire_proto::op::DeviceRecord;

use crate::registry::{DeviceState, Registry};

/// One device in a `state` answer (the same document `OP_REP_DEVSTATE` carries).
pub type StateEntry = usbwire_transport::devstate::DeviceStateEntry;

/// Every exported device this viewer may see, with its state: what `usbwire
/// state` prints and what `OP_REP_DEVSTATE` carries.
pub(crate) fn entries(registry: &Registry, visible: impl Fn(&str, &DeviceRecord, &str) -> bool) -> Vec<StateEntry> {
    registry
        .list()
        .into_iter()
        .filter(|e| visible(&e.kind, &e.record, &e.summary.serial))
        .map(|e| {
            let unix = |at: std::time::SystemTime| at.duration_since(UNIX_EPOCH).ok().map(|d| d.as_secs());
            let rfc3339 = |at: Option<u64>| {
                at.map(|s| {
                    humantime::format_rfc3339_seconds(UNIX_EPOCH + std::time::Duration::from_secs(s)).to_string()
                })
            };
            let (state, client, since, identity, resuming_since) = match e.state {
                DeviceState::Available => ("available", None, None, None, None),
                DeviceState::InUse { client, since, identity, resuming_since } => {
                    ("in_use", Some(client.to_string()), unix(since), identity, resuming_since.and_then(unix))
                }
            };
            StateEntry {
                busid: e.record.busid.to_string(),
                kind: e.kind,
                vendor_id: format!("{:04x}", e.record.id_vendor),
                product_id: format!("{:04x}", e.record.id_product),
                product_string: e.summary.product.clone(),
                product: e.summary.product,
                speed: e.summary.speed.name().to_owned(),
                manufacturer: e.summary.manufacturer,
                serial: e.summary.serial,
                state: state.to_owned(),
                client,
                identity,
                since_at: rfc3339(since),
                resuming_since_at: rfc3339(resuming_since),
                since,
                resuming_since,
                counters: Some(e.meter.snapshot()),
            }
        })
        .collect()
}
