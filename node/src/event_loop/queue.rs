//! The provider's queue of lease requests it cannot grant yet: requests are placed with
//! [`gpunode_sched`] in policy order (team role priority, or credit standing and
//! reputation outside a team; then fair share by recent usage; then shortest declared
//! time), and a request is granted only when the plan starts it now, so the GPUs that
//! free up go to the request ranked first, and short requests fill gaps without delaying
//! it (backfill).

use gpunode_protocol::lease::{LeaseRequest, QueuePlace, RejectCode, Rejection};
use gpunode_sched::{FairShare, Order, Queue, Request, Standing, Ticket};
use libp2p::PeerId;

use super::EventLoop;
use crate::lease::{LeaseRole, LeaseState};
use gpunode_protocol::lease::LeaseId;

/// A place nobody asked for again in this long is dropped (its requester polls every
/// 0.2 s while it waits, or took another provider's offer).
pub(crate) const QUEUE_STALE_MS: u64 = 3_000;
/// Usage a day ago counts half in fair share.
pub(crate) const FAIR_SHARE_HALF_LIFE_MS: u64 = 24 * 3_600_000;
/// Requests placed per plan (the rest wait without an estimate).
const PLAN_DEPTH: usize = 64;

/// The queue and the usage it is ordered by.
pub(crate) struct WaitQueue {
    queue: Queue,
    fair: FairShare,
}

/// Store tree of fair-share usage, by user: `(usage GPU-ms, as of)`.
const FAIR_SHARE_TREE: &str = "fair_share";

impl WaitQueue {
    /// The queue, with fair-share usage as persisted in `store` (it survives restarts:
    /// a restart must not wipe a heavy user's record).
    pub(crate) fn new(order: Order, store: &crate::store::Store) -> WaitQueue {
        let mut fair = FairShare::new(FAIR_SHARE_HALF_LIFE_MS);
        for (k, v) in store.scan(FAIR_SHARE_TREE).unwrap_or_default() {
            if let (Ok(user), Ok((usage, at))) = (
                String::from_utf8(k),
                gpunode_protocol::encoding::decode::<(f64, u64)>(&v, 64),
            ) {
                fair.restore(&user, usage, at);
            }
        }
        WaitQueue {
            queue: Queue::new(order, QUEUE_STALE_MS),
            fair,
        }
    }

    /// Charges `user` and writes its new usage (durable with the next flush).
    fn charge(&mut self, store: &crate::store::Store, user: &str, gpu_ms: f64, now: u64) {
        self.fair.charge(user, gpu_ms, now);
        let written = match self.fair.entry(user) {
            Some(entry) => store.put(
                FAIR_SHARE_TREE,
                user.as_bytes(),
                &gpunode_protocol::encoding::encode(&entry),
            ),
            None => store.remove(FAIR_SHARE_TREE, user.as_bytes()),
        };
        if let Err(e) = written {
            tracing::warn!("cannot store fair-share usage: {e}");
        }
    }
}

/// What to do with a request that passed admission.
pub(super) enum Decision {
    /// Grant it now, on these GPUs if free.
    Grant(Vec<u32>),
    /// Not now: its place.
    Queued(QueuePlace),
    /// Not now, and it asked not to wait.
    Refused(Rejection),
}

fn ticket_of(req: &LeaseRequest) -> (Ticket, bool) {
    match req.ticket {
        Some(t) => (Ticket(t), true),
        // A request without a ticket is placed once, to respect the order, and never
        // kept.
        None => (Ticket(req.nonce as u128 | 1 << 127), false),
    }
}

impl EventLoop {
    fn standing_of(&self, peer: &PeerId) -> Standing {
        match &self.team {
            Some(team) => Standing {
                priority: team.priority_of(peer),
                credit_millicredits: 0,
                reputation: 1.0,
            },
            None => Standing {
                priority: 0,
                credit_millicredits: self
                    .accounts
                    .standing(peer)
                    .clamp(i64::MIN as i128, i64::MAX as i128)
                    as i64,
                reputation: self.accounts.reputation.score(peer),
            },
        }
    }

    /// Places `req` in the queue and decides whether it starts now.
    pub(super) fn queue_decision(
        &mut self,
        peer: &PeerId,
        req: &LeaseRequest,
        now: u64,
    ) -> Decision {
        self.decide(peer, req, now, true)
    }

    fn decide(
        &mut self,
        peer: &PeerId,
        req: &LeaseRequest,
        now: u64,
        may_preempt: bool,
    ) -> Decision {
        let (ticket, keep) = ticket_of(req);
        if req
            .start_at_ms
            .is_some_and(|at| at > now + gpunode_protocol::lease::RESERVATION_MIN_LEAD_MS)
        {
            // A reservation books the future; the book checks it against other
            // reservations and present leases.
            return Decision::Grant(Vec::new());
        }
        let eligible = self.leases.eligible_gpus(req);
        if (eligible.len() as u32) < req.requirements.gpus {
            // This provider can never serve it: the book says why.
            return Decision::Grant(Vec::new());
        }
        let standing = self.standing_of(peer);
        let waiting = &mut self.waiting;
        waiting.queue.expire(now);
        waiting.queue.upsert(
            Request {
                ticket,
                user: peer.to_string(),
                gpus: req.requirements.gpus,
                eligible,
                duration_ms: req.duration_ms,
                standing,
            },
            now,
        );
        let plan = waiting
            .queue
            .plan(&self.leases.timelines(now), &waiting.fair, now, PLAN_DEPTH);
        let Some(place) = plan.get(&ticket).cloned() else {
            return Decision::Grant(Vec::new());
        };
        if place.starts_now(now) {
            return Decision::Grant(place.gpus);
        }
        if keep && may_preempt && self.preempt_for(req, standing.priority, now) {
            // GPUs were freed for it: place it again (once).
            return self.decide(peer, req, now, false);
        }
        let waiting = &mut self.waiting;
        if !keep {
            waiting.queue.remove(&ticket);
            return Decision::Refused(match self.leases.capacity_for(peer, req, now) {
                Err(r) => r,
                Ok(()) => Rejection::new(
                    RejectCode::NoCapacity,
                    format!(
                        "the free GPUs are held for {} request(s) waiting ahead of you; ask with --wait to queue",
                        place.ahead
                    ),
                ),
            });
        }
        Decision::Queued(QueuePlace {
            position: place.position,
            of: place.of,
            estimated_start_ms: place.start_ms,
            reason: place.reason,
        })
    }

