//! Reads sectors of a USB mass-storage device through USB/IP, from userspace:
//! import, configure, then Bulk-Only Transport + SCSI READ(10). The sectors go
//! to stdout as raw bytes.
//!
//! ```sh
//! cargo run --example read_sectors -- 127.0.0.1:3240 2-1 0 8 > first-4k.bin
//! ```

use bytes::Bytes;
use usbwire_client::{Connection, Security, Transfer};
use usbwire_device::descriptor::ConfigurationInfo;
use usbwire_proto::op::BusId;

const SECTOR: u32 = 512;

fn cbw(tag: u32, length: u32, data_in: bool, cdb: &[u8]) -> Bytes {
    let mut raw = vec![0u8; 31];
    raw[0..4].copy_from_slice(&0x4342_5355u32.to_le_bytes());
    raw[4..8].copy_from_slice(&tag.to_le_bytes());
    raw[8..12].copy_from_slice(&length.to_le_bytes());
    raw[12] = if data_in { 0x80 } else { 0 };
    raw[14] = cdb.len() as u8;
    raw[15..15 + cdb.len()].copy_from_slice(cdb);
    raw.into()
}

/// One SCSI command with an IN data phase; returns (data, CSW status).
async fn command_in(
    conn: &Connection,
    ep_in: u8,
    ep_out: u8,
    tag: u32,
    cdb: &[u8],
    length: u32,
) -> anyhow::Result<(Bytes, u8)> {
    conn.transfer(Transfer::bulk_out(ep_out, cbw(tag, length, true, cdb))).await?;
    let data = if length > 0 { conn.transfer(Transfer::bulk_in(ep_in, length)).await?.data } else { Bytes::new() };
    let csw = conn.transfer(Transfer::bulk_in(ep_in, 13)).await?;
    anyhow::ensure!(csw.data.len() == 13, "short CSW ({} bytes, status {})", csw.data.len(), csw.status);
    Ok((data, csw.data[12]))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(args.len() == 5, "usage: read_sectors HOST:PORT BUSID LBA COUNT");
    let addr = usbwire_client::resolve(&args[1]).await?;
    let busid = BusId::new(&args[2]).ok_or_else(|| anyhow::anyhow!("bad bus id"))?;
    let lba: u32 = args[3].parse()?;
    let count: u16 = args[4].parse()?;

    let (stream, record) = usbwire_client::import(addr, &busid, &Security::Plain).await?;
    let conn = Connection::new(stream, &record);
    let header = conn.transfer(Transfer::control_in([0x80, 6, 0, 2, 0, 0, 9, 0])).await?;
    anyhow::ensure!(header.data.len() == 9, "no configuration descriptor");
    let total = u16::from_le_bytes([header.data[2], header.data[3]]);
    let [lo, hi] = total.to_le_bytes();
    let config = conn.transfer(Transfer::control_in([0x80, 6, 0, 2, 0, 0, lo, hi])).await?;
    let info = ConfigurationInfo::parse(&config.data).ok_or_else(|| anyhow::anyhow!("bad configuration descriptor"))?;
    let storage = info
        .interfaces
        .iter()
        .find(|i| i.is_bulk_only_storage())
        .ok_or_else(|| anyhow::anyhow!("not a Bulk-Only mass-storage device"))?;
    let (ep_in, ep_out) = (
        storage.bulk_endpoint(true).ok_or_else(|| anyhow::anyhow!("no bulk IN"))?,
        storage.bulk_endpoint(false).ok_or_else(|| anyhow::anyhow!("no bulk OUT"))?,
    );
    let set = conn.transfer(Transfer::control_out([0, 9, info.value, 0, 0, 0, 0, 0], Bytes::new())).await?;
    anyhow::ensure!(set.status.is_ok(), "SET_CONFIGURATION failed: {}", set.status);

    let [l0, l1, l2, l3] = lba.to_be_bytes();
    let [c0, c1] = count.to_be_bytes();
    let length = u32::from(count) * SECTOR;
    // A fresh device reports UNIT ATTENTION once; read the sense and retry.
    for attempt in 1..=4u32 {
        let (data, status) =
            command_in(&conn, ep_in, ep_out, attempt, &[0x28, 0, l0, l1, l2, l3, 0, c0, c1, 0], length).await?;
        if status == 0 {
            use std::io::Write as _;
            std::io::stdout().write_all(&data)?;
            return Ok(());
        }
        let (sense, _) = command_in(&conn, ep_in, ep_out, 100 + attempt, &[0x03, 0, 0, 0, 18, 0], 18).await?;
        eprintln!(
            "READ(10) failed (sense key {:#x}, asc {:#x}); retrying",
            sense.get(2).copied().unwrap_or(0) & 0xf,
            sense.get(12).copied().unwrap_or(0)
        );
    }
    anyhow::bail!("READ(10) kept failing")
}
