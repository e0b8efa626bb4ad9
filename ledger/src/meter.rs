//! Usage per lease, as one side saw it: the provider meters what its jobs ran (and bills
//! it), the requester notes what it observed (and checks the bill against it).
//!
//! Records are kept in the store (written with the next flush) so a restart between a
//! job and its lease's settlement does not lose them, and dropped once the lease settles.

use std::collections::HashMap;
use std::sync::Mutex;

use gpunode_protocol::encoding;
use gpunode_protocol::lease::LeaseId;
use gpunode_protocol::receipt::{lease_output_digest, Digest};
use serde::{Deserialize, Serialize};

use gpunode_store::Store;

/// Usage of one lease so far.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseUsage {
    /// Time the lease's jobs took, ms (provider: sandbox run time; requester: from
    /// submitting to having the outputs).
    pub billed_ms: u64,
    /// Jobs run.
    pub jobs: u32,
    /// How the last one ended.
    pub last_status: String,
    /// Output digest of each job that delivered.
    pub digests: Vec<Digest>,
    /// GPU time measured from the driver (container jobs on GPUs), ms summed over
    /// GPUs; `None` when nothing was measured and receipts count leased GPU time.
    pub measured_gpu_ms: Option<u64>,
    /// Most GPU memory a job held at once, bytes (measured; 0 when not).
    pub peak_gpu_memory_bytes: u64,
    /// Time the GPU's owner held the lease's jobs paused (`suspend`), ms: not billed.
    pub paused_ms: u64,
}

impl LeaseUsage {
    /// The digest a receipt for this usage carries.
    pub fn output_digest(&self) -> Digest {
        lease_output_digest(&self.digests)
    }

    /// `last_status`, or "none" without jobs.
    pub fn exit_status(&self) -> String {
        if self.jobs == 0 {
            "none".into()
        } else {
            self.last_status.clone()
        }
    }
}

/// Usage by lease, for one side.
pub struct UsageMeter {
    store: Store,
    tree: &'static str,
    leases: Mutex<HashMap<LeaseId, LeaseUsage>>,
    /// Jobs still running, by lease: their usage is not known yet, so their lease's
    /// receipt waits for them.
    running: Mutex<HashMap<LeaseId, u32>>,
    /// Told when the last running job of a lease ends.
    pub jobs_done: tokio::sync::Notify,
    /// Counts leases whose last running job ended, for [`UsageMeter::wait_idle`].
    idle: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for UsageMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UsageMeter")
            .field("tree", &self.tree)
            .finish()
    }
}

