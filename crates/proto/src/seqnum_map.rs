//! [`SeqnumMap`]: the hash map both sides keep URBs in, keyed by seqnum.
//!
//! Seqnums are u32s a client hands out in sequence. The std default hasher
//! (SipHash, built against hostile keys) costs more per lookup than the rest
//! of the lookup, and a URB takes three or four of them on each side. One
//! multiply and a fold spread sequential (and strided) seqnums over the table.
//! It is not keyed: a client that picks colliding seqnums can only slow the
//! lookups of its own connection, whose map the in-flight limit bounds.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` keyed by seqnum with [`SeqnumHasher`].
pub type SeqnumMap<V> = HashMap<u32, V, BuildHasherDefault<SeqnumHasher>>;

/// Hashes one u32 with a multiply (Fibonacci hashing) and folds the high half
/// into the low half, so the table index depends on every bit of the seqnum.
#[derive(Clone, Copy, Debug, Default)]
pub struct SeqnumHasher(u64);

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

impl Hasher for SeqnumHasher {
    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 32)
    }

    fn write_u32(&mut self, seqnum: u32) {
        self.0 = (self.0 ^ u64::from(seqnum)).wrapping_mul(GOLDEN);
    }

    /// Other key types are not expected; hash them byte by byte all the same.
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(GOLDEN);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn sequential_and_strided_seqnums_spread_over_the_low_bits() {
        let build = BuildHasherDefault::<SeqnumHasher>::default();
        for stride in [1u32, 2, 1 << 11, 1 << 16] {
            let buckets: std::collections::HashSet<u64> =
                (0..1024u32).map(|i| build.hash_one(i.wrapping_mul(stride)) & 2047).collect();
            assert!(buckets.len() > 600, "stride {stride}: only {} of 2048 buckets used", buckets.len());
        }
        let mut map = SeqnumMap::default();
        map.insert(7, "a");
        assert_eq!(map.remove(&7), Some("a"));
    }
}
