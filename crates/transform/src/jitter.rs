//! The jitter buffer: on the client, hold each frame from the server until
//! `sent_at + lowest delay seen + playout`, so completions the device made at
//! a steady pace come out at that pace again however the network delayed
//! them (up to `playout` of extra delay). It changes no bytes, only timing,
//! and only where it was asked for: a bulk device would pay the playout
//! delay on every transfer, so it is off unless negotiated.

use std::io;
use std::time::{Duration, Instant};

use crate::frame::{Frame, Transform};

pub struct JitterBuffer {
    /// `None` on the server: it does not delay what clients send.
    playout: Option<Duration>,
    /// Our clock's reading for the sender's time zero, as the least-delayed
    /// frame so far places it (`arrival - sent_at`, minimised).
    origin: Option<Instant>,
    last_release: Option<Instant>,
}

impl JitterBuffer {
    pub fn new(playout: Option<Duration>) -> Self {
        Self { playout, origin: None, last_release: None }
    }
}

impl Transform for JitterBuffer {
    fn name(&self) -> &'static str {
        "jitter"
    }

    fn flag(&self) -> u8 {
        0
    }

    fn encode(&mut self, _frame: &mut Frame) {}

    fn decode(&mut self, _frame: &mut Frame) -> io::Result<()> {
        Ok(())
    }

    fn release_at(&mut self, frame: &Frame, arrived: Instant) -> Instant {
        let Some(playout) = self.playout else { return arrived };
        let sent = Duration::from_micros(frame.sent_at_us);
        if let Some(origin) = arrived.checked_sub(sent) {
            self.origin = Some(self.origin.map_or(origin, |o| o.min(origin)));
        }
        // Held at most `playout` past arrival, whatever the sender's clock claims.
        let due = self.origin.map_or(arrived, |origin| origin + sent + playout).min(arrived + playout);
        // Never reorder, never release before arrival.
        let release = due.max(arrived).max(self.last_release.unwrap_or(arrived));
        self.last_release = Some(release);
        release
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;

    fn frame(sent_at_ms: u64) -> Frame {
        Frame { flags: 0, sent_at_us: sent_at_ms * 1000, payload: BytesMut::new() }
    }

    #[test]
    fn restores_the_senders_spacing_under_jitter() {
        let start = Instant::now();
        let mut buffer = JitterBuffer::new(Some(Duration::from_millis(60)));
        // Sent every 8 ms; network delay 10 ms plus up to 50 ms of jitter, never reordered.
        let extra = [0u64, 37, 12, 50, 3, 44, 21, 8, 49, 1];
        let mut last_arrival = start;
        let mut releases = Vec::new();
        for (i, jitter) in extra.iter().enumerate() {
            let sent = i as u64 * 8;
            let arrival = (start + Duration::from_millis(sent + 10 + jitter)).max(last_arrival);
            last_arrival = arrival;
            releases.push(buffer.release_at(&frame(sent), arrival));
        }
        for pair in releases.windows(2) {
            let spacing = pair[1] - pair[0];
            assert!(spacing.abs_diff(Duration::from_millis(8)) < Duration::from_micros(10), "{spacing:?}");
        }
    }

    #[test]
    fn the_server_side_and_late_frames_pass_at_once() {
        let now = Instant::now();
        assert_eq!(JitterBuffer::new(None).release_at(&frame(5), now), now);
        let mut buffer = JitterBuffer::new(Some(Duration::from_millis(10)));
        buffer.release_at(&frame(0), now);
        // 100 ms late beyond the base delay: more than the playout, so released on arrival.
        let late = now + Duration::from_millis(108);
        assert_eq!(buffer.release_at(&frame(8), late), late);
    }

    #[test]
    fn a_frame_is_never_held_longer_than_the_playout() {
        let now = Instant::now();
        let playout = Duration::from_millis(10);
        let mut buffer = JitterBuffer::new(Some(playout));
        buffer.release_at(&frame(0), now);
        // A sender clock far in the future (or a corrupt stamp) must not stall the stream.
        let later = now + Duration::from_millis(1);
        let stamped = Frame { flags: 0, sent_at_us: u64::MAX, payload: BytesMut::new() };
        assert_eq!(buffer.release_at(&stamped, later), later + playout);
        let next = later + Duration::from_millis(1);
        assert!(buffer.release_at(&frame(16), next) <= next + playout);
    }
}
