//! What the registry remembers only to say why an import is refused: who
//! holds each lab registry reservation and until when ([`Reservation`]), and
//! the devices withdrawn lately ([`RecentlyWithdrawn`]).
//!
//! Enforcing a reservation (comparing token digests) is the registry's; this
//! is what `OP_REP_DEVSTATE` shows of it, never the digest.

use std::collections::VecDeque;
use std::time::SystemTime;

use usbwire_device::devstate::{ReservedFor, WithdrawnDevice};
use usbwire_proto::op::DeviceRecord;

use crate::reservation::ReservationDigest;

/// How many withdrawn devices are remembered: enough for an unbind of a few
/// devices, few enough that the list never grows with a server's uptime.
pub(super) const WITHDRAWN_KEPT: usize = 16;

/// A device reserved in a lab registry: the digest of the token an import
/// must carry, and for whom, as the reservation's record says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    pub digest: ReservationDigest,
    pub reserved_for: ReservedFor,
}

/// Why a device was withdrawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Withdrawal {
    Unbound,
    Unplugged,
}

impl Withdrawal {
    fn word(self) -> &'static str {
        match self {
            Self::Unbound => "unbound",
            Self::Unplugged => "unplugged",
        }
    }
}

/// One withdrawn device, with what the access rules look at.
#[derive(Clone, Debug)]
pub(crate) struct Withdrawn {
    pub(crate) record: DeviceRecord,
    pub(crate) serial: String,
    pub(crate) shown: WithdrawnDevice,
}

/// The last [`WITHDRAWN_KEPT`] devices withdrawn and not exported again, newest first.
#[derive(Default)]
pub(super) struct RecentlyWithdrawn(VecDeque<Withdrawn>);

impl RecentlyWithdrawn {
    pub(super) fn note(&mut self, kind: &str, record: DeviceRecord, serial: String, why: Withdrawal) {
        self.exported_again(record.busid.as_str());
        let shown = WithdrawnDevice {
            busid: record.busid.to_string(),
            kind: kind.to_owned(),
            vendor_id: format!("{:04x}", record.id_vendor),
            product_id: format!("{:04x}", record.id_product),
            why: why.word().to_owned(),
            at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        };
        self.0.push_front(Withdrawn { record, serial, shown });
        self.0.truncate(WITHDRAWN_KEPT);
    }

    /// A bus id exported again is no longer withdrawn.
    pub(super) fn exported_again(&mut self, busid: &str) {
        self.0.retain(|w| w.shown.busid != busid);
    }

    pub(super) fn list(&self) -> Vec<Withdrawn> {
        self.0.iter().cloned().collect()
    }
}
