//! [`Outbox`]: encoded URB messages waiting to be written, as slices for one
//! vectored write, without copying large payloads. The server queues replies
//! in one; a client session queues commands in another.
//!
//! Headers and small payloads are packed into one scratch buffer; a large
//! payload (IN data handed over by the device, OUT data from the caller) is
//! queued as its own slice. One `writev` then carries many messages: headers
//! of several completions and the data between them go out in a single
//! system call. No I/O here: the
//! caller writes [`slices`](Outbox::slices) and reports what went out with
//! [`advance`](Outbox::advance).

use std::collections::VecDeque;
use std::io::IoSlice;

use bytes::{Buf, Bytes, BytesMut};

use crate::urb::{CmdSubmit, RetSubmit, RetUnlink, HEADER_LEN};
use crate::Direction;

/// Payloads up to this size are copied next to their header (cheaper than an iovec).
const COPY_THRESHOLD: usize = 2048;

/// Room the scratch buffer takes at a time: many messages' worth, so making
/// room (which moves what is queued and not yet sealed, or allocates) is rare.
const SCRATCH_CHUNK: usize = 64 * 1024;

#[derive(Default)]
pub struct Outbox {
    frames: VecDeque<Bytes>,
    scratch: BytesMut,
    queued: usize,
    /// Bytes written out over the outbox's life.
    written: u64,
}

impl Outbox {
    pub fn push_ret_submit(&mut self, ret: &RetSubmit) {
        self.push_message(&ret.header(), Some(&ret.data), ret.iso_packets.len());
        ret.iso_trailer(&mut self.scratch);
    }

    pub fn push_ret_unlink(&mut self, ret: &RetUnlink) {
        self.push_header(&ret.header());
    }

    /// A `CMD_SUBMIT` (client side): header, OUT payload, iso descriptors.
    #[inline(always)]
    pub fn push_cmd_submit(&mut self, submit: &CmdSubmit) {
        match submit.direction {
            Direction::Out => self.push_message(&submit.header(), Some(&submit.data), submit.iso_packets.len()),
            Direction::In => self.push_message(&submit.header(), None, submit.iso_packets.len()),
        }
        if !submit.iso_packets.is_empty() {
            submit.iso_trailer(&mut self.scratch);
        }
    }

    /// A message that is only a header (`CMD_UNLINK`, `RET_UNLINK`, a resume ack).
    pub fn push_header(&mut self, header: &[u8; HEADER_LEN]) {
        self.scratch.extend_from_slice(header);
        self.queued += HEADER_LEN;
    }

    /// Header and payload (if any); the caller appends `iso_count` descriptors
    /// to the scratch buffer.
    #[inline(always)]
    fn push_message(&mut self, header: &[u8; HEADER_LEN], payload: Option<&Bytes>, iso_count: usize) {
        let length = payload.map_or(0, Bytes::len);
        match payload {
            Some(large) if length > COPY_THRESHOLD => {
                self.scratch.extend_from_slice(header);
                self.seal();
                self.frames.push_back(large.clone());
            }
            small => {
                // One reservation for the header, the payload and the descriptors.
                let needed = HEADER_LEN + length + iso_count * 16;
                if self.scratch.capacity() - self.scratch.len() < needed {
                    self.scratch.reserve(needed.max(SCRATCH_CHUNK));
                }
                self.scratch.extend_from_slice(header);
                if let Some(payload) = small {
                    self.scratch.extend_from_slice(payload);
                }
            }
        }
        self.queued += HEADER_LEN + length + iso_count * 16;
    }

    /// Moves everything queued to the end of `to`, counting it as written
    /// here: for a writer that writes from an outbox of its own, so the one
    /// messages are queued in (a session's, shared behind a lock) is not held
    /// while it writes. Returns whether anything moved.
    pub fn hand_over(&mut self, to: &mut Self) -> bool {
        if self.queued == 0 {
            return false;
        }
        self.seal();
        to.seal();
        if to.frames.is_empty() {
            std::mem::swap(&mut self.frames, &mut to.frames);
        } else {
            to.frames.append(&mut self.frames);
        }
        to.queued += self.queued;
        self.written += self.queued as u64;
        self.queued = 0;
        true
    }

    /// Drops everything not yet written (the connection it was for is gone).
    pub fn clear(&mut self) {
        self.frames.clear();
        self.scratch.clear();
        self.queued = 0;
    }

    /// Bytes waiting to be written.
    pub fn queued(&self) -> usize {
        self.queued
    }

    pub fn is_empty(&self) -> bool {
        self.queued == 0
    }

    /// Bytes written out (reported by [`advance`](Self::advance)) over the outbox's life.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Up to `max` slices, in order, for one vectored write.
    pub fn slices(&mut self, max: usize) -> Vec<IoSlice<'_>> {
        self.seal();
        self.frames.iter().take(max).map(|f| IoSlice::new(f)).collect()
    }

    /// Drops the first `written` bytes (what the write took).
    pub fn advance(&mut self, mut written: usize) {
        self.seal();
        self.written += written as u64;
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

    #[test]
    fn a_hand_over_keeps_the_order_and_counts_as_written() {
        let header = |n: u8| [n; HEADER_LEN];
        let mut session = Outbox::default();
        let mut wire = Outbox::default();
        assert!(!session.hand_over(&mut wire), "nothing queued");
        session.push_header(&header(1));
        assert!(session.hand_over(&mut wire));
        assert!(session.is_empty() && session.written() == HEADER_LEN as u64);
        // Queued behind what the writer still holds, its own unsealed bytes included.
        wire.push_header(&header(2));
        session.push_header(&header(3));
        session.hand_over(&mut wire);
        assert_eq!(wire.queued(), 3 * HEADER_LEN);
        let bytes: Vec<u8> = wire.slices(64).iter().flat_map(|slice| slice.to_vec()).collect();
        let firsts: Vec<u8> = bytes.chunks(HEADER_LEN).map(|chunk| chunk[0]).collect();
        assert_eq!(firsts, [1, 2, 3]);
    }
}
