//! One admitted job's exchange, in steps: receive the blobs that are not cached, stage
//! the program and inputs, start under the lease (registered so the lease's end stops
//! it, in serving order for CPU slots), execute on its backend ([`super::backends`]),
//! relay its output, bill its run time, and send the report and output files.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::AsyncWriteExt;
use gpunode_protocol::job::{
    BlobRef, JobFile, JobOutcome, JobRefusal, JobReport, JobSubmit, Program, ProviderMsg,
    RequesterMsg, MAX_LOG_PIECE,
};
use gpunode_protocol::receipt::job_output_digest;
use gpunode_sandbox::wasm::Outcome;
use gpunode_sandbox::SandboxError;
use libp2p::PeerId;
use tokio::sync::mpsc;

use super::workdir::JobDir;
use super::{reject, Admitted, JobService, Ready};
use crate::jobs::blobs::BlobCache;
use crate::jobs::wire;
use crate::jobs::{JobControl, LeaseJobs};
use crate::lease::{LeaseState, Standings};
use crate::router::framing::{self, Frame};

/// What a finished run left to bill and send.
struct Finished<'a> {
    outcome: JobOutcome,
    run_ms: u64,
    module_cached: bool,
    workdir: &'a JobDir,
    control: &'a JobControl,
    /// Whether the requester asked to stop it.
    requester_cancelled: bool,
}

impl JobService {
    /// Runs an admitted job to its end on this exchange (see the module doc).
    pub(super) async fn run_admitted<R, W>(
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
        // Each commit pins its blob once more (the caller unpins `wanted`); these pins
        // go when this exchange ends, however it ends.
        let _committed = self.receive_blobs(missing, &mut r, w).await?;
        let Some((ready, module_cached, workdir)) = self.stage(submit, missing, w).await? else {
            return Ok(());
        };
        let control = JobControl::new(admitted.gpus.iter().map(|g| g.uuid.clone()).collect());
        let cancel = control.cancel.clone();
        let _registered = self.register(submit, &control).await;
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
        let requester_cancelled = Arc::new(AtomicBool::new(false));
        let watcher = watch_requester(r, cancel.clone(), requester_cancelled.clone());
        let (tx, mut rx) = mpsc::channel::<ProviderMsg>(64);
        let logs = (
            log_sink(tx.clone(), ProviderMsg::Stdout),
            log_sink(tx, ProviderMsg::Stderr),
        );
        let started = Instant::now();
        usage.started = Some(started);
        let run = self.execute(ready, submit, &admitted, &workdir, &control, logs)?;
        // A requester that resets the stream stops the job, but the time it ran is
        // still recorded below before the error is returned.
        let lost = relay_output(&mut rx, w, &control).await;
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
        let Some(outcome) = self.job_outcome(outcome, &control, w).await? else {
            return Ok(());
        };
        tracing::info!(%peer, lease = %submit.lease_id, ?outcome, run_ms, "job finished");
        self.metrics.job_run(outcome.label());
        let finished = Finished {
            outcome,
            run_ms,
            module_cached,
            workdir: &workdir,
            control: &control,
            requester_cancelled: requester_cancelled.load(Ordering::SeqCst),
        };
        self.bill_and_send(submit, &admitted, finished, usage, w)
            .await
    }

