//! The transfer benchmark's ceiling: a plain quinn stream on loopback with the cipher our
//! QUIC connections negotiate (TLS 1.3 AES-128-GCM, aws-lc-rs, as libp2p-quic uses), one
//! unidirectional stream, 1 MiB writes, the receiver counting and dropping the bytes.
//! No libp2p, no framing, no hashing, no disk: what the stack itself reaches in this run.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::crypto::aws_lc_rs;

/// ALPN of the benchmark's connections.
const ALPN: &[u8] = b"gpunode-bench";
/// Bytes per write, as the job path's chunks.
const WRITE: usize = 1 << 20;

/// rustls' aws-lc-rs provider limited to TLS 1.3 AES-128-GCM.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = aws_lc_rs::default_provider();
    p.cipher_suites = vec![aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256];
    Arc::new(p)
}

/// Sends `bytes` over one plain quinn stream on 127.0.0.1; the receiver's rate, MB/s
/// (from the stream's first byte to its last).
pub async fn plain_quinn_mb_s(bytes: u64) -> Result<f64> {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()])?;
    let cert_der = rustls::pki_types::CertificateDer::from(cert.cert.der().to_vec());
    let key_der = rustls::pki_types::PrivateKeyDer::Pkcs8(
        rustls::pki_types::PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der()),
    );

    let mut server_tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![cert_der.clone()], key_der)?;
    server_tls.alpn_protocols = vec![ALPN.to_vec()];
    let server_config =
        quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(server_tls)?));
    let server = quinn::Endpoint::server(server_config, "127.0.0.1:0".parse()?)?;
    let addr: SocketAddr = server.local_addr()?;

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert_der)?;
    let mut client_tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    client_tls.alpn_protocols = vec![ALPN.to_vec()];
    let mut client = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    client.set_default_client_config(quinn::ClientConfig::new(Arc::new(
        QuicClientConfig::try_from(client_tls)?,
    )));

    let receiver = tokio::spawn(async move {
        let conn = server
            .accept()
            .await
            .context("no connection")?
            .await
            .context("handshake")?;
        let mut stream = conn.accept_uni().await.context("no stream")?;
        let mut received = 0u64;
        let mut first: Option<Instant> = None;
        while let Some(chunk) = stream.read_chunk(WRITE, true).await? {
            first.get_or_insert_with(Instant::now);
            received += chunk.bytes.len() as u64;
        }
        let took = first.map(|f| f.elapsed()).unwrap_or_default();
        conn.close(0u32.into(), b"done");
        server.wait_idle().await;
        anyhow::Ok((received, took))
    });

    let conn = client.connect(addr, "localhost")?.await?;
    let mut stream = conn.open_uni().await?;
    let block = vec![0xa5u8; WRITE];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(WRITE as u64) as usize;
        stream.write_all(&block[..n]).await?;
        left -= n as u64;
    }
    stream.finish()?;
    let (received, took) = receiver.await??;
    client.wait_idle().await;
    if received != bytes {
        bail!("plain quinn: {received} of {bytes} bytes arrived");
    }
    Ok(bytes as f64 / took.as_secs_f64().max(1e-9) / 1e6)
}
