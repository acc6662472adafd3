//! The ceiling: raw TCP over the same path with the same message shapes and
//! the same number in flight, against an ideal server that does no work.
//!
//! The server answers each 48-byte request with 48 bytes + the IN payload, or
//! takes 48 bytes + the OUT payload and answers 48 bytes. It decodes two fields
//! (direction and length), sends IN payloads from one static buffer without
//! copying, and answers everything it has read in one vectored write. The
//! client keeps `depth` requests in flight from a single task, tops the window
//! up with one vectored write per batch of completions and counts replies by
//! their length without parsing them. Nothing a USB/IP implementation must do
//! (decode, route to a device, track seqnums) is left, so what usbwire reaches
//! is measured against what the socket path allows.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use usbwire_proto::urb::{CmdSubmit, RetSubmit, TransferFlags, HEADER_LEN};
use usbwire_proto::Status;

use crate::{Direction, Percentiles};

/// The largest payload the ideal server sends or takes in one message.
pub const MAX_PAYLOAD: usize = 16 << 20;

/// The CMD_SUBMIT header the ceiling's client sends: a bulk URB on endpoint 1
/// or 2 with `size` bytes, exactly as usbwire's client would encode it.
pub fn request_header(direction: Direction, size: usize) -> [u8; HEADER_LEN] {
    CmdSubmit {
        seqnum: 1,
        devid: 0x0001_0002,
        direction: match direction {
            Direction::In => usbwire_proto::Direction::In,
            Direction::Out => usbwire_proto::Direction::Out,
        },
        ep: if direction == Direction::In { 1 } else { 2 },
        transfer_flags: TransferFlags(0),
        transfer_buffer_length: size as u32,
        start_frame: 0,
        number_of_packets: 0,
        interval: 0,
        setup: [0; 8],
        data: Bytes::new(),
        iso_packets: Vec::new(),
    }
    .header()
}

/// Bytes on the wire for one request and one reply of this shape.
pub fn message_lens(direction: Direction, size: usize) -> (usize, usize) {
    match direction {
        Direction::In => (HEADER_LEN, HEADER_LEN + size),
        Direction::Out => (HEADER_LEN + size, HEADER_LEN),
    }
}

/// What the ideal server reads from a request header: the RET_SUBMIT header to
/// answer with, and how many payload bytes follow the request (OUT) or the
/// reply (IN). Lengths beyond [`MAX_PAYLOAD`] are clamped: the ceiling's own
/// client never sends them.
pub fn answer(request: &[u8; HEADER_LEN]) -> (usize, [u8; HEADER_LEN], usize) {
    let field = |at: usize| u32::from_be_bytes([request[at], request[at + 1], request[at + 2], request[at + 3]]);
    let is_in = field(0x0c) == 1;
    let len = (field(0x18) as usize).min(MAX_PAYLOAD);
    let reply = RetSubmit {
        seqnum: field(0x04),
        status: Status::OK,
        actual_length: len as u32,
        start_frame: 0,
        number_of_packets: 0,
        error_count: 0,
        data: Bytes::new(),
        iso_packets: Vec::new(),
    }
    .header();
    if is_in {
        (0, reply, len)
    } else {
        (len, reply, 0)
    }
}

/// Starts the ideal server on 127.0.0.1, on a thread of its own
/// ([`crate::server_thread`]); returns its address.
pub fn start_server() -> std::io::Result<SocketAddr> {
    crate::server_thread("usbwire-ceiling", || async {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let payload = Bytes::from(vec![0x5au8; MAX_PAYLOAD]);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve(stream, payload.clone()));
            }
        });
        Ok(addr)
    })
}

