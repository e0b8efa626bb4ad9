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
    /// Finds bubblewrap and opens the image cache under `image_dir`; the error says
    /// what to install.
    pub fn open(
        image_dir: &Path,
        allow_host_env: bool,
        max_image_bytes: u64,
    ) -> Result<ContainerRuntime, String> {
        let config = ContainerConfig::detect().map_err(|e| e.to_string())?;
        open_path_to(image_dir).map_err(|e| {
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

/// Makes every directory from the data dir down to `dir` traversable by others (0711:
/// no listing) so that a container job, which runs as a uid of its own, can reach its
/// image root; the data dir's secrets stay in files only their owner can read (the
/// identity key 0600) and in `store/`, which is closed (0700).
fn open_path_to(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    // `dir` is DATA/cache/images.
    let mut chain: Vec<&Path> = dir.ancestors().take(3).collect();
    chain.reverse();
    for path in chain {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o711))?;
    }
    if let Some(store) = dir.parent().and_then(Path::parent).map(|d| d.join("store")) {
        if store.is_dir() {
            std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o700))?;
        }
    }
    Ok(())
}
