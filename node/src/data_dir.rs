//! The node's data directory: where the identity key, the store and the control socket
//! live, and how the identity key is created and loaded.
//!
//! The identity key is written once, atomically, with mode 0600. A key file that exists
//! but cannot be read or decoded is an error naming the file: it is never replaced,
//! because replacing it would silently change the node's peer id.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use libp2p::identity::Keypair;

/// Why the data directory or identity could not be used.
#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    /// No home directory to put the default data directory in.
    #[error("cannot find a home directory for the default data dir; pass --data-dir")]
    NoHome,
    /// The directory cannot be created or written.
    #[error("cannot use data directory {path}: {source}")]
    Dir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The key file exists but cannot be read.
    #[error("cannot read identity key {path}: {source}. Fix its permissions; gpunode will not replace it")]
    KeyUnreadable {
        /// The key file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The key file exists but does not hold a valid key.
    #[error("identity key {path} is corrupt ({reason}). gpunode will not replace it: restore it from a backup, or move it away to start with a new identity")]
    KeyCorrupt {
        /// The key file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Where a node running as root keeps jobs' directories (see [`DataDir::job_root`]).
pub const SYSTEM_JOB_ROOT: &str = "/var/lib/gpunode";

/// Paths inside a node's data directory.
#[derive(Debug, Clone)]
pub struct DataDir {
    root: PathBuf,
}

impl DataDir {
    /// Uses `root` as data directory (created on first use).
    pub fn new(root: impl Into<PathBuf>) -> DataDir {
        DataDir { root: root.into() }
    }

    /// The default data directory (`$XDG_DATA_HOME/gpunode`, usually `~/.local/share/gpunode`).
    pub fn default_location() -> Result<DataDir, DataDirError> {
        directories::ProjectDirs::from("", "", "gpunode")
            .map(|d| DataDir::new(d.data_dir()))
            .ok_or(DataDirError::NoHome)
    }

    /// The default config file (`$XDG_CONFIG_HOME/gpunode/config.toml`).
    pub fn default_config_file() -> Option<PathBuf> {
        directories::ProjectDirs::from("", "", "gpunode")
            .map(|d| d.config_dir().join("config.toml"))
    }

    /// The directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The identity key file.
    pub fn identity_file(&self) -> PathBuf {
        self.root.join("identity.key")
    }

    /// The embedded store.
    pub fn store_dir(&self) -> PathBuf {
        self.root.join("store")
    }

    /// Compiled task modules (this node's own artifacts only).
    pub fn module_cache_dir(&self) -> PathBuf {
        self.root.join("cache").join("modules")
    }

    /// Task modules and input files received from peers, by content hash.
    pub fn blob_dir(&self) -> PathBuf {
        self.root.join("cache").join("blobs")
    }

    /// Where jobs' working directories and unpacked container images go.
    ///
    /// A container job runs as a uid of its own when the node runs as root, and that
    /// uid must reach its directories without the operator's home being opened (root's
    /// home, and the default data dir in it, are 0700). So as root they live under
    /// [`SYSTEM_JOB_ROOT`]`/jobs-<id of this data dir>`, a path only root writes and
    /// that others may traverse but not list (0711). Otherwise jobs run as this user,
    /// and the data dir itself serves.
    pub fn job_root(&self) -> PathBuf {
        if gpunode_sandbox::container::procs::effective_uid() != 0 {
            return self.root.clone();
        }
        let absolute = std::path::absolute(&self.root).unwrap_or_else(|_| self.root.clone());
        let id = blake3::hash(absolute.as_os_str().as_encoded_bytes());
        Path::new(SYSTEM_JOB_ROOT).join(format!("jobs-{}", &id.to_hex()[..16]))
    }

    /// Unpacked container images, by archive digest.
    pub fn image_dir(&self) -> PathBuf {
        self.job_root().join("cache").join("images")
    }

    /// Working directories of wasm jobs running here.
    pub fn jobs_dir(&self) -> PathBuf {
        self.root.join("jobs")
    }

    /// Working directories of jobs on a node that runs container jobs (under the job
    /// root, reachable by their uids).
    pub fn container_jobs_dir(&self) -> PathBuf {
        self.job_root().join("jobs")
    }

    /// The control socket of the local API.
    pub fn api_socket(&self) -> PathBuf {
        self.root.join("api.sock")
    }

    /// Creates the directory (mode 0700) if it does not exist.
    pub fn ensure(&self) -> Result<(), DataDirError> {
        let err = |source| DataDirError::Dir {
            path: self.root.clone(),
            source,
        };
        if !self.root.exists() {
            fs::create_dir_all(&self.root).map_err(err)?;
            fs::set_permissions(&self.root, fs::Permissions::from_mode(0o700)).map_err(err)?;
        }
        Ok(())
    }

    /// Loads the identity key, creating it on first start.
    pub fn load_or_create_identity(&self) -> Result<Keypair, DataDirError> {
        self.ensure()?;
        let path = self.identity_file();
        match fs::read(&path) {
            Ok(bytes) => {
                Keypair::from_protobuf_encoding(&bytes).map_err(|e| DataDirError::KeyCorrupt {
                    path: path.clone(),
                    reason: e.to_string(),
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.create_identity(&path),
            Err(source) => Err(DataDirError::KeyUnreadable { path, source }),
        }
    }

    /// Loads the identity key without creating one.
    pub fn load_identity(&self) -> Result<Option<Keypair>, DataDirError> {
        let path = self.identity_file();
        match fs::read(&path) {
            Ok(bytes) => Keypair::from_protobuf_encoding(&bytes)
                .map(Some)
                .map_err(|e| DataDirError::KeyCorrupt {
                    path,
                    reason: e.to_string(),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(DataDirError::KeyUnreadable { path, source }),
        }
    }

    fn create_identity(&self, path: &Path) -> Result<Keypair, DataDirError> {
        let key = Keypair::generate_ed25519();
        let bytes = key
            .to_protobuf_encoding()
            .map_err(|e| DataDirError::KeyCorrupt {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        // A name of this call's own: two processes making the identity at once (`gpunode
        // id` while `serve` starts) must not write into each other's file.
        let tmp = path.with_extension(format!(
            "key.{}.{:016x}.tmp",
            std::process::id(),
            rand::random::<u64>()
        ));
        let err = |source| DataDirError::Dir {
            path: path.to_path_buf(),
            source,
        };
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(err)?;
        file.write_all(&bytes).map_err(err)?;
        file.sync_all().map_err(err)?;
        // Never overwrite a key that appeared meanwhile: another process made one first,
        // and that one is the identity.
        let linked = fs::hard_link(&tmp, path);
        let _ = fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(key),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => self
                .load_identity()?
                .ok_or_else(|| err(std::io::Error::from(std::io::ErrorKind::NotFound))),
            Err(e) => Err(err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_created_once_with_mode_0600_and_reloaded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dd = DataDir::new(dir.path().join("d"));
        let k1 = dd.load_or_create_identity().expect("create");
        let mode = fs::metadata(dd.identity_file())
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let k2 = dd.load_or_create_identity().expect("load");
        assert_eq!(k1.public().to_peer_id(), k2.public().to_peer_id());
    }

    #[test]
    fn processes_making_the_identity_at_once_all_get_the_one_on_disk() {
        // `gpunode id` run while `serve` starts on a new data dir: each caller must end
        // with the key the file holds, or the running node is not who the dir says.
        for _ in 0..20 {
            let dir = tempfile::tempdir().expect("tempdir");
            let dd = DataDir::new(dir.path().join("d"));
            let barrier = std::sync::Barrier::new(8);
            let ids: Vec<_> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..8)
                    .map(|_| {
                        s.spawn(|| {
                            barrier.wait();
                            dd.load_or_create_identity().expect("identity").public()
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("thread"))
                    .collect()
            });
            let on_disk = dd.load_identity().expect("load").expect("made").public();
            assert!(
                ids.iter().all(|k| *k == on_disk),
                "a caller kept a key not on disk"
            );
            let left: Vec<_> = fs::read_dir(dir.path().join("d"))
                .expect("dir")
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
                .collect();
            assert!(left.is_empty(), "temporary key files left: {left:?}");
        }
    }

    #[test]
    fn corrupt_key_is_an_error_naming_the_file_and_is_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dd = DataDir::new(dir.path());
        fs::write(dd.identity_file(), b"not a key").expect("write");
        let err = dd.load_or_create_identity().unwrap_err().to_string();
        assert!(
            err.contains("identity.key") && err.contains("corrupt"),
            "{err}"
        );
        assert_eq!(fs::read(dd.identity_file()).expect("read"), b"not a key");
    }
}
