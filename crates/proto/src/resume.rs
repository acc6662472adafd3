//! Resume (usbwire extension): the wire pieces that let a URB channel
//! survive a dropped connection between two usbwire ends. Stock peers never
//! see any of it.
//!
//! * **Negotiation** rides on the transform offer (`OP_REQ_TRANSFORMS`): the
//!   client adds [`OFFER`]; a server that can resume answers `resume=TOKEN`
//!   ([`Token`], 32 random bytes in hex) next to the transforms it applies.
//!   The token names the session the import on this connection starts.
//! * **Acknowledgement**: while resumable, the client tells the server how
//!   many replies it has received with a header-only message of its own
//!   command code ([`ack_header`]), so the server can drop what it holds for
//!   replay.
//! * **End**: a client that is done says so ([`end_header`]) before it closes,
//!   so the server releases the device at once rather than waiting for it.
//! * **Keep-alive** ([`crate::liveness`]): a client that offers `keepalive`
//!   beside `resume` to a server that answers it back gets pings from the
//!   server and sends its own, so a link gone silent is noticed in seconds.
//! * **In flight**: a server that grants resume also says what its in-flight
//!   table takes (`in_flight=URBS/BYTES`); the client sends no command it
//!   would not take at once, so the server never stops reading — and so
//!   always reads the acknowledgements that free its held replies.
//! * **Resume**: a new connection (transforms negotiated afresh) sends
//!   `OP_REQ_RESUME` with the token and the number of replies received
//!   instead of `OP_REQ_IMPORT`; the server answers `OP_REP_RESUME` with the
//!   number of commands it had received (see [`crate::op`]). Each side then
//!   sends again exactly what the other is missing: messages are counted
//!   whole, so a message cut anywhere is dropped by its receiver and sent
//!   again in full.

use std::fmt;

use crate::urb::{Command, HEADER_LEN};
use crate::wire::{be_u32, put_u32};

/// What a client adds to its transform offer to ask for resumable sessions.
pub const OFFER: &str = "resume";

/// The command word of a resume acknowledgement (client to server).
pub const ACK: Command = Command(0x8000_0001);

/// The command word of a resumable session's last message, either way. From
/// the client: it is done (detached), so the server releases the device at
/// once instead of holding the session for a resume that will not come. From
/// the server: it is shutting down, so the client gives the session up at
/// once instead of trying to resume it.
pub const END: Command = Command(0x8000_0002);

/// The secret that names a resumable session. Whoever holds it (with the same
/// client identity) may take the session over, so it is only ever sent inside
/// the connection that imported, and compared in constant time.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Token(pub [u8; 32]);

impl Token {
    /// As it appears in the transform answer: `resume=` and 64 hex digits.
    pub fn answer_entry(&self) -> String {
        let mut text = String::with_capacity(OFFER.len() + 1 + 64);
        text.push_str(OFFER);
        text.push('=');
        for byte in self.0 {
            text.push_str(&format!("{byte:02x}"));
        }
        text
    }

    /// The token in a server's transform answer, if it granted resume.
    pub fn from_answer(answer: &str) -> Option<Self> {
        let hex = answer.split(',').find_map(|entry| entry.trim().strip_prefix("resume="))?;
        if hex.len() != 64 || !hex.is_ascii() {
            return None;
        }
        let mut token = [0u8; 32];
        for (i, byte) in token.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Self(token))
    }

    /// Compares without an early exit, so timing says nothing about how much matched.
    pub fn matches(&self, other: &Self) -> bool {
        self.0.iter().zip(other.0.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl fmt::Debug for Token {
    /// Only a prefix: enough to tell sessions apart in logs, not to take one over.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({:02x}{:02x}{:02x}{:02x}…)", self.0[0], self.0[1], self.0[2], self.0[3])
    }
}

/// What a server's transform answer granted a client that offered resume:
/// the session's token, and whether the server pings ([`crate::liveness`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub token: Token,
    pub keepalive: bool,
    /// What the server's in-flight table takes, `(URBs, bytes)`, when it said
    /// ([`in_flight_entry`]): a client sends no more, so the server always
    /// reads on, acknowledgements included.
    pub in_flight: Option<(usize, usize)>,
}

impl Grant {
    /// The grant in a server's transform answer, if it granted resume.
    pub fn from_answer(answer: &str) -> Option<Self> {
        let token = Token::from_answer(answer)?;
        let in_flight = answer.split(',').find_map(|entry| {
            let (urbs, bytes) = entry.trim().strip_prefix(IN_FLIGHT_KEY)?.strip_prefix('=')?.split_once('/')?;
            Some((urbs.parse().ok()?, bytes.parse().ok()?))
        });
        Some(Self { token, keepalive: crate::liveness::offered(answer), in_flight })
    }
}

/// The answer entry naming what a resumable server's in-flight table takes.
pub const IN_FLIGHT_KEY: &str = "in_flight";

/// `in_flight=URBS/BYTES`, beside `resume=TOKEN` in a server's answer.
pub fn in_flight_entry(urbs: usize, bytes: usize) -> String {
    format!("{IN_FLIGHT_KEY}={urbs}/{bytes}")
}

