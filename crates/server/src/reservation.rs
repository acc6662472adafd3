//! A lab reservation's digest: the SHA-256 of its token, which is what a lab
//! registry holds for a reserved device and what this server compares the
//! digest of an offered token with. Reading the registry therefore does not
//! let anyone import a device reserved by someone else.
//!
//! It lives here, not in the lab crate that writes reservations, because the
//! server checks them and the lab crate stands on the server: this is the
//! lowest crate both use. The token itself travels in the transform offer
//! (`usbwire_proto::reservation`); which devices are reserved, and for whom,
//! is the registry's ([`crate::Registry::set_reservations`]).

use sha2::{Digest as _, Sha256};
use usbwire_proto::reservation::ReservationToken;

/// The SHA-256 of a reservation token: what a lab registry holds for a reserved device.
pub type ReservationDigest = [u8; 32];

/// The digest a registry stores for `token` (and a server compares an offered token's with).
pub fn digest(token: &ReservationToken) -> ReservationDigest {
    Sha256::digest(token.0).into()
}

/// Whether an import's reservation digest is the one the registry holds,
/// compared without an early exit.
pub(crate) fn digests_match(a: &ReservationDigest, b: &ReservationDigest) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_is_the_sha256_of_the_token_bytes() {
        // SHA-256 of 32 zero bytes (FIPS 180-4; `head -c32 /dev/zero | sha256sum`).
        let zero = "66687aadf862bd776c8fc18b8e9f8e20089714856ee233b3902a591d0d5f2925";
        let hex: String = digest(&ReservationToken([0; 32])).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, zero);
        assert_ne!(digest(&ReservationToken([1; 32])), digest(&ReservationToken([0; 32])));
    }
}
