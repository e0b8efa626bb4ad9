//! Direct advert fetch: a peer asks a provider for its current signed advert over a
//! request-response stream, instead of looking the advert up in the DHT.
//!
//! The request is one version byte; the answer is the signed advert exactly as it is
//! stored in the DHT (empty when the peer advertises nothing), at most
//! [`MAX_SIGNED_ADVERT_BYTES`]. The asker verifies it like any DHT copy (signature,
//! publisher, expiry, sequence number), so a provider cannot answer for anyone else.

use std::time::Duration;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use gpunode_protocol::advert::MAX_SIGNED_ADVERT_BYTES;
use libp2p::request_response::{self, Codec, ProtocolSupport};
use libp2p::StreamProtocol;

/// Protocol name of the direct advert fetch.
pub const ADVERT_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpunode/advert/1.0.0");

/// The only request version this build sends and answers.
const REQUEST_VERSION: u8 = 1;

/// How long a fetch may take, dial included, before the asker falls back to the DHT.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(2);

/// Streams one connection may have open for advert fetches at once.
const MAX_CONCURRENT_FETCHES: usize = 32;

/// "Send me your current advert."
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdvertQuery;

/// A provider's answer: its signed advert, or nothing if it does not advertise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdvertAnswer(pub Option<Vec<u8>>);

/// The request-response behaviour that carries advert fetches. Building it also makes
/// this process open advert streams lazily ([`crate::network::negotiate_lazily`]): the
/// one-byte request leaves with the stream's protocol proposal, a round trip sooner.
pub fn behaviour() -> request_response::Behaviour<AdvertCodec> {
    crate::network::negotiate_lazily(&ADVERT_PROTOCOL);
    request_response::Behaviour::with_codec(
        AdvertCodec,
        [(ADVERT_PROTOCOL, ProtocolSupport::Full)],
        request_response::Config::default()
            .with_request_timeout(FETCH_TIMEOUT)
            .with_max_concurrent_streams(MAX_CONCURRENT_FETCHES),
    )
}

/// Reads the advert protocol with hard size limits.
#[derive(Debug, Clone, Copy, Default)]
pub struct AdvertCodec;

fn invalid(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message)
}

/// Reads at most `limit` bytes to the end of the stream; more is an error.
async fn read_at_most<T: AsyncRead + Unpin + Send>(
    io: &mut T,
    limit: usize,
) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    io.take(limit as u64 + 1).read_to_end(&mut buf).await?;
    if buf.len() > limit {
        return Err(invalid(format!(
            "advert fetch message exceeds {limit} bytes"
        )));
    }
    Ok(buf)
}

impl Codec for AdvertCodec {
    type Protocol = StreamProtocol;
    type Request = AdvertQuery;
    type Response = AdvertAnswer;

    async fn read_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> std::io::Result<AdvertQuery>
    where
        T: AsyncRead + Unpin + Send,
    {
        match read_at_most(io, 1).await?.as_slice() {
            [REQUEST_VERSION] => Ok(AdvertQuery),
            other => Err(invalid(format!(
                "advert fetch request {other:?} is not version {REQUEST_VERSION}"
            ))),
        }
    }

    async fn read_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> std::io::Result<AdvertAnswer>
    where
        T: AsyncRead + Unpin + Send,
    {
        let bytes = read_at_most(io, MAX_SIGNED_ADVERT_BYTES).await?;
        Ok(AdvertAnswer((!bytes.is_empty()).then_some(bytes)))
    }

    async fn write_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        _: AdvertQuery,
    ) -> std::io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        io.write_all(&[REQUEST_VERSION]).await?;
        io.close().await
    }

    async fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: AdvertAnswer,
    ) -> std::io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        if let Some(bytes) = res.0 {
            io.write_all(&bytes).await?;
        }
        io.close().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::io::Cursor;

    #[tokio::test]
    async fn an_oversized_answer_is_refused_before_it_is_kept() {
        let mut io = Cursor::new(vec![7u8; MAX_SIGNED_ADVERT_BYTES + 1]);
        let err = AdvertCodec
            .read_response(&ADVERT_PROTOCOL, &mut io)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        let mut io = Cursor::new(vec![7u8; MAX_SIGNED_ADVERT_BYTES]);
        let ok = AdvertCodec.read_response(&ADVERT_PROTOCOL, &mut io).await;
        assert_eq!(
            ok.unwrap().0.map(|b| b.len()),
            Some(MAX_SIGNED_ADVERT_BYTES)
        );
    }

    #[tokio::test]
    async fn a_request_is_one_version_byte_and_nothing_else() {
        for bad in [vec![], vec![2u8], vec![1u8, 1]] {
            let mut io = Cursor::new(bad.clone());
            let r = AdvertCodec.read_request(&ADVERT_PROTOCOL, &mut io).await;
            assert!(r.is_err(), "{bad:?} was accepted");
        }
        let mut io = Cursor::new(vec![REQUEST_VERSION]);
        assert_eq!(
            AdvertCodec
                .read_request(&ADVERT_PROTOCOL, &mut io)
                .await
                .unwrap(),
            AdvertQuery
        );
        let mut io = Cursor::new(Vec::new());
        let answer = AdvertCodec.read_response(&ADVERT_PROTOCOL, &mut io).await;
        assert_eq!(answer.unwrap(), AdvertAnswer(None));
    }
}
