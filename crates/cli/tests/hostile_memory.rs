//! Memory budgets against a hostile client, from real sockets against the real
//! `usbwire serve`: a compression bomb, a flood of unlinks whose replies are never
//! read, OUT data piled up in flight, and a stream of 1 MiB URBs with capture on.
//! Each must leave the server's peak RSS
//! (`VmHWM`) bounded, push back on the sender instead of buffering, and keep
//! serving other clients. The same for the usbredir bridge (`usbwire redir`)
//! against a guest that floods it with URBs the device cannot finish.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use usbwire_proto::op::{self, BusId, OpRequest};
use usbwire_proto::urb::{CmdSubmit, CmdUnlink, TransferFlags, HEADER_LEN};
use usbwire_proto::Direction;
use usbwire_redir::{Caps, Codec, Packet};
use usbwire_transform::{Frame, Pipeline, Side, TransformSpec, MAX_FRAME_PAYLOAD};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");
/// The loopback gadget is the only device, so it is 0-1.
const LOOPBACK_DEVID: u32 = 0x0000_0001;
/// The loopback gadget's bulk OUT whose data waits for its loop IN (16 MiB queue).
const LOOP_OUT_EP: u8 = 3;
/// The loopback gadget's bulk IN that returns the loop OUT's data (waits for it).
const LOOP_IN_EP: u8 = 0x83;
/// Growth of the server's peak RSS over its idle RSS that every attack must stay under.
/// The default budgets allow about 100 MiB per connection (64 MiB of URBs in flight,
/// 8 MiB of replies, 8 MiB decoded, one message being read); the attacks below reached
/// 400-650 MB before the budgets.
const RSS_GROWTH_BOUND_KIB: u64 = 200 * 1024;

