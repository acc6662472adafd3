//! A usbredir bridge follows a board through both re-enumerations of a DFU
//! flash, through the real binary: `usbwire serve --virtual dfu=FILE` and
//! `usbwire redir -b 0-1 --listen unix:PATH`, with a scripted usbredir guest
//! (QEMU's capabilities) on the socket. DFU_DETACH: the guest gets the
//! detach's reply, then `device_disconnect`, and after its acknowledgement
//! `device_connect` for the bootloader (1209:0007); a download and its
//! manifestation: `device_disconnect`, then the runtime device again
//! (1209:0006), and FILE holds the image. All on one guest connection.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use usbwire_redir::{Caps, Codec, Packet, Side, Status};
use usbwire_testing::process::{free_addr, scratch, start, Running};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");
const RUNTIME: u16 = 0x0006;
const BOOTLOADER: u16 = 0x0007;
/// DFU class requests and states (DFU 1.1).
const DETACH: u8 = 0;
const DNLOAD: u8 = 1;
const GETSTATUS: u8 = 3;
const STATE_DNBUSY: u8 = 4;
const STATE_DNLOAD_IDLE: u8 = 5;
/// The interface DFU requests go to: the runtime's DFU interface, the bootloader's only one.
const RUNTIME_DFU_INTERFACE: u16 = 1;
const DFU_MODE_INTERFACE: u16 = 0;
/// How long any one step may take (the device detaches after 10 ms, manifests in about a second).
const STEP: Duration = Duration::from_secs(15);

/// The guest's end of the bridge's socket: QEMU's usb-redir capabilities.
struct Guest {
    socket: UnixStream,
    codec: Codec,
    received: BytesMut,
    next_id: u64,
}

impl Guest {
    fn connect(path: &Path) -> Self {
        let deadline = Instant::now() + STEP;
        let socket = loop {
            match UnixStream::connect(path) {
                Ok(socket) => break socket,
                Err(error) if Instant::now() < deadline => {
                    let _ = error;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(error) => panic!("the bridge's socket {}: {error}", path.display()),
            }
        };
        socket.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let caps = [
            Caps::CONNECT_DEVICE_VERSION,
            Caps::FILTER,
            Caps::DEVICE_DISCONNECT_ACK,
            Caps::EP_INFO_MAX_PACKET_SIZE,
            Caps::IDS_64,
            Caps::BULK_LENGTH_32,
        ]
        .into_iter()
        .fold(Caps(0), Caps::with);
        let mut guest =
            Self { socket, codec: Codec::new(Side::Guest, caps, 1 << 20), received: BytesMut::new(), next_id: 1 };
        let hello = guest.codec.hello("scripted guest");
        guest.send_with_id(0, &hello);
        guest
    }

    fn send_with_id(&mut self, id: u64, packet: &Packet) {
        let mut wire = BytesMut::new();
        self.codec.encode(id, packet, &mut wire).unwrap();
        self.socket.write_all(&wire).unwrap();
    }

    fn send(&mut self, packet: &Packet) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.send_with_id(id, packet);
        id
    }

    /// The next packet the bridge sends, within [`STEP`].
    fn next(&mut self) -> (u64, Packet) {
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(packet) = self.codec.decode(&mut self.received).unwrap() {
                return packet;
            }
            assert!(Instant::now() < deadline, "nothing from the bridge for {STEP:?}");
            let mut buf = [0u8; 64 * 1024];
            match self.socket.read(&mut buf) {
                Ok(0) => panic!("the bridge closed the guest's connection"),
                Ok(n) => self.received.extend_from_slice(&buf[..n]),
                Err(error) if matches!(error.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                }
                Err(error) => panic!("reading the bridge: {error}"),
            }
        }
    }

    /// Packets up to the first `wanted` one, which is returned; the others are passed to `skipped`.
    fn until(&mut self, what: &str, wanted: impl Fn(&Packet) -> bool) -> (u64, Packet, Vec<Packet>) {
        let mut skipped = Vec::new();
        loop {
            let (id, packet) = self.next();
            if wanted(&packet) {
                return (id, packet, skipped);
            }
            assert!(skipped.len() < 64, "no {what} among {skipped:?}");
            skipped.push(packet);
        }
    }

    /// The device's announce: its VID:PID.
    fn connected(&mut self) -> (u16, u16) {
        let (_, connect, before) = self.until("device_connect", |p| matches!(p, Packet::DeviceConnect { .. }));
        assert!(
            before.iter().any(|p| matches!(p, Packet::InterfaceInfo(_))),
            "interface_info comes before device_connect: {before:?}"
        );
        let Packet::DeviceConnect { vendor_id, product_id, .. } = connect else { unreachable!() };
        (vendor_id, product_id)
    }

    /// Waits for `device_disconnect` (answering nothing else) and acknowledges it, as QEMU does.
    fn disconnected(&mut self) {
        self.until("device_disconnect", |p| matches!(p, Packet::DeviceDisconnect));
        self.send_with_id(0, &Packet::DeviceDisconnectAck);
    }

    /// A control transfer and its reply: (status, IN data).
    fn control(
        &mut self,
        requesttype: u8,
        request: u8,
        value: u16,
        index: u16,
        length: u16,
        data: &[u8],
    ) -> (Status, Bytes) {
        let endpoint = requesttype & 0x80;
        let length = if endpoint == 0 { data.len() as u16 } else { length };
        let id = self.send(&Packet::Control {
            endpoint,
            request,
            requesttype,
            status: Status::SUCCESS,
            value,
            index,
            length,
            data: Bytes::copy_from_slice(data),
        });
        let (_, reply, _) = self.until("the control reply", |p| matches!(p, Packet::Control { .. }));
        let _ = id;
        let Packet::Control { status, data, .. } = reply else { unreachable!() };
        (status, data)
    }

    fn set_configuration(&mut self, configuration: u8) {
        self.send(&Packet::SetConfiguration { configuration });
        let (_, status, _) = self.until("configuration_status", |p| matches!(p, Packet::ConfigurationStatus { .. }));
        assert_eq!(status, Packet::ConfigurationStatus { status: Status::SUCCESS, configuration });
    }

    /// DFU_GETSTATUS: (bStatus, bwPollTimeout, bState).
    fn dfu_status(&mut self) -> (u8, Duration, u8) {
        let (status, data) = self.control(0xa1, GETSTATUS, 0, DFU_MODE_INTERFACE, 6, &[]);
        assert_eq!((status, data.len()), (Status::SUCCESS, 6), "DFU_GETSTATUS");
        let poll = u32::from_le_bytes([data[1], data[2], data[3], 0]);
        (data[0], Duration::from_millis(u64::from(poll)), data[4])
    }
}

