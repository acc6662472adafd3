//! usbredir device filters: the rule strings a guest sends in filter_filter
//! (`class,vendor,product,version,allow|…`, numbers as C's strtol reads them,
//! -1 for any), checked against a device as usbredirfilter_check does with
//! default flags: the device class (unless it is 0x00 or 0xef, which defer
//! to the interfaces) and every interface class must each be allowed by the
//! first rule that matches; no matching rule denies.

use usbwire_device::descriptor::DeviceDescriptor;

/// One rule; `None` matches anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rule {
    class: Option<u8>,
    vendor: Option<u16>,
    product: Option<u16>,
    version: Option<u16>,
    allow: bool,
}

/// Parses a rule string; a malformed rule is skipped (and logged), so a
/// guest's typo denies rather than allows.
fn parse(rules: &str) -> Vec<Rule> {
    rules
        .split('|')
        .filter(|r| !r.trim().is_empty())
        .filter_map(|rule| {
            let parsed = parse_rule(rule);
            if parsed.is_none() {
                tracing::warn!(target: "usbwire::redir", rule, "the guest's usbredir filter has a malformed rule; ignored");
            }
            parsed
        })
        .collect()
}

fn parse_rule(rule: &str) -> Option<Rule> {
    let fields: Vec<i64> = rule.split(',').map(|f| number(f.trim())).collect::<Option<_>>()?;
    let [class, vendor, product, version, allow] = fields[..] else { return None };
    let any_or = |value: i64, max: i64| match value {
        -1 => Some(None),
        v if (0..=max).contains(&v) => Some(Some(v)),
        _ => None,
    };
    Some(Rule {
        class: any_or(class, 0xff)?.map(|v| v as u8),
        vendor: any_or(vendor, 0xffff)?.map(|v| v as u16),
        product: any_or(product, 0xffff)?.map(|v| v as u16),
        version: any_or(version, 0xffff)?.map(|v| v as u16),
        allow: allow != 0,
    })
}

/// An integer in C's notation: decimal, `0x` hex, or leading-zero octal; signed.
fn number(text: &str) -> Option<i64> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let value = if let Some(hex) = digits.strip_prefix("0x").or_else(|| digits.strip_prefix("0X")) {
        i64::from_str_radix(hex, 16).ok()?
    } else if digits.len() > 1 && digits.starts_with('0') {
        i64::from_str_radix(&digits[1..], 8).ok()?
    } else {
        digits.parse().ok()?
    };
    Some(if negative { -value } else { value })
}

/// Whether `rules` let a device with this descriptor and these interfaces
/// (class, subclass, protocol of each, first alt setting) through.
pub(crate) fn allows(rules: &str, device: &DeviceDescriptor, interfaces: &[(u8, u8, u8)]) -> bool {
    let rules = parse(rules);
    let check = |class: u8| {
        rules
            .iter()
            .find(|r| {
                r.class.is_none_or(|c| c == class)
                    && r.vendor.is_none_or(|v| v == device.vendor_id)
                    && r.product.is_none_or(|p| p == device.product_id)
                    && r.version.is_none_or(|v| v == device.bcd_device)
            })
            .is_some_and(|r| r.allow)
    };
    if device.class != 0x00 && device.class != 0xef && !check(device.class) {
        return false;
    }
    interfaces.iter().all(|&(class, _, _)| check(class))
}

#[cfg(test)]
mod tests {
    use super::*;
    use usbwire_proto::Speed;

    fn disk() -> DeviceDescriptor {
        DeviceDescriptor::for_speed(Speed::SUPER, 0x1209, 0x0003)
    }

    #[test]
    fn the_first_matching_rule_decides_for_every_interface() {
        let storage = [(0x08, 0x06, 0x50)];
        assert!(allows("-1,-1,-1,-1,1", &disk(), &storage));
        assert!(allows("0x08,-1,-1,-1,1|-1,-1,-1,-1,0", &disk(), &storage));
        assert!(!allows("0x08,-1,-1,-1,0|-1,-1,-1,-1,1", &disk(), &storage));
        assert!(allows("-1,0x1209,0x0003,-1,1|-1,-1,-1,-1,0", &disk(), &storage));
        assert!(!allows("-1,0x1209,0x0004,-1,1", &disk(), &storage), "no rule matches: denied");
        // A composite device: each interface must be allowed.
        let hid_and_storage = [(0x03, 1, 1), (0x08, 6, 0x50)];
        assert!(!allows("3,-1,-1,-1,1", &disk(), &hid_and_storage));
        assert!(allows("3,-1,-1,-1,1|8,-1,-1,-1,1", &disk(), &hid_and_storage));
    }

    #[test]
    fn a_device_class_other_than_per_interface_is_checked_itself() {
        let mut hub = disk();
        hub.class = 0x09;
        assert!(!allows("8,-1,-1,-1,1", &hub, &[(0x08, 0, 0)]));
        assert!(allows("9,-1,-1,-1,1|8,-1,-1,-1,1", &hub, &[(0x08, 0, 0)]));
    }

    #[test]
    fn malformed_rules_are_skipped_not_allowed() {
        let storage = [(0x08, 0x06, 0x50)];
        assert!(!allows("8,-1,-1,1", &disk(), &storage), "four fields");
        assert!(!allows("x,-1,-1,-1,1", &disk(), &storage));
        assert!(!allows("300,-1,-1,-1,1", &disk(), &storage), "class out of range");
        assert!(allows("bad|010,-1,-1,-1,1", &disk(), &storage), "octal 010 is 8; the bad rule is skipped");
    }
}
