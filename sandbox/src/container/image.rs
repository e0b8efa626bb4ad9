//! Container image archives: this module owns turning a `docker save` or OCI image
//! layout archive (plain tar or gzip) into a root filesystem directory, and the
//! on-disk cache of unpacked images, one directory per archive digest.
//!
//! Layers are applied by hand with overlay semantics (whiteouts and opaque
//! directories). Nothing is ever written outside the destination: entries with `..`,
//! entries below a symlink and hard links that leave the root are refused.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::{symlink, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;
use sha2::{Digest, Sha256};

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

/// Unpacked images under one directory, one per archive digest; at most
/// [`MAX_CACHED_IMAGES`], the least recently used evicted once no job can still be
/// using it.
pub struct ImageCache {
    dir: PathBuf,
    max_bytes: u64,
    max_images: usize,
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

/// Unpacks an archive into `dest` (an existing empty directory); returns its config.
/// On error `dest` may hold part of the image; blob digests are checked before any
/// layer is applied.
pub fn unpack_archive(
    archive: &Path,
    dest: &Path,
    max_unpacked_bytes: u64,
) -> Result<ImageConfig, ImageError> {
    unpack_archive_limited(archive, dest, max_unpacked_bytes, MAX_IMAGE_ENTRIES)
}

/// [`unpack_archive`] with at most `max_entries` archive entries read.
fn unpack_archive_limited(
    archive: &Path,
    dest: &Path,
    max_unpacked_bytes: u64,
    max_entries: u64,
) -> Result<ImageConfig, ImageError> {
    let size = fs::metadata(archive)
        .ctx(|| format!("reading {}", archive.display()))?
        .len();
    let parent = dest
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir);
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let outer = TempDir::create(&parent, &format!(".{name}.outer"))?;
    let not_tar = |e: String| {
        ImageError::NotAnImage(format!("{} is not a readable tar archive ({e}); pass the file written by `docker save` or `podman save`", archive.display()))
    };
    let reader = open_maybe_gzip(archive).ctx(|| format!("opening {}", archive.display()))?;
    if reader.zstd {
        return Err(not_tar("it is zstd-compressed; decompress it first".into()));
    }
    // The outer archive may hold uncompressed layers, so its own cap also allows its size.
    let mut outer_budget = Budget {
        left: max_unpacked_bytes.saturating_add(size),
        limit: max_unpacked_bytes.saturating_add(size),
        entries_left: max_entries,
    };
    extract(reader.inner, &outer.0, &mut outer_budget, false, &not_tar)?;
    let outer_root = outer
        .0
        .canonicalize()
        .ctx(|| "resolving the temporary directory".into())?;
    let (config_path, layers) = read_manifest(&outer_root)?;
    let config = parse_config(&config_path)?;
    let mut budget = Budget {
        left: max_unpacked_bytes,
        limit: max_unpacked_bytes,
        entries_left: outer_budget.entries_left,
    };
    for (label, path) in &layers {
        let bad = |reason: String| ImageError::Layer {
            layer: label.clone(),
            reason,
        };
        for whiteouts in [true, false] {
            let r = open_maybe_gzip(path).map_err(|e| bad(e.to_string()))?;
            if r.zstd {
                return Err(bad("zstd-compressed layers are not supported; re-save the image with gzip or uncompressed layers".into()));
            }
            extract(r.inner, dest, &mut budget, whiteouts, &bad)?;
        }
    }
    Ok(config)
}

