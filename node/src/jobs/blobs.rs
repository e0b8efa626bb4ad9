//! The provider's blob cache: task modules and input files by blake3 hash on disk,
//! bounded in size (least recently used go first), so the same module or input is sent
//! over the network once. Blobs in use by a job are pinned and never evicted.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use gpunode_protocol::job::{BlobHash, BlobRef};

struct Entry {
    size: u64,
    last_used: u64,
    pins: u32,
}

struct Index {
    entries: HashMap<BlobHash, Entry>,
    total: u64,
    clock: u64,
    /// Bytes promised to uploads in progress (see [`BlobCache::pin_and_reserve`]).
    reserved: u64,
}

/// Content-addressed files under one directory.
pub struct BlobCache {
    dir: PathBuf,
    max_bytes: u64,
    index: Mutex<Index>,
}

fn hex(hash: &BlobHash) -> String {
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex(name: &str) -> Option<BlobHash> {
    if name.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(name.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl BlobCache {
    /// Opens (or creates) the cache in `dir`, keeping at most `max_bytes`. Leftover
    /// partial downloads are removed.
    pub fn open(dir: &Path, max_bytes: u64) -> io::Result<BlobCache> {
        std::fs::create_dir_all(dir)?;
        let mut index = Index {
            entries: HashMap::new(),
            total: 0,
            clock: 0,
            reserved: 0,
        };
        for entry in std::fs::read_dir(dir)?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            match parse_hex(&name) {
                Some(hash) => {
                    let size = entry.metadata()?.len();
                    index.total += size;
                    index.entries.insert(
                        hash,
                        Entry {
                            size,
                            last_used: 0,
                            pins: 0,
                        },
                    );
                }
                None => {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        Ok(BlobCache {
            dir: dir.to_path_buf(),
            max_bytes,
            index: Mutex::new(index),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where a cached blob lives.
    pub fn path(&self, hash: &BlobHash) -> PathBuf {
        self.dir.join(hex(hash))
    }

    /// Largest blob total a job may bring.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Pins every blob of `wanted` that is cached and returns those that are not. The
    /// caller unpins all of `wanted` with [`BlobCache::unpin`] when done.
    pub fn pin_and_find_missing(&self, wanted: &[BlobRef]) -> Vec<BlobRef> {
        let mut idx = self.lock();
        idx.clock += 1;
        let now = idx.clock;
        let mut missing = Vec::new();
        for blob in wanted {
            match idx.entries.get_mut(&blob.hash) {
                Some(e) if e.size == blob.size => {
                    e.pins += 1;
                    e.last_used = now;
                }
                _ => {
                    if !missing.contains(blob) {
                        missing.push(*blob);
                    }
                }
            }
        }
        missing
    }

    /// Like [`BlobCache::pin_and_find_missing`], and also reserves room for the missing
    /// blobs: uploads in progress and pinned blobs together never exceed the cache's
    /// bound (unpinned blobs are evicted to make room as uploads land). When they would,
    /// nothing is pinned or reserved and the error is the room there is now. Release
    /// the reservation with [`BlobCache::release`] when the exchange ends.
    pub fn pin_and_reserve(&self, wanted: &[BlobRef]) -> Result<Vec<BlobRef>, u64> {
        {
            let idx = self.lock();
            let mut seen = Vec::new();
            let missing: u64 = wanted
                .iter()
                .filter(|b| {
                    let cached = idx.entries.get(&b.hash).is_some_and(|e| e.size == b.size);
                    let first = !seen.contains(*b);
                    seen.push(**b);
                    !cached && first
                })
                .map(|b| b.size)
                .fold(0u64, u64::saturating_add);
            let pinned: u64 = idx
                .entries
                .values()
                .filter(|e| e.pins > 0)
                .map(|e| e.size)
                .sum();
            let room = self
                .max_bytes
                .saturating_sub(pinned)
                .saturating_sub(idx.reserved);
            if missing > room {
                return Err(room);
            }
        }
        let missing = self.pin_and_find_missing(wanted);
        let bytes = missing
            .iter()
            .map(|b| b.size)
            .fold(0u64, u64::saturating_add);
        self.lock().reserved += bytes;
        Ok(missing)
    }

    /// Gives back room reserved by [`BlobCache::pin_and_reserve`].
    pub fn release(&self, bytes: u64) {
        let mut idx = self.lock();
        idx.reserved = idx.reserved.saturating_sub(bytes);
    }

    /// A fresh temporary file to receive a blob into.
    pub fn temp_path(&self) -> PathBuf {
        self.dir
            .join(format!("partial-{:016x}", rand::random::<u64>()))
    }

    /// Moves a verified download into the cache (pinned), then evicts unpinned blobs,
    /// oldest first, until the cache fits its bound again.
    pub fn commit(&self, temp: &Path, blob: &BlobRef) -> io::Result<()> {
        std::fs::rename(temp, self.path(&blob.hash))?;
        let mut idx = self.lock();
        idx.clock += 1;
        let now = idx.clock;
        if let Some(e) = idx.entries.get_mut(&blob.hash) {
            e.pins += 1;
            e.last_used = now;
        } else {
            idx.total += blob.size;
            idx.entries.insert(
                blob.hash,
                Entry {
                    size: blob.size,
                    last_used: now,
                    pins: 1,
                },
            );
        }
        while idx.total > self.max_bytes {
            let victim = idx
                .entries
                .iter()
                .filter(|(_, e)| e.pins == 0)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(h, _)| *h);
            let Some(h) = victim else { break };
            if let Some(e) = idx.entries.remove(&h) {
                idx.total -= e.size;
                let _ = std::fs::remove_file(self.path(&h));
            }
        }
        Ok(())
    }

    /// Releases pins taken by [`BlobCache::pin_and_find_missing`] or [`BlobCache::commit`].
    pub fn unpin(&self, blobs: &[BlobRef]) {
        let mut idx = self.lock();
        for b in blobs {
            if let Some(e) = idx.entries.get_mut(&b.hash) {
                e.pins = e.pins.saturating_sub(1);
            }
        }
    }

    /// Bytes held.
    pub fn total_bytes(&self) -> u64 {
        self.lock().total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(cache: &BlobCache, data: &[u8]) -> BlobRef {
        let blob = BlobRef {
            hash: *blake3::hash(data).as_bytes(),
            size: data.len() as u64,
        };
        let tmp = cache.temp_path();
        std::fs::write(&tmp, data).unwrap();
        cache.commit(&tmp, &blob).unwrap();
        blob
    }

    #[test]
    fn cached_blobs_are_found_and_the_bound_evicts_oldest_unpinned() {
        let dir = tempfile::tempdir().unwrap();
        let cache = BlobCache::open(dir.path(), 250).unwrap();
        let a = put(&cache, &[1; 100]);
        let b = put(&cache, &[2; 100]);
        assert!(cache.pin_and_find_missing(&[a, b]).is_empty());
        cache.unpin(&[a, b]);
        cache.unpin(&[a, b]); // commit's pins
                              // `a` is used again, so `b` is the oldest when `c` needs room.
        assert!(cache.pin_and_find_missing(&[a]).is_empty());
        cache.unpin(&[a]);
        let c = put(&cache, &[3; 100]);
        cache.unpin(&[c]);
        assert_eq!(cache.pin_and_find_missing(&[b]), vec![b]);
        assert!(cache.pin_and_find_missing(&[a, c]).is_empty());
        assert!(cache.total_bytes() <= 250);

        // Pinned blobs survive even when the cache is over its bound.
        let d = put(&cache, &[4; 100]);
        assert!(cache.path(&a.hash).exists() && cache.path(&c.hash).exists());
        assert!(cache.path(&d.hash).exists());

        // Room is reserved for uploads: pinned blobs and uploads in progress never
        // exceed the bound together.
        cache.unpin(&[a, c, d]);
        cache.unpin(&[a, c, d]);
        cache.unpin(&[d]);
        let big = BlobRef {
            hash: [9; 32],
            size: 200,
        };
        let missing = cache.pin_and_reserve(&[a, big]).expect("room for 200");
        assert_eq!(missing, vec![big]);
        let other = BlobRef {
            hash: [8; 32],
            size: 100,
        };
        assert_eq!(
            cache.pin_and_reserve(&[other]),
            Err(0),
            "a is pinned, 200 reserved"
        );
        cache.unpin(&[a, big]);
        cache.release(200);
        assert_eq!(cache.pin_and_reserve(&[other]), Ok(vec![other]));
        cache.release(100);
        cache.unpin(&[other]);

        // A reopened cache knows what is on disk and drops partial files.
        std::fs::write(cache.temp_path(), b"half").unwrap();
        let again = BlobCache::open(dir.path(), 1000).unwrap();
        assert!(again.pin_and_find_missing(&[a, c, d]).is_empty());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
    }
}
