//! How fast the relay behind `usbwire attach` moves bulk URBs, without a
//! kernel: a thread stands in for vhci-hcd on one end of a socket pair
//! (CMD_SUBMITs in, RET_SUBMITs out, `depth` in flight), and the relay carries
//! them to a usbwire server exporting the loopback device, over TLS with the
//! identity in `DIR`. The relay runs as `attach` runs it: the future
//! `block_on` drives, on a single-threaded runtime or (`multi`) on the main
//! thread of a multi-threaded one.
//!
//! ```text
//! cargo run --release -p usbwire-client --example kernel_relay_speed -- \
//!     ADDR current|multi DIR SIZE in|out SECONDS
//! ```
//!
//! Not a product surface: BENCHMARKS.md ("The attach relay on one thread")
//! says what it measured and why.

use std::error::Error;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use usbwire_client::relay::Upstream;
use usbwire_client::{Security, TlsClient};
use usbwire_gadgets::loopback::{SINK_OUT, SOURCE_IN};
use usbwire_proto::op::BusId;
use usbwire_proto::urb::CmdSubmit;
use usbwire_proto::Direction;
use usbwire_transport::known_servers::KnownServers;
use usbwire_transport::Identity;

const DEPTH: u32 = 8;
const SET_CONFIGURATION_1: [u8; 8] = [0, 9, 1, 0, 0, 0, 0, 0];

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, flavor, dir, size, direction, seconds] = args.as_slice() else {
        return Err("usage: ADDR current|multi DIR SIZE in|out SECONDS".into());
    };
    let addr = addr.parse()?;
    let runtime = match flavor.as_str() {
        "multi" => tokio::runtime::Builder::new_multi_thread(),
        "current" => tokio::runtime::Builder::new_current_thread(),
        _ => return Err(format!("{flavor}: current or multi").into()),
    }
    .enable_all()
    .build()?;
    let dir = std::path::PathBuf::from(dir);
    let (size, seconds): (u32, f64) = (size.parse()?, seconds.parse()?);
    let direction = if direction == "in" { Direction::In } else { Direction::Out };

    let (kernel, relay_end) = UnixStream::pair()?;
    let (devid, relay) = runtime.block_on(async {
        let identity = Identity::load(&dir)?;
        let known = KnownServers::in_dir(&dir.join("known"));
        let security = Security::Tls(Arc::new(TlsClient { identity, known, trust_new: true, pinned: None }));
        let busid = BusId::new("0-1").ok_or("bus id")?;
        let (stream, record) = usbwire_client::import(addr, &busid, &security).await?;
        let devid = record.devid();
        let upstream = Upstream {
            addr,
            security,
            transforms: vec![],
            resume: None,
            give_up_after: Duration::from_secs(5),
            storage: false,
            descriptors: None,
        };
        relay_end.set_nonblocking(true)?;
        let relay_end = tokio::net::UnixStream::from_std(relay_end)?;
        Ok::<_, Box<dyn Error>>((
            devid,
            usbwire_client::kernel_relay::run(relay_end, stream, devid, upstream, None, None),
        ))
    })?;
    let host = std::thread::spawn(move || vhci_stand_in(kernel, devid, direction, size, seconds));
    runtime.block_on(relay)?;
    let rate = host.join().map_err(|_| "the stand-in panicked")??;
    println!("{flavor} {direction:?} {size} {rate:.0} MiB/s");
    Ok(())
}

/// Keeps `DEPTH` bulk URBs of `size` bytes in flight for `seconds`; MiB/s completed.
fn vhci_stand_in(
    mut kernel: UnixStream,
    devid: u32,
    direction: Direction,
    size: u32,
    seconds: f64,
) -> Result<f64, String> {
    let fail = |error: std::io::Error| error.to_string();
    let mut data = Vec::new();
    kernel.write_all(&submit(1, devid, 0, Direction::Out, 0, SET_CONFIGURATION_1, Bytes::new())).map_err(fail)?;
    reply(&mut kernel, Direction::Out, &mut data)?;
    let (endpoint, payload) = match direction {
        Direction::In => (SOURCE_IN & 0x0f, Bytes::new()),
        Direction::Out => (SINK_OUT, Bytes::from(vec![0x5a; size as usize])),
    };
    for seqnum in 2..2 + DEPTH {
        kernel.write_all(&submit(seqnum, devid, endpoint, direction, size, [0; 8], payload.clone())).map_err(fail)?;
    }
    let (started, mut moved, mut seqnum) = (Instant::now(), 0usize, 2 + DEPTH);
    while started.elapsed().as_secs_f64() < seconds {
        moved += reply(&mut kernel, direction, &mut data)?;
        kernel.write_all(&submit(seqnum, devid, endpoint, direction, size, [0; 8], payload.clone())).map_err(fail)?;
        seqnum += 1;
    }
    Ok(moved as f64 / started.elapsed().as_secs_f64() / f64::from(1 << 20))
}

fn submit(seqnum: u32, devid: u32, ep: u8, direction: Direction, length: u32, setup: [u8; 8], data: Bytes) -> BytesMut {
    let mut wire = BytesMut::new();
    CmdSubmit::new(seqnum, devid, direction, ep, length, setup, data).encode(&mut wire);
    wire
}

/// Reads one RET_SUBMIT (and an IN's data); its actual length.
fn reply(kernel: &mut UnixStream, direction: Direction, data: &mut Vec<u8>) -> Result<usize, String> {
    let mut header = [0u8; 48];
    kernel.read_exact(&mut header).map_err(|error| error.to_string())?;
    let field = |at: usize| i32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]]);
    if field(0x14) != 0 {
        return Err(format!("URB ended with status {}", field(0x14)));
    }
    let actual = usize::try_from(field(0x18)).map_err(|_| "negative actual length")?;
    if direction == Direction::In {
        data.resize(actual, 0);
        kernel.read_exact(data).map_err(|error| error.to_string())?;
    }
    Ok(actual)
}
