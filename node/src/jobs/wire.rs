//! Job inputs and outputs on the job stream: a whole blob sent or received as data
//! frames (see [`crate::router::framing`]), with its hash checked on arrival.
//!
//! The disk side of a blob runs on a blocking thread beside the stream: a file is read
//! ahead of the sender, and a received blob is hashed and written behind the receiver,
//! at most [`CHUNKS_IN_FLIGHT`] chunks apart, with the chunk buffers recycled. The
//! async workers only move chunks between the stream and that thread. A small blob (at
//! most [`SMALL_BLOB_BYTES`]) is received whole, checked, then written, without that
//! thread: handing it over would cost more than the disk work.

use std::io;

use futures::{AsyncRead, AsyncWrite};
use gpunode_protocol::job::{BlobRef, MAX_CHUNK_BYTES};
use serde::de::DeserializeOwned;

use crate::router::framing::{invalid, read_frame_into, write_data, Frame};

/// Chunks the disk thread may run ahead of (sending) or behind (receiving) the stream:
/// enough to keep both busy, and a bound on the memory one transfer holds (4 MiB).
const CHUNKS_IN_FLIGHT: usize = 4;

/// Blobs up to this size move in one piece (held in memory), without a disk thread.
pub(crate) const SMALL_BLOB_BYTES: u64 = 64 << 10;

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
    if blob.size <= SMALL_BLOB_BYTES {
        return receive_small_blob::<_, _, T>(r, dst, blob, progress).await;
    }
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
                        return Err(longer_than_announced(blob));
                    }
                    if full_tx.send(chunk).await.is_err() {
                        break; // the writer stopped; its error says why
                    }
                    progress(got);
                }
                Some(Frame::Message(_)) => return Err(message_inside(blob, got)),
                None => return Err(stream_ended_inside(blob)),
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

/// A small blob (`blob.size` at most [`SMALL_BLOB_BYTES`]): its frames gathered in
/// memory, checked against the hash, then written to `dst` in one piece.
async fn receive_small_blob<R, D, T>(
    r: &mut R,
    mut dst: D,
    blob: &BlobRef,
    mut progress: impl FnMut(u64),
) -> io::Result<D>
where
    R: AsyncRead + Unpin,
    D: io::Write,
    T: DeserializeOwned,
{
    let mut data = Vec::with_capacity(blob.size as usize);
    while (data.len() as u64) < blob.size {
        let got = data.len() as u64;
        match read_frame_into::<_, T>(r, Vec::new()).await? {
            Some(Frame::Data(chunk)) => {
                if got + chunk.len() as u64 > blob.size {
                    return Err(longer_than_announced(blob));
                }
                data.extend_from_slice(&chunk);
                progress(data.len() as u64);
            }
            Some(Frame::Message(_)) => return Err(message_inside(blob, got)),
            None => return Err(stream_ended_inside(blob)),
        }
    }
    if blake3::hash(&data).as_bytes() != &blob.hash {
        return Err(invalid(format!(
            "blob {} does not match its hash: corrupted in transit",
            blob.hex()
        )));
    }
    dst.write_all(&data)?;
    Ok(dst)
}

fn longer_than_announced(blob: &BlobRef) -> io::Error {
    invalid(format!(
        "blob {} is longer than the {} bytes announced",
        blob.hex(),
        blob.size
    ))
}

fn message_inside(blob: &BlobRef, got: u64) -> io::Error {
    invalid(format!(
        "blob {} ended after {got} of {} bytes",
        blob.hex(),
        blob.size
    ))
}

fn stream_ended_inside(blob: &BlobRef) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("the stream ended inside blob {}", blob.hex()),
    )
}

/// blake3 and length of a file, read in chunks off the async workers.
pub(crate) async fn hash_file(path: &std::path::Path) -> io::Result<BlobRef> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || Ok(hash_file_here(&path, 0)?.0))
        .await
        .map_err(io::Error::other)?
}

