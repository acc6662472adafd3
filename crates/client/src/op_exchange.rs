//! The OP phase: device list, device states (usbwire servers), stream
//! transform negotiation and import.

use std::net::SocketAddr;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use usbwire_device::devstate::{DeviceStateDocument, DeviceStateEntry};
use usbwire_proto::descriptors::{self, Snapshot};
use usbwire_proto::liveness;
use usbwire_proto::op::{self, BusId, DeviceRecord, OpRequest};
use usbwire_proto::reservation::ReservationToken;
use usbwire_proto::resume::{self, Grant, Token};
use usbwire_proto::{storage, Limits};
use usbwire_transport::transform::{Pipeline, Side, TransformedStream};
use usbwire_transport::PeerStream;

use crate::connect::{closed_early, connect};
use crate::error::OP_TIMEOUT;
use crate::{ClientError, Security, TransformSpec};

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

/// Asks a usbwire server for the state of every device this client may see,
/// in use or not (`OP_REQ_DEVSTATE`, our extension). `Ok(None)`: the server
/// does not speak it (Linux usbipd and usbipd-win hang up on it).
pub async fn device_states(
    addr: SocketAddr,
    security: &Security,
) -> Result<Option<Vec<DeviceStateEntry>>, ClientError> {
    Ok(server_state(addr, security).await?.map(|document| document.devices))
}

/// [`device_states`] with the rest of the document: the devices the server
/// withdrew lately. `Ok(None)`: the server does not speak `OP_REQ_DEVSTATE`.
pub async fn server_state(addr: SocketAddr, security: &Security) -> Result<Option<DeviceStateDocument>, ClientError> {
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
    let parsed: DeviceStateDocument = serde_json::from_slice(&body).map_err(|error| {
        ClientError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("bad device state reply: {error}"),
        ))
    })?;
    Ok(Some(parsed))
}

/// Imports a device (`OP_REQ_IMPORT`); the returned socket is its URB channel.
pub async fn import(
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
) -> Result<(PeerStream, DeviceRecord), ClientError> {
    import_with(addr, busid, security, &[]).await
}

/// What a usbwire server agreed to beside the stream transforms.
#[derive(Default)]
struct Agreed {
    /// The session token, when it granted resume.
    resume: Option<Grant>,
    /// The storage extension (`docs/protocol.md` §5.7): it runs mass-storage
    /// stages in order, so this side may send them without waiting.
    storage: bool,
    /// Descriptor snapshots (`docs/protocol.md` §5.8): the import reply is
    /// followed by the device's descriptors.
    descriptors: bool,
}

/// The usbwire extensions an import offers beside the stream transforms.
#[derive(Clone, Copy)]
struct Extensions {
    /// Resume and keep-alive.
    resume: bool,
    /// With `resume`: the accelerator's, the storage extension and descriptor snapshots.
    accelerate: bool,
}

const RESUMABLE: Extensions = Extensions { resume: true, accelerate: true };

