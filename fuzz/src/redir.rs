//! The `redir_packets` harness: what a hostile QEMU (usbredir guest) sends to
//! our host side, through [`usbwire_redir::Codec`].
//!
//! Input: `[chunking, caps] ++ stream`. The host has received a guest hello
//! announcing `caps` (so every combination of header and type-header sizes
//! is reached); `stream` follows, in pieces (`chunking`, as in the decoder
//! harnesses).
//!
//! Invariants: no panic; `Ok(None)` and errors consume nothing; one-shot and
//! chunked decoding give the same packets and the same error; every decoded
//! packet, encoded again by a guest with the same caps, decodes to itself;
//! nothing larger than the codec's limit is ever buffered for a packet.

use bytes::BytesMut;
use usbwire_redir::{Caps, Codec, Packet, Side, MAX_PACKET_LEN};

/// The limit the harness's host runs with: small, so the check is reachable.
const MAX_DATA: u32 = 64 * 1024;

/// A host and a guest that have exchanged hellos, the guest announcing `caps`.
fn after_hello(caps: Caps) -> (Codec, Codec) {
    let mut host = Codec::new(Side::Host, Caps(0xff), MAX_DATA);
    let mut guest = Codec::new(Side::Guest, caps, MAX_PACKET_LEN);
    let (mut to_host, mut to_guest) = (BytesMut::new(), BytesMut::new());
    guest.encode(0, &guest.hello("fuzz"), &mut to_host).expect("a hello always encodes");
    host.encode(0, &host.hello("usbwire"), &mut to_guest).expect("a hello always encodes");
    host.decode(&mut to_host).expect("a guest hello").expect("whole");
    guest.decode(&mut to_guest).expect("a host hello").expect("whole");
    (host, guest)
}

pub fn redir_packets(data: &[u8]) {
    let Some((&[chunking, caps], stream)) = crate::split_control::<2>(data) else { return };
    let caps = Caps(u32::from(caps));
    let decode_all = |pieces: Vec<&[u8]>| {
        let (mut host, _) = after_hello(caps);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for piece in pieces {
            buf.extend_from_slice(piece);
            loop {
                let before = buf.len();
                match host.decode(&mut buf) {
                    Ok(Some(packet)) => {
                        assert!(buf.len() < before, "a packet from no bytes");
                        out.push(Ok(packet));
                    }
                    Ok(None) => {
                        assert_eq!(buf.len(), before, "Ok(None) consumed input");
                        break;
                    }
                    Err(error) => {
                        assert_eq!(buf.len(), before, "an error consumed input");
                        out.push(Err(error));
                        return out;
                    }
                }
            }
        }
        out
    };
    let whole = decode_all(vec![stream]);
    assert_eq!(whole, decode_all(crate::chunks(stream, chunking)), "one-shot and chunked decoding differ");
    let (mut host, guest) = after_hello(caps);
    // A (second, ignored) hello's version is decoded lossily and cut to 63 bytes
    // when sent: it does not round-trip, by design.
    let sent_again = whole.into_iter().flatten().filter(|(_, packet)| !matches!(packet, Packet::Hello { .. }));
    for (id, packet) in sent_again {
        let mut wire = BytesMut::new();
        guest.encode(id, &packet, &mut wire).expect("what a guest sent, a guest can send");
        let (again_id, again) = host.decode(&mut wire).expect("re-decodes").expect("whole");
        assert_eq!((again_id, &again), (id, &packet), "round trip");
        assert!(wire.is_empty());
    }
}
