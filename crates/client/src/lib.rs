//! The USB/IP client side, in userspace: list a server's devices, import one,
//! and run URBs on it with many in flight.
//!
//! [`list_devices`] and [`import`] speak the OP phase. An imported device's
//! socket becomes a [`Connection`]: [`Connection::submit`] sends a
//! `CMD_SUBMIT` and resolves when its `RET_SUBMIT` arrives (replies are
//! matched by seqnum, in any order); [`Connection::unlink`] sends
//! `CMD_UNLINK`. No kernel module is involved. For many URBs in flight from
//! one task, a [`TransferQueue`] ([`Connection::queue`]) delivers completions
//! in batches instead of one future per URB.
//!
//! Not for the kernel's vhci-hcd attach path (that hands the socket to the
//! kernel instead of keeping it).

pub mod describe;
mod queue;
pub mod reattach;
pub mod vhci;

pub use queue::TransferQueue;
pub use reattach::{Backoff, ReattachingDevice};
pub use usbwire_transport::transform::TransformSpec;
use usbwire_transport::transform::{Pipeline, Side, TransformedStream};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Waker;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tracing::debug;
use usbwire_proto::op::{self, BusId, DeviceRecord, OpRequest, OpStatus};
use usbwire_proto::urb::{
    self, CmdSubmit, CmdUnlink, IsoPacketDescriptor, RetSubmit, ServerMessage, SubmittedShape, TransferFlags,
};
use usbwire_proto::{DecodeError, Direction, Limits, RecvBuffer, SeqnumMap, Status};
use usbwire_transport::known_servers::KnownServers;
use usbwire_transport::tls::ServerTrust;
use usbwire_transport::{Fingerprint, Identity, PeerStream};

/// OUT payloads up to this size are copied next to their header (one write).
const SMALL_PAYLOAD: usize = 16 * 1024;

/// How long the OP phase may take before we give up on a server.
const OP_TIMEOUT: Duration = Duration::from_secs(10);

/// Client-side failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Nothing listens there, or the network is in the way.
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: std::io::Error },
    /// The server did not answer the request in time.
    #[error("{addr} did not answer within {} s", OP_TIMEOUT.as_secs())]
    Timeout { addr: String },
    /// The server closed the connection or the socket failed.
    #[error("connection lost: {0}")]
    Io(#[from] std::io::Error),
    /// The server sent something that is not USB/IP v1.1.1.
    #[error("protocol error: {0}")]
    Protocol(#[from] DecodeError),
    /// The server refused the import.
    #[error("server refused {busid}: {}", .status.describe())]
    Refused { busid: String, status: OpStatus },
    /// TLS: the server's key is not pinned yet and trusting a new one was not allowed.
    #[error("{addr} presented an unknown key {fingerprint}; if that is the server's (`usbwire identity` on it shows it), run again with --trust-new to pin it in {}", .known.display())]
    UnknownServer { addr: String, fingerprint: String, known: std::path::PathBuf },
    /// TLS: the server's key differs from the pinned one.
    #[error("{addr} presented key {got}, but {expected} is pinned in {}: someone may be in the middle; if the server's key really changed, remove its line from that file", .known.display())]
    ServerKeyChanged { addr: String, expected: String, got: String, known: std::path::PathBuf },
    /// TLS: the handshake failed (for instance the server does not know our identity).
    #[error(
        "TLS with {addr} failed: {reason} (does the server allow this client's identity? `usbwire identity` shows it)"
    )]
    Tls { addr: String, reason: String },
    /// TLS: the server does not admit this client's identity (an access-denied alert).
    #[error(
        "{addr} does not admit this client (identity {fingerprint}): ask its administrator to allow it (`usbwire serve --allow {fingerprint}`, or an [[allow]] rule)"
    )]
    NotAdmitted { addr: String, fingerprint: String },
    /// TLS: the server refused this client's CA-issued certificate as expired or not yet valid.
    #[error(
        "{addr} refused this client's certificate as expired or not yet valid: have the CA issue a new one (`usbwire identity --ca-issue NAME --days N`) and check this machine's clock"
    )]
    CertificateExpired { addr: String },
    /// The server closed the connection before answering (plain USB/IP refused, or TLS required).
    #[error(
        "{addr} closed the connection without answering (it may require TLS: use --tls, or it refused this client)"
    )]
    ClosedWithoutAnswer { addr: String },
    /// The server answered an import for another bus id.
    #[error("{addr} did not agree to stream transforms (a usbwire server is needed; leave out --compress / --jitter-buffer)")]
    NoTransforms { addr: String },
    #[error("server answered for bus id {got} instead of {wanted}")]
    WrongDevice { wanted: String, got: String },
}

/// Why a URB did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The connection to the server ended (the device may be gone).
    #[error("connection to the server lost")]
    Disconnected,
    /// The endpoint stalled (-EPIPE): clear the halt, or the request is not supported.
    #[error("endpoint stalled")]
    Stall,
    /// The device sent more than the buffer holds (-EOVERFLOW, babble).
    #[error("device sent more data than requested (babble)")]
    Overflow,
    /// The URB was cancelled (-ECONNRESET / -ENOENT), usually by our unlink.
    #[error("transfer cancelled")]
    Cancelled,
    /// The device went away on the server (-ENODEV / -ESHUTDOWN).
    #[error("device gone")]
    DeviceGone,
    /// Any other failure status the server reported.
    #[error("transfer failed: {0}")]
    Failed(Status),
}

