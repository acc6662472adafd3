//! The server's side: register in the lab registry, keep the registration
//! alive and current, and enforce the reservations made there.
//!
//! One task per server ([`publish`]). It grants a lease, puts the server's
//! entry and one entry per exported device under it, then follows three
//! things at once: the server's device list (each change is published as it
//! happens), the lease (renewed every third of its time to live) and the
//! reservations of this server's devices (handed to the server, which refuses
//! imports without the reservation's token). When etcd cannot be reached the
//! server serves on as if it had no registry (reservations are not enforced
//! meanwhile) and registers again, with a new lease, once etcd answers.

use std::collections::HashMap;
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use tracing::{debug, info, warn};
use usbwire_host::Selector;
use usbwire_server::{DeviceState, ExportInfo, Registry, ReservationDigest};

use crate::entry::{
    decode, timestamp, Availability, DeviceEntry, Key, Keys, ReservationEntry, ServerEntry, SCHEMA_VERSION,
};
use crate::etcd::{keep_alive, Endpoint};
use crate::LabError;

/// etcd's default limit on operations in one transaction is 128.
const OPS_PER_TXN: usize = 100;
/// Retrying an unreachable registry: from this, doubling, up to [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// What a server registers, and where.
#[derive(Clone, Debug)]
pub struct Registration {
    pub endpoint: Endpoint,
    /// The lease's time to live: how long a dead server stays listed.
    pub ttl: Duration,
    pub server: ServerEntry,
    /// Labels for devices that match a selector (`[[bind]] labels`, `[[virtual]] labels`).
    pub labels: Vec<(Selector, Vec<String>)>,
}

/// Registers the server and keeps the registry current, for as long as the
/// server runs (abort the task to stop). Never fails: an unreachable
/// registry is logged once and retried.
pub async fn publish(registration: Registration, registry: Registry) {
    let url = registration.endpoint.url.to_string();
    let mut retry = RETRY_MIN;
    let mut pause = Duration::ZERO;
    let mut registered_before = false;
    let mut said_unreachable = false;
    loop {
        tokio::time::sleep(pause).await;
        let error = match Session::start(&registration, &registry).await {
            Ok(mut session) => {
                info!(
                    registry = %url,
                    server = %registration.server.address,
                    devices = session.devices,
                    ttl_secs = registration.ttl.as_secs(),
                    "{}",
                    if registered_before { "registered again in the lab registry" } else { "registered in the lab registry" }
                );
                registered_before = true;
                said_unreachable = false;
                retry = RETRY_MIN;
                let started = tokio::time::Instant::now();
                let error = session.run(&registration, &registry).await;
                // The member we talked to went away (or the lease or watch ended):
                // register again at once through another, reservations still in
                // force meanwhile; only a cluster that does not answer at all
                // makes the server serve without them.
                info!(registry = %url, %error, "lost the lab registry connection; registering again");
                pause = if started.elapsed() < RETRY_MIN { RETRY_MIN } else { Duration::ZERO };
                continue;
            }
            Err(error) => error,
        };
        // Not enforceable while the registry cannot be read: serve directly.
        registry.forget_reservations();
        if said_unreachable {
            debug!(registry = %url, %error, "lab registry still unreachable");
        } else {
            warn!(registry = %url, %error, "lab registry unreachable; serving directly and trying again");
            said_unreachable = true;
        }
        pause = retry;
        retry = (retry * 2).min(RETRY_MAX);
    }
}

/// One registration: a client, a lease, and what was put under it.
struct Session {
    client: Client,
    keys: Keys,
    lease: i64,
    /// Key → value of every device entry and index entry published.
    published: HashMap<String, String>,
    devices: usize,
    reservations: HashMap<String, ReservationDigest>,
    revision: i64,
}

