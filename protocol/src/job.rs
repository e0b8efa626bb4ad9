//! The job protocol (`/gpunode/job/1.0.0`): what a requester and a provider say on the
//! one stream that carries a job under an active lease.
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

/// What the requester asks the provider to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSubmit {
    /// [`JOB_VERSION`].
    pub version: u16,
    /// The active lease the job runs under.
    pub lease_id: LeaseId,
    /// The task module (`.wasm` binary or `.wat` text).
    pub module: BlobRef,
    /// Files shown read-only under `/input`.
    pub inputs: Vec<JobFile>,
    /// Arguments after the program name.
    pub args: Vec<String>,
    /// Environment, exactly as given.
    pub env: Vec<(String, String)>,
    /// Wall-clock limit; the lease's end applies too.
    pub timeout_ms: u64,
    /// Fuel budget for deterministic metering, if wanted.
    pub fuel: Option<u64>,
}

impl JobSubmit {
    /// Bytes the provider must hold for this job: the module plus every input.
    pub fn input_bytes(&self) -> u64 {
        self.inputs
            .iter()
            .fold(self.module.size, |n, f| n.saturating_add(f.blob.size))
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
    /// The module is not a runnable WASI command.
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
        }
    }
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
            module: BlobRef {
                hash: [1; 32],
                size: 10,
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
            fuel: None,
        });
        let bytes = encode(&msg);
        assert_eq!(decode::<RequesterMsg>(&bytes, MAX_MESSAGE_BYTES), Ok(msg));
        assert!(decode::<RequesterMsg>(&bytes[..bytes.len() - 3], MAX_MESSAGE_BYTES).is_err());
        assert!(decode::<ProviderMsg>(&[9, 9, 9, 9], MAX_MESSAGE_BYTES).is_err());
    }
}