async fn serve(stream: TcpStream, payload: Bytes) -> std::io::Result<()> {
    let (mut reader, mut writer) = stream.into_split();
    let mut buf = vec![0u8; 256 * 1024];
    let (mut start, mut end) = (0usize, 0usize);
    // OUT payload bytes still to discard before the next header.
    let mut skip = 0usize;
    // Replies owed: header and IN payload length.
    let mut replies: Vec<([u8; HEADER_LEN], usize)> = Vec::new();
    loop {
        let take = skip.min(end - start);
        skip -= take;
        start += take;
        while skip == 0 && end - start >= HEADER_LEN {
            let mut header = [0u8; HEADER_LEN];
            header.copy_from_slice(&buf[start..start + HEADER_LEN]);
            start += HEADER_LEN;
            let (out_len, reply, in_len) = answer(&header);
            replies.push((reply, in_len));
            let take = out_len.min(end - start);
            start += take;
            skip = out_len - take;
        }
        // Everything read so far is answered before waiting for more.
        if !replies.is_empty() {
            write_replies(&mut writer, &replies, &payload).await?;
            replies.clear();
        }
        if start == end {
            (start, end) = (0, 0);
        } else if start > buf.len() / 2 {
            buf.copy_within(start..end, 0);
            (start, end) = (0, end - start);
        }
        let n = reader.read(&mut buf[end..]).await?;
        if n == 0 {
            return Ok(());
        }
        end += n;
    }
}

async fn write_replies(
    writer: &mut (impl AsyncWrite + Unpin),
    replies: &[([u8; HEADER_LEN], usize)],
    payload: &[u8],
) -> std::io::Result<()> {
    let parts: Vec<&[u8]> = replies.iter().flat_map(|(h, len)| [&h[..], &payload[..*len]]).collect();
    usbwire_transport::write_all_parts(writer, &parts).await
}

/// Result of one run (usbwire's or the ceiling's).
#[derive(Clone, Debug)]
pub struct Measured {
    pub mib_per_s: f64,
    pub urbs_per_s: f64,
    pub latency: Percentiles,
    /// Every URB's latency in µs, sorted (for CDF plots).
    pub samples: Vec<f64>,
}

/// Runs `depth`-deep request/reply traffic of `size`-byte payloads for `duration`.
pub async fn measure(
    addr: SocketAddr,
    direction: Direction,
    size: usize,
    depth: usize,
    duration: Duration,
) -> std::io::Result<Measured> {
    let size = size.min(MAX_PAYLOAD);
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut reader, mut writer) = stream.into_split();
    let header = request_header(direction, size);
    let out_payload = vec![0xa5u8; if direction == Direction::Out { size } else { 0 }];
    let (_, reply_len) = message_lens(direction, size);
    let mut buf = vec![0u8; reply_len.clamp(64 * 1024, 1 << 20)];
    let mut sent_at = VecDeque::with_capacity(depth);
    let mut latencies = Vec::new();
    let mut received = 0usize;
    let mut done = 0u64;
    let started = Instant::now();
    let stop = started + duration;
    let mut finished = started;
    loop {
        let now = Instant::now();
        let room = if now < stop { depth - sent_at.len() } else { 0 };
        if room > 0 {
            let parts: Vec<&[u8]> = (0..room).flat_map(|_| [&header[..], &out_payload[..]]).collect();
            usbwire_transport::write_all_parts(&mut writer, &parts).await?;
            sent_at.extend((0..room).map(|_| now));
        }
        if sent_at.is_empty() {
            break;
        }
        let n = read_some(&mut reader, &mut buf).await?;
        received += n;
        let now = Instant::now();
        while received >= reply_len {
            received -= reply_len;
            let Some(at) = sent_at.pop_front() else {
                return Err(std::io::Error::other("the ideal server answered more than was asked"));
            };
            latencies.push(now.duration_since(at).as_secs_f64() * 1e6);
            done += 1;
            finished = now;
        }
    }
    let seconds = finished.duration_since(started).as_secs_f64().max(1e-9);
    Ok(Measured {
        mib_per_s: done as f64 * size as f64 / seconds / (1024.0 * 1024.0),
        urbs_per_s: done as f64 / seconds,
        latency: Percentiles::of(&mut latencies),
        samples: latencies,
    })
}

