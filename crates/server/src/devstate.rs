//! The device-state document (`usbwire state`, `OP_REP_DEVSTATE`, the status
//! page's `/status.json`): every exported device a viewer may see, with who
//! holds it and its counters, from the [`Registry`].
//!
//! The document's shape is `usbwire_device::devstate`'s; this file only
//! fills it in. Who may see what is the caller's `visible`.

use std::time::{SystemTime, UNIX_EPOCH};

use usbwire_device::devstate::{DeviceStateDocument, DeviceStateEntry};
use usbwire_device::record::{bcd, class_triple, hex16};
use usbwire_proto::op::DeviceRecord;

use crate::registry::{DeviceState, ExportInfo, Registry};

/// Every exported device this viewer may see, with its state: what `usbwire
/// state` prints and what `OP_REP_DEVSTATE` carries.
pub(crate) fn entries(
    registry: &Registry,
    visible: impl Fn(&str, &DeviceRecord, &str) -> bool,
) -> Vec<DeviceStateEntry> {
    registry
        .list()
        .into_iter()
        .filter(|e| visible(&e.kind, &e.record, &e.summary.serial))
        .map(|export| {
            let reservation = registry.reserved_for(export.record.busid.as_str());
            DeviceStateEntry { reservation, ..state_entry(export) }
        })
        .collect()
}

/// The whole `OP_REP_DEVSTATE` document for this viewer: [`entries`], and
/// the devices withdrawn lately that it may see (why an import of one fails).
pub(crate) fn document(
    registry: &Registry,
    visible: impl Fn(&str, &DeviceRecord, &str) -> bool,
) -> DeviceStateDocument {
    let withdrawn = registry
        .recently_withdrawn()
        .into_iter()
        .filter(|w| visible(&w.shown.kind, &w.record, &w.serial))
        .map(|w| w.shown)
        .collect();
    DeviceStateDocument { devices: entries(registry, &visible), withdrawn, tls_required: false }
}

/// One exported device's entry: its record, strings, holder and counters
/// (its reservation is the registry's: [`entries`] adds it).
/// The lab registry's device records are made from it too.
pub fn state_entry(export: ExportInfo) -> DeviceStateEntry {
    let unix = |at: SystemTime| at.duration_since(UNIX_EPOCH).ok().map(|d| d.as_secs());
    let rfc3339 = |at: Option<u64>| {
        at.map(|s| humantime::format_rfc3339_seconds(UNIX_EPOCH + std::time::Duration::from_secs(s)).to_string())
    };
    let (state, client, since, identity, resuming_since) = match export.state {
        DeviceState::Available => ("available", None, None, None, None),
        DeviceState::InUse { client, since, identity, resuming_since } => {
            ("in_use", Some(client.to_string()), unix(since), identity, resuming_since.and_then(unix))
        }
    };
    let record = &export.record;
    DeviceStateEntry {
        busid: record.busid.to_string(),
        kind: export.kind,
        vendor_id: hex16(record.id_vendor),
        product_id: hex16(record.id_product),
        product_string: export.summary.product.clone(),
        product: export.summary.product,
        speed: export.summary.speed.name().to_owned(),
        bcd_device: Some(bcd(record.bcd_device)),
        device_class: Some(class_triple(record.b_device_class, record.b_device_sub_class, record.b_device_protocol)),
        interfaces: record
            .interfaces
            .iter()
            .map(|i| class_triple(i.b_interface_class, i.b_interface_sub_class, i.b_interface_protocol))
            .collect(),
        manufacturer: export.summary.manufacturer,
        serial: export.summary.serial,
        state: state.to_owned(),
        client,
        identity,
        since_at: rfc3339(since),
        resuming_since_at: rfc3339(resuming_since),
        since,
        resuming_since,
        counters: Some(export.meter.snapshot()),
        reservation: None,
    }
}
