//! Jobs: running tasks on peers under a lease.
//!
//! A job travels on one libp2p stream of the job protocol (see
//! `gpunode_protocol::job`), opened on the connection the lease was agreed on.
//! [`provider`] serves those streams: it checks the lease, takes the blobs it does not
//! have into its [`blobs::BlobCache`], runs the task in the wasm sandbox off the async
//! workers, streams stdout and stderr back live and sends the output files.
//! [`requester`] is the other end: it checks the module locally before paying for
//! anything, leases, uploads, follows the run, downloads outputs and retries on another
//! provider when one fails. [`table`] keeps the jobs a daemon runs for its user, with
//! their events, for `gpunode jobs`, `logs` and `cancel`.
//!
//! A lease taken for one job ends with it: on [`JOB_ENDS_LEASE_PROTOCOL`] streams the
//! provider ends the lease when the job's exchange is over, and the requester only
//! marks it ended on its side.
//!
//! A job never outlives its lease: [`LeaseJobs`] holds the cancel token of every running
//! job by lease, and the event loop fires them when a lease ends or is cancelled.

pub mod blobs;
pub mod containers;
pub mod gpu_use;
pub mod outputs;
pub mod provider;
mod replicas;
mod request_builder;
pub mod requester;
pub mod slots;
pub mod table;
pub(crate) mod wire;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use gpunode_protocol::job::GpuUse;
use gpunode_protocol::lease::LeaseId;
use gpunode_sandbox::container::PauseToken;

use crate::inventory::InventorySnapshot;
use gpunode_sandbox::wasm::CancelToken;
use libp2p::StreamProtocol;

pub use requester::{ContainerRequest, JobEvent, JobRequest, JobSummary, ReplicaView, Waiting};
pub use table::{JobState, JobView};

/// The job stream protocol.
pub const JOB_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpunode/job/1.0.0");
/// The job protocol for a lease's only job: the same messages, and the provider ends
/// the lease itself once the exchange is over (after the outputs), so the requester
/// sends no cancellation and the receipt follows the outputs at once. Providers that
/// do not serve it get [`JOB_PROTOCOL`] and a cancellation, as before.
pub const JOB_ENDS_LEASE_PROTOCOL: StreamProtocol =
    StreamProtocol::new("/gpunode/job-ends-lease/1.0.0");

/// A job running here for a peer, as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunningJobView {
    /// The lease it runs under.
    pub lease_id: String,
    /// Its key on this node.
    pub job: String,
    /// Its GPUs (uuids).
    pub gpus: Vec<String>,
    /// Paused by the owner's `suspend` policy.
    pub paused: bool,
    /// GPU use so far.
    pub gpu: Option<GpuUse>,
}

/// What the node holds of one running job: how to stop it, pause it, whether it was
/// preempted by the GPU's owner, and its host process (container jobs).
#[derive(Debug, Clone, Default)]
pub struct JobControl {
    /// Stops the job.
    pub cancel: CancelToken,
    /// Pauses the job (container jobs; the owner's `suspend` policy).
    pub pause: PauseToken,
    preempted: Arc<AtomicBool>,
    root_pid: Arc<AtomicU32>,
    /// The leased GPUs (uuids) the job may use.
    gpus: Arc<Vec<String>>,
    gpu_use: Arc<Mutex<GpuUse>>,
}

impl JobControl {
    /// Controls for a job on these GPUs (uuids).
    pub fn new(gpus: Vec<String>) -> JobControl {
        JobControl {
            gpus: Arc::new(gpus),
            ..JobControl::default()
        }
    }

