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
}

const MAX_IN_MEMORY: usize = 64;

impl ModuleCache {
    pub(crate) fn new(dir: &Path) -> std::io::Result<ModuleCache> {
        std::fs::create_dir_all(dir)?;
        Ok(ModuleCache {
            dir: dir.to_path_buf(),
            memory: Mutex::new(HashMap::new()),
        })
    }

    /// Returns the module for `key`, compiling `bytes` with `engine` if needed.
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
                    }
                }
                m
            }
        };
        let mut mem = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        if mem.len() >= MAX_IN_MEMORY {
            mem.clear();
        }
        mem.insert(key.to_string(), module.clone());
        Ok((module, source))
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
