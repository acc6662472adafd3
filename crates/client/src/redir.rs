//! The usbredir bridge's I/O: a device imported over USB/IP, offered to QEMU's
//! `usb-redir` device (or anything else speaking usbredir as usb-guest) on a
//! Unix socket or a TCP connection. [`serve_listener`] accepts guests on a
//! listening socket, [`run`] listens on TCP or connects out to a listening
//! QEMU, one guest at a time; for each it imports the device,
//! drives a [`UsbHost`] core between the two sockets, and releases the import
//! when the guest goes, before serving the next one.
//!
//! The protocol work is in `usbwire_redir::host` and the bridge's decisions
//! in [`BridgeCore`] (both sans I/O); this module only moves bytes: guest
//! bytes into the core, completions from the
//! [`TransferQueue`](crate::TransferQueue) back, and the core's bytes to the
//! guest, all from one task.
//!
//! A bridge that follows its device ([`Source::follow`]) keeps the guest
//! through re-enumerations: when the import ends because the device
//! re-enumerated (END `REENUMERATED` from a usbwire server, or, from a
//! stock one, the connection just ending), the guest is told
//! `device_disconnect`, the same bus id is imported again as
//! `usbwire attach --follow` does it ([`crate::follow::Reimport`]), and the
//! guest gets `device_connect` with the new device's descriptors, so it sees
//! an unplug and a plug, as with a board on a local port.
//!
//! Nothing here grows with what the guest sends: the bridge reads from the
//! guest only while the URBs it has in flight, and their bytes, are under the
//! connection's [`Budget`] (the server's default, which the client connection
//! keeps too), and while what waits to be written to the guest is under the
//! budget's `queued_reply_bytes`; past either, it waits for completions or for
//! the guest to read.
//!
//! usbredir has no authentication: whoever connects to the listening socket
//! gets the device. Making that socket private (a Unix socket only its user,
//! or QEMU's group, may open) is the caller's job; `usbwire` does it.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use tokio::io::Ready;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tracing::{debug, info, warn, Instrument};
use usbwire_proto::op::{BusId, DeviceRecord};
use usbwire_proto::Budget;
use usbwire_redir::UsbHost;

use crate::follow::{FollowError, Reimport, WentAway};
use usbwire_proto::retry::Retry;

use crate::{ClientError, Connection, ConnectionEnd, Imported, Security, TransformSpec};

mod bridge;

pub use bridge::{BridgeCore, BridgeError, Completion, Ended};

/// The version text of our hello.
const HELLO: &str = concat!("usbwire ", env!("CARGO_PKG_VERSION"));

