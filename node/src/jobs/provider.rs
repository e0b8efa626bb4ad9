//! The provider's side of the job protocol: admit a job under an active lease, take the
//! blobs that are not cached, run the task in the wasm sandbox or, on `container`
//! leases, under bubblewrap with only the leased GPUs visible, off the async workers,
//! stream stdout and stderr back as they are written, then send the output files.
//!
//! Every refusal happens before any data is transferred and says what was wrong. A job
//! is stopped when its requester cancels or disappears, at its timeout, and when its
//! lease ends ([`super::LeaseJobs`]); its working directory is removed in every case.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{AsyncReadExt, AsyncWriteExt};
use gpunode_protocol::job::{
    check_relative_path, BlobRef, JobFile, JobOutcome, JobRefusal, JobRejection, JobReport,
    JobSubmit, Program, ProviderMsg, RequesterMsg, JOB_VERSION, MAX_INPUT_FILES, MAX_LOG_PIECE,
};
use gpunode_protocol::receipt::job_output_digest;
use gpunode_protocol::time::now_ms;
use gpunode_sandbox::container::{ContainerLimits, ContainerSpec, GpuDevice, Root};
use gpunode_sandbox::wasm::{CompiledTask, Limits, Outcome, RunSpec, WasmExecutor};
use gpunode_sandbox::SandboxError;
use libp2p::{PeerId, Stream};
use tokio::sync::mpsc;

use super::blobs::BlobCache;
use super::containers::ContainerRuntime;
use super::wire;
use super::{JobControl, LeaseJobs};
use crate::lease::Standings;
use crate::lease::{LeaseRole, LeaseState};
use crate::router::framing::{self, Frame};
use crate::router::{StreamGate, StreamHandler, StreamLimits, FIRST_MESSAGE_DEADLINE};
use futures::future::BoxFuture;

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
    /// Where job working directories go.
    pub jobs_dir: PathBuf,
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
}

fn reject(code: JobRefusal, message: impl Into<String>) -> JobRejection {
    JobRejection {
        code,
        message: message.into(),
    }
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
        Box::pin(async move { self.serve_stream(peer, stream, &gate).await })
    }
}

impl JobService {
    async fn serve_stream(self: Arc<Self>, peer: PeerId, stream: Stream, gate: &StreamGate) {
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
        self.blobs.unpin(&wanted);
        self.blobs.release(sent);
        if let Err(e) = result {
            tracing::info!(%peer, lease = %submit.lease_id, "job ended early: {e}");
        }
        let _ = w.close().await;
    }

