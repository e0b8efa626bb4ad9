//! The container backend: native tasks (CUDA programs, PyTorch) run under bubblewrap in
//! their own pid, ipc, uts, mount, user and network namespaces, with no network, a
//! read-only root, a private `/tmp`, `/input` read-only and `/output` writable, limits
//! on memory, processes, CPU time and output, and only the leased GPUs' device nodes.
//!
//! Every job runs under a seccomp filter ([`seccomp`]) and, where bubblewrap allows,
//! cannot make user namespaces of its own (`--disable-userns`).
//!
//! The root is either an OCI image archive unpacked by [`image`] or, where the provider
//! allows it, the provider's own system directories read-only (`--host-env`).

mod cgroup;
pub mod image;
pub mod procs;
mod runner;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub mod seccomp;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub mod seccomp {
    //! No seccomp filter on this architecture (no system call list for it).
    /// No program.
    pub fn program() -> Option<Vec<u8>> {
        None
    }
}

pub use runner::{
    nvidia_driver_files, ContainerConfig, ContainerExecutor, ContainerLimits, ContainerSpec,
    GpuDevice, PauseToken, Root,
};

/// Whether container jobs here get cgroups of their own (a job's memory and process
/// limits for its whole tree): tried by making, and removing, one empty group the way a
/// job's is made. Without them jobs fall back to per-process rlimits.
pub fn cgroups_delegated() -> bool {
    let name = format!("gpunode-probe-{}", std::process::id());
    cgroup::JobCgroup::create(&name, 64 << 20, 16, 0).is_some()
}
