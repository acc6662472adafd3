//! [`Outbox`]: encoded replies waiting to be written, as slices for one
//! vectored write, without copying large payloads.
//!
//! Headers and small payloads are packed into one scratch buffer; a large IN
//! payload (a `Bytes` handed over by the device) is queued as its own slice.
//! One `writev` then carries many replies: headers of several completions and
//! the data between them go out in a single system call. No I/O here: the
//! caller writes [`slices`](Outbox::slices) and reports what went out with
//! [`advance`](Outbox::advance).

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::{Buf, Bytes, BytesMut};

use crate::urb::{RetSubmit, RetUnlink};

/// Payloads up to this size are copied next to their header (cheaper than an iovec).
const COPY_THRESHOLD: usize = 2048;

#[derive(Default)]
pub struct Outbox {
    frames: VecDeque<Bytes>,
    scratch: BytesMut,
    queued: usize,
}

impl Outbox {
    pub fn push_ret_submit(&mut self, ret: &RetSubmit) {
        let header = ret.header();
        self.scratch.extend_from_slice(&header);
        if ret.data.len() <= COPY_THRESHOLD {
            self.scratch.extend_from_slice(&ret.data);
        } else {
            self.seal();
            self.frames.push_back(ret.data.clone());
        }
        ret.iso_trailer(&mut self.scratch);
        self.queued += header.len() + ret.data.len() + ret.iso_packets.len() * 16;
    }

    pub fn push_ret_unlink(&mut self, ret: &RetUnlink) {
        let header = ret.header();
        self.scratch.extend_from_slice(&header);
        self.queued += header.len();
    }

    /// Bytes waiting to be written.
    pub fn queued(&self) -> usize {
        self.queued
    }

    pub fn is_empty(&self) -> bool {
        self.queued == 0
    }

    /// Up to `max` slices, in order, for one vectored write.
    pub fn slices(&mut self, max: usize) -> Vec<IoSlice<'_>> {
        self.seal();
        self.frames.iter().take(max).map(|f| IoSlice::new(f)).collect()
    }

    /// Drops the first `written` bytes (what the write took).
    pub fn advance(&mut self, mut written: usize) {
        self.seal();
        self.queued -= written.min(self.queued);
        while written > 0 {
            let Some(front) = self.frames.front_mut() else { break };
            if written >= front.len() {
                written -= front.len();
                self.frames.pop_front();
            } else {
                front.advance(written);
                written = 0;
            }
        }
    }

    fn seal(&mut self) {
        if !self.scratch.is_empty() {
            self.frames.push_back(self.scratch.split().freeze());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    #[test]
    fn replies_come_out_in_order_byte_for_byte_whatever_the_write_sizes() {
        let small = RetSubmit {
            seqnum: 1,
            status: Status::OK,
            actual_length: 3,
            start_frame: 0,
            number_of_packets: 0,
            error_count: 0,
            data: Bytes::from_static(b"abc"),
            iso_packets: vec![],
        };
        let large = RetSubmit { seqnum: 2, actual_length: 5000, data: Bytes::from(vec![7u8; 5000]), ..small.clone() };
        let unlink = RetUnlink { seqnum: 3, status: Status::ECONNRESET };
        let mut expected = BytesMut::new();
        small.encode(&mut expected);
        large.encode(&mut expected);
        expected.extend_from_slice(&unlink.header());

        for write_size in [1, 7, 48, 4096, usize::MAX] {
            let mut outbox = Outbox::default();
            outbox.push_ret_submit(&small);
            outbox.push_ret_submit(&large);
            outbox.push_ret_unlink(&unlink);
            assert_eq!(outbox.queued(), expected.len());
            let mut out = Vec::new();
            while !outbox.is_empty() {
                let mut took = 0;
                for slice in outbox.slices(2) {
                    let n = slice.len().min(write_size - took);
                    out.extend_from_slice(&slice[..n]);
                    took += n;
                    if took == write_size {
                        break;
                    }
                }
                outbox.advance(took);
            }
            assert_eq!(out, expected.to_vec(), "writes of {write_size}");
        }
    }
}
