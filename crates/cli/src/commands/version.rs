//! `usbwire version` (and `-V`): usbwire's version and commit, the USB/IP
//! protocol version it speaks (what `usbip version` prints, and the number
//! in every OP header), and the revisions of usbwire's own extensions and
//! JSON, so two machines' tools can be compared.

use serde_json::json;
use usbwire_proto::op::EXTENSIONS;
use usbwire_proto::USBIP_VERSION;

use crate::args::{VersionArgs, VERSION};
use crate::exit::Failure;

/// `1.1.1` for 0x0111: one digit per nibble after the major byte, as usbip writes it.
fn usbip_version() -> String {
    format!("{}.{}.{}", USBIP_VERSION >> 8, (USBIP_VERSION >> 4) & 0xf, USBIP_VERSION & 0xf)
}

/// What `-V` and `usbwire version` print after the program's name.
pub(crate) fn version_text() -> String {
    let extensions: Vec<String> = EXTENSIONS
        .iter()
        .map(|e| format!("  {} {} (OP {:#06x}): {}", e.name, e.version, e.request.0, e.what))
        .collect();
    format!(
        "{VERSION}\nUSB/IP protocol {} ({USBIP_VERSION:#06x}), TCP port {}\nusbwire extensions (between usbwire ends only):\n{}\nJSON documents: schema_version {}; lab registry records: schema_version {}",
        usbip_version(),
        usbwire_proto::DEFAULT_PORT,
        extensions.join("\n"),
        usbwire_device::record::JSON_SCHEMA_VERSION,
        usbwire_lab::SCHEMA_VERSION,
    )
}

pub(crate) fn run(args: &VersionArgs) -> Result<(), Failure> {
    if args.json {
        let extensions: Vec<_> = EXTENSIONS
            .iter()
            .map(|e| json!({ "name": e.name, "op": format!("{:#06x}", e.request.0), "version": e.version }))
            .collect();
        let document = json!({
            "version": env!("CARGO_PKG_VERSION"),
            "commit": env!("USBWIRE_COMMIT"),
            "usbip_version": usbip_version(),
            "usbip_version_code": format!("{USBIP_VERSION:#06x}"),
            "extensions": extensions,
            "lab_record_version": usbwire_lab::SCHEMA_VERSION,
        });
        super::common::output::print_json(&document, false)
    } else {
        super::common::stdout::outln!("usbwire {}", version_text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_protocol_version_reads_as_usbip_writes_it() {
        assert_eq!(usbip_version(), "1.1.1");
        let text = version_text();
        assert!(text.starts_with(VERSION), "{text}");
        assert!(text.contains("USB/IP protocol 1.1.1 (0x0111)"), "{text}");
        assert!(text.contains("devstate 2 (OP 0x80f1)"), "{text}");
    }
}
