//! How fast one core seals TLS records: the record layer's own send side
//! (`usbwire_transport::Writer`, AES-256-GCM on aws-lc-rs, the suite our TLS
//! negotiates) sealing 16 KiB records with no socket behind it, to put a TLS
//! throughput in proportion (the `cipher` column of `usbwire bench --tls`).
//!
//! Not `openssl speed`'s figure ([`openssl_speed`](crate::openssl_speed), the
//! TLS target's reference), nor the TLS path as a whole (the matrix's points).

use std::io::IoSlice;
use std::time::{Duration, Instant};

use rustls::crypto::cipher::{AeadKey, Iv};
use rustls::ConnectionTrafficSecrets;
use serde::Serialize;
use usbwire_transport::{PeerSession, RecordError, Writer, MAX_PLAINTEXT};

/// How fast one core runs the record layer's cipher.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct CipherSpeed {
    /// The AEAD and its library, as TLS negotiates it here by default.
    pub cipher: &'static str,
    pub mib_per_s: f64,
}

/// Seals 16 KiB records with AES-256-GCM, four to a write, on the calling thread for
/// about `duration`, dropping each write's records as if a socket took them at once.
pub fn measure(duration: Duration) -> Result<CipherSpeed, RecordError> {
    let secrets = ConnectionTrafficSecrets::Aes256Gcm { key: AeadKey::from([0x5a; 32]), iv: Iv::new([0xa5; 12]) };
    // No record limit is reached in a benchmark's time: the key never changes.
    let mut writer = Writer::new((0, secrets), u64::MAX)?;
    let data = vec![0x17u8; 4 * MAX_PLAINTEXT];
    let start = Instant::now();
    let mut sealed = 0u64;
    while start.elapsed() < duration {
        for _ in 0..4 {
            sealed += writer.seal(&mut OneKey, &[IoSlice::new(&data)])? as u64;
            writer.sent(writer.pending().len());
        }
    }
    let mib = sealed as f64 / f64::from(1 << 20);
    Ok(CipherSpeed { cipher: "AES-256-GCM (aws-lc-rs)", mib_per_s: mib / start.elapsed().as_secs_f64() })
}

/// A session whose keys never change (and that receives nothing).
struct OneKey;

impl PeerSession for OneKey {
    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        Err(RecordError::Unexpected("a key update in the cipher benchmark"))
    }

    fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), RecordError> {
        Err(RecordError::Unexpected("a key update in the cipher benchmark"))
    }

    fn new_session_ticket(&mut self, _: &[u8]) -> Result<(), RecordError> {
        Err(RecordError::Unexpected("a session ticket in the cipher benchmark"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_writer_seals_records_for_about_the_time_asked() {
        let start = Instant::now();
        let speed = measure(Duration::from_millis(20)).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(20));
        assert!(speed.mib_per_s > 0.0 && speed.mib_per_s.is_finite(), "{speed:?}");
        assert_eq!(speed.cipher, "AES-256-GCM (aws-lc-rs)");
    }
}
