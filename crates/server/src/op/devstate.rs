//! `OP_REQ_DEVSTATE` (our extension): every device this client may see, with
//! who holds it, its reservation and counters (the document `usbwire state`
//! prints), the devices withdrawn lately, and whether this plain client must
//! use TLS to see any device (`tls_required`).

use tracing::debug;
use usbwire_proto::op::{self, DeviceRecord};
use usbwire_transport::access::ClientId;

use super::stream::OpStream;
use crate::devstate;
use crate::state::ServerState;

pub(crate) async fn answer(mut stream: OpStream, client: &ClientId, state: &ServerState) {
    let visible =
        |kind: &str, device: &DeviceRecord, serial: &str| state.config.security.may_use(client, kind, device, serial);
    let mut document = devstate::document(&state.registry, visible);
    document.tls_required = *client == ClientId::Plain && state.config.security.tls_only();
    let body = serde_json::to_vec(&document).unwrap_or_default();
    debug!(devices = document.devices.len(), withdrawn = document.withdrawn.len(), "device state");
    let _ = stream.reply(|out| op::encode_devstate_reply(&body, out)).await;
}
