//! The provider's container backend: the bubblewrap executor, images unpacked by digest,
//! and whether requesters may use the provider's own system (`--host-env`).

use std::path::Path;

use gpunode_sandbox::container::image::ImageCache;
use gpunode_sandbox::container::{ContainerConfig, ContainerExecutor};

/// Everything a provider needs to run container jobs.
pub struct ContainerRuntime {
    /// Runs jobs under bubblewrap.
    pub executor: ContainerExecutor,
    /// Unpacked image roots, by the archive's blake3.
    pub images: ImageCache,
    /// Whether `--host-env` jobs are taken.
    pub allow_host_env: bool,
}

impl ContainerRuntime {
    /// Finds bubblewrap and opens the image cache under `image_dir`, inside the node's
    /// job root `job_root`; the error says what to install.
    pub fn open(
        job_root: &Path,
        image_dir: &Path,
        allow_host_env: bool,
        max_image_bytes: u64,
    ) -> Result<ContainerRuntime, String> {
        let config = ContainerConfig::detect().map_err(|e| e.to_string())?;
        // Found once, now, before the node starts children of its own (cgroup v2 may
        // move this process into a leaf of its group, which only works while it is alone
        // there).
        if !gpunode_sandbox::container::cgroups_delegated() {
            tracing::warn!(
                "no cgroups for container jobs here: CPU jobs get per-process limits and GPU \
                 jobs are refused (`gpunode doctor` says how to give the node cgroups)"
            );
        }
        open_path_to(job_root, image_dir).map_err(|e| {
            format!(
                "cannot make {} reachable for container jobs: {e}",
                image_dir.display()
            )
        })?;
        let images = ImageCache::new(image_dir, max_image_bytes)
            .map_err(|e| format!("cannot open image cache {}: {e}", image_dir.display()))?;
        Ok(ContainerRuntime {
            executor: ContainerExecutor::new(config),
            images,
            allow_host_env,
        })
    }
}

/// Makes every directory from `root` down to `dir` traversable by others (0711: no
/// listing) so that a container job, which runs as a uid of its own, can reach its
/// image root. `root` is the node's job root (see `DataDir::job_root`): as root it is
/// outside the data dir, which stays closed.
fn open_path_to(root: &Path, dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    if gpunode_sandbox::container::procs::effective_uid() != 0 {
        // Not root: jobs run as this user and need nothing opened.
        return Ok(());
    }
    for path in dir.ancestors() {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o711))?;
        if path == root {
            break;
        }
    }
    if let Some(parent) = root.parent() {
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o711))?;
    }
    Ok(())
}
