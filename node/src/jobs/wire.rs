//! Framing of the job stream: tagged, length-prefixed messages and data chunks (see
//! `gpunode_protocol::job`), and sending or receiving a whole blob as chunks with its
//! hash checked on arrival.

use std::io;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use gpunode_protocol::encoding;
use gpunode_protocol::job::{
    BlobRef, FRAME_DATA, FRAME_MESSAGE, MAX_CHUNK_BYTES, MAX_MESSAGE_BYTES,
};
use serde::{de::DeserializeOwned, Serialize};

/// One frame read from the stream.
#[derive(Debug)]
pub(crate) enum Frame<T> {
    Message(T),
    Data(Vec<u8>),
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Writes one message frame (not flushed).
pub(crate) async fn write_message<W: AsyncWrite + Unpin, T: Serialize>(
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
pub(crate) async fn write_data<W: AsyncWrite + Unpin>(w: &mut W, data: &[u8]) -> io::Result<()> {
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
pub(crate) async fn read_frame<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
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
            let mut body = vec![0; len];
            r.read_exact(&mut body).await?;
            Ok(Some(Frame::Data(body)))
        }
        tag => Err(invalid(format!("bad frame: tag {tag}, {len} bytes"))),
    }
}

/// Reads the next frame, which must be a message.
pub(crate) async fn read_message<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
) -> io::Result<T> {
    match read_frame(r).await? {
        Some(Frame::Message(m)) => Ok(m),
        Some(Frame::Data(_)) => Err(invalid("expected a message, got data".into())),
        None => Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the peer closed the job stream",
        )),
    }
}

/// Sends `size` bytes read from `src` as data frames; `progress` sees the running total.
pub(crate) async fn send_blob<W, R>(
    w: &mut W,
    src: &mut R,
    size: u64,
    mut progress: impl FnMut(u64),
) -> io::Result<()>
where
    W: AsyncWrite + Unpin,
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt as _;
    let mut buf = vec![0u8; MAX_CHUNK_BYTES.min(size.max(1) as usize)];
    let mut sent = 0u64;
    while sent < size {
        let want = buf.len().min((size - sent) as usize);
        src.read_exact(&mut buf[..want]).await?;
        write_data(w, &buf[..want]).await?;
        sent += want as u64;
        progress(sent);
    }
    Ok(())
}

/// Receives one blob's data frames into `dst`, hashing as it goes; fails unless exactly
/// `blob.size` bytes arrive and their blake3 is `blob.hash`.
pub(crate) async fn receive_blob<R, W, T>(
    r: &mut R,
    dst: &mut W,
    blob: &BlobRef,
    mut progress: impl FnMut(u64),
) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
    T: DeserializeOwned,
{
    use tokio::io::AsyncWriteExt as _;
    let mut hasher = blake3::Hasher::new();
    let mut got = 0u64;
    while got < blob.size {
        match read_frame::<_, T>(r).await? {
            Some(Frame::Data(chunk)) => {
                got += chunk.len() as u64;
                if got > blob.size {
                    return Err(invalid(format!(
                        "blob {} is longer than the {} bytes announced",
                        blob.hex(),
                        blob.size
                    )));
                }
                hasher.update(&chunk);
                dst.write_all(&chunk).await?;
                progress(got);
            }
            Some(Frame::Message(_)) => {
                return Err(invalid(format!(
                    "blob {} ended after {got} of {} bytes",
                    blob.hex(),
                    blob.size
                )))
            }
            None => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the stream ended inside blob {}", blob.hex()),
                ))
            }
        }
    }
    dst.flush().await?;
    if hasher.finalize().as_bytes() != &blob.hash {
        return Err(invalid(format!(
            "blob {} does not match its hash: corrupted in transit",
            blob.hex()
        )));
    }
    Ok(())
}

/// blake3 and length of a file, read in chunks off the async workers.
pub(crate) async fn hash_file(path: &std::path::Path) -> io::Result<BlobRef> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut hasher = blake3::Hasher::new();
        let mut file = std::fs::File::open(&path)?;
        let size = io::copy(&mut file, &mut hasher)?;
        Ok(BlobRef {
            hash: *hasher.finalize().as_bytes(),
            size,
        })
    })
    .await
    .map_err(io::Error::other)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpunode_protocol::job::RequesterMsg;

    #[tokio::test]
    async fn blobs_are_checked_against_their_hash() {
        let data = vec![5u8; 3 * MAX_CHUNK_BYTES + 17];
        let blob = BlobRef {
            hash: *blake3::hash(&data).as_bytes(),
            size: data.len() as u64,
        };
        let mut wire = Vec::new();
        send_blob(&mut wire, &mut &data[..], blob.size, |_| {})
            .await
            .unwrap();
        let mut out = Vec::new();
        receive_blob::<_, _, RequesterMsg>(&mut &wire[..], &mut out, &blob, |_| {})
            .await
            .unwrap();
        assert_eq!(out, data);

        // One flipped byte anywhere is caught.
        let mut bad = wire.clone();
        let n = bad.len();
        bad[n - 3] ^= 1;
        let err = receive_blob::<_, _, RequesterMsg>(&mut &bad[..], &mut Vec::new(), &blob, |_| {})
            .await
            .unwrap_err();
        assert!(err.to_string().contains("corrupted"), "{err}");

        // Truncated: an error, not a hang or a panic.
        let err =
            receive_blob::<_, _, RequesterMsg>(&mut &wire[..n / 2], &mut Vec::new(), &blob, |_| {})
                .await
                .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

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
