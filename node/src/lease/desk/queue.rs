//! The desk's queue of lease requests it cannot grant yet: requests are placed with
//! [`gpunode_sched`] in serving order (the requester's [`gpunode_sched::Rank`], then fair
//! share by recent usage, then shortest declared time), and a request is granted only
//! when the plan starts it now, so the GPUs that free up go to the request ranked first,
//! and short requests fill gaps without delaying it (backfill). Where the team policy
//! allows it, a waiting request stops lower-priority leases (preemption).

use gpunode_protocol::lease::{LeaseId, LeaseRequest, QueuePlace, RejectCode, Rejection};
use gpunode_protocol::time::UnixMillis;
use gpunode_sched::{FairShare, Order, Queue, Request, Ticket};
use libp2p::PeerId;

use super::{Effects, LeaseDesk, Standings};
use crate::lease::{LeaseRole, LeaseState};

/// A place nobody asked for again in this long is dropped (its requester polls every
/// 0.2 s while it waits, or took another provider's offer).
pub const QUEUE_STALE_MS: u64 = 3_000;
/// Usage a day ago counts half in fair share.
pub const FAIR_SHARE_HALF_LIFE_MS: u64 = 24 * 3_600_000;
/// Requests placed per plan (the rest wait without an estimate).
const PLAN_DEPTH: usize = 64;
/// Requesters told at most at once that their turn came (see [`WaitQueue::turns`]).
const MAX_TURNS: usize = 8;

/// One user's fair-share usage as stored: `(usage GPU-ms, as of)`.
pub type FairShareEntry = (f64, UnixMillis);

/// The queue and the usage it is ordered by.
pub(super) struct WaitQueue {
    queue: Queue,
    fair: FairShare,
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

impl WaitQueue {
    /// The queue, with fair-share usage as stored (a restart must not wipe a heavy
    /// user's record).
    pub(super) fn new(order: Order, stored: Vec<(String, FairShareEntry)>) -> WaitQueue {
        let mut fair = FairShare::new(FAIR_SHARE_HALF_LIFE_MS);
        for (user, (usage, at)) in stored {
            fair.restore(&user, usage, at);
        }
        WaitQueue {
            queue: Queue::new(order, QUEUE_STALE_MS),
            fair,
        }
    }

    /// Charges `user`; returns its usage to store.
    pub(super) fn charge(
        &mut self,
        user: &str,
        gpu_ms: f64,
        now: UnixMillis,
    ) -> (String, Option<FairShareEntry>) {
        self.fair.charge(user, gpu_ms, now);
        (user.to_string(), self.fair.entry(user))
    }

    /// A queued request was granted: it leaves the queue and its declared GPU time counts
    /// towards its user's usage (what it does not use is given back when it ends).
    pub(super) fn granted(
        &mut self,
        peer: &PeerId,
        req: &LeaseRequest,
        now: UnixMillis,
    ) -> (String, Option<FairShareEntry>) {
        self.queue.remove(&ticket_of(req).0);
        let gpu_ms = req.requirements.gpus as f64 * req.duration_ms as f64;
        self.charge(&peer.to_string(), gpu_ms, now)
    }

    /// A request was refused for good: it leaves the queue.
    pub(super) fn refused(&mut self, req: &LeaseRequest) {
        self.queue.remove(&ticket_of(req).0);
    }

    /// The queued requests the plan starts now, although their requesters have not asked
    /// again yet (GPUs freed since): `(requester, ticket)`, at most [`MAX_TURNS`], in
    /// serving order. Each is told it is its turn, instead of waiting for its next poll.
    pub(super) fn turns(
        &mut self,
        timelines: &[gpunode_sched::GpuTimeline],
        now: UnixMillis,
    ) -> Vec<(PeerId, u128)> {
        self.queue.expire(now);
        if self.queue.is_empty() {
            return Vec::new();
        }
        let plan = self.queue.plan(timelines, &self.fair, now, PLAN_DEPTH);
        plan.starting_now(now)
            .filter_map(|p| {
                let user = &self.queue.request(&p.ticket)?.user;
                Some((user.parse::<PeerId>().ok()?, p.ticket.0))
            })
            .take(MAX_TURNS)
            .collect()
    }

    /// `peer` withdraws its request queued under `ticket` (it took another provider's
    /// offer); returns whether it was there. Nobody can withdraw another's request.
    pub(super) fn withdraw(&mut self, peer: &PeerId, ticket: u128) -> bool {
        let ticket = Ticket(ticket);
        let owned = self
            .queue
            .request(&ticket)
            .is_some_and(|r| r.user == peer.to_string());
        if owned {
            self.queue.remove(&ticket);
        }
        owned
    }

