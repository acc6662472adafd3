//! Outgoing replies, written with vectored writes and without copying payloads.
//!
//! Headers and small payloads are packed into one scratch buffer; a large IN
//! payload (a `Bytes` handed over by the device) is queued as its own slice.
//! One `writev` then carries many replies: headers of several completions and
//! the data between them go out in a single system call.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::AsyncWrite;
use usbwire_proto::urb::{RetSubmit, RetUnlink};

/// Payloads up to this size are copied next to their header (cheaper than an iovec).
const COPY_THRESHOLD: usize = 2048;
/// iovecs per write call.
const MAX_SLICES: usize = 64;

#[derive(Default)]
pub(crate) struct WriteQueue {
    frames: VecDeque<Bytes>,
    scratch: BytesMut,
    queued: usize,
}

impl WriteQueue {
    pub(crate) fn push_ret_submit(&mut self, ret: &RetSubmit) {
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

    pub(crate) fn push_ret_unlink(&mut self, ret: &RetUnlink) {
        let header = ret.header();
        self.scratch.extend_from_slice(&header);
        self.queued += header.len();
    }

    /// Bytes waiting to be written.
    pub(crate) fn queued(&self) -> usize {
        self.queued
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queued == 0
    }

    fn seal(&mut self) {
        if !self.scratch.is_empty() {
            self.frames.push_back(self.scratch.split().freeze());
        }
    }

    /// Writes as much as the socket takes; `Ready(Ok(()))` once everything is out.
    pub(crate) fn poll_flush<W: AsyncWrite + Unpin>(
        &mut self,
        cx: &mut Context<'_>,
        writer: &mut W,
    ) -> Poll<io::Result<()>> {
        self.seal();
        while !self.frames.is_empty() {
            let slices: Vec<IoSlice<'_>> = self.frames.iter().take(MAX_SLICES).map(|f| IoSlice::new(f)).collect();
            let written = match Pin::new(&mut *writer).poll_write_vectored(cx, &slices) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Pending => return Poll::Pending,
            };
            self.advance(written);
        }
        Poll::Ready(Ok(()))
    }

    fn advance(&mut self, mut written: usize) {
        self.queued -= written;
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Waker;
    use usbwire_proto::Status;

    #[test]
    fn replies_come_out_in_order_byte_for_byte() {
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
        let mut queue = WriteQueue::default();
        queue.push_ret_submit(&small);
        queue.push_ret_submit(&large);
        queue.push_ret_unlink(&unlink);
        let mut expected = BytesMut::new();
        small.encode(&mut expected);
        large.encode(&mut expected);
        expected.extend_from_slice(&unlink.header());
        assert_eq!(queue.queued(), expected.len());

        let mut out: Vec<u8> = Vec::new();
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(queue.poll_flush(&mut cx, &mut out), Poll::Ready(Ok(()))));
        assert_eq!(out, expected.to_vec());
        assert!(queue.is_empty());
    }
}
