//! The container backend: native tasks (CUDA programs, PyTorch) run under bubblewrap in
//! their own pid, ipc, uts, mount, user and network namespaces, with no network, a
//! read-only root, a private `/tmp`, `/input` read-only and `/output` writable, limits
//! on memory, processes, CPU time and output, and only the leased GPUs' device nodes.
//!
//! The root is either an OCI image archive unpacked by [`image`] or, where the provider
//! allows it, the provider's own system directories read-only (`--host-env`).

mod cgroup;
pub mod image;
pub mod procs;
mod runner;

pub use runner::{
    nvidia_driver_files, ContainerConfig, ContainerExecutor, ContainerLimits, ContainerSpec,
    GpuDevice, PauseToken, Root,
};
