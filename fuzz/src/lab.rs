//! The `lab_catalog` harness: a server's catalog chunk as the lab registry
//! hands it to every client that lists the fleet (`usbwire_lab::catalog`),
//! from whoever could write to etcd.
//!
//! Input: `[flags] ++ bytes`. Flag bit 0 compresses the bytes with zstd
//! first (so the fuzzer reaches the JSON without finding zstd's framing);
//! otherwise they are the value itself. Invariants: no panic, no allocation
//! beyond the chunk's budget; the entries read are exactly those serde's own
//! derive reads from the same array (the two-pass decoder against the
//! flattened one), of schema version 1 at most, naming the chunk's server.

use serde_json::value::RawValue;
use usbwire_lab::DeviceEntry;

const SERVER: &str = "10.0.0.5:3240";

pub fn lab_catalog(data: &[u8]) {
    let Some((&flags, bytes)) = data.split_first() else { return };
    let value = if flags & 1 != 0 { zstd::bulk::compress(bytes, 1).unwrap_or_default() } else { bytes.to_vec() };
    let entries = usbwire_lab::catalog::read_chunk(SERVER, &value);
    assert_eq!(entries, reference(&value));
    assert!(entries.iter().all(|entry| entry.server == SERVER && entry.schema_version <= usbwire_lab::SCHEMA_VERSION));
}

/// What the chunk holds by serde's derive (`#[serde(flatten)]`), element by element.
fn reference(value: &[u8]) -> Vec<DeviceEntry> {
    let Some(json) = usbwire_lab::catalog::chunk_json(value) else { return Vec::new() };
    let Ok(elements) = serde_json::from_str::<Vec<&RawValue>>(&json) else { return Vec::new() };
    elements
        .into_iter()
        .filter_map(|element| serde_json::from_str::<DeviceEntry>(element.get()).ok())
        .filter(|entry| entry.schema_version <= usbwire_lab::SCHEMA_VERSION && entry.server == SERVER)
        .collect()
}

/// Seeds: a chunk of two entries as a server writes it, and its JSON for flag 1.
pub(crate) fn lab_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    let entry = |busid: &str, labels: &str| {
        format!(
            r#"{{"schema_version":1,"server":"{SERVER}","busid":"{busid}","kind":"loopback","vendor_id":"1209","product_id":"0005","bcd_device":"1.00","device_class":"00/00/00","speed":"high","manufacturer":"usbwire","product":"usbwire loopback","serial":"0005{busid}","interfaces":[{{"number":0,"class":"ff/00/00","class_name":null,"driver":null}}],"state":"available","holder":null,"class":"00","interface_classes":["ff"],"labels":[{labels}]}}"#
        )
    };
    let entries = [entry("0-1", r#""nucleo""#), entry("0-2", "")];
    let json = format!("[{}]", entries.join(","));
    add("lab_catalog", "two-entries-json", &[1], json.into_bytes());
    let chunk = usbwire_lab::catalog::chunks(entries.iter().map(|entry| entry.as_bytes())).remove(0);
    add("lab_catalog", "two-entries-chunk", &[0], chunk);
}