/// One read, failing if the server closes. No timer: the ideal server is in
/// this process and a timer per read would be work usbwire's client does not do.
async fn read_some(reader: &mut (impl AsyncRead + Unpin), buf: &mut [u8]) -> std::io::Result<usize> {
    match reader.read(buf).await? {
        0 => Err(std::io::ErrorKind::UnexpectedEof.into()),
        n => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;
    use usbwire_proto::urb::{decode_command, decode_return, ClientMessage, ServerMessage, SubmittedShape};
    use usbwire_proto::Limits;

    use super::*;

    fn limits() -> Limits {
        Limits { max_transfer_length: MAX_PAYLOAD as u32, ..Limits::default() }
    }

    /// The ceiling's messages are USB/IP messages: usbwire's own decoders read
    /// them as a CMD_SUBMIT and a RET_SUBMIT with the same lengths.
    #[test]
    fn ceiling_messages_have_the_usbip_shapes() {
        for (direction, size) in
            [(Direction::In, 512), (Direction::Out, 512), (Direction::In, 1 << 20), (Direction::Out, 65536)]
        {
            let (request_len, reply_len) = message_lens(direction, size);
            let header = request_header(direction, size);
            let mut request = BytesMut::from(&header[..]);
            if direction == Direction::Out {
                request.extend_from_slice(&vec![0xa5; size]);
            }
            assert_eq!(request.len(), request_len);
            let Some(ClientMessage::Submit(submit)) = decode_command(&mut request, &limits(), |_, _| false).unwrap()
            else {
                panic!("not a CMD_SUBMIT");
            };
            assert!(request.is_empty());
            assert_eq!(submit.transfer_buffer_length as usize, size);
            assert_eq!(submit.direction == usbwire_proto::Direction::In, direction == Direction::In);

            let (out_len, reply_header, in_len) = answer(&header);
            assert_eq!(HEADER_LEN + out_len, request_len, "the server takes the whole request");
            assert_eq!(HEADER_LEN + in_len, reply_len, "the reply carries the IN payload only");
            let mut reply = BytesMut::from(&reply_header[..]);
            reply.extend_from_slice(&vec![0x5a; in_len]);
            let shape =
                SubmittedShape { direction: submit.direction, transfer_buffer_length: size as u32, iso_packets: None };
            let Some(ServerMessage::Submit(ret)) = decode_return(&mut reply, &limits(), |_| Some(shape)).unwrap()
            else {
                panic!("not a RET_SUBMIT");
            };
            assert!(reply.is_empty());
            assert_eq!((ret.seqnum, ret.status, ret.actual_length as usize), (1, Status::OK, size));
            assert_eq!(ret.data.len(), in_len);
        }
    }

    #[test]
    fn oversized_requests_are_clamped() {
        let header = request_header(Direction::Out, MAX_PAYLOAD + 1);
        assert_eq!(answer(&header).0, MAX_PAYLOAD);
    }

    /// Replies split across `writev` calls in any place still arrive whole and in order.
    #[tokio::test]
    async fn vectored_replies_survive_short_writes() {
        let (mut client, server) = tokio::io::duplex(7);
        let (_, mut server_writer) = tokio::io::split(server);
        let payload = vec![0x5au8; 1000];
        let header = request_header(Direction::In, 1000);
        let (_, reply, in_len) = answer(&header);
        let replies = vec![(reply, in_len); 3];
        let writer = tokio::spawn(async move { write_replies(&mut server_writer, &replies, &payload).await });
        let mut got = Vec::new();
        let mut chunk = [0u8; 64];
        while got.len() < 3 * (HEADER_LEN + 1000) {
            let n = client.read(&mut chunk).await.unwrap();
            got.extend_from_slice(&chunk[..n]);
        }
        writer.await.unwrap().unwrap();
        for message in got.chunks(HEADER_LEN + 1000) {
            assert_eq!(&message[..HEADER_LEN], &reply[..]);
            assert!(message[HEADER_LEN..].iter().all(|&b| b == 0x5a));
        }
    }
}
