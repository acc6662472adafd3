//! Keeping a device imported: after the connection drops or the server
//! restarts, reconnect and import again with exponential backoff — the first
//! retry at once, then doubling up to a cap of a few seconds — logging each
//! step, so a long-running user of a device sees a pause, not an end.
//!
//! Imports are resumable ([`Connection::import_resumable`]): against a server
//! that grants resume, a dropped link is resumed under the connection and
//! nothing here notices; only a lost session (the server restarted, or the
//! outage outlived its grace period) closes the connection and leads to a new
//! import. Servers without resume are imported again after every drop.

use std::net::SocketAddr;

use tracing::{info, warn};
use usbwire_proto::op::BusId;

use usbwire_proto::retry::{Backoff, Retry};

use crate::{ClientError, Connection, Security};

/// One remote device, imported again whenever its connection is lost.
pub struct ReattachingDevice {
    addr: SocketAddr,
    busid: BusId,
    security: Security,
    backoff: Backoff,
    connection: Option<Connection>,
    imports: u64,
}

impl ReattachingDevice {
    pub fn new(addr: SocketAddr, busid: BusId, security: Security) -> Self {
        Self { addr, busid, security, backoff: Retry::SOON.backoff(), connection: None, imports: 0 }
    }

    /// The live connection, importing the device first if there is none or the
    /// last one closed; retries (with backoff) until it succeeds, so callers
    /// bound it with a timeout. The flag is true after a fresh import: the
    /// server has reset the device, so configure it again.
    pub async fn connection(&mut self) -> (&Connection, bool) {
        if self.connection.as_ref().is_some_and(Connection::is_closed) {
            warn!(addr = %self.addr, busid = %self.busid, "connection lost; importing again");
            self.connection = None;
        }
        let fresh = self.connection.is_none();
        let connection = loop {
            if let Some(connection) = self.connection.take() {
                break connection;
            }
            let delay = self.backoff.next_delay();
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            match self.import().await {
                Ok(connection) => {
                    self.imports += 1;
                    self.backoff.reset();
                    info!(addr = %self.addr, busid = %self.busid, imports = self.imports, "imported");
                    break connection;
                }
                Err(error) => warn!(addr = %self.addr, busid = %self.busid, %error, "import failed; retrying"),
            }
        };
        (self.connection.insert(connection), fresh)
    }

    /// Forgets the current connection (after a transfer reported it lost).
    pub fn disconnect(&mut self) {
        self.connection = None;
    }

    /// How many times the device has been imported.
    pub fn imports(&self) -> u64 {
        self.imports
    }

    async fn import(&self) -> Result<Connection, ClientError> {
        let (connection, _) = Connection::import_resumable(self.addr, &self.busid, &self.security, &[]).await?;
        Ok(connection)
    }
}
