//! The usbredir bridge's I/O: a device imported over USB/IP, offered to QEMU's
//! `usb-redir` device (or anything else speaking usbredir as usb-guest) on a
//! TCP connection. [`run`] accepts guests on a listening socket (or connects
//! out to a listening QEMU) one at a time; for each it imports the device,
//! drives a [`UsbHost`] core between the two sockets, and releases the import
//! when the guest goes, before serving the next one.
//!
//! The protocol work is in `usbwire_redir::host` (sans I/O); this module only
//! moves bytes and URBs: guest bytes into the core, the core's URBs onto a
//! [`TransferQueue`](crate::TransferQueue), completions back, and the core's
//! bytes to the guest through a writer task.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tracing::{debug, info, warn, Instrument};
use usbwire_proto::op::{BusId, DeviceRecord};
use usbwire_proto::urb::{IsoPacketDescriptor, TransferFlags};
use usbwire_proto::{Direction, Status};
use usbwire_redir::host::{HostError, HostEvent, UrbCommand, UrbRequest, UrbResult};
use usbwire_redir::UsbHost;

use crate::{Backoff, ClientError, Connection, Security, Transfer, TransferError, TransformSpec};

/// The version text of our hello.
const HELLO: &str = concat!("usbwire ", env!("CARGO_PKG_VERSION"));
/// Chunks for the guest queued before the bridge stops taking completions
/// (a guest that does not read slows the device down instead of growing us).
const TO_GUEST_CHUNKS: usize = 64;
/// How often an idle bridge checks that its USB/IP side is still there.
const LIVENESS_TICK: Duration = Duration::from_secs(1);

/// The device side: which device on which server, and how to reach it.
#[derive(Clone)]
pub struct Source {
    pub addr: SocketAddr,
    pub device: WantedDevice,
    pub security: Security,
    pub transforms: Vec<TransformSpec>,
}

/// Whether a listed device (and its serial, when the server reports one) is the one.
pub type DeviceMatcher = dyn Fn(&DeviceRecord, Option<&str>) -> bool + Send + Sync;

/// Which device a guest gets: one bus id, or the first device the server
/// lists that a rule matches (looked up anew for each guest, so a device
/// plugged in later is found).
#[derive(Clone)]
pub enum WantedDevice {
    BusId(BusId),
    Matching {
        /// The rule as the user wrote it, for logs and errors.
        rule: String,
        /// Whether a listed device (and its serial, when the server reports one) matches.
        matches: Arc<DeviceMatcher>,
    },
}

impl fmt::Display for WantedDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BusId(busid) => write!(f, "{busid}"),
            Self::Matching { rule, .. } => f.write_str(rule),
        }
    }
}

impl WantedDevice {
    /// The bus id to import now.
    async fn resolve(&self, addr: SocketAddr, security: &Security) -> Result<BusId, ClientError> {
        let (rule, matches) = match self {
            Self::BusId(busid) => return Ok(busid.clone()),
            Self::Matching { rule, matches } => (rule, matches),
        };
        let devices = crate::list_devices(addr, security).await?;
        let states = crate::device_states(addr, security).await.ok().flatten().unwrap_or_default();
        let serial_of = |busid: &BusId| states.iter().find(|s| s.busid == busid.as_str()).map(|s| s.serial.as_str());
        devices
            .iter()
            .find(|d| matches(d, serial_of(&d.busid)))
            .map(|d| d.busid.clone())
            .ok_or_else(|| ClientError::NoMatchingDevice { addr, rule: rule.clone() })
    }
}

/// The guest side: wait for QEMU to connect, or connect to a listening QEMU.
#[derive(Clone, Copy, Debug)]
pub enum GuestSide {
    Listen(SocketAddr),
    Connect(SocketAddr),
}

