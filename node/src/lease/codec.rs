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
use libp2p::request_response::Codec;
use libp2p::StreamProtocol;

/// Protocol name of lease negotiation.
pub const LEASE_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpunode/lease/1.0.0");

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
