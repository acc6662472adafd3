//! The OP phase of a connection, as mini-redis serves a command: a stream that
//! reads requests and writes replies ([`stream`]), and one file per request
//! (`devlist`, `devstate`, `import`, `resume`, `transforms`, whose answer is
//! [`negotiate`]d without I/O).
//!
//! Like usbipd, a connection carries exactly one OP request — after an
//! optional transform offer (our extension), which may also ask for resume
//! and carry a lab reservation. A device list or state is answered and the
//! connection closed; a failed import gets its status and is closed; a
//! successful import turns the socket into the device's URB channel.

mod devlist;
mod devstate;
mod import;
mod negotiate;
mod resume;
mod stream;
mod transforms;

use std::sync::Arc;

use tokio::sync::watch;
use tracing::warn;
use usbwire_proto::op::OpRequest;
use usbwire_transport::access::ClientId;
use usbwire_transport::PeerStream;

use crate::peer::Peer;
use crate::state::ServerState;
use negotiate::Negotiated;
use stream::OpStream;

/// Everything after the transport is settled and the client named: the OP
/// phase (with the transform negotiation), then the URB phase of an import.
pub(crate) async fn serve_session(
    stream: PeerStream,
    client: ClientId,
    mut peer: Peer,
    state: Arc<ServerState>,
    stop: watch::Receiver<bool>,
) {
    let mut stream = OpStream::new(stream, &state.config);
    let Some(mut request) = stream.read_request(&peer.ticket).await else { return };
    let mut negotiated = Negotiated::default();
    if let OpRequest::Transforms { offer } = &request {
        let Some(agreed) = transforms::agree(stream, offer, &state.config).await else { return };
        (stream, negotiated) = agreed;
        let Some(next) = stream.read_request(&peer.ticket).await else { return };
        request = next;
    }
    if !peer.ticket.authenticate() {
        return;
    }
    match request {
        OpRequest::DevList => devlist::answer(stream, &client, &state).await,
        OpRequest::DevState => devstate::answer(stream, &client, &state).await,
        OpRequest::Import { busid } => import::serve(stream, busid, negotiated, client, peer, &state, stop).await,
        OpRequest::ImportMalformedBusId { requested } => import::refuse_malformed(stream, &requested, &client).await,
        OpRequest::Resume { token, replies_received } => {
            resume::hand_over(stream, token, replies_received, client, peer, &state).await;
        }
        OpRequest::Transforms { .. } => warn!("transforms offered twice; closing"),
    }
}
