//! What one import of a replay did, against the recording: requests
//! matched, the first divergences with their context, and the recorded
//! requests never asked for. Serialized as JSON for CI (`report=PATH`) and
//! summed up in one log line. Counting only: the replay device decides what
//! is a divergence.

use serde::Serialize;

use super::recording::Exchange;

/// Divergences and unasked requests listed in full, at most (the rest are counted).
pub const MAX_LISTED: usize = 16;
/// Data bytes shown in hex per divergence, at most.
const MAX_SHOWN: usize = 64;

/// One import's account of a replay.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// `strict` or `lenient`.
    pub mode: String,
    /// Every URB the host submitted.
    pub requests: u64,
    /// Answered with the recorded completion of a matching request.
    pub matched: u64,
    /// `GET_DESCRIPTOR`s answered from the recorded descriptors (in any order).
    pub descriptors: u64,
    /// IN requests past the end of an endpoint's recording: held, as a
    /// device with nothing to send holds them, until cancelled.
    pub held_past_end: u64,
    /// TEST UNIT READYs on a Bulk-Only interface that the recording has not
    /// at their place (media polling), answered good as the last recorded
    /// one of their LUN was, without moving the recording on.
    pub ready_checks_answered: u64,
    /// Recorded TEST UNIT READYs that passed, the host did not send at their
    /// place (the recorded host's polling): passed over with their CSW.
    pub ready_checks_passed_over: u64,
    /// Port resets the host asked for (`SET_FEATURE(PORT_RESET)`, what a
    /// usbredir bridge or a usbip-win client sends) that the recording has
    /// not at their place: the device is unconfigured, the recording keeps
    /// its place.
    pub resets: u64,
    /// `GET_CONFIGURATION`s the recording has not at their place, answered
    /// with the configuration the replay is in (the last `SET_CONFIGURATION`
    /// it answered; 0 before one and after a reset).
    pub configuration_answered: u64,
    pub divergences: u64,
    /// The first [`MAX_LISTED`] divergences, in order.
    pub first_divergences: Vec<Divergence>,
    /// Recorded requests this import never asked for.
    pub never_asked: u64,
    /// The first [`MAX_LISTED`] of them, in recorded order per endpoint.
    pub first_never_asked: Vec<Unasked>,
}

/// A request that differs from the recording.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Divergence {
    /// The request's place in the import, counting every URB from 1.
    pub position: u64,
    /// Endpoint address, direction bit included (`0x81`).
    pub endpoint: String,
    /// What was asked: the SETUP packet of a control request, or the transfer and length.
    pub request: String,
    pub reason: String,
    /// The recorded request it was compared with, if any.
    pub recorded: Option<Side>,
    /// What this request carried (OUT data, IN length).
    pub received: Side,
    /// What the device answered: `stall`, `recorded` or `held`.
    pub answered: String,
}

/// One side of a comparison.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Side {
    /// The recorded request's block in the file (recorded side only).
    pub block: Option<u64>,
    /// Its place among its endpoint's recorded requests, from 1 (recorded side only).
    pub index: Option<u64>,
    /// The length asked (IN) or sent (OUT).
    pub length: u32,
    /// OUT data, in hex (at most 64 bytes shown).
    pub data: String,
}

/// A recorded request nobody asked for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Unasked {
    pub endpoint: String,
    pub request: String,
    pub block: u64,
}

impl Report {
    pub(crate) fn diverged(&mut self, divergence: Divergence) {
        self.divergences += 1;
        if self.first_divergences.len() < MAX_LISTED {
            self.first_divergences.push(divergence);
        }
    }

    pub(crate) fn unasked(&mut self, exchange: &Exchange) {
        self.never_asked += 1;
        if self.first_never_asked.len() < MAX_LISTED {
            self.first_never_asked.push(Unasked {
                endpoint: format!("{:#04x}", exchange.endpoint),
                request: describe(exchange.endpoint, exchange.setup, exchange.requested),
                block: exchange.block,
            });
        }
    }

    /// Whether the import went as recorded: nothing diverged.
    pub fn is_clean(&self) -> bool {
        self.divergences == 0
    }
}

impl Side {
    pub(crate) fn recorded(exchange: &Exchange, index: usize) -> Self {
        Self {
            block: Some(exchange.block),
            index: Some(index as u64 + 1),
            length: exchange.requested,
            data: hex(&exchange.out),
        }
    }

    pub(crate) fn received(length: u32, data: &[u8]) -> Self {
        Self { block: None, index: None, length, data: hex(data) }
    }
}

/// A request in words: `control 80 06 00 01 00 00 12 00` or `bulk 0x81 512`.
pub(crate) fn describe(endpoint: u8, setup: [u8; 8], length: u32) -> String {
    if endpoint & 0x7f == 0 {
        format!("control {}", hex(&setup).trim_end_matches('…'))
    } else {
        let direction = if endpoint & 0x80 != 0 { "IN" } else { "OUT" };
        format!("{direction} {length} bytes")
    }
}

/// `de ad be ef`, cut after [`MAX_SHOWN`] bytes with `…`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut text: Vec<String> = bytes.iter().take(MAX_SHOWN).map(|b| format!("{b:02x}")).collect();
    if bytes.len() > MAX_SHOWN {
        text.push("…".into());
    }
    text.join(" ")
}
