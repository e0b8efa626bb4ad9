//! Job inputs and outputs on the job stream: a whole blob sent or received as data
//! frames (see [`crate::router::framing`]), with its hash checked on arrival.

use std::io;

use futures::{AsyncRead, AsyncWrite};
use gpunode_protocol::job::{BlobRef, MAX_CHUNK_BYTES};
use serde::de::DeserializeOwned;

use crate::router::framing::{invalid, read_frame, write_data, Frame};

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
}