impl TransferError {
    /// The typed error for a failed URB status (`None` for success and for a
    /// short read, which is not an error unless the caller asked for it).
    pub fn from_status(status: Status) -> Option<Self> {
        Some(match status {
            Status::OK => return None,
            Status::EPIPE => Self::Stall,
            Status::EOVERFLOW => Self::Overflow,
            Status::ECONNRESET | Status::ENOENT => Self::Cancelled,
            Status::ENODEV | Status::ESHUTDOWN => Self::DeviceGone,
            other => Self::Failed(other),
        })
    }
}

/// Resolves `HOST`, `HOST:PORT` or `[V6]:PORT` (default port 3240).
pub async fn resolve(target: &str) -> Result<SocketAddr, ClientError> {
    let with_port = if target.parse::<SocketAddr>().is_ok() || has_port(target) {
        target.to_owned()
    } else {
        format!("{target}:{}", usbwire_proto::DEFAULT_PORT)
    };
    let connect_error = |source| ClientError::Connect { addr: target.to_owned(), source };
    let mut addrs = tokio::net::lookup_host(&with_port).await.map_err(connect_error)?;
    addrs.next().ok_or_else(|| connect_error(std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))
}

fn has_port(target: &str) -> bool {
    match target.rsplit_once(':') {
        Some((host, port)) => !host.contains(':') && port.parse::<u16>().is_ok(),
        None => false,
    }
}

/// How to reach a server: plain USB/IP, or TLS 1.3 with our identity and the
/// server's pinned fingerprint.
#[derive(Clone, Default)]
pub enum Security {
    #[default]
    Plain,
    Tls(Arc<TlsClient>),
}

/// A client identity and where pinned server keys are kept.
#[derive(Debug)]
pub struct TlsClient {
    pub identity: Identity,
    pub known: KnownServers,
    /// Pin an unknown server's key on first use instead of refusing it.
    pub trust_new: bool,
}

async fn connect(addr: SocketAddr, security: &Security) -> Result<PeerStream, ClientError> {
    let tcp = connect_tcp(addr).await?;
    let Security::Tls(tls) = security else {
        return Ok(PeerStream::Plain(tcp));
    };
    let key = addr.to_string();
    let pinned = tls.known.lookup(&key);
    let trust = match (pinned, tls.trust_new) {
        (Some(fingerprint), _) => ServerTrust::Pinned(fingerprint),
        (None, true) => ServerTrust::FirstUse,
        (None, false) => ServerTrust::Unknown,
    };
    let (config, seen) = usbwire_transport::tls::client_config(&tls.identity, trust)
        .map_err(|e| ClientError::Tls { addr: key.clone(), reason: e.to_string() })?;
    let connector = tokio_rustls::TlsConnector::from(config);
    let handshake = tokio::time::timeout(
        OP_TIMEOUT,
        connector.connect(usbwire_transport::tls::server_name(), usbwire_transport::tls_socket(tcp)),
    );
    let stream = match handshake.await {
        Err(_) => return Err(ClientError::Timeout { addr: key }),
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => {
            let got = seen.fingerprint();
            return Err(match (pinned, got) {
                (Some(expected), Some(got)) if expected != got => ClientError::ServerKeyChanged {
                    addr: key,
                    expected: expected.to_string(),
                    got: got.to_string(),
                    known: tls.known.path().to_path_buf(),
                },
                (None, Some(got)) if !tls.trust_new => ClientError::UnknownServer {
                    addr: key,
                    fingerprint: got.to_string(),
                    known: tls.known.path().to_path_buf(),
                },
                _ => ClientError::Tls { addr: key, reason: error.to_string() },
            });
        }
    };
    if pinned.is_none() {
        if let Some(fingerprint) = seen.fingerprint() {
            pin(&tls.known, &key, fingerprint)?;
        }
    }
    Ok(PeerStream::ClientTls(Box::new(stream)))
}

fn pin(known: &KnownServers, key: &str, fingerprint: Fingerprint) -> Result<(), ClientError> {
    known.add(key, fingerprint)?;
    tracing::info!(server = key, %fingerprint, file = %known.path().display(), "pinned the server's key (trust on first use)");
    Ok(())
}

async fn connect_tcp(addr: SocketAddr) -> Result<TcpStream, ClientError> {
    let stream = tokio::time::timeout(OP_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| ClientError::Timeout { addr: addr.to_string() })?
        .map_err(|source| ClientError::Connect { addr: addr.to_string(), source })?;
    stream.set_nodelay(true)?;
    let keepalive =
        socket2::TcpKeepalive::new().with_time(Duration::from_secs(30)).with_interval(Duration::from_secs(10));
    let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
    Ok(stream)
}

