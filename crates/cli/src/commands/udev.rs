//! `usbwire udev-rules`: udev rules that give the server's group the USB
//! devices its `[[bind]]` rules name, and no others.
//!
//! The server runs as an unprivileged user and opens real devices through
//! usbfs (`/dev/bus/usb/BBB/DDD`). A rule for every device would let that
//! network-facing user open the host's keyboard or security key, detach their
//! drivers or reflash them; so nothing is shipped, and this prints one rule
//! per selector instead: VID:PID, serial, or bus id (the port). A class
//! selector has no safe rule (it would open every keyboard for `class=03`):
//! it is left out with a comment saying what to write instead.

use std::fmt::Write as _;

use anyhow::{anyhow, bail};
use usbwire_device::Selector;

use crate::args::UdevRulesArgs;
use crate::config::FileConfig;
use crate::exit::Failure;

pub(crate) fn run(args: UdevRulesArgs) -> Result<(), Failure> {
    let file = FileConfig::load(&args.config).map_err(Failure::config)?;
    let mut selectors: Vec<Selector> = Vec::new();
    for rule in &file.bind {
        for selector in std::iter::once(&rule.device).chain(&rule.also) {
            if !selectors.contains(selector) {
                selectors.push(selector.clone());
            }
        }
    }
    if selectors.is_empty() {
        return Err(Failure::config(anyhow!(
            "{} has no [[bind]] rules: no real device to give the server (add `[[bind]] device = \"VID:PID\"`)",
            args.config.display()
        )));
    }
    let text = rules(&selectors, &args.group, &args.config.display().to_string()).map_err(Failure::config)?;
    super::common::stdout::out!("{text}")?;
    for selector in selectors.iter().filter(|s| matches!(s, Selector::Class(_))) {
        eprintln!(
            "usbwire: {} gets no rule: a class rule would open every such device; add the devices' VID:PID or \
             serial=TEXT to its [[bind]] `also`",
            describe(selector)
        );
    }
    Ok(())
}

/// The rules file for `selectors`: a header, then one rule each.
fn rules(selectors: &[Selector], group: &str, source: &str) -> anyhow::Result<String> {
    if group.is_empty() || !group.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(&b)) {
        bail!("--group {group:?} is not a group name");
    }
    let mut out = String::new();
    let _ = writeln!(out, "# usbwire: usbfs access for group {group:?} to the devices [[bind]] names in {source}");
    let _ = writeln!(out, "# (usbwire udev-rules). Install as /etc/udev/rules.d/70-usbwire.rules, then");
    let _ = writeln!(out, "#   udevadm control --reload && udevadm trigger --subsystem-match=usb");
    let _ = writeln!(out, "# Regenerate it when the [[bind]] rules change.");
    for selector in selectors {
        let matcher = match selector {
            Selector::VidPid { vendor_id, product_id } => {
                format!("ATTR{{idVendor}}==\"{vendor_id:04x}\", ATTR{{idProduct}}==\"{product_id:04x}\"")
            }
            Selector::Serial(serial) => format!("ATTR{{serial}}==\"{}\"", udev_literal(serial)?),
            Selector::BusId(busid) => format!("KERNEL==\"{}\"", udev_literal(busid)?),
            Selector::Class(_) => {
                let _ = writeln!(out, "# {}: no rule (it would open every such device)", describe(selector));
                continue;
            }
        };
        let _ = writeln!(out, "# {}", describe(selector));
        let _ = writeln!(
            out,
            "SUBSYSTEM==\"usb\", ENV{{DEVTYPE}}==\"usb_device\", {matcher}, MODE=\"0660\", GROUP=\"{group}\""
        );
    }
    Ok(out)
}

/// A selector as `[[bind]]` writes it.
fn describe(selector: &Selector) -> String {
    match selector {
        Selector::BusId(busid) => format!("bus id {busid}"),
        Selector::VidPid { vendor_id, product_id } => format!("{vendor_id:04x}:{product_id:04x}"),
        Selector::Serial(serial) => format!("serial={}", serial.escape_debug()),
        Selector::Class(class) => format!("class={class:02x}"),
    }
}

/// `text` inside a udev match: printable ASCII without quotes, backslashes
/// or the glob characters udev would expand (a serial `*` would match all).
fn udev_literal(text: &str) -> anyhow::Result<&str> {
    let plain =
        text.bytes().all(|b| b.is_ascii_graphic() || b == b' ') && !text.contains(['"', '\\', '*', '?', '[', ']', '|']);
    if text.is_empty() || !plain {
        bail!(
            "{:?} cannot be matched exactly by a udev rule (quotes, backslashes, * ? [ ] | or non-ASCII): select \
             that device by VID:PID instead",
            text
        );
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule_lines(text: &str) -> Vec<&str> {
        text.lines().filter(|l| !l.starts_with('#')).collect()
    }

    #[test]
    fn each_selector_gets_one_narrow_rule_and_a_class_none() {
        let selectors: Vec<Selector> =
            ["0781:5567", "serial=4C530001", "1-1.2", "class=03"].iter().map(|s| s.parse().unwrap()).collect();
        let text = rules(&selectors, "usbwire", "server.toml").unwrap();
        assert_eq!(
            rule_lines(&text),
            [
                r#"SUBSYSTEM=="usb", ENV{DEVTYPE}=="usb_device", ATTR{idVendor}=="0781", ATTR{idProduct}=="5567", MODE="0660", GROUP="usbwire""#,
                r#"SUBSYSTEM=="usb", ENV{DEVTYPE}=="usb_device", ATTR{serial}=="4C530001", MODE="0660", GROUP="usbwire""#,
                r#"SUBSYSTEM=="usb", ENV{DEVTYPE}=="usb_device", KERNEL=="1-1.2", MODE="0660", GROUP="usbwire""#,
            ]
        );
        assert!(text.contains("# class=03: no rule"), "{text}");
    }

    #[test]
    fn a_serial_udev_would_read_as_a_pattern_or_break_out_of_quotes_is_refused() {
        for serial in ["*", "A?", "x\" MODE=\"0666", "back\\slash", "[ab]"] {
            let selectors = vec![Selector::Serial(serial.into())];
            let error = rules(&selectors, "usbwire", "server.toml").unwrap_err();
            assert!(error.to_string().contains("VID:PID"), "{serial}: {error}");
        }
        assert!(rules(&[Selector::Serial("A1".into())], "wheel\"", "x").is_err(), "a group name is checked too");
    }
}
