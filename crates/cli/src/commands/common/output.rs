//! Printing what the network sent. Human output shows each such string
//! through [`usbwire_proto::display::escape`]; JSON output goes through
//! [`print_json`] (or [`terminal_safe_json`]).
//!
//! Every `--json` document carries `schema_version`
//! ([`JSON_SCHEMA_VERSION`]), and shows a device as one record,
//! `usbwire_device::record::DeviceJson`; docs/json.md is the reference
//! (fields, formats, and what each version changed).

use usbwire_device::record::JSON_SCHEMA_VERSION;
use usbwire_proto::display::needs_escape;

/// Prints a `--json` document: `schema_version` added at its top, strings
/// made terminal-safe, on one line (`pretty`: indented). A report: see
/// [`super::stdout`] for what a closed stdout does.
pub(crate) fn print_json(value: &impl serde::Serialize, pretty: bool) -> Result<(), crate::exit::Failure> {
    super::stdout::outln!("{}", json_text(value, pretty))
}

/// The text [`print_json`] prints, without its line break.
pub(crate) fn json_text(value: &impl serde::Serialize, pretty: bool) -> String {
    let mut value = serde_json::to_value(value).unwrap_or(serde_json::Value::Null);
    if let Some(object) = value.as_object_mut() {
        object.insert("schema_version".into(), JSON_SCHEMA_VERSION.into());
    }
    let text = if pretty { serde_json::to_string_pretty(&value) } else { serde_json::to_string(&value) };
    terminal_safe_json(text.unwrap_or_default())
}

/// RFC 3339 (UTC, to the second) for a Unix time.
pub(crate) fn rfc3339(unix_seconds: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(unix_seconds)).to_string()
}

/// JSON text with every character [`needs_escape`] names written as a
/// `\uXXXX` escape, so `--json` on a terminal cannot be driven by a device
/// name either. serde_json already escapes U+0000..U+001F inside strings, but
/// writes DEL, the C1 controls (U+0080..U+009F, CSI among them) and bidi
/// overrides raw. Those are never JSON whitespace or structure, so they only
/// occur inside strings, where `\uXXXX` decodes to the same character: a
/// script reading the output sees the same values.
pub(crate) fn terminal_safe_json(text: String) -> String {
    // Below U+0020 only the pretty printer's own newlines and indentation
    // can remain, outside strings: leave those.
    let escape = |c: char| c >= '\u{7f}' && needs_escape(c);
    if !text.chars().any(escape) {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if escape(c) {
            // Every character in the set is in the BMP: one \u escape each.
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn json_output_escapes_del_c1_and_bidi_and_decodes_to_the_same_value() {
        let name = "disk\x1b[2J\x7f\u{9b}2J\u{202e}gpj.exe\n";
        let value = json!({ "product": name, "list": [name] });
        // Why this exists: serde_json writes DEL and C1 raw.
        assert!(value.to_string().contains("\x7f\u{9b}2J"));
        for text in [value.to_string(), serde_json::to_string_pretty(&value).unwrap()] {
            let safe = terminal_safe_json(text);
            assert!(!safe.chars().any(|c| needs_escape(c) && c != '\n' && c != ' '), "{safe:?}");
            assert!(safe.contains(r"\u001b[2J\u007f\u009b2J\u202egpj.exe\n"), "{safe}");
            let back: serde_json::Value = serde_json::from_str(&safe).unwrap();
            assert_eq!(back, value);
        }
    }

    #[test]
    fn rfc3339_times() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_795_000_000), "2026-11-18T11:06:40Z");
    }

    #[test]
    fn pretty_json_keeps_its_layout() {
        let text = serde_json::to_string_pretty(&json!({ "a": ["b"] })).unwrap();
        assert_eq!(terminal_safe_json(text.clone()), text);
    }
}
