//! The requester's side of a job: check the task locally (an invalid module never costs
//! a lease), hash the module and inputs, lease a provider, upload only what it lacks,
//! relay stdout and stderr as they arrive, download and verify the output files, and
//! retry on another provider when one vanishes or fails before the task ends.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{AsyncReadExt, AsyncWriteExt};
use gpunode_protocol::job::{
    check_relative_path, BlobHash, BlobRef, JobFile, JobOutcome, JobRefusal, JobReport, JobSubmit,
    Program, ProviderMsg, RequesterMsg, JOB_VERSION, MAX_INPUT_FILES, MAX_MESSAGE_BYTES,
};
use gpunode_protocol::lease::{LeaseId, QueuePlace};
use gpunode_protocol::time::now_ms;
use libp2p::PeerId;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::JOB_PROTOCOL;
use super::{outputs, wire};
use crate::ledger::reputation::Outcome;
use crate::ledger::settle::ReceiptStatus;
use crate::router::framing;
use crate::{LeaseError, LeaseSpec, LeaseView};

/// How long after the task's timeout the lease runs, for transfers on both ends.
const LEASE_MARGIN_MS: u64 = 120_000;
/// How long opening the job stream may take.
const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long past its lease's end an attempt may still take before it is given up.
const ATTEMPT_GRACE: Duration = Duration::from_secs(30);
/// How long a finished job waits for its provider's receipt before reporting the cost
/// as an estimate.
const RECEIPT_WAIT: Duration = Duration::from_secs(10);
/// Why an attempt ended when the provider went silent.
const STOPPED_ANSWERING: &str = "the provider stopped answering";
/// Why an attempt ended when the provider stopped the job unasked.
const STOPPED_UNASKED: &str = "the provider stopped the job before it ended";
/// Why an attempt ended when the provider's owner took the GPU back.
const PREEMPTED: &str =
    "the provider's owner took the GPU back (preempted; only the time used is charged)";
/// A waiting job asks again after this, then twice as long each time, up to
/// [`MAX_WAIT_POLL`].
const FIRST_WAIT_POLL: Duration = Duration::from_secs(1);
/// The longest a waiting job goes without asking again.
const MAX_WAIT_POLL: Duration = Duration::from_secs(10);
/// How often a job waiting in providers' queues asks again (well inside the time a
/// provider keeps a place that nobody asks for: `QUEUE_STALE_MS`).
const QUEUED_POLL: Duration = Duration::from_millis(200);
/// How long after a reservation's start its job is sent (the provider activates it at
/// its next tick).
const RESERVATION_START_MARGIN_MS: u64 = 300;
/// How long a cancelled job may take to report back.
const CANCEL_GRACE: Duration = Duration::from_secs(5);

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
fn replica_digest(report: &JobReport) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&gpunode_protocol::receipt::job_output_digest(
        &report.outputs,
    ));
    h.update(super::provider::outcome_status(&report.outcome).as_bytes());
    h.finalize().to_hex().to_string()
}

/// One input file on this machine.
struct LocalFile {
    file: JobFile,
    path: PathBuf,
}

/// The job with everything hashed, ready to send to any provider.
pub(super) struct Prepared {
    /// The module's bytes (wasm jobs; empty for containers).
    module: Vec<u8>,
    /// The image archive on disk (container jobs with an image).
    image: Option<PathBuf>,
    program: Program,
    inputs: Vec<LocalFile>,
}

impl Prepared {
    /// What the provider is sent for this job under `lease_id`.
    fn submit(&self, req: &JobRequest, lease_id: LeaseId) -> JobSubmit {
        JobSubmit {
            version: JOB_VERSION,
            lease_id,
            program: self.program.clone(),
            inputs: self.inputs.iter().map(|f| f.file.clone()).collect(),
            args: req.args.clone(),
            env: req.env.clone(),
            timeout_ms: req.timeout_ms,
        }
    }
}

/// How one attempt ended.
enum Attempt {
    Done(JobReport),
    /// The provider refused or failed; another may do.
    Retry(String),
    /// No provider can do this (the module or request is bad).
    Fatal(String),
}

