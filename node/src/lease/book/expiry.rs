//! What time does to the book: offers expire, leases complete, reservations start,
//! spent nonces are forgotten and ended records are pruned after their retention.

use gpunode_protocol::lease::LeaseId;
use gpunode_protocol::time::UnixMillis;

use super::{Change, LeaseBook, LeaseState, EXPIRED_OFFER_RETENTION_MS, PRUNE_EVERY_MS};

impl LeaseBook {
    /// Moves time forward: offers past their window expire (holds released), active
    /// leases past their end complete, spent nonces past any use are forgotten.
    pub fn tick(&mut self, now: UnixMillis) -> Vec<LeaseId> {
        let mut changed = Vec::new();
        while let Some(&(due, id)) = self.deadlines.first() {
            if due > now {
                break;
            }
            let next = match self.leases.get(&id).map(|l| l.state) {
                Some(LeaseState::Offered) => LeaseState::Expired,
                Some(LeaseState::Active) => LeaseState::Completed,
                Some(LeaseState::Reserved) => LeaseState::Active,
                _ => {
                    self.deadlines.remove(&(due, id));
                    continue;
                }
            };
            self.set_state(id, next, now);
            changed.push(id);
        }
        while let Some(&(until, peer, nonce)) = self.nonce_expiry.first() {
            if until >= now {
                break;
            }
            self.nonce_expiry.remove(&(until, peer, nonce));
            self.nonces.remove(&(peer, nonce));
            self.changes.push(Change::ForgetNonce(peer, nonce));
        }
        if now >= self.last_prune_ms.saturating_add(PRUNE_EVERY_MS) {
            self.last_prune_ms = now;
            self.prune(now);
        }
        changed
    }

    /// Forgets ended records older than the retention (offers that expired unsigned
    /// after an hour), so that a peer's requests cannot grow the book without bound.
    fn prune(&mut self, now: UnixMillis) {
        let retention = self.policy.retention_ms;
        let old: Vec<LeaseId> = self
            .leases
            .values()
            .filter(|l| {
                let keep = match l.state {
                    LeaseState::Expired => EXPIRED_OFFER_RETENTION_MS.min(retention),
                    LeaseState::Completed | LeaseState::Cancelled | LeaseState::Failed => retention,
                    _ => return false,
                };
                l.updated_ms.saturating_add(keep) < now
            })
            .map(|l| l.terms.lease_id)
            .collect();
        for id in old {
            self.account(&id, false);
            self.leases.remove(&id);
            self.changes.push(Change::ForgetLease(id));
        }
    }

    /// When the next offer window, lease end or reservation start falls due, if any.
    pub fn next_lease_deadline(&self) -> Option<UnixMillis> {
        self.deadlines.first().map(|(due, _)| *due)
    }

    /// When the book next needs a [`LeaseBook::tick`]: an offer window or lease end, a
    /// spent nonce to forget (to the second), or the minute's pruning of ended records.
    /// Without this, a node that holds no lease would never forget the nonces of the
    /// requests it refused.
    pub fn next_deadline(&self) -> Option<UnixMillis> {
        let lease = self.next_lease_deadline();
        let nonce = self
            .nonce_expiry
            .first()
            .map(|(until, _, _)| (until / 1000 + 1) * 1000);
        let prune =
            (!self.leases.is_empty()).then(|| self.last_prune_ms.saturating_add(PRUNE_EVERY_MS));
        [lease, nonce, prune].into_iter().flatten().min()
    }
}
