//! `OP_REQ_IMPORT`: takes the device from the registry ([`Registry::import`](crate::registry::Registry::import)),
//! answers with its record (and the device's descriptor snapshot, when the
//! client asked for one: `crate::descriptor_snapshot`), and turns the connection into the device's URB
//! channel ([`crate::urb_channel`]) until either side ends it; then gives the
//! device back. A bus id that cannot be one gets `ST_NODEV` at once.

use std::net::SocketAddr;

use bytes::BytesMut;
use tokio::sync::watch;
use tracing::{info, warn, Instrument};
use usbwire_proto::op::{self, BusId, DeviceRecord, OpStatus};
use usbwire_proto::resume::Grant;
use usbwire_transport::access::ClientId;

use super::negotiate::Negotiated;
use super::stream::OpStream;
use crate::descriptor_snapshot;
use crate::peer::Peer;
use crate::registry::{Importer, Lease};
use crate::resumable::Owner;
use crate::state::ServerState;
use crate::urb_channel::{self, Agreed, End, Resumable};

/// Imports `busid` for `client` and serves it until the import ends.
pub(crate) async fn serve(
    mut stream: OpStream,
    busid: BusId,
    negotiated: Negotiated,
    client: ClientId,
    peer: Peer,
    state: &ServerState,
    stop: watch::Receiver<bool>,
) {
    // The ticket keeps the connection's place in the admission budgets until the import ends.
    let Peer { addr, ticket: _ticket, probe } = peer;
    let visible =
        |kind: &str, device: &DeviceRecord, serial: &str| state.config.security.may_use(&client, kind, device, serial);
    let importer = Importer { client: addr, identity: identity(&client), probe, reservation: negotiated.reservation };
    let mut lease = match state.registry.import(&busid, importer, visible, state.config.admission.release_wait).await {
        Ok(lease) => lease,
        Err(refused) => {
            info!(%busid, %client, reason = %refused, "import refused");
            let _ = stream.reply(|out| op::encode_import_reply(Err(refused.status()), out)).await;
            return;
        }
    };
    // Taken before the reply, and sent with it: the client reads both before
    // any URB. Taken for a capture too, whose files start with it (a client
    // answering the enumeration from it sends none of those requests).
    let snapshot = match negotiated.descriptors || state.capture.is_on() {
        true => {
            let devid = lease.record().devid();
            Some(descriptor_snapshot::take(lease.device(), devid).await)
        }
        false => None,
    };
    let reply = |out: &mut BytesMut| {
        op::encode_import_reply(Ok(lease.record()), out);
        if let Some(snapshot) = snapshot.as_ref().filter(|_| negotiated.descriptors) {
            snapshot.encode(out);
        }
    };
    if let Err(error) = stream.reply(reply).await {
        warn!(%busid, %error, "import reply not delivered");
        lease.release().await;
        return;
    }
    let owner = Owner::new(client, addr.ip());
    let resumable = negotiated.resume.map(|Grant { token, keepalive, .. }| Resumable {
        token,
        keepalive,
        client: owner,
        parked: state.parked.clone(),
        grace: state.config.resume_grace,
    });
    let agreed = Agreed { resumable, storage: negotiated.storage, descriptors: snapshot };
    urb_phase(stream, &mut lease, agreed, addr, state, stop).await;
    // Resets the device (on a blocking thread) and makes it available again.
    lease.release().await;
}

/// The imported device's URB channel, until the client or the server ends it
/// or the export is withdrawn; logs how it ended.
async fn urb_phase(
    stream: OpStream,
    lease: &mut Lease,
    agreed: Agreed,
    addr: SocketAddr,
    state: &ServerState,
    stop: watch::Receiver<bool>,
) {
    let busid = lease.record().busid.clone();
    let span = tracing::info_span!("urb", %busid, devid = format_args!("{:#x}", lease.record().devid()));
    span.in_scope(|| info!("imported"));
    let (stream, leftover) = stream.into_parts();
    let channel = urb_channel::run(stream, leftover, lease, state, stop, agreed, addr).instrument(span.clone());
    let outcome = channel.await;
    let _enter = span.enter();
    match outcome {
        Ok(End::ClientClosed | End::ClientEnded) => info!("client disconnected"),
        Ok(End::Shutdown) => info!("closed for server shutdown"),
        Ok(End::DeviceGone) => info!("device unplugged; connection closed"),
        Ok(End::Withdrawn) => info!("device unbound; connection closed"),
        Ok(End::Reenumerated { seen_at }) => {
            info!("device re-enumerated; import ended (the bus id is exported again when it is back)");
            lease.reenumerated(seen_at);
        }
        Err(error) => warn!(%error, "connection closed"),
    }
}

/// `OP_REQ_IMPORT` naming something that cannot be a bus id.
pub(crate) async fn refuse_malformed(mut stream: OpStream, requested: &[u8], client: &ClientId) {
    info!(busid = %requested.escape_ascii(), %client, "import refused: not a bus id");
    let _ = stream.reply(|out| op::encode_import_reply(Err(OpStatus::NODEV), out)).await;
}

/// What `usbwire state` shows as the importer's identity.
fn identity(client: &ClientId) -> Option<String> {
    match client {
        ClientId::Certificate(fingerprint) => Some(fingerprint.to_string()),
        ClientId::CaIssued { .. } => Some(client.to_string()),
        ClientId::Plain => None,
    }
}
