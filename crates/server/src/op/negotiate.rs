//! What the server agrees to when a client offers transforms
//! (`OP_REQ_TRANSFORMS`): the stream transforms it can run, resume (when the
//! server keeps sessions: a grace period above zero), keep-alive (with resume
//! only), the storage extension and descriptor snapshots (whenever asked),
//! and the lab reservation the offer carries. Pure: the offer and the
//! configuration in, the answer out; the token a granted resume gets is
//! handed in, so the same inputs always give the same answer.

use usbwire_proto::reservation::ReservationToken;
use usbwire_proto::resume::{self, Grant, Token};
use usbwire_proto::storage;
use usbwire_proto::{descriptors, liveness};
use usbwire_transport::transform::TransformSpec;

use crate::config::ServerConfig;

/// The outcome of a transform offer.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Negotiated {
    /// The stream transforms both sides run from the next request on.
    pub(crate) transforms: Vec<TransformSpec>,
    /// `transforms` as text (what the log shows as accepted).
    pub(crate) accepted: String,
    /// The `OP_REP_TRANSFORMS` text: the transforms, then the resume grant's entries.
    pub(crate) answer: String,
    /// Resume, if the client asked and the server keeps sessions.
    pub(crate) resume: Option<Grant>,
    /// The lab registry reservation the client says it holds.
    pub(crate) reservation: Option<ReservationToken>,
    /// The storage extension: the client sends mass-storage stages without
    /// waiting and the server's stage gate runs them one at a time (§5.7).
    pub(crate) storage: bool,
    /// Descriptor snapshots: the import reply is followed by every
    /// descriptor the device gave (§5.8).
    pub(crate) descriptors: bool,
}

