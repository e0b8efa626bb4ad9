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
//! A job never outlives its lease: [`LeaseJobs`] holds the cancel token of every running
//! job by lease, and the event loop fires them when a lease ends or is cancelled.

pub mod blobs;
pub mod provider;
mod replicas;
pub mod requester;
pub mod slots;
pub mod table;
pub(crate) mod wire;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use gpunode_protocol::lease::LeaseId;
use gpunode_sandbox::wasm::CancelToken;
use libp2p::StreamProtocol;

pub use requester::{JobEvent, JobRequest, JobSummary, ReplicaView};
pub use table::{JobState, JobView};

/// The job stream protocol.
pub const JOB_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpunode/job/1.0.0");

/// Running jobs by lease: a key for each job and its cancel token.
type JobsByLease = HashMap<LeaseId, Vec<(u64, CancelToken)>>;

/// Cancel tokens of the jobs running under each lease.
#[derive(Debug, Clone, Default)]
pub struct LeaseJobs(Arc<Mutex<JobsByLease>>);

impl LeaseJobs {
    fn lock(&self) -> std::sync::MutexGuard<'_, JobsByLease> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a running job; returns the key to remove it with.
    pub fn add(&self, lease: LeaseId, token: CancelToken) -> u64 {
        let key = rand::random();
        self.lock().entry(lease).or_default().push((key, token));
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
        let jobs = self.lock().remove(lease).unwrap_or_default();
        for (_, token) in &jobs {
            token.cancel();
        }
        jobs.len()
    }

    /// Stops every job (the node is stopping).
    pub fn end_all(&self) {
        let all: Vec<_> = self.lock().drain().flat_map(|(_, v)| v).collect();
        for (_, token) in all {
            token.cancel();
        }
    }

    /// Jobs running now.
    pub fn running(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }
}
