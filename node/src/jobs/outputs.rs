//! Where a provider's output files land on the requester, written as if the provider
//! were hostile.
//!
//! - Every job's outputs go into a fresh directory: `--output DIR` when DIR does not
//!   exist yet, otherwise `DIR/<job>`. Nothing already on disk is replaced.
//! - Files are first written into a fresh, private staging directory beside the target
//!   and moved into place with one `rename` once every file arrived and matched its
//!   hash; a failed or cancelled download leaves nothing behind.
//! - Names are checked (`check_relative_path`: relative, no `..`, no empty parts) and
//!   every file and directory is created new (`O_EXCL`, `O_NOFOLLOW`), so a symlink is
//!   never followed and a name given twice is refused.
//! - The number of files and their total size are capped before a byte is written
//!   ([`OutputLimits`]), so a provider cannot fill the requester's disk.

use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use futures::AsyncRead;
use gpunode_protocol::job::{check_relative_path, JobFile, ProviderMsg};

use super::wire;

/// Default cap on the total size of one job's outputs.
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 16 << 30;
/// Default cap on the number of one job's output files.
pub const DEFAULT_MAX_OUTPUT_FILES: u32 = 10_000;

/// What one job may write on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputLimits {
    /// Total bytes of all output files.
    pub max_bytes: u64,
    /// Number of output files.
    pub max_files: u32,
}

impl Default for OutputLimits {
    fn default() -> Self {
        Self {
            max_bytes: DEFAULT_MAX_OUTPUT_BYTES,
            max_files: DEFAULT_MAX_OUTPUT_FILES,
        }
    }
}

impl OutputLimits {
    /// Refuses a list of outputs that breaks the limits or names a file badly, before
    /// anything is written.
    pub fn check(&self, files: &[JobFile]) -> Result<(), String> {
        if files.len() as u64 > u64::from(self.max_files) {
            return Err(format!(
                "the provider sent {} output files, more than the {} allowed (raise --max-output-files)",
                files.len(),
                self.max_files
            ));
        }
        let mut total = 0u64;
        for f in files {
            check_relative_path(&f.path).map_err(|e| format!("output file refused: {e}"))?;
            total = total.saturating_add(f.blob.size);
        }
        if total > self.max_bytes {
            return Err(format!(
                "the provider sent {total} bytes of outputs, more than the {} allowed (raise --max-output)",
                self.max_bytes
            ));
        }
        Ok(())
    }
}

/// The directory a job's outputs end up in: `requested` itself when nothing is there
/// yet, else a new directory `name` inside it.
pub fn final_dir(requested: &Path, name: &str) -> PathBuf {
    match std::fs::symlink_metadata(requested) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => requested.to_path_buf(),
        _ => requested.join(name),
    }
}

/// A private directory that outputs are written into before they are moved into place;
/// removed on drop unless [`Staging::commit`] moved it.
pub struct Staging {
    path: PathBuf,
    done: bool,
}