struct Served {
    child: Child,
    addr: String,
    /// Holds the control socket; removed after the server is killed.
    _dir: usbwire_testing::process::Scratch,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Served {
    fn start() -> Self {
        Self::start_with(&[])
    }

    /// The server with `extra` arguments after the usual ones.
    fn start_with(extra: &[&std::ffi::OsStr]) -> Self {
        let addr = format!("127.0.0.1:{}", TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port());
        let dir = usbwire_testing::process::scratch("hostile", &addr.replace(':', "-"));
        let control = dir.join("control.sock");
        let mut child = Command::new(BIN)
            .args(["serve", "--listen", &addr, "--virtual", "loopback", "--control"])
            .arg(&control)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first =
            lines.by_ref().map(|l| l.unwrap()).find(|l| l.starts_with("usbwire serving")).expect("server output");
        assert!(first.contains(&addr), "unexpected line: {first}");
        std::thread::spawn(move || for _ in lines {});
        Self { child, addr, _dir: dir }
    }

    /// A field of the server's `/proc/PID/status` in KiB (`VmRSS`, `VmHWM`).
    fn status_kib(&self, field: &str) -> u64 {
        status_kib(&self.child, field)
    }

    /// Another client is still served: the device list comes back, quickly.
    fn assert_serves_others(&self) {
        assert!(self.lists_available("0-1"), "the device is missing from the list during the attack");
    }

    /// Whether `busid` is in the device list, asked as another client would;
    /// the server must answer, quickly, either way.
    fn lists_available(&self, busid: &str) -> bool {
        let started = Instant::now();
        let out = Command::new(BIN).args(["list", "-r", &self.addr, "--json"]).output().unwrap();
        assert!(out.status.success(), "list failed: {}", String::from_utf8_lossy(&out.stderr));
        assert!(started.elapsed() < Duration::from_secs(5), "list took {:?}", started.elapsed());
        String::from_utf8_lossy(&out.stdout).contains(&format!("\"{busid}\""))
    }

    fn connect(&self) -> TcpStream {
        let stream = TcpStream::connect(&self.addr).unwrap();
        stream.set_nodelay(true).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        stream
    }
}

/// A field of `/proc/PID/status` in KiB (`VmRSS`, `VmHWM`).
fn status_kib(child: &Child, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let line = status.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in {status}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn import_request() -> BytesMut {
    let mut out = BytesMut::new();
    OpRequest::Import { busid: BusId::new("0-1").unwrap() }.encode(&mut out);
    out
}

/// Imports 0-1 over plain USB/IP; the stream is then in the URB phase.
fn import(stream: &mut TcpStream) {
    stream.write_all(&import_request()).unwrap();
    let mut reply = BytesMut::new();
    let mut chunk = [0u8; 512];
    loop {
        if let Some(result) = op::decode_import_reply(&mut reply).unwrap() {
            assert!(result.is_ok(), "import refused: {result:?}");
            return;
        }
        let n = stream.read(&mut chunk).unwrap();
        assert!(n > 0, "server closed during import");
        reply.extend_from_slice(&chunk[..n]);
    }
}

fn submit(seqnum: u32, direction: Direction, ep: u8, setup: [u8; 8], data: Vec<u8>, length: usize) -> BytesMut {
    let submit = CmdSubmit {
        seqnum,
        devid: LOOPBACK_DEVID,
        direction,
        ep,
        transfer_flags: TransferFlags::default(),
        transfer_buffer_length: length as u32,
        start_frame: 0,
        number_of_packets: 0,
        interval: 0,
        setup,
        data: data.into(),
        iso_packets: vec![],
    };
    let mut message = BytesMut::new();
    submit.encode(&mut message);
    message
}

/// SET_CONFIGURATION(1), as a driver does first, and waits for its completion.
fn configure(stream: &mut TcpStream) {
    const SET_CONFIGURATION_1: [u8; 8] = [0x00, 9, 1, 0, 0, 0, 0, 0];
    stream.write_all(&submit(0x7fff_0000, Direction::Out, 0, SET_CONFIGURATION_1, vec![], 0)).unwrap();
    let mut reply = vec![0u8; HEADER_LEN];
    stream.read_exact(&mut reply).unwrap();
    assert_eq!(&reply[..4], &3u32.to_be_bytes(), "not a RET_SUBMIT");
    assert_eq!(&reply[20..24], &0u32.to_be_bytes(), "SET_CONFIGURATION failed");
}

/// Writes `message` repeatedly until `cap` bytes went out or the peer stopped taking
/// them for 3 s (backpressure). Returns the bytes written.
fn write_until_blocked(stream: &mut TcpStream, message: &[u8], cap: usize) -> usize {
    stream.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    let batch: Vec<u8> = message.iter().copied().cycle().take(message.len() * (65536 / message.len()).max(1)).collect();
    let mut written = 0;
    let mut offset = 0;
    while written < cap {
        match stream.write(&batch[offset..]) {
            Ok(n) => {
                written += n;
                offset = (offset + n) % batch.len();
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
            Err(e) => panic!("write failed: {e}"),
        }
    }
    written
}

#[test]
fn a_compression_bomb_leaves_the_server_bounded_and_serving() {
    let served = Served::start();
    served.assert_serves_others();
    let idle = served.status_kib("VmRSS:");

    let mut stream = served.connect();
    let mut offer = BytesMut::new();
    OpRequest::Transforms { offer: "zstd".into() }.encode(&mut offer);
    stream.write_all(&offer).unwrap();
    let mut reply = BytesMut::new();
    let mut chunk = [0u8; 256];
    let accepted = loop {
        if let Some(accepted) = op::decode_transforms_reply(&mut reply).unwrap() {
            break accepted;
        }
        let n = stream.read(&mut chunk).unwrap();
        assert!(n > 0, "server closed during the transform offer");
        reply.extend_from_slice(&chunk[..n]);
    };
    assert_eq!(accepted, "zstd");

    // The import, then 4000 frames that each decompress to 1 MiB of zeros: 4 GiB from
    // about 400 KB on the wire, sent before any access check would look at the device.
    let mut pipeline = Pipeline::new(&[TransformSpec::Zstd], Side::Client);
    let mut frame_bytes = |payload: &[u8]| {
        let mut frame = Frame { flags: 0, sent_at_us: 0, payload: BytesMut::from(payload) };
        pipeline.encode(&mut frame);
        let mut wire = frame.header().to_vec();
        wire.extend_from_slice(&frame.payload);
        wire
    };
    let mut bomb = frame_bytes(&import_request());
    let zeros = frame_bytes(&vec![0u8; MAX_FRAME_PAYLOAD]);
    for _ in 0..4000 {
        bomb.extend_from_slice(&zeros);
    }
    assert!(bomb.len() < 1 << 20, "the bomb is small on the wire: {} bytes", bomb.len());
    let _ = write_until_blocked(&mut stream, &bomb, bomb.len());

    std::thread::sleep(Duration::from_secs(1));
    served.assert_serves_others();
    let growth = served.status_kib("VmHWM:").saturating_sub(idle);
    eprintln!("compression bomb: peak RSS grew by {growth} KiB");
    assert!(growth < RSS_GROWTH_BOUND_KIB, "the bomb grew the server by {growth} KiB");
    assert!(served.child.try_wait_ok(), "the server died");
}

#[test]
fn unlinks_whose_replies_are_never_read_push_back_and_lose_nothing() {
    let served = Served::start();
    served.assert_serves_others();
    let idle = served.status_kib("VmRSS:");

    let mut stream = served.connect();
    import(&mut stream);
    // Unlinks of URBs never submitted: each is answered at once with RET_UNLINK(0).
    // One seqnum for all is fine: the server keeps no state for them.
    let unlink = CmdUnlink { seqnum: 7, devid: LOOPBACK_DEVID, unlink_seqnum: 1_000_000 }.header();
    let cap = 512 << 20;
    let written = write_until_blocked(&mut stream, &unlink, cap);
    eprintln!("unread unlinks: the server took {written} bytes before pushing back");
    assert!(written < cap, "the server read {written} bytes of unlinks without its replies being read");

    served.assert_serves_others();
    let growth = served.status_kib("VmHWM:").saturating_sub(idle);
    eprintln!("unread unlinks: peak RSS grew by {growth} KiB");
    assert!(growth < RSS_GROWTH_BOUND_KIB, "the unlink flood grew the server by {growth} KiB");

    // Nothing is lost: every unlink sent gets its RET_UNLINK once we read.
    let partial = written % HEADER_LEN;
    let expected = written / HEADER_LEN + usize::from(partial > 0);
    let mut reader = stream.try_clone().unwrap();
    let replies = std::thread::spawn(move || {
        let mut reply = vec![0u8; HEADER_LEN];
        for i in 0..expected {
            reader.read_exact(&mut reply).unwrap_or_else(|e| panic!("reply {i} of {expected}: {e}"));
            assert_eq!(&reply[..4], &4u32.to_be_bytes(), "reply {i} is not a RET_UNLINK");
        }
        expected
    });
    stream.set_write_timeout(None).unwrap();
    stream.write_all(&unlink[partial..]).unwrap();
    assert_eq!(replies.join().unwrap(), expected);
}

#[test]
fn out_data_in_flight_is_bounded_by_pushing_back() {
    let served = Served::start();
    served.assert_serves_others();
    let idle = served.status_kib("VmRSS:");

    let mut stream = served.connect();
    import(&mut stream);
    configure(&mut stream);
    // 16 MiB OUT URBs to the loop endpoint: the first fills its queue, the rest stay
    // in flight until someone reads the loop IN (nobody does).
    const URB: usize = 16 << 20;
    const URBS: usize = 40;
    let mut written = 0;
    let mut blocked = false;
    stream.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    for seqnum in 1..=URBS as u32 {
        let message = submit(seqnum, Direction::Out, LOOP_OUT_EP, [0; 8], vec![0x5a; URB], URB);
        let mut offset = 0;
        while offset < message.len() {
            match stream.write(&message[offset..]) {
                Ok(n) => offset += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    blocked = true;
                    break;
                }
                Err(e) => panic!("write failed: {e}"),
            }
        }
        written += offset;
        if blocked {
            break;
        }
    }
    eprintln!("OUT in flight: the server took {} MiB of {} MiB before pushing back", written >> 20, (URB * URBS) >> 20);
    assert!(blocked, "the server took all {URBS} URBs of 16 MiB");

    served.assert_serves_others();
    let growth = served.status_kib("VmHWM:").saturating_sub(idle);
    eprintln!("OUT in flight: peak RSS grew by {growth} KiB");
    assert!(growth < RSS_GROWTH_BOUND_KIB, "OUT data in flight grew the server by {growth} KiB");
}

/// What capture may add to the server, at any URB size: its queue (16 MiB) and
/// file buffers, with room for the allocator. It was 2.6 GB with 1 MiB URBs.
const CAPTURE_GROWTH_BOUND_KIB: u64 = 64 * 1024;

#[test]
fn capturing_a_stream_of_1_mib_urbs_adds_tens_of_mib_not_gigabytes() {
    let base = usbwire_testing::process::scratch("capture-rss", "base");
    let dir = base.join("capture");
    let served = Served::start_with(&["--capture".as_ref(), dir.as_os_str()]);
    let idle = served.status_kib("VmRSS:");

    let bench = Command::new(BIN)
        .args(["bench", "-r", &served.addr, "-b", "0-1", "--sizes", "1M", "--depths", "8", "--seconds", "3"])
        .args(["--repeat", "1", "--json"])
        .output()
        .unwrap();
    assert!(bench.status.success(), "bench failed: {}", String::from_utf8_lossy(&bench.stderr));
    served.assert_serves_others();
    let growth = served.status_kib("VmHWM:").saturating_sub(idle);
    eprintln!("capture of 1 MiB URBs: peak RSS grew by {growth} KiB");
    assert!(growth < CAPTURE_GROWTH_BOUND_KIB, "capture grew the server by {growth} KiB");

    use std::os::unix::fs::MetadataExt as _;
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700, "the capture directory is private");
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(!files.is_empty(), "nothing was captured");
    for file in &files {
        assert_eq!(std::fs::metadata(file).unwrap().mode() & 0o777, 0o600, "{}", file.display());
    }
    drop(served);
    let _ = std::fs::remove_dir_all(&base);
}

/// `usbwire redir` importing the server's loopback device for usbredir guests.
struct RedirBridge {
    child: Child,
    /// Its Unix socket, in a directory of its own.
    socket: std::path::PathBuf,
}

impl Drop for RedirBridge {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = self.socket.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl RedirBridge {
    fn start(served: &Served) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "usbwire-hostile-redir-{}-{}",
            std::process::id(),
            served.addr.replace(':', "-")
        ));
        let socket = dir.join("redir.sock");
        let child = Command::new(BIN)
            .args(["redir", "-r", &served.addr, "-b", "0-1", "--listen"])
            .arg(format!("unix:{}", socket.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Self { child, socket }
    }

    /// A guest that said hello, saw the device announced and configured it.
    fn guest(&self) -> (UnixStream, Codec) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut stream = loop {
            match UnixStream::connect(&self.socket) {
                Ok(stream) => break stream,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => panic!("the bridge does not listen on {}: {e}", self.socket.display()),
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let caps = [Caps::CONNECT_DEVICE_VERSION, Caps::EP_INFO_MAX_PACKET_SIZE, Caps::IDS_64, Caps::BULK_LENGTH_32];
        let mut codec = Codec::new(usbwire_redir::Side::Guest, caps.into_iter().fold(Caps(0), Caps::with), u32::MAX);
        send(&mut stream, &codec, 0, &codec.hello("hostile guest"));
        let mut inbuf = BytesMut::new();
        expect(&mut stream, &mut codec, &mut inbuf, |p| matches!(p, Packet::DeviceConnect { .. }));
        send(&mut stream, &codec, 1, &Packet::SetConfiguration { configuration: 1 });
        expect(
            &mut stream,
            &mut codec,
            &mut inbuf,
            |p| matches!(p, Packet::ConfigurationStatus { status, .. } if *status == usbwire_redir::Status::SUCCESS),
        );
        (stream, codec)
    }
}

fn send(stream: &mut UnixStream, codec: &Codec, id: u64, packet: &Packet) {
    let mut out = BytesMut::new();
    codec.encode(id, packet, &mut out).unwrap();
    stream.write_all(&out).unwrap();
}

/// Reads packets from the bridge until one `wanted` arrives.
fn expect(stream: &mut UnixStream, codec: &mut Codec, inbuf: &mut BytesMut, wanted: impl Fn(&Packet) -> bool) {
    let mut chunk = [0u8; 4096];
    loop {
        while let Some((_, packet)) = codec.decode(inbuf).unwrap() {
            if wanted(&packet) {
                return;
            }
        }
        let n = stream.read(&mut chunk).unwrap();
        assert!(n > 0, "the bridge closed the guest's connection");
        inbuf.extend_from_slice(&chunk[..n]);
    }
}

/// Bulk packets on the loop pair: `count` IN requests of 512 bytes on the loop IN
/// (which wait for loop data that never comes), or OUT packets of `size` bytes on
/// the loop OUT (of which the device takes 16 MiB, then leaves the rest pending).
/// The OUT packets share one buffer.
fn bulk_packets(first_id: u64, count: usize, size: usize, endpoint: u8) -> impl Iterator<Item = (u64, Packet)> + Send {
    let data = if endpoint & 0x80 == 0 { Bytes::from(vec![0x5a; size]) } else { Bytes::new() };
    (first_id..first_id + count as u64).map(move |id| {
        let status = usbwire_redir::Status::SUCCESS;
        (id, Packet::Bulk { endpoint, status, length: size as u32, stream_id: 0, data: data.clone() })
    })
}

/// Writes `packets` from a thread of its own until they are all out or the bridge
/// stopped reading for 3 s. The thread returns the bytes that went out and
/// whether that was all of them.
fn flood(
    stream: &UnixStream,
    codec: Codec,
    packets: impl Iterator<Item = (u64, Packet)> + Send + 'static,
) -> std::thread::JoinHandle<(usize, bool)> {
    let mut stream = stream.try_clone().unwrap();
    stream.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    std::thread::spawn(move || {
        let mut written = 0;
        let mut out = BytesMut::new();
        for (id, packet) in packets {
            codec.encode(id, &packet, &mut out).unwrap();
            while !out.is_empty() {
                match stream.write(&out) {
                    Ok(0) | Err(_) => return (written, false),
                    Ok(n) => {
                        written += n;
                        let _ = out.split_to(n);
                    }
                }
            }
        }
        (written, true)
    })
}

/// Growth of the bridge's peak RSS over its idle RSS under the floods below: the
/// default budget lets 64 MiB of OUT data be in flight, plus a 16 MiB packet being
/// read. Before the bridge kept to the budget the same floods took it from 10 MB to
/// 404 MB.
const BRIDGE_GROWTH_BOUND_KIB: u64 = 160 * 1024;
/// IN requests the first guest queues: more than the budget's 1 024 URBs in flight.
const FLOOD_INS: usize = 1_100;
/// OUT packets of 16 MiB the guests send on the loop OUT.
const FLOOD_OUTS: usize = 16;
const FLOOD_OUT_SIZE: usize = 16 << 20;

#[test]
fn a_usbredir_guest_flooding_the_bridge_with_urbs_leaves_it_bounded() {
    // The attack as reported: IN requests that never finish, then 256 MiB of OUT data.
    let packets = bulk_packets(100, FLOOD_INS, 512, LOOP_IN_EP).chain(bulk_packets(
        10_000,
        FLOOD_OUTS,
        FLOOD_OUT_SIZE,
        LOOP_OUT_EP,
    ));
    flood_the_bridge("IN+OUT", Box::new(packets));
}

#[test]
fn a_usbredir_guest_flooding_the_bridge_with_out_data_leaves_it_bounded() {
    // The OUT data first: the bytes in flight, not the URB count, must stop the reads.
    let packets = bulk_packets(100, FLOOD_OUTS, FLOOD_OUT_SIZE, LOOP_OUT_EP)
        .chain(bulk_packets(10_000, FLOOD_INS, 512, LOOP_IN_EP));
    flood_the_bridge("OUT+IN", Box::new(packets));
}

type Packets = Box<dyn Iterator<Item = (u64, Packet)> + Send>;

/// A guest of a bridge to a fresh server sends `packets`: the bridge must stop
/// reading instead of buffering them and stay within its bound; the server keeps
/// serving others.
fn flood_the_bridge(name: &str, packets: Packets) {
    let served = Served::start();
    let bridge = RedirBridge::start(&served);
    let (guest, codec) = bridge.guest();
    let idle = status_kib(&bridge.child, "VmRSS:");
    let (written, all) = flood(&guest, codec, packets).join().unwrap();
    let growth = status_kib(&bridge.child, "VmHWM:").saturating_sub(idle);
    eprintln!("usbredir {name} flood: {written} bytes taken, peak RSS grew by {growth} KiB");
    assert!(!all, "the bridge read the whole flood: it does not push back");
    assert!(growth < BRIDGE_GROWTH_BOUND_KIB, "the flood grew the bridge by {growth} KiB");
    assert!(bridge.child.try_wait_ok(), "the bridge exited");
    drop(guest);
    // The bridge gives the device back once it notices the guest left (behind the
    // flood it could not read); meanwhile the server answers, with the device in use.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !served.lists_available("0-1") {
        assert!(Instant::now() < deadline, "the bridge never gave the device back after its guest left");
        std::thread::sleep(Duration::from_millis(200));
    }
}

trait TryWaitOk {
    fn try_wait_ok(&self) -> bool;
}

impl TryWaitOk for Child {
    /// Still running (reading `/proc` needs no `&mut`).
    fn try_wait_ok(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/status", self.id()))
            .is_ok_and(|status| !status.lines().any(|l| l.starts_with("State:") && l.contains("zombie")))
    }
}
