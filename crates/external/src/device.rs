//! [`ExternalDevice`]: a [`Device`] whose answers come from a device process
//! over a byte stream (a Unix socket), and the task that moves its bytes.
//!
//! [`attach`] takes a freshly accepted stream: it reads the hello (within the
//! hello timeout), answers WELCOME, starts the I/O task, reads the
//! descriptors ([`crate::enumerate`]) and resets the device for its first
//! importer. The protocol state lives in a [`Core`] the device (driven by the
//! server's URB task) and the I/O task share under a short lock; the I/O task
//! reads frames, writes what the core queued and fires its deadlines.
//!
//! Not for listening on sockets or exporting: the server accepts the device
//! process and lists what this returns.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{watch, Notify};
use tracing::{debug, info, warn, Instrument as _};
use usbwire_device::sync::lock;
use usbwire_device::{Completion, Device, DeviceSummary, Direction, Speed, TransferType, Urb};

use crate::codec::{self, Message, MAX_FRAME_LEN, VERSION};
use crate::core::{Core, Gone, Layout, ProtocolError};
use crate::enumerate::{enumerate, Descriptors, EnumerationError};

/// How long a device process has for each step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// To send its hello after connecting.
    pub hello_timeout: Duration,
    /// To give each request its first answer (NAK, or the final one; a control
    /// request must be finished). The USB 2.0 limit for a standard request is 5 s.
    pub reply_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self { hello_timeout: Duration::from_secs(5), reply_timeout: Duration::from_secs(5) }
    }
}

/// Why a device process was not attached.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// Nothing (or not a whole hello) arrived within the hello timeout.
    #[error("no hello within {0:?}: the device process must send HELLO first")]
    NoHello(Duration),
    /// The first frame is not a hello, or not a frame at all.
    #[error("{0}")]
    Protocol(#[from] ProtocolError),
    /// It speaks another revision of the protocol.
    #[error("the device process speaks protocol revision {0}, this server {VERSION}; upgrade the older side")]
    Version(u16),
    /// The hello names no speed a USB device has.
    #[error("the hello names speed {0}, not one of 1 (low), 2 (full), 3 (high), 5 (super), 6 (super-plus)")]
    Speed(u32),
    /// The connection failed or closed during the hello.
    #[error("reading the hello: {0}")]
    Io(#[from] std::io::Error),
    /// Its descriptors could not be read.
    #[error("{0}")]
    Enumeration(#[from] EnumerationError),
}

/// What the device and its I/O task share.
struct Shared {
    core: Mutex<Core>,
    /// Wakes the writer: bytes queued, or the device gone.
    wake_writer: Notify,
    /// Wakes the reader: a new deadline, or the device gone.
    wake_reader: Notify,
}

impl Shared {
    fn wake(&self) {
        self.wake_writer.notify_one();
        self.wake_reader.notify_one();
    }
}

/// A device whose descriptors and traffic come from a device process.
pub struct ExternalDevice {
    shared: Arc<Shared>,
    descriptors: Descriptors,
}

/// The I/O task of an attached device process: resolves, with why, once it
/// is gone (the server then withdraws the device).
#[derive(Debug)]
pub struct Attached {
    ended: watch::Receiver<Option<Gone>>,
}

impl Attached {
    pub async fn ended(mut self) -> Gone {
        match self.ended.wait_for(Option::is_some).await {
            Ok(gone) => gone.clone().unwrap_or(Gone::Dropped),
            Err(_) => Gone::Dropped,
        }
    }
}

/// Attaches the device process at the other end of `stream` (see the module docs).
pub async fn attach<S>(stream: S, options: &Options) -> Result<(ExternalDevice, Attached), AttachError>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut reader, mut writer) = tokio::io::split(stream);
    let mut input = BytesMut::with_capacity(4096);
    let hello = tokio::time::timeout(options.hello_timeout, read_frame(&mut reader, &mut input))
        .await
        .map_err(|_| AttachError::NoHello(options.hello_timeout))??;
    let (speed, ep0_max_packet) = match hello {
        Message::Hello { version, .. } if version != VERSION => {
            refuse(
                &mut writer,
                &format!("protocol revision {version} is not spoken here; this server speaks {VERSION}"),
            )
            .await;
            return Err(AttachError::Version(version));
        }
        Message::Hello { speed, .. }
            if !(Speed::LOW.0..=Speed::SUPER_PLUS.0).contains(&speed.0) || speed == Speed::WIRELESS =>
        {
            refuse(&mut writer, &format!("speed {} is not a USB speed", speed.0)).await;
            return Err(AttachError::Speed(speed.0));
        }
        Message::Hello { speed, ep0_max_packet, .. } => (speed, ep0_max_packet),
        other => return Err(ProtocolError::Unexpected(other.kind()).into()),
    };
    let mut welcome = BytesMut::new();
    Message::Welcome { version: VERSION, max_frame_len: MAX_FRAME_LEN }.encode(&mut welcome);
    writer.write_all(&welcome).await?;
    debug!(speed = speed.name(), ep0_max_packet, "device process said hello");
    let shared = Arc::new(Shared {
        core: Mutex::new(Core::new(options.reply_timeout)),
        wake_writer: Notify::new(),
        wake_reader: Notify::new(),
    });
    let (ended_tx, ended) = watch::channel(None);
    let task = drive(reader, writer, input, shared.clone(), ended_tx);
    tokio::spawn(task.instrument(tracing::Span::current()));
    let mut device = ExternalDevice { shared, descriptors: placeholder(speed) };
    let descriptors = enumerate(&mut device, speed).await?;
    {
        let mut core = lock(&device.shared.core);
        core.set_layout(Layout::new(descriptors.configurations.clone()));
        core.reset();
    }
    device.shared.wake();
    info!(
        vid = format_args!("{:04x}", descriptors.device.vendor_id),
        pid = format_args!("{:04x}", descriptors.device.product_id),
        product = descriptors.product,
        "device process attached"
    );
    device.descriptors = descriptors;
    Ok((device, Attached { ended }))
}

