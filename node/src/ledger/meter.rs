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

use crate::store::Store;

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
    pub fn open(store: Store, tree: &'static str) -> Result<UsageMeter, crate::store::StoreError> {
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
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<LeaseId, LeaseUsage>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
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
