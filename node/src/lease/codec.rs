//! Lease messages on a libp2p request-response stream: one bincode message each way,
//! at most `MAX_LEASE_MESSAGE_BYTES`. An inbound request that is too large or does not
//! decode is handed to the node as [`InboundLease::Invalid`], so the peer gets a
//! rejection with a reason and the connection stays up.

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use gpunode_protocol::encoding;
use gpunode_protocol::lease::{
    decode_message, decode_reply, LeaseMessage, LeaseReply, RejectCode, Rejection,
    MAX_LEASE_MESSAGE_BYTES,
};
use std::time::Duration;

use libp2p::request_response::{self, Codec};
use libp2p::StreamProtocol;

/// Protocol name of lease negotiation.
pub const LEASE_PROTOCOL_NAME: &str = "/gpunode/lease/1.0.0";
/// [`LEASE_PROTOCOL_NAME`] as libp2p takes it.
pub const LEASE_PROTOCOL: StreamProtocol = StreamProtocol::new(LEASE_PROTOCOL_NAME);

/// The lease protocol's request-response behaviour, one per swarm. Building it also
/// makes this process open lease streams lazily ([`crate::network::negotiate_lazily`]):
/// a request leaves right behind its stream's protocol proposal instead of waiting a
/// round trip for the provider to confirm the protocol.
pub fn lease_behaviour() -> request_response::Behaviour<LeaseCodec> {
    crate::network::negotiate_lazily(&LEASE_PROTOCOL);
    request_response::Behaviour::with_codec(
        LeaseCodec,
        [(LEASE_PROTOCOL, request_response::ProtocolSupport::Full)],
        request_response::Config::default()
            .with_request_timeout(Duration::from_secs(10))
            .with_max_concurrent_streams(256),
    )
}

/// A request as read from (or written to) the wire.
// Requests are read once and handed straight to the event loop; boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum InboundLease {
    /// A well-formed message.
    Message(LeaseMessage),
    /// Bytes that were refused before they could become a message.
    Invalid(Rejection),
}

/// The bincode codec with hard size limits.
#[derive(Debug, Clone, Copy, Default)]
pub struct LeaseCodec;

async fn read_limited<T: AsyncRead + Unpin + Send>(
    io: &mut T,
) -> std::io::Result<Result<Vec<u8>, usize>> {
    let mut buf = Vec::new();
    io.take(MAX_LEASE_MESSAGE_BYTES as u64 + 1)
        .read_to_end(&mut buf)
        .await?;
    if buf.len() > MAX_LEASE_MESSAGE_BYTES {
        return Ok(Err(buf.len()));
    }
    Ok(Ok(buf))
}

impl Codec for LeaseCodec {
    type Protocol = StreamProtocol;
    type Request = InboundLease;
    type Response = LeaseReply;

    async fn read_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> std::io::Result<InboundLease>
    where
        T: AsyncRead + Unpin + Send,
    {
        Ok(match read_limited(io).await? {
            Err(_) => InboundLease::Invalid(Rejection::new(
                RejectCode::Oversized,
                format!("lease messages are limited to {MAX_LEASE_MESSAGE_BYTES} bytes"),
            )),
            Ok(bytes) => match decode_message(&bytes) {
                Ok(m) => InboundLease::Message(m),
                Err(r) => InboundLease::Invalid(r),
            },
        })
    }

