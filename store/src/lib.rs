//! The node's embedded store (the only crate that touches sled).
//!
//! Keys are grouped in named trees. Writes that the node acknowledges to anyone are
//! flushed before the call returns. Opening a store that another process holds fails
//! with an error that says so.

use std::path::{Path, PathBuf};

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Another process has the store open.
    #[error("store {path} is in use by another process (is `gpunode serve` already running with this data dir?)")]
    Locked {
        /// The store directory.
        path: PathBuf,
    },
    /// Any other storage failure.
    #[error("store {path}: {message}")]
    Io {
        /// The store directory.
        path: PathBuf,
        /// What failed.
        message: String,
    },
}

/// How long opening waits for a lock that a store closed just before may still hold.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A key and its value.
pub type Entry = (Vec<u8>, Vec<u8>);

/// A handle to the store; cheap to clone.
#[derive(Clone)]
pub struct Store {
    db: sled::Db,
    path: PathBuf,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

impl Store {
    /// Opens (or creates) the store in `path`.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        // A store closed a moment ago may still be locked while sled's background flusher
        // lets go of it: wait for that, briefly, before calling it in use.
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        loop {
            match Store::open_once(path) {
                Err(StoreError::Locked { .. }) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }

    fn open_once(path: &Path) -> Result<Store, StoreError> {
        let db = sled::Config::new()
            .path(path)
            .cache_capacity(16 * 1024 * 1024)
            .open()
            .map_err(|e| match e {
                sled::Error::Io(io) if io.kind() == std::io::ErrorKind::WouldBlock => {
                    StoreError::Locked {
                        path: path.to_path_buf(),
                    }
                }
                sled::Error::Io(io) if io.to_string().contains("lock") => StoreError::Locked {
                    path: path.to_path_buf(),
                },
                other => StoreError::Io {
                    path: path.to_path_buf(),
                    message: other.to_string(),
                },
            })?;
        Ok(Store {
            db,
            path: path.to_path_buf(),
        })
    }

    /// A store that lives in memory only and is gone when dropped (test networks).
    pub fn temporary() -> Result<Store, StoreError> {
        let db = sled::Config::new()
            .temporary(true)
            .cache_capacity(1024 * 1024)
            .open()
            .map_err(|e| StoreError::Io {
                path: PathBuf::from("(temporary)"),
                message: e.to_string(),
            })?;
        Ok(Store {
            db,
            path: PathBuf::from("(temporary)"),
        })
    }

    fn io(&self, e: sled::Error) -> StoreError {
        StoreError::Io {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    /// Reads a value.
    pub fn get(&self, tree: &str, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let t = self.db.open_tree(tree).map_err(|e| self.io(e))?;
        Ok(t.get(key).map_err(|e| self.io(e))?.map(|v| v.to_vec()))
    }

    /// Writes a value and flushes it to disk before returning.
    pub fn put_durable(&self, tree: &str, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        let t = self.db.open_tree(tree).map_err(|e| self.io(e))?;
        t.insert(key, value).map_err(|e| self.io(e))?;
        t.flush().map_err(|e| self.io(e))?;
        Ok(())
    }

    /// Writes a value; durable after the next [`Store::flush`].
    pub fn put(&self, tree: &str, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        let t = self.db.open_tree(tree).map_err(|e| self.io(e))?;
        t.insert(key, value).map_err(|e| self.io(e))?;
        Ok(())
    }

    /// Removes a value; durable after the next [`Store::flush`].
    pub fn remove(&self, tree: &str, key: &[u8]) -> Result<(), StoreError> {
        let t = self.db.open_tree(tree).map_err(|e| self.io(e))?;
        t.remove(key).map_err(|e| self.io(e))?;
        Ok(())
    }

    /// Every key and value of a tree, in key order.
    pub fn scan(&self, tree: &str) -> Result<Vec<Entry>, StoreError> {
        let t = self.db.open_tree(tree).map_err(|e| self.io(e))?;
        t.iter()
            .map(|r| {
                r.map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .map_err(|e| self.io(e))
            })
            .collect()
    }

    /// Atomically increments a big-endian u64 counter, at least to `floor`, flushes,
    /// and returns the new value.
    pub fn next_counter(&self, tree: &str, key: &[u8], floor: u64) -> Result<u64, StoreError> {
        let t = self.db.open_tree(tree).map_err(|e| self.io(e))?;
        let new = t
            .update_and_fetch(key, |old| {
                let prev = old
                    .and_then(|b| <[u8; 8]>::try_from(b).ok())
                    .map(u64::from_be_bytes)
                    .unwrap_or(0);
                Some((prev + 1).max(floor).to_be_bytes().to_vec())
            })
            .map_err(|e| self.io(e))?
            .and_then(|b| <[u8; 8]>::try_from(b.as_ref()).ok())
            .map(u64::from_be_bytes)
            .unwrap_or(floor);
        t.flush().map_err(|e| self.io(e))?;
        Ok(new)
    }

    /// Applies every write and removal in `ops` to `tree` atomically (all or none, also
    /// across a crash), then flushes before returning.
    pub fn apply_durable(
        &self,
        tree: &str,
        ops: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    ) -> Result<(), StoreError> {
        let t = self.db.open_tree(tree).map_err(|e| self.io(e))?;
        let mut batch = sled::Batch::default();
        for (k, v) in ops {
            match v {
                Some(v) => batch.insert(k, v),
                None => batch.remove(k),
            }
        }
        t.apply_batch(batch).map_err(|e| self.io(e))?;
        t.flush().map_err(|e| self.io(e))?;
        Ok(())
    }

    /// Keys and values of `tree` whose key starts with `prefix`, in key order, read
    /// lazily (for trees too large to hold in memory).
    pub fn iter_prefix(
        &self,
        tree: &str,
        prefix: &[u8],
    ) -> Result<impl Iterator<Item = Result<Entry, StoreError>> + use<>, StoreError> {
        self.iter_prefix_from(tree, prefix, prefix)
    }

    /// Like [`Store::iter_prefix`], from the first key at or after `from` (itself under
    /// `prefix`) on.
    pub fn iter_prefix_from(
        &self,
        tree: &str,
        prefix: &[u8],
        from: &[u8],
    ) -> Result<impl Iterator<Item = Result<Entry, StoreError>> + use<>, StoreError> {
        let t = self.db.open_tree(tree).map_err(|e| self.io(e))?;
        let path = self.path.clone();
        let prefix = prefix.to_vec();
        Ok(t.range(from.to_vec()..)
            .take_while(move |r| r.as_ref().map_or(true, |(k, _)| k.starts_with(&prefix)))
            .map(move |r| {
                r.map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .map_err(|e| StoreError::Io {
                        path: path.clone(),
                        message: e.to_string(),
                    })
            }))
    }

    /// The last key and value of `tree` under `prefix`, if any.
    pub fn last_with_prefix(&self, tree: &str, prefix: &[u8]) -> Result<Option<Entry>, StoreError> {
        let t = self.db.open_tree(tree).map_err(|e| self.io(e))?;
        t.scan_prefix(prefix)
            .next_back()
            .transpose()
            .map(|o| o.map(|(k, v)| (k.to_vec(), v.to_vec())))
            .map_err(|e| self.io(e))
    }

    /// Flushes everything to disk.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush().map(|_| ()).map_err(|e| self.io(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_survives_reopen_and_respects_floor() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let s = Store::open(dir.path()).expect("open");
            assert_eq!(s.next_counter("t", b"seq", 0).expect("inc"), 1);
            assert_eq!(s.next_counter("t", b"seq", 0).expect("inc"), 2);
        }
        let s = Store::open(dir.path()).expect("reopen");
        assert_eq!(s.next_counter("t", b"seq", 0).expect("inc"), 3);
        assert_eq!(s.next_counter("t", b"seq", 100).expect("inc"), 100);
    }

    /// Every write acknowledged by `put_durable`, from several threads flushing at once,
    /// is there after the writing process is killed (SIGKILL) mid-stream. (sled is
    /// vendored so that a flush writes on the flushing thread: vendor/README.md.)
    #[test]
    fn acknowledged_writes_survive_a_kill_of_the_writer() {
        const CHILD_DIR: &str = "GPUNODE_STORE_CRASH_DIR";
        if let Ok(dir) = std::env::var(CHILD_DIR) {
            // The writer: four threads write and flush for ever, and print each key
            // once its write is acknowledged.
            let store = Store::open(Path::new(&dir)).expect("child open");
            let threads: Vec<_> = (0..4u8)
                .map(|t| {
                    let store = store.clone();
                    std::thread::spawn(move || {
                        for i in 0u32.. {
                            let key = format!("{t}-{i}");
                            store
                                .put_durable("crash", key.as_bytes(), &[t; 300])
                                .expect("child write");
                            println!("{key}");
                        }
                    })
                })
                .collect();
            for t in threads {
                let _ = t.join();
            }
            return;
        }
        use std::io::BufRead;
        let dir = tempfile::tempdir().expect("tempdir");
        let mut child = std::process::Command::new(std::env::current_exe().expect("exe"))
            .args([
                "--exact",
                "tests::acknowledged_writes_survive_a_kill_of_the_writer",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn the writer");
        // A writer that hangs (a deadlocked flush) fails the test instead of hanging it.
        let pid = child.id();
        let reading = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let watchdog = {
            let reading = reading.clone();
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
                while reading.load(std::sync::atomic::Ordering::SeqCst) {
                    if std::time::Instant::now() > deadline {
                        let _ = std::process::Command::new("kill")
                            .args(["-KILL", &pid.to_string()])
                            .status();
                        return true;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                false
            })
        };
        let mut acked = Vec::new();
        // The pipe stays open until the writer is killed, so it is still writing then.
        let mut lines = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        for line in lines.by_ref() {
            let line = line.expect("line");
            if line.contains('-') && !line.contains(' ') {
                acked.push(line);
            }
            if acked.len() >= 2_000 {
                break;
            }
        }
        child.kill().expect("kill the writer");
        let status = child.wait().expect("wait for the writer");
        drop(lines);
        reading.store(false, std::sync::atomic::Ordering::SeqCst);
        assert!(!watchdog.join().expect("watchdog"), "the writer hung");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "the writer was not killed mid-stream: {status}"
        );
        assert_eq!(acked.len(), 2_000, "the writer stopped early");
        let store = Store::open(dir.path()).expect("reopen after the kill");
        for key in &acked {
            assert!(
                store.get("crash", key.as_bytes()).expect("read").is_some(),
                "acknowledged write {key} lost"
            );
        }
    }

    #[test]
    fn second_open_reports_lock() {
        let dir = tempfile::tempdir().expect("tempdir");
        let _s = Store::open(dir.path()).expect("open");
        // sled's lock is per process file lock; a second open in the same process of the
        // same path may succeed on some platforms, so only check it is not corrupted.
        if let Err(e) = Store::open(dir.path()) {
            assert!(matches!(e, StoreError::Locked { .. }), "{e}");
        }
    }
}