    async fn admit(&self, peer: PeerId, s: &JobSubmit) -> Result<Admitted, JobRejection> {
        if !self.standings.may_lease(&peer) {
            return Err(reject(
                JobRefusal::NotYourLease,
                "not a member of this team (no valid certificate, or revoked)".to_string(),
            ));
        }
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
        let now = now_ms();
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

    async fn run_admitted<R, W>(
        &self,
        peer: PeerId,
        submit: &JobSubmit,
        admitted: Admitted,
        missing: &[BlobRef],
        mut r: R,
        w: &mut W,
    ) -> std::io::Result<()>
    where
        R: futures::AsyncRead + Unpin + Send + 'static,
        W: futures::AsyncWrite + Unpin,
    {
        let accepted = ProviderMsg::Accepted {
            missing: missing.iter().map(|b| b.hash).collect(),
        };
        framing::write_message(w, &accepted).await?;
        w.flush().await?;
        // Each commit pins its blob once more (the caller unpins `wanted`); these pins
        // go when this exchange ends, however it ends.
        let mut committed = UnpinOnDrop(&self.blobs, Vec::with_capacity(missing.len()));
        for blob in missing {
            let temp = self.blobs.temp_path();
            let mut file = tokio::fs::File::create(&temp).await?;
            let got =
                wire::receive_blob::<_, _, RequesterMsg>(&mut r, &mut file, blob, |_| {}).await;
            drop(file);
            if let Err(e) = got.and_then(|()| self.blobs.commit(&temp, blob)) {
                let _ = tokio::fs::remove_file(&temp).await;
                let rej = reject(JobRefusal::Corrupt, e.to_string());
                self.metrics.job_rejected(rej.code.label());
                let _ = framing::write_message(w, &ProviderMsg::Rejected(rej)).await;
                return Err(e);
            }
            committed.1.push(*blob);
        }

        let ready = match self.prepare(&submit.program).await {
            Ok(r) => r,
            Err(rej) => {
                self.metrics.job_rejected(rej.code.label());
                framing::write_message(w, &ProviderMsg::Rejected(rej)).await?;
                return Ok(());
            }
        };
        let module_cached = match &ready {
            Ready::Wasm(task) => task.source != gpunode_sandbox::wasm::CacheSource::Compiled,
            Ready::Container(_) => submit
                .program
                .blob()
                .is_some_and(|b| !missing.iter().any(|m| m.hash == b.hash)),
        };

        let workdir = JobDir::create(&self.jobs_dir)?;
        if let Err(e) = self.materialize_inputs(&submit.inputs, &workdir.input()) {
            let rej = reject(
                JobRefusal::ProviderError,
                format!("cannot stage inputs: {e}"),
            );
            self.metrics.job_rejected(rej.code.label());
            framing::write_message(w, &ProviderMsg::Rejected(rej)).await?;
            return Err(e);
        }

        let control = JobControl::new(admitted.gpus.iter().map(|g| g.uuid.clone()).collect());
        let cancel = control.cancel.clone();
        let key = self.lease_jobs.add(submit.lease_id, control.clone());
        let _registered = Unregister(&self.lease_jobs, submit.lease_id, key);
        // However this exchange ends (the requester gone mid-run included), the guest
        // does not outlive it.
        let _stop_guest = {
            let cancel = cancel.clone();
            scopeguard(move || cancel.cancel())
        };
        // The lease may have ended between admission and registration.
        if !matches!(self.client.lease(&submit.lease_id).await, Ok(Some(l)) if l.state == LeaseState::Active)
        {
            cancel.cancel();
        }
        // The same serving order as lease admission.
        let rank = self.standings.standing(&peer).rank();
        let permits = self.slots.acquire(admitted.cpus, rank).await;

        // The lease's receipt waits until this job's usage is recorded, however the
        // exchange ends.
        let mut usage = UsageGuard::new(self.accounts.clone(), submit.lease_id);
        let metrics = self.metrics.clone();
        metrics.jobs_running.inc();
        let _running = scopeguard(move || {
            metrics.jobs_running.dec();
        });
        framing::write_message(w, &ProviderMsg::Started).await?;
        w.flush().await?;

        // The requester may cancel, or vanish, while the task runs.
        let requester_cancelled = Arc::new(AtomicBool::new(false));
        let watcher = {
            let (cancel, asked) = (cancel.clone(), requester_cancelled.clone());
            tokio::spawn(async move {
                loop {
                    match framing::read_frame::<_, RequesterMsg>(&mut r).await {
                        Ok(Some(Frame::Message(RequesterMsg::Cancel))) => {
                            asked.store(true, Ordering::SeqCst);
                            cancel.cancel();
                            return;
                        }
                        Ok(None) | Err(_) => {
                            cancel.cancel();
                            return;
                        }
                        Ok(Some(_)) => {}
                    }
                }
            })
        };

        let (tx, mut rx) = mpsc::channel::<ProviderMsg>(64);
        let (stdout, stderr) = (
            log_sink(tx.clone(), ProviderMsg::Stdout),
            log_sink(tx, ProviderMsg::Stderr),
        );
        let started = Instant::now();
        usage.started = Some(started);
        let run = match ready {
            Ready::Wasm(task) => {
                let spec = RunSpec {
                    args: submit.args.clone(),
                    env: submit.env.clone(),
                    input_dir: Some(workdir.input()),
                    output_dir: workdir.output(),
                    limits: Limits {
                        wall_time: admitted.wall_time,
                        fuel: match submit.program {
                            Program::Wasm { fuel, .. } => fuel,
                            Program::Container { .. } => None,
                        },
                        memory_bytes: admitted.memory_bytes as usize,
                        output_bytes: self.max_job_bytes,
                        ..Limits::default()
                    },
                    stdout,
                    stderr,
                    cancel: cancel.clone(),
                };
                let exec = self.executor.clone();
                tokio::task::spawn_blocking(move || exec.run(&task, spec))
            }
            Ready::Container(root) => {
                let Some(runtime) = self.containers.clone() else {
                    return Err(std::io::Error::other("container backend gone"));
                };
                let mut command = match &submit.program {
                    Program::Container { command, .. } => command.clone(),
                    Program::Wasm { .. } => Vec::new(),
                };
                command.extend(submit.args.iter().cloned());
                let spec = ContainerSpec {
                    root,
                    command,
                    env: submit.env.clone(),
                    input_dir: Some(workdir.input()),
                    output_dir: workdir.output(),
                    gpus: admitted.gpus.clone(),
                    limits: ContainerLimits {
                        wall_time: admitted.wall_time,
                        memory_bytes: admitted.memory_bytes,
                        cpu_seconds: admitted.wall_time.as_secs().max(1) * u64::from(admitted.cpus),
                        output_bytes: self.max_job_bytes,
                        cpus: admitted.cpus,
                        ..ContainerLimits::default()
                    },
                    stdout,
                    stderr,
                    cancel: cancel.clone(),
                    pause: control.pause.clone(),
                    on_start: Some({
                        let control = control.clone();
                        Box::new(move |pid| control.set_root_pid(pid))
                    }),
                };
                tokio::task::spawn_blocking(move || runtime.executor.run(spec))
            }
        };
        // A requester that resets the stream stops the job, but the time it ran is
        // still recorded below before the error is returned.
        let mut lost: Option<std::io::Error> = None;
        while let Some(msg) = rx.recv().await {
            if lost.is_some() {
                continue;
            }
            let sent = match framing::write_message(w, &msg).await {
                Ok(()) if rx.is_empty() => w.flush().await,
                other => other,
            };
            if let Err(e) = sent {
                cancel.cancel();
                lost = Some(e);
            }
        }
        let outcome = run.await.map_err(std::io::Error::other)?;
        control.set_root_pid(0);
        // Time the owner held the job paused (`suspend`) is not billed.
        let paused_ms = control.pause.paused_ms();
        let run_ms = (started.elapsed().as_millis() as u64).saturating_sub(paused_ms);
        self.accounts.metered.add_paused(submit.lease_id, paused_ms);
        if let Some(e) = lost {
            usage.record(run_ms, "interrupted".into(), None, None);
            return Err(e);
        }
        drop(permits);
        watcher.abort();
        let outcome = match outcome {
            Ok(_) if control.was_preempted() => JobOutcome::Preempted,
            Ok(o) => wire_outcome(o),
            Err(e) => {
                let code = match e {
                    SandboxError::InvalidModule(_) => JobRefusal::InvalidModule,
                    SandboxError::Setup(_) => JobRefusal::ProviderError,
                };
                let rej = reject(code, e.to_string());
                self.metrics.job_rejected(rej.code.label());
                framing::write_message(w, &ProviderMsg::Rejected(rej)).await?;
                return Ok(());
            }
        };
        tracing::info!(%peer, lease = %submit.lease_id, ?outcome, run_ms, "job finished");
        self.metrics.job_run(outcome.label());
        let accounts = &self.accounts;
        if accounts.misbehaviour.corrupt_outputs {
            corrupt_outputs(&workdir.output())?;
        }
        // A job stopped without its requester asking (lease ended, owner came back,
        // requester gone) sends no outputs: the requester retries elsewhere, so there is
        // no digest for both to agree on.
        let stopped_unasked = outcome == JobOutcome::Preempted
            || (outcome == JobOutcome::Cancelled && !requester_cancelled.load(Ordering::SeqCst));
        let outputs = if stopped_unasked {
            Vec::new()
        } else {
            match list_outputs(&workdir.output()).await {
                Ok(o) => o,
                Err(e) => {
                    usage.record(run_ms, "failed".into(), None, None);
                    return Err(e);
                }
            }
        };
        let mut files: Vec<JobFile> = outputs.iter().map(|(f, _)| f.clone()).collect();
        if let (Some(name), Some(first)) =
            (accounts.misbehaviour.evil_output_name, files.first_mut())
        {
            first.path = name.to_string();
        }
        // Samples cover whole poll intervals: never more than the GPUs over the run.
        let gpu_use = control.gpu_use().map(|mut g| {
            g.gpu_ms = g
                .gpu_ms
                .min(run_ms.saturating_mul(admitted.gpus.len() as u64));
            g
        });
        usage.record(
            run_ms,
            outcome_status(&outcome),
            (!stopped_unasked).then(|| job_output_digest(&files)),
            gpu_use.filter(|_| matches!(submit.program, Program::Container { .. })),
        );
        let report = JobReport {
            outcome,
            run_ms,
            module_cached,
            outputs: files,
            gpu: gpu_use,
        };
        framing::write_message(w, &ProviderMsg::Finished(report)).await?;
        for (file, path) in &outputs {
            let mut src = tokio::fs::File::open(path).await?;
            wire::send_blob(w, &mut src, file.blob.size, |_| {}).await?;
        }
        w.flush().await?;
        Ok(())
    }

    /// Compiles the module, or unpacks the image (once per image), off the async
    /// workers. A program that cannot run is refused with what is wrong with it.
    async fn prepare(&self, program: &Program) -> Result<Ready, JobRejection> {
        let failed = |e: tokio::task::JoinError| reject(JobRefusal::ProviderError, e.to_string());
        match program {
            Program::Wasm { module, fuel } => {
                let module_path = self.blobs.path(&module.hash);
                let exec = self.executor.clone();
                let fuel = fuel.is_some();
                tokio::task::spawn_blocking(move || {
                    let bytes = std::fs::read(&module_path).map_err(|e| e.to_string())?;
                    exec.compile(&bytes, fuel).map_err(|e| e.to_string())
                })
                .await
                .map_err(failed)?
                .map(Ready::Wasm)
                .map_err(|e| reject(JobRefusal::InvalidModule, e))
            }
            Program::Container { image: None, .. } => Ok(Ready::Container(Root::HostEnv)),
            Program::Container {
                image: Some(image), ..
            } => {
                let Some(runtime) = self.containers.clone() else {
                    return Err(reject(
                        JobRefusal::WrongBackend,
                        "this provider does not run containers",
                    ));
                };
                let (archive, digest) = (self.blobs.path(&image.hash), image.hex());
                tokio::task::spawn_blocking(move || runtime.images.rootfs(&archive, &digest))
                    .await
                    .map_err(failed)?
                    .map(|(rootfs, config)| Ready::Container(Root::Image { rootfs, config }))
                    .map_err(|e| {
                        reject(
                            JobRefusal::InvalidModule,
                            format!("the image cannot be used: {e}"),
                        )
                    })
            }
        }
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

/// Records a job's usage exactly once: by [`UsageGuard::record`] on the normal path or,
/// when the exchange ends early (stream reset, requester gone, the exchange's time
/// limit), on drop with the time since the job started, so hanging up does not avoid
/// the bill. Either way the lease's receipt may then be made.
struct UsageGuard {
    accounts: Arc<crate::Accounts>,
    lease: gpunode_protocol::lease::LeaseId,
    /// When the task started; nothing ran (and nothing is billed) before.
    started: Option<Instant>,
    done: bool,
}

impl UsageGuard {
    fn new(accounts: Arc<crate::Accounts>, lease: gpunode_protocol::lease::LeaseId) -> UsageGuard {
        accounts.metered.job_started(lease);
        UsageGuard {
            accounts,
            lease,
            started: None,
            done: false,
        }
    }

    fn record(
        &mut self,
        run_ms: u64,
        status: String,
        digest: Option<gpunode_protocol::receipt::Digest>,
        gpu: Option<gpunode_protocol::job::GpuUse>,
    ) {
        if self.done {
            return;
        }
        self.done = true;
        let meter = &self.accounts.metered;
        meter.add_job(self.lease, run_ms, status, digest);
        if let Some(g) = gpu {
            meter.add_gpu_use(self.lease, g.gpu_ms, g.peak_memory_bytes);
        }
        meter.job_ended(self.lease);
    }
}

impl Drop for UsageGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        match self.started {
            Some(t) => {
                let ms = t.elapsed().as_millis() as u64;
                self.record(ms, "interrupted".into(), None, None);
            }
            None => self.accounts.metered.job_ended(self.lease),
        }
    }
}

/// Runs `f` when dropped.
fn scopeguard<F: FnOnce()>(f: F) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

struct UnpinOnDrop<'a>(&'a BlobCache, Vec<BlobRef>);

