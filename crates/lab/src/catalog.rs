//! A server's catalog: its device entries in a few keys, so that a list of
//! the fleet reads a key per [`PER_CHUNK`] devices instead of one per device
//! (etcd's cost of a range grows with its keys: 100 000 device keys took
//! it 2 s of CPU and 63 MB to send). A chunk is the JSON array of its
//! devices' entries, in bus id order (the order of their keys), compressed
//! with zstd. The server writes each chunk before the device keys it holds
//! (`publish`), so a list at a revision and a watch of the device keys from
//! the next one miss nothing. No I/O.
//!
//! Beside the catalog of all its devices, a server keeps one per term of the
//! kinds in [`TERM_KINDS`] (`label/nucleo`, `id/0483:374b`, `class/08`): the
//! entries of its devices with that term, chunked alike, so a filtered list
//! reads only the matching entries; or, where more than half its devices
//! have the term, a marker ([`READ_WHOLE`]) to read the whole catalog and
//! filter it. A server rewrites a catalog's chunks in
//! [`write_order`], so that at no revision between two of its writes is a
//! device that stays missing from every chunk.
//!
//! Not the truth a reservation goes by: that is each device's own key
//! (`take` reads it), which the catalog repeats.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use serde_json::value::RawValue;

use crate::entry::{chunk_key, decode_str, index_terms, DeviceEntry, Keys, Want, SCHEMA_VERSION};

/// Devices in one chunk: a chunk of typical entries is 36 KB of JSON,
/// a few KiB compressed.
pub const PER_CHUNK: usize = 64;

/// The most a chunk may take when decompressed: what a hostile value can
/// make a reader hold (64 entries of 256 KiB, far beyond any device's).
const MAX_CHUNK_BYTES: usize = 16 << 20;

/// zstd's level: fast, and as small as higher levels on these records.
const LEVEL: i32 = 3;

/// The kinds of index term a server keeps a catalog of each term of:
/// labels, VID:PIDs and classes. Not serials: a serial names one device,
/// which the index finds in a read or two. (A reader goes by each server's
/// `catalog_terms`, so kinds can be added without breaking it.)
pub const TERM_KINDS: [&str; 3] = ["label", "id", "class"];

/// What a term catalog that would hold more than half of its server's
/// devices holds instead of chunks: one key, `PREFIX` + this, whose value
/// is this too, telling a reader to read the server's whole catalog and
/// filter it, which costs it less than twice the bytes. On a server of one
/// kind of device each VID:PID and class catalog would otherwise copy the
/// whole catalog, and those copies made a 1 000-server registration storm
/// lose its leases on two vCPUs (BENCHMARKS.md); this way a device is
/// written at most once per kind beyond the whole catalog, and usually not.
pub const READ_WHOLE: &str = "whole";

/// The marker key of the term catalog under `prefix` ([`READ_WHOLE`]).
pub fn read_whole_key(prefix: &str) -> String {
    format!("{prefix}{READ_WHOLE}")
}

/// The term catalogs `device` is in, one prefix each, sorted.
pub fn term_catalogs(keys: &Keys, device: &DeviceEntry) -> Vec<String> {
    let mut prefixes: Vec<String> = index_terms(device)
        .into_iter()
        .filter(|(kind, _)| TERM_KINDS.contains(kind))
        .map(|(kind, value)| keys.term_catalog_of(&device.server, kind, &value))
        .collect();
    prefixes.sort();
    prefixes.dedup();
    prefixes
}

