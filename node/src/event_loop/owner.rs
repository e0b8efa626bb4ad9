//! The owner comes first, in the event loop: leases whose GPUs the owner starts using
//! are handled by the owner's policy (yield after a grace period, share, or suspend
//! until the owner leaves), checked at every inventory change and every second.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::lease::LeaseId;
use tokio::time::Instant;

use super::EventLoop;
use crate::lease::{LeaseRole, LeaseState};
use crate::owner::{LendingHours, OwnerPolicy};

/// The owner's rules and what the loop remembers while applying them.
pub(super) struct OwnerState {
    policy: OwnerPolicy,
    grace: Duration,
    /// When GPUs are lent (lease admission and renewal).
    pub(super) lending: LendingHours,
    /// Since when the owner has been on a GPU of each lease (policy `yield`).
    seen: HashMap<LeaseId, Instant>,
    /// Leases whose jobs are paused (policy `suspend`).
    suspended: HashSet<LeaseId>,
}

impl OwnerState {
    pub(super) fn new(policy: OwnerPolicy, grace: Duration, lending: LendingHours) -> OwnerState {
        OwnerState {
            policy,
            grace,
            lending,
            seen: HashMap::new(),
            suspended: HashSet::new(),
        }
    }
}

impl EventLoop {
    /// Applies the owner's policy to every active lease this node provides.
    pub(super) fn enforce_owner_policy(&mut self) {
        let busy: HashSet<&str> = self
            .inventory
            .gpus
            .iter()
            .filter(|g| g.state == GpuState::OwnerBusy)
            .map(|g| g.uuid.as_str())
            .collect();
        let leases: Vec<(LeaseId, bool)> = self
            .leases
            .all()
            .into_iter()
            .filter(|l| l.role == LeaseRole::Provider && l.state == LeaseState::Active)
            .map(|l| {
                let owner = l.terms.gpus.iter().any(|g| busy.contains(g.uuid.as_str()));
                (l.terms.lease_id, owner)
            })
            .collect();
        let active: HashSet<LeaseId> = leases.iter().map(|(id, _)| *id).collect();
        self.owner.seen.retain(|id, _| active.contains(id));
        self.owner.suspended.retain(|id| active.contains(id));
        let now = Instant::now();
        for (id, owner_there) in leases {
            match self.owner.policy {
                OwnerPolicy::Share => {}
                OwnerPolicy::Suspend => {
                    if owner_there != self.owner.suspended.contains(&id) {
                        self.lease_jobs.pause(&id, owner_there);
                        if owner_there {
                            tracing::info!(lease = %id, "the GPU's owner is back: lease suspended");
                            self.owner.suspended.insert(id);
                        } else {
                            tracing::info!(lease = %id, "the GPU's owner left: lease resumed");
                            self.owner.suspended.remove(&id);
                        }
                    }
                }
                OwnerPolicy::Yield if owner_there => {
                    let since = *self.owner.seen.entry(id).or_insert(now);
                    if now.duration_since(since) >= self.owner.grace {
                        self.owner.seen.remove(&id);
                        let stopped = self.lease_jobs.preempt(&id);
                        tracing::info!(lease = %id, stopped, "the GPU's owner is back: lease preempted");
                        self.metrics.leases_preempted.inc();
                        if let Err(e) = self.cancel_local(&id.to_string()) {
                            tracing::warn!(lease = %id, "cannot end a preempted lease: {}", e.message);
                        }
                    }
                }
                OwnerPolicy::Yield => {
                    self.owner.seen.remove(&id);
                }
            }
        }
    }
}
