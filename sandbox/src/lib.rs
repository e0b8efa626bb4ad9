//! Task executors: where a leased task actually runs.
//!
//! [`wasm::WasmExecutor`] runs WASI preview 1 modules (`.wasm` or `.wat`) in wasmtime with
//! every limit a provider promises, in a thread or in a worker process
//! ([`wasm::Isolation`]): wall-clock deadline, optional
//! fuel, linear memory and table limits, stdout/stderr caps, output-directory size and
//! file-count caps, no network, and a filesystem of exactly `/input` (read-only) and
//! `/output` (writable). Each run ends in one distinct [`wasm::Outcome`].
//!
//! [`container::ContainerExecutor`] runs native commands (CUDA, PyTorch) under bubblewrap:
//! own namespaces, no network, a read-only root (an unpacked OCI image, see
//! [`container::image`], or the host's system directories), cgroup or rlimit limits, only
//! the leased GPUs' device nodes, and the whole process tree killed at the end.
//!
//! This crate does no networking and never imports the node.

pub mod container;
pub mod wasm;

pub use wasm::{
    CancelToken, CompiledTask, Isolation, Limits, Outcome, RunSpec, SandboxError, WasmExecutor,
};
