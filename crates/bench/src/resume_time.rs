//! Resume time: how long an application's URBs stall when the link drops.
//!
//! A resumable [`Connection`] keeps URBs in flight on the device's bulk
//! source and sink through a [`Proxy`]; at random moments the proxy cuts
//! every connection. For each cut the stall is the time from the cut to the
//! first URB completing after the relay has resumed — detection, reconnect,
//! the resume handshake and the replay, as the application sees them.
//!
//! Why not simply the first completion after the cut: replies already past
//! the proxy (in the relay's socket buffer, the in-process pipe, the
//! connection's reader) still complete a few microseconds after it, and
//! would hide the stall. So a completion counts only once the relay reports
//! [`RelayState::Connected`] again after the cut.

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde::Serialize;
use usbwire_client::relay::RelayState;
use usbwire_client::{Connection, Transfer};

use crate::measure::Endpoints;
use crate::proxy::Proxy;
use crate::Percentiles;

/// Traffic between cuts, drawn uniformly: the cut lands at a random point of the stream.
const BETWEEN_CUTS_MS: std::ops::RangeInclusive<u64> = 20..=120;
/// A cut not followed by a completion within this long is reported as an error.
const STALL_LIMIT: Duration = Duration::from_secs(30);

/// What [`measure`] found, in microseconds like every [`Percentiles`] here.
#[derive(Clone, Debug, Serialize)]
pub struct ResumeTimes {
    pub cuts: usize,
    /// Cut → the first URB completing after the resume: the stall an application sees.
    pub stall_us: Percentiles,
    /// Cut → the relay connected again (the resume handshake done; the replay follows).
    pub resumed_us: Percentiles,
    /// URBs completed over the whole run.
    pub urbs: u64,
}

/// Streams `size`-byte URBs, `depth` in flight on each endpoint of
/// `endpoints`, through `conn` (imported resumably through `proxy`), and cuts
/// the link `cuts` times at random moments.
pub async fn measure(
    conn: &Connection,
    proxy: &Proxy,
    endpoints: Endpoints,
    size: usize,
    depth: usize,
    cuts: usize,
) -> Result<ResumeTimes, String> {
    let mut states = conn.relay_states().ok_or("the connection is not resumable")?;
    let payload = bytes::Bytes::from(vec![0xa5u8; size]);
    let mut streams = Vec::new();
    if let Some(source) = endpoints.source {
        streams.push(Transfer::bulk_in(source, size as u32));
    }
    if let Some(sink) = endpoints.sink {
        streams.push(Transfer::bulk_out(sink, payload));
    }
    if streams.is_empty() {
        return Err("no bulk endpoint to stream on".into());
    }
    let mut queue = conn.queue();
    let mut rng = rand::rngs::StdRng::from_entropy();
    let mut stalls = Vec::with_capacity(cuts);
    let mut resumes = Vec::with_capacity(cuts);
    let mut urbs = 0u64;
    // The cut being measured: when it happened, and when the relay was connected again.
    let mut cut: Option<(Instant, Option<Instant>)> = None;
    let mut next_cut = Instant::now() + Duration::from_millis(rng.gen_range(BETWEEN_CUTS_MS));
    while stalls.len() < cuts {
        while queue.pending() < depth * streams.len() {
            for transfer in &streams {
                queue.submit(transfer.clone()).map_err(|e| e.to_string())?;
            }
        }
        let deadline = match cut {
            Some((at, _)) => at + STALL_LIMIT,
            None => next_cut,
        };
        tokio::select! {
            completion = queue.next_complete() => {
                let now = Instant::now();
                let mut next = Some(completion.ok_or("the connection closed")?.map_err(|e| e.to_string())?);
                while let Some(ret) = next {
                    if !ret.status.is_ok() {
                        return Err(format!("URB failed: {}", ret.status));
                    }
                    urbs += 1;
                    next = queue.try_next_complete();
                }
                if let Some((at, Some(resumed))) = cut {
                    stalls.push(now.duration_since(at));
                    resumes.push(resumed.duration_since(at));
                    cut = None;
                    next_cut = now + Duration::from_millis(rng.gen_range(BETWEEN_CUTS_MS));
                }
            }
            changed = states.changed(), if cut.is_some() => {
                let now = Instant::now();
                changed.map_err(|_| "the relay ended")?;
                // Any change after the cut means the relay noticed it; Connected means it
                // also resumed (a quick resume may fold both changes into one).
                if *states.borrow_and_update() == RelayState::Connected {
                    if let Some((_, resumed @ None)) = &mut cut {
                        *resumed = Some(now);
                    }
                }
            }
            () = tokio::time::sleep_until(deadline.into()) => {
                if cut.is_some() {
                    return Err(format!("no URB completed within {STALL_LIMIT:?} of a cut"));
                }
                states.mark_unchanged();
                proxy.cut_all();
                cut = Some((Instant::now(), None));
            }
        }
    }
    let us = |samples: Vec<Duration>| {
        let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        Percentiles::of(&mut us)
    };
    Ok(ResumeTimes { cuts, stall_us: us(stalls), resumed_us: us(resumes), urbs })
}