impl Drop for UnpinOnDrop<'_> {
    fn drop(&mut self) {
        self.0.unpin(&self.1);
    }
}

struct Unregister<'a>(&'a LeaseJobs, gpunode_protocol::lease::LeaseId, u64);

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        self.0.remove(self.1, self.2);
    }
}

/// A job's working directory, removed when dropped.
struct JobDir(PathBuf);

impl JobDir {
    /// A fresh working directory. A container job runs as a uid of its own, so the
    /// path down to its `input` must be traversable by others (0711: no listing) and
    /// `input` readable; `output` is handed to the job's uid by the sandbox.
    fn create(root: &Path) -> std::io::Result<JobDir> {
        use std::os::unix::fs::PermissionsExt;
        let dir = root.join(format!("{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(dir.join("input"))?;
        std::fs::create_dir_all(dir.join("output"))?;
        let job = JobDir(dir);
        let set =
            |p: &Path, mode| std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode));
        set(root, 0o711)?;
        set(&job.0, 0o711)?;
        set(&job.input(), 0o755)?;
        Ok(job)
    }
    fn input(&self) -> PathBuf {
        self.0.join("input")
    }
    fn output(&self) -> PathBuf {
        self.0.join("output")
    }
}

impl Drop for JobDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!("cannot remove job directory {}: {e}", self.0.display());
        }
    }
}