/// The terms of `want` of the kinds servers keep a catalog of each term of
/// ([`TERM_KINDS`]), as (kind, value), in that list's order: where a
/// filtered list can read its matching entries.
pub fn terms_of(want: &Want) -> Vec<(&'static str, String)> {
    let mut terms: Vec<(&'static str, String)> =
        want.index_terms().into_iter().filter(|(kind, _)| TERM_KINDS.contains(kind)).collect();
    terms.sort_by_key(|(kind, _)| TERM_KINDS.iter().position(|k| k == kind));
    terms
}

/// The order to write a catalog's chunks in (their indices: every chunk of
/// `before` or `after`, the bus ids each holds as last written and as it is
/// to be) so that a reader at any revision in between finds every device of
/// both in some chunk. When a device moves to another chunk (one was added
/// or removed before it), the chunk it moves into is written before the one
/// it leaves. Both are in bus id order, so no two devices move against each
/// other and an order always exists; were one missing (`before` not what
/// the catalog holds), the chunks left go in index order.
pub fn write_order<S: AsRef<str>>(before: &[Vec<S>], after: &[Vec<S>]) -> Vec<usize> {
    let count = before.len().max(after.len());
    write_order_if_any(before, after).unwrap_or_else(|| (0..count).collect())
}

/// [`write_order`], or `None` when there is none: `before` is not one
/// catalog in bus id order but chunks of two (a write that failed part way).
/// A device in two chunks of `before` is such a case too, though an order
/// of bus ids may exist: the two may hold different entries of it (one
/// with a label, one without), so each is to be rewritten with its new
/// entry before either lets it go.
fn write_order_if_any<S: AsRef<str>>(before: &[Vec<S>], after: &[Vec<S>]) -> Option<Vec<usize>> {
    let count = before.len().max(after.len());
    let mut was: HashMap<&str, usize> = HashMap::with_capacity(before.iter().map(Vec::len).sum());
    for (n, chunk) in before.iter().enumerate() {
        for busid in chunk {
            if was.insert(busid.as_ref(), n).is_some() {
                return None;
            }
        }
    }
    // (into, from): `into` is written before `from`.
    let mut moves = BTreeSet::new();
    for (into, chunk) in after.iter().enumerate() {
        for busid in chunk {
            match was.get(busid.as_ref()) {
                Some(&from) if from != into => moves.insert((into, from)),
                _ => false,
            };
        }
    }
    let mut waiting = vec![0_usize; count];
    let mut then: Vec<Vec<usize>> = vec![Vec::new(); count];
    for &(into, from) in &moves {
        waiting[from] += 1;
        then[into].push(from);
    }
    let mut ready: BTreeSet<usize> = (0..count).filter(|&n| waiting[n] == 0).collect();
    let mut order = Vec::with_capacity(count);
    while let Some(n) = ready.pop_first() {
        order.push(n);
        for &from in &then[n] {
            waiting[from] -= 1;
            if waiting[from] == 0 {
                ready.insert(from);
            }
        }
    }
    (order.len() == count).then_some(order)
}

/// Each catalog's chunks as last written, by the catalog's prefix: the bus
/// ids each chunk holds.
pub type Layouts = HashMap<String, Vec<Vec<String>>>;

/// What to write (a key's value, or `None` to delete it) so that a server's
/// catalogs, whose keys start with `catalogs_of`, hold `catalogs` (prefix →
/// its devices' bus ids and entries, in bus id order), given what is
/// `published` (key → value) and `layouts`, which it updates: each
/// catalog's changed chunks in [`write_order`], then the chunks no catalog
/// has any more (a term no device has now, a write that failed), whose
/// devices are in other chunks by then. The whole catalog's prefix sorts
/// before every term catalog's, so it is written before a marker that
/// sends readers to it is put, and a term catalog's chunks before its
/// marker goes.
pub fn changes(
    catalogs: &BTreeMap<&str, Vec<(&str, &[u8])>>,
    catalogs_of: &str,
    published: &HashMap<String, Vec<u8>>,
    layouts: &mut Layouts,
) -> Vec<(String, Option<Vec<u8>>)> {
    let mut changes = Vec::new();
    let mut written = HashSet::new();
    let mut now = HashMap::with_capacity(catalogs.len());
    let whole = format!("{catalogs_of}{}/", crate::entry::CATALOG.trim_start_matches('!'));
    let devices = catalogs.get(whole.as_str()).map_or(0, Vec::len);
    for (prefix, entries) in catalogs {
        // A term most devices have: a marker to read the whole catalog, not a copy of most of it.
        if *prefix != whole && entries.len() * 2 > devices {
            let key = read_whole_key(prefix);
            if published.get(&key).map(Vec::as_slice) != Some(READ_WHOLE.as_bytes()) {
                changes.push((key.clone(), Some(READ_WHOLE.as_bytes().to_vec())));
            }
            written.insert(key);
            continue;
        }
        let layout: Vec<Vec<String>> = entries
            .chunks(PER_CHUNK)
            .map(|chunk| chunk.iter().map(|(busid, _)| (*busid).to_owned()).collect())
            .collect();
        let chunks = chunks(entries.iter().map(|(_, entry)| *entry));
        let before = layouts.get(*prefix).map(Vec::as_slice).unwrap_or_default();
        let (order, bridged, settled) = match write_order_if_any(before, &layout) {
            Some(order) => (order, HashSet::new(), HashSet::new()),
            None => bridges(prefix, entries, before, &layout, &mut changes),
        };
        for n in order {
            let key = chunk_key(prefix, n);
            if settled.contains(&n) {
                written.insert(key);
                continue;
            }
            let bridge = bridged.contains(&n);
            match chunks.get(n) {
                Some(chunk) => {
                    if bridge || published.get(&key) != Some(chunk) {
                        changes.push((key.clone(), Some(chunk.clone())));
                    }
                    written.insert(key);
                }
                None if bridge || published.contains_key(&key) => changes.push((key, None)),
                None => {}
            }
        }
        now.insert((*prefix).to_owned(), layout);
    }
    let deleted: HashSet<&String> = changes.iter().filter(|(_, value)| value.is_none()).map(|(key, _)| key).collect();
    let mut stale: Vec<&String> = published
        .keys()
        .filter(|key| key.starts_with(catalogs_of) && !written.contains(*key) && !deleted.contains(key))
        .collect();
    stale.sort();
    let stale: Vec<String> = stale.into_iter().cloned().collect();
    changes.extend(stale.into_iter().map(|key| (key, None)));
    *layouts = now;
    changes
}

/// The layouts of the catalogs whose chunks `pairs` are (key, value), as a
/// reader finds them: what a server that cannot know what its last write
/// did reads back before it writes its catalogs again, so that
/// [`write_order`] goes by what etcd holds.
pub fn layouts_of<'a>(server: &str, pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Layouts {
    let mut layouts = Layouts::new();
    for (key, value) in pairs {
        let Some((prefix, n)) = key.len().checked_sub(6).and_then(|at| Some((key.get(..at)?, key.get(at..)?))) else {
            continue;
        };
        // (No server writes 65 536 chunks, 4 M devices: a key beyond is not its own.)
        let Some(n) = n.parse::<usize>().ok().filter(|n| *n < 1 << 16) else { continue };
        let layout = layouts.entry(prefix.to_owned()).or_default();
        if layout.len() <= n {
            layout.resize(n + 1, Vec::new());
        }
        layout[n] = read_chunk(server, value).into_iter().map(|entry| entry.record.busid).collect();
    }
    layouts
}

