//! Compiled modules cached by content hash: in memory for the fastest second start, and
//! on disk so a restart skips compilation too. Only files this node wrote into its own
//! cache directory are ever deserialized.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use wasmtime::{Engine, Module};

/// Where a module came from, for tests and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSource {
    /// Compiled now.
    Compiled,
    /// Loaded from this node's disk cache.
    Disk,
    /// Already in memory.
    Memory,
}

pub(crate) struct ModuleCache {
    dir: PathBuf,
    memory: Mutex<HashMap<String, Module>>,
    max_on_disk: usize,
}

const MAX_IN_MEMORY: usize = 64;
/// Most compiled modules kept on disk; the least recently written go first (peers send
/// modules, so the directory must not grow with them).
const MAX_ON_DISK: usize = 256;
/// Largest compiled module a waiting worker loads ahead of its task (each ready worker
/// holds its own copy).
const MAX_PRELOAD_BYTES: u64 = 32 << 20;

impl ModuleCache {
    pub(crate) fn new(dir: &Path) -> std::io::Result<ModuleCache> {
        std::fs::create_dir_all(dir)?;
        Ok(ModuleCache {
            dir: dir.to_path_buf(),
            memory: Mutex::new(HashMap::new()),
            max_on_disk: MAX_ON_DISK,
        })
    }

    /// Removes the oldest compiled modules beyond the disk limit.
    fn prune_disk(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut files: Vec<(std::time::SystemTime, PathBuf)> = entries
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "cwasm"))
            .map(|e| {
                let at = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                (at, e.path())
            })
            .collect();
        if files.len() <= self.max_on_disk {
            return;
        }
        files.sort();
        let excess = files.len() - self.max_on_disk;
        for (_, path) in files.into_iter().take(excess) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Whether the module under `key` is in memory (it was checked when remembered).
    pub(crate) fn in_memory(&self, key: &str) -> bool {
        self.memory
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(key)
    }

    /// Returns the module for `key`, compiling `bytes` with `engine` if needed (kept on
    /// disk; in memory only once [`ModuleCache::remember`]ed).
    pub(crate) fn get_or_compile(
        &self,
        engine: &Engine,
        key: &str,
        bytes: &[u8],
    ) -> wasmtime::Result<(Module, CacheSource)> {
        if let Some(m) = self
            .memory
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
        {
            return Ok((m.clone(), CacheSource::Memory));
        }
        let path = self.dir.join(format!("{key}.cwasm"));
        let mut source = CacheSource::Compiled;
        let module = match path
            .exists()
            .then(|| load(engine, &path))
            .and_then(Result::ok)
        {
            Some(m) => {
                source = CacheSource::Disk;
                m
            }
            None => {
                let m = Module::new(engine, bytes)?;
                if let Ok(serialized) = m.serialize() {
                    let tmp = path.with_extension("tmp");
                    if std::fs::write(&tmp, serialized).is_ok() {
                        let _ = std::fs::rename(&tmp, &path);
                        self.prune_disk();
                    }
                }
                m
            }
        };
        Ok((module, source))
    }

    /// Keeps `module` in memory under `key` (the caller checked it can run).
    /// Loads the compiled module stored under `key` into memory ahead of its task (a
    /// worker waiting for work, told which module its parent ran last), so that the
    /// task's load is a memory hit. False when there is no such file, the key is not one
    /// this cache makes, or the file is over [`MAX_PRELOAD_BYTES`].
    pub(crate) fn preload(&self, engine: &Engine, key: &str) -> bool {
        let well_formed = !key.is_empty()
            && key.len() <= 128
            && key
                .bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b'-');
        if !well_formed {
            return false;
        }
        let path = self.dir.join(format!("{key}.cwasm"));
        let small = std::fs::metadata(&path).is_ok_and(|m| m.len() <= MAX_PRELOAD_BYTES);
        match small.then(|| load(engine, &path)) {
            Some(Ok(module)) => {
                self.remember(key, &module);
                true
            }
            _ => false,
        }
    }

    pub(crate) fn remember(&self, key: &str, module: &Module) {
        let mut mem = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        if mem.len() >= MAX_IN_MEMORY {
            mem.clear();
        }
        mem.insert(key.to_string(), module.clone());
    }
}

#[allow(unsafe_code)]
fn load(engine: &Engine, path: &Path) -> wasmtime::Result<Module> {
    // SAFETY: `path` is inside this node's own cache directory and was written by
    // `Module::serialize` of this same engine configuration (the file name is the hash of
    // the source plus the engine flavour); wasmtime additionally checks the engine and
    // version header and refuses mismatched artifacts. Nothing received from a peer is
    // ever deserialized here.
    unsafe { Module::deserialize_file(engine, path) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_module_loaded_ahead_is_a_memory_hit_and_only_cache_keys_are_loaded() {
        let dir = tempfile::tempdir().expect("tmp");
        let engine = Engine::default();
        let wat = b"(module (func (export \"f\")))";
        ModuleCache::new(dir.path())
            .expect("cache")
            .get_or_compile(&engine, "abc123-plain-free", wat)
            .expect("compile");
        // A new process's cache: the module is on disk only.
        let fresh = ModuleCache::new(dir.path()).expect("cache");
        assert!(fresh.preload(&engine, "abc123-plain-free"));
        let (_, source) = fresh
            .get_or_compile(&engine, "abc123-plain-free", wat)
            .expect("load");
        assert_eq!(source, CacheSource::Memory);
        // Nothing outside the cache's own names is opened.
        std::fs::write(dir.path().join("x.cwasm"), b"junk").expect("write");
        for key in [
            "",
            "../x",
            "X",
            "abc/..",
            "abc123-plain-free\n",
            "absent-plain-free",
        ] {
            assert!(!fresh.preload(&engine, key), "{key:?}");
        }
        // A damaged file is refused, not loaded.
        assert!(!fresh.preload(&engine, "x"));
    }

    #[test]
    fn the_disk_cache_keeps_a_bounded_number_of_modules() {
        let dir = tempfile::tempdir().expect("tmp");
        let mut cache = ModuleCache::new(dir.path()).expect("cache");
        let engine = Engine::default();
        let compile = |cache: &ModuleCache, i: u32| {
            let wat = format!("(module (func (export \"f{i}\")))");
            cache
                .get_or_compile(&engine, &format!("m{i}"), wat.as_bytes())
                .expect("compile");
        };
        for i in 0..5 {
            compile(&cache, i);
        }
        // Written i hours ago, newest last.
        let now = std::time::SystemTime::now();
        for i in 0..5u64 {
            std::fs::File::options()
                .write(true)
                .open(dir.path().join(format!("m{i}.cwasm")))
                .expect("open")
                .set_modified(now - std::time::Duration::from_secs((5 - i) * 3600))
                .expect("set time");
        }
        // Past the limit, the next module written pushes the oldest out.
        cache.max_on_disk = 2;
        compile(&cache, 5);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .expect("dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, vec!["m4.cwasm", "m5.cwasm"]);
    }
}
