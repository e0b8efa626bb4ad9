//! Jobs' working directories on a provider: each job gets a fresh one under the jobs
//! directory, removed when the job's exchange ends. One is made ahead of need, so a job
//! does not wait for its directories to be made: on a busy filesystem a new directory
//! costs a fraction of a millisecond (ext4 without a journal passes over every inode
//! deleted in the last one to six minutes to find a free one), and a job used to pay
//! three of them between its acceptance and its task's start.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Where jobs' working directories are made, with the one made ahead of need.
pub struct JobDirs {
    root: PathBuf,
    /// A fresh, unused working directory, if one is ready.
    spare: Mutex<Option<PathBuf>>,
}

impl JobDirs {
    /// Working directories under `root`; whatever a previous run left there is removed
    /// (those jobs are gone), then the first spare is made.
    pub fn open(root: PathBuf) -> Arc<JobDirs> {
        let _ = std::fs::remove_dir_all(&root);
        let dirs = Arc::new(JobDirs {
            root,
            spare: Mutex::new(None),
        });
        dirs.refill();
        dirs
    }

    /// A fresh working directory: the spare if one is ready and still whole, else one
    /// made now.
    pub(super) fn take(self: &Arc<Self>) -> std::io::Result<JobDir> {
        let spare = self.lock().take();
        let path = match spare {
            Some(path) if is_whole(&path) => path,
            Some(broken) => {
                let _ = std::fs::remove_dir_all(&broken);
                make(&self.root)?
            }
            None => make(&self.root)?,
        };
        Ok(JobDir {
            path,
            dirs: Arc::clone(self),
        })
    }

    /// Makes a spare when none is ready (a failure only means the next job makes its
    /// own).
    fn refill(&self) {
        if self.lock().is_some() {
            return;
        }
        let Ok(path) = make(&self.root) else {
            return;
        };
        let mut spare = self.lock();
        if spare.is_none() {
            *spare = Some(path);
        } else {
            // Another job's end made one meanwhile.
            drop(spare);
            let _ = std::fs::remove_dir_all(&path);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<PathBuf>> {
        self.spare.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The spare's path, for tests.
    #[cfg(test)]
    fn spare(&self) -> Option<PathBuf> {
        self.lock().clone()
    }
}

/// A new working directory under `root`, named at random. A container job runs as a
/// uid of its own, so the path down to its `input` must be traversable by others
/// (0711: no listing) and `input` readable; `output` is handed to the job's uid by the
/// sandbox.
fn make(root: &Path) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let dir = root.join(format!("{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(dir.join("input"))?;
    let set = |p: &Path, mode| std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode));
    let made = std::fs::create_dir(dir.join("output"))
        .and_then(|()| set(root, 0o711))
        .and_then(|()| set(&dir, 0o711))
        .and_then(|()| set(&dir.join("input"), 0o755));
    if let Err(e) = made {
        let _ = std::fs::remove_dir_all(&dir);
        return Err(e);
    }
    Ok(dir)
}

/// Whether a spare still has its two directories (only the node's user can write in
/// them, but a person or a cleaner of old files may remove them).
fn is_whole(dir: &Path) -> bool {
    let is_dir = |p: PathBuf| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir());
    is_dir(dir.join("input")) && is_dir(dir.join("output"))
}

/// A job's working directory, removed when dropped (and a new spare made).
pub(super) struct JobDir {
    path: PathBuf,
    dirs: Arc<JobDirs>,
}

impl JobDir {
    pub(super) fn input(&self) -> PathBuf {
        self.path.join("input")
    }
    pub(super) fn output(&self) -> PathBuf {
        self.path.join("output")
    }
}

impl Drop for JobDir {
    /// Removed on a blocking thread where there is a runtime: a job's outputs can be
    /// many files, and the exchange's end (its lease's end, its receipt) does not wait
    /// for them. The next job's spare is made there too. A node that stops first leaves
    /// the directory to its next start, which clears the jobs directory.
    fn drop(&mut self) {
        let dir = std::mem::take(&mut self.path);
        let dirs = Arc::clone(&self.dirs);
        let remove = move || {
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!("cannot remove job directory {}: {e}", dir.display());
            }
            dirs.refill();
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn a_job_takes_the_spare_and_its_end_makes_the_next() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("jobs");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("stale"), b"left by a crash").unwrap();
        let dirs = JobDirs::open(root.clone());
        assert!(
            !root.join("stale").exists(),
            "a previous run's leftovers stay"
        );
        let spare = dirs.spare().expect("a spare made at open");

        let job = dirs.take().unwrap();
        assert_eq!(job.input(), spare.join("input"));
        assert!(dirs.spare().is_none());
        assert_eq!(mode(&root), 0o711);
        assert_eq!(mode(&spare), 0o711);
        assert_eq!(mode(&job.input()), 0o755);
        assert!(job.output().is_dir());

        // A second job at the same time makes its own.
        let other = dirs.take().unwrap();
        assert_ne!(other.input(), job.input());

        std::fs::write(job.output().join("result"), b"x").unwrap();
        drop(job);
        assert!(!spare.exists(), "a job's directory outlives it");
        let next = dirs.spare().expect("the job's end made a spare");
        assert!(is_whole(&next));
        drop(other);
        let mut left: Vec<_> = std::fs::read_dir(&root).unwrap().collect();
        assert_eq!(left.len(), 1, "only the one spare stays");
        assert_eq!(left.pop().unwrap().unwrap().path(), next);
    }

    #[test]
    fn a_spare_removed_under_the_node_is_made_again() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("jobs");
        let dirs = JobDirs::open(root.clone());
        let spare = dirs.spare().unwrap();
        std::fs::remove_dir_all(spare.join("output")).unwrap();
        let job = dirs.take().unwrap();
        assert_ne!(job.input(), spare.join("input"));
        assert!(job.input().is_dir() && job.output().is_dir());
        assert!(!spare.exists(), "the broken spare is left behind");

        // The whole jobs directory removed: the next job makes it again.
        drop(job);
        std::fs::remove_dir_all(&root).unwrap();
        let job = dirs.take().unwrap();
        assert!(job.input().is_dir() && job.output().is_dir());
        assert_eq!(mode(&root), 0o711);
    }
}
