//! TLS 1.3 with mutual authentication, the plain-connection policy, per-device
//! access rules and tamper detection, over real loopback TCP.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use usbwire_testing::process::Scratch;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use usbwire_client::{ClientError, Connection, Security, TlsClient, Transfer, TransferError, TransformSpec};
use usbwire_proto::op::{BusId, OpStatus};
use usbwire_proto::Status;
use usbwire_server::{PlainPolicy, Security as ServerSecurity};
use usbwire_testing::TestServer;
use usbwire_transport::access::{AccessRules, Admission, Rule};
use usbwire_transport::known_servers::KnownServers;
use usbwire_transport::Identity;

struct Setup {
    addr: SocketAddr,
    server: Identity,
    alice: Identity,
    /// Where this test's known_servers files go; removed with the setup.
    dir: Scratch,
}

impl Setup {
    /// An empty known_servers file of its own under the setup's directory.
    fn known(&self, name: &str) -> KnownServers {
        let dir = self.dir.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        KnownServers::in_dir(&dir)
    }
}

fn scratch(name: &str) -> Scratch {
    usbwire_testing::process::scratch("tls", name)
}

/// A TLS server exporting three devices; Alice may use only 0-1.
async fn start(plain: PlainPolicy) -> Setup {
    start_with_ca(plain, None).await
}

/// The same, also trusting `ca` for `ca:bob` on 0-2.
async fn start_with_ca(plain: PlainPolicy, ca: Option<usbwire_transport::ca::TrustedCa>) -> Setup {
    start_with_rules(plain, ca, &[]).await
}

