//! A server's catalog: its device entries in a few keys, so that a list of
//! the fleet reads a key per [`PER_CHUNK`] devices instead of one per device
//! (etcd's cost of a range grows with its keys: 100 000 device keys took
//! it 2 s of CPU and 63 MB to send). A chunk is the JSON array of its
//! devices' entries, in bus id order (the order of their keys), compressed
//! with zstd. The server writes each chunk before the device keys it holds
//! (`publish`), so a list at a revision and a watch of the device keys from
//! the next one miss nothing. No I/O.
//!
//! Not the truth a reservation goes by: that is each device's own key
//! (`take` reads it), which the catalog repeats.

use serde_json::value::RawValue;

use crate::entry::{decode_str, DeviceEntry};

/// Devices in one chunk: a chunk of typical entries is 36 KB of JSON,
/// a few KiB compressed.
pub const PER_CHUNK: usize = 64;

/// The most a chunk may take when decompressed: what a hostile value can
/// make a reader hold (64 entries of 256 KiB, far beyond any device's).
const MAX_CHUNK_BYTES: usize = 16 << 20;

/// zstd's level: fast, and as small as higher levels on these records.
const LEVEL: i32 = 3;

/// The chunks of a server's device entries (their JSON, in bus id order).
pub fn chunks<'a>(entries: impl IntoIterator<Item = &'a [u8]>) -> Vec<Vec<u8>> {
    let entries: Vec<&[u8]> = entries.into_iter().collect();
    entries
        .chunks(PER_CHUNK)
        .map(|chunk| {
            let mut json = Vec::with_capacity(chunk.iter().map(|entry| entry.len() + 1).sum::<usize>() + 1);
            json.push(b'[');
            for (n, entry) in chunk.iter().enumerate() {
                if n > 0 {
                    json.push(b',');
                }
                json.extend_from_slice(entry);
            }
            json.push(b']');
            // Compressing a buffer in memory fails only when out of memory;
            // an uncompressed chunk would not be read, so none is better.
            zstd::bulk::compress(&json, LEVEL).unwrap_or_default()
        })
        .collect()
}

/// The entries of a chunk that `server` published: entries that cannot be
/// read, are of a newer schema or name another server are left out; a
/// value that is no chunk gives none.
pub fn read_chunk(server: &str, value: &[u8]) -> Vec<DeviceEntry> {
    let Some(json) = chunk_json(value) else { return Vec::new() };
    let Ok(entries) = serde_json::from_str::<Vec<&RawValue>>(&json) else { return Vec::new() };
    entries
        .into_iter()
        .filter_map(|entry| decode_str::<DeviceEntry>(entry.get()))
        .filter(|entry| entry.server == server)
        .collect()
}

/// A chunk's text, if it is a zstd stream of UTF-8 of at most
/// [`MAX_CHUNK_BYTES`] (the buffer grows as the stream does, not to the
/// budget at once).
pub fn chunk_json(value: &[u8]) -> Option<String> {
    use std::io::Read;
    let decoder = zstd::stream::read::Decoder::with_buffer(value).ok()?;
    let mut json = Vec::new();
    decoder.take(MAX_CHUNK_BYTES as u64 + 1).read_to_end(&mut json).ok()?;
    if json.len() > MAX_CHUNK_BYTES {
        return None;
    }
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
        let entries = [json(&mine), json(&planted), newer, b"{\"busid\":".to_vec()];
        let chunk = chunks(entries.iter().map(Vec::as_slice)).remove(0);
        assert_eq!(read_chunk("10.0.0.5:3240", &chunk), [], "an unreadable entry spoils the array");
        let chunk = chunks(entries[..3].iter().map(Vec::as_slice)).remove(0);
        assert_eq!(read_chunk("10.0.0.5:3240", &chunk), [mine]);
        assert_eq!(read_chunk("10.0.0.5:3240", b"[]"), [], "not compressed");
        assert_eq!(read_chunk("10.0.0.5:3240", &[0x28, 0xb5, 0x2f, 0xfd, 0, 0]), []);
    }

    #[test]
    fn a_chunk_that_inflates_beyond_its_budget_is_not_read() {
        let bomb = zstd::bulk::compress(&vec![b' '; MAX_CHUNK_BYTES + 1], LEVEL).unwrap();
        assert!(bomb.len() < 4096, "{} bytes", bomb.len());
        assert_eq!(read_chunk("10.0.0.5:3240", &bomb), []);
    }
}
