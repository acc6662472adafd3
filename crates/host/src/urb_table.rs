//! Which usbfs URBs the kernel holds, keyed by the address of each URB.
//!
//! usbfs hands back a finished URB as the pointer we submitted
//! (`USBDEVFS_REAPURBNDELAY` returns the `struct usbdevfs_urb *`), and it
//! writes the URB's status, lengths and IN data into our memory *during that
//! reap*. So memory given to `USBDEVFS_SUBMITURB` is the kernel's until the
//! pointer comes back from a reap, whatever happened meanwhile: an unlink,
//! a reset for the next importer, an unplug. This table holds that memory:
//!
//! * **Keyed by the pointer, not the seqnum.** A seqnum is chosen by the
//!   importer and repeats across importers; an address cannot repeat while
//!   the table owns the allocation at it, so a URB reaped late can only ever
//!   find its own entry. A reaped pointer that is not in the table is
//!   reported as [`Reaped::Unknown`] and must not be dereferenced.
//! * **Three sets.** `submitted` URBs a seqnum still names; `cancelled` URBs
//!   (discard sent, completion still owed to the importer); `abandoned` URBs
//!   whose importer is gone (reset) or was already answered (unplug): freed
//!   when reaped, and nobody is told.
//! * **Never freed before the kernel gives it back.** Entries leave the table
//!   only through [`UrbTable::reap`] or [`UrbTable::leak_all`]; dropping a
//!   table that still holds entries leaks them on purpose.
//!
//! Sans-I/O: no ioctls here, so it is tested without a kernel. The caller
//! (`device.rs`) submits, discards and reaps, and tells the table what it did.

use std::collections::HashMap;

use tracing::warn;

/// The address of a submitted `struct usbdevfs_urb`, as `USBDEVFS_SUBMITURB`
/// received it and `USBDEVFS_REAPURBNDELAY` returns it. Only compared, never
/// turned back into a pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct UrbKey(usize);

impl UrbKey {
    pub(crate) fn of<T>(urb: *const T) -> Self {
        Self(urb.addr())
    }
}

/// What a reaped pointer was.
#[derive(Debug)]
pub(crate) enum Reaped<E> {
    /// A URB the importer is waiting for: turn it into a completion.
    /// `cancelled` says whether the importer asked to unlink it.
    Completed { seqnum: u32, cancelled: bool, entry: E },
    /// A URB nobody waits for any more; the kernel is done with it, so its
    /// memory may be freed now.
    Abandoned(E),
    /// Not a URB this table holds (already reaped, or never ours): ignore it,
    /// never read through it.
    Unknown,
}

/// An entry the kernel still holds, with the seqnum it was submitted for.
#[derive(Debug)]
struct Held<E> {
    seqnum: u32,
    entry: E,
}

/// The usbfs URBs in the kernel's hands, each owning its memory (`E`).
#[derive(Debug)]
pub(crate) struct UrbTable<E> {
    submitted: HashMap<UrbKey, Held<E>>,
    cancelled: HashMap<UrbKey, Held<E>>,
    abandoned: HashMap<UrbKey, Held<E>>,
    /// The submitted URB a seqnum names, for [`cancel`](Self::cancel).
    by_seqnum: HashMap<u32, UrbKey>,
}

impl<E> Default for UrbTable<E> {
    fn default() -> Self {
        Self {
            submitted: HashMap::new(),
            cancelled: HashMap::new(),
            abandoned: HashMap::new(),
            by_seqnum: HashMap::new(),
        }
    }
}

impl<E> UrbTable<E> {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Records a URB the kernel accepted. Call right after a successful
    /// `USBDEVFS_SUBMITURB` with the key of the pointer submitted.
    ///
    /// `Err` gives the entry back if the key is already held: two live URBs
    /// cannot share an address, so this is a caller bug. The entry's memory
    /// was submitted, so the caller must not free it (leak it).
    pub(crate) fn insert(&mut self, key: UrbKey, seqnum: u32, entry: E) -> Result<(), E> {
        if self.holds(key) {
            return Err(entry);
        }
        // The server refuses a seqnum already in flight, so one seqnum names
        // one submitted URB; if not, the newest is the one an unlink finds.
        self.by_seqnum.insert(seqnum, key);
        self.submitted.insert(key, Held { seqnum, entry });
        Ok(())
    }