/// The same, with `extra` rules after Alice's and Bob's.
async fn start_with_rules(plain: PlainPolicy, ca: Option<usbwire_transport::ca::TrustedCa>, extra: &[Rule]) -> Setup {
    let server = Identity::generate("server").unwrap();
    let alice = Identity::generate("alice").unwrap();
    let mut rules = AccessRules {
        rules: vec![
            Rule { client: alice.fingerprint().to_string(), devices: vec!["0-1".into()] },
            Rule { client: "ca:bob".into(), devices: vec!["0-2".into()] },
        ],
    };
    rules.rules.extend_from_slice(extra);
    let security = ServerSecurity::tls(&server, plain, Admission { rules, ca }).unwrap();
    let addr = TestServer::builder().security(security).loopback().loopback().loopback().start().await.keep_running();
    static SETUPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = scratch(&format!("setup-{}", SETUPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    Setup { addr, server, alice, dir }
}

fn tls(identity: &Identity, known: KnownServers, trust_new: bool) -> Security {
    // Identities are not Clone (the key stays in one place); re-load a copy from disk.
    let dir = scratch(&format!("copy-{}", identity.fingerprint().to_string()[7..15].to_owned()));
    identity.save(&dir, usbwire_transport::key_files::Existing::Refuse).unwrap();
    let copy = Identity::load(&dir).unwrap();
    Security::Tls(Arc::new(TlsClient { identity: copy, known, trust_new, pinned: None }))
}

/// As the lab registry's entry pins it: only `fingerprint`, whatever `known` says.
fn registry_pinned(identity: &Identity, known: KnownServers, fingerprint: usbwire_transport::Fingerprint) -> Security {
    let dir = scratch(&format!("registry-copy-{}", identity.fingerprint().to_string()[7..15].to_owned()));
    identity.save(&dir, usbwire_transport::key_files::Existing::Refuse).unwrap();
    let copy = Identity::load(&dir).unwrap();
    Security::Tls(Arc::new(TlsClient { identity: copy, known, trust_new: false, pinned: Some(fingerprint) }))
}

fn pinned(setup: &Setup, addr: SocketAddr, name: &str) -> KnownServers {
    let known = setup.known(name);
    known.add(&addr.to_string(), setup.server.fingerprint()).unwrap();
    known
}

#[tokio::test]
async fn allowed_client_sees_and_imports_only_its_device_over_tls() {
    let setup = start(PlainPolicy::Never).await;
    let alice = tls(&setup.alice, pinned(&setup, setup.addr, "alice-known"), false);
    let devices = usbwire_client::list_devices(setup.addr, &alice).await.unwrap();
    assert_eq!(devices.iter().map(|d| d.busid.as_str()).collect::<Vec<_>>(), vec!["0-1"]);
    match usbwire_client::import(setup.addr, &BusId::new("0-2").unwrap(), &alice).await {
        Err(ClientError::Refused { status, .. }) => assert_eq!(status, OpStatus::NODEV),
        other => panic!("expected refusal, got {:?}", other.map(|(_, r)| r)),
    }
    let (stream, record) = usbwire_client::import(setup.addr, &BusId::new("0-1").unwrap(), &alice).await.unwrap();
    assert!(stream.is_tls());
    let conn = Connection::new(stream, &record);
    let ret = conn.transfer(Transfer::control_out([0, 9, 1, 0, 0, 0, 0, 0], Bytes::new())).await.unwrap();
    assert_eq!(ret.status, Status::OK);
    let payload = Bytes::from(vec![0x3cu8; 100_000]);
    conn.transfer(Transfer::bulk_out(0x03, payload.clone())).await.unwrap();
    let back = conn.transfer(Transfer::bulk_in(0x83, 100_000)).await.unwrap();
    assert_eq!(back.data, payload);
    // Device state names the holder by identity, and shows Alice only what she may see.
    let states = usbwire_client::device_states(setup.addr, &alice).await.unwrap().unwrap();
    assert_eq!(states.len(), 1, "{states:?}");
    assert_eq!(states[0].state, "in_use");
    assert_eq!(states[0].identity.as_deref(), Some(setup.alice.fingerprint().to_string().as_str()));
}

#[tokio::test]
async fn refused_before_any_device_is_listed() {
    let setup = start(PlainPolicy::Never).await;
    // No client key at all: plain USB/IP, which this policy forbids (a downgrade).
    let plain = usbwire_client::list_devices(setup.addr, &Security::Plain).await;
    assert!(matches!(plain, Err(ClientError::ClosedWithoutAnswer { .. })), "{plain:?}");
    // A TLS client with no key: the server demands one in the handshake.
    let result = list_without_client_key(setup.addr).await;
    assert!(result.is_err(), "a client without a key got an answer: {result:?}");
    // An unknown key: refused in the handshake, and told so with its fingerprint,
    // whether it lists, imports or asks for device states.
    let mallory = Identity::generate("mallory").unwrap();
    let unknown = tls(&mallory, pinned(&setup, setup.addr, "mallory-known"), false);
    let not_admitted = |result: Result<(), ClientError>| match result {
        Err(ClientError::NotAdmitted { fingerprint, .. }) => assert_eq!(fingerprint, mallory.fingerprint().to_string()),
        other => panic!("expected not-admitted, got {other:?}"),
    };
    not_admitted(usbwire_client::list_devices(setup.addr, &unknown).await.map(drop));
    not_admitted(usbwire_client::import(setup.addr, &BusId::new("0-1").unwrap(), &unknown).await.map(drop));
    not_admitted(usbwire_client::device_states(setup.addr, &unknown).await.map(drop));
    let offer = [TransformSpec::Zstd];
    not_admitted(
        usbwire_client::import_with(setup.addr, &BusId::new("0-1").unwrap(), &unknown, &offer).await.map(drop),
    );
    // A server whose key is not the pinned one (a key for another server).
    let other_server = Identity::generate("other").unwrap();
    let known = setup.known("wrong-pin");
    known.add(&setup.addr.to_string(), other_server.fingerprint()).unwrap();
    let result = usbwire_client::list_devices(setup.addr, &tls(&setup.alice, known, false)).await;
    assert!(matches!(result, Err(ClientError::ServerKeyChanged { .. })), "{result:?}");
    // A lab registry entry naming another key (planted, or stale) is refused, even
    // where known_servers pins the right one; the entry's right key is accepted even
    // where known_servers pins another, and known_servers is left as it was.
    let right = pinned(&setup, setup.addr, "registry-right");
    let planted = registry_pinned(&setup.alice, right.clone(), other_server.fingerprint());
    match usbwire_client::list_devices(setup.addr, &planted).await {
        Err(ClientError::NotTheRegisteredKey { expected, got, .. }) => {
            assert_eq!(expected, other_server.fingerprint().to_string());
            assert_eq!(got, setup.server.fingerprint().to_string());
        }
        other => panic!("expected a refused registry key, got {other:?}"),
    }
    let wrong = setup.known("registry-wrong-known");
    wrong.add(&setup.addr.to_string(), other_server.fingerprint()).unwrap();
    let registered = registry_pinned(&setup.alice, wrong.clone(), setup.server.fingerprint());
    usbwire_client::list_devices(setup.addr, &registered).await.expect("the registered key is accepted");
    assert_eq!(wrong.lookup(&setup.addr.to_string()), Some(other_server.fingerprint()), "known_servers untouched");
    let unpinned = setup.known("registry-unpinned");
    let registered = registry_pinned(&setup.alice, unpinned.clone(), setup.server.fingerprint());
    usbwire_client::list_devices(setup.addr, &registered).await.expect("no pin needed beside the registry's");
    assert!(unpinned.is_empty(), "the registry's key is not written to known_servers");
    // An unknown server without --trust-new: refused, and the error shows the key to check.
    let known = setup.known("unpinned");
    match usbwire_client::list_devices(setup.addr, &tls(&setup.alice, known.clone(), false)).await {
        Err(ClientError::UnknownServer { fingerprint, .. }) => {
            assert_eq!(fingerprint, setup.server.fingerprint().to_string())
        }
        other => panic!("expected an unknown-server error, got {other:?}"),
    }
    assert_eq!(known.lookup(&setup.addr.to_string()), None);
    // With --trust-new it is pinned and used.
    let devices = usbwire_client::list_devices(setup.addr, &tls(&setup.alice, known.clone(), true)).await.unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(known.lookup(&setup.addr.to_string()), Some(setup.server.fingerprint()));
}

/// A TLS 1.3 client that presents no certificate, asking for the device list.
async fn list_without_client_key(addr: SocketAddr) -> std::io::Result<usize> {
    use tokio_rustls::rustls;
    #[derive(Debug)]
    struct AnyServer(rustls::crypto::WebPkiSupportedAlgorithms);
    impl rustls::client::danger::ServerCertVerifier for AnyServer {
        fn verify_server_cert(
            &self,
            _: &rustls::pki_types::CertificateDer<'_>,
            _: &[rustls::pki_types::CertificateDer<'_>],
            _: &rustls::pki_types::ServerName<'_>,
            _: &[u8],
            _: rustls::pki_types::UnixTime,
        ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &rustls::pki_types::CertificateDer<'_>,
            _: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            unreachable!("TLS 1.3 only")
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &rustls::pki_types::CertificateDer<'_>,
            dss: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
        }
        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.0.supported_schemes()
        }
    }
    let provider = rustls::crypto::ring::default_provider();
    let verifier = AnyServer(provider.signature_verification_algorithms);
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await?;
    let mut stream =
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(usbwire_transport::tls::server_name(), tcp).await?;
    let mut request = bytes::BytesMut::new();
    usbwire_proto::op::OpRequest::DevList.encode(&mut request);
    stream.write_all(&request).await?;
    let mut reply = [0u8; 256];
    match stream.read(&mut reply).await? {
        0 => Err(std::io::ErrorKind::UnexpectedEof.into()),
        n => Ok(n),
    }
}

#[tokio::test]
async fn plain_from_loopback_is_allowed_by_the_default_tls_policy() {
    let setup = start(PlainPolicy::Loopback).await;
    // Accepted, but as the identity `plain`, which no rule of this server names.
    let devices = usbwire_client::list_devices(setup.addr, &Security::Plain).await.unwrap();
    assert_eq!(devices.len(), 0);
}

/// A proxy that flips one byte of the client-to-server stream at `at`.
async fn tampering_proxy(target: SocketAddr, at: usize) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut client, _) = listener.accept().await.unwrap();
        let mut server = TcpStream::connect(target).await.unwrap();
        let (mut cr, mut cw) = client.split();
        let (mut sr, mut sw) = server.split();
        let upstream = async {
            let mut seen = 0usize;
            let mut buf = vec![0u8; 65536];
            loop {
                let n = match cr.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if seen <= at && at < seen + n {
                    buf[at - seen] ^= 0x40;
                }
                seen += n;
                if sw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = sw.shutdown().await;
        };
        let downstream = async {
            let _ = tokio::io::copy(&mut sr, &mut cw).await;
            let _ = cw.shutdown().await;
        };
        tokio::join!(upstream, downstream);
    });
    addr
}

