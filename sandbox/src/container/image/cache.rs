//! The on-disk cache of unpacked images: one directory per archive digest, made by
//! unpacking into a temporary sibling renamed into place, the least recently used
//! evicted once no job can still be using it.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::{unpack_archive, Ctx, ImageConfig, ImageError, TempDir, MOUNT_POINTS};

/// Unpacked images under one directory, one per archive digest; at most
/// [`MAX_CACHED_IMAGES`], the least recently used evicted once no job can still be
/// using it.
pub struct ImageCache {
    dir: PathBuf,
    max_bytes: u64,
    pub(super) max_images: usize,
}

/// Most images kept unpacked.
pub const MAX_CACHED_IMAGES: usize = 32;
/// An image not used for this long may be evicted: no job outlives its lease, and no
/// lease lasts longer (24 h by default, renewals included) plus a margin.
pub const IMAGE_IDLE_BEFORE_EVICTION: std::time::Duration =
    std::time::Duration::from_secs(25 * 3600);

impl ImageCache {
    /// `dir` is created if missing. `max_unpacked_bytes` caps the total size of regular
    /// files written for one image (tar-bomb guard).
    pub fn new(dir: &Path, max_unpacked_bytes: u64) -> io::Result<ImageCache> {
        fs::create_dir_all(dir)?;
        Ok(ImageCache {
            dir: dir.to_path_buf(),
            max_bytes: max_unpacked_bytes,
            max_images: MAX_CACHED_IMAGES,
        })
    }

    /// Makes room for one more image: evicts the least recently used images idle for
    /// [`IMAGE_IDLE_BEFORE_EVICTION`] while the cache is full; refuses when none is.
    fn make_room(&self) -> Result<(), ImageError> {
        let mut images: Vec<(std::time::SystemTime, PathBuf)> = fs::read_dir(&self.dir)
            .ctx(|| format!("reading {}", self.dir.display()))?
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .map(|e| {
                let used = fs::metadata(e.path().join("config.json"))
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                (used, e.path())
            })
            .collect();
        images.sort();
        let now = std::time::SystemTime::now();
        let mut count = images.len();
        for (used, path) in images {
            if count < self.max_images {
                break;
            }
            let idle = now.duration_since(used).unwrap_or_default();
            if idle < IMAGE_IDLE_BEFORE_EVICTION {
                break;
            }
            fs::remove_dir_all(&path).ctx(|| format!("evicting {}", path.display()))?;
            count -= 1;
        }
        if count >= self.max_images {
            return Err(ImageError::CacheFull(self.max_images));
        }
        Ok(())
    }

    /// The root filesystem of the archive at `archive`, whose content digest (any
    /// stable hex string the caller computed) is `digest`: unpacked the first time,
    /// reused afterwards. Unpacking happens in a temporary sibling directory that is
    /// renamed into place, so a failure never leaves a half image that is later reused
    /// and concurrent callers are safe. Returns the rootfs path
    /// (`<dir>/<digest>/rootfs`) and the config (stored in `<dir>/<digest>/config.json`).
    pub fn rootfs(
        &self,
        archive: &Path,
        digest: &str,
    ) -> Result<(PathBuf, ImageConfig), ImageError> {
        if digest.is_empty()
            || digest.len() > 128
            || !digest.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            return Err(ImageError::BadDigest(digest.to_string()));
        }
        let target = self.dir.join(digest);
        if let Some(config) = read_cached(&target)? {
            // Marks it used now (what eviction goes by).
            if let Ok(f) = fs::File::options()
                .write(true)
                .open(target.join("config.json"))
            {
                let _ = f.set_modified(std::time::SystemTime::now());
            }
            return Ok((target.join("rootfs"), config));
        }
        self.make_room()?;
        let tmp = TempDir::create(&self.dir, &format!(".{digest}.tmp"))?;
        let rootfs = tmp.0.join("rootfs");
        fs::create_dir(&rootfs).ctx(|| format!("creating {}", rootfs.display()))?;
        let config = unpack_archive(archive, &rootfs, self.max_bytes)?;
        // Jobs run as uids of their own: the way in is traversable, the root readable,
        // and the mount points every job needs are made once, here.
        fs::set_permissions(&tmp.0, fs::Permissions::from_mode(0o711))
            .ctx(|| format!("opening {}", tmp.0.display()))?;
        fs::set_permissions(&rootfs, fs::Permissions::from_mode(0o755))
            .ctx(|| format!("opening {}", rootfs.display()))?;
        for dir in MOUNT_POINTS {
            let path = rootfs.join(dir);
            if fs::symlink_metadata(&path).is_err() {
                fs::create_dir(&path).ctx(|| format!("creating {}", path.display()))?;
            }
        }
        let json = serde_json::to_vec_pretty(&config)
            .map_err(io::Error::other)
            .ctx(|| "encoding the image config".into())?;
        fs::write(tmp.0.join("config.json"), json).ctx(|| "writing the image config".into())?;
        match fs::rename(&tmp.0, &target) {
            Ok(()) => Ok((target.join("rootfs"), config)),
            // Lost a race with another caller: use the winner's copy (tmp is removed on drop).
            Err(e) => match read_cached(&target)? {
                Some(config) => Ok((target.join("rootfs"), config)),
                None => Err(e).ctx(|| format!("moving the unpacked image to {}", target.display())),
            },
        }
    }
}

/// The config of a complete cached image in `target`, or `None` when there is none.
fn read_cached(target: &Path) -> Result<Option<ImageConfig>, ImageError> {
    let path = target.join("config.json");
    if !path.is_file() || !target.join("rootfs").is_dir() {
        return Ok(None);
    }
    let bytes = fs::read(&path).ctx(|| format!("reading {}", path.display()))?;
    let config = serde_json::from_slice(&bytes)
        .map_err(io::Error::other)
        .ctx(|| format!("parsing {}", path.display()))?;
    Ok(Some(config))
}