    /// A user's usage now (tests).
    #[cfg(test)]
    pub(super) fn usage_gpu_ms(&self, user: &str, now: UnixMillis) -> f64 {
        self.fair.usage_gpu_ms(user, now)
    }
}

impl LeaseDesk {
    /// The waiting requests in serving order, as this provider plans them now (at most
    /// 64, the plan's depth). Requesters for whom `shown` is false (not in our team)
    /// are named only by their place.
    pub(crate) fn queue_view(
        &mut self,
        now: UnixMillis,
        shown: impl Fn(&PeerId) -> bool,
    ) -> Vec<crate::overview::QueuedRequestView> {
        let waiting = &mut self.waiting;
        waiting.queue.expire(now);
        if waiting.queue.is_empty() {
            return Vec::new();
        }
        let timelines = self.book.timelines(now);
        let plan = waiting
            .queue
            .plan(&timelines, &waiting.fair, now, PLAN_DEPTH);
        let mut out: Vec<_> = plan
            .placements
            .iter()
            .filter_map(|p| {
                let req = waiting.queue.request(&p.ticket)?;
                let requester = match req.user.parse::<PeerId>() {
                    Ok(peer) if shown(&peer) => req.user.clone(),
                    _ => format!("peer outside the team (#{})", p.position),
                };
                Some(crate::overview::QueuedRequestView {
                    position: p.position,
                    of: p.of,
                    requester,
                    gpus: req.gpus,
                    duration_ms: req.duration_ms,
                    waiting_since_ms: waiting.queue.arrived(&p.ticket).unwrap_or(now),
                    estimated_start_ms: p.start_ms,
                    reason: p.reason.clone(),
                })
            })
            .collect();
        out.sort_by_key(|q| q.position);
        out
    }

    /// Places `req` in the queue and decides whether it starts now.
    pub(super) fn decide(
        &mut self,
        peer: &PeerId,
        req: &LeaseRequest,
        standings: &dyn Standings,
        effects: &mut Effects,
        now: UnixMillis,
    ) -> Decision {
        self.decide_once(peer, req, standings, effects, now, true)
    }

    fn decide_once(
        &mut self,
        peer: &PeerId,
        req: &LeaseRequest,
        standings: &dyn Standings,
        effects: &mut Effects,
        now: UnixMillis,
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
        let eligible = self.book.eligible_gpus(req);
        if (eligible.len() as u32) < req.requirements.gpus {
            // This provider can never serve it: the book says why.
            return Decision::Grant(Vec::new());
        }
        let standing = standings.standing(peer);
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
        let timelines = self.book.timelines(now);
        let plan = waiting
            .queue
            .plan(&timelines, &waiting.fair, now, PLAN_DEPTH);
        let Some(place) = plan.get(&ticket).cloned() else {
            return Decision::Grant(Vec::new());
        };
        if place.starts_now(now) {
            return Decision::Grant(place.gpus);
        }
        if keep && may_preempt && self.preempt_for(req, standing.priority, standings, effects, now)
        {
            // GPUs were freed for it: place it again (once).
            return self.decide_once(peer, req, standings, effects, now, false);
        }
        if !keep {
            self.waiting.queue.remove(&ticket);
            return Decision::Refused(match self.book.capacity_for(peer, req, now) {
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
    fn preempt_for(
        &mut self,
        req: &LeaseRequest,
        priority: i32,
        standings: &dyn Standings,
        effects: &mut Effects,
        now: UnixMillis,
    ) -> bool {
        if !standings.preempts() {
            return false;
        }
        let eligible = self.book.eligible_gpus(req);
        let free_now = self
            .book
            .timelines(now)
            .iter()
            .filter(|t| eligible.contains(&t.index) && t.free_at == Some(now))
            .count() as u32;
        let mut need = req.requirements.gpus.saturating_sub(free_now);
        if need == 0 {
            return false;
        }
        let mut victims = self.victims(&eligible, priority, standings);
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
            tracing::info!(lease = %id, "preempted for higher-priority work (team policy)");
            effects.preempt.push(id);
            match self.cancel(&id.to_string(), now) {
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

    /// Active leases this node provides to requesters ranked below `priority` that hold
    /// GPUs among `eligible`: `(priority, most recent first, id, usable GPUs)`.
    fn victims(
        &self,
        eligible: &[u32],
        priority: i32,
        standings: &dyn Standings,
    ) -> Vec<(i32, std::cmp::Reverse<u64>, LeaseId, u32)> {
        self.book
            .live()
            .into_iter()
            .filter(|l| l.role == LeaseRole::Provider && l.state == LeaseState::Active)
            .filter_map(|l| {
                let p = standings.standing(&l.terms.requester).priority;
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
            .collect()
    }
}