/// Whether a client's transform offer asks for resume.
pub fn offered(offer: &str) -> bool {
    offer.split(',').any(|entry| entry.trim() == OFFER)
}

/// A resume acknowledgement: `replies_received` server messages have arrived whole.
pub fn ack_header(devid: u32, replies_received: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    put_u32(&mut h, 0x00, ACK.0);
    put_u32(&mut h, 0x08, devid);
    put_u32(&mut h, 0x14, (replies_received >> 32) as u32);
    put_u32(&mut h, 0x18, replies_received as u32);
    h
}

/// The end of a resumable session ([`END`]), for no particular reason
/// ([`EndReason::DONE`]: the client detached, the server shuts down).
pub fn end_header(devid: u32) -> [u8; HEADER_LEN] {
    end_header_for(devid, EndReason::DONE)
}

/// Why a session ended: the word at 0x14 of an [`END`] header. A peer that
/// does not know a reason takes it as [`EndReason::DONE`] (older usbwire
/// clients look at the command word alone), so a new reason never makes an
/// older peer do worse than give the session up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndReason(pub u32);

impl EndReason {
    /// The session is over: the client detached, or the server shuts down.
    pub const DONE: Self = Self(0);
    /// From the server: the device re-enumerated at the imported bus id (a
    /// DFU device entering its bootloader or leaving it, a device replaced at
    /// a bound port). The port stays exported: import the same bus id again.
    pub const REENUMERATED: Self = Self(1);
}

/// The end of a resumable session, saying why.
pub fn end_header_for(devid: u32, reason: EndReason) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    put_u32(&mut h, 0x00, END.0);
    put_u32(&mut h, 0x08, devid);
    put_u32(&mut h, 0x14, reason.0);
    h
}

/// The reason an [`END`] header carries, if `header` is one.
pub fn parse_end(header: &[u8]) -> Option<EndReason> {
    if header.len() < HEADER_LEN || be_u32(header, 0) != END.0 {
        return None;
    }
    Some(EndReason(be_u32(header, 0x14)))
}

/// The count an acknowledgement carries, if `header` is one.
pub fn parse_ack(header: &[u8]) -> Option<u64> {
    if header.len() < HEADER_LEN || be_u32(header, 0) != ACK.0 {
        return None;
    }
    Some((u64::from(be_u32(header, 0x14)) << 32) | u64::from(be_u32(header, 0x18)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_round_trips_through_the_answer() {
        let token = Token(std::array::from_fn(|i| (i * 7) as u8));
        let answer = format!("zstd,{},jitter=40", token.answer_entry());
        assert_eq!(Token::from_answer(&answer), Some(token));
        assert_eq!(Token::from_answer("zstd"), None);
        assert_eq!(Token::from_answer("resume=zz"), None);
        assert_eq!(Token::from_answer(&format!("resume={}", "é".repeat(32))), None);
        assert!(token.matches(&token) && !token.matches(&Token([0; 32])));
        assert_eq!(Grant::from_answer(&answer), Some(Grant { token, keepalive: false, in_flight: None }));
        let pinging = format!("{},keepalive,{}", token.answer_entry(), in_flight_entry(4, 6000));
        assert_eq!(Grant::from_answer(&pinging), Some(Grant { token, keepalive: true, in_flight: Some((4, 6000)) }));
        let garbled = format!("{},in_flight=4/x,in_flight=/", token.answer_entry());
        assert_eq!(Grant::from_answer(&garbled).and_then(|grant| grant.in_flight), None);
        assert_eq!(Grant::from_answer("keepalive"), None);
    }

    #[test]
    fn offer_is_found_among_transforms() {
        assert!(offered("zstd, resume"));
        assert!(!offered("zstd,resumex"));
    }

    #[test]
    fn ack_golden_bytes() {
        let h = ack_header(0x0001_0002, 0x1_0000_0005);
        let mut expected = [0u8; HEADER_LEN];
        expected[..12].copy_from_slice(&[0x80, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 2]);
        expected[0x14..0x1c].copy_from_slice(&[0, 0, 0, 1, 0, 0, 0, 5]);
        assert_eq!(h, expected);
        assert_eq!(parse_ack(&h), Some(0x1_0000_0005));
        assert_eq!(parse_ack(&[0u8; HEADER_LEN]), None);
    }

    #[test]
    fn end_golden_bytes_with_and_without_a_reason() {
        let done = end_header(0x0001_0002);
        let mut expected = [0u8; HEADER_LEN];
        expected[..12].copy_from_slice(&[0x80, 0, 0, 2, 0, 0, 0, 0, 0, 1, 0, 2]);
        assert_eq!(done, expected);
        assert_eq!(parse_end(&done), Some(EndReason::DONE));
        let reenumerated = end_header_for(0x0001_0002, EndReason::REENUMERATED);
        expected[0x14..0x18].copy_from_slice(&[0, 0, 0, 1]);
        assert_eq!(reenumerated, expected);
        assert_eq!(parse_end(&reenumerated), Some(EndReason::REENUMERATED));
        assert_eq!(parse_end(&ack_header(1, 1)), None);
    }
}
