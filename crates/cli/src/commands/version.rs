//! `usbwire version` (and `-V`): usbwire's version and commit, the USB/IP
//! protocol version it speaks (what `usbip version` prints, and the number
//! in every OP header), and the revisions of usbwire's own extensions and
//! JSON, so two machines' tools can be compared.

use serde_json::json;
use usbwire_proto::op::EXTENSIONS;
use usbwire_proto::USBIP_VERSION;

use crate::args::VersionArgs;
use crate::exit::Failure;
use crate::version::{usbip_version, version_text};

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