/// Finds the config blob and the layers (label, path) in order, via `manifest.json`
/// (docker save) or `index.json` (OCI layout).
fn read_manifest(outer: &Path) -> Result<(PathBuf, Vec<(String, PathBuf)>), ImageError> {
    if outer.join("manifest.json").is_file() {
        let json = read_json(&member(outer, "manifest.json")?)?;
        if let Some(m) = json.as_array().and_then(|a| a.first()) {
            let config = m["Config"]
                .as_str()
                .ok_or_else(|| not_image("manifest.json has no Config"))?;
            let config = docker_member(outer, config, "the image config")?;
            let mut layers = Vec::new();
            for (i, l) in m["Layers"].as_array().into_iter().flatten().enumerate() {
                let name = l
                    .as_str()
                    .ok_or_else(|| not_image("manifest.json has a layer that is not a path"))?;
                let label = format!("{} ({name})", i + 1);
                layers.push((
                    label.clone(),
                    docker_member(outer, name, &format!("layer {label}"))?,
                ));
            }
            return Ok((config, layers));
        }
    }
    if !outer.join("index.json").is_file() {
        return Err(not_image("it has neither manifest.json (docker save) nor index.json (OCI layout); pass an archive made by `docker save`, `podman save` or `skopeo copy ... oci-archive:`"));
    }
    let mut json = read_json(&member(outer, "index.json")?)?;
    for _ in 0..8 {
        let Some(list) = json.get("manifests").and_then(Value::as_array) else {
            return oci_image(outer, &json);
        };
        let platform = |d: &&Value, os: &str, arch: Option<&str>| {
            d["platform"]["os"].as_str() == Some(os)
                && arch.is_none_or(|a| d["platform"]["architecture"].as_str() == Some(a))
        };
        let chosen = list
            .iter()
            .find(|d| platform(d, "linux", Some("amd64")))
            .or_else(|| list.iter().find(|d| !platform(d, "unknown", None)))
            .or_else(|| list.first())
            .ok_or_else(|| not_image("its index lists no manifests"))?;
        json = read_json(&blob(outer, chosen, "an image manifest")?)?;
    }
    Err(not_image("its indexes are nested more than 8 deep"))
}

fn oci_image(
    outer: &Path,
    manifest: &Value,
) -> Result<(PathBuf, Vec<(String, PathBuf)>), ImageError> {
    let config = blob(outer, &manifest["config"], "the image config")?;
    let mut layers = Vec::new();
    for (i, l) in manifest["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let label = format!("{} ({})", i + 1, l["digest"].as_str().unwrap_or("?"));
        layers.push((label.clone(), blob(outer, l, &format!("layer {label}"))?));
    }
    Ok((config, layers))
}

fn not_image(msg: &str) -> ImageError {
    ImageError::NotAnImage(msg.to_string())
}

/// The blob named by an OCI descriptor, with its sha256 verified.
fn blob(outer: &Path, desc: &Value, what: &str) -> Result<PathBuf, ImageError> {
    let digest = desc["digest"].as_str().unwrap_or_default();
    match digest.strip_prefix("sha256:") {
        Some(hex) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            let path = member(outer, &format!("blobs/sha256/{hex}"))?;
            verify(&path, hex, what)?;
            Ok(path)
        }
        _ => Err(ImageError::NotAnImage(format!(
            "{what} has digest {digest:?}; only sha256 digests are supported"
        ))),
    }
}

/// A `docker save` member; verified when it is named by digest (Docker 25+).
fn docker_member(outer: &Path, name: &str, what: &str) -> Result<PathBuf, ImageError> {
    let path = member(outer, name)?;
    if let Some(hex) = name.strip_prefix("blobs/sha256/").filter(|h| h.len() == 64) {
        verify(&path, hex, what)?;
    }
    Ok(path)
}

fn verify(path: &Path, hex: &str, what: &str) -> Result<(), ImageError> {
    let mut hasher = Sha256::new();
    let mut file = File::open(path).ctx(|| format!("opening {what}"))?;
    io::copy(&mut file, &mut hasher).ctx(|| format!("reading {what}"))?;
    if hex::encode(hasher.finalize()) != hex.to_ascii_lowercase() {
        return Err(ImageError::Corrupt {
            what: what.to_string(),
            digest: format!("sha256:{hex}"),
        });
    }
    Ok(())
}

/// A regular file of the unpacked outer archive, never resolving outside it.
fn member(outer: &Path, name: &str) -> Result<PathBuf, ImageError> {
    let rel = normalise(Path::new(name))?.ok_or_else(|| not_image("a member name is empty"))?;
    let missing = || ImageError::NotAnImage(format!("it names {name} but does not contain it"));
    let path = outer.join(rel).canonicalize().map_err(|_| missing())?;
    if !path.starts_with(outer) {
        return Err(ImageError::Unsafe(format!(
            "archive member {name} points outside the archive"
        )));
    }
    if !path.is_file() {
        return Err(missing());
    }
    Ok(path)
}