/// Asks a server for its exported devices (`OP_REQ_DEVLIST`).
pub async fn list_devices(addr: SocketAddr, security: &Security) -> Result<Vec<DeviceRecord>, ClientError> {
    let mut stream = connect(addr, security).await?;
    let exchange = async {
        let mut out = BytesMut::new();
        OpRequest::DevList.encode(&mut out);
        stream.write_all(&out).await?;
        stream.flush().await?;
        let mut buf = BytesMut::with_capacity(4096);
        loop {
            if let Some(devices) = op::decode_devlist_reply(&mut buf, &Limits::default())? {
                return Ok(devices);
            }
            if stream.read_buf(&mut buf).await? == 0 {
                return Err(ClientError::ClosedWithoutAnswer { addr: addr.to_string() });
            }
        }
    };
    let result = tokio::time::timeout(OP_TIMEOUT, exchange)
        .await
        .map_err(|_| ClientError::Timeout { addr: addr.to_string() })?;
    result.map_err(|e| closed_early(e, addr, security))
}

/// One device as a usbwire server reports it through `OP_REQ_DEVSTATE`:
/// in use or not, by whom, since when, with its strings.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct RemoteDeviceState {
    pub busid: String,
    #[serde(default)]
    pub kind: String,
    pub vendor_id: String,
    pub product_id: String,
    #[serde(default)]
    pub product: String,
    #[serde(default)]
    pub manufacturer: String,
    #[serde(default)]
    pub serial: String,
    #[serde(default)]
    pub speed: String,
    /// `available` or `in_use`.
    pub state: String,
    /// The importer's address, when in use.
    #[serde(default)]
    pub client: Option<String>,
    /// The importer's certificate fingerprint, when it came over TLS.
    #[serde(default)]
    pub identity: Option<String>,
    /// Seconds since the Unix epoch when it was imported.
    #[serde(default)]
    pub since: Option<u64>,
}

/// Asks a usbwire server for the state of every device this client may see,
/// in use or not (`OP_REQ_DEVSTATE`, our extension). `Ok(None)`: the server
/// does not speak it (Linux usbipd and usbipd-win hang up on it).
pub async fn device_states(
    addr: SocketAddr,
    security: &Security,
) -> Result<Option<Vec<RemoteDeviceState>>, ClientError> {
    let mut stream = connect(addr, security).await?;
    let exchange = async {
        let mut out = BytesMut::new();
        OpRequest::DevState.encode(&mut out);
        stream.write_all(&out).await?;
        stream.flush().await?;
        let mut buf = BytesMut::with_capacity(4096);
        loop {
            match op::decode_devstate_reply(&mut buf) {
                Ok(Some(body)) => return Ok(Some(body)),
                Ok(None) => {}
                // Something else answered: not a usbwire server.
                Err(_) => return Ok(None),
            }
            match stream.read_buf(&mut buf).await {
                Ok(0) => return Ok(None),
                Ok(_) => {}
                Err(error)
                    if matches!(
                        error.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
                    ) =>
                {
                    return Ok(None)
                }
                Err(error) => return Err(ClientError::Io(error)),
            }
        }
    };
    let body = tokio::time::timeout(OP_TIMEOUT, exchange)
        .await
        .map_err(|_| ClientError::Timeout { addr: addr.to_string() })?
        .map_err(|e| closed_early(e, addr, security))?;
    let Some(body) = body else { return Ok(None) };
    #[derive(serde::Deserialize)]
    struct Body {
        devices: Vec<RemoteDeviceState>,
    }
    let parsed: Body = serde_json::from_slice(&body).map_err(|error| {
        ClientError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("bad device state reply: {error}"),
        ))
    })?;
    Ok(Some(parsed.devices))
}

/// How a server turns a client away during the OP phase, in the user's terms:
/// a TLS alert refusing our identity (TLS 1.3 finishes the client's side of the
/// handshake before the server has checked its certificate, so the alert comes
/// with the first reply), or a hang-up (a refused plain client, or TLS required)
/// rather than "connection reset".
fn closed_early(error: ClientError, addr: SocketAddr, security: &Security) -> ClientError {
    use tokio_rustls::rustls;
    let ClientError::Io(io) = error else { return error };
    let alert = io.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()).and_then(|e| match e {
        rustls::Error::AlertReceived(alert) => Some(*alert),
        _ => None,
    });
    match (alert, security) {
        (Some(rustls::AlertDescription::AccessDenied), Security::Tls(tls)) => {
            return ClientError::NotAdmitted {
                addr: addr.to_string(),
                fingerprint: tls.identity.fingerprint().to_string(),
            }
        }
        (Some(rustls::AlertDescription::CertificateExpired), _) => {
            return ClientError::CertificateExpired { addr: addr.to_string() }
        }
        (Some(alert), _) => {
            return ClientError::Tls { addr: addr.to_string(), reason: format!("the server sent the alert {alert:?}") }
        }
        (None, _) => {}
    }
    match io.kind() {
        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::BrokenPipe => {
            ClientError::ClosedWithoutAnswer { addr: addr.to_string() }
        }
        _ => ClientError::Io(io),
    }
}

/// Imports a device (`OP_REQ_IMPORT`); the returned socket is its URB channel.
pub async fn import(
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
) -> Result<(PeerStream, DeviceRecord), ClientError> {
    import_with(addr, busid, security, &[]).await
}

