//! A [`JobRequest`] built step by step: [`JobRequest::new`] starts from what
//! `gpunode run` asks without flags, and each setter changes one thing.

use std::path::PathBuf;

use super::requester::{ContainerRequest, JobRequest};

impl JobRequest {
    /// Runs `module` with its outputs in `output_dir`, on what `gpunode run` asks for
    /// without flags: no GPU, one CPU, 512 MiB, ten minutes, two retries, one replica.
    pub fn new(module: impl Into<PathBuf>, output_dir: impl Into<PathBuf>) -> JobRequest {
        JobRequest {
            module: module.into(),
            container: None,
            inputs: Vec::new(),
            output_dir: output_dir.into(),
            output_per_job: false,
            args: Vec::new(),
            env: Vec::new(),
            gpus: 0,
            gpu_model: None,
            gpu_slice: None,
            cpus: 1,
            mem_bytes: 512 << 20,
            timeout_ms: 600_000,
            max_price: None,
            peer: None,
            retries: 2,
            fuel: None,
            replicas: 1,
            kind: Default::default(),
            wait: None,
            reservation: None,
            max_output_bytes: None,
            max_output_files: None,
            allow_relayed_data: false,
        }
    }

    /// Lets the job's data go through a team relay when no direct connection works.
    pub fn allow_relayed_data(mut self, allowed: bool) -> JobRequest {
        self.allow_relayed_data = allowed;
        self
    }

    /// Runs this native command in a container instead of the module.
    pub fn container(mut self, container: ContainerRequest) -> JobRequest {
        self.container = Some(container);
        self
    }

    /// Shows this file or directory under `/input`.
    pub fn input(mut self, path: impl Into<PathBuf>) -> JobRequest {
        self.inputs.push(path.into());
        self
    }

    /// The task's arguments after the program name.
    pub fn args<S: Into<String>>(mut self, args: impl IntoIterator<Item = S>) -> JobRequest {
        self.args = args.into_iter().map(Into::into).collect();
        self
    }

    /// Sets one environment variable for the task.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> JobRequest {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Leases this many GPUs.
    pub fn gpus(mut self, gpus: u32) -> JobRequest {
        self.gpus = gpus;
        self
    }

    /// A MIG slice of this profile instead of whole GPUs.
    pub fn gpu_slice(mut self, profile: impl Into<String>) -> JobRequest {
        self.gpu_slice = Some(profile.into());
        self
    }

    /// Leases this many CPU cores.
    pub fn cpus(mut self, cpus: u32) -> JobRequest {
        self.cpus = cpus;
        self
    }

    /// Leases this much RAM (also the task's memory limit), bytes.
    pub fn mem_bytes(mut self, bytes: u64) -> JobRequest {
        self.mem_bytes = bytes;
        self
    }

    /// The task's wall-clock limit, ms.
    pub fn timeout_ms(mut self, ms: u64) -> JobRequest {
        self.timeout_ms = ms;
        self
    }

    /// Runs on this provider (peer id) only.
    pub fn peer(mut self, peer: impl Into<String>) -> JobRequest {
        self.peer = Some(peer.into());
        self
    }

    /// Tries this many other providers after a failure.
    pub fn retries(mut self, retries: u32) -> JobRequest {
        self.retries = retries;
        self
    }

    /// Runs on this many providers and compares the outputs.
    pub fn replicas(mut self, replicas: u32) -> JobRequest {
        self.replicas = replicas;
        self
    }

    /// Waits for a provider (`true`) or fails at once (`false`) when none can take it.
    pub fn wait(mut self, wait: bool) -> JobRequest {
        self.wait = Some(wait);
        self
    }

    /// Runs inside this reservation (lease id or prefix).
    pub fn reservation(mut self, lease: impl Into<String>) -> JobRequest {
        self.reservation = Some(lease.into());
        self
    }

    /// Accepts at most this many bytes of outputs.
    pub fn max_output_bytes(mut self, bytes: u64) -> JobRequest {
        self.max_output_bytes = Some(bytes);
        self
    }
}
