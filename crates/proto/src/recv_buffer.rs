//! [`RecvBuffer`]: the buffer a connection reads into, reusing its allocations.
//!
//! Decoders hand payloads out as `Bytes` sliced from the buffer they read, so
//! after a large payload has been handed on, the buffer's allocation is shared
//! with whoever holds it. `BytesMut::reserve` then has to allocate a fresh
//! buffer for the next message, and a fresh megabyte costs page faults on every
//! page the next read touches (the kernel zeroes each one) and an unmap when
//! the last payload in it is dropped. That showed in profiles of 1 MiB IN
//! transfers as `clear_page_erms` / `do_anonymous_page` in the reading thread,
//! where a plain TCP reader reuses one buffer.
//!
//! A `RecvBuffer` keeps the allocations it gives up as spares. When it needs
//! room and its own allocation is still shared, it moves the few bytes of the
//! next message it already holds into a spare whose payloads have all been
//! dropped, instead of into a fresh allocation.

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};

use bytes::BytesMut;

/// The least room [`RecvBuffer::reserve_for_next`] reads into.
pub(crate) const MIN_READ_ROOM: usize = 16 * 1024;

/// Allocations kept for reuse, at most.
const MAX_SPARES: usize = 16;
/// Bytes of spare allocations kept, at most (the capacity of those kept), unless
/// the buffer is made with a lower bound ([`RecvBuffer::holding`]).
pub(crate) const MAX_SPARE_BYTES: usize = 64 << 20;

/// A `BytesMut` to read into whose [`reserve`](Self::reserve) reuses
/// allocations that decoded payloads no longer use. Everything else is the
/// inner `BytesMut`'s (through `Deref`).
#[derive(Debug, Default)]
pub struct RecvBuffer {
    buf: BytesMut,
    /// Allocations given up while payloads still pointed into them, oldest first.
    /// Each is an empty handle; it can take its whole allocation back once
    /// the payloads are dropped. Beside each, the size of its allocation.
    spares: VecDeque<(BytesMut, usize)>,
    /// The size of `buf`'s allocation, as far as this type made it.
    alloc: usize,
    /// Smallest allocation to make (the usual read size).
    min_alloc: usize,
    /// Bound on the size of the spares kept.
    max_spare_bytes: usize,
}

impl RecvBuffer {
    /// A buffer that allocates at least `min_alloc` bytes at a time.
    pub fn with_capacity(min_alloc: usize) -> Self {
        Self {
            buf: BytesMut::with_capacity(min_alloc),
            spares: VecDeque::new(),
            alloc: min_alloc,
            min_alloc,
            max_spare_bytes: MAX_SPARE_BYTES,
        }
    }

    /// A buffer that already holds `bytes` (read past a previous exchange)
    /// and keeps at most `max_spare_bytes` of spare allocations: what it may
    /// hold on to beyond what is buffered and what decoded payloads use.
    pub fn holding(bytes: BytesMut, min_alloc: usize, max_spare_bytes: usize) -> Self {
        let alloc = bytes.capacity();
        Self { buf: bytes, spares: VecDeque::new(), alloc, min_alloc, max_spare_bytes }
    }

    /// Makes room to read the rest of the next message (`rest` bytes, 0 when
    /// its length is not known yet): that much, and at least
    /// [`MIN_READ_ROOM`]. The room left in the current allocation is used
    /// as long as it is that large, so a read that brought part of a message
    /// does not cost a new allocation before the next; a new one is at least
    /// `min_alloc`.
    pub fn reserve_for_next(&mut self, rest: usize) {
        self.reserve(rest.max(MIN_READ_ROOM));
    }

    /// Makes room for at least `additional` more bytes, keeping what is buffered.
    ///
    /// In order of preference: the room is already there; the buffer's own
    /// allocation is free again; a spare allocation is free again and large
    /// enough; a new allocation. In the last two cases the old allocation
    /// becomes a spare.
    pub fn reserve(&mut self, additional: usize) {
        if self.buf.capacity() - self.buf.len() >= additional || self.buf.try_reclaim(additional) {
            return;
        }
        let needed = self.buf.len() + additional;
        let reusable = self.spares.iter_mut().position(|(spare, _)| spare.try_reclaim(needed));
        let (mut next, alloc) = match reusable.and_then(|at| self.spares.remove(at)) {
            Some(spare) => spare,
            None => {
                let alloc = needed.max(self.min_alloc);
                (BytesMut::with_capacity(alloc), alloc)
            }
        };
        next.extend_from_slice(&self.buf);
        let mut old = std::mem::replace(&mut self.buf, next);
        old.clear();
        let old_alloc = std::mem::replace(&mut self.alloc, alloc);
        self.keep_spare(old, old_alloc);
    }