    /// Registers the job under its lease, so that the lease's end stops it; the lease
    /// may have ended since admission, and then the job is stopped at once.
    async fn register(&self, submit: &JobSubmit, control: &JobControl) -> Registered<'_> {
        let key = self.lease_jobs.add(submit.lease_id, control.clone());
        let registered = Registered {
            _unregister: Unregister(&self.lease_jobs, submit.lease_id, key),
            cancel: control.cancel.clone(),
        };
        if !matches!(self.client.lease(&submit.lease_id).await, Ok(Some(l)) if l.state == LeaseState::Active)
        {
            control.cancel.cancel();
        }
        registered
    }

    /// Receives the blobs the provider does not have, each checked against its hash
    /// and committed to the cache (pinned until the returned guard drops). A corrupt
    /// one is refused to the requester and ends the exchange.
    async fn receive_blobs<'a, R, W>(
        &'a self,
        missing: &[BlobRef],
        r: &mut R,
        w: &mut W,
    ) -> std::io::Result<UnpinOnDrop<'a>>
    where
        R: futures::AsyncRead + Unpin,
        W: futures::AsyncWrite + Unpin,
    {
        let accepted = ProviderMsg::Accepted {
            missing: missing.iter().map(|b| b.hash).collect(),
        };
        framing::write_message(w, &accepted).await?;
        w.flush().await?;
        let mut committed = UnpinOnDrop(&self.blobs, Vec::with_capacity(missing.len()));
        for blob in missing {
            let temp = self.blobs.temp_path();
            let file = tokio::fs::File::create(&temp).await?.into_std().await;
            let got = wire::receive_blob::<_, _, RequesterMsg>(r, file, blob, |_| {}).await;
            if let Err(e) = got.and_then(|file| {
                drop(file);
                self.blobs.commit(&temp, blob)
            }) {
                let _ = tokio::fs::remove_file(&temp).await;
                let rej = reject(JobRefusal::Corrupt, e.to_string());
                self.metrics.job_rejected(rej.code.label());
                let _ = framing::write_message(w, &ProviderMsg::Rejected(rej)).await;
                return Err(e);
            }
            committed.1.push(*blob);
        }
        Ok(committed)
    }

    /// Prepares the program (compiled module or unpacked image) and the working
    /// directory with the inputs; `None` when the program was refused (the requester
    /// was told why). Also says whether the module came from the cache.
    async fn stage<W: futures::AsyncWrite + Unpin>(
        &self,
        submit: &JobSubmit,
        missing: &[BlobRef],
        w: &mut W,
    ) -> std::io::Result<Option<(Ready, bool, JobDir)>> {
        let ready = match self.prepare(&submit.program).await {
            Ok(r) => r,
            Err(rej) => {
                self.metrics.job_rejected(rej.code.label());
                framing::write_message(w, &ProviderMsg::Rejected(rej)).await?;
                return Ok(None);
            }
        };
        let module_cached = match &ready {
            Ready::Wasm(task) => task.source != gpunode_sandbox::wasm::CacheSource::Compiled,
            Ready::Container(_) => submit
                .program
                .blob()
                .is_some_and(|b| !missing.iter().any(|m| m.hash == b.hash)),
        };
        let workdir = self.job_dirs.take()?;
        if let Err(e) = self.materialize_inputs(&submit.inputs, &workdir.input()) {
            let rej = reject(
                JobRefusal::ProviderError,
                format!("cannot stage inputs: {e}"),
            );
            self.metrics.job_rejected(rej.code.label());
            framing::write_message(w, &ProviderMsg::Rejected(rej)).await?;
            return Err(e);
        }
        Ok(Some((ready, module_cached, workdir)))
    }

    /// The job's outcome for the requester; `None` when the sandbox could not run it
    /// at all (the requester was told why).
    async fn job_outcome<W: futures::AsyncWrite + Unpin>(
        &self,
        outcome: Result<Outcome, SandboxError>,
        control: &JobControl,
        w: &mut W,
    ) -> std::io::Result<Option<JobOutcome>> {
        match outcome {
            Ok(_) if control.was_preempted() => Ok(Some(JobOutcome::Preempted)),
            Ok(o) => Ok(Some(wire_outcome(o))),
            Err(e) => {
                let code = match e {
                    SandboxError::InvalidModule(_) => JobRefusal::InvalidModule,
                    SandboxError::Setup(_) => JobRefusal::ProviderError,
                };
                let rej = reject(code, e.to_string());
                self.metrics.job_rejected(rej.code.label());
                framing::write_message(w, &ProviderMsg::Rejected(rej)).await?;
                Ok(None)
            }
        }
    }

    /// Records the job's usage for the lease's receipt, then sends the report and the
    /// output files.
    async fn bill_and_send<W: futures::AsyncWrite + Unpin>(
        &self,
        submit: &JobSubmit,
        admitted: &Admitted,
        run: Finished<'_>,
        mut usage: UsageGuard,
        w: &mut W,
    ) -> std::io::Result<()> {
        let misbehaviour = &self.accounts.misbehaviour;
        if misbehaviour.corrupt_outputs {
            corrupt_outputs(&run.workdir.output())?;
        }
        // A job stopped without its requester asking (lease ended, owner came back,
        // requester gone) sends no outputs: the requester retries elsewhere, so there is
        // no digest for both to agree on.
        let stopped_unasked = run.outcome == JobOutcome::Preempted
            || (run.outcome == JobOutcome::Cancelled && !run.requester_cancelled);
        let outputs = if stopped_unasked {
            Vec::new()
        } else {
            match list_outputs(&run.workdir.output()).await {
                Ok(o) => o,
                Err(e) => {
                    usage.record(run.run_ms, "failed".into(), None, None);
                    return Err(e);
                }
            }
        };
        let mut files: Vec<JobFile> = outputs.iter().map(|o| o.file.clone()).collect();
        if let (Some(name), Some(first)) = (misbehaviour.evil_output_name, files.first_mut()) {
            first.path = name.to_string();
        }
        // Samples cover whole poll intervals: never more than the GPUs over the run.
        let gpu_use = run.control.gpu_use().map(|mut g| {
            g.gpu_ms = g
                .gpu_ms
                .min(run.run_ms.saturating_mul(admitted.gpus.len() as u64));
            g
        });
        usage.record(
            run.run_ms,
            outcome_status(&run.outcome),
            (!stopped_unasked).then(|| job_output_digest(&files)),
            gpu_use.filter(|_| matches!(submit.program, Program::Container { .. })),
        );
        let report = JobReport {
            outcome: run.outcome,
            run_ms: run.run_ms,
            module_cached: run.module_cached,
            outputs: files,
            gpu: gpu_use,
        };
        framing::write_message(w, &ProviderMsg::Finished(report)).await?;
        for output in &outputs {
            match &output.bytes {
                Some(bytes) => wire::send_bytes(w, bytes).await?,
                None => {
                    let src = tokio::fs::File::open(&output.path).await?.into_std().await;
                    wire::send_blob(w, src, output.file.blob.size, |_| {}).await?;
                }
            }
        }
        w.flush().await
    }
}