fn read_json(path: &Path) -> Result<Value, ImageError> {
    let bytes = fs::read(path).ctx(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        ImageError::NotAnImage(format!("{name} is not valid JSON ({e})"))
    })
}

fn parse_config(path: &Path) -> Result<ImageConfig, ImageError> {
    let json = read_json(path)?;
    let c = &json["config"];
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(String::from))
            .collect()
    };
    Ok(ImageConfig {
        env: strings(&c["Env"]),
        entrypoint: strings(&c["Entrypoint"]),
        cmd: strings(&c["Cmd"]),
        working_dir: c["WorkingDir"].as_str().unwrap_or_default().to_string(),
    })
}

struct Sniffed {
    inner: Box<dyn Read>,
    zstd: bool,
}

/// Opens a tar stream, decompressing gzip when the file starts with its magic.
fn open_maybe_gzip(path: &Path) -> io::Result<Sniffed> {
    let mut reader = BufReader::new(File::open(path)?);
    let head = reader.fill_buf()?;
    let zstd = head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]);
    let inner: Box<dyn Read> = if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::MultiGzDecoder::new(reader))
    } else {
        Box::new(reader)
    };
    Ok(Sniffed { inner, zstd })
}

struct Budget {
    left: u64,
    limit: u64,
    /// Archive entries still allowed (every pass over every archive counts).
    entries_left: u64,
}

/// Most archive entries read for one image, all passes over the outer archive and its
/// layers together: a million empty files would exhaust inodes and time long before
/// they filled any byte budget.
pub const MAX_IMAGE_ENTRIES: u64 = 1_000_000;

/// Reads the tar in `reader` into `root`. With `whiteouts`, only applies whiteout and
/// opaque markers to what is already there; without, writes every other entry.
fn extract(
    reader: Box<dyn Read>,
    root: &Path,
    budget: &mut Budget,
    whiteouts: bool,
    bad: &dyn Fn(String) -> ImageError,
) -> Result<(), ImageError> {
    let mut archive = tar::Archive::new(reader);
    for entry in archive.entries().map_err(|e| bad(e.to_string()))? {
        budget.entries_left = budget
            .entries_left
            .checked_sub(1)
            .ok_or(ImageError::TooManyEntries)?;
        let mut entry = entry.map_err(|e| bad(e.to_string()))?;
        let Some(rel) = normalise(&entry.path().map_err(|e| bad(e.to_string()))?)? else {
            continue;
        };
        let file_name = rel
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let marker = file_name.starts_with(".wh.");
        if whiteouts {
            if marker {
                apply_whiteout(root, &rel, &file_name)?;
            }
            continue;
        }
        if !marker {
            write_entry(&mut entry, root, &rel, budget, bad)?;
        }
    }
    Ok(())
}

fn apply_whiteout(root: &Path, rel: &Path, file_name: &str) -> Result<(), ImageError> {
    let dir = rel.parent().unwrap_or(Path::new(""));
    // Deleting through a symlink could reach outside the root; there is nothing of ours there.
    if symlink_in_parents(root, rel)? {
        return Ok(());
    }
    let what = || format!("applying whiteout {}", rel.display());
    if file_name == ".wh..wh..opq" {
        let dir = root.join(dir);
        if fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            for child in fs::read_dir(&dir).ctx(what)? {
                remove_any(&child.ctx(what)?.path()).ctx(what)?;
            }
        }
    } else if let Some(name) = file_name
        .strip_prefix(".wh.")
        .filter(|n| !n.starts_with(".wh.") && !n.is_empty())
    {
        remove_any(&root.join(dir).join(name)).ctx(what)?;
    }
    Ok(())
}