/// When no order of writes keeps every device in a chunk (`before` holds
/// chunks of two catalogs after a write that failed part way, or a device
/// in two chunks, maybe as two entries): first each
/// chunk is written as its new devices plus those of its old that stay, so
/// that each staying device is in its old chunk and its new one; then, in
/// any order, each chunk that held more than its new devices is written as
/// it is to be. Pushes the first writes to `changes`; returns the order of
/// the chunks (all), those written as more than they are to be, and those
/// already as they are to be.
fn bridges(
    prefix: &str,
    entries: &[(&str, &[u8])],
    before: &[Vec<String>],
    after: &[Vec<String>],
    changes: &mut Vec<(String, Option<Vec<u8>>)>,
) -> (Vec<usize>, HashSet<usize>, HashSet<usize>) {
    let entry_of: HashMap<&str, &[u8]> = entries.iter().copied().collect();
    let count = before.len().max(after.len());
    let (mut bridged, mut settled) = (HashSet::new(), HashSet::new());
    for n in 0..count {
        let mut busids: BTreeSet<&str> = after.get(n).into_iter().flatten().map(String::as_str).collect();
        let new = busids.len();
        busids.extend(before.get(n).into_iter().flatten().map(String::as_str).filter(|b| entry_of.contains_key(b)));
        if busids.is_empty() {
            continue;
        }
        let both: Vec<&[u8]> = busids.iter().filter_map(|busid| entry_of.get(busid).copied()).collect();
        changes.push((chunk_key(prefix, n), Some(chunk(&both))));
        if busids.len() > new {
            bridged.insert(n);
        } else {
            settled.insert(n);
        }
    }
    ((0..count).collect(), bridged, settled)
}

/// The chunks of a server's device entries (their JSON, in bus id order).
pub fn chunks<'a>(entries: impl IntoIterator<Item = &'a [u8]>) -> Vec<Vec<u8>> {
    let entries: Vec<&[u8]> = entries.into_iter().collect();
    entries.chunks(PER_CHUNK).map(chunk).collect()
}

/// One chunk of `entries`, however many.
fn chunk(entries: &[&[u8]]) -> Vec<u8> {
    let mut json = Vec::with_capacity(entries.iter().map(|entry| entry.len() + 1).sum::<usize>() + 1);
    json.push(b'[');
    for (n, entry) in entries.iter().enumerate() {
        if n > 0 {
            json.push(b',');
        }
        json.extend_from_slice(entry);
    }
    json.push(b']');
    // Compressing a buffer in memory fails only when out of memory;
    // an uncompressed chunk would not be read, so none is better.
    zstd::bulk::compress(&json, LEVEL).unwrap_or_default()
}

