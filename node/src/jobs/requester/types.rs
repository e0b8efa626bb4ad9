//! What a job is and what happens to it, as the API and the CLI see them: the request,
//! its events, its summary, its errors.

use std::path::PathBuf;

use gpunode_protocol::job::{JobOutcome, JobReport};
use gpunode_protocol::lease::QueuePlace;
use serde::{Deserialize, Serialize};

use super::outputs;
use crate::LeaseError;

/// A container job's program, with paths on this machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContainerRequest {
    /// The image archive (`docker save`, OCI archive) to run in; `None` runs on the
    /// provider's own system software (`--host-env`).
    pub image: Option<PathBuf>,
    /// Program and arguments (empty: the image's entrypoint and cmd).
    pub command: Vec<String>,
}

/// What to run, with paths on this machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRequest {
    /// The task: a `.wasm` module or `.wat` text (for container jobs, what `jobs`
    /// shows as the task: the image or the command).
    pub module: PathBuf,
    /// Run a native command in a container (the `container` backend) instead of the
    /// module.
    #[serde(default)]
    pub container: Option<ContainerRequest>,
    /// Files or directories shown under `/input` by their names.
    #[serde(default)]
    pub inputs: Vec<PathBuf>,
    /// Where output files go (absolute).
    pub output_dir: PathBuf,
    /// Put outputs in a subdirectory of `output_dir` named by the job id.
    #[serde(default)]
    pub output_per_job: bool,
    /// Arguments after the program name.
    #[serde(default)]
    pub args: Vec<String>,
    /// Environment for the task.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// GPUs to lease.
    #[serde(default)]
    pub gpus: u32,
    /// GPU model or family.
    #[serde(default)]
    pub gpu_model: Option<String>,
    /// A MIG slice profile (`1g.18gb`) instead of whole GPUs.
    #[serde(default)]
    pub gpu_slice: Option<String>,
    /// CPU cores to lease.
    pub cpus: u32,
    /// RAM to lease (also the task's memory limit), bytes.
    pub mem_bytes: u64,
    /// Wall-clock limit of the task, ms.
    pub timeout_ms: u64,
    /// Highest acceptable credits per GPU-hour.
    #[serde(default)]
    pub max_price: Option<f64>,
    /// Ask this provider only.
    #[serde(default)]
    pub peer: Option<String>,
    /// Other providers to try after a failure.
    pub retries: u32,
    /// Fuel budget (deterministic metering).
    #[serde(default)]
    pub fuel: Option<u64>,
    /// Run on this many providers and compare outputs (deterministic tasks only);
    /// 0 or 1 runs once.
    #[serde(default)]
    pub replicas: u32,
    /// Interactive (default) or batch work, for team policies' time windows.
    #[serde(default)]
    pub kind: gpunode_protocol::team::JobKind,
    /// When no provider can take the job now: wait and ask again (`true`), or fail at
    /// once (`false`). `None`: wait inside a team, fail fast outside one.
    #[serde(default)]
    pub wait: Option<bool>,
    /// Run inside this reservation (lease id or prefix) instead of finding a provider.
    #[serde(default)]
    pub reservation: Option<String>,
    /// Cap on the total size of the outputs (default
    /// [`outputs::DEFAULT_MAX_OUTPUT_BYTES`]).
    #[serde(default)]
    pub max_output_bytes: Option<u64>,
    /// Cap on the number of output files (default
    /// [`outputs::DEFAULT_MAX_OUTPUT_FILES`]).
    #[serde(default)]
    pub max_output_files: Option<u32>,
    /// Send this job's data through a team relay when the provider cannot be reached
    /// directly (hole punching failed); otherwise such a provider is refused.
    #[serde(default)]
    pub allow_relayed_data: bool,
}

impl JobRequest {
    /// What this job's provider may write here.
    pub fn output_limits(&self) -> outputs::OutputLimits {
        let default = outputs::OutputLimits::default();
        outputs::OutputLimits {
            max_bytes: self.max_output_bytes.unwrap_or(default.max_bytes),
            max_files: self.max_output_files.unwrap_or(default.max_files),
        }
    }
}

/// Why a waiting job is not running: what each provider asked said.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiting {
    /// When it started waiting.
    pub since_ms: u64,
    /// Provider (or `-` when none offers what was asked) and its reason.
    pub reasons: Vec<(String, String)>,
    /// The best place it holds in a provider's queue (soonest estimated start).
    #[serde(default)]
    pub queue: Option<(String, QueuePlace)>,
}