/// Offers stream transforms (usbwire servers only) and wraps the stream in
/// those the server accepted. An empty offer sends nothing.
async fn negotiate(
    stream: PeerStream,
    offer: &[TransformSpec],
    addr: SocketAddr,
    security: &Security,
) -> Result<PeerStream, ClientError> {
    if offer.is_empty() {
        return Ok(stream);
    }
    let mut stream = stream;
    let exchange = async {
        let mut out = BytesMut::new();
        OpRequest::Transforms { offer: TransformSpec::list_text(offer) }.encode(&mut out);
        stream.write_all(&out).await?;
        stream.flush().await?;
        // Exactly the answer: the framed stream starts right after it.
        let mut head = [0u8; op::OP_HEADER_LEN + 4];
        if let Err(error) = stream.read_exact(&mut head).await {
            // A refused identity, said by a TLS alert; otherwise a server that hung up on the extension.
            return Err(match closed_early(error.into(), addr, security) {
                ClientError::ClosedWithoutAnswer { .. } | ClientError::Io(_) => {
                    ClientError::NoTransforms { addr: addr.to_string() }
                }
                refused => refused,
            });
        }
        let len = u32::from_be_bytes([head[8], head[9], head[10], head[11]]).min(op::MAX_TRANSFORMS_LEN) as usize;
        let mut buf = BytesMut::from(&head[..]);
        buf.resize(head.len() + len, 0);
        stream.read_exact(&mut buf[head.len()..]).await?;
        op::decode_transforms_reply(&mut buf)?.ok_or(ClientError::NoTransforms { addr: addr.to_string() })
    };
    let accepted = tokio::time::timeout(OP_TIMEOUT, exchange)
        .await
        .map_err(|_| ClientError::Timeout { addr: addr.to_string() })??;
    let specs = TransformSpec::parse_list(&accepted);
    tracing::info!(offered = %TransformSpec::list_text(offer), accepted = %accepted, "stream transforms");
    if specs.is_empty() {
        return Ok(stream);
    }
    Ok(PeerStream::Transformed(Box::new(TransformedStream::new(stream, Pipeline::new(&specs, Side::Client)))))
}

/// [`import`] with stream transforms offered first (compression, jitter buffer).
pub async fn import_with(
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
    transforms: &[TransformSpec],
) -> Result<(PeerStream, DeviceRecord), ClientError> {
    let stream = connect(addr, security).await?;
    let mut stream = negotiate(stream, transforms, addr, security).await?;
    let exchange = async {
        let mut out = BytesMut::new();
        OpRequest::Import { busid: busid.clone() }.encode(&mut out);
        stream.write_all(&out).await?;
        stream.flush().await?;
        // Read exactly the reply, no further: URB traffic follows on this socket.
        let mut header = [0u8; op::OP_HEADER_LEN];
        if let Err(error) = stream.read_exact(&mut header).await {
            return Err(match error.kind() {
                std::io::ErrorKind::UnexpectedEof => ClientError::ClosedWithoutAnswer { addr: addr.to_string() },
                _ => ClientError::Io(error),
            });
        }
        let mut buf = BytesMut::from(&header[..]);
        if let Some(Err(status)) = op::decode_import_reply(&mut buf)? {
            return Err(ClientError::Refused { busid: busid.to_string(), status });
        }
        let mut body = vec![0u8; op::DEVICE_RECORD_LEN];
        stream.read_exact(&mut body).await?;
        buf.extend_from_slice(&body);
        match op::decode_import_reply(&mut buf)? {
            Some(Ok(device)) if device.busid == *busid => Ok(device),
            Some(Ok(device)) => {
                Err(ClientError::WrongDevice { wanted: busid.to_string(), got: device.busid.to_string() })
            }
            Some(Err(status)) => Err(ClientError::Refused { busid: busid.to_string(), status }),
            None => Err(ClientError::Io(std::io::ErrorKind::UnexpectedEof.into())),
        }
    };
    let device = tokio::time::timeout(OP_TIMEOUT, exchange)
        .await
        .map_err(|_| ClientError::Timeout { addr: addr.to_string() })?
        .map_err(|e| closed_early(e, addr, security))?;
    Ok((stream, device))
}

/// A transfer to submit.
#[derive(Clone, Debug)]
pub struct Transfer {
    pub endpoint: u8,
    pub direction: Direction,
    /// SETUP packet for control transfers.
    pub setup: [u8; 8],
    pub flags: u32,
    /// IN: bytes wanted. OUT: ignored (the data's length is used).
    pub length: u32,
    pub data: Bytes,
    pub interval: i32,
    /// Isochronous packets; `Some` marks the endpoint as isochronous.
    pub iso_packets: Option<Vec<IsoPacketDescriptor>>,
}

impl Transfer {
    pub fn control_in(setup: [u8; 8]) -> Self {
        let length = u32::from(u16::from_le_bytes([setup[6], setup[7]]));
        Self {
            endpoint: 0,
            direction: Direction::In,
            setup,
            flags: TransferFlags::DIR_IN,
            length,
            data: Bytes::new(),
            interval: 0,
            iso_packets: None,
        }
    }

    pub fn control_out(setup: [u8; 8], data: Bytes) -> Self {
        Self {
            endpoint: 0,
            direction: Direction::Out,
            setup,
            flags: 0,
            length: data.len() as u32,
            data,
            interval: 0,
            iso_packets: None,
        }
    }