    /// Marks the submitted URB for `seqnum` as cancelled and returns it, so the
    /// caller can `USBDEVFS_DISCARDURB` it. The URB stays held until reaped.
    /// `None` if no submitted URB has that seqnum (finished, or already cancelled).
    pub(crate) fn cancel(&mut self, seqnum: u32) -> Option<&mut E> {
        let key = self.by_seqnum.remove(&seqnum)?;
        let held = self.submitted.remove(&key)?;
        Some(&mut self.cancelled.entry(key).or_insert(held).entry)
    }

    /// Takes the URB the kernel just returned from a reap out of the table.
    pub(crate) fn reap(&mut self, key: UrbKey) -> Reaped<E> {
        if let Some(Held { seqnum, entry }) = self.submitted.remove(&key) {
            if self.by_seqnum.get(&seqnum) == Some(&key) {
                self.by_seqnum.remove(&seqnum);
            }
            Reaped::Completed { seqnum, cancelled: false, entry }
        } else if let Some(Held { seqnum, entry }) = self.cancelled.remove(&key) {
            Reaped::Completed { seqnum, cancelled: true, entry }
        } else if let Some(Held { entry, .. }) = self.abandoned.remove(&key) {
            Reaped::Abandoned(entry)
        } else {
            Reaped::Unknown
        }
    }

    /// Stops waiting for every submitted or cancelled URB (the importer is
    /// gone, or was answered another way): each is passed to `each` once, with
    /// its seqnum, and kept as abandoned until reaped.
    pub(crate) fn abandon_all(&mut self, mut each: impl FnMut(u32, &mut E)) {
        self.by_seqnum.clear();
        for (key, mut held) in self.submitted.drain().chain(self.cancelled.drain()) {
            each(held.seqnum, &mut held.entry);
            self.abandoned.insert(key, held);
        }
    }

    /// Every URB the kernel still holds, for discarding them all.
    pub(crate) fn held_mut(&mut self) -> impl Iterator<Item = &mut E> {
        self.submitted
            .values_mut()
            .chain(self.cancelled.values_mut())
            .chain(self.abandoned.values_mut())
            .map(|held| &mut held.entry)
    }

