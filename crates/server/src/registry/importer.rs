//! Who asks the registry for a device ([`Importer`]) and why it may be
//! refused ([`ImportError`], with the status `OP_REP_IMPORT` carries). The
//! decision itself is the registry's.

use std::net::SocketAddr;
use std::time::Duration;

use usbwire_proto::op::OpStatus;
use usbwire_proto::reservation::ReservationToken;

use crate::peer::PeerProbe;

/// Who asks for a device: the connection's address, its TLS identity, and a
/// way to tell later whether its peer is still there.
pub(crate) struct Importer {
    pub(crate) client: SocketAddr,
    pub(crate) identity: Option<String>,
    pub(crate) probe: PeerProbe,
    /// The lab registry reservation the client's offer carried.
    pub(crate) reservation: Option<ReservationToken>,
}

/// Why an import was refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ImportError {
    /// No such export, or one this client may not see.
    #[error("no such device for this client (see `usbwire list -r` for what it may import)")]
    NoDevice,
    /// Held by a live connection.
    #[error("device busy: imported by {holder}; detach it there first")]
    InUse { holder: SocketAddr },
    /// The previous holder's connection had ended but its device was not back within the bound.
    #[error("device busy: still being released by its previous importer after {} ms; try again", .waited.as_millis())]
    StillReleasing { waited: Duration },
    /// Reserved in the lab registry, and the import did not carry that reservation.
    #[error("device reserved in the lab registry by another client (reserve it with `usbwire attach --registry URL --device …`)")]
    Reserved,
}

impl ImportError {
    /// What `OP_REP_IMPORT` says.
    pub(crate) fn status(&self) -> OpStatus {
        match self {
            Self::NoDevice => OpStatus::NODEV,
            Self::InUse { .. } | Self::StillReleasing { .. } | Self::Reserved => OpStatus::DEV_BUSY,
        }
    }
}
