//! The job protocol (`/gpunode/job/1.0.0`, and `/gpunode/job-ends-lease/1.0.0` for a
//! lease's only job, after which the provider ends the lease): what a requester and a
//! provider say on the one stream that carries a job under an active lease.
//!
//! ```text
//! requester                                   provider
//!   Submit(JobSubmit) ───────────────────────▶ checks lease, sizes, backend
//!                     ◀─────────────────────── Accepted { missing } | Rejected
//!   data chunks of each missing blob ────────▶ verified by blake3, cached
//!                     ◀─────────────────────── Started, Stdout/Stderr ..., Finished
//!                     ◀─────────────────────── data chunks of each output file
//!   Cancel (any time) ───────────────────────▶
//! ```
//!
//! Every message is a frame: one tag byte, a little-endian u32 length, then the body.
//! Tag [`FRAME_MESSAGE`] bodies are canonical bincode of [`RequesterMsg`] or
//! [`ProviderMsg`] (at most [`MAX_MESSAGE_BYTES`]); tag [`FRAME_DATA`] bodies are raw
//! bytes of the blob being sent (at most [`MAX_CHUNK_BYTES`]). Blobs (the module, input
//! and output files) are content addressed: named by the blake3 hash of their bytes.

use serde::{Deserialize, Serialize};

use crate::lease::LeaseId;

/// Version of the job messages.
pub const JOB_VERSION: u16 = 1;
/// Frame tag of a message.
pub const FRAME_MESSAGE: u8 = 0;
/// Frame tag of a chunk of blob data.
pub const FRAME_DATA: u8 = 1;
/// Largest message body.
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// Largest data chunk.
pub const MAX_CHUNK_BYTES: usize = 1024 * 1024;
/// Largest stdout or stderr piece in one message.
pub const MAX_LOG_PIECE: usize = 64 * 1024;
/// Most input files in one job.
pub const MAX_INPUT_FILES: usize = 4096;
/// Longest relative path of an input or output file.
pub const MAX_PATH_LEN: usize = 1024;

/// blake3 hash of a blob's bytes.
pub type BlobHash = [u8; 32];

/// A blob by content: hash and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlobRef {
    /// blake3 of the bytes.
    pub hash: BlobHash,
    /// Length in bytes.
    pub size: u64,
}

impl BlobRef {
    /// The hash as lowercase hex.
    pub fn hex(&self) -> String {
        self.hash.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// A file the task sees under `/input` (or left in `/output`), by relative path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobFile {
    /// Relative path with `/` separators, no `..`, no leading `/`.
    pub path: String,
    /// Its content.
    pub blob: BlobRef,
}

/// What runs: a WASI module, or a native command in a container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Program {
    /// A WASI preview 1 module (`.wasm` binary or `.wat` text); needs a `wasm` lease.
    Wasm {
        /// The module.
        module: BlobRef,
        /// Fuel budget for deterministic metering, if wanted.
        fuel: Option<u64>,
    },
    /// A command under bubblewrap; needs a `container` lease.
    Container {
        /// An image archive (`docker save`, OCI archive), or `None` for the provider's
        /// own system software read-only (`--host-env`, where the provider allows it).
        image: Option<BlobRef>,
        /// Program and arguments; empty runs the image's entrypoint and cmd.
        command: Vec<String>,
    },
}

impl Program {
    /// The blob the program itself needs (the module or the image), if any.
    pub fn blob(&self) -> Option<BlobRef> {
        match self {
            Program::Wasm { module, .. } => Some(*module),
            Program::Container { image, .. } => *image,
        }
    }

    /// The lease backend it runs on.
    pub fn backend(&self) -> &'static str {
        match self {
            Program::Wasm { .. } => "wasm",
            Program::Container { .. } => "container",
        }
    }
}

/// What the requester asks the provider to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSubmit {
    /// [`JOB_VERSION`].
    pub version: u16,
    /// The active lease the job runs under.
    pub lease_id: LeaseId,
    /// The module or container to run.
    pub program: Program,
    /// Files shown read-only under `/input`.
    pub inputs: Vec<JobFile>,
    /// Arguments after the program name.
    pub args: Vec<String>,
    /// Environment, exactly as given.
    pub env: Vec<(String, String)>,
    /// Wall-clock limit; the lease's end applies too.
    pub timeout_ms: u64,
}

impl JobSubmit {
    /// Bytes the provider must hold for this job: the module or image plus every input.
    pub fn input_bytes(&self) -> u64 {
        let program = self.program.blob().map_or(0, |b| b.size);
        self.inputs
            .iter()
            .fold(program, |n, f| n.saturating_add(f.blob.size))
    }

    /// Every blob the job needs: the program's, then the inputs'.
    pub fn blobs(&self) -> Vec<BlobRef> {
        let mut all: Vec<BlobRef> = self.program.blob().into_iter().collect();
        all.extend(self.inputs.iter().map(|f| f.blob));
        all
    }
}

/// Requester to provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RequesterMsg {
    /// Run this job.
    Submit(JobSubmit),
    /// Stop the job now.
    Cancel,
}

/// Why a provider would not take a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobRefusal {
    /// No such lease here.
    UnknownLease,
    /// The lease belongs to someone else.
    NotYourLease,
    /// The lease is not active (ended, cancelled, not yet accepted).
    LeaseNotActive,
    /// The lease is for another backend.
    WrongBackend,
    /// Module and inputs are larger than the provider accepts.
    TooLarge,
    /// The module is not a runnable WASI command, or the image is not a usable image.
    InvalidModule,
    /// Malformed request (paths, version, counts).
    BadRequest,
    /// A blob did not match its hash.
    Corrupt,
    /// The provider failed on its side (disk, sandbox).
    ProviderError,
}

