//! Framing of every stream protocol the router serves (jobs, settlement, team): tagged,
//! length-prefixed messages and data chunks (see `gpunode_protocol::job`), with sizes
//! checked before anything is allocated.

use std::io;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use gpunode_protocol::encoding;
use gpunode_protocol::job::{FRAME_DATA, FRAME_MESSAGE, MAX_CHUNK_BYTES, MAX_MESSAGE_BYTES};
use serde::{de::DeserializeOwned, Serialize};

/// One frame read from the stream.
#[derive(Debug)]
pub enum Frame<T> {
    /// A message.
    Message(T),
    /// A chunk of data.
    Data(Vec<u8>),
}

pub(crate) fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Writes one message frame (not flushed).
pub async fn write_message<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> io::Result<()> {
    let body = encoding::encode(msg);
    if body.len() > MAX_MESSAGE_BYTES {
        return Err(invalid(format!(
            "message of {} bytes is too large",
            body.len()
        )));
    }
    write_frame(w, FRAME_MESSAGE, &body).await
}

/// Writes one data frame (not flushed).
pub async fn write_data<W: AsyncWrite + Unpin>(w: &mut W, data: &[u8]) -> io::Result<()> {
    write_frame(w, FRAME_DATA, data).await
}

async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, tag: u8, body: &[u8]) -> io::Result<()> {
    let mut header = [0u8; 5];
    header[0] = tag;
    header[1..].copy_from_slice(&(body.len() as u32).to_le_bytes());
    w.write_all(&header).await?;
    w.write_all(body).await
}

/// Reads one frame; `Ok(None)` at a clean end of stream. Sizes are checked before any
/// allocation; a bad tag, an oversized frame or an undecodable message is an error.
pub async fn read_frame<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
) -> io::Result<Option<Frame<T>>> {
    read_frame_into(r, Vec::new()).await
}

/// [`read_frame`], with a data frame read into `buf` (grown only where it is shorter),
/// so that a caller can recycle chunk buffers instead of allocating one per chunk.
pub async fn read_frame_into<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
    buf: Vec<u8>,
) -> io::Result<Option<Frame<T>>> {
    let mut header = [0u8; 5];
    match r.read(&mut header[..1]).await? {
        0 => return Ok(None),
        _ => r.read_exact(&mut header[1..]).await?,
    }
    let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
    match header[0] {
        FRAME_MESSAGE if len <= MAX_MESSAGE_BYTES => {
            let mut body = vec![0; len];
            r.read_exact(&mut body).await?;
            encoding::decode(&body, MAX_MESSAGE_BYTES)
                .map(|m| Some(Frame::Message(m)))
                .map_err(|e| invalid(e.to_string()))
        }
        FRAME_DATA if len <= MAX_CHUNK_BYTES => {
            let mut body = buf;
            body.resize(len, 0);
            r.read_exact(&mut body).await?;
            Ok(Some(Frame::Data(body)))
        }
        tag => Err(invalid(format!("bad frame: tag {tag}, {len} bytes"))),
    }
}

/// Reads the next frame, which must be a message.
pub async fn read_message<R: AsyncRead + Unpin, T: DeserializeOwned>(r: &mut R) -> io::Result<T> {
    match read_frame(r).await? {
        Some(Frame::Message(m)) => Ok(m),
        Some(Frame::Data(_)) => Err(invalid("expected a message, got data".into())),
        None => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the peer closed the job stream",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpunode_protocol::job::RequesterMsg;

    #[tokio::test]
    async fn oversized_or_unknown_frames_are_refused_before_allocating() {
        let mut huge = vec![FRAME_DATA];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        let r = read_frame::<_, RequesterMsg>(&mut &huge[..]).await;
        assert!(r.is_err());
        let mut unknown = vec![7u8];
        unknown.extend_from_slice(&4u32.to_le_bytes());
        unknown.extend_from_slice(&[0; 4]);
        assert!(read_frame::<_, RequesterMsg>(&mut &unknown[..])
            .await
            .is_err());
        let mut garbage = vec![FRAME_MESSAGE];
        garbage.extend_from_slice(&3u32.to_le_bytes());
        garbage.extend_from_slice(&[0xff; 3]);
        assert!(read_frame::<_, RequesterMsg>(&mut &garbage[..])
            .await
            .is_err());
    }
}
