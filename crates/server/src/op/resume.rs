//! `OP_REQ_RESUME` (our extension): hands the connection to the parked
//! session its token names, which answers it and carries on with it
//! ([`crate::resumable`]); anyone else gets `ST_NODEV`.

use tracing::info;
use usbwire_proto::op::{self, OpStatus};
use usbwire_proto::resume::Token;
use usbwire_transport::access::ClientId;

use super::stream::{write_reply, OpStream};
use crate::peer::Peer;
use crate::resumable::{Handover, Owner};
use crate::state::ServerState;

pub(crate) async fn hand_over(
    stream: OpStream,
    token: Token,
    replies_received: u64,
    client: ClientId,
    peer: Peer,
    state: &ServerState,
) {
    let owner = Owner::new(client.clone(), peer.addr.ip());
    let (stream, leftover) = stream.into_parts();
    let arrival = Handover { stream, leftover, replies_received, peer };
    if let Err((refused, mut stream)) = state.parked.hand_over(&token, &owner, arrival) {
        info!(?token, %client, reason = %refused, "resume refused");
        let _ = write_reply(&mut stream, |out| op::encode_resume_reply(Err(OpStatus::NODEV), out)).await;
    }
}
