//! [`SeqnumMap`]: the map both sides keep URBs in, keyed by seqnum.
//!
//! Seqnums are u32s a client hands out in sequence, so the URBs in flight on a
//! connection are almost always a short run of consecutive numbers. The map is
//! therefore a window: a power-of-two array of slots indexed by
//! `seqnum & mask`, where insert, lookup and remove are one index and one
//! compare (a URB takes three or four of them on each side). Whatever does not
//! fit — more URBs in flight than slots, or a peer whose seqnums jump so that
//! two live ones share a slot — goes to a fallback hash map, so the map stays
//! correct for any seqnums and only gets slower for odd ones.
//!
//! The fallback hashes with [`SeqnumHasher`] (one multiply and a fold instead
//! of SipHash). It is not keyed: a client that picks colliding seqnums can
//! only slow the lookups of its own connection, whose map the in-flight limit
//! bounds.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Slots in the window: enough for the server's default in-flight limit, so
/// sequential seqnums never reach the fallback map.
const WINDOW: usize = 1024;

/// A map from seqnum to `V`: a window of slots indexed by the seqnum's low
/// bits, with a hash map behind it for seqnums whose slot is taken.
///
/// The slots are allocated on the first insert, so an unused map costs nothing.
pub struct SeqnumMap<V> {
    /// `WINDOW` slots once anything was inserted; each holds its key.
    slots: Vec<Option<(u32, V)>>,
    /// Entries whose slot held another seqnum when they were inserted.
    overflow: HashMap<u32, V, BuildHasherDefault<SeqnumHasher>>,
    /// Entries in `slots` and `overflow` together.
    len: usize,
}

impl<V> Default for SeqnumMap<V> {
    fn default() -> Self {
        Self { slots: Vec::new(), overflow: HashMap::default(), len: 0 }
    }
}

impl<V: std::fmt::Debug> std::fmt::Debug for SeqnumMap<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let slots = self.slots.iter().flatten().map(|(k, v)| (k, v));
        f.debug_map().entries(slots.chain(self.overflow.iter())).finish()
    }
}

#[inline]
fn slot_of(seqnum: u32) -> usize {
    seqnum as usize & (WINDOW - 1)
}

impl<V> SeqnumMap<V> {
    /// Adds `value` under `seqnum`; returns the value it replaces, if any.
    pub fn insert(&mut self, seqnum: u32, value: V) -> Option<V> {
        if self.slots.is_empty() {
            self.slots.resize_with(WINDOW, || None);
        }
        let slot = &mut self.slots[slot_of(seqnum)];
        match slot {
            Some((key, old)) if *key == seqnum => return Some(std::mem::replace(old, value)),
            Some(_) => {}
            None if self.overflow.is_empty() => {
                *slot = Some((seqnum, value));
                self.len += 1;
                return None;
            }
            // The key may already wait in the fallback map from when the slot was taken.
            None => {
                if let Some(old) = self.overflow.remove(&seqnum) {
                    *slot = Some((seqnum, value));
                    return Some(old);
                }
                *slot = Some((seqnum, value));
                self.len += 1;
                return None;
            }
        }
        let old = self.overflow.insert(seqnum, value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// Adds `value` under `seqnum` unless the seqnum is taken, in which case
    /// the map is left as it was and `value` comes back.
    #[inline]
    pub fn insert_new(&mut self, seqnum: u32, value: V) -> Result<(), V> {
        if let Some(slot @ None) = self.slots.get_mut(slot_of(seqnum)) {
            // The usual case: a free slot, and nothing in the fallback map that could hold the key.
            if self.overflow.is_empty() {
                *slot = Some((seqnum, value));
                self.len += 1;
                return Ok(());
            }
        }
        self.insert_new_slowly(seqnum, value)
    }

    /// [`insert_new`](Self::insert_new) past its usual case (out of line, so that stays short).
    #[cold]
    #[inline(never)]
    fn insert_new_slowly(&mut self, seqnum: u32, value: V) -> Result<(), V> {
        if self.slots.is_empty() {
            self.slots.resize_with(WINDOW, || None);
        }
        match &self.slots[slot_of(seqnum)] {
            Some((key, _)) if *key == seqnum => return Err(value),
            _ => {}
        }
        if self.overflow.contains_key(&seqnum) {
            return Err(value);
        }
        self.insert(seqnum, value);
        Ok(())
    }

    /// Takes the value under `seqnum` out of the map.
    #[inline]
    pub fn remove(&mut self, seqnum: u32) -> Option<V> {
        if let Some(slot) = self.slots.get_mut(slot_of(seqnum)) {
            if matches!(slot, Some((key, _)) if *key == seqnum) {
                self.len -= 1;
                return slot.take().map(|(_, value)| value);
            }
        }
        if self.overflow.is_empty() {
            return None;
        }
        self.remove_from_overflow(seqnum)
    }

    /// [`remove`](Self::remove) from the fallback map (out of line, so the usual case stays short).
    #[cold]
    #[inline(never)]
    fn remove_from_overflow(&mut self, seqnum: u32) -> Option<V> {
        let value = self.overflow.remove(&seqnum)?;
        self.len -= 1;
        Some(value)
    }

    #[inline]
    pub fn get(&self, seqnum: u32) -> Option<&V> {
        match self.slots.get(slot_of(seqnum)) {
            Some(Some((key, value))) if *key == seqnum => Some(value),
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.get(&seqnum),
        }
    }

    pub fn get_mut(&mut self, seqnum: u32) -> Option<&mut V> {
        match self.slots.get_mut(slot_of(seqnum)) {
            Some(Some((key, value))) if *key == seqnum => Some(value),
            _ => self.overflow.get_mut(&seqnum),
        }
    }

    pub fn contains_key(&self, seqnum: u32) -> bool {
        self.get(seqnum).is_some()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every value, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.slots.iter().flatten().map(|(_, value)| value).chain(self.overflow.values())
    }

    /// Every value, in no particular order (for failing what is left when a connection ends).
    pub fn into_values(self) -> impl Iterator<Item = V> {
        self.slots.into_iter().flatten().map(|(_, value)| value).chain(self.overflow.into_values())
    }
}

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
    }

