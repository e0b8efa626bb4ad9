//! The provider's side of the job protocol: admit a job under an active lease, take the
//! blobs that are not cached, run the task in the wasm sandbox or, on `container`
//! leases, under bubblewrap with only the leased GPUs visible, off the async workers,
//! stream stdout and stderr back as they are written, then send the output files.
//!
//! Every refusal happens before any data is transferred and says what was wrong. A job
//! is stopped when its requester cancels or disappears, at its timeout, and when its
//! lease ends ([`super::LeaseJobs`]); its working directory is removed in every case.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use gpunode_protocol::job::{
    check_relative_path, JobFile, JobRefusal, JobRejection, JobSubmit, Program, ProviderMsg,
    RequesterMsg, JOB_VERSION, MAX_INPUT_FILES,
};
use gpunode_protocol::time::now_ms;
use gpunode_sandbox::container::{GpuDevice, Root};
use gpunode_sandbox::wasm::{CompiledTask, WasmExecutor};
use libp2p::{PeerId, Stream};

use super::blobs::BlobCache;
use super::containers::ContainerRuntime;
use super::LeaseJobs;
use crate::lease::Standings;
use crate::lease::{LeaseRole, LeaseState};
use crate::router::framing::{self};
use crate::router::{StreamGate, StreamHandler, StreamLimits, FIRST_MESSAGE_DEADLINE};
use futures::future::BoxFuture;

mod backends;
mod run;
mod workdir;

pub use run::outcome_status;
pub use workdir::JobDirs;

/// Smallest wasm memory a job gets when its lease reserved no RAM.
const DEFAULT_JOB_MEMORY: u64 = 256 << 20;
/// Largest wasm32 linear memory.
const WASM32_MAX_MEMORY: u64 = 4 << 30;
/// Memory of a container job whose lease reserved no RAM.
const DEFAULT_CONTAINER_MEMORY: u64 = 2 << 30;

/// What the provider needs to run jobs.
pub struct JobService {
    /// The door to the event loop (leases).
    pub client: crate::loop_client::LoopClient,
    /// The node's metrics.
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The node's ledger (usage meters, receipts).
    pub accounts: Arc<crate::Accounts>,
    /// The node's sandbox.
    pub executor: Arc<WasmExecutor>,
    /// The container backend, when this provider offers it.
    pub containers: Option<Arc<ContainerRuntime>>,
    /// Modules and inputs by hash.
    pub blobs: Arc<BlobCache>,
    /// Where job working directories are made.
    pub job_dirs: Arc<JobDirs>,
    /// Running jobs by lease.
    pub lease_jobs: LeaseJobs,
    /// One slot per offered CPU core; a job holds as many as its lease has CPUs, and
    /// waiting jobs are served give-to-get.
    pub slots: Arc<super::slots::Slots>,
    /// Permits in total.
    pub total_slots: u32,
    /// Cap on a job's inputs and on its outputs.
    pub max_job_bytes: u64,
    /// How requesters stand with this node: orders jobs waiting for CPU slots.
    pub standings: crate::standings::PeerStandings,
    /// Settlement streams opened ahead of the claim of a lease that ends with its job.
    pub settle_ahead: Arc<crate::ledger::settle::StreamsAhead>,
}

fn reject(code: JobRefusal, message: impl Into<String>) -> JobRejection {
    JobRejection {
        code,
        message: message.into(),
    }
}