    async fn read_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> std::io::Result<LeaseReply>
    where
        T: AsyncRead + Unpin + Send,
    {
        match read_limited(io).await? {
            Err(n) => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("lease reply of more than {n} bytes exceeds the limit"),
            )),
            Ok(bytes) => decode_reply(&bytes)
                .map_err(|r| std::io::Error::new(std::io::ErrorKind::InvalidData, r.message)),
        }
    }

    async fn write_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: InboundLease,
    ) -> std::io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        let InboundLease::Message(m) = req else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "only messages can be sent",
            ));
        };
        io.write_all(&encoding::encode(&m)).await?;
        io.close().await
    }

    async fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: LeaseReply,
    ) -> std::io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        io.write_all(&encoding::encode(&res)).await?;
        io.close().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::refused_protocol;
    use futures::FutureExt;
    use multistream_select::{dialer_select_proto, listener_select_proto, Version};
    use tokio_util::compat::TokioAsyncReadCompatExt;

    /// Once the lease behaviour exists, a lease stream is settled on at once (the
    /// request can follow its proposal in the same packet), while any other protocol
    /// still waits for the listener: without the registration, or with it applied to
    /// every protocol, this fails.
    #[tokio::test]
    async fn a_lease_stream_does_not_wait_for_the_listener_and_others_do() {
        let _lease = lease_behaviour();
        let (dialer, _listener) = tokio::io::duplex(4096);
        let lease = dialer_select_proto(dialer.compat(), [LEASE_PROTOCOL_NAME], Version::V1);
        let (protocol, _) = lease
            .now_or_never()
            .expect("a lease stream waited for the listener")
            .expect("negotiation failed");
        assert_eq!(protocol, LEASE_PROTOCOL_NAME);

        let (dialer, _listener) = tokio::io::duplex(4096);
        let job = dialer_select_proto(dialer.compat(), ["/gpunode/job/1.0.0"], Version::V1);
        assert!(
            job.now_or_never().is_none(),
            "another protocol did not wait for the listener's confirmation"
        );
    }

    /// A lease stream opened on `dialer` as the node opens one, with a request written.
    async fn request_sent(
        dialer: tokio::io::DuplexStream,
    ) -> multistream_select::Negotiated<tokio_util::compat::Compat<tokio::io::DuplexStream>> {
        let (_, mut io) = dialer_select_proto(dialer.compat(), [LEASE_PROTOCOL_NAME], Version::V1)
            .await
            .expect("dialer negotiation");
        io.write_all(b"request").await.expect("write");
        io.flush().await.expect("flush");
        io
    }

    /// Closing a lazily opened stream waits for the listener's confirmation, so a
    /// message sent without an answer is not dropped before the listener took it; a
    /// refusal fails the close with an error `refused_protocol` recognises.
    #[tokio::test]
    async fn closing_a_lazy_stream_waits_for_the_listeners_confirmation() {
        let _lease = lease_behaviour();
        let (dialer, listener) = tokio::io::duplex(4096);
        let mut io = request_sent(dialer).await;
        {
            let mut close = Box::pin(io.close());
            assert!(
                close.as_mut().now_or_never().is_none(),
                "closed before the listener confirmed the protocol"
            );
            let provider = tokio::spawn(async move {
                let (_, mut io) = listener_select_proto(listener.compat(), [LEASE_PROTOCOL_NAME])
                    .await
                    .expect("listener negotiation");
                let mut request = Vec::new();
                io.read_to_end(&mut request).await.expect("request");
                assert_eq!(request, b"request");
            });
            close.await.expect("closed once confirmed");
            provider.await.expect("listener task");
        }
        io.close().await.expect("a second close");

        let (dialer, listener) = tokio::io::duplex(4096);
        let refuser = tokio::spawn(async move {
            let _ = listener_select_proto(listener.compat(), ["/other/1.0.0"]).await;
        });
        let mut io = request_sent(dialer).await;
        let refused = io
            .close()
            .await
            .expect_err("a refused stream closed cleanly");
        assert!(refused_protocol(&request_response::OutboundFailure::Io(
            refused
        )));
        refuser.await.expect("listener task");
    }

    /// Against a listener that negotiates as every libp2p node does (an older gpunode
    /// too), the request sent before the confirmation arrives whole and the reply comes
    /// back; a listener that does not serve the protocol fails the dialer's read with an
    /// error the loop tells from a failed connection.
    #[tokio::test]
    async fn a_lazily_opened_lease_stream_carries_request_and_reply() {
        let _lease = lease_behaviour();
        let (dialer, listener) = tokio::io::duplex(4096);
        let provider = tokio::spawn(async move {
            let (protocol, mut io) =
                listener_select_proto(listener.compat(), [LEASE_PROTOCOL_NAME])
                    .await
                    .expect("listener negotiation");
            assert_eq!(protocol, LEASE_PROTOCOL_NAME);
            let mut request = [0u8; 7];
            io.read_exact(&mut request).await.expect("request");
            assert_eq!(&request, b"request");
            io.write_all(b"reply").await.expect("reply");
            io.close().await.expect("close");
        });
        let mut io = request_sent(dialer).await;
        let mut reply = Vec::new();
        io.read_to_end(&mut reply).await.expect("read");
        assert_eq!(reply, b"reply");
        provider.await.expect("listener task");

        let (dialer, listener) = tokio::io::duplex(4096);
        let refuser = tokio::spawn(async move {
            let refused = listener_select_proto(listener.compat(), ["/other/1.0.0"]).await;
            assert!(
                refused.is_err(),
                "the listener accepted a protocol it does not serve"
            );
        });
        let mut io = request_sent(dialer).await;
        let mut reply = Vec::new();
        let refused = io
            .read_to_end(&mut reply)
            .await
            .expect_err("a refused lease stream read as a reply");
        assert!(refused_protocol(&request_response::OutboundFailure::Io(
            refused
        )));
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(!refused_protocol(&request_response::OutboundFailure::Io(
            reset
        )));
        drop(io);
        refuser.await.expect("listener task");
    }
}
