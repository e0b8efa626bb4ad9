//! Job inputs and outputs on the job stream: a whole blob sent or received as data
//! frames (see [`crate::router::framing`]), with its hash checked on arrival.
//!
//! The disk side of a blob runs on a blocking thread beside the stream: a file is read
//! ahead of the sender, and a received blob is hashed and written behind the receiver,
//! at most [`CHUNKS_IN_FLIGHT`] chunks apart, with the chunk buffers recycled. The
//! async workers only move chunks between the stream and that thread.

use std::io;

use futures::{AsyncRead, AsyncWrite};
use gpunode_protocol::job::{BlobRef, MAX_CHUNK_BYTES};
use serde::de::DeserializeOwned;

use crate::router::framing::{invalid, read_frame_into, write_data, Frame};

/// Chunks the disk thread may run ahead of (sending) or behind (receiving) the stream:
/// enough to keep both busy, and a bound on the memory one transfer holds (4 MiB).
const CHUNKS_IN_FLIGHT: usize = 4;

/// Sends `data`, held in memory, as data frames.
pub(crate) async fn send_bytes<W: AsyncWrite + Unpin>(w: &mut W, data: &[u8]) -> io::Result<()> {
    for chunk in data.chunks(MAX_CHUNK_BYTES) {
        write_data(w, chunk).await?;
    }
    Ok(())
}

/// Sends `size` bytes read from `src` (read ahead on a blocking thread) as data frames;
/// `progress` sees the running total. A source shorter than `size` is an error.
pub(crate) async fn send_blob<W, S>(
    w: &mut W,
    src: S,
    size: u64,
    mut progress: impl FnMut(u64),
) -> io::Result<()>
where
    W: AsyncWrite + Unpin,
    S: io::Read + Send + 'static,
{
    let (full_tx, mut full_rx) = tokio::sync::mpsc::channel::<Vec<u8>>(CHUNKS_IN_FLIGHT);
    let (spare_tx, mut spare_rx) = tokio::sync::mpsc::channel::<Vec<u8>>(CHUNKS_IN_FLIGHT + 2);
    let reader = tokio::task::spawn_blocking(move || -> io::Result<()> {
        let mut src = src;
        let mut left = size;
        while left > 0 {
            let want = left.min(MAX_CHUNK_BYTES as u64) as usize;
            let mut buf = spare_rx.try_recv().unwrap_or_default();
            buf.resize(want, 0);
            src.read_exact(&mut buf)?;
            left -= want as u64;
            if full_tx.blocking_send(buf).is_err() {
                break; // the stream side stopped; it reports why
            }
        }
        Ok(())
    });
    let mut sent = 0u64;
    while sent < size {
        let Some(chunk) = full_rx.recv().await else {
            break;
        };
        write_data(w, &chunk).await?;
        sent += chunk.len() as u64;
        progress(sent);
        let _ = spare_tx.try_send(chunk); // dropped when enough are spare
    }
    drop(full_rx);
    reader.await.map_err(io::Error::other)??;
    if sent < size {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the source ended after {sent} of {size} bytes"),
        ));
    }
    Ok(())
}

