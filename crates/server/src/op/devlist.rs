//! `OP_REQ_DEVLIST`: the devices this client may see and import now (like
//! usbipd, only those not in use).

use tracing::debug;
use usbwire_proto::op::{self, DeviceRecord};
use usbwire_transport::access::ClientId;

use super::stream::OpStream;
use crate::state::ServerState;

pub(crate) async fn answer(mut stream: OpStream, client: &ClientId, state: &ServerState) {
    let visible =
        |kind: &str, device: &DeviceRecord, serial: &str| state.config.security.may_use(client, kind, device, serial);
    let devices = state.registry.devlist(visible);
    debug!(devices = devices.len(), "device list");
    if let Err(error) = stream.reply(|out| op::encode_devlist_reply(&devices, out)).await {
        debug!(%error, "device list not delivered");
    }
}