    /// How many URBs the kernel holds (in any set).
    pub(crate) fn len(&self) -> usize {
        self.submitted.len() + self.cancelled.len() + self.abandoned.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many URBs an importer still waits for (submitted or cancelled).
    pub(crate) fn awaited(&self) -> usize {
        self.submitted.len() + self.cancelled.len()
    }

    /// Gives up on every URB still held without freeing its memory (the kernel
    /// may write it at a later reap, which then finds nothing and is ignored).
    /// Returns how many were leaked.
    pub(crate) fn leak_all(&mut self) -> usize {
        let leaked = self.len();
        self.by_seqnum.clear();
        for (_, held) in self.submitted.drain().chain(self.cancelled.drain()).chain(self.abandoned.drain()) {
            std::mem::forget(held);
        }
        leaked
    }

    fn holds(&self, key: UrbKey) -> bool {
        self.submitted.contains_key(&key) || self.cancelled.contains_key(&key) || self.abandoned.contains_key(&key)
    }
}

impl<E> Drop for UrbTable<E> {
    fn drop(&mut self) {
        let leaked = self.leak_all();
        if leaked > 0 {
            warn!(
                target: "usbwire::host",
                leaked,
                "usbfs URBs never came back from the kernel; their memory is leaked on purpose (freeing it could \
                 corrupt memory at a later reap). If this repeats, the device or its host controller driver is stuck: \
                 unplug it or reload the controller's driver"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    /// A URB's memory: a heap allocation whose address is its key, that
    /// counts its own drops so a test sees exactly when memory is freed.
    #[derive(Debug)]
    struct Memory {
        block: Box<u64>,
        freed: Rc<Cell<usize>>,
    }

    impl Memory {
        fn key(&self) -> UrbKey {
            UrbKey::of(&*self.block as *const u64)
        }
    }

    impl Drop for Memory {
        fn drop(&mut self) {
            self.freed.set(self.freed.get() + 1);
        }
    }

    struct Kernel {
        freed: Rc<Cell<usize>>,
        next: u64,
    }

    impl Kernel {
        fn new() -> Self {
            Self { freed: Rc::new(Cell::new(0)), next: 0 }
        }

        /// Submits fresh memory for `seqnum`; returns the key the kernel would reap.
        fn submit(&mut self, table: &mut UrbTable<Memory>, seqnum: u32) -> UrbKey {
            self.next += 1;
            let memory = Memory { block: Box::new(self.next), freed: self.freed.clone() };
            let key = memory.key();
            table.insert(key, seqnum, memory).expect("a fresh allocation has a fresh address");
            key
        }

        fn freed(&self) -> usize {
            self.freed.get()
        }
    }

    #[test]
    fn submit_then_reap_gives_back_the_entry_and_its_seqnum() {
        let mut kernel = Kernel::new();
        let mut table = UrbTable::new();
        let a = kernel.submit(&mut table, 7);
        let b = kernel.submit(&mut table, 8);
        assert_eq!(table.len(), 2);
        match table.reap(b) {
            Reaped::Completed { seqnum: 8, cancelled: false, entry } => assert_eq!(entry.key(), b),
            other => panic!("expected seqnum 8 completed, got {other:?}"),
        }
        assert_eq!(kernel.freed(), 1, "the reaped entry is the caller's to drop");
        assert!(matches!(table.reap(a), Reaped::Completed { seqnum: 7, cancelled: false, .. }));
        assert!(table.is_empty());
        assert!(table.cancel(7).is_none(), "a finished URB cannot be cancelled");
    }

    #[test]
    fn cancelled_urb_keeps_its_memory_until_the_kernel_gives_it_back() {
        let mut kernel = Kernel::new();
        let mut table = UrbTable::new();
        let key = kernel.submit(&mut table, 5);
        let discarded = table.cancel(5).expect("submitted URB is cancellable");
        assert_eq!(discarded.key(), key, "cancel hands out the URB to discard");
        assert!(table.cancel(5).is_none(), "a second unlink of the same seqnum finds nothing to discard");
        assert_eq!(kernel.freed(), 0);
        assert_eq!(table.len(), 1);
        assert_eq!(table.awaited(), 1, "the importer still gets the cancelled URB's completion");
        match table.reap(key) {
            Reaped::Completed { seqnum: 5, cancelled: true, entry } => drop(entry),
            other => panic!("expected a cancelled completion, got {other:?}"),
        }
        assert_eq!(kernel.freed(), 1);
        assert!(table.is_empty());
    }

    #[test]
    fn reap_of_a_pointer_not_in_the_table_is_unknown_and_frees_nothing() {
        let mut kernel = Kernel::new();
        let mut table = UrbTable::new();
        let key = kernel.submit(&mut table, 1);
        let stranger = Box::new(0u64);
        assert!(matches!(table.reap(UrbKey::of(&*stranger as *const u64)), Reaped::Unknown));
        assert!(matches!(table.reap(key), Reaped::Completed { .. }));
        assert!(matches!(table.reap(key), Reaped::Unknown), "a pointer is reaped once; a repeat is ignored");
        assert_eq!(kernel.freed(), 1);
    }

    /// The use-after-free of issue 10: a URB cancelled (then abandoned by a
    /// reset) comes back late, after the next importer reused its seqnum.
    /// It must find its own entry, and the new importer's URB must stay held.
    #[test]
    fn seqnum_reuse_while_a_cancelled_urb_is_outstanding() {
        let mut kernel = Kernel::new();
        let mut table = UrbTable::new();
        let old = kernel.submit(&mut table, 42);
        table.cancel(42).expect("cancellable");
        // The first importer disconnects: reset abandons what is left.
        let mut abandoned = Vec::new();
        table.abandon_all(|seqnum, memory| abandoned.push((seqnum, memory.key())));
        assert_eq!(abandoned, [(42, old)]);
        assert_eq!(table.awaited(), 0);

        // The next importer uses seqnum 42 too.
        let new = kernel.submit(&mut table, 42);
        assert_ne!(new, old, "the old URB's memory is still held, so its address is not reused");
        assert_eq!(kernel.freed(), 0);

        // The kernel finally returns the old URB.
        assert!(matches!(table.reap(old), Reaped::Abandoned(_)));
        assert_eq!(kernel.freed(), 1, "only the old URB's memory is freed");
        assert_eq!(table.len(), 1);

        // The new importer's URB is untouched: still cancellable and reaped as its own.
        assert_eq!(table.cancel(42).map(|m| m.key()), Some(new));
        assert!(matches!(table.reap(new), Reaped::Completed { seqnum: 42, cancelled: true, .. }));
        assert_eq!(kernel.freed(), 2);
    }

    /// Same seqnum reused while the first URB is only cancelled (not reset):
    /// each pointer completes as itself.
    #[test]
    fn same_seqnum_cancelled_and_submitted_complete_separately() {
        let mut kernel = Kernel::new();
        let mut table = UrbTable::new();
        let first = kernel.submit(&mut table, 9);
        table.cancel(9).expect("cancellable");
        let second = kernel.submit(&mut table, 9);
        assert!(matches!(table.reap(first), Reaped::Completed { seqnum: 9, cancelled: true, .. }));
        assert_eq!(table.cancel(9).map(|m| m.key()), Some(second), "the reap of the first did not unindex the second");
        assert!(matches!(table.reap(second), Reaped::Completed { seqnum: 9, cancelled: true, .. }));
        assert!(table.is_empty());
    }

    #[test]
    fn close_with_outstanding_urbs_discards_all_and_leaks_what_never_comes_back() {
        let mut kernel = Kernel::new();
        let mut table = UrbTable::new();
        let keys: Vec<UrbKey> = (0..4).map(|seqnum| kernel.submit(&mut table, seqnum)).collect();
        table.cancel(1).expect("cancellable");
        let mut told = Vec::new();
        table.abandon_all(|seqnum, _| told.push(seqnum));
        told.sort_unstable();
        assert_eq!(told, [0, 1, 2, 3], "every URB an importer waited for is reported once");
        let mut discarded: Vec<UrbKey> = table.held_mut().map(|m| m.key()).collect();
        discarded.sort_by_key(|k| k.0);
        let mut expected = keys.clone();
        expected.sort_by_key(|k| k.0);
        assert_eq!(discarded, expected, "closing discards every held URB");

        // Two come back within the wait; two never do.
        assert!(matches!(table.reap(keys[0]), Reaped::Abandoned(_)));
        assert!(matches!(table.reap(keys[1]), Reaped::Abandoned(_)));
        assert_eq!(kernel.freed(), 2);
        assert_eq!(table.len(), 2);
        drop(table);
        assert_eq!(kernel.freed(), 2, "dropping the table must not free what the kernel still holds");
    }

    #[test]
    fn inserting_a_held_key_twice_is_refused() {
        let mut kernel = Kernel::new();
        let mut table = UrbTable::new();
        let key = kernel.submit(&mut table, 3);
        let twin = Memory { block: Box::new(0), freed: kernel.freed.clone() };
        let refused = table.insert(key, 4, twin).expect_err("the key is held");
        drop(refused);
        assert!(matches!(table.reap(key), Reaped::Completed { seqnum: 3, .. }), "the held entry is unchanged");
    }

    /// A random mix of submits, cancels, resets and reaps (in a random
    /// order) never frees memory before its reap, and every submitted URB is
    /// reaped exactly once as what it was.
    #[test]
    fn no_entry_is_freed_before_its_reap_under_random_operations() {
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for _ in 0..200 {
            let mut kernel = Kernel::new();
            let mut table = UrbTable::new();
            // What the kernel holds: key and seqnum, in the order it will give them back.
            let mut outstanding: Vec<UrbKey> = Vec::new();
            let mut reaped = 0;
            for _ in 0..64 {
                match next() % 5 {
                    0 | 1 => outstanding.push(kernel.submit(&mut table, (next() % 4) as u32)),
                    2 => {
                        table.cancel((next() % 4) as u32);
                    }
                    3 => table.abandon_all(|_, _| {}),
                    _ if !outstanding.is_empty() => {
                        let key = outstanding.swap_remove((next() as usize) % outstanding.len());
                        assert!(!matches!(table.reap(key), Reaped::Unknown), "a held URB is always found");
                        reaped += 1;
                    }
                    _ => {}
                }
                assert_eq!(kernel.freed(), reaped, "memory freed only at reap");
                assert_eq!(table.len(), outstanding.len());
            }
        }
    }
}