    /// Keeps `old` for reuse, dropping the oldest spares beyond the bounds.
    fn keep_spare(&mut self, old: BytesMut, alloc: usize) {
        self.spares.push_back((old, alloc));
        while self.spares.len() > MAX_SPARES || self.spare_bytes() > self.max_spare_bytes {
            self.spares.pop_front();
        }
    }

    /// The size of the allocations kept as spares.
    fn spare_bytes(&self) -> usize {
        self.spares.iter().map(|(_, alloc)| alloc).sum()
    }
}

impl Deref for RecvBuffer {
    type Target = BytesMut;

    fn deref(&self) -> &BytesMut {
        &self.buf
    }
}

impl DerefMut for RecvBuffer {
    fn deref_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fills `len` bytes and hands them out as a payload would be.
    fn take(buf: &mut RecvBuffer, len: usize) -> bytes::Bytes {
        buf.reserve(len);
        buf.extend(std::iter::repeat_n(7u8, len));
        buf.split_to(len).freeze()
    }

    #[test]
    fn a_dropped_payload_gives_its_allocation_back() {
        let mut buf = RecvBuffer::with_capacity(1024);
        let first = take(&mut buf, 1 << 20);
        let first_ptr = first.as_ptr();
        // Held: the next megabyte needs another allocation.
        let second = take(&mut buf, 1 << 20);
        assert_ne!(second.as_ptr(), first_ptr);
        drop(first);
        // The first allocation is free again and is used instead of a third
        // for the next message of the same size, of which 4 bytes are here.
        buf.extend_from_slice(b"head");
        buf.reserve((1 << 20) - 4);
        assert_eq!(buf.as_ptr(), first_ptr);
        assert_eq!(&buf[..], b"head", "buffered bytes move along");
        drop(second);
    }

    #[test]
    fn own_allocation_is_reclaimed_in_place() {
        let mut buf = RecvBuffer::with_capacity(4096);
        let payload = take(&mut buf, 4096);
        let ptr = payload.as_ptr();
        drop(payload);
        buf.reserve(4096);
        assert_eq!(buf.as_ptr(), ptr);
        assert!(buf.spares.is_empty());
    }

    #[test]
    fn spares_are_bounded() {
        let mut buf = RecvBuffer::with_capacity(16);
        let held: Vec<_> = (0..3 * MAX_SPARES).map(|_| take(&mut buf, 64 << 10)).collect();
        assert!(buf.spares.len() <= MAX_SPARES);
        drop(held);
        // Every spare is free now; a reserve that fits takes one and keeps the bounds.
        buf.reserve(32 << 10);
        assert!(buf.spares.len() <= MAX_SPARES);
        assert!(buf.spare_bytes() <= MAX_SPARE_BYTES);
    }

    #[test]
    fn a_lower_spare_bound_holds() {
        let bound = 3 << 20;
        let mut buf = RecvBuffer::holding(BytesMut::new(), 16, bound);
        let held: Vec<_> = (0..8).map(|_| take(&mut buf, 1 << 20)).collect();
        assert!(buf.spare_bytes() <= bound, "{} bytes of spares kept", buf.spare_bytes());
        assert!(!buf.spares.is_empty(), "some are kept for reuse");
        drop(held);
    }

    #[test]
    fn spares_too_small_are_skipped() {
        let mut buf = RecvBuffer::with_capacity(16);
        let small = take(&mut buf, 1024);
        drop(small);
        let held = take(&mut buf, 1 << 20);
        assert_eq!(held.len(), 1 << 20);
        assert!(buf.capacity() - buf.len() < 1 << 20);
        buf.reserve(1 << 20);
        assert!(buf.capacity() - buf.len() >= 1 << 20);
    }
}
