//! The owner comes first: leases whose GPUs the owner starts using are handled by the
//! owner's policy (yield after a grace period, share, or suspend until the owner leaves),
//! checked at every inventory change and every second.

use std::collections::{HashMap, HashSet};

use gpunode_protocol::lease::LeaseId;
use gpunode_protocol::time::UnixMillis;

use super::{Effects, LeaseDesk};
use crate::lease::{LeaseRole, LeaseState};
use crate::owner::OwnerPolicy;

/// The owner's policy and what the desk remembers while applying it.
pub struct OwnerRules {
    policy: OwnerPolicy,
    grace_ms: u64,
    /// Since when the owner has been on a GPU of each lease (policy `yield`).
    seen: HashMap<LeaseId, UnixMillis>,
    /// Leases whose jobs are paused (policy `suspend`).
    suspended: HashSet<LeaseId>,
}

impl OwnerRules {
    /// `policy`, yielding after `grace_ms`.
    pub fn new(policy: OwnerPolicy, grace_ms: u64) -> OwnerRules {
        OwnerRules {
            policy,
            grace_ms,
            seen: HashMap::new(),
            suspended: HashSet::new(),
        }
    }
}

impl LeaseDesk {
    /// Applies the owner's policy to every active lease this node provides, given the
    /// GPUs (by uuid) the owner uses now.
    pub fn enforce_owner_policy(&mut self, owner_busy: &HashSet<&str>, now: UnixMillis) -> Effects {
        let owner = &self.owner;
        if owner.policy == OwnerPolicy::Share
            || (owner_busy.is_empty() && owner.seen.is_empty() && owner.suspended.is_empty())
        {
            // Nothing to start or undo: every lease would be left as it is. This runs
            // once a second and at every inventory change, so it must not walk the
            // leases.
            return self.tracked(now, |_, _| {}).1;
        }
        let leases: Vec<(LeaseId, bool)> = self
            .book
            .live()
            .into_iter()
            .filter(|l| l.role == LeaseRole::Provider && l.state == LeaseState::Active)
            .map(|l| {
                let owner = l
                    .terms
                    .gpus
                    .iter()
                    .any(|g| owner_busy.contains(g.uuid.as_str()));
                (l.terms.lease_id, owner)
            })
            .collect();
        let active: HashSet<LeaseId> = leases.iter().map(|(id, _)| *id).collect();
        self.owner.seen.retain(|id, _| active.contains(id));
        self.owner.suspended.retain(|id| active.contains(id));
        self.tracked(now, |desk, effects| {
            for (id, owner_there) in leases {
                desk.apply_owner_policy(id, owner_there, effects, now);
            }
        })
        .1
    }

    fn apply_owner_policy(
        &mut self,
        id: LeaseId,
        owner_there: bool,
        effects: &mut Effects,
        now: UnixMillis,
    ) {
        let owner = &mut self.owner;
        match owner.policy {
            OwnerPolicy::Share => {}
            OwnerPolicy::Suspend => {
                if owner_there != owner.suspended.contains(&id) {
                    effects.pause.push((id, owner_there));
                    if owner_there {
                        tracing::info!(lease = %id, "the GPU's owner is back: lease suspended");
                        owner.suspended.insert(id);
                    } else {
                        tracing::info!(lease = %id, "the GPU's owner left: lease resumed");
                        owner.suspended.remove(&id);
                    }
                }
            }
            OwnerPolicy::Yield if owner_there => {
                let since = *owner.seen.entry(id).or_insert(now);
                if now.saturating_sub(since) >= owner.grace_ms {
                    owner.seen.remove(&id);
                    tracing::info!(lease = %id, "the GPU's owner is back: lease preempted");
                    effects.preempt.push(id);
                    effects.flush_now = true;
                    if let Err(e) = self.cancel(&id.to_string(), now) {
                        tracing::warn!(lease = %id, "cannot end a preempted lease: {}", e.message);
                    }
                }
            }
            OwnerPolicy::Yield => {
                owner.seen.remove(&id);
            }
        }
    }
}
