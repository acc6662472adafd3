//! How a URB channel ends on the server's side: the end said to a resumable
//! client (END with its reason, then FIN), and the close after it that never
//! resets the connection. Not for ends the client starts (`urb_channel`).

use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::debug;
use usbwire_proto::resume::EndReason;
use usbwire_proto::server_session::ServerSession;
use usbwire_transport::{poll_write_outbox, PeerStream};

/// How long a shutting-down server tries to deliver a resumable client's last replies and the end.
const GOODBYE_TIMEOUT: Duration = Duration::from_secs(1);

/// The session ends on this side (the server shuts down, the device
/// re-enumerated): writes the replies already queued, then tells a resumable
/// client there is no session to resume and why, so it does not retry for its
/// whole give-up time. Returns the connection, for [`linger`].
pub(super) async fn say_goodbye(session: &mut ServerSession, mut stream: PeerStream, reason: EndReason) -> PeerStream {
    session.end_for(reason);
    let said = tokio::time::timeout(GOODBYE_TIMEOUT, async {
        while !session.outbox().is_empty() {
            if !std::future::poll_fn(|cx| poll_write_outbox(session.outbox(), cx, &mut stream)).await? {
                break;
            }
        }
        stream.shutdown().await
    })
    .await;
    if !matches!(said, Ok(Ok(()))) {
        debug!("could not tell the client the session ended");
    }
    stream
}

/// After the end was said: reads and drops what the client still sends
/// until it closes its side (or [`GOODBYE_TIMEOUT`]), then closes. Closing
/// with bytes unread would send a reset, which a proxy on the way passes on
/// at once, dropping the end it still holds for the client.
pub(super) async fn linger(mut stream: PeerStream) {
    let mut sink = [0u8; 4096];
    let drained = tokio::time::timeout(GOODBYE_TIMEOUT, async {
        while stream.read(&mut sink).await? > 0 {}
        Ok::<(), io::Error>(())
    })
    .await;
    if !matches!(drained, Ok(Ok(()))) {
        debug!("the client did not close after the end; closing anyway");
    }
}