/// Receives one blob's data frames into `dst` (hashed and written behind the stream on
/// a blocking thread) and gives `dst` back; fails unless exactly `blob.size` bytes
/// arrive and their blake3 is `blob.hash`. `progress` sees the running total received.
pub(crate) async fn receive_blob<R, D, T>(
    r: &mut R,
    dst: D,
    blob: &BlobRef,
    mut progress: impl FnMut(u64),
) -> io::Result<D>
where
    R: AsyncRead + Unpin,
    D: io::Write + Send + 'static,
    T: DeserializeOwned,
{
    let (full_tx, mut full_rx) = tokio::sync::mpsc::channel::<Vec<u8>>(CHUNKS_IN_FLIGHT);
    let (spare_tx, mut spare_rx) = tokio::sync::mpsc::channel::<Vec<u8>>(CHUNKS_IN_FLIGHT + 2);
    let writer = tokio::task::spawn_blocking(move || -> io::Result<(D, blake3::Hash)> {
        // Whole chunks go straight through; a peer sending tiny frames gets them
        // gathered into one write per MiB, not one system call each.
        use io::Write as _;
        let mut dst = io::BufWriter::with_capacity(MAX_CHUNK_BYTES, dst);
        let mut hasher = blake3::Hasher::new();
        while let Some(chunk) = full_rx.blocking_recv() {
            hasher.update(&chunk);
            dst.write_all(&chunk)?;
            let _ = spare_tx.try_send(chunk); // dropped when enough are spare
        }
        let dst = dst.into_inner().map_err(io::IntoInnerError::into_error)?;
        Ok((dst, hasher.finalize()))
    });
    let received = async {
        let mut got = 0u64;
        while got < blob.size {
            let buf = spare_rx.try_recv().unwrap_or_default();
            match read_frame_into::<_, T>(r, buf).await? {
                Some(Frame::Data(chunk)) => {
                    got += chunk.len() as u64;
                    if got > blob.size {
                        return Err(invalid(format!(
                            "blob {} is longer than the {} bytes announced",
                            blob.hex(),
                            blob.size
                        )));
                    }
                    if full_tx.send(chunk).await.is_err() {
                        break; // the writer stopped; its error says why
                    }
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
        Ok(())
    }
    .await;
    drop(full_tx);
    let written = writer.await.map_err(io::Error::other)?;
    let (dst, hash) = match (received, written) {
        (_, Err(e)) | (Err(e), _) => return Err(e),
        (Ok(()), Ok(w)) => w,
    };
    if hash.as_bytes() != &blob.hash {
        return Err(invalid(format!(
            "blob {} does not match its hash: corrupted in transit",
            blob.hex()
        )));
    }
    Ok(dst)
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
        send_blob(&mut wire, io::Cursor::new(data.clone()), blob.size, |_| {})
            .await
            .unwrap();
        let mut from_memory = Vec::new();
        send_bytes(&mut from_memory, &data).await.unwrap();
        assert_eq!(wire, from_memory);
        let out = receive_blob::<_, _, RequesterMsg>(&mut &wire[..], Vec::new(), &blob, |_| {})
            .await
            .unwrap();
        assert_eq!(out, data);

        // One flipped byte anywhere is caught.
        let mut bad = wire.clone();
        let n = bad.len();
        bad[n - 3] ^= 1;
        let err = receive_blob::<_, _, RequesterMsg>(&mut &bad[..], Vec::new(), &blob, |_| {})
            .await
            .unwrap_err();
        assert!(err.to_string().contains("corrupted"), "{err}");

        // Truncated: an error, not a hang or a panic.
        let err =
            receive_blob::<_, _, RequesterMsg>(&mut &wire[..n / 2], Vec::new(), &blob, |_| {})
                .await
                .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);

        // Longer than announced: refused as it arrives.
        let mut long = wire.clone();
        long.extend_from_slice(&wire[..wire.len().min(MAX_CHUNK_BYTES + 5)]);
        let short = BlobRef {
            size: blob.size - 1,
            ..blob
        };
        let err = receive_blob::<_, _, RequesterMsg>(&mut &long[..], Vec::new(), &short, |_| {})
            .await
            .unwrap_err();
        assert!(err.to_string().contains("longer"), "{err}");
    }

    #[tokio::test]
    async fn tiny_frames_from_a_peer_are_gathered_into_few_writes() {
        /// Counts the writes that reach the "disk".
        #[derive(Default)]
        struct Counting {
            writes: usize,
            bytes: Vec<u8>,
        }
        impl io::Write for Counting {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.writes += 1;
                self.bytes.extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let data: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let mut wire = Vec::new();
        for byte in &data {
            write_data(&mut wire, std::slice::from_ref(byte))
                .await
                .unwrap();
        }
        let blob = BlobRef {
            hash: *blake3::hash(&data).as_bytes(),
            size: data.len() as u64,
        };
        let out =
            receive_blob::<_, _, RequesterMsg>(&mut &wire[..], Counting::default(), &blob, |_| {})
                .await
                .unwrap();
        assert_eq!(out.bytes, data);
        assert_eq!(out.writes, 1, "5000 one-byte frames, one write");
    }

    #[tokio::test]
    async fn a_source_shorter_than_announced_or_a_failing_disk_is_an_error() {
        let data = vec![1u8; MAX_CHUNK_BYTES + 10];
        let err = send_blob(
            &mut Vec::new(),
            io::Cursor::new(data.clone()),
            3 * MAX_CHUNK_BYTES as u64,
            |_| {},
        )
        .await
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);

        /// A disk that fills after `room` bytes.
        struct Full {
            room: usize,
        }
        impl io::Write for Full {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                if self.room < b.len() {
                    return Err(io::Error::new(io::ErrorKind::StorageFull, "disk full"));
                }
                self.room -= b.len();
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let blob = BlobRef {
            hash: *blake3::hash(&data).as_bytes(),
            size: data.len() as u64,
        };
        let mut wire = Vec::new();
        send_bytes(&mut wire, &data).await.unwrap();
        let err =
            receive_blob::<_, _, RequesterMsg>(&mut &wire[..], Full { room: 100 }, &blob, |_| {})
                .await
                .err()
                .expect("a full disk is an error");
        assert_eq!(err.kind(), io::ErrorKind::StorageFull);
    }
}