fn serve(dir: &Path) -> (Running, String) {
    let addr = free_addr().to_string();
    let mut command = Command::new(BIN);
    command
        .args(["serve", "--no-advertise", "--listen", &addr, "--control"])
        .arg(dir.join("control.sock"))
        .arg("--virtual")
        .arg(format!("dfu={}", dir.join("fw.bin").display()));
    (start(command, "usbwire serving on ").ready(), addr)
}

fn bridge(addr: &str, socket: &Path) -> Running {
    let mut command = Command::new(BIN);
    command.args(["redir", "-v", "-r", addr, "-b", "0-1", "--listen"]).arg(format!("unix:{}", socket.display()));
    start(command, "usbredir for").ready()
}

#[test]
fn a_bridge_follows_a_dfu_flash_through_both_re_enumerations() {
    let dir = scratch("redir-follow", "dfu");
    let (server, addr) = serve(&dir);
    let socket = dir.join("redir.sock");
    let bridge = bridge(&addr, &socket);
    let mut guest = Guest::connect(&socket);

    assert_eq!(guest.connected(), (0x1209, RUNTIME), "the runtime device first");
    guest.set_configuration(1);
    let (status, _) = guest.control(0x21, DETACH, 1000, RUNTIME_DFU_INTERFACE, 0, &[]);
    assert_eq!(status, Status::SUCCESS, "the detach's reply reaches the guest before the device goes");
    let detached = Instant::now();
    guest.disconnected();
    assert_eq!(guest.connected(), (0x1209, BOOTLOADER), "then the bootloader, on the same connection");
    let into_bootloader = detached.elapsed();

    // dfu-util's download: blocks, each polled until idle, then the zero-length block.
    guest.set_configuration(1);
    guest.send(&Packet::SetAltSetting { interface: 0, alt: 0 });
    guest.until("alt_setting_status", |p| matches!(p, Packet::AltSettingStatus { status: Status::SUCCESS, .. }));
    let image: Vec<u8> = (0..10_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    for (block_number, block) in image.chunks(4096).enumerate() {
        let (status, _) = guest.control(0x21, DNLOAD, block_number as u16, DFU_MODE_INTERFACE, 0, block);
        assert_eq!(status, Status::SUCCESS, "block {block_number}");
        loop {
            let (dfu_status, poll, state) = guest.dfu_status();
            assert_eq!(dfu_status, 0, "DFU status after block {block_number}");
            if state == STATE_DNLOAD_IDLE {
                break;
            }
            assert_eq!(state, STATE_DNBUSY);
            std::thread::sleep(poll);
        }
    }
    let (status, _) = guest.control(0x21, DNLOAD, image.len().div_ceil(4096) as u16, DFU_MODE_INTERFACE, 0, &[]);
    assert_eq!(status, Status::SUCCESS, "the zero-length block starts manifestation");
    let (dfu_status, _, _) = guest.dfu_status();
    assert_eq!(dfu_status, 0);
    let manifesting = Instant::now();
    guest.disconnected();
    assert_eq!(guest.connected(), (0x1209, RUNTIME), "the runtime device is back after manifestation");
    let into_runtime = manifesting.elapsed();
    eprintln!(
        "guest saw the bootloader {} ms after the detach's reply, the runtime device {} ms after manifestation began",
        into_bootloader.as_millis(),
        into_runtime.as_millis()
    );
    assert_eq!(std::fs::read(dir.join("fw.bin")).unwrap(), image, "FILE holds the image");
    // The runtime device answers: it is the one the bridge announced.
    guest.set_configuration(1);

    drop(guest);
    let log = bridge.stop();
    assert!(log.contains("the device is back at its bus id"), "{log}");
    assert!(!log.contains("guest session ended"), "the guest's session went on throughout: {log}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