/// Why one guest's session ended badly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BridgeError {
    /// The device could not be imported (see [`ClientError`]).
    #[error("importing the device failed: {0}")]
    Import(#[from] ClientError),
    /// The guest broke the protocol, or the device's descriptors could not be read.
    #[error(transparent)]
    Host(#[from] HostError),
    /// The guest's socket failed.
    #[error("the guest connection failed: {0}")]
    Guest(#[from] std::io::Error),
    /// The USB/IP connection ended while the guest used the device.
    #[error("the USB/IP connection to the device was lost")]
    DeviceLost,
}

/// How a guest's session ended without an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// The guest closed the connection.
    GuestLeft,
    /// The guest's filter refuses this device, or it rejected it.
    Refused(String),
}

/// Serves guests until the listening socket fails: one at a time, each with
/// its own import of the device. Returns only on a listen error.
pub async fn run(source: Source, guest: GuestSide) -> Result<(), BridgeError> {
    match guest {
        GuestSide::Listen(addr) => {
            let listener = TcpListener::bind(addr).await?;
            serve_listener(source, listener).await
        }
        GuestSide::Connect(addr) => {
            let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
            loop {
                match TcpStream::connect(addr).await {
                    Ok(stream) => {
                        backoff.reset();
                        serve_logged(&source, stream, addr).await;
                        // The guest went; a restarted QEMU listens again shortly.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(error) => {
                        let delay = backoff.next_delay();
                        debug!(target: "usbwire::redir", %addr, %error, ?delay, "no usb-redir guest listening yet");
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        }
    }
}

/// Serves guests that connect to `listener`, one at a time, until accepting fails.
pub async fn serve_listener(source: Source, listener: TcpListener) -> Result<(), BridgeError> {
    let addr = listener.local_addr()?;
    info!(target: "usbwire::redir", %addr, device = %source.device, "waiting for a usb-redir guest");
    loop {
        let (stream, peer) = listener.accept().await?;
        serve_logged(&source, stream, peer).await;
    }
}

async fn serve_logged(source: &Source, stream: TcpStream, peer: SocketAddr) {
    let span = tracing::info_span!(target: "usbwire::redir", "guest", %peer, device = %source.device);
    async {
        info!(target: "usbwire::redir", "guest connected");
        match serve_guest(source, stream).await {
            Ok(Ended::GuestLeft) => info!(target: "usbwire::redir", "guest disconnected; device released"),
            Ok(Ended::Refused(why)) => {
                warn!(target: "usbwire::redir", reason = %why, "the guest does not take this device; connection closed")
            }
            Err(error) => warn!(target: "usbwire::redir", %error, "guest session ended; device released"),
        }
    }
    .instrument(span)
    .await
}

/// One guest: imports the device, bridges until either side goes, releases it.
pub async fn serve_guest(source: &Source, stream: TcpStream) -> Result<Ended, BridgeError> {
    stream.set_nodelay(true)?;
    let (mut reader, mut writer) = stream.into_split();
    let mut inbuf = BytesMut::with_capacity(64 * 1024);
    let Some((connection, device)) = import_while_guest_waits(source, &mut reader, &mut inbuf).await? else {
        return Ok(Ended::GuestLeft);
    };
    info!(target: "usbwire::redir", resumable = connection.is_resumable(), speed = device.speed.name(),
        vid = format_args!("{:04x}", device.id_vendor), pid = format_args!("{:04x}", device.id_product), "device imported");
    let (to_guest, mut outgoing) = mpsc::channel::<bytes::Bytes>(TO_GUEST_CHUNKS);
    let writer_task = tokio::spawn(async move {
        while let Some(bytes) = outgoing.recv().await {
            writer.write_all(&bytes).await?;
        }
        writer.shutdown().await
    });
    let mut bridge = Bridge {
        host: UsbHost::new(HELLO, device.speed),
        queue: connection.queue(),
        seqnums: HashMap::new(),
        tags: HashMap::new(),
    };
    let outcome = bridge.run(&connection, &mut reader, &mut inbuf, &to_guest).await;
    let traffic = bridge.host.traffic();
    info!(target: "usbwire::redir", control = traffic.control, bulk = traffic.bulk,
        interrupt_in = traffic.interrupt_in, interrupt_out = traffic.interrupt_out,
        iso_in_packets = traffic.iso_in_packets, iso_out_packets = traffic.iso_out_packets, "guest traffic");
    drop(to_guest);
    // What the core said last (a device_disconnect) reaches the guest before the socket closes.
    let _ = tokio::time::timeout(Duration::from_secs(1), writer_task).await;
    drop(bridge);
    connection.close().await;
    outcome
}

/// Imports the device, retrying (backing off) while the guest stays; the
/// guest's first bytes (its hello) are kept in `inbuf`. `None`: the guest left.
async fn import_while_guest_waits(
    source: &Source,
    reader: &mut tokio::net::tcp::OwnedReadHalf,
    inbuf: &mut BytesMut,
) -> Result<Option<(Connection, usbwire_proto::op::DeviceRecord)>, BridgeError> {
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(10));
    loop {
        let imported = match source.device.resolve(source.addr, &source.security).await {
            Ok(busid) => Connection::import_resumable(source.addr, &busid, &source.security, &source.transforms).await,
            Err(error) => Err(error),
        };
        match imported {
            Ok(imported) => return Ok(Some(imported)),
            Err(error @ (ClientError::UnknownServer { .. } | ClientError::ServerKeyChanged { .. })) => {
                return Err(error.into());
            }
            Err(error) => {
                let delay = backoff.next_delay();
                warn!(target: "usbwire::redir", %error, retry_in = ?delay, "cannot import the device yet; the guest waits");
                let sleep = tokio::time::sleep(delay);
                tokio::pin!(sleep);
                loop {
                    tokio::select! {
                        _ = &mut sleep => break,
                        read = reader.read_buf(inbuf) => {
                            if read? == 0 {
                                return Ok(None);
                            }
                            if inbuf.len() > 1 << 20 {
                                // A guest does not send much before it has a device.
                                return Err(BridgeError::Guest(std::io::Error::other("the guest sent over 1 MiB before the device was there")));
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The running bridge of one guest: the core and the URB bookkeeping.
struct Bridge {
    host: UsbHost,
    queue: crate::TransferQueue,
    /// Core tag → USB/IP seqnum, for cancels.
    seqnums: HashMap<u64, u32>,
    /// USB/IP seqnum → core tag, for completions.
    tags: HashMap<u32, u64>,
}

impl Bridge {
    async fn run(
        &mut self,
        connection: &Connection,
        reader: &mut tokio::net::tcp::OwnedReadHalf,
        inbuf: &mut BytesMut,
        to_guest: &mpsc::Sender<bytes::Bytes>,
    ) -> Result<Ended, BridgeError> {
        // A hello that came while the import was under way.
        self.host.handle_guest(inbuf)?;
        let mut tick = tokio::time::interval(LIVENESS_TICK);
        loop {
            if let Some(ended) = self.handle_events() {
                self.flush(to_guest).await;
                return Ok(ended);
            }
            self.issue_commands(connection).await;
            self.flush(to_guest).await;
            tokio::select! {
                read = reader.read_buf(inbuf) => {
                    if read? == 0 {
                        return Ok(Ended::GuestLeft);
                    }
                    self.host.handle_guest(inbuf)?;
                    inbuf.reserve(64 * 1024);
                }
                completion = self.queue.next_complete(), if self.queue.pending() > 0 => {
                    match completion {
                        Some(Ok(ret)) => {
                            self.complete(ret)?;
                            while let Some(ret) = self.queue.try_next_complete() {
                                self.complete(ret)?;
                            }
                        }
                        Some(Err(_)) | None => return self.lost(to_guest).await,
                    }
                }
                _ = tick.tick() => {
                    if connection.is_closed() {
                        return self.lost(to_guest).await;
                    }
                }
            }
        }
    }

    fn handle_events(&mut self) -> Option<Ended> {
        while let Some(event) = self.host.poll_event() {
            match event {
                HostEvent::GuestHello { version } => info!(target: "usbwire::redir", %version, "guest said hello"),
                HostEvent::Announced => info!(target: "usbwire::redir", "device announced to the guest"),
                HostEvent::FilteredOut { rules } => {
                    return Some(Ended::Refused(format!("its usbredir filter ({rules}) refuses the device")));
                }
                HostEvent::GuestRejected => return Some(Ended::Refused("it rejected the device".into())),
                HostEvent::DisconnectAcknowledged => {
                    debug!(target: "usbwire::redir", "guest acknowledged the disconnect")
                }
                other => debug!(target: "usbwire::redir", ?other, "bridge event"),
            }
        }
        None
    }

    async fn issue_commands(&mut self, connection: &Connection) {
        while let Some(command) = self.host.poll_urb() {
            match command {
                UrbCommand::Submit { tag, urb } => match self.queue.submit(transfer_of(urb)) {
                    Ok(seqnum) => {
                        self.seqnums.insert(tag, seqnum);
                        self.tags.insert(seqnum, tag);
                    }
                    // The connection is gone; the liveness check ends the session.
                    Err(TransferError::Disconnected) => {}
                    Err(error) => debug!(target: "usbwire::redir", %error, "submit failed"),
                },
                UrbCommand::Cancel { tag } => {
                    if let Some(&seqnum) = self.seqnums.get(&tag) {
                        let _ = connection.unlink(seqnum).await;
                    }
                }
            }
        }
    }

    fn complete(&mut self, ret: usbwire_proto::urb::RetSubmit) -> Result<(), HostError> {
        let Some(tag) = self.tags.remove(&ret.seqnum) else { return Ok(()) };
        self.seqnums.remove(&tag);
        let result = UrbResult {
            status: ret.status,
            actual_length: ret.actual_length,
            data: ret.data,
            iso_packets: ret.iso_packets,
        };
        self.host.handle_urb(tag, result)
    }

    async fn flush(&mut self, to_guest: &mpsc::Sender<bytes::Bytes>) {
        let out = self.host.to_guest();
        if !out.is_empty() {
            // An error means the writer ended (the guest's socket failed); the read side sees it too.
            let _ = to_guest.send(out.split().freeze()).await;
        }
    }

    async fn lost(&mut self, to_guest: &mpsc::Sender<bytes::Bytes>) -> Result<Ended, BridgeError> {
        self.host.device_lost();
        self.flush(to_guest).await;
        Err(BridgeError::DeviceLost)
    }
}

/// The client's [`Transfer`] for a core's URB.
fn transfer_of(urb: UrbRequest) -> Transfer {
    let direction = if urb.is_in() { Direction::In } else { Direction::Out };
    let mut flags = if urb.is_in() { TransferFlags::DIR_IN } else { 0 };
    let iso_packets = (!urb.iso_packet_lengths.is_empty()).then(|| {
        flags |= TransferFlags::ISO_ASAP;
        let mut offset = 0;
        urb.iso_packet_lengths
            .iter()
            .map(|&length| {
                let descriptor = IsoPacketDescriptor { offset, length, actual_length: 0, status: Status::OK };
                offset += length;
                descriptor
            })
            .collect()
    });
    let interval = if iso_packets.is_some() { 1 } else { 0 };
    Transfer {
        endpoint: urb.endpoint & 0x0f,
        direction,
        setup: urb.setup,
        flags,
        length: urb.length,
        data: urb.data,
        interval,
        iso_packets,
    }
}