/// The requester's side of jobs: prepares a task, leases a provider, ships the task,
/// follows it, retries elsewhere, and pays.
#[derive(Clone)]
pub struct Requester {
    negotiator: crate::lease::negotiate::Negotiator,
    pub(super) accounts: Arc<crate::Accounts>,
    control: libp2p_stream::Control,
    executor: Arc<gpunode_sandbox::WasmExecutor>,
    in_team: bool,
}

impl std::fmt::Debug for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Requester").finish_non_exhaustive()
    }
}

impl Requester {
    /// A requester negotiating with `negotiator`, paying from `accounts`, opening job
    /// streams with `control` and compiling tasks with `executor`; `in_team` makes
    /// jobs wait in queues by default.
    pub fn new(
        negotiator: crate::lease::negotiate::Negotiator,
        accounts: Arc<crate::Accounts>,
        control: libp2p_stream::Control,
        executor: Arc<gpunode_sandbox::WasmExecutor>,
        in_team: bool,
    ) -> Requester {
        Requester {
            negotiator,
            accounts,
            control,
            executor,
            in_team,
        }
    }

    /// Runs a job to its end, reporting each step to `events`. `cancel` turning true
    /// stops it (the provider is told, the lease is cancelled).
    pub async fn run_job(
        &self,
        req: JobRequest,
        events: &mut (dyn FnMut(JobEvent) + Send),
        mut cancel: watch::Receiver<bool>,
    ) -> Result<JobSummary, JobError> {
        let mut req = req;
        // Outputs never mix with files already there: an existing directory gets a new
        // one for this job inside it (`submit_job` names it by the job id).
        req.output_dir = outputs::final_dir(
            &req.output_dir,
            &format!("job-{:08x}", rand::random::<u32>()),
        );
        let prepared = self.prepare(&req).await?;
        if req.replicas <= 1 {
            return self
                .run_once(&req, &prepared, events, &mut cancel, Vec::new())
                .await;
        }
        self.run_replicated(&req, &prepared, events, &mut cancel)
            .await
    }