/// Offers stream transforms (usbwire servers only), and the `extensions`,
/// and wraps the stream in the transforms the server accepted. An empty
/// offer sends nothing. The `next` request goes right behind the offer when
/// it offers no stream transforms (none can be agreed, so what follows the
/// answer is plain whatever it says): a round trip less. Says whether `next` went.
async fn negotiate(
    stream: PeerStream,
    offer: &[TransformSpec],
    extensions: Extensions,
    reservation: Option<&ReservationToken>,
    addr: SocketAddr,
    security: &Security,
    next: Option<&OpRequest>,
) -> Result<((PeerStream, Agreed), bool), ClientError> {
    let Extensions { resume, accelerate } = extensions;
    if offer.is_empty() && !resume && reservation.is_none() {
        return Ok(((stream, Agreed::default()), false));
    }
    let next = next.filter(|_| offer.is_empty());
    let mut entries = vec![TransformSpec::list_text(offer)];
    if resume {
        entries.push(resume::OFFER.to_owned());
        entries.push(liveness::OFFER.to_owned());
    }
    if resume && accelerate {
        entries.push(storage::OFFER.to_owned());
        entries.push(descriptors::OFFER.to_owned());
    }
    let reservation_entry = reservation.map(ReservationToken::offer_entry);
    entries.extend(reservation_entry.clone());
    entries.retain(|entry| !entry.is_empty());
    let offer_text = entries.join(",");
    // The reservation token is a secret: logged without it.
    let offer_logged = match &reservation_entry {
        Some(entry) => offer_text.replace(entry, "reservation=…"),
        None => offer_text.clone(),
    };
    let mut stream = stream;
    let exchange = async {
        let mut out = BytesMut::new();
        OpRequest::Transforms { offer: offer_text.clone() }.encode(&mut out);
        if let Some(next) = next {
            next.encode(&mut out);
        }
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
    let grant = if resume { Grant::from_answer(&accepted) } else { None };
    let agreed = Agreed {
        resume: grant,
        storage: resume && storage::offered(&accepted),
        descriptors: resume && descriptors::offered(&accepted),
    };
    // The token is a secret: log what was agreed, not the answer itself.
    tracing::info!(
        offered = %offer_logged,
        accepted = %TransformSpec::list_text(&specs),
        resume = agreed.resume.is_some(),
        keepalive = agreed.resume.as_ref().is_some_and(|grant| grant.keepalive),
        storage = agreed.storage,
        descriptors = agreed.descriptors,
        "stream transforms"
    );
    let sent = next.is_some();
    if specs.is_empty() {
        return Ok(((stream, agreed), sent));
    }
    let stream = PeerStream::Transformed(Box::new(TransformedStream::new(stream, Pipeline::new(&specs, Side::Client))));
    Ok(((stream, agreed), sent))
}

/// An imported device's URB channel, and the token to resume it by when the
/// server granted resume.
pub struct Imported {
    pub stream: PeerStream,
    pub device: DeviceRecord,
    pub resume: Option<Grant>,
    /// The server runs mass-storage stages in order (the storage extension,
    /// `docs/protocol.md` §5.7): a relay may accelerate the device's storage.
    pub storage: bool,
    /// The device's descriptors as the server took them at import (§5.8),
    /// when it sends them: a relay may answer the kernel's enumeration from them.
    pub descriptors: Option<Snapshot>,
}

/// [`import_with`], offering resume too (and the accelerator's extensions,
/// which only a relay uses). A server that does not know our extensions
/// (usbipd, usbipd-win) hangs up on the offer; then the device is imported
/// again without it (when no transforms were asked for).
pub async fn import_resumable(
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
    transforms: &[TransformSpec],
) -> Result<Imported, ClientError> {
    import_for_relay(addr, busid, security, transforms, None, true).await
}

/// [`import_resumable`] for a device reserved in a lab registry: the import
/// carries the reservation's token, without which the server refuses it.
pub async fn import_reserved(
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
    transforms: &[TransformSpec],
    reservation: &ReservationToken,
) -> Result<Imported, ClientError> {
    import_for_relay(addr, busid, security, transforms, Some(reservation), true).await
}

/// A resumable import for a relay, reserved or not, offering the storage
/// extension and descriptor snapshots only when `accelerate`
/// (`usbwire attach --accelerate off` offers neither).
pub async fn import_for_relay(
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
    transforms: &[TransformSpec],
    reservation: Option<&ReservationToken>,
    accelerate: bool,
) -> Result<Imported, ClientError> {
    let extensions = Extensions { resume: true, accelerate };
    match import_inner(addr, busid, security, transforms, extensions, reservation).await {
        Err(ClientError::NoTransforms { .. }) if transforms.is_empty() && reservation.is_none() => {
            tracing::debug!(%addr, "server does not resume sessions; importing without");
            // Not a usbwire server: a refusal has no reason to ask for.
            import_plain(addr, busid, security).await
        }
        other => other,
    }
}

/// Takes a resumable session over on a new connection: offers the same
/// transforms, sends `OP_REQ_RESUME` with the token and the replies received,
/// and returns the stream and the number of commands the server had received.
pub async fn resume_session(
    addr: SocketAddr,
    security: &Security,
    transforms: &[TransformSpec],
    token: &Token,
    replies_received: u64,
) -> Result<(PeerStream, u64), ClientError> {
    let stream = connect(addr, security).await?;
    // The same extensions as the import: a relay keeps using what it agreed to then.
    let ((mut stream, _new_token), _) = negotiate(stream, transforms, RESUMABLE, None, addr, security, None).await?;
    let exchange = async {
        let mut out = BytesMut::new();
        OpRequest::Resume { token: *token, replies_received }.encode(&mut out);
        stream.write_all(&out).await?;
        stream.flush().await?;
        // Exactly the answer: URB traffic follows.
        let mut header = [0u8; op::OP_HEADER_LEN];
        stream.read_exact(&mut header).await?;
        let mut buf = BytesMut::from(&header[..]);
        if let Some(Err(_)) = op::decode_resume_reply(&mut buf)? {
            return Err(ClientError::ResumeRefused { addr: addr.to_string() });
        }
        let mut count = [0u8; 8];
        stream.read_exact(&mut count).await?;
        buf.extend_from_slice(&count);
        match op::decode_resume_reply(&mut buf)? {
            Some(Ok(commands)) => Ok(commands),
            _ => Err(ClientError::ResumeRefused { addr: addr.to_string() }),
        }
    };
    let commands = tokio::time::timeout(OP_TIMEOUT, exchange)
        .await
        .map_err(|_| ClientError::Timeout { addr: addr.to_string() })?
        .map_err(|e| closed_early(e, addr, security))?;
    Ok((stream, commands))
}

/// [`import`] with stream transforms offered first (compression, jitter buffer).
pub async fn import_with(
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
    transforms: &[TransformSpec],
) -> Result<(PeerStream, DeviceRecord), ClientError> {
    let plain = Extensions { resume: false, accelerate: false };
    let imported = import_inner(addr, busid, security, transforms, plain, None).await?;
    Ok((imported.stream, imported.device))
}

/// Imports, and when the server refuses, asks it why (`OP_REQ_DEVSTATE`,
/// [`why_refused`]) and says so in the error. A server that did not
/// answer an offer first is asked too: a stock one closes that connection,
/// and the refusal keeps its status alone.
async fn import_inner(
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
    transforms: &[TransformSpec],
    extensions: Extensions,
    reservation: Option<&ReservationToken>,
) -> Result<Imported, ClientError> {
    let stream = connect(addr, security).await?;
    let import = OpRequest::Import { busid: busid.clone() };
    let ((stream, agreed), sent) =
        negotiate(stream, transforms, extensions, reservation, addr, security, Some(&import)).await?;
    match import_on(stream, addr, busid, security, sent).await {
        Ok((mut stream, device)) => {
            let descriptors = match agreed.descriptors {
                true => Some(read_snapshot(&mut stream, addr).await?),
                false => None,
            };
            Ok(Imported { stream, device, resume: agreed.resume, storage: agreed.storage, descriptors })
        }
        Err(ClientError::Refused { busid: refused, status, .. }) => {
            let reason = why_refused(addr, busid, security).await;
            Err(ClientError::Refused { busid: refused, status, reason })
        }
        Err(error) => Err(error),
    }
}

/// What the server says of `busid` now, in words ([`crate::refusal::explain`]);
/// `None` when it does not speak `OP_REQ_DEVSTATE`, cannot be asked, or says
/// nothing that explains the refusal.
async fn why_refused(addr: SocketAddr, busid: &BusId, security: &Security) -> Option<String> {
    match server_state(addr, security).await {
        Ok(Some(document)) => crate::refusal::explain(busid.as_str(), &document),
        Ok(None) => None,
        Err(error) => {
            tracing::debug!(%addr, %error, "could not ask the server why it refused the import");
            None
        }
    }
}

/// A plain import (no offer) from a server known not to be usbwire: a
/// refusal is not explained, as that server has nothing to explain it with.
async fn import_plain(addr: SocketAddr, busid: &BusId, security: &Security) -> Result<Imported, ClientError> {
    let stream = connect(addr, security).await?;
    let (stream, device) = import_on(stream, addr, busid, security, false).await?;
    Ok(Imported { stream, device, resume: None, storage: false, descriptors: None })
}

/// The descriptor snapshot that follows a granted import's reply (§5.8):
/// exactly its bytes, the URB channel starts right after it.
async fn read_snapshot(stream: &mut PeerStream, addr: SocketAddr) -> Result<Snapshot, ClientError> {
    let exchange = async {
        let mut header = [0u8; descriptors::HEADER_LEN];
        stream.read_exact(&mut header).await?;
        let len =
            Snapshot::body_len(&header).map_err(|error| ClientError::Snapshot { addr: addr.to_string(), error })?;
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).await?;
        Snapshot::decode(body.into()).map_err(|error| ClientError::Snapshot { addr: addr.to_string(), error })
    };
    tokio::time::timeout(OP_TIMEOUT, exchange).await.map_err(|_| ClientError::Timeout { addr: addr.to_string() })?
}

