//! The values several config tables share: sizes (`64M`), durations
//! (`30s`, `2m`), and device selectors, each with the serde field parser the
//! tables use and one error message per kind of mistake.

use std::time::Duration;

use anyhow::{bail, Context as _};
use serde::Deserialize;

/// `64M`, `1G`, `512K`, `4096` (bytes; binary units).
pub(crate) fn parse_size(text: &str) -> anyhow::Result<u64> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let number: u64 = digits.parse().with_context(|| format!("invalid size {text:?} (e.g. 64M)"))?;
    let multiplier: u64 = match unit.to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        "T" => 1 << 40,
        _ => bail!("invalid size unit in {text:?} (use K, M, G or T)"),
    };
    number.checked_mul(multiplier).with_context(|| format!("size {text:?} is too large"))
}

pub(super) fn size_field<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Option::<Size>::deserialize(deserializer)? {
        None => Ok(None),
        Some(Size::Bytes(bytes)) => Ok(Some(bytes)),
        Some(Size::Text(text)) => parse_size(&text).map(Some).map_err(serde::de::Error::custom),
    }
}

/// `500ms`, `3s`, `2m`, or a bare number of seconds.
pub(crate) fn parse_duration(text: &str) -> anyhow::Result<Duration> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let number: u64 =
        digits.parse().with_context(|| format!("invalid duration {text:?} (e.g. \"3s\" or \"500ms\")"))?;
    match unit.trim() {
        "ms" => Ok(Duration::from_millis(number)),
        "s" => Ok(Duration::from_secs(number)),
        "m" => Ok(Duration::from_secs(number.saturating_mul(60))),
        "h" => Ok(Duration::from_secs(number.saturating_mul(3600))),
        _ => bail!("invalid duration unit in {text:?} (use ms, s, m or h)"),
    }
}

pub(super) fn duration_field<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Time {
        Seconds(u64),
        Text(String),
    }
    match Option::<Time>::deserialize(deserializer)? {
        None => Ok(None),
        Some(Time::Seconds(seconds)) => Ok(Some(Duration::from_secs(seconds))),
        Some(Time::Text(text)) => parse_duration(&text).map(Some).map_err(serde::de::Error::custom),
    }
}

pub(super) fn selector_field<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<usbwire_device::Selector, D::Error> {
    let text = String::deserialize(deserializer)?;
    text.parse().map_err(serde::de::Error::custom)
}

pub(super) fn selector_list<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<usbwire_device::Selector>, D::Error> {
    let texts = Vec::<String>::deserialize(deserializer)?;
    texts.iter().map(|t| t.parse().map_err(serde::de::Error::custom)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert!(parse_size("M").is_err());
    }
}
