//! Property tests for the device protocol's codec: every message round-trips,
//! any split of a stream of frames decodes the same, and no byte string panics
//! or consumes anything on `Ok(None)`.

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use usbwire_device::Speed;
use usbwire_external::codec::{decode, Message, MAX_REASON_LEN};

fn data() -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..300).prop_map(Bytes::from)
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (any::<u16>(), 0u32..=255, any::<u8>()).prop_map(|(version, speed, ep0_max_packet)| Message::Hello {
            version,
            speed: Speed(speed),
            ep0_max_packet
        }),
        (any::<u32>(), data()).prop_map(|(id, data)| Message::Data { id, data }),
        any::<u32>().prop_map(|id| Message::Ack { id }),
        any::<u32>().prop_map(|id| Message::Nak { id }),
        any::<u32>().prop_map(|id| Message::Stall { id }),
        (any::<u16>(), any::<u32>()).prop_map(|(version, max_frame_len)| Message::Welcome { version, max_frame_len }),
        "\\PC{0,80}".prop_filter("fits", |r| r.len() <= MAX_REASON_LEN).prop_map(|reason| Message::Refuse { reason }),
        (any::<u32>(), any::<[u8; 8]>(), data()).prop_map(|(id, setup, data)| Message::Setup { id, setup, data }),
        (any::<u32>(), any::<u8>(), data()).prop_map(|(id, endpoint, data)| Message::Out { id, endpoint, data }),
        (any::<u32>(), any::<u8>(), any::<u32>()).prop_map(|(id, endpoint, length)| Message::In {
            id,
            endpoint,
            length
        }),
        any::<u32>().prop_map(|id| Message::Cancel { id }),
        Just(Message::Reset),
    ]
}

proptest! {
    #[test]
    fn messages_round_trip(message in message()) {
        let mut wire = BytesMut::new();
        message.encode(&mut wire);
        prop_assert_eq!(decode(&mut wire), Ok(Some(message)));
        prop_assert!(wire.is_empty());
    }

    #[test]
    fn every_split_decodes_the_same(messages in prop::collection::vec(message(), 1..8), cuts in prop::collection::vec(1usize..64, 1..64)) {
        let mut wire = BytesMut::new();
        for message in &messages {
            message.encode(&mut wire);
        }
        let mut fed = BytesMut::new();
        let mut decoded = Vec::new();
        let mut rest = wire.freeze();
        let mut cuts = cuts.into_iter().cycle();
        while !rest.is_empty() {
            let take = cuts.next().unwrap_or(1).min(rest.len());
            fed.extend_from_slice(&rest.split_to(take));
            loop {
                let before = fed.len();
                match decode(&mut fed) {
                    Ok(Some(message)) => decoded.push(message),
                    Ok(None) => { prop_assert_eq!(fed.len(), before, "Ok(None) consumes nothing"); break }
                    Err(error) => return Err(TestCaseError::fail(format!("{error}"))),
                }
            }
        }
        prop_assert_eq!(decoded, messages);
    }

    #[test]
    fn no_byte_string_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let mut input = BytesMut::from(&bytes[..]);
        loop {
            let before = input.len();
            match decode(&mut input) {
                Ok(Some(_)) => prop_assert!(input.len() < before),
                Ok(None) => { prop_assert_eq!(input.len(), before); break }
                Err(_) => break,
            }
        }
    }
}
