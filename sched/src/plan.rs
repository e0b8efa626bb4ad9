//! Placing the queue on the provider's GPU timeline: who starts now, and when each of
//! the others would start if nothing changed.

use std::collections::HashMap;

use crate::fair_share::FairShare;
use crate::queue::{Order, Queue, Ticket};
use crate::{human_duration, Millis};

/// One GPU of the provider, as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuTimeline {
    /// Index on the provider.
    pub index: u32,
    /// When its current lease ends (`Some(now)` or earlier when free); `None` while it
    /// cannot be lent at all (the owner has it, or it is outside lending hours).
    pub free_at: Option<Millis>,
    /// Reservations already signed on it, `[start, end)`.
    pub reserved: Vec<(Millis, Millis)>,
}

impl GpuTimeline {
    fn clear(&self, start: Millis, end: Millis, extra: &[(Millis, Millis)]) -> bool {
        self.free_at.is_some_and(|f| f <= start)
            && self
                .reserved
                .iter()
                .chain(extra)
                .all(|(s, e)| *e <= start || *s >= end)
    }
}

/// Where one waiting request stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The request.
    pub ticket: Ticket,
    /// 1 = served next.
    pub position: u32,
    /// Requests waiting in all.
    pub of: u32,
    /// When it would start if nothing changed; `None` when this provider cannot serve it
    /// at any time it can foresee.
    pub start_ms: Option<Millis>,
    /// The GPUs it would get then.
    pub gpus: Vec<u32>,
    /// Requests ranked above it.
    pub ahead: u32,
    /// Why it does not start now, in plain words (empty when it does).
    pub reason: String,
}

impl Placement {
    /// Whether the plan starts it now.
    pub fn starts_now(&self, now: Millis) -> bool {
        self.start_ms == Some(now)
    }

    /// "position 2 of 5; estimated start in 3m 20s: ..." for messages and `gpunode why`.
    pub fn describe(&self, now: Millis) -> String {
        let when = match self.start_ms {
            Some(t) if t <= now => "it can start now".to_string(),
            Some(t) => format!("estimated start in {}", human_duration(t - now)),
            None => "no start can be estimated".to_string(),
        };
        format!(
            "queued: position {} of {}; {when}: {}",
            self.position, self.of, self.reason
        )
    }
}

/// The queue placed on the timeline, in serving order.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Every waiting request.
    pub placements: Vec<Placement>,
}

impl Plan {
    /// Where `ticket` stands.
    pub fn get(&self, ticket: &Ticket) -> Option<&Placement> {
        self.placements.iter().find(|p| p.ticket == *ticket)
    }

    /// The requests that start now, with their GPUs.
    pub fn starting_now(&self, now: Millis) -> impl Iterator<Item = &Placement> {
        self.placements.iter().filter(move |p| p.starts_now(now))
    }
}