    /// One run on one provider (retrying on others after failures), avoiding `exclude`.
    pub(super) async fn run_once(
        &self,
        req: &JobRequest,
        prepared: &Prepared,
        events: &mut (dyn FnMut(JobEvent) + Send),
        cancel: &mut watch::Receiver<bool>,
        mut exclude: Vec<String>,
    ) -> Result<JobSummary, JobError> {
        let mut attempt = 0;
        let wait = req.wait.unwrap_or(self.in_team);
        let mut backoff = FIRST_WAIT_POLL;
        // One ticket for the whole job, so providers keep its place in their queues.
        let ticket: u128 = rand::random();
        let mut last_reasons: Option<Vec<(String, String)>> = None;
        loop {
            attempt += 1;
            if *cancel.borrow() {
                return Err(JobError::Cancelled);
            }
            let spec = LeaseSpec {
                peer: req.peer.clone(),
                gpus: req.gpus,
                gpu_model: req.gpu_model.clone(),
                gpu_slice: req.gpu_slice.clone(),
                min_gpu_mem_bytes: None,
                cpus: req.cpus,
                mem_bytes: req.mem_bytes,
                backend: if req.container.is_some() {
                    "container"
                } else {
                    "wasm"
                }
                .into(),
                duration_ms: req.timeout_ms.saturating_add(LEASE_MARGIN_MS),
                max_price: req.max_price,
                exclude: exclude.clone(),
                kind: req.kind,
                ticket: wait.then_some(ticket),
                start_at_ms: None,
            };
            let asked = match &req.reservation {
                Some(prefix) => self
                    .reserved_lease(prefix, req, events, cancel)
                    .await?
                    .map_err(LeaseError::Invalid),
                None => self.negotiator.request_lease(spec).await,
            };
            let lease = match asked {
                Ok(l) => l,
                Err(e) if attempt == 1 && wait && waitable(&e) => {
                    let reasons = wait_reasons(&e);
                    let queue = match &e {
                        LeaseError::Queued { queued, .. } => queued.first().cloned(),
                        _ => None,
                    };
                    if last_reasons.as_ref() != Some(&reasons) {
                        events(JobEvent::Waiting {
                            reasons: reasons.clone(),
                            queue: queue.clone(),
                        });
                        last_reasons = Some(reasons);
                    }
                    attempt = 0;
                    if queue.is_some() {
                        // A place in a queue is kept only by asking again soon.
                        backoff = QUEUED_POLL;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        changed = cancel.changed() => {
                            if changed.is_err() {
                                tokio::time::sleep(backoff).await;
                            }
                        }
                    }
                    backoff = (backoff * 2).min(MAX_WAIT_POLL);
                    continue;
                }
                Err(e) if attempt == 1 => return Err(e.into()),
                Err(e) => {
                    return Err(JobError::Failed(format!(
                        "{} provider(s) failed and no other is available: {e}",
                        attempt - 1
                    )))
                }
            };
            events(JobEvent::Leased {
                provider: lease.provider.clone(),
                lease_id: lease.lease_id.clone(),
                price_per_gpu_hour: lease.price_per_gpu_hour,
            });
            let started = Instant::now();
            // A provider that stops answering without dropping the connection cannot
            // hold the job past its lease.
            let watchdog =
                Duration::from_millis(lease.end_ms.saturating_sub(now_ms())) + ATTEMPT_GRACE;
            let outcome = tokio::time::timeout(
                watchdog,
                self.attempt(req, prepared, &lease, events, cancel),
            )
            .await
            .unwrap_or_else(|_| Attempt::Retry(STOPPED_ANSWERING.into()));
            let lease_key = lease.lease_id.parse::<LeaseId>().ok();
            self.observe(lease_key, &lease.provider, &outcome, started.elapsed());
            // The job is over on this lease either way: release the provider's resources
            // (in the background, so a dead provider does not hold up the retry).
            // A reservation stays for the next job in it.
            if req.reservation.is_none() {
                let node = self.clone();
                let lease_id = lease.lease_id.clone();
                tokio::spawn(async move {
                    let _ = node.negotiator.cancel_lease(&lease_id).await;
                });
            }
            match outcome {
                Attempt::Done(report) => {
                    let wall_ms = started.elapsed().as_millis() as u64;
                    // Until the receipt settles: priced like the lease's maximum (a lease
                    // without GPUs as one GPU) over the wall time.
                    let gpus = lease.gpus.len().max(1) as f64;
                    let mut cost = lease.price_per_gpu_hour * gpus * wall_ms as f64 / 3_600_000.0;
                    let receipt = match lease_key {
                        // Settled once, for the whole reservation, when it ends.
                        Some(_) if req.reservation.is_some() => {
                            "at the reservation's end".to_string()
                        }
                        Some(id) => match self.accounts.wait_receipt(&id, RECEIPT_WAIT).await {
                            ReceiptStatus::Settled(r) => {
                                cost = crate::ledger::credits(r.receipt.amount_millicredits);
                                "settled".to_string()
                            }
                            ReceiptStatus::Refused(why) => format!("refused: {why}"),
                            ReceiptStatus::Pending => "pending".to_string(),
                        },
                        None => "pending".to_string(),
                    };
                    let output_digest = replica_digest(&report);
                    return Ok(JobSummary {
                        provider: lease.provider.clone(),
                        lease_id: lease.lease_id.clone(),
                        exit_code: exit_code(&report.outcome),
                        outcome: report.outcome,
                        wall_ms,
                        run_ms: report.run_ms,
                        cost,
                        receipt,
                        output_digest,
                        replicas: Vec::new(),
                        output_dir: req.output_dir.clone(),
                        outputs: report.outputs.iter().map(|f| f.path.clone()).collect(),
                        attempts: attempt,
                        module_cached: report.module_cached,
                        gpu: report.gpu,
                    });
                }
                Attempt::Fatal(why) => return Err(JobError::Failed(why)),
                Attempt::Retry(why)
                    if attempt <= req.retries
                        && req.peer.is_none()
                        && req.reservation.is_none() =>
                {
                    events(JobEvent::Retrying {
                        provider: lease.provider.clone(),
                        reason: why,
                        attempt: attempt + 1,
                    });
                    exclude.push(lease.provider.clone());
                }
                Attempt::Retry(why) => {
                    return Err(JobError::Failed(format!(
                        "provider {} failed: {why}",
                        lease.provider
                    )))
                }
            }
        }
    }