    pub fn bulk_in(endpoint: u8, length: u32) -> Self {
        Self {
            endpoint: endpoint & 0x0f,
            direction: Direction::In,
            setup: [0; 8],
            flags: TransferFlags::DIR_IN,
            length,
            data: Bytes::new(),
            interval: 0,
            iso_packets: None,
        }
    }

    pub fn bulk_out(endpoint: u8, data: Bytes) -> Self {
        Self {
            endpoint: endpoint & 0x0f,
            direction: Direction::Out,
            setup: [0; 8],
            flags: 0,
            length: data.len() as u32,
            data,
            interval: 0,
            iso_packets: None,
        }
    }
}

#[derive(Default)]
struct Waiters {
    submits: SeqnumMap<(SubmittedShape, Waiter)>,
    /// CMD_UNLINK seqnum -> the seqnum it cancels.
    unlinks: SeqnumMap<u32>,
    /// The inboxes of live [`TransferQueue`]s, by queue id. A queued URB's
    /// waiter names its queue by id, so queueing one takes no `Arc` clone.
    queues: Vec<(u64, Arc<queue::Inbox>)>,
    next_queue: u64,
}

impl Waiters {
    fn register_queue(&mut self, inbox: Arc<queue::Inbox>) -> u64 {
        let id = self.next_queue;
        self.next_queue += 1;
        self.queues.push((id, inbox));
        id
    }

    /// A dropped queue's URBs still complete; their replies are then dropped.
    fn unregister_queue(&mut self, id: u64) {
        self.queues.retain(|(queue, _)| *queue != id);
    }

    fn inbox(&self, id: u64) -> Option<&Arc<queue::Inbox>> {
        self.queues.iter().find(|(queue, _)| *queue == id).map(|(_, inbox)| inbox)
    }
}

/// Who gets a URB's reply.
enum Waiter {
    /// The future [`Connection::submit`] returned.
    Reply(oneshot::Sender<RetSubmit>),
    /// A [`TransferQueue`], by id: the reply joins its inbox's ready list.
    Queue(u64),
}

impl Waiter {
    /// Hands the reply over. A queue's replies gather in `batch` and reach
    /// its inbox together (see [`Deliveries`]).
    fn deliver(self, ret: RetSubmit, batch: &mut Deliveries, waiters: &Waiters) {
        match self {
            Self::Reply(tx) => {
                let _ = tx.send(ret);
            }
            Self::Queue(id) => batch.add(id, ret, waiters),
        }
    }
}

/// Replies of one read on their way to their queues' inboxes: consecutive
/// replies for the same queue are handed over under one lock, and each queue
/// is woken once, after the read is dispatched.
#[derive(Default)]
struct Deliveries {
    /// The queue the replies in `replies` are for, and its inbox (`None`: the
    /// queue was dropped, and so are its replies).
    queue: Option<(u64, Option<Arc<queue::Inbox>>)>,
    replies: Vec<RetSubmit>,
    /// Wakers of queues that were waiting, to wake once the read is handed over.
    wake: Vec<Waker>,
}

impl Deliveries {
    fn add(&mut self, id: u64, ret: RetSubmit, waiters: &Waiters) {
        if self.queue.as_ref().map(|(current, _)| *current) != Some(id) {
            self.hand_over();
            self.queue = Some((id, waiters.inbox(id).cloned()));
        }
        self.replies.push(ret);
    }

    /// Moves the gathered replies into their inbox.
    fn hand_over(&mut self) {
        match self.queue.take() {
            Some((_, Some(inbox))) => inbox.push_all(&mut self.replies, &mut self.wake),
            _ => self.replies.clear(),
        }
    }
}

struct Shared {
    /// `None` once the connection is gone.
    waiters: Mutex<Option<Waiters>>,
    next_seqnum: AtomicU32,
    /// Set with `waiters` becoming `None`, readable without the lock.
    closed: AtomicBool,
}

impl Shared {
    fn waiters(&self) -> std::sync::MutexGuard<'_, Option<Waiters>> {
        self.waiters.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The connection is gone: every URB still waiting fails as disconnected
    /// (dropped reply senders; queues are told).
    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let Some(waiters) = self.waiters().take() else { return };
        for (_, inbox) in &waiters.queues {
            inbox.disconnect();
        }
    }
}

/// The URB channel of an imported device.
pub struct Connection {
    devid: u32,
    shared: Arc<Shared>,
    /// Messages for the writer task, in the order they go on the wire.
    outgoing: mpsc::UnboundedSender<Frame>,
    reader: tokio::task::JoinHandle<()>,
    /// `None` once [`Connection::close`] has waited for it.
    writer: Option<tokio::task::JoinHandle<()>>,
}

/// One message for the writer task: the header (with a small payload and any
/// isochronous descriptors packed behind it) and a large OUT payload, uncopied.
struct Frame {
    head: Bytes,
    payload: Bytes,
}

/// Slices per `writev` (Linux allows 1024).
const MAX_SLICES: usize = 512;
/// Bytes the writer gathers before it writes, so one batch does not hold many large payloads.
const MAX_BATCH_BYTES: usize = 4 << 20;

