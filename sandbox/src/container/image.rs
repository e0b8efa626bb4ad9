//! Container image archives: this module owns turning a `docker save` or OCI image
//! layout archive (plain tar or gzip) into a root filesystem directory, and the
//! on-disk cache of unpacked images, one directory per archive digest.
//!
//! Layers are applied by hand with overlay semantics (whiteouts and opaque
//! directories). Nothing is ever written outside the destination: entries with `..`,
//! entries below a symlink and hard links that leave the root are refused.
//!
//! `cache` keeps unpacked images, `archive` reads an archive's manifest and blobs, and
//! `layers` applies each layer's tar.

mod archive;
mod cache;
mod layers;
#[cfg(test)]
mod tests;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

pub use archive::unpack_archive;
pub use cache::{ImageCache, IMAGE_IDLE_BEFORE_EVICTION, MAX_CACHED_IMAGES};
pub use layers::MAX_IMAGE_ENTRIES;

/// Directories every job's root needs as mount points.
pub const MOUNT_POINTS: &[&str] = &["input", "output", "tmp", "dev", "proc", "run"];

/// Why an image archive could not be used. Messages say what is wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The file is not a container image archive that this node understands.
    #[error("not a container image archive: {0}")]
    NotAnImage(String),
    /// A layer could not be read or applied.
    #[error("image layer {layer} could not be applied: {reason}")]
    Layer {
        /// Which layer (position and name or digest).
        layer: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A blob's content does not match the digest that names it.
    #[error("{what} does not match its digest {digest}; the archive is damaged or was altered, save the image again")]
    Corrupt {
        /// Which blob (e.g. "layer 2").
        what: String,
        /// The expected digest.
        digest: String,
    },
    /// The image would write outside its directory or through a symlink; it was refused.
    #[error("the image was refused because it is unsafe to unpack: {0}")]
    Unsafe(String),
    /// Every cached image was used recently; no room for another now.
    #[error("this provider holds {0} unpacked images, all in recent use; try again later")]
    CacheFull(usize),
    /// The archive holds more entries than an image may.
    #[error("the image has more than {MAX_IMAGE_ENTRIES} archive entries; it was refused")]
    TooManyEntries,
    /// The unpacked files would exceed the configured size cap.
    #[error("the image unpacks to more than {limit} bytes of files; raise the unpack limit or use a smaller image")]
    TooLarge {
        /// The cap in bytes.
        limit: u64,
    },
    /// The digest given to the cache cannot name a directory.
    #[error("image digest {0:?} is not usable: it must be 1 to 128 ASCII letters or digits (e.g. a blake3 hex digest)")]
    BadDigest(String),
    /// A file system operation failed.
    #[error("I/O error while {what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        source: io::Error,
    },
}

/// What the image says about how to run it (from its config JSON); empty fields when absent.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ImageConfig {
    /// Environment, as `K=V` strings.
    pub env: Vec<String>,
    /// The entrypoint argv.
    pub entrypoint: Vec<String>,
    /// The default command argv (appended to the entrypoint).
    pub cmd: Vec<String>,
    /// The working directory inside the container.
    pub working_dir: String,
}

/// A fresh directory `<parent>/<prefix>-<pid>-<n>`, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn create(parent: &Path, prefix: &str) -> Result<TempDir, ImageError> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        loop {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = parent.join(format!("{prefix}-{}-{n}", std::process::id()));
            match fs::create_dir(&path) {
                Ok(()) => return Ok(TempDir(path)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e).ctx(|| format!("creating {}", path.display())),
            }
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Attaches what was being done to an I/O error.
trait Ctx<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T, ImageError>;
}

impl<T> Ctx<T> for io::Result<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T, ImageError> {
        self.map_err(|source| ImageError::Io {
            what: what(),
            source,
        })
    }
}
