//! `OP_REQ_TRANSFORMS` (our extension): answers the offer ([`negotiate`]),
//! then puts the agreed stream transforms under the connection, for the real
//! request and everything after it.

use tracing::{info, warn};
use usbwire_proto::op;
use usbwire_proto::resume::Token;

use super::negotiate::{negotiate, Negotiated};
use super::stream::OpStream;
use crate::config::ServerConfig;

/// Answers `offer`; `None` when the connection is done with (closed, or the
/// client did not wait for the answer).
pub(crate) async fn agree(mut stream: OpStream, offer: &str, config: &ServerConfig) -> Option<(OpStream, Negotiated)> {
    let negotiated = negotiate(offer, config, Token(rand::random()));
    stream.reply(|out| op::encode_transforms_reply(&negotiated.answer, out)).await.ok()?;
    if stream.has_leftover() && !negotiated.transforms.is_empty() {
        // Bytes read before the transforms were put under the stream: not
        // transformed as the client must send them. Without transforms, they
        // are the next request, sent behind the offer.
        warn!("client sent more before the transform answer; closing");
        return None;
    }
    info!(
        // The reservation token is a secret: logged without it.
        offered = %match &negotiated.reservation {
            Some(token) => offer.replace(&token.hex(), "…"),
            None => offer.to_owned(),
        },
        accepted = %negotiated.accepted,
        resume = negotiated.resume.is_some(),
        reservation = negotiated.reservation.is_some(),
        storage = negotiated.storage,
        descriptors = negotiated.descriptors,
        "stream transforms"
    );
    let stream = if negotiated.transforms.is_empty() {
        stream
    } else {
        stream.transformed(&negotiated.transforms, config.budget.decoded_bytes)
    };
    Some((stream, negotiated))
}
