//! The libp2p TLS handshake, attacked with forged certificates. Our copy of libp2p-tls
//! (vendor/README.md) checks a peer's certificate once per full handshake instead of
//! three times: its self-signature and the host key's signature when the verifier first
//! sees it, the handshake signature after. These tests run TLS 1.3 in memory with the
//! configs libp2p-tls builds for QUIC connections (`make_client_config`,
//! `make_server_config`; QUIC itself, and libp2p-quic reading the peer id, are not
//! exercised here) and check that each forgery is refused, for the reason it was made
//! to fail, from either side, and that an honest peer gets through as itself.

use std::sync::Arc;

use libp2p::identity::Keypair;
use libp2p::PeerId;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, ClientConnection, ServerConfig, ServerConnection};

/// The libp2p Public Key Extension's OID (1.3.6.1.4.1.53594.1.1).
const P2P_EXT_OID: [u64; 9] = [1, 3, 6, 1, 4, 1, 53594, 1, 1];

/// A certificate and the key that signs the handshake with it, as a peer presents them.
#[derive(Debug)]
struct Presented(Arc<CertifiedKey>);

impl rustls::client::ResolvesClientCert for Presented {
    fn resolve(&self, _: &[&[u8]], _: &[rustls::SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

impl rustls::server::ResolvesServerCert for Presented {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }
}

/// What a peer presents: `cert`, with the handshake signed by `key`.
fn presented(cert: CertificateDer<'static>, key: &rcgen::KeyPair) -> Arc<Presented> {
    let der = PrivateKeyDer::from(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let signer = rustls::crypto::aws_lc_rs::sign::any_ecdsa_type(&der).expect("an ECDSA key");
    Arc::new(Presented(Arc::new(CertifiedKey::new(vec![cert], signer))))
}

fn p256() -> rcgen::KeyPair {
    rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("a P-256 key")
}

/// DER of `SEQUENCE { OCTET STRING a, OCTET STRING b }` (libp2p's `SignedKey`), for
/// contents short enough for one-byte lengths.
fn signed_key_der(a: &[u8], b: &[u8]) -> Vec<u8> {
    let octets = |v: &[u8]| {
        assert!(v.len() < 128);
        [&[0x04, v.len() as u8][..], v].concat()
    };
    let body = [octets(a), octets(b)].concat();
    assert!(body.len() < 128);
    [&[0x30, body.len() as u8][..], &body].concat()
}

/// A self-signed certificate for `cert_key` whose libp2p extension names `host`'s public
/// key, with the extension's signature made by `signer` (the host itself when honest).
fn libp2p_cert(
    cert_key: &rcgen::KeyPair,
    host: &Keypair,
    signer: &Keypair,
) -> CertificateDer<'static> {
    let mut msg = b"libp2p-tls-handshake:".to_vec();
    msg.extend(cert_key.public_key_der());
    let signature = signer.sign(&msg).expect("an ed25519 signature");
    let content = signed_key_der(&host.public().encode_protobuf(), &signature);
    let mut ext = rcgen::CustomExtension::from_oid_content(&P2P_EXT_OID, content);
    ext.set_criticality(true);
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.custom_extensions.push(ext);
    params
        .self_signed(cert_key)
        .expect("a certificate")
        .der()
        .clone()
}

/// Runs a handshake in memory; the peer certificates each side ended with (the client's
/// view of the server's, the server's view of the client's), or the first error.
fn handshake(
    client: ClientConfig,
    server: ServerConfig,
) -> Result<(CertificateDer<'static>, CertificateDer<'static>), rustls::Error> {
    let name = ServerName::try_from("libp2p").expect("a server name");
    let mut c = ClientConnection::new(Arc::new(client), name)?;
    let mut s = ServerConnection::new(Arc::new(server))?;
    for _ in 0..20 {
        let mut buf = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut buf).expect("write to memory");
        }
        let mut rd = &buf[..];
        while !rd.is_empty() {
            s.read_tls(&mut rd).expect("read from memory");
        }
        s.process_new_packets()?;
        let mut buf = Vec::new();
        while s.wants_write() {
            s.write_tls(&mut buf).expect("write to memory");
        }
        let mut rd = &buf[..];
        while !rd.is_empty() {
            c.read_tls(&mut rd).expect("read from memory");
        }
        c.process_new_packets()?;
        if !c.is_handshaking() && !s.is_handshaking() {
            let first = |certs: Option<&[CertificateDer<'_>]>| {
                certs
                    .and_then(|c| c.first())
                    .expect("a peer certificate")
                    .clone()
                    .into_owned()
            };
            return Ok((first(c.peer_certificates()), first(s.peer_certificates())));
        }
    }
    panic!("handshake did not finish in 20 exchanges");
}

fn honest_client(host: &Keypair, expect: Option<PeerId>) -> ClientConfig {
    libp2p_tls::make_client_config(host, expect).expect("a client config")
}

fn honest_server(host: &Keypair) -> ServerConfig {
    libp2p_tls::make_server_config(host).expect("a server config")
}

