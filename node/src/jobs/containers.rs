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
        let images = ImageCache::new(image_dir, max_image_bytes)
            .map_err(|e| format!("cannot open image cache {}: {e}", image_dir.display()))?;
        Ok(ContainerRuntime {
            executor: ContainerExecutor::new(config),
            images,
            allow_host_env,
        })
    }
}