/// Watches the requester's side while the task runs: a `Cancel`, or the stream
/// ending, stops the job (`asked` says which).
fn watch_requester<R>(
    mut r: R,
    cancel: gpunode_sandbox::CancelToken,
    asked: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()>
where
    R: futures::AsyncRead + Unpin + Send + 'static,
{
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
}

/// Sends the guest's output as it comes until the task's sinks close; a write that
/// fails stops the job, and the error is returned once the task has ended.
async fn relay_output<W: futures::AsyncWrite + Unpin>(
    rx: &mut mpsc::Receiver<ProviderMsg>,
    w: &mut W,
    control: &JobControl,
) -> Option<std::io::Error> {
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
            control.cancel.cancel();
            lost = Some(e);
        }
    }
    lost
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

pub(super) struct UnpinOnDrop<'a>(&'a BlobCache, Vec<BlobRef>);

impl Drop for UnpinOnDrop<'_> {
    fn drop(&mut self) {
        self.0.unpin(&self.1);
    }
}

/// A job registered under its lease until dropped. However the exchange ends (the
/// requester gone mid-run included), the guest does not outlive it: dropping this stops
/// it, then unregisters it.
struct Registered<'a> {
    _unregister: Unregister<'a>,
    cancel: gpunode_sandbox::wasm::CancelToken,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

struct Unregister<'a>(&'a LeaseJobs, gpunode_protocol::lease::LeaseId, u64);

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        self.0.remove(self.1, self.2);
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

/// Small output files held in memory from their hashing to their sending, at most this
/// much of them in all (the rest are read again as they are sent).
const OUTPUTS_HELD_BYTES: u64 = 4 << 20;

/// One output file: its entry in the report, where it is, and its bytes when it is small
/// enough to be sent from memory.
struct Output {
    file: JobFile,
    path: PathBuf,
    bytes: Option<Vec<u8>>,
}

/// Every regular file under `dir`, with its relative path and hash, sorted by path: the
/// whole walk in one trip to a blocking thread.
async fn list_outputs(dir: &Path) -> std::io::Result<Vec<Output>> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || walk_outputs(&dir))
        .await
        .map_err(std::io::Error::other)?
}

fn walk_outputs(dir: &Path) -> std::io::Result<Vec<Output>> {
    let mut files = Vec::new();
    let mut held = 0u64;
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
                let keep = wire::SMALL_BLOB_BYTES.min(OUTPUTS_HELD_BYTES - held);
                let (blob, bytes) = wire::hash_file_here(&path, keep)?;
                held += bytes.as_ref().map_or(0, |b| b.len() as u64);
                files.push(Output {
                    file: JobFile { path: rel, blob },
                    path,
                    bytes,
                });
            }
        }
    }
    files.sort_by(|a, b| a.file.path.cmp(&b.file.path));
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file is listed with its true hash; small ones are held in memory, up to
    /// the bound for all of them, and a large one never is.
    #[test]
    fn outputs_are_hashed_and_small_ones_held_within_a_bound() {
        let dir = tempfile::tempdir().expect("tmp");
        let small = wire::SMALL_BLOB_BYTES as usize;
        let count = (OUTPUTS_HELD_BYTES as usize / small) + 3;
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        for i in 0..count {
            let data = vec![i as u8; small];
            std::fs::write(dir.path().join(format!("sub/f{i:03}")), data).expect("write");
        }
        let large = vec![7u8; small + 1];
        std::fs::write(dir.path().join("large"), &large).expect("write");
        let outputs = walk_outputs(dir.path()).expect("walk");
        assert_eq!(outputs.len(), count + 1);
        assert_eq!(outputs[0].file.path, "large");
        assert_eq!(outputs[0].file.blob.hash, *blake3::hash(&large).as_bytes());
        assert!(
            outputs[0].bytes.is_none(),
            "a large file is read as it is sent"
        );
        let mut held = 0;
        for (i, out) in outputs[1..].iter().enumerate() {
            let data = vec![i as u8; small];
            assert_eq!(out.file.path, format!("sub/f{i:03}"));
            assert_eq!(out.file.blob.hash, *blake3::hash(&data).as_bytes());
            if let Some(bytes) = &out.bytes {
                assert_eq!(bytes, &data);
                held += bytes.len() as u64;
            }
        }
        assert_eq!(held, OUTPUTS_HELD_BYTES, "held up to the bound, no more");
    }
}