/// Something that happened to a job, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum JobEvent {
    /// A provider granted a lease.
    Leased {
        /// The provider.
        provider: String,
        /// The lease.
        lease_id: String,
        /// Its price.
        price_per_gpu_hour: f64,
    },
    /// Bytes moved for one file.
    Progress {
        /// `upload` or `download`.
        direction: String,
        /// Which file.
        name: String,
        /// Bytes so far.
        done: u64,
        /// Bytes in all.
        total: u64,
    },
    /// The task started on the provider.
    Started {
        /// The provider.
        provider: String,
    },
    /// Task stdout.
    Stdout {
        /// The bytes.
        #[serde(with = "base64_bytes")]
        data: Vec<u8>,
    },
    /// Task stderr.
    Stderr {
        /// The bytes.
        #[serde(with = "base64_bytes")]
        data: Vec<u8>,
    },
    /// No provider can take the job now: it waits and asks again.
    Waiting {
        /// Provider (or `-`) and why it cannot take the job.
        reasons: Vec<(String, String)>,
        /// The best place it holds in a provider's queue.
        #[serde(default)]
        queue: Option<(String, QueuePlace)>,
    },
    /// The provider failed; trying another.
    Retrying {
        /// The provider that failed.
        provider: String,
        /// What happened.
        reason: String,
        /// Attempt about to start (2 = first retry).
        attempt: u32,
    },
    /// The task's result and its output files are in; the receipt may not be settled
    /// yet, so the summary's cost can still be an estimate (`receipt: pending`).
    /// `finished` follows once it settles (or its wait ends). A follower sees this kind
    /// only when it asks for it ([`JobEvent::ASKED_FOR`]).
    Done {
        /// The summary so far.
        summary: Box<JobSummary>,
    },
    /// The job ended with a result.
    Finished {
        /// What happened.
        summary: Box<JobSummary>,
    },
    /// The job could not be run.
    Failed {
        /// Why.
        error: String,
    },
}

impl JobEvent {
    /// Every kind of event, as `type` names it on the wire.
    pub const KINDS: [&'static str; 10] = [
        "leased", "progress", "started", "stdout", "stderr", "waiting", "retrying", "done",
        "finished", "failed",
    ];

    /// Kinds a follower gets only when it names them (`with`), so one older than them
    /// never meets a kind it cannot read.
    pub const ASKED_FOR: [&'static str; 1] = ["done"];

    /// This event's kind, as its `type` on the wire.
    pub fn kind(&self) -> &'static str {
        match self {
            JobEvent::Leased { .. } => "leased",
            JobEvent::Progress { .. } => "progress",
            JobEvent::Started { .. } => "started",
            JobEvent::Stdout { .. } => "stdout",
            JobEvent::Stderr { .. } => "stderr",
            JobEvent::Waiting { .. } => "waiting",
            JobEvent::Retrying { .. } => "retrying",
            JobEvent::Done { .. } => "done",
            JobEvent::Finished { .. } => "finished",
            JobEvent::Failed { .. } => "failed",
        }
    }
}

mod base64_bytes {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(serde::de::Error::custom)
    }
}

/// The end of a job, for the summary line and `gpunode jobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSummary {
    /// The provider that ran it.
    pub provider: String,
    /// The lease it ran under.
    pub lease_id: String,
    /// How it ended.
    pub outcome: JobOutcome,
    /// Exit code for the shell: the task's own, or a conventional one (see `exit_code`).
    pub exit_code: i32,
    /// From lease to last output byte, ms.
    pub wall_ms: u64,
    /// Time the task ran on the provider, ms.
    pub run_ms: u64,
    /// Credits: the settled receipt's amount (the sum over replicas), or while a
    /// receipt is not settled, price per GPU-hour × GPUs (at least one) × wall time.
    pub cost: f64,
    /// Where the receipt stands: `settled`, `refused: REASON` or `pending`.
    #[serde(default)]
    pub receipt: String,
    /// Digest of the outputs and exit status (hex), what replicas compare.
    #[serde(default)]
    pub output_digest: String,
    /// With `--replicas`: each run, its provider, digest and whether it agreed.
    #[serde(default)]
    pub replicas: Vec<ReplicaView>,
    /// Where outputs were written.
    pub output_dir: PathBuf,
    /// Output files, relative to `output_dir`.
    pub outputs: Vec<String>,
    /// Providers tried.
    pub attempts: u32,
    /// Whether the provider had the compiled module cached.
    pub module_cached: bool,
    /// GPU use the provider measured (jobs that held GPUs).
    #[serde(default)]
    pub gpu: Option<gpunode_protocol::job::GpuUse>,
}

/// One replica of a replicated job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaView {
    /// Who ran it.
    pub provider: String,
    /// Its output digest (hex).
    pub output_digest: String,
    /// Whether it agreed with the majority.
    pub agrees: bool,
}

/// Exit code a shell sees for an outcome: the task's code when it exited (0..=255),
/// 124 for a timeout (like `timeout(1)`), 130 when cancelled, 137 when out of memory,
/// 1 otherwise.
pub fn exit_code(outcome: &JobOutcome) -> i32 {
    match outcome {
        JobOutcome::Exited(c) if (0..=255).contains(c) => *c,
        JobOutcome::TimedOut => 124,
        JobOutcome::Cancelled => 130,
        JobOutcome::OutOfMemory => 137,
        _ => 1,
    }
}

/// Why a job could not run.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// A local file or the request itself is wrong; nothing was leased.
    #[error("{0}")]
    Invalid(String),
    /// No lease could be had.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// Every attempt failed.
    #[error("{0}")]
    Failed(String),
    /// Cancelled before it started.
    #[error("cancelled")]
    Cancelled,
}

/// What replicas compare: the outputs' digest and how the task ended, hex.
pub(super) fn replica_digest(report: &JobReport) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&gpunode_protocol::receipt::job_output_digest(
        &report.outputs,
    ));
    h.update(crate::jobs::provider::outcome_status(&report.outcome).as_bytes());
    h.finalize().to_hex().to_string()
}
