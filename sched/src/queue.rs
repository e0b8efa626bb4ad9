//! The waiting requests themselves and the order they are served in.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use crate::fair_share::FairShare;
use crate::Millis;

/// A waiting request's identity, chosen by the requester and kept across its asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ticket(pub u128);

/// How a provider orders waiting requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// The node's rule: role priority, then credit standing and reputation (which only
    /// differ outside a team), then fair share by recent usage, then shortest declared
    /// time, then arrival; later requests may start early only where that delays no
    /// request ranked above them (conservative backfill).
    Fair,
    /// First come, first served, nobody passes.
    Fcfs,
    /// First come, first served with EASY backfill (Slurm's default `sched/backfill`
    /// with `priority/basic`): only the first waiting request holds a reservation, and a
    /// later one may start now if it does not delay that reservation. The baseline the
    /// benchmarks compare with.
    Easy,
}

/// How the requester stands with this provider, as the provider sees it now.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Standing {
    /// Serving priority of the requester's team role (0 outside a team).
    pub priority: i32,
    /// Credit standing with this provider, millicredits (0 inside a team).
    pub credit_millicredits: i64,
    /// Reputation score, 0 to 1 (give the same to everyone inside a team).
    pub reputation: f64,
}

/// Where a requester stands in serving order: higher is served first. Role priority,
/// then whole credits (a few millicredits of difference is not a rule), then reputation
/// in tenths. Lease admission and CPU slots both order by it.
pub type Rank = (i32, i64, u32);

impl Standing {
    /// This standing's [`Rank`].
    pub fn rank(&self) -> Rank {
        (
            self.priority,
            self.credit_millicredits.div_euclid(1000),
            (self.reputation.clamp(0.0, 1.0) * 10.0).floor() as u32,
        )
    }
}

/// One request waiting for GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Who asks, kept across asks.
    pub ticket: Ticket,
    /// The user charged for it (fair share).
    pub user: String,
    /// GPUs needed.
    pub gpus: u32,
    /// GPUs of this provider that could serve it at all (model, memory, slice).
    pub eligible: Vec<u32>,
    /// Declared time (the lease duration), ms.
    pub duration_ms: u64,
    /// How the requester stands.
    pub standing: Standing,
}

#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) request: Request,
    pub(crate) arrived_ms: Millis,
    pub(crate) last_seen_ms: Millis,
    seq: u64,
}

/// A provider's waiting requests.
#[derive(Debug, Clone)]
pub struct Queue {
    order: Order,
    stale_after_ms: u64,
    entries: BTreeMap<Ticket, Entry>,
    next_seq: u64,
}

/// The sort key of an entry under [`Order::Fair`]: smaller goes first.
type FairKey = (Reverse<Rank>, u32, u64, Millis, u64);

impl Queue {
    /// An empty queue; a request not asked for again within `stale_after_ms` is dropped
    /// (its requester took another offer or gave up).
    pub fn new(order: Order, stale_after_ms: u64) -> Queue {
        Queue {
            order,
            stale_after_ms,
            entries: BTreeMap::new(),
            next_seq: 0,
        }
    }

    /// The ordering rule.
    pub fn order(&self) -> Order {
        self.order
    }

    /// Adds a request, or refreshes it when its ticket is already queued (its place in
    /// arrival order is kept).
    pub fn upsert(&mut self, request: Request, now: Millis) {
        match self.entries.get_mut(&request.ticket) {
            Some(e) => {
                e.request = request;
                e.last_seen_ms = now;
            }
            None => {
                self.next_seq += 1;
                self.entries.insert(
                    request.ticket,
                    Entry {
                        request,
                        arrived_ms: now,
                        last_seen_ms: now,
                        seq: self.next_seq,
                    },
                );
            }
        }
    }

    /// Takes a request out (granted or withdrawn).
    pub fn remove(&mut self, ticket: &Ticket) -> Option<Request> {
        self.entries.remove(ticket).map(|e| e.request)
    }

    /// Whether a ticket waits here.
    pub fn contains(&self, ticket: &Ticket) -> bool {
        self.entries.contains_key(ticket)
    }

    /// The request queued under `ticket`.
    pub fn request(&self, ticket: &Ticket) -> Option<&Request> {
        self.entries.get(ticket).map(|e| &e.request)
    }

    /// When a queued request first arrived.
    pub fn arrived(&self, ticket: &Ticket) -> Option<Millis> {
        self.entries.get(ticket).map(|e| e.arrived_ms)
    }

