//! Imports a remote device and submits URBs given on the command line, one
//! after the other, printing each one's status and data: a probe for tests
//! and scripts that need real traffic through an import (the Python device
//! library's tests use it).
//!
//! ```sh
//! cargo build --release --example urb -p usbwire-client
//! target/release/examples/urb 127.0.0.1:3240 0-1 \
//!     control-out:0009010000000000 out:2:68656c6c6f in:1:512
//! ```
//!
//! Steps: `control-in:SETUP` (8 bytes in hex; the length is its wLength),
//! `control-out:SETUP[:DATA]`, `out:EP:DATA` and `in:EP:LENGTH` (bulk or
//! interrupt, endpoint number 1..15). Prints `STEP status=N data=HEX` a line;
//! exits 1 when a step fails to complete within 10 s or the import fails.

use std::time::Duration;

use anyhow::{bail, Context as _};
use bytes::Bytes;
use usbwire_client::{Connection, Security, Transfer};
use usbwire_proto::op::BusId;

fn hex(text: &str) -> anyhow::Result<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        bail!("odd number of hex digits in {text:?}");
    }
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).with_context(|| format!("not hex: {text:?}")))
        .collect()
}

fn setup(text: &str) -> anyhow::Result<[u8; 8]> {
    hex(text)?.try_into().map_err(|_| anyhow::anyhow!("a SETUP packet is 8 bytes: {text:?}"))
}

fn step(text: &str) -> anyhow::Result<Transfer> {
    let parts: Vec<&str> = text.split(':').collect();
    let endpoint = |at: usize| -> anyhow::Result<u8> {
        let number: u8 = parts.get(at).context("missing endpoint")?.parse().context("endpoint must be 1..15")?;
        anyhow::ensure!((1..=15).contains(&number), "endpoint must be 1..15");
        Ok(number)
    };
    Ok(match (parts[0], parts.len()) {
        ("control-in", 2) => Transfer::control_in(setup(parts[1])?),
        ("control-out", 2) => Transfer::control_out(setup(parts[1])?, Bytes::new()),
        ("control-out", 3) => Transfer::control_out(setup(parts[1])?, hex(parts[2])?.into()),
        ("out", 3) => Transfer::bulk_out(endpoint(1)?, hex(parts[2])?.into()),
        ("in", 3) => Transfer::bulk_in(endpoint(1)?, parts[2].parse().context("length must be a number")?),
        _ => bail!("unknown step {text:?}: control-in:SETUP, control-out:SETUP[:DATA], out:EP:DATA, in:EP:LENGTH"),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        bail!("usage: urb HOST:PORT BUSID STEP...");
    }
    let addr = usbwire_client::resolve(&args[0]).await?;
    let busid = BusId::new(&args[1]).context("bad bus id")?;
    let steps = args[2..].iter().map(|text| step(text)).collect::<anyhow::Result<Vec<_>>>()?;
    let (stream, record) = usbwire_client::import(addr, &busid, &Security::Plain).await?;
    let connection = Connection::new(stream, &record);
    for (text, transfer) in args[2..].iter().zip(steps) {
        let ret = tokio::time::timeout(Duration::from_secs(10), connection.transfer(transfer))
            .await
            .with_context(|| format!("{text}: no completion within 10 s"))??;
        let data: String = ret.data.iter().map(|byte| format!("{byte:02x}")).collect();
        println!("{text} status={} data={data}", ret.status.0);
    }
    connection.close().await;
    Ok(())
}
