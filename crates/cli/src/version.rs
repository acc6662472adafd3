//! What this build is: [`VERSION`] (the version and the commit it was built
//! from) and [`version_text`], what `-V` and `usbwire version` print, with the
//! USB/IP protocol version and the revisions of usbwire's extensions and JSON.
//!
//! It sits below the command line (clap's `-V`) and the verbs that show it
//! (`version`, `serve`'s lab record, `man`). It is not for printing.

use usbwire_proto::op::EXTENSIONS;
use usbwire_proto::USBIP_VERSION;

/// The version and the commit it was built from (`build.rs`; "unknown" outside a git checkout).
pub(crate) const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("USBWIRE_COMMIT"), ")");

/// `1.1.1` for 0x0111: one digit per nibble after the major byte, as usbip writes it.
pub(crate) fn usbip_version() -> String {
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