/// `OP_REQ_IMPORT` on a connected (and negotiated) stream, unless it was
/// `sent` already (behind the offer): its reply.
async fn import_on(
    mut stream: PeerStream,
    addr: SocketAddr,
    busid: &BusId,
    security: &Security,
    sent: bool,
) -> Result<(PeerStream, DeviceRecord), ClientError> {
    let exchange = async {
        if !sent {
            let mut out = BytesMut::new();
            OpRequest::Import { busid: busid.clone() }.encode(&mut out);
            stream.write_all(&out).await?;
            stream.flush().await?;
        }
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
            return Err(ClientError::Refused { busid: busid.to_string(), status, reason: None });
        }
        let mut body = vec![0u8; op::DEVICE_RECORD_LEN];
        stream.read_exact(&mut body).await?;
        buf.extend_from_slice(&body);
        match op::decode_import_reply(&mut buf)? {
            Some(Ok(device)) if device.busid == *busid => Ok(device),
            Some(Ok(device)) => {
                Err(ClientError::WrongDevice { wanted: busid.to_string(), got: device.busid.to_string() })
            }
            Some(Err(status)) => Err(ClientError::Refused { busid: busid.to_string(), status, reason: None }),
            None => Err(ClientError::Io(std::io::ErrorKind::UnexpectedEof.into())),
        }
    };
    let device = tokio::time::timeout(OP_TIMEOUT, exchange)
        .await
        .map_err(|_| ClientError::Timeout { addr: addr.to_string() })?
        .map_err(|e| closed_early(e, addr, security))?;
    Ok((stream, device))
}