/// What the device is listed as before its descriptors are read (never listed).
fn placeholder(speed: Speed) -> Descriptors {
    Descriptors {
        speed,
        device: usbwire_device::descriptor::DeviceDescriptor::for_speed(speed, 0, 0),
        configurations: Vec::new(),
        manufacturer: String::new(),
        product: String::new(),
        serial: String::new(),
    }
}

/// Reads until one whole frame is decoded; bytes after it stay in `input`.
async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R, input: &mut BytesMut) -> Result<Message, AttachError> {
    loop {
        if let Some(message) = codec::decode(input).map_err(ProtocolError::from)? {
            return Ok(message);
        }
        reserve_for_frame(input).map_err(ProtocolError::from)?;
        if reader.read_buf(input).await? == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
    }
}

/// Room for the rest of the frame at the front (never more than 1 MiB at a
/// time, and never past a length over the maximum, which is refused first).
fn reserve_for_frame(input: &mut BytesMut) -> Result<(), codec::CodecError> {
    let want = match codec::frame_len(input)? {
        Some(len) => len.saturating_sub(input.len()).clamp(1, 1 << 20),
        None => 4096,
    };
    input.reserve(want);
    Ok(())
}

async fn refuse<W: AsyncWrite + Unpin>(writer: &mut W, reason: &str) {
    let mut frame = BytesMut::new();
    Message::Refuse { reason: reason.to_owned() }.encode(&mut frame);
    let _ = tokio::time::timeout(Duration::from_secs(1), writer.write_all(&frame)).await;
}

/// The I/O task: reads and writes until the device process or the device is gone.
async fn drive<R, W>(
    mut reader: R,
    mut writer: W,
    input: BytesMut,
    shared: Arc<Shared>,
    ended: watch::Sender<Option<Gone>>,
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    tokio::select! {
        () = read_loop(&mut reader, input, &shared) => {}
        () = write_loop(&mut writer, &shared) => {}
    }
    let gone = {
        let mut core = lock(&shared.core);
        core.close(Gone::Closed);
        core.gone().cloned().unwrap_or(Gone::Closed)
    };
    // Whatever is left to say (a refusal) is written before the socket closes.
    loop {
        let Some(bytes) = lock(&shared.core).poll_transmit() else { break };
        if tokio::time::timeout(Duration::from_secs(1), writer.write_all(&bytes)).await.is_err() {
            break;
        }
    }
    let _ = writer.shutdown().await;
    match &gone {
        Gone::Dropped => debug!("device process let go"),
        Gone::Closed => info!("device process disconnected"),
        other => warn!(why = %other, "device process dropped"),
    }
    ended.send_replace(Some(gone));
}

