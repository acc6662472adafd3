//! rustls configurations for both ends.
//!
//! TLS 1.3 only. Servers demand a client certificate and admit it during the
//! handshake when the access rules name it (by fingerprint, or as issued by the
//! server's CA for a name): a refused client is logged with its fingerprint
//! and told why by a TLS alert (access denied, certificate expired) before a
//! single USB/IP byte is exchanged. Clients accept only
//! the server fingerprint they pinned; an unknown server is refused before
//! a single USB/IP byte is sent, with its fingerprint in the error so the user
//! can check it and trust it.

use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls13_signature, CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, Error, SignatureScheme};

use crate::access::Admission;
use crate::{Fingerprint, Identity};

/// aws-lc-rs: its AES-GCM seals 16 KiB records about 1.5 times as fast as ring's on
/// this project's benchmark machine (see BENCHMARKS.md); the record layer uses the same
/// library's AEAD (`record`).
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn algorithms() -> WebPkiSupportedAlgorithms {
    rustls::crypto::aws_lc_rs::default_provider().signature_verification_algorithms
}

/// The server side: TLS 1.3, a client certificate `admission` admits required.
/// Its traffic keys go to our record layer after the handshake (`handshake::accept`).
pub fn server_config(identity: &Identity, admission: Admission) -> Result<Arc<rustls::ServerConfig>, Error> {
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(Arc::new(AdmittedClients { admission, algorithms: algorithms() }))
        .with_single_cert(vec![identity.certificate.clone()], identity.key.clone_key())?;
    config.enable_secret_extraction = true;
    // No session tickets: our clients never resume a TLS session (a usbwire session
    // resumes over a fresh handshake), and our record layer takes an AES-GCM key
    // before any record went under it (`record::Sealer`).
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

/// What the client expects of the server's certificate.
#[derive(Clone, Debug)]
pub enum ServerTrust {
    /// Only this fingerprint.
    Pinned(Fingerprint),
    /// Any certificate (trust on first use: the caller records what was seen).
    FirstUse,
    /// None yet, and the user did not allow trusting a new one: refuse.
    Unknown,
}

/// The fingerprint the server presented, as seen by the client's verifier.
#[derive(Clone, Debug, Default)]
pub struct SeenServer(Arc<Mutex<Option<Fingerprint>>>);

impl SeenServer {
    pub fn fingerprint(&self) -> Option<Fingerprint> {
        *usbwire_device::sync::lock(&self.0)
    }
}

/// The client side: TLS 1.3 with our identity, the server pinned per `trust`.
pub fn client_config(
    identity: &Identity,
    trust: ServerTrust,
) -> Result<(Arc<rustls::ClientConfig>, SeenServer), Error> {
    let seen = SeenServer::default();
    let verifier = PinnedServer { trust, seen: seen.clone(), algorithms: algorithms() };
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_auth_cert(vec![identity.certificate.clone()], identity.key.clone_key())?;
    // Its traffic keys go to our record layer after the handshake (`handshake::connect`).
    config.enable_secret_extraction = true;
    Ok((Arc::new(config), seen))
}

/// The name put in the ClientHello. Servers are identified by fingerprint,
/// not by name, so this is constant.
pub fn server_name() -> ServerName<'static> {
    ServerName::try_from("usbwire").expect("a valid DNS name").to_owned()
}

#[derive(Debug)]
struct AdmittedClients {
    admission: Admission,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ClientCertVerifier for AdmittedClients {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        // That the client holds the certificate's key is checked next, by its
        // handshake signature (verify_tls13_signature).
        match self.admission.identify(end_entity) {
            Ok(_) => Ok(ClientCertVerified::assertion()),
            Err(reason) => {
                let client = Fingerprint::of(end_entity);
                tracing::warn!(%client, ?reason, "client identity refused (add it to an [[allow]] rule or --allow to admit it)");
                Err(Error::InvalidCertificate(reason))
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        Err(Error::PeerIncompatible(rustls::PeerIncompatible::Tls12NotOffered))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        // Proof that the client holds the key of the certificate it presented.
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[derive(Debug)]
struct PinnedServer {
    trust: ServerTrust,
    seen: SeenServer,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let fingerprint = Fingerprint::of(end_entity);
        *usbwire_device::sync::lock(&self.seen.0) = Some(fingerprint);
        match self.trust {
            ServerTrust::Pinned(expected) if expected == fingerprint => Ok(ServerCertVerified::assertion()),
            ServerTrust::FirstUse => Ok(ServerCertVerified::assertion()),
            ServerTrust::Pinned(_) | ServerTrust::Unknown => {
                Err(Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure))
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        Err(Error::PeerIncompatible(rustls::PeerIncompatible::Tls12NotOffered))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