    /// Where the team policy allows it, stops running leases of requesters with a lower
    /// priority than `priority` on GPUs `req` could use, lowest priority and most recent
    /// first, until enough GPUs are free; returns whether it stopped any. Their jobs end
    /// as preempted (no fault of theirs; they are charged for the time they used).
    fn preempt_for(&mut self, req: &LeaseRequest, priority: i32, now: u64) -> bool {
        let Some(team) = self.team.clone() else {
            return false;
        };
        if !team.preempts() {
            return false;
        }
        let eligible = self.leases.eligible_gpus(req);
        let free_now = self
            .leases
            .timelines(now)
            .iter()
            .filter(|t| eligible.contains(&t.index) && t.free_at == Some(now))
            .count() as u32;
        let mut need = req.requirements.gpus.saturating_sub(free_now);
        if need == 0 {
            return false;
        }
        let mut victims: Vec<(i32, std::cmp::Reverse<u64>, LeaseId, u32)> = self
            .leases
            .all()
            .into_iter()
            .filter(|l| l.role == LeaseRole::Provider && l.state == LeaseState::Active)
            .filter_map(|l| {
                let p = team.priority_of(&l.terms.requester);
                let usable = l
                    .terms
                    .gpus
                    .iter()
                    .filter(|g| eligible.contains(&g.index))
                    .count() as u32;
                (p < priority && usable > 0).then_some((
                    p,
                    std::cmp::Reverse(l.terms.start_ms),
                    l.terms.lease_id,
                    usable,
                ))
            })
            .collect();
        let available: u32 = victims.iter().map(|v| v.3).sum();
        if available < need {
            return false;
        }
        victims.sort();
        let mut stopped = false;
        for (_, _, id, usable) in victims {
            if need == 0 {
                break;
            }
            let jobs = self.lease_jobs.preempt(&id);
            tracing::info!(lease = %id, jobs, "preempted for higher-priority work (team policy)");
            self.metrics.leases_preempted.inc();
            match self.cancel_local(&id.to_string()) {
                Ok(_) => {
                    need = need.saturating_sub(usable);
                    stopped = true;
                }
                Err(e) => {
                    tracing::warn!(lease = %id, "cannot end a preempted lease: {}", e.message)
                }
            }
        }
        stopped
    }

    /// A queued request was granted: it leaves the queue and its declared GPU time counts
    /// towards its user's usage (what it does not use is given back when it ends).
    pub(super) fn queue_granted(&mut self, peer: &PeerId, req: &LeaseRequest, now: u64) {
        let (ticket, _) = ticket_of(req);
        self.waiting.queue.remove(&ticket);
        let gpu_ms = req.requirements.gpus as f64 * req.duration_ms as f64;
        self.waiting
            .charge(&self.store, &peer.to_string(), gpu_ms, now);
    }

    /// A request was refused for good: it leaves the queue.
    pub(super) fn queue_refused(&mut self, req: &LeaseRequest) {
        self.waiting.queue.remove(&ticket_of(req).0);
    }

    /// A lease we provided ended at `now`: its user gets back the GPU time it was charged
    /// and did not use.
    pub(super) fn queue_lease_ended(
        &mut self,
        requester: &PeerId,
        gpus: u32,
        end_ms: u64,
        now: u64,
    ) {
        let unused = end_ms.saturating_sub(now) as f64 * gpus as f64;
        if unused > 0.0 {
            self.waiting
                .charge(&self.store, &requester.to_string(), -unused, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fair_share_usage_survives_a_restart() {
        let dir = tempfile::tempdir().expect("tmp");
        let now = 1_800_000_000_000;
        {
            let store = crate::store::Store::open(dir.path()).expect("store");
            let mut w = WaitQueue::new(Order::Fair, &store);
            w.charge(&store, "heavy", 3_600_000.0 * 8.0, now);
            w.charge(&store, "light", 1_000.0, now);
            // Given back entirely: nothing left to keep.
            w.charge(&store, "light", -1_000.0, now);
            store.flush().expect("flush");
        }
        let store = crate::store::Store::open(dir.path()).expect("reopen");
        let w = WaitQueue::new(Order::Fair, &store);
        assert!((w.fair.usage_gpu_ms("heavy", now) - 28_800_000.0).abs() < 1e-3);
        assert_eq!(w.fair.usage_gpu_ms("light", now), 0.0);
    }
}