    /// The reservation `prefix` names, once it has started (waiting for its start, and
    /// saying so); the inner error says why it cannot be used.
    async fn reserved_lease(
        &self,
        prefix: &str,
        req: &JobRequest,
        events: &mut (dyn FnMut(JobEvent) + Send),
        cancel: &mut watch::Receiver<bool>,
    ) -> Result<Result<crate::views::LeaseView, String>, JobError> {
        use crate::lease::{LeaseRole, LeaseState};
        let leases = self
            .negotiator
            .list_leases()
            .await
            .map_err(|e| JobError::Failed(e.to_string()))?;
        let found: Vec<_> = leases
            .into_iter()
            .filter(|l| l.role == LeaseRole::Requester && l.lease_id.starts_with(prefix.trim()))
            .collect();
        let lease = match found.as_slice() {
            [one] => one.clone(),
            [] => {
                return Ok(Err(format!(
                    "no reservation {prefix} of yours here; `gpunode reservations` lists them"
                )))
            }
            _ => {
                return Ok(Err(format!(
                    "'{prefix}' starts more than one lease id; give more of it"
                )))
            }
        };
        if !matches!(lease.state, LeaseState::Reserved | LeaseState::Active) {
            return Ok(Err(format!(
                "reservation {} is {}; book another with `gpunode reserve`",
                lease.lease_id,
                lease.state.label()
            )));
        }
        let start = lease.start_ms.max(now_ms());
        if start + req.timeout_ms > lease.end_ms {
            return Ok(Err(format!(
                "reservation {} ends at {}, before a job started then could use its --timeout of {} s; renew it (`gpunode reservations renew`) or give a shorter --timeout",
                lease.lease_id,
                gpunode_protocol::time::format_utc(lease.end_ms),
                req.timeout_ms / 1000
            )));
        }
        let wait_ms = lease.start_ms.saturating_sub(now_ms());
        if wait_ms > 0 {
            events(JobEvent::Waiting {
                reasons: vec![(
                    lease.provider.clone(),
                    format!(
                        "it runs in reservation {}, which starts at {}",
                        lease.lease_id,
                        gpunode_protocol::time::format_utc(lease.start_ms)
                    ),
                )],
                queue: None,
            });
            // A little past the start, so the provider has activated it.
            let until = Duration::from_millis(wait_ms + RESERVATION_START_MARGIN_MS);
            tokio::select! {
                _ = tokio::time::sleep(until) => {}
                _ = cancel.wait_for(|c| *c) => return Err(JobError::Cancelled),
            }
        }
        Ok(Ok(lease))
    }

    /// Notes what this attempt used (for checking the provider's receipt) and what it
    /// says about the provider (reputation).
    fn observe(&self, lease: Option<LeaseId>, provider: &str, outcome: &Attempt, took: Duration) {
        let accounts = &self.accounts;
        let ms = took.as_millis() as u64;
        let peer = provider.parse::<PeerId>().ok();
        let (status, digest, verdict) = match outcome {
            Attempt::Done(report) => (
                super::provider::outcome_status(&report.outcome),
                Some(gpunode_protocol::receipt::job_output_digest(
                    &report.outputs,
                )),
                Some(Outcome::JobDone),
            ),
            Attempt::Retry(why) if why == STOPPED_ANSWERING => {
                ("failed".into(), None, Some(Outcome::TimedOut))
            }
            Attempt::Retry(why) if why == STOPPED_UNASKED => {
                ("failed".into(), None, Some(Outcome::CancelledByProvider))
            }
            // The owner's right, announced in the provider's policy: no fault.
            Attempt::Retry(why) if why == PREEMPTED => ("preempted".into(), None, None),
            Attempt::Retry(_) => ("failed".into(), None, Some(Outcome::Failed)),
            Attempt::Fatal(_) => ("failed".into(), None, None),
        };
        if let Some(id) = lease {
            accounts.observed.add_job(id, ms, status, digest);
        }
        if let (Some(peer), Some(verdict)) = (peer, verdict) {
            accounts.reputation.record(peer, verdict);
        }
    }