impl JobRefusal {
    /// A label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            JobRefusal::UnknownLease => "unknown_lease",
            JobRefusal::NotYourLease => "not_your_lease",
            JobRefusal::LeaseNotActive => "lease_not_active",
            JobRefusal::WrongBackend => "wrong_backend",
            JobRefusal::TooLarge => "too_large",
            JobRefusal::InvalidModule => "invalid_module",
            JobRefusal::BadRequest => "bad_request",
            JobRefusal::Corrupt => "corrupt",
            JobRefusal::ProviderError => "provider_error",
        }
    }
}

/// A refusal with a sentence that says what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRejection {
    /// Machine-readable reason.
    pub code: JobRefusal,
    /// For people.
    pub message: String,
}

/// How a job ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobOutcome {
    /// The task exited with this code.
    Exited(i32),
    /// The task trapped.
    Trapped(String),
    /// Its wall-clock limit (or the lease's end) passed.
    TimedOut,
    /// Its fuel ran out.
    OutOfFuel,
    /// It wanted more memory than the lease grants.
    OutOfMemory,
    /// stdout, stderr or `/output` went over its cap (which is said).
    OutputTooLarge(String),
    /// Cancelled by the requester or because the lease ended.
    Cancelled,
    /// Stopped because the GPU's owner came back; only the time used is charged and
    /// the requester may retry elsewhere.
    Preempted,
}

impl JobOutcome {
    /// A label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            JobOutcome::Exited(_) => "exited",
            JobOutcome::Trapped(_) => "trapped",
            JobOutcome::TimedOut => "timed_out",
            JobOutcome::OutOfFuel => "out_of_fuel",
            JobOutcome::OutOfMemory => "out_of_memory",
            JobOutcome::OutputTooLarge(_) => "output_too_large",
            JobOutcome::Cancelled => "cancelled",
            JobOutcome::Preempted => "preempted",
        }
    }
}

/// A job's use of its leased GPUs, measured by the provider from the driver's process
/// lists at each inventory poll.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuUse {
    /// Milliseconds, summed over the leased GPUs, during which a process of the job was
    /// on the GPU.
    pub gpu_ms: u64,
    /// Most GPU memory the job's processes held at once, bytes.
    pub peak_memory_bytes: u64,
    /// Compute use of its GPUs at the last sample, percent (mean over the leased GPUs).
    pub utilization_percent: u32,
    /// How many samples were taken.
    pub samples: u32,
}

/// The end of a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobReport {
    /// How it ended.
    pub outcome: JobOutcome,
    /// Time the task ran, milliseconds.
    pub run_ms: u64,
    /// Whether the provider already had the compiled module.
    pub module_cached: bool,
    /// Files left in `/output`, sent after this message in this order.
    pub outputs: Vec<JobFile>,
    /// GPU use, for jobs that held GPUs.
    pub gpu: Option<GpuUse>,
}

/// Provider to requester.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProviderMsg {
    /// Taken; send the data of these blobs (in this order), the others are cached here.
    Accepted {
        /// Blobs to send.
        missing: Vec<BlobHash>,
    },
    /// Not taken.
    Rejected(JobRejection),
    /// The task started.
    Started,
    /// A piece of the task's stdout.
    Stdout(Vec<u8>),
    /// A piece of the task's stderr.
    Stderr(Vec<u8>),
    /// The task ended; output files follow.
    Finished(JobReport),
}

/// Checks a relative path from the other side: `/` separated, no empty, `.` or `..`
/// parts, no leading `/`, no NUL, bounded length.
pub fn check_relative_path(path: &str) -> Result<(), String> {
    if path.is_empty() || path.len() > MAX_PATH_LEN {
        return Err(format!(
            "path '{path}' must have 1 to {MAX_PATH_LEN} characters"
        ));
    }
    if path.starts_with('/') || path.contains('\0') || path.contains('\\') {
        return Err(format!(
            "path '{path}' must be relative, without '\\' or NUL"
        ));
    }
    if path
        .split('/')
        .any(|part| part.is_empty() || part == "." || part == "..")
    {
        return Err(format!(
            "path '{path}' must not contain empty, '.' or '..' parts"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoding::{decode, encode};

    #[test]
    fn paths_that_escape_are_refused() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a//b",
            "./a",
            "a\\b",
            "a\0b",
        ] {
            assert!(check_relative_path(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["a", "dir/file.txt", "x/y/z.bin", "..a", "a.."] {
            assert!(check_relative_path(good).is_ok(), "{good:?} refused");
        }
        assert!(check_relative_path(&"a".repeat(MAX_PATH_LEN + 1)).is_err());
    }

    #[test]
    fn messages_round_trip_and_garbage_is_an_error() {
        let msg = RequesterMsg::Submit(JobSubmit {
            version: JOB_VERSION,
            lease_id: LeaseId([7; 16]),
            program: Program::Container {
                image: Some(BlobRef {
                    hash: [1; 32],
                    size: 10,
                }),
                command: vec!["python".into(), "train.py".into()],
            },
            inputs: vec![JobFile {
                path: "a/b".into(),
                blob: BlobRef {
                    hash: [2; 32],
                    size: 5,
                },
            }],
            args: vec!["x".into()],
            env: vec![("K".into(), "V".into())],
            timeout_ms: 1000,
        });
        let bytes = encode(&msg);
        assert_eq!(decode::<RequesterMsg>(&bytes, MAX_MESSAGE_BYTES), Ok(msg));
        assert!(decode::<RequesterMsg>(&bytes[..bytes.len() - 3], MAX_MESSAGE_BYTES).is_err());
        assert!(decode::<ProviderMsg>(&[9, 9, 9, 9], MAX_MESSAGE_BYTES).is_err());
    }
}