/// The submission itself is well formed: our protocol version, a bounded number of
/// input files with relative paths, none given twice.
fn check_submission(s: &JobSubmit) -> Result<(), JobRejection> {
    if s.version != JOB_VERSION {
        return Err(reject(
            JobRefusal::BadRequest,
            format!(
                "job protocol version {} is not supported (this node speaks {JOB_VERSION})",
                s.version
            ),
        ));
    }
    if s.inputs.len() > MAX_INPUT_FILES {
        return Err(reject(
            JobRefusal::BadRequest,
            format!("at most {MAX_INPUT_FILES} input files per job"),
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for f in &s.inputs {
        check_relative_path(&f.path).map_err(|m| reject(JobRefusal::BadRequest, m))?;
        if !seen.insert(f.path.as_str()) {
            return Err(reject(
                JobRefusal::BadRequest,
                format!("input path '{}' is given twice", f.path),
            ));
        }
    }
    Ok(())
}

/// What admission decided for a job.
struct Admitted {
    wall_time: Duration,
    memory_bytes: u64,
    cpus: u32,
    /// The leased GPUs (what a container job sees).
    gpus: Vec<GpuDevice>,
    /// Time left on the lease: the whole exchange must end by then (plus a grace).
    lease_left: Duration,
}

/// A program ready to run.
enum Ready {
    Wasm(CompiledTask),
    Container(Root),
}

/// How long after its lease's end a job's exchange may still finish sending outputs.
const AFTER_LEASE_GRACE: Duration = Duration::from_secs(30);
/// Most job streams served at once (running jobs are bounded by the job slots and
/// leases; this bounds streams that are opened and left idle).
const MAX_JOB_STREAMS: usize = 256;

/// How job streams are bounded: running jobs are bounded by the job slots and leases;
/// this bounds streams that are opened and left idle. A job's exchange lasts as long as
/// its run.
pub const JOB_STREAM_LIMITS: StreamLimits = StreamLimits {
    max_handlers: MAX_JOB_STREAMS,
    first_message: FIRST_MESSAGE_DEADLINE,
    exchange: None,
};

impl StreamHandler for JobService {
    /// Guests are stopped through [`super::LeaseJobs`] when the node stops; each
    /// exchange then ends on its own.
    fn handle(
        self: Arc<Self>,
        peer: PeerId,
        stream: Stream,
        gate: StreamGate,
    ) -> BoxFuture<'static, ()> {
        Box::pin(async move { self.serve_stream(peer, stream, &gate, false).await })
    }
}

/// The job service on [`super::JOB_ENDS_LEASE_PROTOCOL`] streams: a job admitted there
/// ends its lease when its exchange is over, however it ends.
pub struct LeaseEndingJobs(pub Arc<JobService>);

impl StreamHandler for LeaseEndingJobs {
    fn handle(
        self: Arc<Self>,
        peer: PeerId,
        stream: Stream,
        gate: StreamGate,
    ) -> BoxFuture<'static, ()> {
        let service = self.0.clone();
        Box::pin(async move { service.serve_stream(peer, stream, &gate, true).await })
    }
}

impl JobService {
    /// Serves one job stream; with `ends_lease`, a job that was admitted (so under the
    /// peer's own active lease) ends that lease when the exchange is over.
    async fn serve_stream(
        self: Arc<Self>,
        peer: PeerId,
        stream: Stream,
        gate: &StreamGate,
        ends_lease: bool,
    ) {
        let (mut r, mut w) = AsyncReadExt::split(stream);
        let submit = match gate.first_message::<_, RequesterMsg>(&mut r).await {
            Ok(RequesterMsg::Submit(s)) => s,
            Ok(RequesterMsg::Cancel) => return,
            Err(e) => {
                tracing::debug!(%peer, "bad job request: {e}");
                let rej = reject(
                    JobRefusal::BadRequest,
                    format!("malformed job request: {e}"),
                );
                self.metrics.job_rejected(rej.code.label());
                let _ = framing::write_message(&mut w, &ProviderMsg::Rejected(rej)).await;
                let _ = w.close().await;
                return;
            }
        };
        let admitted = match self.admit(peer, &submit).await {
            Ok(a) => a,
            Err(rej) => {
                tracing::info!(%peer, "job refused: {}", rej.message);
                self.metrics.job_rejected(rej.code.label());
                let _ = framing::write_message(&mut w, &ProviderMsg::Rejected(rej)).await;
                let _ = w.close().await;
                return;
            }
        };
        let wanted = submit.blobs();
        // Uploads in progress count against the cache's bound with the pinned blobs.
        let missing = match self.blobs.pin_and_reserve(&wanted) {
            Ok(m) => m,
            Err(room) => {
                let rej = reject(
                    JobRefusal::TooLarge,
                    format!(
                        "this provider's blob cache has room for {room} more bytes now (other jobs' files are in use); try again later"
                    ),
                );
                self.metrics.job_rejected(rej.code.label());
                let _ = framing::write_message(&mut w, &ProviderMsg::Rejected(rej)).await;
                let _ = w.close().await;
                if ends_lease {
                    self.end_lease(submit.lease_id).await;
                }
                return;
            }
        };
        let sent: u64 = missing.iter().map(|b| b.size).sum();
        let metrics = &self.metrics;
        metrics.job_bytes_received.inc_by(sent);
        metrics
            .job_bytes_cached
            .inc_by(submit.input_bytes().saturating_sub(sent));
        // A requester that stalls mid-upload or never reads its outputs cannot hold
        // this job (its pins, its directory) past the lease.
        let limit = admitted.lease_left + AFTER_LEASE_GRACE;
        let result = tokio::time::timeout(
            limit,
            self.run_admitted(peer, &submit, admitted, &missing, r, &mut w),
        )
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the exchange outlived its lease",
            ))
        });
        if ends_lease {
            // Its claim follows the lease's end: its stream opens meanwhile.
            self.settle_ahead.open(peer);
            self.end_lease(submit.lease_id).await;
        }
        self.blobs.unpin(&wanted);
        self.blobs.release(sent);
        if let Err(e) = result {
            tracing::info!(%peer, lease = %submit.lease_id, "job ended early: {e}");
        }
        let _ = w.close().await;
    }

    /// Ends a lease whose only job's exchange is over (its receipt is made from here);
    /// one that ended otherwise meanwhile is left as it is.
    async fn end_lease(&self, lease: gpunode_protocol::lease::LeaseId) {
        match self.client.cancel_local(lease.to_string()).await {
            Ok(Ok(_)) => {
                self.metrics.leases_ended_with_job.inc();
            }
            Ok(Err(r)) => tracing::debug!(%lease, "lease not ended after its job: {}", r.message),
            Err(e) => tracing::warn!(%lease, "cannot end the lease after its job: {e}"),
        }
    }

    /// Admits a job: a member's well-formed submission, under its own active lease
    /// of the right backend, within this provider's size limits.
    async fn admit(&self, peer: PeerId, s: &JobSubmit) -> Result<Admitted, JobRejection> {
        if !self.standings.may_lease(&peer) {
            return Err(reject(
                JobRefusal::NotYourLease,
                "not a member of this team (no valid certificate, or revoked)".to_string(),
            ));
        }
        check_submission(s)?;
        let now = now_ms();
        let record = self.active_lease_of(peer, s, now).await?;
        self.check_program(s, &record)?;
        let lease_left = record.terms.end_ms - now;
        let memory = match (&s.program, record.terms.mem_bytes) {
            (Program::Wasm { .. }, 0) => DEFAULT_JOB_MEMORY,
            (Program::Wasm { .. }, m) => m.min(WASM32_MAX_MEMORY),
            (Program::Container { .. }, 0) => DEFAULT_CONTAINER_MEMORY,
            (Program::Container { .. }, m) => m,
        };
        Ok(Admitted {
            wall_time: Duration::from_millis(s.timeout_ms.min(lease_left)),
            memory_bytes: memory,
            cpus: record.terms.cpus.clamp(1, self.total_slots.max(1)),
            gpus: record
                .terms
                .gpus
                .iter()
                .map(|g| GpuDevice {
                    index: g.index,
                    uuid: g.uuid.clone(),
                })
                .collect(),
            lease_left: Duration::from_millis(lease_left),
        })
    }

    /// The lease the job names: this provider's, held by `peer`, active now.
    async fn active_lease_of(
        &self,
        peer: PeerId,
        s: &JobSubmit,
        now: u64,
    ) -> Result<crate::lease::LeaseRecord, JobRejection> {
        let record = self
            .client
            .lease(&s.lease_id)
            .await
            .map_err(|e| reject(JobRefusal::ProviderError, e.to_string()))?
            .ok_or_else(|| {
                reject(
                    JobRefusal::UnknownLease,
                    format!("no lease {} here; lease first", s.lease_id),
                )
            })?;
        if record.role != LeaseRole::Provider || record.terms.requester != peer {
            return Err(reject(
                JobRefusal::NotYourLease,
                format!("lease {} is not yours", s.lease_id),
            ));
        }
        if record.state != LeaseState::Active || record.terms.end_ms <= now {
            return Err(reject(
                JobRefusal::LeaseNotActive,
                format!(
                    "lease {} is {}, not active; request a new one",
                    s.lease_id,
                    record.state.label()
                ),
            ));
        }
        Ok(record)
    }

    /// The program fits the lease's backend and what this provider runs and takes.
    fn check_program(
        &self,
        s: &JobSubmit,
        record: &crate::lease::LeaseRecord,
    ) -> Result<(), JobRejection> {
        let backend = s.program.backend();
        if record.terms.backend != backend {
            return Err(reject(
                JobRefusal::WrongBackend,
                format!(
                    "lease {} is for the {} backend; {backend} tasks need a {backend} lease",
                    s.lease_id, record.terms.backend
                ),
            ));
        }
        if let Program::Container { image, .. } = &s.program {
            let Some(runtime) = &self.containers else {
                return Err(reject(
                    JobRefusal::WrongBackend,
                    "this provider does not run containers; lease one that offers the container backend",
                ));
            };
            if image.is_none() && !runtime.allow_host_env {
                return Err(reject(
                    JobRefusal::BadRequest,
                    "this provider does not allow --host-env; send an image with --image",
                ));
            }
        }
        let limit = self.max_job_bytes.min(self.blobs.max_bytes());
        if s.input_bytes() > limit {
            return Err(reject(
                JobRefusal::TooLarge,
                format!(
                    "module and inputs total {} bytes; this provider takes at most {limit} bytes per job",
                    s.input_bytes()
                ),
            ));
        }
        Ok(())
    }

    /// Hard-links (or copies) each cached input into the job's input directory.
    fn materialize_inputs(&self, inputs: &[JobFile], dir: &Path) -> std::io::Result<()> {
        for f in inputs {
            let dst = dir.join(&f.path);
            if let Some(parent) = dst.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let src = self.blobs.path(&f.blob.hash);
            if std::fs::hard_link(&src, &dst).is_err() {
                std::fs::copy(&src, &dst)?;
            }
            // Readable by a container job's own uid (read-only for everyone).
            std::fs::set_permissions(&dst, std::os::unix::fs::PermissionsExt::from_mode(0o444))?;
        }
        Ok(())
    }
}
