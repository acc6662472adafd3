//! Sessions waiting for their client to come back ([`usbwire_proto::resume`]).
//!
//! A resumable import registers here under its token for as long as it lives.
//! When it loses its connection, its task keeps the device and the session
//! for the grace period. A new connection that sends `OP_REQ_RESUME` with
//! that token, from the same client identity, is handed over to the task
//! (which drops the old connection if it had not noticed the loss yet),
//! answers it and carries on; anything else gets `ST_NODEV`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use tokio::sync::mpsc;
use usbwire_proto::resume::Token;
use usbwire_proto::sync::lock;
use usbwire_transport::access::ClientId;
use usbwire_transport::PeerStream;

use crate::connection::Peer;

/// A new connection for a parked session: the stream just past its resume
/// request, and what the client has received.
pub(crate) struct Handover {
    pub(crate) stream: PeerStream,
    pub(crate) leftover: BytesMut,
    pub(crate) replies_received: u64,
    /// Keeps the new connection's place in the admission budgets.
    pub(crate) peer: Peer,
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
}

struct Slot {
    token: Token,
    client: ClientId,
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
    pub(crate) fn park(&self, token: Token, client: ClientId) -> Parking {
        let (handover, arrivals) = mpsc::channel(1);
        lock(&self.slots).insert(key(&token), Slot { token, client, handover });
        Parking { parked: self.clone(), token, arrivals }
    }

    /// Gives a resuming connection to the session `token` names, if it is
    /// parked and was imported by `client`.
    /// Refused, the connection's stream comes back to be answered.
    pub(crate) fn hand_over(
        &self,
        token: &Token,
        client: &ClientId,
        arrival: Handover,
    ) -> Result<(), (Refused, PeerStream)> {
        let slots = lock(&self.slots);
        let Some(slot) = slots.get(&key(token)).filter(|slot| slot.token.matches(token)) else {
            return Err((Refused::Unknown, arrival.stream));
        };
        if &slot.client != client {
            return Err((Refused::OtherClient, arrival.stream));
        }
        // One handover at a time; the slot stays for the session's life.
        slot.handover.try_send(arrival).map_err(|error| (Refused::Unknown, error.into_inner().stream))
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.slots).len()
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
        let parking = parked.park(token, ClientId::Plain);
        let mut near = token;
        near.0[31] ^= 1;
        // The refusals are decided before a Handover would be needed; check them through the map.
        assert!(lock(&parked.slots).get(&key(&near)).is_some_and(|slot| !slot.token.matches(&near)));
        assert_eq!(parked.len(), 1);
        drop(parking);
        assert_eq!(parked.len(), 0, "dropping the parking unparks");
    }
}