/// Forwards guest output to the stream writer in bounded pieces. The sandbox calls it
/// from inside WASI's own runtime, so it waits for room by sleeping, not by blocking on
/// tokio; when the requester is gone the output is dropped.
fn log_sink(
    tx: mpsc::Sender<ProviderMsg>,
    wrap: fn(Vec<u8>) -> ProviderMsg,
) -> gpunode_sandbox::wasm::OutputSink {
    Box::new(move |bytes: &[u8]| {
        for piece in bytes.chunks(MAX_LOG_PIECE) {
            let mut msg = wrap(piece.to_vec());
            loop {
                match tx.try_send(msg) {
                    Ok(()) => break,
                    Err(mpsc::error::TrySendError::Full(m)) => {
                        msg = m;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => return,
                }
            }
        }
    })
}

fn wire_outcome(o: Outcome) -> JobOutcome {
    match o {
        Outcome::Exited(c) => JobOutcome::Exited(c),
        Outcome::Trapped(t) => JobOutcome::Trapped(t),
        Outcome::TimedOut => JobOutcome::TimedOut,
        Outcome::OutOfFuel => JobOutcome::OutOfFuel,
        Outcome::OutOfMemory => JobOutcome::OutOfMemory,
        Outcome::OutputTooLarge(w) => JobOutcome::OutputTooLarge(w),
        Outcome::Cancelled => JobOutcome::Cancelled,
    }
}

/// How a job ended, in a receipt's words.
pub fn outcome_status(outcome: &JobOutcome) -> String {
    match outcome {
        JobOutcome::Exited(code) => format!("exited {code}"),
        other => other.label().to_string(),
    }
}

/// Test networks' cheating provider: flips the first byte of every output file.
fn corrupt_outputs(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_file() {
            let mut bytes = std::fs::read(&path)?;
            match bytes.first_mut() {
                Some(b) => *b ^= 0x20,
                None => bytes.push(b'!'),
            }
            std::fs::write(&path, bytes)?;
        }
    }
    Ok(())
}

/// Every regular file under `dir`, with its relative path and hash, sorted by path.
async fn list_outputs(dir: &Path) -> std::io::Result<Vec<(JobFile, PathBuf)>> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            let path = entry.path();
            if kind.is_dir() {
                stack.push(path);
            } else if kind.is_file() {
                let rel = path
                    .strip_prefix(dir)
                    .map_err(std::io::Error::other)?
                    .to_string_lossy()
                    .replace('\\', "/");
                let blob = wire::hash_file(&path).await?;
                files.push((JobFile { path: rel, blob }, path));
            }
        }
    }
    files.sort_by(|a, b| a.0.path.cmp(&b.0.path));
    Ok(files)
}