impl Session {
    async fn start(registration: &Registration, registry: &Registry) -> Result<Self, LabError> {
        let mut client = registration.endpoint.connect().await?;
        let keys = Keys::new(&registration.endpoint.url.prefix);
        let ttl = i64::try_from(registration.ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let lease = client.lease_grant(ttl, None).await?.id();
        let server = &registration.server;
        let entry = serde_json::to_string(server).unwrap_or_default();
        client.put(keys.server(&server.address), entry, Some(PutOptions::new().with_lease(lease))).await?;
        let mut session = Self {
            client,
            keys,
            lease,
            published: HashMap::new(),
            devices: 0,
            reservations: HashMap::new(),
            revision: 0,
        };
        // Reservations now (the index shows them), then every change after them.
        let held = session
            .client
            .get(session.keys.reservations_of(&server.address), Some(GetOptions::new().with_prefix()))
            .await?;
        session.revision = held.header().map_or(0, |h| h.revision());
        for kv in held.kvs() {
            session.reservation_changed(kv.key(), Some(kv.value()));
        }
        registry.set_reservations(session.reservations.clone());
        session.sync(registration, registry).await?;
        Ok(session)
    }

    /// Follows the device list, the lease and the reservations until one of them fails.
    async fn run(&mut self, registration: &Registration, registry: &Registry) -> LabError {
        let address = &registration.server.address;
        let mut changes = registry.changes();
        let renewing =
            tokio::spawn(keep_alive(registration.endpoint.clone(), self.client.clone(), self.lease, registration.ttl));
        let renewing_abort = renewing.abort_handle();
        let _stop_renewing = scopeguard(move || renewing_abort.abort());
        let options = WatchOptions::new().with_prefix().with_start_revision(self.revision + 1);
        let mut watch = match self.client.watch(self.keys.reservations_of(address), Some(options)).await {
            Ok(watch) => watch,
            Err(error) => return error.into(),
        };
        tokio::pin!(renewing);
        loop {
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return LabError::Unreachable { url: registration.endpoint.url.to_string(), reason: "server stopped".into(), tls: false };
                    }
                    if let Err(error) = self.sync(registration, registry).await {
                        return error;
                    }
                }
                lost = &mut renewing => {
                    return lost.unwrap_or_else(|_| LabError::LeaseLost { lease: self.lease, reason: "renewal stopped".into() });
                }
                message = watch.message() => {
                    let response = match message {
                        Ok(Some(response)) => response,
                        Ok(None) => return LabError::Unreachable { url: registration.endpoint.url.to_string(), reason: "the reservation watch ended".into(), tls: false },
                        Err(error) => return error.into(),
                    };
                    if response.canceled() {
                        return LabError::Unreachable { url: registration.endpoint.url.to_string(), reason: format!("the reservation watch was cancelled: {}", response.cancel_reason()), tls: false };
                    }
                    for event in response.events() {
                        let Some(kv) = event.kv() else { continue };
                        let value = (event.event_type() == EventType::Put).then(|| kv.value());
                        self.reservation_changed(kv.key(), value);
                    }
                    registry.set_reservations(self.reservations.clone());
                    // The index says which devices are reserved.
                    if let Err(error) = self.sync(registration, registry).await {
                        return error;
                    }
                }
            }
        }
    }

    /// Puts what changed in the device list and its index, and deletes what
    /// went, in as few transactions as fit.
    async fn sync(&mut self, registration: &Registration, registry: &Registry) -> Result<(), LabError> {
        let address = &registration.server.address;
        let mut now: HashMap<String, String> = HashMap::new();
        let exports = registry.list();
        for export in &exports {
            let entry = device_entry(address, export, &registration.labels);
            let availability = Availability::of(&entry.state, self.reservations.contains_key(&entry.busid));
            for key in self.keys.index_entries(&entry) {
                now.insert(key, availability.to_owned());
            }
            now.insert(self.keys.device(address, &entry.busid), serde_json::to_string(&entry).unwrap_or_default());
        }
        let mut ops = Vec::new();
        for (key, value) in &now {
            if self.published.get(key) != Some(value) {
                let put = PutOptions::new().with_lease(self.lease);
                ops.push(TxnOp::put(key.clone(), value.clone(), Some(put)));
            }
        }
        for key in self.published.keys().filter(|key| !now.contains_key(*key)) {
            ops.push(TxnOp::delete(key.clone(), None));
        }
        let count = ops.len();
        while !ops.is_empty() {
            let batch: Vec<TxnOp> = ops.drain(..ops.len().min(OPS_PER_TXN)).collect();
            self.client.txn(Txn::new().and_then(batch)).await?;
        }
        if count > 0 {
            debug!(changed = count, "published device changes");
        }
        self.published = now;
        self.devices = exports.len();
        Ok(())
    }

    fn reservation_changed(&mut self, key: &[u8], value: Option<&[u8]>) {
        let Some(Key::Reservation { busid, .. }) = self.keys.parse(key) else { return };
        let digest = value.and_then(decode::<ReservationEntry>).and_then(|entry| digest_from_hex(&entry.token_sha256));
        match digest {
            Some(digest) => {
                info!(%busid, "device reserved in the lab registry");
                self.reservations.insert(busid, digest);
            }
            // Gone; an unreadable one counts as none (and is logged).
            None => {
                if value.is_some() {
                    warn!(%busid, "unreadable reservation in the lab registry; ignored");
                }
                if self.reservations.remove(&busid).is_some() {
                    info!(%busid, "reservation ended");
                }
            }
        }
    }
}