    #[test]
    fn sequential_seqnums_stay_in_the_window() {
        let mut map = SeqnumMap::default();
        for seqnum in 1..=32u32 {
            assert_eq!(map.insert(seqnum, seqnum * 10), None);
        }
        assert_eq!((map.len(), map.overflow.len()), (32, 0));
        assert_eq!(map.get(7), Some(&70));
        *map.get_mut(7).unwrap() += 1;
        assert_eq!(map.remove(7), Some(71));
        assert_eq!(map.remove(7), None, "removed twice");
        assert!(!map.contains_key(7) && map.contains_key(8));
        assert_eq!(map.len(), 31);
    }

    #[test]
    fn seqnums_wrap_around_u32() {
        let mut map = SeqnumMap::default();
        let seqnums: Vec<u32> = (0..40u32).map(|i| (u32::MAX - 20).wrapping_add(i)).collect();
        for &seqnum in &seqnums {
            map.insert(seqnum, seqnum);
        }
        assert_eq!((map.len(), map.overflow.len()), (40, 0), "wrapping past 0 stays sequential in the slots");
        for &seqnum in &seqnums {
            assert_eq!(map.remove(seqnum), Some(seqnum));
        }
        assert!(map.is_empty());
    }

    #[test]
    fn insert_new_refuses_a_taken_seqnum_in_a_slot_or_in_the_fallback_map() {
        let mut map = SeqnumMap::default();
        let (a, b) = (9u32, 9 + WINDOW as u32);
        assert_eq!(map.insert_new(a, 'a'), Ok(()));
        assert_eq!(map.insert_new(a, 'x'), Err('x'), "taken in its slot");
        assert_eq!(map.insert_new(b, 'b'), Ok(()), "its slot is taken by another seqnum: the fallback map");
        assert_eq!(map.insert_new(b, 'y'), Err('y'), "taken in the fallback map");
        assert_eq!(map.remove(a), Some('a'));
        assert_eq!(map.insert_new(b, 'z'), Err('z'), "the slot is free, the key still waits in the fallback map");
        assert_eq!((map.len(), map.get(b)), (1, Some(&'b')));
        assert_eq!(map.insert_new(a, 'A'), Ok(()));
        assert_eq!((map.len(), map.get(a)), (2, Some(&'A')));
    }

    #[test]
    fn colliding_seqnums_fall_back_and_stay_distinct() {
        let mut map = SeqnumMap::default();
        let (a, b, c) = (5u32, 5 + WINDOW as u32, 5 + 2 * WINDOW as u32);
        map.insert(a, 'a');
        map.insert(b, 'b');
        map.insert(c, 'c');
        assert_eq!((map.len(), map.overflow.len()), (3, 2));
        assert_eq!((map.get(a), map.get(b), map.get(c)), (Some(&'a'), Some(&'b'), Some(&'c')));
        // The slot frees up while b still waits in the fallback map: re-inserting
        // b must replace it there, not add a second entry.
        assert_eq!(map.remove(a), Some('a'));
        assert_eq!(map.insert(b, 'B'), Some('b'));
        assert_eq!(map.len(), 2);
        assert_eq!(map.remove(b), Some('B'));
        assert_eq!(map.remove(b), None);
        assert_eq!(map.get_mut(c).map(|v| *v), Some('c'));
        assert_eq!(map.remove(c), Some('c'));
        assert!(map.is_empty());
    }

    #[test]
    fn more_in_flight_than_slots() {
        let mut map = SeqnumMap::default();
        let count = 3 * WINDOW as u32 + 7;
        for seqnum in 0..count {
            map.insert(seqnum, seqnum);
        }
        assert_eq!(map.len(), count as usize);
        assert_eq!(map.insert(count - 1, 0), Some(count - 1), "a replaced value does not count twice");
        assert_eq!(map.len(), count as usize);
        let mut values: Vec<u32> = map.into_values().collect();
        values.sort_unstable();
        assert_eq!(values.len(), count as usize);
        assert_eq!(values[..3], [0, 0, 1]);
    }

    #[test]
    fn absent_keys_are_absent() {
        let mut map: SeqnumMap<u8> = SeqnumMap::default();
        assert_eq!(map.get(1), None);
        assert_eq!(map.remove(1), None);
        assert_eq!(map.get_mut(1), None);
        map.insert(1, 1);
        assert_eq!(map.remove(1 + WINDOW as u32), None, "same slot, other seqnum");
        assert_eq!(map.get(1), Some(&1));
    }
}