    /// Drops requests not asked for again in time; returns how many.
    pub fn expire(&mut self, now: Millis) -> usize {
        let before = self.entries.len();
        let stale = self.stale_after_ms;
        self.entries
            .retain(|_, e| now.saturating_sub(e.last_seen_ms) <= stale);
        before - self.entries.len()
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn fair_key(e: &Entry, fair: &FairShare, now: Millis) -> FairKey {
        (
            Reverse(e.request.standing.rank()),
            fair.level(&e.request.user, now),
            e.request.duration_ms,
            e.arrived_ms,
            e.seq,
        )
    }

    /// The requests in serving order.
    pub(crate) fn ranked(&self, fair: &FairShare, now: Millis) -> Vec<&Entry> {
        let mut list: Vec<&Entry> = self.entries.values().collect();
        match self.order {
            Order::Fair => list.sort_by_cached_key(|e| Self::fair_key(e, fair, now)),
            Order::Fcfs | Order::Easy => list.sort_by_key(|e| (e.arrived_ms, e.seq)),
        }
        list
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn request(ticket: u128, user: &str, duration_ms: u64) -> Request {
        Request {
            ticket: Ticket(ticket),
            user: user.into(),
            gpus: 1,
            eligible: vec![0],
            duration_ms,
            standing: Standing::default(),
        }
    }

    fn order_of(q: &Queue, fair: &FairShare, now: Millis) -> Vec<u128> {
        q.ranked(fair, now)
            .iter()
            .map(|e| e.request.ticket.0)
            .collect()
    }

    #[test]
    fn role_priority_then_fair_share_then_short_jobs_then_arrival() {
        let mut fair = FairShare::new(3_600_000);
        fair.charge("heavy", 3_600_000.0, 0); // one GPU-hour
        let mut q = Queue::new(Order::Fair, 10_000);
        q.upsert(request(1, "heavy", 60_000), 10);
        q.upsert(request(2, "light", 600_000), 20);
        q.upsert(request(3, "light", 60_000), 30);
        q.upsert(request(4, "light", 60_000), 40);
        let mut admin = request(5, "heavy", 600_000);
        admin.standing.priority = 10;
        q.upsert(admin, 50);
        // Admin first despite heavy usage; then light's jobs, short ones first and equal
        // ones by arrival; heavy's last.
        assert_eq!(order_of(&q, &fair, 100), vec![5, 3, 4, 2, 1]);

        let fcfs = Queue {
            order: Order::Fcfs,
            ..q.clone()
        };
        assert_eq!(order_of(&fcfs, &fair, 100), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn fair_share_forgets_with_the_half_life() {
        let hour = 3_600_000;
        let mut fair = FairShare::new(hour);
        fair.charge("ann", 3_600_000.0, 0);
        fair.charge("bob", 60_000.0, 0);
        let mut q = Queue::new(Order::Fair, u64::MAX);
        q.upsert(request(1, "ann", 60_000), 0);
        q.upsert(request(2, "bob", 120_000), 0);
        assert_eq!(order_of(&q, &fair, 0), vec![2, 1], "bob used less");
        // Ten half-lives on, both usages are below one GPU-second: level 0 for both,
        // and ann's shorter job goes first.
        assert_eq!(order_of(&q, &fair, 20 * hour), vec![1, 2]);
    }

    #[test]
    fn credit_and_reputation_order_requests_outside_a_team() {
        let fair = FairShare::new(3_600_000);
        let mut q = Queue::new(Order::Fair, u64::MAX);
        let mut debtor = request(1, "debtor", 60_000);
        debtor.standing = Standing {
            priority: 0,
            credit_millicredits: -5_000,
            reputation: 0.9,
        };
        let mut giver = request(2, "giver", 600_000);
        giver.standing = Standing {
            priority: 0,
            credit_millicredits: 50_000,
            reputation: 0.5,
        };
        let mut trusted = request(3, "trusted", 600_000);
        trusted.standing = Standing {
            priority: 0,
            credit_millicredits: 50_400,
            reputation: 0.9,
        };
        q.upsert(debtor, 0);
        q.upsert(giver, 1);
        q.upsert(trusted, 2);
        // Same whole-credit standing for giver and trusted; reputation breaks the tie.
        assert_eq!(order_of(&q, &fair, 10), vec![3, 2, 1]);
    }

    #[test]
    fn asking_again_keeps_the_place_and_silence_drops_it() {
        let fair = FairShare::new(3_600_000);
        let mut q = Queue::new(Order::Fcfs, 5_000);
        q.upsert(request(1, "a", 1_000), 0);
        q.upsert(request(2, "b", 1_000), 1_000);
        q.upsert(request(1, "a", 1_000), 4_000);
        assert_eq!(order_of(&q, &fair, 4_000), vec![1, 2]);
        assert_eq!(q.arrived(&Ticket(1)), Some(0));
        assert_eq!(q.expire(6_500), 1, "b was last seen at 1 s");
        assert!(q.contains(&Ticket(1)) && !q.contains(&Ticket(2)));
        assert_eq!(q.remove(&Ticket(1)).map(|r| r.user), Some("a".to_string()));
        assert!(q.is_empty());
    }
}