/// What the registry shows of an exported device.
pub fn device_entry(server: &str, export: &ExportInfo, labels: &[(Selector, Vec<String>)]) -> DeviceEntry {
    let record = &export.record;
    let summary = &export.summary;
    let text = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    let (state, holder, since) = match &export.state {
        DeviceState::Available => ("available", None, None),
        DeviceState::InUse { client, since, identity, resuming_since } => (
            if resuming_since.is_some() { "resuming" } else { "in_use" },
            Some(identity.clone().unwrap_or_else(|| client.to_string())),
            Some(timestamp(*since)),
        ),
    };
    let mut device_labels: Vec<String> = Vec::new();
    for (selector, names) in labels {
        if selector_matches(selector, export) {
            for name in names {
                if !device_labels.contains(name) {
                    device_labels.push(name.clone());
                }
            }
        }
    }
    DeviceEntry {
        schema_version: SCHEMA_VERSION,
        server: server.to_owned(),
        busid: record.busid.to_string(),
        kind: export.kind.clone(),
        vendor_id: format!("{:04x}", record.id_vendor),
        product_id: format!("{:04x}", record.id_product),
        manufacturer: text(&summary.manufacturer),
        product: text(&summary.product),
        serial: text(&summary.serial),
        class: format!("{:02x}", record.b_device_class),
        interface_classes: record.interfaces.iter().map(|i| format!("{:02x}", i.b_interface_class)).collect(),
        speed: summary.speed.name().to_owned(),
        state: state.to_owned(),
        holder,
        since_at: since,
        labels: device_labels,
    }
}

fn selector_matches(selector: &Selector, export: &ExportInfo) -> bool {
    let record = &export.record;
    match selector {
        Selector::BusId(busid) => record.busid.as_str() == busid,
        Selector::VidPid { vendor_id, product_id } => {
            record.id_vendor == *vendor_id && record.id_product == *product_id
        }
        Selector::Serial(serial) => !serial.is_empty() && &export.summary.serial == serial,
        Selector::Class(class) => {
            record.b_device_class == *class || record.interfaces.iter().any(|i| i.b_interface_class == *class)
        }
    }
}

fn digest_from_hex(hex: &str) -> Option<ReservationDigest> {
    usbwire_proto::reservation::ReservationToken::from_hex(hex).map(|token| token.0)
}

/// Runs `f` when dropped.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_entries_carry_identity_state_and_labels() {
        let mut server = usbwire_server::Server::new(usbwire_server::ServerConfig::default());
        let disk = server.export("loopback", Box::new(usbwire_gadgets::loopback(usbwire_device::Speed::HIGH)));
        let keyboard = server.export("keyboard", Box::new(usbwire_gadgets::keyboard().0));
        let labels = vec![
            (Selector::BusId(disk.to_string()), vec!["nucleo".to_owned(), "bench-3".to_owned()]),
            ("class=03".parse().unwrap(), vec!["hid".to_owned(), "nucleo".to_owned()]),
        ];
        let entries: Vec<DeviceEntry> =
            server.registry().list().iter().map(|export| device_entry("10.0.0.5:3240", export, &labels)).collect();
        let by_busid = |busid: &usbwire_proto::op::BusId| entries.iter().find(|e| e.busid == busid.as_str()).unwrap();
        let loopback = by_busid(&disk);
        assert_eq!(loopback.labels, ["nucleo", "bench-3"]);
        assert_eq!(
            (loopback.server.as_str(), loopback.state.as_str(), loopback.holder.as_deref()),
            ("10.0.0.5:3240", "available", None)
        );
        assert_eq!(loopback.schema_version, SCHEMA_VERSION);
        let hid = by_busid(&keyboard);
        assert_eq!(hid.labels, ["hid", "nucleo"], "each label once, in rule order");
        assert_eq!((hid.vendor_id.as_str(), hid.product_id.as_str()), ("1209", "0001"));
        assert_eq!(hid.interface_classes, ["03"]);
        assert_eq!(hid.speed, "high");
        let json: serde_json::Value = serde_json::to_value(hid).unwrap();
        assert_eq!(json["product"], "usbwire keyboard");
    }

    #[test]
    fn reservation_digests_parse_from_their_hex() {
        let token = usbwire_proto::reservation::ReservationToken([0x5a; 32]);
        let digest = usbwire_server::reservation_digest(&token);
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(digest_from_hex(&hex), Some(digest));
        assert_eq!(digest_from_hex("00"), None);
    }
}