/// The three forgeries, each as a (certificate, handshake key) pair for `host`, with
/// what the refusal names (the verifier's error, as `Debug` prints it).
fn forgeries(host: &Keypair) -> Vec<(&'static str, Arc<Presented>, &'static str)> {
    let other_host = Keypair::generate_ed25519();
    // The host-key signature in the extension made by another host key.
    let key = p256();
    let bad_extension = presented(libp2p_cert(&key, host, &other_host), &key);
    // A valid certificate whose self-signature is corrupted (its last byte, inside the
    // signature value), the handshake signed with its own key.
    let key = p256();
    let mut der = libp2p_cert(&key, host, host).to_vec();
    *der.last_mut().expect("a non-empty certificate") ^= 0x01;
    let bad_self_signature = presented(CertificateDer::from(der), &key);
    // A valid certificate, the handshake signed with a key that is not the certificate's.
    let key = p256();
    let wrong_handshake_key = presented(libp2p_cert(&key, host, host), &p256());
    vec![
        (
            "extension signed by another host key",
            bad_extension,
            "UnknownIssuer",
        ),
        (
            "self-signature corrupted",
            bad_self_signature,
            "SignatureAlgorithmMismatch",
        ),
        (
            "handshake signed with another key",
            wrong_handshake_key,
            "BadSignature",
        ),
    ]
}

#[test]
fn an_honest_handshake_names_each_peer_as_itself() {
    let (client_host, server_host) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    let server_id = server_host.public().to_peer_id();
    let (server_cert, client_cert) = handshake(
        honest_client(&client_host, Some(server_id)),
        honest_server(&server_host),
    )
    .expect("an honest handshake succeeds");
    // As libp2p-quic names a connection's peer (the certificate parsed once more without
    // its checks), and as a full parse does.
    for (cert, host) in [(&server_cert, &server_host), (&client_cert, &client_host)] {
        let want = host.public().to_peer_id();
        let unchecked = libp2p_tls::certificate::parse_verified(cert).expect("parses");
        assert_eq!(unchecked.peer_id(), want);
        assert_eq!(
            libp2p_tls::certificate::parse(cert)
                .expect("verifies")
                .peer_id(),
            want
        );
    }
}

/// `host` presents `cert` as a server to an honest client expecting `expect`: the
/// certificate the client ended with, or its refusal.
fn present_as_server(
    host: &Keypair,
    cert: Arc<Presented>,
    expect: Option<PeerId>,
) -> Result<CertificateDer<'static>, rustls::Error> {
    let mut server = honest_server(host);
    server.cert_resolver = cert;
    let client = honest_client(&Keypair::generate_ed25519(), expect);
    handshake(client, server).map(|(server_cert, _)| server_cert)
}

/// `host` presents `cert` as a client to an honest server: the certificate the server
/// ended with, or its refusal.
fn present_as_client(
    host: &Keypair,
    cert: Arc<Presented>,
) -> Result<CertificateDer<'static>, rustls::Error> {
    let mut client = honest_client(host, None);
    client.client_auth_cert_resolver = cert;
    let server = honest_server(&Keypair::generate_ed25519());
    handshake(client, server).map(|(_, client_cert)| client_cert)
}

/// Fails unless `result` is a refusal naming `reason`.
fn assert_refused(
    result: Result<CertificateDer<'static>, rustls::Error>,
    side: &str,
    what: &str,
    reason: &str,
) {
    match result {
        Ok(_) => panic!("a {side} whose certificate has its {what} was accepted"),
        Err(e) => assert!(
            format!("{e:?}").contains(reason),
            "a {side} whose certificate has its {what} was refused for {e:?}, not {reason}"
        ),
    }
}

/// The certificates the forgeries start from, made honestly, get through: a forgery is
/// refused for what was forged, not for how the test builds certificates.
#[test]
fn a_certificate_built_as_the_forgeries_are_but_honest_is_accepted() {
    let host = Keypair::generate_ed25519();
    let want = host.public().to_peer_id();
    let key = p256();
    let honest = presented(libp2p_cert(&key, &host, &host), &key);
    let server_cert = present_as_server(&host, honest.clone(), Some(want))
        .expect("a server presenting it is accepted");
    let client_cert = present_as_client(&host, honest).expect("a client presenting it is accepted");
    for cert in [&server_cert, &client_cert] {
        assert_eq!(
            libp2p_tls::certificate::parse(cert)
                .expect("verifies")
                .peer_id(),
            want
        );
    }
}

#[test]
fn a_server_presenting_a_forged_certificate_is_refused() {
    let host = Keypair::generate_ed25519();
    for (what, forged, reason) in forgeries(&host) {
        assert_refused(
            present_as_server(&host, forged, None),
            "server",
            what,
            reason,
        );
    }
}

#[test]
fn a_client_presenting_a_forged_certificate_is_refused() {
    let host = Keypair::generate_ed25519();
    for (what, forged, reason) in forgeries(&host) {
        assert_refused(present_as_client(&host, forged), "client", what, reason);
    }
}

#[test]
fn a_server_that_is_not_the_peer_dialled_is_refused() {
    let (server_host, expected) = (Keypair::generate_ed25519(), Keypair::generate_ed25519());
    let client = honest_client(
        &Keypair::generate_ed25519(),
        Some(expected.public().to_peer_id()),
    );
    let refused = handshake(client, honest_server(&server_host)).expect_err("refused");
    assert!(
        format!("{refused:?}").contains("ApplicationVerificationFailure"),
        "{refused:?}"
    );
}
