//! Sessions waiting for their client to come back ([`usbwire_proto::resume`]).
//!
//! A resumable import registers here under its token for as long as it lives.
//! When it loses its connection, its task keeps the device and the session
//! for the grace period ([`crate::cores::park::Grace`] says when it is over,
//! and whether a resume came in time). A new connection that sends `OP_REQ_RESUME` with
//! that token, from the same owner ([`Owner`]: the same TLS identity, or for
//! a plain client the same IP address), is handed over to the task (which
//! drops the old connection if it had not noticed the loss yet), answers it
//! and carries on; anything else gets `ST_NODEV`.
//!
//! A plain client's token crosses the wire in clear: whoever sniffs it could
//! take the session over, even while its owner is connected. Binding it to
//! the address it was issued to leaves that only to someone who can also
//! send from that address.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use tokio::sync::mpsc;
use usbwire_device::sync::lock;
use usbwire_proto::resume::Token;
use usbwire_transport::access::ClientId;
use usbwire_transport::PeerStream;

use crate::peer::Peer;

/// A new connection for a parked session: the stream just past its resume
/// request, and what the client has received.
pub(crate) struct Handover {
    pub(crate) stream: PeerStream,
    pub(crate) leftover: BytesMut,
    pub(crate) replies_received: u64,
    /// Keeps the new connection's place in the admission budgets.
    pub(crate) peer: Peer,
}

/// Who may resume a session: the TLS identity that imported it, or for a
/// plain client (which has none) the IP address it imported from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Owner {
    client: ClientId,
    /// Plain clients only.
    address: Option<IpAddr>,
}

impl Owner {
    /// The owner of a session `client` imports, or resumes, from `address`.
    pub(crate) fn new(client: ClientId, address: IpAddr) -> Self {
        let address = (client == ClientId::Plain).then(|| address.to_canonical());
        Self { client, address }
    }
}

/// Why a resume request was not handed over.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refused {
    /// No session parked under that token (never was, expired, or taken over).
    #[error("no session is waiting under that token")]
    Unknown,
    /// Parked, but imported by another identity.
    #[error("the session belongs to another client")]
    OtherClient,
    /// Parked, imported by a plain client from another address (a sniffed token?).
    #[error("the session belongs to a plain client at another address")]
    OtherAddress,
}

struct Slot {
    token: Token,
    owner: Owner,
    handover: mpsc::Sender<Handover>,
}

/// The parked sessions of one server. Cheap to clone (shared).
#[derive(Clone, Default)]
pub(crate) struct Parked {
    /// By the token's first half; the whole token is compared in constant time.
    slots: Arc<Mutex<HashMap<[u8; 16], Slot>>>,
}

fn key(token: &Token) -> [u8; 16] {
    let mut key = [0u8; 16];
    key.copy_from_slice(&token.0[..16]);
    key
}

impl Parked {
    /// Registers a session until the returned [`Parking`] is dropped.
    pub(crate) fn park(&self, token: Token, owner: Owner) -> Parking {
        let (handover, arrivals) = mpsc::channel(1);
        lock(&self.slots).insert(key(&token), Slot { token, owner, handover });
        Parking { parked: self.clone(), token, arrivals }
    }

    /// Gives a resuming connection to the session `token` names, if it is
    /// parked and was imported by `owner`.
    /// Refused, the connection's stream comes back to be answered.
    pub(crate) fn hand_over(
        &self,
        token: &Token,
        owner: &Owner,
        arrival: Handover,
    ) -> Result<(), (Refused, PeerStream)> {
        let slots = lock(&self.slots);
        let Some(slot) = slots.get(&key(token)).filter(|slot| slot.token.matches(token)) else {
            return Err((Refused::Unknown, arrival.stream));
        };
        if let Some(refused) = slot.owner.refuses(owner) {
            return Err((refused, arrival.stream));
        }
        // One handover at a time; the slot stays for the session's life.
        slot.handover.try_send(arrival).map_err(|error| (Refused::Unknown, error.into_inner().stream))
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.slots).len()
    }
}

impl Owner {
    /// Why `other` may not take over this owner's session, if it may not.
    fn refuses(&self, other: &Self) -> Option<Refused> {
        if self.client != other.client {
            Some(Refused::OtherClient)
        } else if self.address != other.address {
            Some(Refused::OtherAddress)
        } else {
            None
        }
    }
}

/// A parked session's side: waits for a resuming connection; unparks on drop.
pub(crate) struct Parking {
    parked: Parked,
    token: Token,
    arrivals: mpsc::Receiver<Handover>,
}

impl Parking {
    pub(crate) async fn arrival(&mut self) -> Option<Handover> {
        self.arrivals.recv().await
    }
}

impl Drop for Parking {
    fn drop(&mut self) {
        let mut slots = lock(&self.parked.slots);
        if slots.get(&key(&self.token)).is_some_and(|slot| slot.token.matches(&self.token)) {
            slots.remove(&key(&self.token));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_differing_in_one_bit_does_not_match_and_dropping_the_parking_unparks() {
        let parked = Parked::default();
        let token = Token([7; 32]);
        let parking = parked.park(token, Owner::new(ClientId::Plain, [127, 0, 0, 1].into()));
        let mut near = token;
        near.0[31] ^= 1;
        // The refusals are decided before a Handover would be needed; check them through the map.
        assert!(lock(&parked.slots).get(&key(&near)).is_some_and(|slot| !slot.token.matches(&near)));
        assert_eq!(parked.len(), 1);
        drop(parking);
        assert_eq!(parked.len(), 0, "dropping the parking unparks");
    }

    #[test]
    fn a_plain_session_belongs_to_its_address_a_tls_one_to_its_identity() {
        let plain = Owner::new(ClientId::Plain, [127, 0, 0, 1].into());
        assert_eq!(plain.refuses(&Owner::new(ClientId::Plain, [127, 0, 0, 1].into())), None);
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        assert_eq!(plain.refuses(&Owner::new(ClientId::Plain, mapped)), None, "the same address over IPv6");
        assert_eq!(plain.refuses(&Owner::new(ClientId::Plain, [127, 0, 0, 2].into())), Some(Refused::OtherAddress));
        let fingerprint = usbwire_transport::identity::Fingerprint([1; 32]);
        let tls = Owner::new(ClientId::Certificate(fingerprint), [10, 0, 0, 1].into());
        assert_eq!(
            tls.refuses(&Owner::new(ClientId::Certificate(fingerprint), [10, 0, 0, 2].into())),
            None,
            "a TLS client may come back from a new address (a roaming laptop)"
        );
        assert_eq!(tls.refuses(&plain), Some(Refused::OtherClient));
    }
}