impl Connection {
    /// Starts the reply reader on an imported device's socket.
    pub fn new(stream: PeerStream, device: &DeviceRecord) -> Self {
        // Plain TCP splits without a lock between the halves; TLS needs tokio's split.
        let (mut read_half, write_half): (
            Box<dyn tokio::io::AsyncRead + Send + Unpin>,
            Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
        ) = match stream {
            PeerStream::Plain(tcp) => {
                let (r, w) = tcp.into_split();
                (Box::new(r), Box::new(w))
            }
            tls => {
                let (r, w) = tokio::io::split(tls);
                (Box::new(r), Box::new(w))
            }
        };
        let shared = Arc::new(Shared {
            waiters: Mutex::new(Some(Waiters::default())),
            next_seqnum: AtomicU32::new(1),
            closed: AtomicBool::new(false),
        });
        let reader_shared = shared.clone();
        let reader = tokio::spawn(async move {
            let mut buf = RecvBuffer::with_capacity(256 * 1024);
            let limits = Limits::default();
            let mut deliveries = Deliveries::default();
            let outcome: Result<(), ClientError> = async {
                loop {
                    let decoded = dispatch_buffered(&reader_shared, &mut buf, &limits, &mut deliveries);
                    deliveries.hand_over();
                    decoded?;
                    // Wake after the locks are released, each waiting queue once per read,
                    // then let it run: while replies keep coming this loop would otherwise
                    // read on until its budget runs out, and on a single-threaded runtime
                    // the queue could not submit more URBs to keep the server busy.
                    if !deliveries.wake.is_empty() {
                        deliveries.wake.drain(..).for_each(Waker::wake);
                        yield_to_ready_tasks().await;
                    }
                    buf.reserve(next_read_room(&buf, &limits));
                    if read_half.read_buf(&mut *buf).await? == 0 {
                        return Ok(());
                    }
                }
            }
            .await;
            match outcome {
                // The reason every pending URB fails with `Disconnected`: worth seeing without -v.
                Err(error @ ClientError::Protocol(_)) => {
                    tracing::warn!(%error, "the server sent a malformed reply; connection closed")
                }
                Err(error) => debug!(%error, "urb channel closed"),
                Ok(()) => {}
            }
            reader_shared.close();
        });
        let (outgoing, frames) = mpsc::unbounded_channel();
        let writer = Some(tokio::spawn(write_frames(write_half, frames, shared.clone())));
        Self { devid: device.devid(), shared, outgoing, reader, writer }
    }

    /// Ends the connection cleanly and waits (up to a second) until it has: what was
    /// submitted is written, then the stream is shut down (over TLS with close_notify,
    /// so the server logs a client that left, not a cut connection). Dropping a
    /// `Connection` does the same in the background; a short-lived process that exits
    /// right after should close instead. Transfer queues still alive keep it open.
    pub async fn close(mut self) {
        self.outgoing = mpsc::unbounded_channel().0;
        if let Some(writer) = self.writer.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), writer).await;
        }
    }

    /// Submits a transfer; returns its seqnum and a future for the reply.
    pub async fn submit(
        &self,
        transfer: Transfer,
    ) -> Result<(u32, impl std::future::Future<Output = Result<RetSubmit, TransferError>>), TransferError> {
        let seqnum = self.shared.next_seqnum.fetch_add(1, Ordering::Relaxed);
        let mut head = BytesMut::new();
        let (shape, payload) = encode_submit(self.devid, seqnum, transfer, &mut head);
        let (tx, rx) = oneshot::channel();
        self.shared
            .waiters()
            .as_mut()
            .ok_or(TransferError::Disconnected)?
            .submits
            .insert(seqnum, (shape, Waiter::Reply(tx)));
        if self.outgoing.send(Frame { head: head.freeze(), payload }).is_err() {
            return Err(TransferError::Disconnected);
        }
        Ok((seqnum, async move { rx.await.map_err(|_| TransferError::Disconnected) }))
    }

    /// A queue for URBs submitted and collected by one task: completions come
    /// back in batches, without a future per URB (see [`TransferQueue`]).
    pub fn queue(&self) -> TransferQueue {
        TransferQueue::new(self.devid, self.shared.clone(), self.outgoing.clone())
    }

    /// Submits and waits for the reply (whatever its status).
    pub async fn transfer(&self, transfer: Transfer) -> Result<RetSubmit, TransferError> {
        let (_, reply) = self.submit(transfer).await?;
        reply.await
    }

    /// Submits, waits, and turns a failure status into a typed [`TransferError`].
    pub async fn transfer_checked(&self, transfer: Transfer) -> Result<RetSubmit, TransferError> {
        let ret = self.transfer(transfer).await?;
        match TransferError::from_status(ret.status) {
            Some(error) => Err(error),
            None => Ok(ret),
        }
    }

    /// Asks the server to cancel the URB `seqnum`. Its reply (if any) still
    /// resolves the submit future; a URB cancelled without a RET_SUBMIT
    /// resolves with [`Status::ECONNRESET`].
    pub async fn unlink(&self, target: u32) -> Result<(), TransferError> {
        let seqnum = self.shared.next_seqnum.fetch_add(1, Ordering::Relaxed);
        let unlink = CmdUnlink { seqnum, devid: self.devid, unlink_seqnum: target };
        if let Some(w) = self.shared.waiters().as_mut() {
            w.unlinks.insert(seqnum, target);
        }
        let head = Bytes::copy_from_slice(&unlink.header());
        self.outgoing.send(Frame { head, payload: Bytes::new() }).map_err(|_| TransferError::Disconnected)
    }

    /// Whether the server has closed the connection.
    pub fn is_closed(&self) -> bool {
        self.reader.is_finished()
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Lets the tasks that are ready run before this one continues: the task goes
/// to the back of the run queue. Unlike `tokio::task::yield_now`, whose wake
/// is deferred until the runtime has polled the I/O driver, this costs no
/// extra `epoll_wait` per read (the driver is still polled regularly, every
/// few dozen tasks, by the runtime itself).
async fn yield_to_ready_tasks() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            return std::task::Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await;
}

