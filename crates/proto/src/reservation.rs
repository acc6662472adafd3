//! Reservations (usbwire extension): the proof an import carries that its
//! client holds the device's reservation in a lab registry (`usbwire attach
//! --registry`). Stock peers never see it.
//!
//! The client adds `reservation=TOKEN` ([`ReservationToken`], 32 random bytes
//! in hex) to its transform offer (`OP_REQ_TRANSFORMS`) before `OP_REQ_IMPORT`.
//!
//! Not for the token's digest, which is what a lab registry holds and a server
//! compares an offered token's with: that is `usbwire_server::reservation`.

use std::fmt;

/// The key of the offer entry.
pub const OFFER_KEY: &str = "reservation";

/// The secret a reservation's holder proves itself with.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReservationToken(pub [u8; 32]);

impl ReservationToken {
    /// As it appears in the transform offer: `reservation=` and 64 hex digits.
    pub fn offer_entry(&self) -> String {
        format!("{OFFER_KEY}={}", self.hex())
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> String {
        self.0.iter().map(|byte| format!("{byte:02x}")).collect()
    }

    /// Parses 64 hex digits.
    pub fn from_hex(hex: &str) -> Option<Self> {
        if hex.len() != 64 || !hex.is_ascii() {
            return None;
        }
        let mut token = [0u8; 32];
        for (i, byte) in token.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Self(token))
    }

    /// The token a client's transform offer carries, if any (the first one).
    pub fn from_offer(offer: &str) -> Option<Self> {
        offer
            .split(',')
            .find_map(|entry| entry.trim().strip_prefix(OFFER_KEY)?.strip_prefix('='))
            .and_then(Self::from_hex)
    }
}

impl fmt::Debug for ReservationToken {
    /// Only a prefix: enough to tell reservations apart in logs, not to use one.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ReservationToken({:02x}{:02x}{:02x}{:02x}…)", self.0[0], self.0[1], self.0[2], self.0[3])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_round_trips_through_the_offer() {
        let token = ReservationToken(std::array::from_fn(|i| (i * 13) as u8));
        let offer = format!("zstd,resume,{}", token.offer_entry());
        assert_eq!(ReservationToken::from_offer(&offer), Some(token));
        assert_eq!(ReservationToken::from_hex(&token.hex()), Some(token));
        assert_eq!(ReservationToken::from_offer("zstd,resume"), None);
        assert_eq!(ReservationToken::from_offer("reservation=zz"), None);
        assert_eq!(ReservationToken::from_offer(&format!("reservationx={}", token.hex())), None);
        assert_eq!(ReservationToken::from_offer(&format!("reservation={}", "é".repeat(32))), None);
    }

    #[test]
    fn offer_entry_golden_text() {
        let token = ReservationToken([0xab; 32]);
        assert_eq!(token.offer_entry(), format!("reservation={}", "ab".repeat(32)));
    }
}
