//! Showing text that came from the network without letting it drive the terminal.
//!
//! Device strings, `path` fields, DNS-SD instance names, TXT values and the
//! holder of a device are chosen by whoever is at the other end (a server,
//! a device, any machine on the LAN). Printed raw, `ESC [ 2 J` clears the
//! user's screen, an OSC sequence retitles the window or writes the
//! clipboard, `\r` or a bidi override makes one name look like another.
//! [`escape`] shows every such character as a visible escape instead, at the
//! moment of printing; the data itself stays as received (and `--json`
//! output escapes the same set as `\uXXXX`, see [`needs_escape`]).
//!
//! ```
//! use usbwire_proto::display::escape;
//!
//! assert_eq!(escape("disk\x1b[2J\n").to_string(), r"disk\x1b[2J\n");
//! assert_eq!(escape("Clé USB").to_string(), "Clé USB");
//! ```
//!
//! The output is for people, not a reversible encoding: a backslash is
//! printed as itself.

use std::fmt::{self, Write as _};

/// Whether `c` must not reach a terminal as itself: C0 controls, DEL, C1
/// controls (`char::is_control`), the Unicode bidi embedding, override and
/// isolate controls and marks, and the line and paragraph separators.
pub fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'              // ARABIC LETTER MARK
            | '\u{200e}' | '\u{200f}' // LRM, RLM
            | '\u{2028}' | '\u{2029}' // LINE / PARAGRAPH SEPARATOR
            | '\u{202a}'..='\u{202e}' // LRE, RLE, PDF, LRO, RLO
            | '\u{2066}'..='\u{2069}' // LRI, RLI, FSI, PDI
        )
}

/// Displays `text` with every character [`needs_escape`] names written as an
/// escape: `\n`, `\r`, `\t`, `\0`, `\x1b` for other ASCII controls, `\u{9b}`
/// for the rest. Everything else is written unchanged.
pub fn escape(text: &str) -> Escaped<'_> {
    Escaped(text)
}

/// What [`escape`] returns: formats as the escaped text, without allocating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Escaped<'a>(&'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Printable ASCII, what almost every name is: nothing to escape.
        if self.0.bytes().all(|b| (0x20..0x7f).contains(&b)) {
            return f.pad(self.0);
        }
        if f.width().is_some() || f.precision().is_some() {
            // Honour `{:>11}` and friends: pad the escaped text, not the raw one.
            let mut escaped = String::with_capacity(self.0.len());
            write!(escaped, "{}", Self(self.0))?;
            return f.pad(&escaped);
        }
        let mut rest = self.0;
        while let Some((at, c)) = rest.char_indices().find(|&(_, c)| needs_escape(c)) {
            f.write_str(&rest[..at])?;
            match c {
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                '\t' => f.write_str("\\t")?,
                '\0' => f.write_str("\\0")?,
                c if c.is_ascii() => write!(f, "\\x{:02x}", u32::from(c))?,
                c => write!(f, "\\u{{{:x}}}", u32::from(c))?,
            }
            rest = &rest[at + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn terminal_escapes_become_visible() {
        assert_eq!(escape("\x1b[2J\x1b]0;owned\x07").to_string(), r"\x1b[2J\x1b]0;owned\x07");
        assert_eq!(escape("a\nb\rc\td\0e\x7f").to_string(), r"a\nb\rc\td\0e\x7f");
        // C1: CSI (U+009B) as UTF-8, which some terminals obey like ESC [.
        assert_eq!(escape("x\u{9b}2J").to_string(), r"x\u{9b}2J");
    }

    #[test]
    fn bidi_overrides_become_visible() {
        assert_eq!(escape("evil\u{202e}fdp.exe").to_string(), r"evil\u{202e}fdp.exe");
        assert_eq!(escape("\u{2066}a\u{2069}\u{200f}").to_string(), r"\u{2066}a\u{2069}\u{200f}");
        assert_eq!(escape("line\u{2028}sep").to_string(), r"line\u{2028}sep");
    }

    #[test]
    fn ordinary_text_is_unchanged() {
        for text in ["", "usbwire disk", "Clé USB 3.0 — 64 GB", "日本語のキーボード", r"C:\path", "😀"] {
            assert_eq!(escape(text).to_string(), text);
        }
    }

    #[test]
    fn width_pads_the_escaped_text() {
        assert_eq!(format!("{:<6}|", escape("\x1b")), r"\x1b  |");
        assert_eq!(format!("{:>6}|", escape("ab")), "    ab|");
    }

    proptest! {
        #[test]
        fn escaped_output_never_holds_a_character_that_needs_escaping(text in any::<String>()) {
            let shown = escape(&text).to_string();
            prop_assert!(!shown.chars().any(needs_escape), "{:?} -> {:?}", text, shown);
        }

        /// Escaping only adds: the safe characters are all there, in order.
        #[test]
        fn safe_characters_survive_in_order(text in any::<String>()) {
            let shown = escape(&text).to_string();
            let kept: String = text.chars().filter(|&c| !needs_escape(c)).collect();
            let mut shown_chars = shown.chars();
            prop_assert!(kept.chars().all(|c| shown_chars.any(|s| s == c)));
            if kept.len() == text.len() {
                prop_assert_eq!(shown, text);
            }
        }

        /// The strategy above rarely picks controls; this one mostly does.
        #[test]
        fn control_heavy_strings_are_safe(text in "[\\x00-\\x1f\\x7f-\\u{9f}\\u{202a}-\\u{202e}a\\\\]{0,64}") {
            let shown = escape(&text).to_string();
            prop_assert!(!shown.chars().any(needs_escape), "{:?} -> {:?}", text, shown);
        }
    }
}