impl UsageMeter {
    /// Loads what `tree` holds.
    pub fn open(store: Store, tree: &'static str) -> Result<UsageMeter, gpunode_store::StoreError> {
        let mut leases = HashMap::new();
        for (k, v) in store.scan(tree)? {
            if let (Ok(id), Ok(u)) = (
                <[u8; 16]>::try_from(k.as_slice()),
                encoding::decode::<LeaseUsage>(&v, 1 << 20),
            ) {
                leases.insert(LeaseId(id), u);
            }
        }
        Ok(UsageMeter {
            store,
            tree,
            leases: Mutex::new(leases),
            running: Mutex::new(HashMap::new()),
            jobs_done: tokio::sync::Notify::new(),
            idle: tokio::sync::watch::Sender::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<LeaseId, LeaseUsage>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds GPU time and peak memory measured from the driver to `lease` (container
    /// jobs on GPUs).
    pub fn add_gpu_use(&self, lease: LeaseId, gpu_ms: u64, peak_memory_bytes: u64) {
        let usage = {
            let mut leases = self.lock();
            let u = leases.entry(lease).or_default();
            u.measured_gpu_ms = Some(u.measured_gpu_ms.unwrap_or(0).saturating_add(gpu_ms));
            u.peak_gpu_memory_bytes = u.peak_gpu_memory_bytes.max(peak_memory_bytes);
            u.clone()
        };
        if let Err(e) = self
            .store
            .put(self.tree, &lease.0, &encoding::encode(&usage))
        {
            tracing::warn!("cannot store usage of lease {lease}: {e}");
        }
    }

    /// Adds time the owner held a job of `lease` paused.
    pub fn add_paused(&self, lease: LeaseId, ms: u64) {
        if ms == 0 {
            return;
        }
        let usage = {
            let mut leases = self.lock();
            let u = leases.entry(lease).or_default();
            u.paused_ms = u.paused_ms.saturating_add(ms);
            u.clone()
        };
        if let Err(e) = self
            .store
            .put(self.tree, &lease.0, &encoding::encode(&usage))
        {
            tracing::warn!("cannot store usage of lease {lease}: {e}");
        }
    }

    /// Adds one job to `lease`.
    pub fn add_job(&self, lease: LeaseId, ms: u64, status: String, digest: Option<Digest>) {
        let usage = {
            let mut leases = self.lock();
            let u = leases.entry(lease).or_default();
            u.billed_ms = u.billed_ms.saturating_add(ms);
            u.jobs += 1;
            u.last_status = status;
            u.digests.extend(digest);
            u.clone()
        };
        if let Err(e) = self
            .store
            .put(self.tree, &lease.0, &encoding::encode(&usage))
        {
            tracing::warn!("cannot store usage of lease {lease}: {e}");
        }
    }

    /// A job of `lease` started; its lease's receipt waits for [`UsageMeter::job_ended`].
    pub fn job_started(&self, lease: LeaseId) {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        *running.entry(lease).or_default() += 1;
    }

    /// A job of `lease` ended (after [`UsageMeter::add_job`], or without usage).
    pub fn job_ended(&self, lease: LeaseId) {
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = running.get_mut(&lease) {
            *n -= 1;
            if *n == 0 {
                running.remove(&lease);
                self.jobs_done.notify_one();
                self.idle.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
    }

    /// Waits until no job of `lease` is running, at most `timeout`; whether none is.
    pub async fn wait_idle(&self, lease: &LeaseId, timeout: std::time::Duration) -> bool {
        let mut idle = self.idle.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if !self.has_running(lease) {
                return true;
            }
            if tokio::time::timeout_at(deadline, idle.changed())
                .await
                .is_err()
            {
                return false;
            }
        }
    }

    /// Whether a job of `lease` is still running.
    pub fn has_running(&self, lease: &LeaseId) -> bool {
        self.running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(lease)
    }

    /// What `lease` used so far (nothing if no job ran).
    pub fn get(&self, lease: &LeaseId) -> LeaseUsage {
        self.lock().get(lease).cloned().unwrap_or_default()
    }

    /// Forgets a settled lease.
    pub fn forget(&self, lease: &LeaseId) {
        self.lock().remove(lease);
        let _ = self.store.remove(self.tree, &lease.0);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn waiting_for_a_lease_ends_when_its_last_job_ends_and_not_before() {
        let meter =
            Arc::new(UsageMeter::open(Store::temporary().expect("store"), "t").expect("meter"));
        let (lease, other) = (LeaseId([1; 16]), LeaseId([2; 16]));
        assert!(
            meter.wait_idle(&lease, Duration::ZERO).await,
            "nothing runs"
        );
        meter.job_started(lease);
        meter.job_started(lease);
        meter.job_started(other);
        assert!(!meter.wait_idle(&lease, Duration::from_millis(20)).await);
        let waiter = tokio::spawn({
            let meter = meter.clone();
            async move { meter.wait_idle(&lease, Duration::from_secs(30)).await }
        });
        // Another lease's end and one of two jobs ending do not end the wait.
        meter.job_ended(other);
        meter.job_ended(lease);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        meter.add_job(lease, 5, "exited".into(), None);
        meter.job_ended(lease);
        assert!(waiter.await.expect("waiter"));
        assert_eq!(meter.get(&lease).jobs, 1);
    }
}