/// Answers `offer` under `config`; a granted resume gets `token`.
pub(crate) fn negotiate(offer: &str, config: &ServerConfig, token: Token) -> Negotiated {
    let transforms = TransformSpec::parse_list(offer);
    let accepted = TransformSpec::list_text(&transforms);
    let mut answer = accepted.clone();
    let mut resume = None;
    if resume::offered(offer) && !config.resume_grace.is_zero() {
        if !answer.is_empty() {
            answer.push(',');
        }
        answer.push_str(&token.answer_entry());
        // Keep-alive goes with resume: a link gone silent is noticed in seconds and resumed.
        let keepalive = liveness::offered(offer);
        if keepalive {
            answer.push(',');
            answer.push_str(liveness::OFFER);
        }
        // What our table takes: the client sends no more, so we always read its acknowledgements.
        let in_flight = (config.budget.in_flight_urbs, config.budget.in_flight_bytes);
        answer.push(',');
        answer.push_str(&resume::in_flight_entry(in_flight.0, in_flight.1));
        resume = Some(Grant { token, keepalive, in_flight: Some(in_flight) });
    }
    // Stages cost the server nothing until a client flags one: granted whenever asked.
    let storage = storage::offered(offer);
    if storage {
        if !answer.is_empty() {
            answer.push(',');
        }
        answer.push_str(storage::OFFER);
    }
    // A snapshot is a few local requests to the device at import: granted whenever asked.
    let descriptors = descriptors::offered(offer);
    if descriptors {
        if !answer.is_empty() {
            answer.push(',');
        }
        answer.push_str(descriptors::OFFER);
    }
    let reservation = ReservationToken::from_offer(offer);
    Negotiated { transforms, accepted, answer, resume, reservation, storage, descriptors }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const TOKEN: Token = Token([0x5a; 32]);

    fn config(resume_grace: Duration) -> ServerConfig {
        let mut config = ServerConfig { resume_grace, ..ServerConfig::default() };
        config.budget.in_flight_urbs = 64;
        config.budget.in_flight_bytes = 1 << 20;
        config
    }

    /// The resume entries of an answer: the token, keep-alive if granted, the in-flight bounds.
    fn resume_entries(keepalive: bool) -> String {
        let keepalive = if keepalive { format!(",{}", liveness::OFFER) } else { String::new() };
        format!("{}{keepalive},{}", TOKEN.answer_entry(), resume::in_flight_entry(64, 1 << 20))
    }

    #[test]
    fn every_offer_against_a_server_with_and_without_sessions() {
        let reservation = ReservationToken([0xab; 32]);
        let keeps = config(Duration::from_secs(30));
        let keeps_none = config(Duration::ZERO);
        // (offer, server keeps sessions, expected answer, resume granted, keep-alive granted)
        let cases = [
            (String::new(), true, String::new(), false, false),
            ("zstd".to_owned(), true, "zstd".to_owned(), false, false),
            ("zstd,lz4,bogus".to_owned(), false, "zstd".to_owned(), false, false),
            ("resume".to_owned(), true, resume_entries(false), true, false),
            ("resume".to_owned(), false, String::new(), false, false),
            ("resume,keepalive".to_owned(), true, resume_entries(true), true, true),
            ("resume,keepalive".to_owned(), false, String::new(), false, false),
            ("keepalive".to_owned(), true, String::new(), false, false),
            ("lz4,resume,keepalive".to_owned(), true, format!("lz4,{}", resume_entries(true)), true, true),
            ("lz4,resume".to_owned(), false, "lz4".to_owned(), false, false),
            (format!("zstd,{}", reservation.offer_entry()), true, "zstd".to_owned(), false, false),
            (format!("resume,{}", reservation.offer_entry()), true, resume_entries(false), true, false),
        ];
        for (offer, sessions, answer, resumed, keepalive) in cases {
            let config = if sessions { &keeps } else { &keeps_none };
            let negotiated = negotiate(&offer, config, TOKEN);
            assert_eq!(negotiated.answer, answer, "offer {offer:?}, sessions kept: {sessions}");
            assert_eq!(negotiated.resume.is_some(), resumed, "offer {offer:?}, sessions kept: {sessions}");
            assert_eq!(negotiated.resume.as_ref().is_some_and(|grant| grant.keepalive), keepalive, "offer {offer:?}");
            if let Some(grant) = &negotiated.resume {
                assert_eq!(grant.token, TOKEN);
                assert_eq!(grant.in_flight, Some((64, 1 << 20)), "what the server's table takes");
            }
            assert_eq!(negotiated.accepted, TransformSpec::list_text(&negotiated.transforms));
            let reserved = offer.contains("reservation=");
            assert_eq!(negotiated.reservation, reserved.then_some(reservation), "offer {offer:?}");
        }
    }

    #[test]
    fn storage_is_granted_whenever_offered_with_or_without_sessions() {
        for grace in [Duration::ZERO, Duration::from_secs(30)] {
            let negotiated = negotiate("lz4,resume,keepalive,storage", &config(grace), TOKEN);
            assert!(negotiated.storage);
            assert!(negotiated.answer.starts_with("lz4,"), "{}", negotiated.answer);
            assert!(negotiated.answer.ends_with(",storage"), "{}", negotiated.answer);
            assert_eq!(negotiated.resume.is_some(), !grace.is_zero());
            assert_eq!(TransformSpec::parse_list(&negotiated.answer), negotiated.transforms);
        }
        assert_eq!(negotiate("storage", &config(Duration::ZERO), TOKEN).answer, "storage");
        assert!(!negotiate("zstd,resume", &config(Duration::from_secs(5)), TOKEN).storage);
    }

    #[test]
    fn descriptor_snapshots_are_granted_whenever_offered_and_answered_last() {
        let negotiated = negotiate("lz4,resume,storage,descriptors", &config(Duration::from_secs(5)), TOKEN);
        assert!(negotiated.descriptors && negotiated.storage);
        assert!(negotiated.answer.ends_with(",storage,descriptors"), "{}", negotiated.answer);
        assert_eq!(negotiate("descriptors", &config(Duration::ZERO), TOKEN).answer, "descriptors");
        assert!(!negotiate("zstd,resume,storage", &config(Duration::from_secs(5)), TOKEN).descriptors);
    }

    #[test]
    fn the_answer_is_what_a_client_reads_back() {
        let negotiated = negotiate("zstd,resume,keepalive", &config(Duration::from_secs(5)), TOKEN);
        let grant = Grant::from_answer(&negotiated.answer).expect("the client finds the grant");
        assert_eq!((grant.token, grant.keepalive, grant.in_flight), (TOKEN, true, Some((64, 1 << 20))));
        assert_eq!(TransformSpec::parse_list(&negotiated.answer), negotiated.transforms);
    }

    #[test]
    fn without_an_offer_nothing_is_agreed() {
        let nothing = Negotiated::default();
        assert!(nothing.transforms.is_empty() && nothing.resume.is_none() && nothing.reservation.is_none());
    }
}
