//! Applying one layer's tar to the root with overlay semantics (whiteouts and opaque
//! directories), within a byte and entry budget, never writing outside the root:
//! entries with `..`, entries below a symlink and hard links that leave it are refused.

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{symlink, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use super::{Ctx, ImageError};

/// What an image may still unpack: bytes of files and archive entries.
pub(super) struct Budget {
    pub(super) left: u64,
    pub(super) limit: u64,
    /// Archive entries still allowed (every pass over every archive counts).
    pub(super) entries_left: u64,
}

/// Most archive entries read for one image, all passes over the outer archive and its
/// layers together: a million empty files would exhaust inodes and time long before
/// they filled any byte budget.
pub const MAX_IMAGE_ENTRIES: u64 = 1_000_000;

/// Reads the tar in `reader` into `root`. With `whiteouts`, only applies whiteout and
/// opaque markers to what is already there; without, writes every other entry.
pub(super) fn extract(
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

/// Writes one entry (file, directory, symlink or hard link) at `rel` below `root`;
/// devices, fifos and pax headers are skipped.
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
    if kind == T::Directory {
        return write_dir(&path, rel, mode);
    }
    let link = entry
        .link_name()
        .map_err(|e| bad(e.to_string()))?
        .map(|l| l.into_owned());
    if kind == T::Link {
        return write_hard_link(root, rel, link.as_deref(), budget, bad);
    }
    remove_any(&path).ctx(what)?;
    if kind == T::Symlink {
        let target = link.ok_or_else(|| bad(format!("symlink {} has no target", rel.display())))?;
        return symlink(target, &path).ctx(what);
    }
    write_file(entry, rel, &path, mode, budget, bad)
}

/// A directory at `path` (replacing a file there), traversable and readable by all.
fn write_dir(path: &Path, rel: &Path, mode: u32) -> Result<(), ImageError> {
    let what = || format!("writing {}", rel.display());
    match fs::symlink_metadata(path).ok() {
        Some(m) if m.is_dir() => {}
        Some(_) => {
            fs::remove_file(path).ctx(what)?;
            fs::create_dir(path).ctx(what)?;
        }
        None => fs::create_dir(path).ctx(what)?,
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode | 0o755)).ctx(what)
}

/// A hard link at `rel` to `link` (both below `root`): a link where the file system
/// allows, else a copy counted against the budget; a link to a symlink is a symlink.
fn write_hard_link(
    root: &Path,
    rel: &Path,
    link: Option<&Path>,
    budget: &mut Budget,
    bad: &dyn Fn(String) -> ImageError,
) -> Result<(), ImageError> {
    let path = root.join(rel);
    let what = || format!("writing {}", rel.display());
    let target_rel = link
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
    Ok(())
}

/// A regular (or sparse) file at `path` with the entry's content, within the budget.
fn write_file(
    entry: &mut tar::Entry<'_, Box<dyn Read>>,
    rel: &Path,
    path: &Path,
    mode: u32,
    budget: &mut Budget,
    bad: &dyn Fn(String) -> ImageError,
) -> Result<(), ImageError> {
    let what = || format!("writing {}", rel.display());
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
        .open(path)
        .ctx(what)?;
    let copied = io::copy(
        &mut (&mut *entry).take(budget.left.saturating_add(1)),
        &mut file,
    )
    .map_err(|e| bad(format!("reading {}: {e}", rel.display())))?;
    budget.take(copied)?;
    if entry.header().entry_type() != tar::EntryType::GNUSparse && copied != size {
        return Err(bad(format!("{} is truncated", rel.display())));
    }
    file.flush().ctx(what)?;
    // Readable by the job's own uid, whatever owner the image gave it.
    fs::set_permissions(path, fs::Permissions::from_mode(mode | 0o444)).ctx(what)
}

impl Budget {
    /// Takes `n` bytes from the budget, or fails with `TooLarge`.
    pub(super) fn take(&mut self, n: u64) -> Result<(), ImageError> {
        self.left = self
            .left
            .checked_sub(n)
            .ok_or(ImageError::TooLarge { limit: self.limit })?;
        Ok(())
    }
}

/// The entry path relative to the root: leading `/` and `.` dropped; `None` for the
/// root itself; `..` anywhere is refused.
pub(super) fn normalise(path: &Path) -> Result<Option<PathBuf>, ImageError> {
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
