//! Bounds on what a peer may make us allocate, parse or hold.

/// Explicit limits applied while decoding untrusted input.
///
/// Defaults are generous enough for every real driver seen (usb-storage and
/// uas submit transfers of a few MiB through vhci's scatter-gather path) and
/// small enough that one connection cannot exhaust memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest `transfer_buffer_length` accepted, in bytes.
    pub max_transfer_length: u32,
    /// Largest `number_of_packets` of an isochronous URB (the kernel's `USBIP_MAX_ISO_PACKETS`).
    pub max_iso_packets: u32,
    /// Largest number of devices accepted in an `OP_REP_DEVLIST`.
    pub max_devices: u32,
}

impl Limits {
    /// The kernel stub's limit on isochronous packets per URB.
    pub const KERNEL_MAX_ISO_PACKETS: u32 = 1024;
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_transfer_length: 16 * 1024 * 1024, max_iso_packets: Self::KERNEL_MAX_ISO_PACKETS, max_devices: 1024 }
    }
}

/// What one connection may hold in memory on behalf of its peer. When a budget
/// is full the connection stops *reading* (TCP pushes back on the peer) rather
/// than buffering more, so no byte sequence a peer sends makes us hold more
/// than the sum of these plus one message of each kind.
///
/// Defaults keep a 10 Gbit/s link busy at tens of milliseconds of round trip
/// and cap a connection at well under 128 MiB.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Reply bytes (completions with their data, unlink answers) waiting to be written.
    pub queued_reply_bytes: usize,
    /// Reply bytes a resumable session keeps until the client acknowledges
    /// them (sent, in the network or not yet read): the bandwidth-delay
    /// product the link may reach, plus what is waiting to be written.
    pub unacked_reply_bytes: usize,
    /// Bytes a transform decoded (decompressed) that the reader has not taken yet.
    pub decoded_bytes: usize,
    /// `transfer_buffer_length` summed over URBs in flight (OUT data held, IN data to come).
    pub in_flight_bytes: usize,
    /// URBs in flight.
    pub in_flight_urbs: usize,
}

impl Budget {
    /// Whether a URB of `length` bytes may start while `held` bytes are in flight:
    /// always when nothing is (so one URB of any accepted size gets through).
    pub fn admits(&self, held: usize, length: usize) -> bool {
        held == 0 || held.saturating_add(length) <= self.in_flight_bytes
    }
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            queued_reply_bytes: 8 * 1024 * 1024,
            unacked_reply_bytes: 32 * 1024 * 1024,
            decoded_bytes: 8 * 1024 * 1024,
            in_flight_bytes: 64 * 1024 * 1024,
            in_flight_urbs: 1024,
        }
    }
}

/// Which [`Budget`] holds a session back when it is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BudgetKind {
    /// [`Budget::in_flight_bytes`]: a submit waits for URB bytes in flight to complete.
    InFlightBytes,
    /// [`Budget::in_flight_urbs`].
    InFlightUrbs,
    /// [`Budget::queued_reply_bytes`]: replies wait for the client to read them.
    QueuedReplyBytes,
    /// [`Budget::unacked_reply_bytes`]: a resumable session's replies wait for acknowledgement.
    UnackedReplyBytes,
}

impl BudgetKind {
    pub const ALL: [Self; 4] =
        [Self::InFlightBytes, Self::InFlightUrbs, Self::QueuedReplyBytes, Self::UnackedReplyBytes];

    /// Its name in the configuration file's `[limits]` and in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::InFlightBytes => "in_flight_bytes",
            Self::InFlightUrbs => "in_flight_urbs",
            Self::QueuedReplyBytes => "queued_reply_bytes",
            Self::UnackedReplyBytes => "unacked_reply_bytes",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_urb_of_any_size_gets_through_an_empty_budget() {
        let budget = Budget { in_flight_bytes: 1000, ..Budget::default() };
        assert!(budget.admits(0, 5000));
        assert!(budget.admits(400, 600));
        assert!(!budget.admits(400, 601));
        assert!(!budget.admits(usize::MAX, 1));
    }
}