    /// Reads, checks and hashes everything the job sends.
    async fn prepare(&self, req: &JobRequest) -> Result<Prepared, JobError> {
        if req.timeout_ms == 0 {
            return Err(JobError::Invalid(
                "the timeout must be positive, e.g. --timeout 10m".into(),
            ));
        }
        let (module, image, program) = match &req.container {
            Some(c) => {
                let blob = match &c.image {
                    Some(path) => Some(wire::hash_file(path).await.map_err(|e| {
                        JobError::Invalid(format!("cannot read image {}: {e}", path.display()))
                    })?),
                    None if c.command.is_empty() => {
                        return Err(JobError::Invalid(
                            "--host-env needs a command: gpunode run --backend container --host-env -- python train.py"
                                .into(),
                        ))
                    }
                    None => None,
                };
                let program = Program::Container {
                    image: blob,
                    command: c.command.clone(),
                };
                (Vec::new(), c.image.clone(), program)
            }
            None => {
                let module = self.read_module(req).await?;
                let program = Program::Wasm {
                    module: BlobRef {
                        hash: *blake3::hash(&module).as_bytes(),
                        size: module.len() as u64,
                    },
                    fuel: req.fuel,
                };
                (module, None, program)
            }
        };
        let mut inputs = Vec::new();
        for root in &req.inputs {
            collect_inputs(root, &mut inputs).await?;
        }
        if inputs.len() > MAX_INPUT_FILES {
            return Err(JobError::Invalid(format!(
                "{} input files; at most {MAX_INPUT_FILES} per job (pack them into an archive)",
                inputs.len()
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for f in &inputs {
            if !seen.insert(f.file.path.clone()) {
                return Err(JobError::Invalid(format!(
                    "two inputs are both named '{}' under /input; rename one",
                    f.file.path
                )));
            }
        }
        let prepared = Prepared {
            module,
            image,
            program,
            inputs,
        };
        let size = gpunode_protocol::encoding::encode(&RequesterMsg::Submit(
            prepared.submit(req, LeaseId([0; 16])),
        ))
        .len();
        if size > MAX_MESSAGE_BYTES {
            return Err(JobError::Invalid(format!(
                "the job's description (input names, arguments, environment) takes {size} bytes; at most {MAX_MESSAGE_BYTES} fit: pack the inputs into an archive"
            )));
        }
        Ok(prepared)
    }

    /// Reads the module and checks here that it is a runnable task, so that an invalid
    /// module never costs a lease.
    async fn read_module(&self, req: &JobRequest) -> Result<Vec<u8>, JobError> {
        let module = tokio::fs::read(&req.module).await.map_err(|e| {
            JobError::Invalid(format!(
                "cannot read task file {}: {e}",
                req.module.display()
            ))
        })?;
        let exec = self.executor.clone();
        let bytes = module.clone();
        let fuel = req.fuel.is_some();
        tokio::task::spawn_blocking(move || exec.compile(&bytes, fuel))
            .await
            .map_err(|e| JobError::Invalid(e.to_string()))?
            .map_err(|e| {
                JobError::Invalid(format!(
                    "{} is not a runnable task: {e}",
                    req.module.display()
                ))
            })?;
        Ok(module)
    }

    async fn attempt(
        &self,
        req: &JobRequest,
        prepared: &Prepared,
        lease: &LeaseView,
        events: &mut (dyn FnMut(JobEvent) + Send),
        cancel: &mut watch::Receiver<bool>,
    ) -> Attempt {
        let (Ok(provider), Ok(lease_id)) = (
            lease.provider.parse::<PeerId>(),
            lease.lease_id.parse::<LeaseId>(),
        ) else {
            return Attempt::Fatal("the lease names an invalid provider or id".into());
        };
        let mut control = self.control.clone();
        let stream =
            match tokio::time::timeout(OPEN_TIMEOUT, control.open_stream(provider, JOB_PROTOCOL))
                .await
            {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return Attempt::Retry(format!("cannot open a job stream: {e}")),
                Err(_) => return Attempt::Retry("opening a job stream timed out".into()),
            };
        let (mut r, mut w) = AsyncReadExt::split(stream);
        let submit = prepared.submit(req, lease_id);
        let lost = |e: std::io::Error| Attempt::Retry(format!("the provider went away: {e}"));
        if let Err(e) = framing::write_message(&mut w, &RequesterMsg::Submit(submit)).await {
            return lost(e);
        }
        if let Err(e) = w.flush().await {
            return lost(e);
        }
        let missing = match framing::read_message::<_, ProviderMsg>(&mut r).await {
            Ok(ProviderMsg::Accepted { missing }) => missing,
            Ok(ProviderMsg::Rejected(rej)) => return refused(rej),
            Ok(other) => return Attempt::Retry(format!("unexpected answer {other:?}")),
            Err(e) => return lost(e),
        };
        if let Err(e) = self.upload(prepared, &missing, &mut w, events).await {
            return lost(e);
        }

        // Follow the run; a cancel is passed on once and then we wait for the report.
        let mut cancel_sent = false;
        let mut cancel_deadline: Option<tokio::time::Instant> = None;
        let report = loop {
            let next = framing::read_message::<_, ProviderMsg>(&mut r);
            let msg = tokio::select! {
                m = next => m,
                _ = cancel.changed(), if !cancel_sent => {
                    cancel_sent = true;
                    cancel_deadline = Some(tokio::time::Instant::now() + CANCEL_GRACE);
                    let _ = framing::write_message(&mut w, &RequesterMsg::Cancel).await;
                    let _ = w.flush().await;
                    continue;
                }
                _ = sleep_until_opt(cancel_deadline) => {
                    return Attempt::Fatal("cancelled (the provider did not confirm)".into());
                }
            };
            match msg {
                Ok(ProviderMsg::Started) => events(JobEvent::Started {
                    provider: lease.provider.clone(),
                }),
                Ok(ProviderMsg::Stdout(data)) => events(JobEvent::Stdout { data }),
                Ok(ProviderMsg::Stderr(data)) => events(JobEvent::Stderr { data }),
                Ok(ProviderMsg::Finished(report)) => break report,
                Ok(ProviderMsg::Rejected(rej)) => return refused(rej),
                Ok(ProviderMsg::Accepted { .. }) => {
                    return Attempt::Retry("the provider repeated itself".into())
                }
                Err(e) => return lost(e),
            }
        };
        if report.outcome == JobOutcome::Preempted {
            return Attempt::Retry(PREEMPTED.into());
        }
        if report.outcome == JobOutcome::Cancelled && !cancel_sent {
            // Not our doing: the provider ended the lease, shut down or was preempted.
            return Attempt::Retry(STOPPED_UNASKED.into());
        }
        match self.download(req, &report, &mut r, events).await {
            Ok(()) => Attempt::Done(report),
            Err(e) => Attempt::Retry(format!("downloading outputs failed: {e}")),
        }
    }

    async fn upload<W: futures::AsyncWrite + Unpin>(
        &self,
        prepared: &Prepared,
        missing: &[BlobHash],
        w: &mut W,
        events: &mut (dyn FnMut(JobEvent) + Send),
    ) -> std::io::Result<()> {
        let by_hash: HashMap<BlobHash, &LocalFile> = prepared
            .inputs
            .iter()
            .map(|f| (f.file.blob.hash, f))
            .collect();
        let program = prepared.program.blob();
        for hash in missing {
            match (program, &prepared.image) {
                (Some(blob), None) if blob.hash == *hash => {
                    wire::send_blob(w, &mut &prepared.module[..], blob.size, |_| {}).await?;
                    continue;
                }
                (Some(blob), Some(path)) if blob.hash == *hash => {
                    let mut src = tokio::fs::File::open(path).await?;
                    let name = path
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_else(|| "image".into());
                    let mut report = progress_reporter("upload", &name, blob.size, events);
                    wire::send_blob(w, &mut src, blob.size, &mut report).await?;
                    continue;
                }
                _ => {}
            }
            let Some(local) = by_hash.get(hash) else {
                return Err(std::io::Error::other(
                    "the provider asked for a blob this job does not have",
                ));
            };
            let size = local.file.blob.size;
            let mut src = tokio::fs::File::open(&local.path).await?;
            let name = local.file.path.clone();
            let mut report = progress_reporter("upload", &name, size, events);
            wire::send_blob(w, &mut src, size, &mut report).await?;
        }
        w.flush().await
    }

    async fn download<R: futures::AsyncRead + Unpin>(
        &self,
        req: &JobRequest,
        report: &JobReport,
        r: &mut R,
        events: &mut (dyn FnMut(JobEvent) + Send),
    ) -> std::io::Result<()> {
        if report.outputs.is_empty() {
            return Ok(());
        }
        let limits = req.output_limits();
        // Refused before the staging directory exists: nothing is written at all.
        limits
            .check(&report.outputs)
            .map_err(std::io::Error::other)?;
        let staging = outputs::Staging::beside(&req.output_dir)?;
        let mut steps = (String::new(), ProgressSteps::default());
        outputs::receive_outputs(&staging, &report.outputs, &limits, r, |f, done| {
            if steps.0 != f.path {
                steps = (f.path.clone(), ProgressSteps::default());
            }
            if steps.1.due(done, f.blob.size) {
                events(JobEvent::Progress {
                    direction: "download".into(),
                    name: f.path.clone(),
                    done,
                    total: f.blob.size,
                });
            }
        })
        .await?;
        staging.commit(&req.output_dir)
    }
}

/// When to report a transfer's progress: every 8 MiB and at the end (small files: never).
#[derive(Default)]
struct ProgressSteps {
    last: u64,
}

impl ProgressSteps {
    fn due(&mut self, done: u64, total: u64) -> bool {
        const STEP: u64 = 8 << 20;
        let due = total >= STEP && (done.saturating_sub(self.last) >= STEP || done == total);
        if due {
            self.last = done;
        }
        due
    }
}

/// Progress events for one file: every 8 MiB and at the end (small files: none).
fn progress_reporter<'a>(
    direction: &'a str,
    name: &'a str,
    total: u64,
    events: &'a mut (dyn FnMut(JobEvent) + Send),
) -> impl FnMut(u64) + 'a {
    let mut steps = ProgressSteps::default();
    move |done| {
        if steps.due(done, total) {
            events(JobEvent::Progress {
                direction: direction.to_string(),
                name: name.to_string(),
                done,
                total,
            });
        }
    }
}

fn refused(rej: gpunode_protocol::job::JobRejection) -> Attempt {
    match rej.code {
        JobRefusal::InvalidModule | JobRefusal::BadRequest => Attempt::Fatal(rej.message),
        _ => Attempt::Retry(rej.message),
    }
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Adds `root` (a file, or a directory walked recursively) to `out`, named by its last
/// path component.
async fn collect_inputs(root: &Path, out: &mut Vec<LocalFile>) -> Result<(), JobError> {
    let invalid = |e: std::io::Error, p: &Path| {
        JobError::Invalid(format!("cannot read input {}: {e}", p.display()))
    };
    let name = root
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| JobError::Invalid(format!("input {} has no file name", root.display())))?;
    let mut stack = vec![(root.to_path_buf(), name)];
    while let Some((path, rel)) = stack.pop() {
        let meta = tokio::fs::metadata(&path)
            .await
            .map_err(|e| invalid(e, &path))?;
        if meta.is_dir() {
            let mut dir = tokio::fs::read_dir(&path)
                .await
                .map_err(|e| invalid(e, &path))?;
            while let Some(entry) = dir.next_entry().await.map_err(|e| invalid(e, &path))? {
                let child = entry.file_name().to_string_lossy().into_owned();
                stack.push((entry.path(), format!("{rel}/{child}")));
            }
        } else if meta.is_file() {
            check_relative_path(&rel).map_err(JobError::Invalid)?;
            let blob = wire::hash_file(&path)
                .await
                .map_err(|e| invalid(e, &path))?;
            out.push(LocalFile {
                file: JobFile { path: rel, blob },
                path,
            });
        }
    }
    Ok(())
}

/// Whether a lease failure may pass with time (busy, hours, quota, debt), so that a job
/// with `--wait` asks again rather than failing.
fn waitable(e: &LeaseError) -> bool {
    use gpunode_protocol::lease::RejectCode;
    match e {
        LeaseError::NoProviders(_) | LeaseError::AllRefused(_) | LeaseError::Queued { .. } => true,
        LeaseError::Refused(r) => matches!(
            r.code,
            RejectCode::NoCapacity
                | RejectCode::LendingHours
                | RejectCode::TeamPolicy
                | RejectCode::DebtLimit
                | RejectCode::LowReputation
        ),
        _ => false,
    }
}

/// What each provider said, in plain words, for `gpunode why`.
fn wait_reasons(e: &LeaseError) -> Vec<(String, String)> {
    match e {
        LeaseError::AllRefused(list) => list.clone(),
        LeaseError::Queued { queued, refused } => queued
            .iter()
            .map(|(p, q)| (p.clone(), crate::lease::describe_place(q)))
            .chain(refused.iter().cloned())
            .collect(),
        other => vec![("-".to_string(), other.to_string())],
    }
}