/// The device side: which device on which server, and how to reach it.
#[derive(Clone)]
pub struct Source {
    pub addr: SocketAddr,
    pub device: WantedDevice,
    pub security: Security,
    pub transforms: Vec<TransformSpec>,
    /// Follow the device through re-enumerations: when it goes away and
    /// comes back at the bus id it was imported from (with any VID:PID), the
    /// guest sees it unplugged and plugged in again instead of losing it.
    /// `usbwire redir` (by bus id) follows; `[[redir]]` rules as `[[attach]]`'s.
    pub follow: bool,
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

/// Serves guests until the listening socket fails: one at a time, each with
/// its own import of the device. Returns only on a listen error.
pub async fn run(source: Source, guest: GuestSide) -> Result<(), BridgeError> {
    match guest {
        GuestSide::Listen(addr) => {
            let listener = TcpListener::bind(addr).await?;
            serve_listener(source, listener).await
        }
        GuestSide::Connect(addr) => {
            let mut backoff = Retry::PATIENT.backoff();
            loop {
                match TcpStream::connect(addr).await {
                    Ok(stream) => {
                        backoff.reset();
                        serve_logged(&source, stream.into(), &addr.to_string()).await;
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

/// Where guests connect: a Unix socket (the private default) or TCP.
#[derive(Debug)]
pub enum GuestListener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl From<UnixListener> for GuestListener {
    fn from(listener: UnixListener) -> Self {
        Self::Unix(listener)
    }
}

impl From<TcpListener> for GuestListener {
    fn from(listener: TcpListener) -> Self {
        Self::Tcp(listener)
    }
}

impl GuestListener {
    /// The next guest, and who it is for the log (its address, or its uid and pid).
    async fn accept(&self) -> std::io::Result<(GuestStream, String)> {
        match self {
            Self::Tcp(listener) => {
                let (stream, peer) = listener.accept().await?;
                Ok((GuestStream::Tcp(stream), peer.to_string()))
            }
            Self::Unix(listener) => {
                let (stream, _) = listener.accept().await?;
                let peer = match stream.peer_cred() {
                    Ok(cred) => format!("uid {} pid {}", cred.uid(), cred.pid().unwrap_or(0)),
                    Err(_) => "unix socket".to_owned(),
                };
                Ok((GuestStream::Unix(stream), peer))
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Tcp(listener) => listener.local_addr().map_or_else(|_| "tcp".to_owned(), |a| a.to_string()),
            Self::Unix(listener) => listener
                .local_addr()
                .ok()
                .and_then(|a| a.as_pathname().map(|p| format!("unix:{}", p.display())))
                .unwrap_or_else(|| "unix socket".to_owned()),
        }
    }
}

/// One guest's connection, over a Unix socket or TCP.
#[derive(Debug)]
pub enum GuestStream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl From<UnixStream> for GuestStream {
    fn from(stream: UnixStream) -> Self {
        Self::Unix(stream)
    }
}

impl From<TcpStream> for GuestStream {
    fn from(stream: TcpStream) -> Self {
        Self::Tcp(stream)
    }
}

impl GuestStream {
    async fn ready(&self, interest: Interest) -> std::io::Result<Ready> {
        match self {
            Self::Unix(stream) => stream.ready(interest).await,
            Self::Tcp(stream) => stream.ready(interest).await,
        }
    }

    async fn writable(&self) -> std::io::Result<()> {
        match self {
            Self::Unix(stream) => stream.writable().await,
            Self::Tcp(stream) => stream.writable().await,
        }
    }

    fn try_read_buf(&self, buf: &mut BytesMut) -> std::io::Result<usize> {
        match self {
            Self::Unix(stream) => stream.try_read_buf(buf),
            Self::Tcp(stream) => stream.try_read_buf(buf),
        }
    }

    fn try_write(&self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Self::Unix(stream) => stream.try_write(buf),
            Self::Tcp(stream) => stream.try_write(buf),
        }
    }

    /// Clears the readiness `interest` had (until the socket changes again).
    fn clear_ready(&self, interest: Interest) {
        let would_block = || Err::<(), _>(std::io::Error::from(std::io::ErrorKind::WouldBlock));
        let _ = match self {
            Self::Unix(stream) => stream.try_io(interest, would_block),
            Self::Tcp(stream) => stream.try_io(interest, would_block),
        };
    }

    async fn read_buf(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        match self {
            Self::Unix(stream) => stream.read_buf(buf).await,
            Self::Tcp(stream) => stream.read_buf(buf).await,
        }
    }

    async fn write_all_and_close(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Self::Unix(stream) => {
                stream.write_all(bytes).await?;
                stream.shutdown().await
            }
            Self::Tcp(stream) => {
                stream.write_all(bytes).await?;
                stream.shutdown().await
            }
        }
    }
}

/// Serves guests that connect to `listener`, one at a time, until accepting fails.
pub async fn serve_listener(source: Source, listener: impl Into<GuestListener>) -> Result<(), BridgeError> {
    let listener = listener.into();
    let addr = listener.describe();
    info!(target: "usbwire::redir", %addr, device = %source.device, "waiting for a usb-redir guest");
    loop {
        let (stream, peer) = listener.accept().await?;
        serve_logged(&source, stream, &peer).await;
    }
}

async fn serve_logged(source: &Source, stream: GuestStream, peer: &str) {
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

/// One guest: imports the device, bridges until either side goes (a device
/// that is followed may go and come back meanwhile), releases it.
pub async fn serve_guest(source: &Source, stream: impl Into<GuestStream>) -> Result<Ended, BridgeError> {
    let mut stream = stream.into();
    if let GuestStream::Tcp(tcp) = &stream {
        tcp.set_nodelay(true)?;
    }
    let mut inbuf = BytesMut::with_capacity(64 * 1024);
    let Some((connection, device)) = import_while_guest_waits(source, &mut stream, &mut inbuf).await? else {
        return Ok(Ended::GuestLeft);
    };
    info!(target: "usbwire::redir", resumable = connection.is_resumable(), speed = device.speed.name(),
        vid = format_args!("{:04x}", device.id_vendor), pid = format_args!("{:04x}", device.id_product), "device imported");
    let mut bridge = BridgeCore::new(UsbHost::new(HELLO, device.speed), connection.queue(), Budget::default());
    let mut side = DeviceSide::new(source, device.busid.clone(), connection);
    let outcome = run_bridge(&mut bridge, &mut side, &stream, &mut inbuf).await;
    let traffic = bridge.traffic();
    info!(target: "usbwire::redir", control = traffic.control, bulk = traffic.bulk,
        interrupt_in = traffic.interrupt_in, interrupt_out = traffic.interrupt_out,
        iso_in_packets = traffic.iso_in_packets, iso_out_packets = traffic.iso_out_packets,
        reenumerations = side.followed, "guest traffic");
    // What the core said last (a device_disconnect) reaches the guest before the socket closes.
    let last = bridge.to_guest();
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all_and_close(last)).await;
    drop(bridge);
    side.close().await;
    outcome
}

/// What a followed device's way back resolves to.
type Return = Pin<Box<dyn Future<Output = Result<Imported, FollowError>> + Send>>;

/// The device behind a guest's bridge: imported, or, when it went away and
/// is followed, being imported again at its bus id.
struct DeviceSide<'a> {
    source: &'a Source,
    busid: BusId,
    /// The current import (`None` while the device is away).
    connection: Option<Connection>,
    /// Resolves when the current import's connection ends.
    ended: Pin<Box<dyn Future<Output = ConnectionEnd> + Send>>,
    /// Following: since when the device is away, and its import again.
    returning: Option<(Instant, Return)>,
    /// Times the device came back.
    followed: u64,
}

impl<'a> DeviceSide<'a> {
    fn new(source: &'a Source, busid: BusId, connection: Connection) -> Self {
        let ended = Box::pin(connection.ended());
        Self { source, busid, connection: Some(connection), ended, returning: None, followed: 0 }
    }

    /// The device went away (its connection `end`ed, or a completion said
    /// so and the end is still to come): the core tells the guest; unless
    /// the device is followed, that ends the guest's session. A followed
    /// device is imported again, once the connection's end says why it went
    /// (which decides how long to try).
    fn went_away(&mut self, core: &mut BridgeCore, end: Option<ConnectionEnd>) -> Result<(), BridgeError> {
        let lost = core.device_lost();
        if !self.source.follow {
            return Err(lost);
        }
        if self.returning.is_some() {
            return Ok(());
        }
        let ended = std::mem::replace(&mut self.ended, Box::pin(std::future::pending()));
        // Its relay has ended or is ending; nothing more goes over it.
        self.connection = None;
        let Source { addr, security, transforms, .. } = self.source;
        let reimport = Reimport {
            addr: *addr,
            security: security.clone(),
            transforms: transforms.clone(),
            busid: self.busid.clone(),
            resumable: true,
            reservation: None,
            persistence: crate::follow::Persistence::Bounded,
            accelerate: true,
        };
        let back = async move {
            let end = match end {
                Some(end) => end,
                None => ended.await,
            };
            let went =
                WentAway::of(&end).unwrap_or_else(|| WentAway::ConnectionEnded("the connection was closed".into()));
            info!(target: "usbwire::redir", busid = %reimport.busid, why = %went,
                "the device went away; the guest was told, importing its bus id again");
            reimport.after(&went).await
        };
        self.returning = Some((Instant::now(), Box::pin(back)));
        Ok(())
    }

    /// The followed device is back: the core moves onto the new import and
    /// announces the new device to the guest.
    fn came_back(&mut self, core: &mut BridgeCore, imported: Imported) {
        let since = self.returning.take().map(|(since, _)| since);
        let Source { addr, security, transforms, .. } = self.source;
        let (connection, device) = Connection::from_imported(imported, *addr, security, transforms);
        self.followed += 1;
        info!(target: "usbwire::redir", busid = %self.busid, resumable = connection.is_resumable(),
            vid = format_args!("{:04x}", device.id_vendor), pid = format_args!("{:04x}", device.id_product),
            back_ms = since.map_or(0, |since| since.elapsed().as_millis() as u64), times = self.followed,
            "the device is back at its bus id; announcing it to the guest");
        core.replace_device(device.speed, connection.queue());
        self.ended = Box::pin(connection.ended());
        self.connection = Some(connection);
    }

    /// The import, if any, ends (the server is told, and releases the device).
    async fn close(&mut self) {
        self.returning = None;
        if let Some(connection) = self.connection.take() {
            connection.close().await;
        }
    }
}

/// Imports the device, retrying (backing off) while the guest stays; the
/// guest's first bytes (its hello) are kept in `inbuf`. `None`: the guest left.
async fn import_while_guest_waits(
    source: &Source,
    reader: &mut GuestStream,
    inbuf: &mut BytesMut,
) -> Result<Option<(Connection, DeviceRecord)>, BridgeError> {
    let mut backoff = Retry::PATIENT.backoff();
    loop {
        let imported = match source.device.resolve(source.addr, &source.security).await {
            Ok(busid) => Connection::import_resumable(source.addr, &busid, &source.security, &source.transforms).await,
            Err(error) => Err(error),
        };
        match imported {
            Ok(imported) => return Ok(Some(imported)),
            Err(
                error @ (ClientError::UnknownServer { .. }
                | ClientError::ServerKeyChanged { .. }
                | ClientError::NotTheRegisteredKey { .. }),
            ) => {
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

/// Runs `core` between the guest's socket and the USB/IP connection until
/// either side goes or the guest refuses the device; a followed device that
/// goes away is imported again meanwhile (the guest is served throughout).
async fn run_bridge(
    core: &mut BridgeCore,
    device: &mut DeviceSide<'_>,
    guest: &GuestStream,
    inbuf: &mut BytesMut,
) -> Result<Ended, BridgeError> {
    // A hello that came while the import was under way.
    core.handle_guest(inbuf)?;
    loop {
        if let Some(ended) = core.poll_ended() {
            return Ok(ended);
        }
        core.issue_commands()?;
        let to_guest = core.to_guest().len();
        let read_guest = core.reads_guest();
        let returning = device.returning.is_some();
        let collect = !returning && core.collects_completions();
        let (ended, back) = (&mut device.ended, device.returning.as_mut().map(|(_, back)| back));
        tokio::select! {
            ready = guest.ready(Interest::READABLE) => {
                if read_guest {
                    match guest.try_read_buf(inbuf) {
                        Ok(0) => return Ok(Ended::GuestLeft),
                        Ok(_) => {
                            core.handle_guest(inbuf)?;
                            inbuf.reserve(64 * 1024);
                        }
                        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(error) => return Err(error.into()),
                    }
                } else if ready?.is_read_closed() {
                    // Gone with bytes we had no room for: no need to read them to know.
                    return Ok(Ended::GuestLeft);
                } else {
                    // Bytes we have no room for yet: wait for the next change (more
                    // bytes, or the guest hanging up) rather than spin on these.
                    guest.clear_ready(Interest::READABLE);
                }
            }
            writable = guest.writable(), if to_guest > 0 => {
                writable?;
                match guest.try_write(core.to_guest()) {
                    Ok(wrote) => core.to_guest().advance(wrote),
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(error) => return Err(error.into()),
                }
            }
            completion = core.next_complete(), if collect => match core.handle_completion(completion) {
                Ok(()) => {}
                Err(BridgeError::DeviceLost) => device.went_away(core, None)?,
                Err(error) => return Err(error),
            },
            end = ended, if !returning => device.went_away(core, Some(end))?,
            imported = async { match back { Some(back) => back.await, None => std::future::pending().await } },
                if returning => device.came_back(core, imported.map_err(|e| BridgeError::NotBack(Box::new(e)))?),
        }
    }
}