/// Removes a file, symlink or directory tree (never following links); absent is fine.
fn remove_any(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn write_entry(
    entry: &mut tar::Entry<'_, Box<dyn Read>>,
    root: &Path,
    rel: &Path,
    budget: &mut Budget,
    bad: &dyn Fn(String) -> ImageError,
) -> Result<(), ImageError> {
    use tar::EntryType as T;
    let kind = entry.header().entry_type();
    if !matches!(
        kind,
        T::Regular | T::Continuous | T::GNUSparse | T::Directory | T::Symlink | T::Link
    ) {
        return Ok(()); // devices, fifos, global pax headers: skipped
    }
    if symlink_in_parents(root, rel)? {
        return Err(ImageError::Unsafe(format!(
            "entry {} lies below a symlink",
            rel.display()
        )));
    }
    let path = root.join(rel);
    let what = || format!("writing {}", rel.display());
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).ctx(what)?;
    }
    let mode = entry.header().mode().map_err(|e| bad(e.to_string()))? & 0o777;
    let existing = fs::symlink_metadata(&path).ok();
    if kind == T::Directory {
        match existing {
            Some(m) if m.is_dir() => {}
            Some(_) => {
                fs::remove_file(&path).ctx(what)?;
                fs::create_dir(&path).ctx(what)?;
            }
            None => fs::create_dir(&path).ctx(what)?,
        }
        return fs::set_permissions(&path, fs::Permissions::from_mode(mode | 0o755)).ctx(what);
    }
    let link = entry
        .link_name()
        .map_err(|e| bad(e.to_string()))?
        .map(|l| l.into_owned());
    if kind == T::Link {
        let target_rel = link
            .as_deref()
            .map(normalise)
            .transpose()?
            .flatten()
            .ok_or_else(|| bad(format!("hard link {} has no target", rel.display())))?;
        if target_rel == rel {
            return Ok(());
        }
        if symlink_in_parents(root, &target_rel)? {
            return Err(ImageError::Unsafe(format!(
                "hard link {} points below a symlink",
                rel.display()
            )));
        }
        let target = root.join(&target_rel);
        let meta = fs::symlink_metadata(&target).map_err(|_| {
            bad(format!(
                "hard link {} points to {}, which does not exist",
                rel.display(),
                target_rel.display()
            ))
        })?;
        if meta.is_dir() {
            return Err(bad(format!(
                "hard link {} points to a directory",
                rel.display()
            )));
        }
        remove_any(&path).ctx(what)?;
        if meta.file_type().is_symlink() {
            return symlink(fs::read_link(&target).ctx(what)?, &path).ctx(what);
        }
        if fs::hard_link(&target, &path).is_err() {
            budget.take(meta.len())?;
            fs::copy(&target, &path).ctx(what)?;
        }
        return Ok(());
    }
    remove_any(&path).ctx(what)?;
    if kind == T::Symlink {
        let target = link.ok_or_else(|| bad(format!("symlink {} has no target", rel.display())))?;
        return symlink(target, &path).ctx(what);
    }
    // Sparse entries read back larger than their header size, so count what is written.
    let size = entry.size();
    if size > budget.left {
        return Err(ImageError::TooLarge {
            limit: budget.limit,
        });
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .ctx(what)?;
    let copied = io::copy(
        &mut (&mut *entry).take(budget.left.saturating_add(1)),
        &mut file,
    )
    .map_err(|e| bad(format!("reading {}: {e}", rel.display())))?;
    budget.take(copied)?;
    if kind != T::GNUSparse && copied != size {
        return Err(bad(format!("{} is truncated", rel.display())));
    }
    file.flush().ctx(what)?;
    // Readable by the job's own uid, whatever owner the image gave it.
    fs::set_permissions(&path, fs::Permissions::from_mode(mode | 0o444)).ctx(what)
}

impl Budget {
    /// Takes `n` bytes from the budget, or fails with `TooLarge`.
    fn take(&mut self, n: u64) -> Result<(), ImageError> {
        self.left = self
            .left
            .checked_sub(n)
            .ok_or(ImageError::TooLarge { limit: self.limit })?;
        Ok(())
    }
}