/// Decodes every whole message in `buf` and hands each reply to its waiter,
/// under one lock of the waiter map for the lot; queues' replies gather in
/// `deliveries` for the caller to hand over once the map's lock is released.
fn dispatch_buffered(
    shared: &Shared,
    buf: &mut BytesMut,
    limits: &Limits,
    deliveries: &mut Deliveries,
) -> Result<(), ClientError> {
    let mut guard = shared.waiters();
    loop {
        let decoded = {
            let waiters = guard.as_ref();
            urb::decode_return(buf, limits, |seq| waiters.and_then(|w| w.submits.get(seq)).map(|(shape, _)| *shape))?
        };
        let Some(waiters) = guard.as_mut() else {
            // Closed by the writer: nobody is waiting any more.
            return Ok(());
        };
        match decoded {
            Some(ServerMessage::Submit(ret)) => {
                if let Some((_, waiter)) = waiters.submits.remove(ret.seqnum) {
                    waiter.deliver(ret, deliveries, waiters);
                }
            }
            Some(ServerMessage::Unlink(ret)) => {
                debug!(seqnum = ret.seqnum, status = ?ret.status, "unlink answered");
                // Cancelled without a RET_SUBMIT (the kernel stub's way): the
                // RET_UNLINK is the URB's only answer, as vhci treats it.
                let cancelled = waiters
                    .unlinks
                    .remove(ret.seqnum)
                    .and_then(|target| waiters.submits.remove(target).map(|(_, waiter)| (target, waiter)));
                if let Some((target, waiter)) = cancelled {
                    waiter.deliver(empty_reply(target, ret.status), deliveries, waiters);
                }
            }
            None => return Ok(()),
        }
    }
}

/// A RET_SUBMIT without data: what a URB cancelled by its RET_UNLINK gets.
fn empty_reply(seqnum: u32, status: Status) -> RetSubmit {
    RetSubmit {
        seqnum,
        status,
        actual_length: 0,
        start_frame: 0,
        number_of_packets: 0,
        error_count: 0,
        data: Bytes::new(),
        iso_packets: Vec::new(),
    }
}

/// Encodes a `CMD_SUBMIT` for `transfer` onto `head` and says what the reply
/// will look like. Small messages are packed into `head`; a large OUT payload
/// is returned to go out beside it in the same vectored write, uncopied.
/// Isochronous descriptors follow the payload, so they force the copy.
fn encode_submit(devid: u32, seqnum: u32, transfer: Transfer, head: &mut BytesMut) -> (SubmittedShape, Bytes) {
    let length = match transfer.direction {
        Direction::Out => transfer.data.len() as u32,
        Direction::In => transfer.length,
    };
    let number_of_packets = transfer.iso_packets.as_ref().map_or(0, |p| p.len() as i32);
    let shape = SubmittedShape {
        direction: transfer.direction,
        transfer_buffer_length: length,
        iso_packets: transfer.iso_packets.as_ref().map(|p| p.len() as i32),
    };
    let submit = CmdSubmit {
        seqnum,
        devid,
        direction: transfer.direction,
        ep: transfer.endpoint,
        transfer_flags: TransferFlags(transfer.flags),
        transfer_buffer_length: length,
        start_frame: 0,
        number_of_packets,
        interval: transfer.interval,
        setup: transfer.setup,
        data: transfer.data,
        iso_packets: transfer.iso_packets.unwrap_or_default(),
    };
    let iso_len = submit.iso_packets.len() * urb::ISO_DESCRIPTOR_LEN;
    let out_len = if submit.direction == Direction::Out { submit.data.len() } else { 0 };
    let large = out_len > SMALL_PAYLOAD && iso_len == 0;
    head.reserve(urb::HEADER_LEN + if large { 0 } else { out_len } + iso_len);
    head.extend_from_slice(&submit.header());
    if out_len > 0 && !large {
        head.extend_from_slice(&submit.data);
    }
    for packet in &submit.iso_packets {
        head.extend_from_slice(&packet.offset.to_be_bytes());
        head.extend_from_slice(&packet.length.to_be_bytes());
        head.extend_from_slice(&[0; 8]);
    }
    (shape, if large { submit.data } else { Bytes::new() })
}