impl Queue {
    /// Places every live request on `gpus`, in serving order: each gets the earliest
    /// time at which enough of its eligible GPUs are free for its whole declared time
    /// without touching a reservation or the place of any request ranked above it. Under
    /// [`Order::Fcfs`] nobody starts before a request that arrived earlier. Under
    /// [`Order::Easy`] only the first request keeps its place ahead; a later one is
    /// placed only if it starts now without touching that place (it gets no estimate
    /// otherwise).
    ///
    /// Only the first `depth` requests are placed (the rest wait without an estimate and
    /// cannot start), which bounds the work per plan like Slurm's `bf_max_job_test`.
    pub fn plan(&self, gpus: &[GpuTimeline], fair: &FairShare, now: Millis, depth: usize) -> Plan {
        let ranked = self.ranked(fair, now);
        let of = ranked.len() as u32;
        let by_index: HashMap<u32, &GpuTimeline> = gpus.iter().map(|g| (g.index, g)).collect();
        // Places already given to requests ranked higher, per GPU.
        let mut held: HashMap<u32, Vec<(Millis, Millis)>> = HashMap::new();
        let mut not_before = now;
        let mut placements = Vec::with_capacity(ranked.len());
        for (i, entry) in ranked.iter().enumerate() {
            let req = &entry.request;
            let need = req.gpus as usize;
            let eligible: Vec<&GpuTimeline> = req
                .eligible
                .iter()
                .filter_map(|ix| by_index.get(ix).copied())
                .collect();
            let lendable = eligible.iter().filter(|g| g.free_at.is_some()).count();
            let mut place = Placement {
                ticket: req.ticket,
                position: i as u32 + 1,
                of,
                start_ms: None,
                gpus: Vec::new(),
                ahead: i as u32,
                reason: String::new(),
            };
            if i >= depth {
                place.reason = format!(
                    "{i} request(s) are ranked higher; only the first {depth} get a start time"
                );
                placements.push(place);
                continue;
            }
            if lendable < need {
                place.reason = too_few_reason(need, lendable, eligible.len());
                placements.push(place);
                continue;
            }
            let Some((start, chosen)) =
                earliest_fit(&eligible, need, req.duration_ms, &held, not_before)
            else {
                place.reason = "no time ahead has enough matching GPUs free".into();
                placements.push(place);
                continue;
            };
            if self.order() == Order::Easy && i > 0 && start > now {
                place.reason = format!(
                    "{i} request(s) arrived earlier; it starts when it fits without delaying the first (EASY backfill)"
                );
                placements.push(place);
                continue;
            }
            let end_of = |t: Millis| t.saturating_add(req.duration_ms);
            for ix in &chosen {
                held.entry(*ix).or_default().push((start, end_of(start)));
            }
            if self.order() == Order::Fcfs {
                not_before = not_before.max(start);
            }
            place.reason = if start == now {
                String::new()
            } else {
                waiting_reason(&eligible, need, &chosen, now, i as u32, req.duration_ms)
            };
            place.start_ms = Some(start);
            place.gpus = chosen;
            placements.push(place);
        }
        Plan { placements }
    }
}

/// Why a request for `need` GPUs cannot be placed when only `lendable` of the
/// `eligible` GPUs that match can be lent.
fn too_few_reason(need: usize, lendable: usize, eligible: usize) -> String {
    if eligible >= need {
        format!(
            "needs {need} GPU(s) and only {lendable} of the {eligible} that match can be lent now (the owner is using the others)"
        )
    } else {
        format!("needs {need} GPU(s) and this provider has {eligible} that match")
    }
}

/// The earliest time from `not_before` at which `need` of the `eligible` GPUs are clear
/// for `duration_ms` (of reservations and of the places `held` for requests ranked
/// higher), with the lowest-numbered such GPUs. The candidate times are `not_before` and
/// whenever a matching GPU frees up or a reservation or place on one ends.
fn earliest_fit(
    eligible: &[&GpuTimeline],
    need: usize,
    duration_ms: Millis,
    held: &HashMap<u32, Vec<(Millis, Millis)>>,
    not_before: Millis,
) -> Option<(Millis, Vec<u32>)> {
    let mut times: Vec<Millis> = vec![not_before];
    for g in eligible {
        if let Some(f) = g.free_at {
            times.push(f.max(not_before));
        }
        let extra = held.get(&g.index).map(Vec::as_slice).unwrap_or_default();
        times.extend(
            g.reserved
                .iter()
                .chain(extra)
                .map(|(_, e)| (*e).max(not_before)),
        );
    }
    times.sort_unstable();
    times.dedup();
    times.into_iter().find_map(|t| {
        let mut free: Vec<&GpuTimeline> = eligible
            .iter()
            .copied()
            .filter(|g| {
                let extra = held.get(&g.index).map(Vec::as_slice).unwrap_or_default();
                g.clear(t, t.saturating_add(duration_ms), extra)
            })
            .collect();
        if free.len() < need {
            return None;
        }
        free.sort_by_key(|g| g.index);
        Some((
            t,
            free.iter().take(need).map(|g| g.index).collect::<Vec<_>>(),
        ))
    })
}