/// The entry path relative to the root: leading `/` and `.` dropped; `None` for the
/// root itself; `..` anywhere is refused.
fn normalise(path: &Path) -> Result<Option<PathBuf>, ImageError> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                return Err(ImageError::Unsafe(format!(
                    "entry {} contains `..`",
                    path.display()
                )))
            }
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    Ok((!out.as_os_str().is_empty()).then_some(out))
}

/// Whether an existing proper ancestor of `rel` (below `root`) is a symlink.
fn symlink_in_parents(root: &Path, rel: &Path) -> Result<bool, ImageError> {
    let mut path = root.to_path_buf();
    let mut parents: Vec<_> = rel.components().collect();
    parents.pop();
    for c in parents {
        path.push(c);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_symlink() => return Ok(true),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e).ctx(|| format!("checking {}", path.display())),
        }
    }
    Ok(false)
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tar::EntryType;

    enum E<'a> {
        File(&'a str, &'a [u8], u32),
        Dir(&'a str),
        Sym(&'a str, &'a str),
        Hard(&'a str, &'a str),
        /// A regular file whose name is written verbatim (the builder refuses `..`).
        Raw(&'a str, &'a [u8]),
    }

    fn tar_of(entries: &[E]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for e in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_size(0);
            match *e {
                E::File(p, data, mode) => {
                    h.set_mode(mode);
                    h.set_size(data.len() as u64);
                    b.append_data(&mut h, p, data).unwrap();
                }
                E::Dir(p) => {
                    h.set_entry_type(EntryType::Directory);
                    h.set_mode(0o755);
                    b.append_data(&mut h, p, io::empty()).unwrap();
                }
                E::Sym(p, t) | E::Hard(p, t) => {
                    let sym = matches!(e, E::Sym(..));
                    h.set_entry_type(if sym {
                        EntryType::Symlink
                    } else {
                        EntryType::Link
                    });
                    b.append_link(&mut h, p, t).unwrap();
                }
                E::Raw(name, data) => {
                    h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
                    h.set_size(data.len() as u64);
                    h.set_cksum();
                    b.append(&h, data).unwrap();
                }
            }
        }
        b.into_inner().unwrap()
    }

    fn gz(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    fn sha(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    fn write_tar(path: &Path, members: &[(String, Vec<u8>)]) {
        let files: Vec<E> = members.iter().map(|(n, d)| E::File(n, d, 0o644)).collect();
        fs::write(path, tar_of(&files)).unwrap();
    }

    fn config_json() -> Vec<u8> {
        let c = json!({"config": {"Env": ["PATH=/usr/bin:/bin", "A=1"], "Entrypoint": null, "Cmd": ["/bin/sh", "-c", "echo hi"], "WorkingDir": "/work"}});
        serde_json::to_vec(&c).unwrap()
    }

    /// A classic `docker save` archive with the given layer blobs.
    fn docker_archive(path: &Path, layers: &[Vec<u8>]) {
        let names: Vec<String> = (0..layers.len())
            .map(|i| format!("l{i}/layer.tar"))
            .collect();
        let manifest = json!([{"Config": "cfg.json", "RepoTags": ["t:latest"], "Layers": names}]);
        let mut members = vec![
            (
                "manifest.json".to_string(),
                serde_json::to_vec(&manifest).unwrap(),
            ),
            ("cfg.json".into(), config_json()),
        ];
        members.extend(names.into_iter().zip(layers.iter().cloned()));
        write_tar(path, &members);
    }

    fn desc(media: &str, bytes: &[u8]) -> Value {
        json!({"mediaType": media, "digest": format!("sha256:{}", sha(bytes)), "size": bytes.len()})
    }

    fn blob_member(bytes: &[u8]) -> (String, Vec<u8>) {
        (format!("blobs/sha256/{}", sha(bytes)), bytes.to_vec())
    }

    fn oci_manifest(layer: &[u8]) -> Vec<u8> {
        let m = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": desc("application/vnd.oci.image.config.v1+json", &config_json()),
            "layers": [desc("application/vnd.oci.image.layer.v1.tar+gzip", layer)]});
        serde_json::to_vec(&m).unwrap()
    }

    fn unpack_err(archive: &Path, dest: &Path, limit: u64) -> ImageError {
        fs::create_dir_all(dest).unwrap();
        unpack_archive(archive, dest, limit).unwrap_err()
    }

    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            out.push(p.clone());
            if fs::symlink_metadata(&p).unwrap().is_dir() {
                walk(&p, out);
            }
        }
    }

    #[test]
    fn docker_save_applies_layers_whiteouts_and_links() {
        let tmp = tempfile::tempdir().unwrap();
        let l1 = tar_of(&[
            E::Dir("etc"),
            E::File("etc/a", b"a", 0o644),
            E::File("etc/b", b"b1", 0o644),
            E::File("data/old/x", b"x", 0o644),
            E::File("keep/y", b"yy", 0o644),
            E::File("bin/sh", b"#!sh", 0o4755),
            E::Raw("/abs/file", b"abs"),
            E::Dir("usr/lib"),
            E::Sym("lib", "usr/lib"),
        ]);
        let l2 = gz(&tar_of(&[
            E::File("etc/.wh.a", b"", 0o644),
            E::File("data/.wh..wh..opq", b"", 0o644),
            E::File("./data/new", b"new", 0o644),
            E::Hard("keep/z", "keep/y"),
            E::File("usr/lib/libc.so", b"libc", 0o644),
        ]));
        let l3 = tar_of(&[E::File("etc/b", b"b3", 0o644)]);
        let archive = tmp.path().join("img.tar");
        docker_archive(&archive, &[l1, l2, l3]);
        let root = tmp.path().join("root");
        fs::create_dir(&root).unwrap();
        let config = unpack_archive(&archive, &root, 1 << 20).unwrap();

        assert!(fs::symlink_metadata(root.join("etc/a")).is_err());
        assert_eq!(fs::read(root.join("etc/b")).unwrap(), b"b3");
        assert!(fs::symlink_metadata(root.join("data/old")).is_err());
        assert_eq!(fs::read(root.join("data/new")).unwrap(), b"new");
        assert_eq!(fs::read(root.join("keep/z")).unwrap(), b"yy");
        assert_eq!(
            fs::read_link(root.join("lib")).unwrap(),
            Path::new("usr/lib")
        );
        assert_eq!(fs::read(root.join("usr/lib/libc.so")).unwrap(), b"libc");
        assert_eq!(fs::read(root.join("abs/file")).unwrap(), b"abs");
        let mode = fs::metadata(root.join("bin/sh"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o755, "executable, setuid stripped");
        let mut all = Vec::new();
        walk(&root, &mut all);
        assert!(
            !all.iter().any(|p| p.to_string_lossy().contains(".wh.")),
            "{all:?}"
        );
        assert!(config.env.contains(&"PATH=/usr/bin:/bin".to_string()));
        assert_eq!(config.cmd, ["/bin/sh", "-c", "echo hi"]);
        assert!(config.entrypoint.is_empty());
        assert_eq!(config.working_dir, "/work");
        // The temporary copy of the outer archive is gone.
        let siblings: Vec<_> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(siblings.len(), 2, "{siblings:?}");
    }

    #[test]
    fn oci_layout_picks_amd64_and_checks_digests() {
        let tmp = tempfile::tempdir().unwrap();
        let amd = gz(&tar_of(&[E::File("arch", b"amd64", 0o644)]));
        let arm = tar_of(&[E::File("arch", b"arm64", 0o644)]);
        let (m_amd, m_arm) = (oci_manifest(&amd), oci_manifest(&arm));
        let manifest_type = "application/vnd.oci.image.manifest.v1+json";
        let mut d_arm = desc(manifest_type, &m_arm);
        d_arm["platform"] = json!({"os": "linux", "architecture": "arm64"});
        let mut d_amd = desc(manifest_type, &m_amd);
        d_amd["platform"] = json!({"os": "linux", "architecture": "amd64"});
        let nested =
            serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [d_arm, d_amd]})).unwrap();
        let index = json!({"schemaVersion": 2, "manifests": [desc("application/vnd.oci.image.index.v1+json", &nested)]});
        let archive = tmp.path().join("oci.tar");
        let mut members: Vec<_> = [&amd, &arm, &m_amd, &m_arm, &nested, &config_json()]
            .iter()
            .map(|b| blob_member(b))
            .collect();
        members.push(("index.json".into(), serde_json::to_vec(&index).unwrap()));
        members.push((
            "oci-layout".into(),
            br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
        ));
        write_tar(&archive, &members);
        let root = tmp.path().join("root");
        fs::create_dir(&root).unwrap();
        let config = unpack_archive(&archive, &root, 1 << 20).unwrap();
        assert_eq!(fs::read(root.join("arch")).unwrap(), b"amd64");
        assert_eq!(config.cmd, ["/bin/sh", "-c", "echo hi"]);

        // The layer blob's bytes do not match the digest it is stored under.
        let index = json!({"manifests": [desc(manifest_type, &m_amd)]});
        let tampered = vec![
            (
                format!("blobs/sha256/{}", sha(&amd)),
                gz(&tar_of(&[E::File("arch", b"evil!", 0o644)])),
            ),
            blob_member(&m_amd),
            blob_member(&config_json()),
            ("index.json".into(), serde_json::to_vec(&index).unwrap()),
        ];
        write_tar(&archive, &tampered);
        let dest = tmp.path().join("dest");
        let err = unpack_err(&archive, &dest, 1 << 20);
        assert!(matches!(err, ImageError::Corrupt { .. }), "{err}");
        assert!(
            err.to_string().contains("layer 1") && err.to_string().contains(&sha(&amd)),
            "{err}"
        );
        assert_eq!(fs::read_dir(&dest).unwrap().count(), 0);
    }

    #[test]
    fn unsafe_entries_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        fs::create_dir(&outside).unwrap();
        let archive = tmp.path().join("img.tar");
        let dest = tmp.path().join("a/dest");

        docker_archive(&archive, &[tar_of(&[E::Raw("../evil", b"x")])]);
        let err = unpack_err(&archive, &dest, 1 << 20);
        assert!(matches!(err, ImageError::Unsafe(_)), "{err}");
        assert!(!tmp.path().join("a/evil").exists());

        let target = outside.to_string_lossy().into_owned();
        docker_archive(
            &archive,
            &[tar_of(&[
                E::Sym("escape", &target),
                E::File("escape/pwned", b"x", 0o644),
            ])],
        );
        let err = unpack_err(&archive, &tmp.path().join("b"), 1 << 20);
        assert!(matches!(err, ImageError::Unsafe(_)), "{err}");
        assert!(!outside.join("pwned").exists());

        docker_archive(&archive, &[tar_of(&[E::Hard("h", "../../outside/f")])]);
        let err = unpack_err(&archive, &tmp.path().join("c"), 1 << 20);
        assert!(matches!(err, ImageError::Unsafe(_)), "{err}");
    }

    #[test]
    fn non_images_get_clear_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let archive = tmp.path().join("x.tar");
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let garbage: Vec<u8> = (0..4096)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 24) as u8 | 0x40
            })
            .collect();
        fs::write(&archive, garbage).unwrap();
        let err = unpack_err(&archive, &tmp.path().join("d1"), 1 << 20);
        assert!(matches!(err, ImageError::NotAnImage(_)), "{err}");

        for (i, content) in [tar_of(&[]), tar_of(&[E::File("hello.txt", b"hi", 0o644)])]
            .into_iter()
            .enumerate()
        {
            fs::write(&archive, content).unwrap();
            let err = unpack_err(&archive, &tmp.path().join(format!("e{i}")), 1 << 20);
            assert!(matches!(err, ImageError::NotAnImage(_)), "{err}");
            assert!(err.to_string().contains("neither manifest.json"), "{err}");
        }

        docker_archive(&archive, &[vec![0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0]]);
        let err = unpack_err(&archive, &tmp.path().join("z"), 1 << 20);
        assert!(matches!(err, ImageError::Layer { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("zstd-compressed layers are not supported"),
            "{err}"
        );
    }

    #[test]
    fn cache_reuses_images_and_leaves_nothing_on_failure() {
        let tmp = tempfile::tempdir().unwrap();
        let archive = tmp.path().join("img.tar");
        docker_archive(
            &archive,
            &[tar_of(&[E::File("etc/os-release", b"ID=test", 0o644)])],
        );
        let dir = tmp.path().join("cache");
        let cache = ImageCache::new(&dir, 1 << 20).unwrap();
        let (rootfs, config) = cache.rootfs(&archive, "abc123").unwrap();
        assert_eq!(rootfs, dir.join("abc123/rootfs"));
        assert_eq!(fs::read(rootfs.join("etc/os-release")).unwrap(), b"ID=test");
        fs::write(rootfs.join("marker"), b"m").unwrap();
        let (again, config2) = cache.rootfs(&archive, "abc123").unwrap();
        assert_eq!(again, rootfs);
        assert_eq!(config2, config);
        assert!(
            again.join("marker").exists(),
            "the image was unpacked again"
        );

        let bad = tmp.path().join("bad.tar");
        fs::write(&bad, b"not an image at all").unwrap();
        assert!(cache.rootfs(&bad, "bad1").is_err());
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["abc123"]);

        for digest in ["../x", "", "a/b", "."] {
            assert!(
                matches!(
                    cache.rootfs(&archive, digest),
                    Err(ImageError::BadDigest(_))
                ),
                "{digest}"
            );
        }
        assert!(!tmp.path().join("x").exists());
    }

    #[test]
    fn the_cache_keeps_a_bounded_number_of_images_evicting_idle_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let archive = tmp.path().join("img.tar");
        docker_archive(&archive, &[tar_of(&[E::File("a", b"a", 0o644)])]);
        let dir = tmp.path().join("cache");
        let mut cache = ImageCache::new(&dir, 1 << 20).unwrap();
        cache.max_images = 2;
        cache.rootfs(&archive, "one").unwrap();
        cache.rootfs(&archive, "two").unwrap();
        // Both in recent use: a third is refused, nothing is evicted.
        let err = cache.rootfs(&archive, "three").unwrap_err();
        assert!(matches!(err, ImageError::CacheFull(2)), "{err}");
        assert!(dir.join("one").exists() && dir.join("two").exists());
        // "one" was last used two days ago: it makes room.
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(2 * 86_400);
        fs::File::options()
            .write(true)
            .open(dir.join("one/config.json"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        cache.rootfs(&archive, "three").unwrap();
        assert!(!dir.join("one").exists());
        assert!(dir.join("two").exists() && dir.join("three").exists());
        // Reuse refreshes an image: "two" stays while it is used.
        cache.rootfs(&archive, "two").unwrap();
    }

    #[test]
    fn images_with_too_many_entries_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let archive = tmp.path().join("img.tar");
        let names: Vec<String> = (0..50).map(|i| format!("f{i}")).collect();
        let entries: Vec<E> = names.iter().map(|n| E::File(n, b"", 0o644)).collect();
        docker_archive(&archive, &[tar_of(&entries)]);
        let dest = tmp.path().join("few");
        fs::create_dir(&dest).unwrap();
        let err = unpack_archive_limited(&archive, &dest, 1 << 20, 40).unwrap_err();
        assert!(matches!(err, ImageError::TooManyEntries), "{err}");
        let dest = tmp.path().join("enough");
        fs::create_dir(&dest).unwrap();
        unpack_archive_limited(&archive, &dest, 1 << 20, 1000).unwrap();
        assert!(dest.join("f49").exists());
    }

    #[test]
    fn too_large_images_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let archive = tmp.path().join("img.tar");
        docker_archive(&archive, &[tar_of(&[E::File("big", &[7u8; 1000], 0o644)])]);
        let err = unpack_err(&archive, &tmp.path().join("small"), 999);
        assert!(matches!(err, ImageError::TooLarge { limit: 999 }), "{err}");
        let ok = tmp.path().join("ok");
        fs::create_dir(&ok).unwrap();
        unpack_archive(&archive, &ok, 1000).unwrap();
        assert_eq!(fs::metadata(ok.join("big")).unwrap().len(), 1000);
    }
}