/// Room to reserve before the next read: the rest of a RET_SUBMIT whose
/// header is already buffered (bounded by the limits), so a large IN payload
/// lands in one allocation instead of growing the buffer (and copying it) read
/// by read; at least 64 KiB otherwise.
fn next_read_room(buf: &[u8], limits: &Limits) -> usize {
    const MIN_READ: usize = 64 * 1024;
    if buf.len() < urb::HEADER_LEN {
        return MIN_READ;
    }
    let field = |at: usize| u32::from_be_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
    if urb::Command(field(0)) != urb::Command::RET_SUBMIT {
        return MIN_READ;
    }
    let payload = field(0x18).min(limits.max_transfer_length) as usize;
    (urb::HEADER_LEN + payload).saturating_sub(buf.len()).max(MIN_READ)
}

/// The writer task: takes every message queued since its last write and sends
/// them with as few `writev` calls as the socket allows, so URBs submitted
/// while it was writing share one system call (and, with TCP_NODELAY, as few
/// segments as their bytes need). Submitters never wait for the socket.
///
/// Ends when the [`Connection`] is dropped (after writing what was queued) or
/// the socket fails; then every URB still waiting fails as disconnected.
async fn write_frames(
    mut writer: Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
    mut frames: mpsc::UnboundedReceiver<Frame>,
    shared: Arc<Shared>,
) {
    let mut batch: Vec<Bytes> = Vec::new();
    while let Some(first) = frames.recv().await {
        let mut bytes = 0;
        let mut next = Some(first);
        while let Some(frame) = next.take() {
            bytes += frame.head.len() + frame.payload.len();
            batch.push(frame.head);
            if !frame.payload.is_empty() {
                batch.push(frame.payload);
            }
            if batch.len() < MAX_SLICES && bytes < MAX_BATCH_BYTES {
                next = frames.try_recv().ok();
            }
        }
        let sent = async {
            write_all_vectored(&mut *writer, &batch).await?;
            writer.flush().await
        }
        .await;
        batch.clear();
        if let Err(error) = sent {
            debug!(%error, "urb channel write failed");
            shared.close();
            return;
        }
    }
    // The connection was dropped: end the stream cleanly (TLS: close_notify, so the
    // server can tell a client that left from a connection cut short).
    let _ = writer.shutdown().await;
}

/// Writes every byte of `parts`, in order, with as few system calls as the socket allows.
async fn write_all_vectored<W: tokio::io::AsyncWrite + Unpin + ?Sized>(
    writer: &mut W,
    parts: &[Bytes],
) -> std::io::Result<()> {
    let (mut index, mut offset) = (0usize, 0usize);
    while index < parts.len() {
        let slices: Vec<std::io::IoSlice<'_>> = std::iter::once(&parts[index][offset..])
            .chain(parts[index + 1..].iter().map(|p| &p[..]))
            .take(MAX_SLICES)
            .map(std::io::IoSlice::new)
            .collect();
        let mut written = writer.write_vectored(&slices).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while written > 0 || (index < parts.len() && parts[index].len() == offset) {
            let left = parts[index].len() - offset;
            if written < left {
                offset += written;
                written = 0;
            } else {
                written -= left;
                index += 1;
                offset = 0;
            }
        }
    }
    Ok(())
}

/// The status a RET_SUBMIT carries, for callers that only care about success.
pub fn is_ok(ret: &RetSubmit) -> bool {
    ret.status == Status::OK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_typed_errors() {
        assert_eq!(TransferError::from_status(Status::OK), None);
        assert_eq!(TransferError::from_status(Status::EPIPE), Some(TransferError::Stall));
        assert_eq!(TransferError::from_status(Status::EOVERFLOW), Some(TransferError::Overflow));
        assert_eq!(TransferError::from_status(Status::ECONNRESET), Some(TransferError::Cancelled));
        assert_eq!(TransferError::from_status(Status::ESHUTDOWN), Some(TransferError::DeviceGone));
        assert_eq!(TransferError::from_status(Status::EPROTO), Some(TransferError::Failed(Status::EPROTO)));
        assert!(has_port("host:3240") && !has_port("host") && !has_port("::1"));
    }

    #[test]
    fn replies_reach_registered_queues_in_order_and_dropped_queues_lose_theirs() {
        let mut waiters = Waiters::default();
        let (a, b) = (Arc::<queue::Inbox>::default(), Arc::<queue::Inbox>::default());
        let (id_a, id_b) = (waiters.register_queue(a.clone()), waiters.register_queue(b.clone()));
        assert_ne!(id_a, id_b);
        let mut deliveries = Deliveries::default();
        for (id, seqnum) in [(id_a, 1), (id_a, 2), (id_b, 3), (id_a, 4)] {
            deliveries.add(id, empty_reply(seqnum, Status::OK), &waiters);
        }
        deliveries.hand_over();
        assert_eq!(a.ready_seqnums(), vec![1, 2, 4]);
        assert_eq!(b.ready_seqnums(), vec![3]);

        waiters.unregister_queue(id_b);
        assert!(waiters.inbox(id_b).is_none() && waiters.inbox(id_a).is_some());
        deliveries.add(id_b, empty_reply(5, Status::OK), &waiters);
        deliveries.hand_over();
        assert_eq!(b.ready_seqnums(), vec![3], "a dropped queue gets nothing more");
        assert!(deliveries.replies.is_empty());
    }
}