/// Frames in, until the device process closes, breaks the protocol or misses a deadline.
async fn read_loop<R: AsyncRead + Unpin>(reader: &mut R, mut input: BytesMut, shared: &Shared) {
    loop {
        let deadline = {
            let mut core = lock(&shared.core);
            loop {
                let handled = match codec::decode(&mut input) {
                    Ok(Some(message)) => core.handle(message),
                    Ok(None) => break,
                    Err(error) => Err(error.into()),
                };
                if let Err(error) = handled {
                    let reason = error.to_string();
                    core.close(Gone::Protocol(error));
                    core.send(&Message::Refuse { reason });
                    return;
                }
            }
            if core.gone().is_some() {
                return;
            }
            core.poll_timeout()
        };
        if let Err(error) = reserve_for_frame(&mut input) {
            let mut core = lock(&shared.core);
            core.close(Gone::Protocol(error.clone().into()));
            core.send(&Message::Refuse { reason: error.to_string() });
            return;
        }
        let sleep = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            read = reader.read_buf(&mut input) => match read {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            },
            () = sleep => {
                let mut core = lock(&shared.core);
                core.handle_timeout(Instant::now());
                if let Some(why) = core.gone() {
                    let reason = why.to_string();
                    core.send(&Message::Refuse { reason });
                    return;
                }
            }
            () = shared.wake_reader.notified() => {}
        }
    }
}

/// What the core queued, out, until the device is gone or the socket fails.
async fn write_loop<W: AsyncWrite + Unpin>(writer: &mut W, shared: &Shared) {
    loop {
        let next = {
            let mut core = lock(&shared.core);
            match core.poll_transmit() {
                Some(bytes) => Some(bytes),
                None if core.gone().is_some() => return,
                None => None,
            }
        };
        match next {
            Some(bytes) => {
                if writer.write_all(&bytes).await.is_err() {
                    return;
                }
            }
            None => {
                if writer.flush().await.is_err() {
                    return;
                }
                shared.wake_writer.notified().await;
            }
        }
    }
}

impl std::fmt::Debug for ExternalDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalDevice").field("descriptors", &self.descriptors).finish_non_exhaustive()
    }
}

impl ExternalDevice {
    /// The descriptors read when the device process attached.
    pub fn descriptors(&self) -> &Descriptors {
        &self.descriptors
    }

    /// Why the device process is gone, once it is.
    pub fn gone(&self) -> Option<Gone> {
        lock(&self.shared.core).gone().cloned()
    }
}

impl Device for ExternalDevice {
    fn summary(&self) -> DeviceSummary {
        self.descriptors.summary()
    }

    fn endpoint_type(&self, direction: Direction, number: u8) -> Option<TransferType> {
        lock(&self.shared.core).endpoint_type(direction, number)
    }

    fn submit(&mut self, urb: Urb) {
        lock(&self.shared.core).submit(urb, Instant::now());
        self.shared.wake();
    }

    fn poll_complete(&mut self, cx: &mut Context<'_>) -> Poll<Completion> {
        lock(&self.shared.core).poll_complete(cx)
    }

    fn cancel(&mut self, seqnum: u32) {
        lock(&self.shared.core).cancel(seqnum);
        self.shared.wake();
    }

    fn reset(&mut self) {
        lock(&self.shared.core).reset();
        self.shared.wake();
    }

    fn is_gone(&self) -> bool {
        lock(&self.shared.core).gone().is_some()
    }
}

impl Drop for ExternalDevice {
    /// The I/O task ends and the socket closes: the device process sees its device unplugged.
    fn drop(&mut self) {
        lock(&self.shared.core).close(Gone::Dropped);
        self.shared.wake();
    }
}
