//! What the tasks of one running server share: its configuration, the
//! [`Registry`] of exported devices, the sessions parked for their client to
//! resume, the server's counters, the capture switch and the admission gate.
//!
//! Built once when the server binds (or starts in process) and handed to
//! every connection, the control socket and the HTTP responder as an
//! `Arc<ServerState>`. It holds; it does not decide: importing is the
//! registry's business, parking the resumable sessions', counting the meters'.

use std::sync::Arc;

use crate::admission::Gate;
use crate::capture::CaptureSwitch;
use crate::config::ServerConfig;
use crate::meter::ServerMeter;
use crate::registry::Registry;
use crate::resumable::Parked;

pub(crate) struct ServerState {
    pub(crate) config: ServerConfig,
    /// The exported devices, their holders and reservations.
    pub(crate) registry: Registry,
    /// Imports whose connection dropped, waiting for their client to resume.
    pub(crate) parked: Parked,
    /// The server's own counters (connections, refusals).
    pub(crate) meter: Arc<ServerMeter>,
    /// Where imports are captured now; every URB channel follows it.
    pub(crate) capture: CaptureSwitch,
    /// Places for connections not yet authenticated; its totals say what was refused.
    pub(crate) gate: Gate,
}

impl ServerState {
    pub(crate) fn new(config: ServerConfig, registry: Registry) -> Arc<Self> {
        let gate = Gate::new(config.admission.clone(), config.max_connections);
        Arc::new(Self {
            capture: CaptureSwitch::new(config.capture.clone()),
            registry,
            parked: Parked::default(),
            meter: Arc::default(),
            gate,
            config,
        })
    }
}
