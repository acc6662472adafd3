//! Why a usbwire server refused an import, from its device state
//! (`OP_REQ_DEVSTATE`, which the OP phase asks once after a refusal), in words —
//! in use by whom and since when, reserved in the lab registry for whom and
//! until when, or withdrawn. The import's status code is the server's answer;
//! this only explains it (a stock client never asks and sees the code alone).

use usbwire_device::devstate::{DeviceStateDocument, DeviceStateEntry};
use usbwire_proto::display::escape;

/// What a plain client of a server that shows its devices to TLS clients
/// only is told (`tls_required` in the server's device state).
pub const TLS_REQUIRED: &str =
    "this server shows its devices to TLS clients only: add --tls (the first time also --trust-new, to pin its key)";

/// The reason `document` gives for refusing `busid`. Every string in it is
/// the server's word, so each is escaped.
pub fn explain(busid: &str, document: &DeviceStateDocument) -> Option<String> {
    if document.tls_required {
        return Some(TLS_REQUIRED.to_owned());
    }
    if let Some(device) = document.devices.iter().find(|d| d.busid == busid) {
        return held(device);
    }
    let withdrawn = document.withdrawn.iter().find(|w| w.busid == busid)?;
    let what = match withdrawn.why.as_str() {
        "unplugged" => "unplugged from the server",
        _ => "no longer exported (unbound on the server)",
    };
    Some(format!("{what} at {}", escape(&withdrawn.at)))
}

/// Reserved for someone, or in use by someone.
fn held(device: &DeviceStateEntry) -> Option<String> {
    if let Some(reservation) = &device.reservation {
        let mut why = format!("reserved in the lab registry for {}", escape(&reservation.holder));
        if !reservation.client.is_empty() {
            why.push_str(&format!(" ({})", escape(&reservation.client)));
        }
        if let Some(since) = &reservation.since_at {
            why.push_str(&format!(" since {}", escape(since)));
        }
        match &reservation.until_at {
            Some(until) => why.push_str(&format!(" until {}", escape(until))),
            None => why.push_str(" until released"),
        }
        why.push_str(" (import it through its reservation: `usbwire attach --registry URL --device …`)");
        return Some(why);
    }
    if device.state != "in_use" {
        return None;
    }
    let who = match (&device.identity, &device.client) {
        (Some(identity), Some(client)) => format!("{} at {}", escape(identity), escape(client)),
        (None, Some(client)) => escape(client).to_string(),
        (Some(identity), None) => escape(identity).to_string(),
        (None, None) => "another client".to_owned(),
    };
    let mut why = format!("in use by {who}");
    if let Some(since) = &device.since_at {
        why.push_str(&format!(" since {}", escape(since)));
    }
    if let Some(lost) = &device.resuming_since_at {
        why.push_str(&format!(", its connection lost at {}: held for it to resume", escape(lost)));
    }
    why.push_str("; detach it there first");
    Some(why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use usbwire_device::devstate::{ReservedFor, WithdrawnDevice};

    fn device(busid: &str, state: &str) -> DeviceStateEntry {
        DeviceStateEntry { busid: busid.into(), state: state.into(), ..DeviceStateEntry::default() }
    }

    #[test]
    fn each_refusal_is_said_in_words_and_escaped() {
        let mut in_use = device("1-2", "in_use");
        in_use.client = Some("127.0.0.1:59058".into());
        in_use.since_at = Some("2026-11-26T02:00:00Z".into());
        let mut reserved = device("1-3", "available");
        reserved.reservation = Some(ReservedFor {
            holder: "ada@lab\x1b[2J".into(),
            client: "usbwire reserve".into(),
            since_at: None,
            until_at: Some("2026-11-26T03:00:00Z".into()),
        });
        let withdrawn = WithdrawnDevice {
            busid: "1-4".into(),
            why: "unplugged".into(),
            at: "2026-11-26T02:10:00Z".into(),
            ..WithdrawnDevice::default()
        };
        let document = DeviceStateDocument {
            devices: vec![in_use, reserved, device("1-5", "available")],
            withdrawn: vec![withdrawn],
            tls_required: false,
        };
        assert_eq!(
            explain("1-2", &document).as_deref(),
            Some("in use by 127.0.0.1:59058 since 2026-11-26T02:00:00Z; detach it there first")
        );
        let reserved = explain("1-3", &document).unwrap();
        assert!(
            reserved.starts_with(
                r"reserved in the lab registry for ada@lab\x1b[2J (usbwire reserve) until 2026-11-26T03:00:00Z"
            ),
            "{reserved}"
        );
        assert_eq!(explain("1-4", &document).as_deref(), Some("unplugged from the server at 2026-11-26T02:10:00Z"));
        assert_eq!(explain("1-5", &document), None, "available: nothing to explain");
        assert_eq!(explain("9-9", &document), None, "unknown to the server");
    }

    #[test]
    fn a_plain_client_of_a_tls_only_server_is_told_to_add_tls() {
        let document = DeviceStateDocument { tls_required: true, ..DeviceStateDocument::default() };
        let said = explain("1-1", &document).unwrap();
        assert!(said.contains("TLS clients only") && said.contains("add --tls"), "{said}");
        // The field is sent only when true, and read as false when absent (older servers).
        let plain: DeviceStateDocument = serde_json::from_str(r#"{"devices": []}"#).unwrap();
        assert!(!plain.tls_required);
        assert_eq!(serde_json::to_string(&plain).unwrap(), r#"{"devices":[]}"#);
        let round: DeviceStateDocument = serde_json::from_str(&serde_json::to_string(&document).unwrap()).unwrap();
        assert!(round.tls_required);
    }
}