impl Staging {
    /// A new, empty staging directory beside `target` (mode 0700).
    pub fn beside(target: &Path) -> io::Result<Self> {
        let parent = target
            .parent()
            .ok_or_else(|| io::Error::other("the output directory has no parent"))?;
        std::fs::create_dir_all(parent)?;
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "out".into());
        let path = parent.join(format!(".{name}.{:016x}.partial", rand::random::<u64>()));
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        Ok(Self { path, done: false })
    }

    /// The staging directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates the new file `rel` (a checked relative path) and its missing parent
    /// directories inside the staging directory. Never follows a symlink and never
    /// opens anything that already exists.
    pub fn create_file(&self, rel: &str) -> io::Result<std::fs::File> {
        check_relative_path(rel).map_err(io::Error::other)?;
        let mut dir = self.path.clone();
        let parts: Vec<&str> = rel.split('/').collect();
        let (file, parents) = parts
            .split_last()
            .ok_or_else(|| io::Error::other("empty"))?;
        for part in parents {
            dir.push(part);
            match std::fs::DirBuilder::new().mode(0o755).create(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    // Only a directory made by an earlier file of this job may be reused.
                    if !std::fs::symlink_metadata(&dir)?.file_type().is_dir() {
                        return Err(io::Error::other(format!(
                            "output '{rel}' would go through '{}', which is not a directory",
                            part
                        )));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o644)
            .open(dir.join(file))
            .map_err(|e| match e.kind() {
                io::ErrorKind::AlreadyExists => {
                    io::Error::other(format!("the provider sent output '{rel}' twice"))
                }
                _ => e,
            })
    }

    /// Moves the staging directory to `target` (which must not exist, or be an empty
    /// directory); the outputs appear all at once.
    pub fn commit(mut self, target: &Path) -> io::Result<()> {
        std::fs::set_permissions(
            &self.path,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )?;
        // rename(2) never follows a symlink at the target and never replaces a file or
        // a non-empty directory.
        std::fs::rename(&self.path, target).map_err(|e| {
            io::Error::other(format!(
                "cannot move the outputs to {}: {e} (it appeared while the job ran)",
                target.display()
            ))
        })?;
        self.done = true;
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done {
            // remove_dir_all does not follow symlinks inside the directory.
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Receives the output files a provider announced in `files` from `r` into `staging`,
/// each checked against its hash; `progress(file, done)` sees each file's progress.
pub async fn receive_outputs<R: AsyncRead + Unpin>(
    staging: &Staging,
    files: &[JobFile],
    limits: &OutputLimits,
    r: &mut R,
    mut progress: impl FnMut(&JobFile, u64),
) -> io::Result<()> {
    limits.check(files).map_err(io::Error::other)?;
    for f in files {
        let std_file = staging.create_file(&f.path)?;
        wire::receive_blob::<_, _, ProviderMsg>(r, std_file, &f.blob, |done| progress(f, done))
            .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpunode_protocol::job::BlobRef;

    fn file(path: &str, data: &[u8]) -> JobFile {
        JobFile {
            path: path.into(),
            blob: BlobRef {
                hash: *blake3::hash(data).as_bytes(),
                size: data.len() as u64,
            },
        }
    }

    async fn stream(files: &[(&str, &[u8])]) -> (Vec<JobFile>, Vec<u8>) {
        let mut wire_bytes = Vec::new();
        let mut list = Vec::new();
        for (path, data) in files {
            list.push(file(path, data));
            wire::send_bytes(&mut wire_bytes, data).await.expect("send");
        }
        (list, wire_bytes)
    }

    /// Runs a whole download as the requester does: staging, receive, commit.
    async fn download(
        target: &Path,
        files: &[JobFile],
        bytes: &[u8],
        limits: OutputLimits,
    ) -> io::Result<()> {
        let staging = Staging::beside(target)?;
        receive_outputs(&staging, files, &limits, &mut &bytes[..], |_, _| {}).await?;
        staging.commit(target)
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[tokio::test]
    async fn honest_outputs_land_in_a_fresh_directory() {
        let tmp = tempfile::tempdir().expect("tmp");
        let target = final_dir(&tmp.path().join("out"), "job1");
        assert_eq!(target, tmp.path().join("out"));
        let (files, bytes) = stream(&[("a.txt", b"alpha"), ("deep/er/b.bin", b"beta")]).await;
        download(&target, &files, &bytes, OutputLimits::default())
            .await
            .expect("download");
        assert_eq!(std::fs::read(target.join("a.txt")).expect("a"), b"alpha");
        assert_eq!(
            std::fs::read(target.join("deep/er/b.bin")).expect("b"),
            b"beta"
        );
        // No staging directory is left beside it.
        assert_eq!(entries(tmp.path()), vec!["out"]);
        // An existing directory is never written into: the next job gets a new one.
        assert_eq!(final_dir(&target, "job2"), target.join("job2"));
    }

    #[tokio::test]
    async fn output_dot_in_a_checkout_cannot_plant_hooks_or_dotfiles() {
        let tmp = tempfile::tempdir().expect("tmp");
        let checkout = tmp.path().join("checkout");
        std::fs::create_dir_all(checkout.join(".git/hooks")).expect("mkdir");
        std::fs::write(checkout.join(".bashrc"), b"mine").expect("write");
        // `--output .` in the checkout: the job gets its own directory inside it.
        let target = final_dir(&checkout, "job1");
        let (files, bytes) = stream(&[
            (".git/hooks/pre-commit", b"#!/bin/sh\nevil"),
            (".bashrc", b"evil"),
        ])
        .await;
        download(&target, &files, &bytes, OutputLimits::default())
            .await
            .expect("download into its own directory");
        assert!(!checkout.join(".git/hooks/pre-commit").exists());
        assert_eq!(
            std::fs::read(checkout.join(".bashrc")).expect("rc"),
            b"mine"
        );
        assert_eq!(
            std::fs::read(checkout.join("job1/.bashrc")).expect("job rc"),
            b"evil"
        );
    }

    #[tokio::test]
    async fn names_that_escape_are_refused_and_nothing_is_written() {
        let tmp = tempfile::tempdir().expect("tmp");
        for bad in [
            "../escape",
            "/etc/passwd",
            "a/../../b",
            "a//b",
            "./a",
            "a\\..\\b",
        ] {
            let target = tmp.path().join("out");
            let (mut files, bytes) = stream(&[("ok.txt", b"fine"), ("x", b"evil")]).await;
            files[1].path = bad.into();
            let err = download(&target, &files, &bytes, OutputLimits::default())
                .await
                .expect_err(bad);
            assert!(err.to_string().contains("refused"), "{bad}: {err}");
            assert_eq!(entries(tmp.path()), Vec::<String>::new(), "{bad}");
        }
        assert!(!tmp.path().parent().expect("parent").join("escape").exists());
    }

    #[tokio::test]
    async fn symlinks_are_never_followed_or_replaced() {
        let tmp = tempfile::tempdir().expect("tmp");
        let victim = tmp.path().join("victim.txt");
        std::fs::write(&victim, b"precious").expect("write");
        // A symlink where the output directory would be: refused, not followed.
        let target = tmp.path().join("out");
        std::os::unix::fs::symlink(tmp.path().join("elsewhere"), &target).expect("link");
        let staging = Staging::beside(&target).expect("staging");
        let (files, bytes) = stream(&[("victim.txt", b"evil")]).await;
        receive_outputs(
            &staging,
            &files,
            &OutputLimits::default(),
            &mut &bytes[..],
            |_, _| {},
        )
        .await
        .expect("receive");
        let err = staging.commit(&target).expect_err("symlink target");
        assert!(err.to_string().contains("cannot move"), "{err}");
        assert!(!tmp.path().join("elsewhere").exists());
        // And a symlink to a file as the target: rename does not follow it either.
        let target2 = tmp.path().join("out2");
        std::os::unix::fs::symlink(&victim, &target2).expect("link");
        let err = download(&target2, &files, &bytes, OutputLimits::default())
            .await
            .expect_err("file symlink target");
        assert!(err.to_string().contains("cannot move"), "{err}");
        assert_eq!(std::fs::read(&victim).expect("victim"), b"precious");
    }

    #[tokio::test]
    async fn a_file_sent_twice_or_through_a_file_is_refused() {
        let tmp = tempfile::tempdir().expect("tmp");
        let target = tmp.path().join("out");
        let (files, bytes) = stream(&[("a", b"one"), ("a", b"two")]).await;
        let err = download(&target, &files, &bytes, OutputLimits::default())
            .await
            .expect_err("twice");
        assert!(err.to_string().contains("twice"), "{err}");
        let (files, bytes) = stream(&[("a", b"one"), ("a/b", b"two")]).await;
        let err = download(&target, &files, &bytes, OutputLimits::default())
            .await
            .expect_err("through a file");
        assert!(err.to_string().contains("not a directory"), "{err}");
        assert_eq!(entries(tmp.path()), Vec::<String>::new());
    }

    #[tokio::test]
    async fn huge_or_numerous_outputs_are_refused_before_a_byte_is_written() {
        let tmp = tempfile::tempdir().expect("tmp");
        let target = tmp.path().join("out");
        let limits = OutputLimits {
            max_bytes: 10,
            max_files: 2,
        };
        let (files, bytes) = stream(&[("a", b"123456"), ("b", b"789012")]).await;
        let err = download(&target, &files, &bytes, limits)
            .await
            .expect_err("too big");
        assert!(err.to_string().contains("--max-output"), "{err}");
        let (files, bytes) = stream(&[("a", b"1"), ("b", b"2"), ("c", b"3")]).await;
        let err = download(&target, &files, &bytes, limits)
            .await
            .expect_err("too many");
        assert!(err.to_string().contains("--max-output-files"), "{err}");
        // Sizes that overflow when added are refused too, not wrapped.
        let mut files = vec![file("a", b"x"), file("b", b"y")];
        files[0].blob.size = u64::MAX;
        files[1].blob.size = 5;
        assert!(OutputLimits::default().check(&files).is_err());
        assert_eq!(entries(tmp.path()), Vec::<String>::new());
    }

    #[tokio::test]
    async fn a_broken_download_leaves_nothing_behind() {
        let tmp = tempfile::tempdir().expect("tmp");
        let target = tmp.path().join("out");
        let (files, bytes) = stream(&[("a", b"alpha"), ("b", b"beta")]).await;
        let err = download(
            &target,
            &files,
            &bytes[..bytes.len() - 2],
            OutputLimits::default(),
        )
        .await
        .expect_err("truncated");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(entries(tmp.path()), Vec::<String>::new());
    }
}