    /// The job's GPU use so far; `None` for a job without GPUs.
    pub fn gpu_use(&self) -> Option<GpuUse> {
        (!self.gpus.is_empty()).then(|| *self.gpu_use.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Whether the job was stopped because the GPU's owner came back.
    pub fn was_preempted(&self) -> bool {
        self.preempted.load(Ordering::SeqCst)
    }

    /// Records the job's outer host process (its processes are its descendants).
    pub fn set_root_pid(&self, pid: u32) {
        self.root_pid.store(pid, Ordering::SeqCst);
    }

    /// Whether the job ran as host processes that GPU metering can see (container jobs).
    pub fn root_pid_known(&self) -> bool {
        self.root_pid().is_some()
    }

    fn root_pid(&self) -> Option<u32> {
        Some(self.root_pid.load(Ordering::SeqCst)).filter(|p| *p != 0)
    }
}

/// Running jobs by lease: a key for each job and its controls.
type JobsByLease = HashMap<LeaseId, Vec<(u64, JobControl)>>;

/// The controls of the jobs running under each lease, and the leases paused now.
#[derive(Debug, Clone, Default)]
pub struct LeaseJobs(Arc<Mutex<JobsByLease>>, Arc<Mutex<HashSet<LeaseId>>>);

impl LeaseJobs {
    fn lock(&self) -> std::sync::MutexGuard<'_, JobsByLease> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn paused(&self) -> std::sync::MutexGuard<'_, HashSet<LeaseId>> {
        self.1.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a running job (paused at once if its lease is); returns the key to
    /// remove it with.
    pub fn add(&self, lease: LeaseId, control: JobControl) -> u64 {
        let key = rand::random();
        control.pause.set(self.paused().contains(&lease));
        self.lock().entry(lease).or_default().push((key, control));
        key
    }

    /// Forgets a job that ended.
    pub fn remove(&self, lease: LeaseId, key: u64) {
        let mut map = self.lock();
        if let Some(v) = map.get_mut(&lease) {
            v.retain(|(k, _)| *k != key);
            if v.is_empty() {
                map.remove(&lease);
            }
        }
    }

    /// The lease ended: stop every job under it. Returns how many were stopped.
    pub fn end_lease(&self, lease: &LeaseId) -> usize {
        self.paused().remove(lease);
        let jobs = self.lock().remove(lease).unwrap_or_default();
        for (_, control) in &jobs {
            control.cancel.cancel();
        }
        jobs.len()
    }

    /// The GPU's owner came back (policy `yield`): mark the lease's jobs preempted and
    /// stop them. Returns how many.
    pub fn preempt(&self, lease: &LeaseId) -> usize {
        let jobs = self.lock().remove(lease).unwrap_or_default();
        for (_, control) in &jobs {
            control.preempted.store(true, Ordering::SeqCst);
            control.cancel.cancel();
        }
        jobs.len()
    }

    /// Pauses (policy `suspend`) or resumes the lease's jobs.
    pub fn pause(&self, lease: &LeaseId, paused: bool) {
        if paused {
            self.paused().insert(*lease);
        } else {
            self.paused().remove(lease);
        }
        for (_, control) in self.lock().get(lease).map(Vec::as_slice).unwrap_or(&[]) {
            control.pause.set(paused);
        }
    }

    /// Stops every job (the node is stopping).
    pub fn end_all(&self) {
        let all: Vec<_> = self.lock().drain().flat_map(|(_, v)| v).collect();
        for (_, control) in all {
            control.cancel.cancel();
        }
    }

    /// Jobs running now.
    pub fn running(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// Adds one sample of `snap`, covering `dt_ms`, to the GPU use of every running job
    /// that holds GPUs, and returns the host processes of every running container job
    /// (what is not the GPU owner's). One `/proc` scan serves all jobs.
    pub fn meter(&self, snap: &InventorySnapshot, dt_ms: u64) -> HashSet<u32> {
        let jobs: Vec<JobControl> = self
            .lock()
            .values()
            .flatten()
            .map(|(_, c)| c.clone())
            .filter(|c| !c.gpus.is_empty() || c.root_pid().is_some())
            .collect();
        let mut all = HashSet::new();
        let tree = jobs
            .iter()
            .any(|j| j.root_pid().is_some())
            .then(gpunode_sandbox::container::procs::ProcessTree::read);
        for job in jobs {
            let mut pids: HashSet<u32> = HashSet::new();
            if let (Some(root), Some(tree)) = (job.root_pid(), &tree) {
                pids.insert(root);
                pids.extend(tree.descendants(root));
            }
            if !job.gpus.is_empty() {
                let mut usage = job.gpu_use.lock().unwrap_or_else(|p| p.into_inner());
                gpu_use::sample(&mut usage, snap, &job.gpus, &pids, dt_ms);
            }
            all.extend(pids);
        }
        all
    }

    /// The running jobs, for `status` and `/metrics`.
    pub fn views(&self) -> Vec<RunningJobView> {
        let mut views: Vec<RunningJobView> = self
            .lock()
            .iter()
            .flat_map(|(lease, jobs)| {
                jobs.iter().map(|(key, c)| RunningJobView {
                    lease_id: lease.to_string(),
                    job: format!("{key:016x}"),
                    gpus: c.gpus.to_vec(),
                    paused: c.pause.is_paused(),
                    gpu: c.gpu_use(),
                })
            })
            .collect();
        views.sort_by(|a, b| a.lease_id.cmp(&b.lease_id).then(a.job.cmp(&b.job)));
        views
    }
}