/// Why a request placed on `chosen` cannot start now.
fn waiting_reason(
    eligible: &[&GpuTimeline],
    need: usize,
    chosen: &[u32],
    now: Millis,
    ahead: u32,
    duration_ms: u64,
) -> String {
    let busy: Vec<String> = eligible
        .iter()
        .filter(|g| chosen.contains(&g.index))
        .filter_map(|g| {
            let f = g.free_at?;
            (f > now).then(|| {
                // A time, not a duration, so the words stay true while it waits.
                format!(
                    "GPU {} is leased until {}",
                    g.index,
                    &gpunode_protocol::time::format_utc(f)[11..]
                )
            })
        })
        .collect();
    let reserved_soon = eligible.iter().any(|g| {
        g.reserved
            .iter()
            .any(|(s, e)| *s < now.saturating_add(duration_ms) && *e > now)
    });
    let mut parts = Vec::new();
    if !busy.is_empty() {
        parts.push(busy.join(", "));
    }
    if reserved_soon {
        parts.push(format!(
            "a reservation starts before a {} job could finish",
            human_duration(duration_ms)
        ));
    }
    if ahead > 0 {
        parts.push(format!("{ahead} request(s) ranked higher are served first"));
    }
    if parts.is_empty() {
        parts.push(format!("needs {need} GPU(s) free together"));
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::{Request, Standing};

    const MIN: u64 = 60_000;

    fn gpu(index: u32, free_at: Millis) -> GpuTimeline {
        GpuTimeline {
            index,
            free_at: Some(free_at),
            reserved: Vec::new(),
        }
    }

    fn req(ticket: u128, user: &str, gpus: u32, duration_ms: u64, eligible: &[u32]) -> Request {
        Request {
            ticket: Ticket(ticket),
            user: user.into(),
            gpus,
            eligible: eligible.to_vec(),
            duration_ms,
            standing: Standing::default(),
        }
    }

    #[test]
    fn a_request_that_fits_starts_now_and_the_rest_get_estimates() {
        let fair = FairShare::new(3_600_000);
        let mut q = Queue::new(Order::Fair, u64::MAX);
        q.upsert(req(1, "a", 1, 10 * MIN, &[0, 1]), 0);
        q.upsert(req(2, "b", 1, 10 * MIN, &[0, 1]), 0);
        q.upsert(req(3, "c", 1, 10 * MIN, &[0, 1]), 0);
        let now = 1_000;
        let plan = q.plan(&[gpu(0, 0), gpu(1, now + 5 * MIN)], &fair, now, 64);
        let p1 = plan.get(&Ticket(1)).unwrap();
        assert!(p1.starts_now(now));
        assert_eq!(p1.gpus, vec![0]);
        let p2 = plan.get(&Ticket(2)).unwrap();
        assert_eq!(p2.start_ms, Some(now + 5 * MIN), "when GPU 1's lease ends");
        assert_eq!((p2.position, p2.of), (2, 3));
        assert!(p2
            .describe(now)
            .contains("GPU 1 is leased until 00:05:01 UTC"));
        let p3 = plan.get(&Ticket(3)).unwrap();
        assert_eq!(
            p3.start_ms,
            Some(now + 10 * MIN),
            "after the first job on GPU 0"
        );
        assert!(p3.describe(now).contains("2 request(s) ranked higher"));
        assert_eq!(plan.starting_now(now).count(), 1);
    }

    #[test]
    fn backfill_never_delays_a_reservation() {
        let fair = FairShare::new(3_600_000);
        let now = 0;
        let reserved_gpu = GpuTimeline {
            index: 0,
            free_at: Some(now),
            reserved: vec![(30 * MIN, 90 * MIN)],
        };
        let mut q = Queue::new(Order::Fair, u64::MAX);
        // A long job: would run into the reservation, so it waits until it is over.
        q.upsert(req(1, "long", 1, 60 * MIN, &[0]), now);
        // A short job: ends before the reservation, so it backfills now.
        q.upsert(req(2, "short", 1, 20 * MIN, &[0]), now);
        let plan = q.plan(std::slice::from_ref(&reserved_gpu), &fair, now, 64);
        let short = plan.get(&Ticket(2)).unwrap();
        assert!(short.starts_now(now), "{short:?}");
        let long = plan.get(&Ticket(1)).unwrap();
        assert_eq!(long.start_ms, Some(90 * MIN));
        assert!(long.reason.contains("reservation"), "{}", long.reason);
        // Every placement keeps clear of the reservation.
        for p in &plan.placements {
            let (s, e) = (p.start_ms.unwrap(), p.start_ms.unwrap() + 60 * MIN);
            assert!(e <= 30 * MIN || s >= 90 * MIN || p.ticket == Ticket(2));
        }
        // A job exactly as long as the gap fits too (reservations are half-open).
        let mut q = Queue::new(Order::Fair, u64::MAX);
        q.upsert(req(3, "exact", 1, 30 * MIN, &[0]), now);
        let plan = q.plan(&[reserved_gpu], &fair, now, 64);
        assert!(plan.get(&Ticket(3)).unwrap().starts_now(now));
    }

    #[test]
    fn backfill_does_not_delay_a_higher_ranked_wide_request() {
        let fair = FairShare::new(3_600_000);
        let now = 0;
        let gpus = [gpu(0, now), gpu(1, now + 30 * MIN)];
        let mut q = Queue::new(Order::Fair, u64::MAX);
        let mut wide = req(1, "wide", 2, 60 * MIN, &[0, 1]);
        wide.standing.priority = 5;
        q.upsert(wide, now);
        q.upsert(req(2, "short", 1, 20 * MIN, &[0, 1]), now);
        q.upsert(req(3, "long", 1, 45 * MIN, &[0, 1]), now);
        let plan = q.plan(&gpus, &fair, now, 64);
        assert_eq!(plan.get(&Ticket(1)).unwrap().start_ms, Some(30 * MIN));
        assert!(
            plan.get(&Ticket(2)).unwrap().starts_now(now),
            "fits before 30m"
        );
        assert_eq!(
            plan.get(&Ticket(3)).unwrap().start_ms,
            Some(90 * MIN),
            "would delay the wide request, so it goes after it"
        );
    }

    #[test]
    fn fcfs_lets_nobody_pass() {
        let fair = FairShare::new(3_600_000);
        let now = 0;
        let gpus = [gpu(0, now), gpu(1, now + 30 * MIN)];
        let mut q = Queue::new(Order::Fcfs, u64::MAX);
        q.upsert(req(1, "wide", 2, 60 * MIN, &[0, 1]), now);
        q.upsert(req(2, "short", 1, 20 * MIN, &[0, 1]), now + 1);
        let plan = q.plan(&gpus, &fair, now, 64);
        assert_eq!(plan.get(&Ticket(1)).unwrap().start_ms, Some(30 * MIN));
        // GPU 0 is free now, but the short job may not pass the wide one.
        assert_eq!(plan.get(&Ticket(2)).unwrap().start_ms, Some(90 * MIN));
        assert_eq!(plan.starting_now(now).count(), 0);
    }

    #[test]
    fn easy_backfills_short_jobs_that_do_not_delay_the_first() {
        let fair = FairShare::new(3_600_000);
        let now = 0;
        let gpus = [gpu(0, now), gpu(1, now + 30 * MIN)];
        let mut q = Queue::new(Order::Easy, u64::MAX);
        q.upsert(req(1, "wide", 2, 60 * MIN, &[0, 1]), now);
        q.upsert(req(2, "short", 1, 20 * MIN, &[0, 1]), now + 1);
        q.upsert(req(3, "long", 1, 40 * MIN, &[0, 1]), now + 2);
        let plan = q.plan(&gpus, &fair, now, 64);
        // The first keeps its reservation; the short one ends before it and starts now.
        assert_eq!(plan.get(&Ticket(1)).unwrap().start_ms, Some(30 * MIN));
        assert_eq!(plan.get(&Ticket(2)).unwrap().start_ms, Some(now));
        // The long one would delay the first: it waits, without a reservation of its own.
        let long = plan.get(&Ticket(3)).unwrap();
        assert_eq!(long.start_ms, None);
        assert!(long.reason.contains("EASY"), "{}", long.reason);
        assert_eq!(plan.starting_now(now).count(), 1);
    }

    #[test]
    fn requests_this_provider_cannot_serve_say_why() {
        let fair = FairShare::new(3_600_000);
        let now = 0;
        let owner_has_it = GpuTimeline {
            index: 1,
            free_at: None,
            reserved: Vec::new(),
        };
        let mut q = Queue::new(Order::Fair, u64::MAX);
        q.upsert(req(1, "a", 2, MIN, &[0, 1]), now);
        q.upsert(req(2, "b", 3, MIN, &[0, 1]), now);
        let plan = q.plan(&[gpu(0, now), owner_has_it], &fair, now, 64);
        let p1 = plan.get(&Ticket(1)).unwrap();
        assert_eq!(p1.start_ms, None);
        assert!(p1.describe(now).contains("owner"), "{}", p1.describe(now));
        let p2 = plan.get(&Ticket(2)).unwrap();
        assert!(p2.reason.contains("has 2 that match"), "{}", p2.reason);
    }
}