#[tokio::test]
async fn bytes_altered_on_the_wire_drop_the_connection() {
    let setup = start(PlainPolicy::Never).await;
    // Flip a byte well after the handshake, inside the OUT payload's TLS records.
    let proxy = tampering_proxy(setup.addr, 60_000).await;
    let alice = tls(&setup.alice, pinned(&setup, proxy, "tamper-known"), false);
    let (stream, record) = usbwire_client::import(proxy, &BusId::new("0-1").unwrap(), &alice).await.unwrap();
    let conn = Connection::new(stream, &record);
    conn.transfer(Transfer::control_out([0, 9, 1, 0, 0, 0, 0, 0], Bytes::new())).await.unwrap();
    let sent = Bytes::from(vec![0x11u8; 200_000]);
    let out =
        tokio::time::timeout(Duration::from_secs(5), conn.transfer(Transfer::bulk_out(0x03, sent))).await.unwrap();
    assert_eq!(out, Err(TransferError::Disconnected), "the server must drop the connection, not complete the URB");
    // And the device is reset and available again (through a clean path).
    let direct = tls(&setup.alice, pinned(&setup, setup.addr, "after-tamper"), false);
    for _ in 0..100 {
        if usbwire_client::list_devices(setup.addr, &direct).await.unwrap().len() == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("device not available again after the tampered connection");
}

#[tokio::test]
async fn negotiated_transforms_carry_urbs_over_tls_and_plain() {
    let plain_rule = Rule { client: "plain".into(), devices: vec!["0-1".into()] };
    let setup = start_with_rules(PlainPolicy::Loopback, None, &[plain_rule]).await;
    let alice = tls(&setup.alice, pinned(&setup, setup.addr, "alice-transforms"), false);
    let offer = [TransformSpec::Zstd, TransformSpec::Jitter(std::time::Duration::from_millis(20))];
    for security in [alice, Security::Plain] {
        let (stream, record) =
            usbwire_client::import_with(setup.addr, &BusId::new("0-1").unwrap(), &security, &offer).await.unwrap();
        assert_eq!(stream.transforms(), ["zstd", "jitter"]);
        let conn = Connection::new(stream, &record);
        conn.transfer(Transfer::control_out([0, 9, 1, 0, 0, 0, 0, 0], Bytes::new())).await.unwrap();
        // Compressible and incompressible payloads both come back intact through the loop pair.
        let compressible = Bytes::from(vec![0x3cu8; 300_000]);
        let noise: Bytes = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        for payload in [compressible, noise] {
            conn.transfer(Transfer::bulk_out(0x03, payload.clone())).await.unwrap();
            let mut back = Vec::new();
            while back.len() < payload.len() {
                let ret = conn.transfer(Transfer::bulk_in(0x83, 300_000)).await.unwrap();
                back.extend_from_slice(&ret.data);
            }
            assert_eq!(back, payload);
        }
        drop(conn);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn asking_a_stock_server_for_transforms_is_a_clear_error() {
    // A peer that hangs up on an unknown op code, as usbipd does.
    let addr = usbwire_testing::stock_peer().await;
    let result =
        usbwire_client::import_with(addr, &BusId::new("0-1").unwrap(), &Security::Plain, &[TransformSpec::Lz4]).await;
    match result {
        Err(ClientError::NoTransforms { .. }) => {}
        other => panic!("expected NoTransforms, got {:?}", other.map(|(_, r)| r)),
    }
}

#[tokio::test]
async fn a_private_ca_admits_the_names_it_issued_and_nothing_else() {
    use usbwire_transport::ca::{CertificateAuthority, TrustedCa};
    let ca_dir = scratch("fleet-ca");
    let ca = CertificateAuthority::create(&ca_dir, "fleet", usbwire_transport::key_files::Existing::Refuse).unwrap().0;
    let setup = start_with_ca(PlainPolicy::Never, Some(TrustedCa::load(&ca_dir).unwrap())).await;
    let client = |identity: &Identity, name: &str| tls(identity, pinned(&setup, setup.addr, name), false);

    let bob = ca.issue("bob", 30).unwrap();
    let devices = usbwire_client::list_devices(setup.addr, &client(&bob, "bob-known")).await.unwrap();
    assert_eq!(devices.iter().map(|d| d.busid.as_str()).collect::<Vec<_>>(), ["0-2"], "bob sees only his device");
    let (_stream, _) =
        usbwire_client::import(setup.addr, &BusId::new("0-2").unwrap(), &client(&bob, "bob-import")).await.unwrap();
    let states = usbwire_client::device_states(setup.addr, &client(&bob, "bob-state")).await.unwrap().unwrap();
    assert!(states[0].identity.as_deref().unwrap().starts_with("ca:bob"), "{states:?}");

    let refused = |result: &Result<Vec<usbwire_proto::op::DeviceRecord>, ClientError>| {
        matches!(result, Err(ClientError::NotAdmitted { .. }))
    };
    // Issued by the CA, but for a name no rule admits.
    let eve = ca.issue("eve", 30).unwrap();
    let result = usbwire_client::list_devices(setup.addr, &client(&eve, "eve-known")).await;
    assert!(refused(&result), "{result:?}");
    // Named bob, but by another CA.
    let other_dir = scratch("other-ca");
    let other =
        CertificateAuthority::create(&other_dir, "other", usbwire_transport::key_files::Existing::Refuse).unwrap().0;
    let fake_bob = other.issue("bob", 30).unwrap();
    let result = usbwire_client::list_devices(setup.addr, &client(&fake_bob, "fake-known")).await;
    assert!(refused(&result), "{result:?}");
    // The refusal names the CA and the name, not a fingerprint rule that would admit one key.
    let said = result.unwrap_err().to_string();
    assert!(said.contains("issued by CA other for bob") && said.contains("allow `ca:bob`"), "{said}");
    assert!(!said.contains("--allow sha256"), "{said}");
    // Bob's certificate, expired.
    let now = time::OffsetDateTime::now_utc();
    let old_bob = ca.issue_valid("bob", now - time::Duration::days(30), now - time::Duration::days(1)).unwrap();
    let result = usbwire_client::list_devices(setup.addr, &client(&old_bob, "old-known")).await;
    assert!(matches!(result, Err(ClientError::CertificateExpired { .. })), "{result:?}");
}

/// A session's token is worth nothing to another identity: with Alice's token,
/// a plain loopback client and another admitted TLS client are refused, and
/// Alice herself resumes (over TLS, on a new connection).
#[tokio::test]
async fn only_the_importing_identity_can_resume_a_session() {
    let eve = Identity::generate("eve").unwrap();
    let extra = [Rule { client: eve.fingerprint().to_string(), devices: vec!["0-3".into()] }];
    let setup = start_with_rules(PlainPolicy::Loopback, None, &extra).await;
    let alice = tls(&setup.alice, pinned(&setup, setup.addr, "resume-alice"), false);
    let busid = BusId::new("0-1").unwrap();
    let imported = usbwire_client::import_resumable(setup.addr, &busid, &alice, &[]).await.unwrap();
    let token = imported.resume.expect("resume granted over TLS").token;
    drop(imported.stream);
    tokio::time::sleep(Duration::from_millis(200)).await;

    let refused = usbwire_client::resume_session(setup.addr, &Security::Plain, &[], &token, 0).await;
    assert!(matches!(refused, Err(ClientError::ResumeRefused { .. })), "plain: {:?}", refused.err());
    let eve = tls(&eve, pinned(&setup, setup.addr, "resume-eve"), false);
    let refused = usbwire_client::resume_session(setup.addr, &eve, &[], &token, 0).await;
    assert!(matches!(refused, Err(ClientError::ResumeRefused { .. })), "eve: {:?}", refused.err());

    let (stream, commands_received) = usbwire_client::resume_session(setup.addr, &alice, &[], &token, 0).await.unwrap();
    assert!(stream.is_tls());
    assert_eq!(commands_received, 0);
}