/// The entries of a chunk that `server` published: entries that cannot be
/// read, are of a newer schema or name another server are left out; a
/// value that is no chunk gives none.
pub fn read_chunk(server: &str, value: &[u8]) -> Vec<DeviceEntry> {
    let Some(json) = chunk_json(value) else { return Vec::new() };
    // Every entry readable, as nearly every chunk's are: one pass over the text.
    if let Ok(mut entries) = serde_json::from_str::<Vec<DeviceEntry>>(&json) {
        entries.retain(|entry| entry.schema_version <= SCHEMA_VERSION && entry.server == server);
        return entries;
    }
    // Else each entry on its own, so that one that cannot be read spoils no other.
    let Ok(entries) = serde_json::from_str::<Vec<&RawValue>>(&json) else { return Vec::new() };
    entries
        .into_iter()
        .filter_map(|entry| decode_str::<DeviceEntry>(entry.get()))
        .filter(|entry| entry.server == server)
        .collect()
}

thread_local! {
    /// One decompression context a thread: making one a chunk (its tables
    /// allocated and zeroed) was 7 % of a filtered list's CPU on 1 000
    /// servers, whose chunks of one term hold a few entries each.
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// A chunk's text, if it is one zstd frame of UTF-8 of at most
/// [`MAX_CHUNK_BYTES`]: the buffer is the size the frame declares, and a
/// frame that declares more than the budget, or holds more than it
/// declares, is not read.
pub fn chunk_json(value: &[u8]) -> Option<String> {
    let json = DECOMPRESSOR.with(|cell| {
        let mut decompressor = cell.try_borrow_mut().ok()?;
        if decompressor.is_none() {
            *decompressor = zstd::bulk::Decompressor::new().ok();
        }
        decompressor.as_mut()?.decompress(value, MAX_CHUNK_BYTES).ok()
    })?;
    String::from_utf8(json).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::tests::device as device_entry;

    fn json(entry: &DeviceEntry) -> Vec<u8> {
        serde_json::to_vec(entry).unwrap()
    }

    #[test]
    fn a_servers_entries_come_back_from_its_chunks_in_order() {
        let entries: Vec<DeviceEntry> =
            (0..150).map(|n| device_entry("10.0.0.5:3240", &format!("1-{n}"), &["nucleo"])).collect();
        let encoded: Vec<Vec<u8>> = entries.iter().map(json).collect();
        let chunks = chunks(encoded.iter().map(Vec::as_slice));
        assert_eq!(chunks.len(), 3, "64 + 64 + 22");
        let read: Vec<DeviceEntry> = chunks.iter().flat_map(|chunk| read_chunk("10.0.0.5:3240", chunk)).collect();
        assert_eq!(read, entries);
        let raw: usize = encoded.iter().map(Vec::len).sum();
        let compressed: usize = chunks.iter().map(Vec::len).sum();
        assert!(compressed * 5 < raw, "{raw} bytes of entries took {compressed} compressed");
        assert!(super::chunks(std::iter::empty()).is_empty());
    }

    #[test]
    fn entries_of_another_server_a_newer_schema_or_no_chunk_at_all_are_left_out() {
        let mine = device_entry("10.0.0.5:3240", "1-1", &[]);
        let planted = device_entry("10.0.0.6:3240", "1-2", &[]);
        let mut newer = json(&device_entry("10.0.0.5:3240", "1-3", &[]));
        newer = String::from_utf8(newer).unwrap().replace("\"schema_version\":1", "\"schema_version\":2").into_bytes();
        let mistyped = String::from_utf8(json(&device_entry("10.0.0.5:3240", "1-4", &[])))
            .unwrap()
            .replace("\"labels\":[]", "\"labels\":5")
            .into_bytes();
        let also_mine = device_entry("10.0.0.5:3240", "1-5", &["x"]);
        let entries = [json(&mine), json(&planted), newer, mistyped, json(&also_mine), b"{\"busid\":".to_vec()];
        let chunk = chunks(entries.iter().map(Vec::as_slice)).remove(0);
        assert_eq!(read_chunk("10.0.0.5:3240", &chunk), [], "JSON that is not JSON spoils the array");
        let chunk = chunks(entries[..5].iter().map(Vec::as_slice)).remove(0);
        assert_eq!(
            read_chunk("10.0.0.5:3240", &chunk),
            [mine.clone(), also_mine.clone()],
            "a mistyped entry spoils no other"
        );
        let chunk = chunks([json(&mine), json(&planted), json(&also_mine)].iter().map(Vec::as_slice)).remove(0);
        assert_eq!(read_chunk("10.0.0.5:3240", &chunk), [mine, also_mine], "every entry readable: one pass");
        assert_eq!(read_chunk("10.0.0.5:3240", b"[]"), [], "not compressed");
        assert_eq!(read_chunk("10.0.0.5:3240", &[0x28, 0xb5, 0x2f, 0xfd, 0, 0]), []);
    }

    /// Writes `after` over `before` a chunk at a time in [`write_order`],
    /// checking after each write that every device of both is in a chunk.
    fn rewrite(before: &[u16], after: &[u16], per_chunk: usize) -> Result<(), String> {
        let layout = |busids: &[u16]| -> Vec<Vec<String>> {
            busids.chunks(per_chunk).map(|chunk| chunk.iter().map(|b| format!("1-{b}")).collect()).collect()
        };
        let (old, new) = (layout(before), layout(after));
        let order = write_order(&old, &new);
        let mut sorted = order.clone();
        sorted.sort();
        if sorted != (0..old.len().max(new.len())).collect::<Vec<_>>() {
            return Err(format!("{order:?} is not every chunk once"));
        }
        let staying: Vec<String> = before.iter().filter(|b| after.contains(b)).map(|b| format!("1-{b}")).collect();
        let mut held: Vec<Vec<String>> = old.clone();
        held.resize(order.len(), Vec::new());
        for n in order.iter().copied() {
            held[n] = new.get(n).cloned().unwrap_or_default();
            for busid in &staying {
                if !held.iter().any(|chunk| chunk.contains(busid)) {
                    return Err(format!("{busid} is in no chunk after writing chunk {n} of {order:?}"));
                }
            }
        }
        if held.iter().flatten().collect::<Vec<_>>() != new.iter().flatten().collect::<Vec<_>>() {
            return Err("the chunks written are not the new catalog".into());
        }
        Ok(())
    }

    #[test]
    fn a_device_moved_to_the_next_chunk_is_written_there_before_it_leaves() {
        // One device in front: every chunk's last moves on to the next.
        let before: Vec<u16> = (10..200).collect();
        let mut after = before.clone();
        after.insert(0, 1);
        assert_eq!(write_order(&[vec!["a", "b"], vec!["c"]], &[vec!["0", "a"], vec!["b", "c"]]), [1, 0]);
        rewrite(&before, &after, 64).unwrap();
        // One device gone from the front: every chunk's first moves back.
        rewrite(&after, &before, 64).unwrap();
        assert_eq!(write_order(&[vec!["a", "b"], vec!["c"]], &[vec!["b", "c"]]), [0, 1]);
    }

    #[test]
    fn only_changed_chunks_are_written_and_a_catalog_no_device_is_in_goes_last() {
        let busids: Vec<String> = (10..80).map(|n| format!("1-{n}")).collect();
        let jsons: Vec<Vec<u8>> = busids.iter().map(|busid| json(&device_entry("10.0.0.5:3240", busid, &[]))).collect();
        let all: Vec<(&str, &[u8])> = busids.iter().zip(&jsons).map(|(b, j)| (b.as_str(), j.as_slice())).collect();
        let catalogs = BTreeMap::from([("p/!catalog/", all.clone()), ("p/!term/label/x/", all[..3].to_vec())]);
        let (mut published, mut layouts) = (HashMap::new(), Layouts::new());
        let first = changes(&catalogs, "p/!", &published, &mut layouts);
        let keys: Vec<&str> = first.iter().map(|(key, _)| key.as_str()).collect();
        assert_eq!(keys, ["p/!catalog/000000", "p/!catalog/000001", "p/!term/label/x/000000"]);
        published.extend(first.into_iter().map(|(key, value)| (key, value.unwrap())));
        assert_eq!(changes(&catalogs, "p/!", &published, &mut layouts), [], "nothing changed");
        // A device in front (every chunk's last moves on), and no device has the label now.
        let front = json(&device_entry("10.0.0.5:3240", "1-0", &[]));
        let mut more = vec![("1-0", front.as_slice())];
        more.extend(all.iter().copied());
        let second = changes(&BTreeMap::from([("p/!catalog/", more)]), "p/!", &published, &mut layouts);
        let keys: Vec<(&str, bool)> = second.iter().map(|(key, value)| (key.as_str(), value.is_some())).collect();
        assert_eq!(keys, [("p/!catalog/000001", true), ("p/!catalog/000000", true), ("p/!term/label/x/000000", false)]);
    }

    /// The catalog of `named` (bus id, entry, labelled `t`) devices, and
    /// the term catalog of label `t` if any device has it.
    fn catalog(named: &[(String, Vec<u8>, bool)]) -> BTreeMap<&'static str, Vec<(&str, &[u8])>> {
        let all = named.iter().map(|(b, j, _)| (b.as_str(), j.as_slice())).collect();
        let labelled: Vec<(&str, &[u8])> =
            named.iter().filter(|(.., t)| *t).map(|(b, j, _)| (b.as_str(), j.as_slice())).collect();
        let mut catalogs = BTreeMap::from([("p/!catalog/", all)]);
        if !labelled.is_empty() {
            catalogs.insert("p/!term/label/t/", labelled);
        }
        catalogs
    }

    /// The bus ids in the whole catalog's chunks `held`.
    fn devices_in(held: &HashMap<String, Vec<u8>>) -> Vec<String> {
        let whole = held.iter().filter(|(key, _)| key.starts_with("p/!catalog/"));
        let mut busids: Vec<String> =
            whole.flat_map(|(_, value)| read_chunk("10.0.0.5:3240", value)).map(|d| d.record.busid).collect();
        busids.sort();
        busids
    }

    /// The bus ids a filtered list of `label=t` finds in `held`, as
    /// `matching` reads it: the term catalog's chunks, and the whole
    /// catalog's devices labelled `t` if the term catalog is a marker.
    fn labelled_in(held: &HashMap<String, Vec<u8>>) -> Vec<String> {
        let marker = held.contains_key(&read_whole_key("p/!term/label/t/"));
        let read = held
            .iter()
            .filter(|(key, _)| key.starts_with("p/!term/label/t/") || (marker && key.starts_with("p/!catalog/")));
        let entries = read.flat_map(|(_, value)| read_chunk("10.0.0.5:3240", value));
        let mut busids: Vec<String> =
            entries.filter(|d| d.labels.iter().any(|l| l == "t")).map(|d| d.record.busid).collect();
        busids.sort();
        busids.dedup();
        busids
    }

    /// Writes catalog `a`, then `b` of which only the first `landed` changes
    /// land and the next one fails, landed or not (`next_landed`): what a
    /// server cannot know, so it reads its chunks back (`layouts_of`) before
    /// it writes `c` a change at a time. Each device (a number) is labelled
    /// `t` or not, so the label's catalog is chunks, a marker or none. After
    /// each of `c`'s changes every device held before that `c` keeps must be
    /// in some chunk, and a filtered list of `label=t` must find every
    /// device it found before that `c` keeps labelled; in the end the chunks
    /// must hold `c`, each device once. Without the read back (`read_back`
    /// false) the layouts are those `b` meant to write.
    fn rewrite_after_unknown(
        [a, b, c]: [&[(u16, bool)]; 3],
        landed: usize,
        next_landed: bool,
        read_back: bool,
    ) -> Result<(), String> {
        let named = |devices: &[(u16, bool)]| -> Vec<(String, Vec<u8>, bool)> {
            let named = devices.iter().map(|(n, t)| (format!("1-{n:03}"), *t));
            named
                .map(|(busid, t)| {
                    let entry = device_entry("10.0.0.5:3240", &busid, if t { &["t"] } else { &[] });
                    (busid, json(&entry), t)
                })
                .collect()
        };
        let (a, b, c) = (named(a), named(b), named(c));
        let mut held: HashMap<String, Vec<u8>> = HashMap::new();
        let mut layouts = Layouts::new();
        let apply = |held: &mut HashMap<String, Vec<u8>>, (key, value): &(String, Option<Vec<u8>>)| match value {
            Some(value) => held.insert(key.clone(), value.clone()),
            None => held.remove(key),
        };
        for change in &changes(&catalog(&a), "p/!", &held.clone(), &mut layouts) {
            apply(&mut held, change);
        }
        let mut published = held.clone();
        for (n, change) in changes(&catalog(&b), "p/!", &published.clone(), &mut layouts).iter().enumerate() {
            if n < landed || (n == landed && next_landed) {
                apply(&mut held, change);
            }
            if n < landed {
                apply(&mut published, change);
            }
        }
        if read_back {
            published = held.clone();
            layouts = layouts_of("10.0.0.5:3240", held.iter().map(|(k, v)| (k.as_str(), v.as_slice())));
        }
        let wanted: Vec<String> = c.iter().map(|(busid, ..)| busid.clone()).collect();
        let labelled: Vec<String> = c.iter().filter(|(.., t)| *t).map(|(busid, ..)| busid.clone()).collect();
        let staying: Vec<String> = devices_in(&held).into_iter().filter(|busid| wanted.contains(busid)).collect();
        let staying_labelled: Vec<String> =
            labelled_in(&held).into_iter().filter(|busid| labelled.contains(busid)).collect();
        let third = changes(&catalog(&c), "p/!", &published, &mut layouts);
        let writes = || third.iter().map(|c| &c.0).collect::<Vec<_>>();
        for change in &third {
            apply(&mut held, change);
            let now = devices_in(&held);
            if let Some(lost) = staying.iter().find(|busid| !now.contains(*busid)) {
                return Err(format!("{lost} is in no chunk after {} of {:?}", change.0, writes()));
            }
            let now = labelled_in(&held);
            if let Some(lost) = staying_labelled.iter().find(|busid| !now.contains(*busid)) {
                return Err(format!("label=t does not find {lost} after {} of {:?}", change.0, writes()));
            }
        }
        if devices_in(&held) != wanted {
            return Err(format!("the chunks hold {:?}, not the last catalog", devices_in(&held)));
        }
        if labelled_in(&held) != labelled {
            return Err(format!("label=t finds {:?}, not the last catalog's {labelled:?}", labelled_in(&held)));
        }
        let marker = held.contains_key(&read_whole_key("p/!term/label/t/"));
        if marker != (labelled.len() * 2 > wanted.len()) {
            return Err(format!("a marker ({marker}) for {} labelled of {}", labelled.len(), wanted.len()));
        }
        Ok(())
    }

    /// What the property test below found: a write of two chunks failed
    /// after the first landed, leaving 365 in both, and the next catalog
    /// moves devices both ways between them, so no order of writes keeps
    /// every device (the chunks are bridged), and going by the layouts the
    /// failed write meant loses one.
    #[test]
    fn a_server_unsure_of_its_last_write_goes_by_what_etcd_holds() {
        let a: Vec<u16> = vec![211, 365];
        let b: Vec<u16> =
            (0..=70).filter(|n| ![5, 6, 11, 23, 43, 49, 50, 51, 52].contains(n)).chain([73, 76, 99, 365]).collect();
        let c: Vec<u16> = vec![
            0, 2, 3, 4, 8, 9, 12, 14, 15, 20, 21, 22, 25, 29, 30, 36, 40, 51, 57, 58, 60, 61, 67, 69, 70, 73, 74, 76,
            77, 81, 82, 83, 90, 92, 93, 98, 99, 105, 106, 107, 108, 112, 114, 120, 121, 139, 142, 145, 146, 147, 148,
            149, 151, 153, 154, 155, 163, 164, 166, 171, 174, 178, 179, 182, 183, 186, 189, 190, 194, 195, 198, 202,
            203, 204, 206, 207, 208, 210, 211, 212, 215, 219, 222, 226, 228, 229, 232, 233, 234, 235, 236, 242, 245,
            248, 251, 253, 258, 260, 262, 270, 274, 275, 278, 281, 286, 288, 290, 294, 295, 296, 297, 308, 316, 317,
            318, 322, 323, 326, 329, 332, 336, 341, 348, 352, 358, 359, 361, 362, 365, 368, 371, 378, 380, 392,
        ];
        assert_eq!(b.len(), 66);
        let [a, b, c] = [a, b, c].map(|set| set.into_iter().map(|n| (n, false)).collect::<Vec<_>>());
        // The first of `b`'s two writes (chunk 1, which 365 moves into) landed;
        // the second (chunk 0, which 365 leaves) failed and did not land.
        assert!(rewrite_after_unknown([&a, &b, &c], 1, false, false).is_err(), "the case needs the read back");
        rewrite_after_unknown([&a, &b, &c], 1, false, true).unwrap();
    }

    /// What the property test below found next: a device labelled `t` in
    /// one chunk (a marker sending `label=t` to the whole catalog) that a
    /// failed write left in a second chunk too, as an entry without the
    /// label. Going by bus ids alone, the chunk with the labelled entry was
    /// rewritten first, and `label=t` did not find the device until the
    /// label's own catalog was written: two chunks holding a device are
    /// bridged, so each is rewritten with its new entry first.
    #[test]
    fn a_device_a_failed_write_left_in_two_chunks_is_found_by_its_label_throughout() {
        let a = [(349, true)];
        let b: Vec<(u16, bool)> = (0..64).chain([349]).map(|n| (n, false)).collect();
        let c: Vec<(u16, bool)> = (0..69).map(|n| (n, false)).chain([(349, true)]).collect();
        // `b` moved 349 into chunk 1 (that write landed) and failed to take it out of chunk 0.
        rewrite_after_unknown([&a, &b, &c], 1, false, true).unwrap();
    }

    proptest::proptest! {
        #[test]
        fn no_device_is_lost_after_a_catalog_write_whose_outcome_is_not_known(
            a in proptest::collection::btree_map(0_u16..400, proptest::bool::weighted(0.5), 0..300),
            b in proptest::collection::btree_map(0_u16..400, proptest::bool::weighted(0.5), 0..300),
            c in proptest::collection::btree_map(0_u16..400, proptest::bool::weighted(0.5), 0..300),
            landed in 0_usize..8,
            next_landed: bool,
        ) {
            let [a, b, c] = [a, b, c].map(|map| map.into_iter().collect::<Vec<(u16, bool)>>());
            if let Err(error) = rewrite_after_unknown([&a, &b, &c], landed, next_landed, true) {
                proptest::prop_assert!(false, "{}", error);
            }
        }

        #[test]
        fn no_device_of_both_catalogs_is_ever_in_no_chunk(
            before in proptest::collection::btree_set(0_u16..400, 0..200),
            after in proptest::collection::btree_set(0_u16..400, 0..200),
            per_chunk in 1_usize..9,
        ) {
            let (before, after): (Vec<u16>, Vec<u16>) = (before.into_iter().collect(), after.into_iter().collect());
            if let Err(error) = rewrite(&before, &after, per_chunk) {
                proptest::prop_assert!(false, "{}", error);
            }
        }
    }

    proptest::proptest! {
        /// A chunk reads as its entries read one by one: those of its
        /// server, of a schema this reader knows, that can be read at all.
        #[test]
        fn a_chunk_reads_as_its_entries_read_one_by_one(
            entries in proptest::collection::vec((0_u8..2, 0_u32..3, 0_u8..4), 0..80),
        ) {
            let encoded: Vec<Vec<u8>> = entries
                .iter()
                .enumerate()
                .map(|(n, &(server, version, how))| {
                    let mut entry = device_entry(&format!("10.0.0.{server}:3240"), &format!("1-{n}"), &["x"]);
                    entry.schema_version = version;
                    let text = String::from_utf8(json(&entry)).unwrap();
                    match how {
                        0 => text.replace("\"labels\":[\"x\"]", "\"labels\":\"x\""),
                        1 => text.replace("\"server\"", "\"\\u0073erver\""),
                        _ => text,
                    }
                    .into_bytes()
                })
                .collect();
            let one_by_one: Vec<DeviceEntry> = encoded
                .iter()
                .filter_map(|entry| decode_str::<DeviceEntry>(std::str::from_utf8(entry).unwrap()))
                .filter(|entry| entry.server == "10.0.0.0:3240")
                .collect();
            let expected = entries.iter().filter(|&&(server, version, how)| server == 0 && version <= SCHEMA_VERSION && how != 0).count();
            proptest::prop_assert_eq!(one_by_one.len(), expected);
            let read: Vec<DeviceEntry> = chunks(encoded.iter().map(Vec::as_slice))
                .iter()
                .flat_map(|chunk| read_chunk("10.0.0.0:3240", chunk))
                .collect();
            proptest::prop_assert_eq!(read, one_by_one);
        }
    }

    #[test]
    fn a_chunk_that_inflates_beyond_its_budget_is_not_read() {
        let bomb = zstd::bulk::compress(&vec![b' '; MAX_CHUNK_BYTES + 1], LEVEL).unwrap();
        assert!(bomb.len() < 4096, "{} bytes", bomb.len());
        assert_eq!(read_chunk("10.0.0.5:3240", &bomb), []);
        // A frame that does not say its size is read within the budget; one
        // that holds more than it says (a second frame after it) is not.
        let entry = json(&device_entry("10.0.0.5:3240", "1-1", &[]));
        let array = [b"[".as_slice(), &entry, b"]"].concat();
        let unsized_frame = zstd::stream::encode_all(std::io::Cursor::new(&array), LEVEL).unwrap();
        assert_eq!(read_chunk("10.0.0.5:3240", &unsized_frame).len(), 1);
        let sized = zstd::bulk::compress(&array, LEVEL).unwrap();
        assert_eq!(read_chunk("10.0.0.5:3240", &sized).len(), 1);
        let unsized_bomb =
            zstd::stream::encode_all(std::io::Cursor::new(vec![b' '; MAX_CHUNK_BYTES + 1]), LEVEL).unwrap();
        assert_eq!(read_chunk("10.0.0.5:3240", &unsized_bomb), []);
        assert_eq!(read_chunk("10.0.0.5:3240", &[sized.clone(), sized].concat()), []);
    }
}