/// blake3 and length of a file, read on this thread, with its bytes when it has at
/// most `keep` of them (`0`: never).
pub(crate) fn hash_file_here(
    path: &std::path::Path,
    keep: u64,
) -> io::Result<(BlobRef, Option<Vec<u8>>)> {
    use io::{Read as _, Seek as _};
    let mut file = std::fs::File::open(path)?;
    if keep > 0 && file.metadata()?.len() <= keep {
        // (A file that grew since is hashed as a large one.)
        let mut bytes = Vec::new();
        (&mut file).take(keep + 1).read_to_end(&mut bytes)?;
        if bytes.len() as u64 <= keep {
            let blob = BlobRef {
                hash: *blake3::hash(&bytes).as_bytes(),
                size: bytes.len() as u64,
            };
            return Ok((blob, Some(bytes)));
        }
        file.rewind()?;
    }
    let mut hasher = blake3::Hasher::new();
    let size = io::copy(&mut file, &mut hasher)?;
    let blob = BlobRef {
        hash: *hasher.finalize().as_bytes(),
        size,
    };
    Ok((blob, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpunode_protocol::job::RequesterMsg;

    /// The reference to `data`: its blake3 and length.
    fn blob_of(data: &[u8]) -> BlobRef {
        BlobRef {
            hash: *blake3::hash(data).as_bytes(),
            size: data.len() as u64,
        }
    }

    /// Receives `data`, sent whole, then with one byte flipped, cut short, longer than
    /// announced, and broken by a message: only the first is accepted.
    async fn receive_and_attack(data: &[u8]) {
        let blob = blob_of(data);
        let receive = |wire: Vec<u8>, blob: BlobRef| async move {
            receive_blob::<_, _, RequesterMsg>(&mut &wire[..], Vec::new(), &blob, |_| {}).await
        };
        let mut wire = Vec::new();
        send_blob(&mut wire, io::Cursor::new(data.to_vec()), blob.size, |_| {})
            .await
            .unwrap();
        let mut from_memory = Vec::new();
        send_bytes(&mut from_memory, data).await.unwrap();
        assert_eq!(wire, from_memory);
        assert_eq!(receive(wire.clone(), blob).await.unwrap(), data);

        // One flipped byte anywhere is caught.
        let mut bad = wire.clone();
        let n = bad.len();
        bad[n - 1] ^= 1;
        let err = receive(bad, blob).await.unwrap_err();
        assert!(err.to_string().contains("corrupted"), "{err}");

        // Truncated: an error, not a hang or a panic.
        let err = receive(wire[..n / 2].to_vec(), blob).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);

        // Longer than announced: refused as it arrives.
        let mut long = wire.clone();
        long.extend_from_slice(&wire[..wire.len().min(MAX_CHUNK_BYTES + 5)]);
        let short = BlobRef {
            size: blob.size - 1,
            ..blob
        };
        let err = receive(long, short).await.unwrap_err();
        assert!(err.to_string().contains("longer"), "{err}");

        // A message where data should be.
        let mut broken = Vec::new();
        send_bytes(&mut broken, &data[..data.len() / 2])
            .await
            .unwrap();
        crate::router::framing::write_message(&mut broken, &RequesterMsg::Cancel)
            .await
            .unwrap();
        let err = receive(broken, blob).await.unwrap_err();
        assert!(err.to_string().contains("ended after"), "{err}");
    }

    #[tokio::test]
    async fn blobs_are_checked_against_their_hash() {
        // Through the disk thread (several chunks), and whole (small ones, up to the
        // largest that is): the same blobs pass and the same attacks fail.
        for size in [3 * MAX_CHUNK_BYTES + 17, SMALL_BLOB_BYTES as usize + 1] {
            receive_and_attack(&vec![5u8; size]).await;
        }
        for size in [SMALL_BLOB_BYTES as usize, 1000, 2] {
            receive_and_attack(&vec![7u8; size]).await;
        }
        // An empty blob, and one that claims to be empty but is not.
        let empty = blob_of(b"");
        let out = receive_blob::<_, _, RequesterMsg>(&mut &[][..], Vec::new(), &empty, |_| {})
            .await
            .unwrap();
        assert!(out.is_empty());
        let lying = BlobRef {
            hash: *blake3::hash(b"x").as_bytes(),
            size: 0,
        };
        let err = receive_blob::<_, _, RequesterMsg>(&mut &[][..], Vec::new(), &lying, |_| {})
            .await
            .unwrap_err();
        assert!(err.to_string().contains("corrupted"), "{err}");
    }

    /// A small blob that does not match its hash never reaches the disk.
    #[tokio::test]
    async fn a_corrupt_small_blob_is_not_written() {
        let data = vec![9u8; 3000];
        let blob = blob_of(&data);
        let mut wire = Vec::new();
        send_bytes(&mut wire, &data).await.unwrap();
        wire[100] ^= 1;
        /// A disk whose writes are seen after the receiver has dropped it.
        #[derive(Clone, Default)]
        struct Seen(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl io::Write for Seen {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let disk = Seen::default();
        let err = receive_blob::<_, _, RequesterMsg>(&mut &wire[..], disk.clone(), &blob, |_| {})
            .await
            .err()
            .expect("corrupt");
        assert!(err.to_string().contains("corrupted"), "{err}");
        assert!(disk.0.lock().unwrap().is_empty(), "nothing written");
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
        // Larger than a small blob: the frames go through the disk thread.
        let data: Vec<u8> = (0..SMALL_BLOB_BYTES as u32 + 5000)
            .map(|i| i as u8)
            .collect();
        let mut wire = Vec::new();
        for byte in &data {
            write_data(&mut wire, std::slice::from_ref(byte))
                .await
                .unwrap();
        }
        let blob = blob_of(&data);
        let out =
            receive_blob::<_, _, RequesterMsg>(&mut &wire[..], Counting::default(), &blob, |_| {})
                .await
                .unwrap();
        assert_eq!(out.bytes, data);
        assert_eq!(out.writes, 1, "70,536 one-byte frames, one write");
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
        // Through the disk thread, and a small blob written in one piece.
        for sent in [&data[..], &data[..1000]] {
            let blob = blob_of(sent);
            let mut wire = Vec::new();
            send_bytes(&mut wire, sent).await.unwrap();
            let full = Full { room: 100 };
            let err = receive_blob::<_, _, RequesterMsg>(&mut &wire[..], full, &blob, |_| {})
                .await
                .err()
                .expect("a full disk is an error");
            assert_eq!(err.kind(), io::ErrorKind::StorageFull);
        }
    }
}
