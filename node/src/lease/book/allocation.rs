//! How the book picks and accounts for what it lends: the running [`Totals`] of what
//! live leases hold (kept as leases change state), which GPUs, CPUs and RAM a request
//! gets now or as a reservation, and the views of that for the queue's plan and adverts.

use std::collections::{BTreeMap, HashMap, HashSet};

use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::lease::{
    LeaseId, LeaseRequest, LeasedGpu, RejectCode, Rejection, Requirements,
};
use gpunode_protocol::time::UnixMillis;
use gpunode_protocol::units::format_bytes;
use gpunode_protocol::PeerId;

use super::{reject, LeaseBook, LeaseRecord, LeaseRole, LeaseState};
use crate::lease::policy::GpuSlot;

/// What offered and active leases hold.
#[derive(Debug, Default)]
pub(super) struct Totals {
    /// GPUs we lend, by UUID.
    gpus: HashSet<String>,
    cpus: u32,
    mem: u64,
    /// GPUs we lend, by requester.
    per_peer: HashMap<PeerId, u32>,
    /// Most the leases we provide can still cost, by requester, millicredits.
    exposure: HashMap<PeerId, u64>,
    /// Active leases, either side.
    active: usize,
    /// When the present lease on each GPU (by UUID) ends.
    busy_until: HashMap<String, UnixMillis>,
    /// Reservations we provide (offered or signed, not yet started): GPUs, start, end.
    reserved: HashMap<LeaseId, (Vec<String>, UnixMillis, UnixMillis)>,
    /// MIG slices lent now, by card (device index) and requester.
    mig_tenants: HashMap<u32, HashMap<PeerId, u32>>,
}

impl Totals {
    /// Counts a reservation we provide (offered or signed, not yet started): its GPUs'
    /// window and its cost as the requester's exposure.
    fn add_reservation(&mut self, id: &LeaseId, l: &LeaseRecord) {
        *self.exposure.entry(l.terms.requester).or_default() += l.terms.max_amount_millicredits();
        let uuids = l.terms.gpus.iter().map(|g| g.uuid.clone()).collect();
        self.reserved
            .insert(*id, (uuids, l.terms.start_ms, l.terms.end_ms));
    }

    /// Undoes [`Totals::add_reservation`].
    fn remove_reservation(&mut self, id: &LeaseId, l: &LeaseRecord) {
        self.reserved.remove(id);
        take_from(
            &mut self.exposure,
            &l.terms.requester,
            l.terms.max_amount_millicredits(),
        );
    }

    /// Counts a lease we provide that holds its GPUs, CPUs and RAM now (or for its offer
    /// window).
    fn add_held(&mut self, l: &LeaseRecord) {
        let n = l.terms.gpus.len() as u32;
        self.cpus += l.terms.cpus;
        self.mem += l.terms.mem_bytes;
        self.gpus
            .extend(l.terms.gpus.iter().map(|g| g.uuid.clone()));
        for g in &l.terms.gpus {
            self.busy_until.insert(g.uuid.clone(), l.terms.end_ms);
        }
        *self.per_peer.entry(l.terms.requester).or_default() += n;
        *self.exposure.entry(l.terms.requester).or_default() += l.terms.max_amount_millicredits();
        for g in l.terms.gpus.iter().filter(|g| is_mig(&g.uuid)) {
            *self
                .mig_tenants
                .entry(g.index)
                .or_default()
                .entry(l.terms.requester)
                .or_default() += 1;
        }
    }

    /// Undoes [`Totals::add_held`].
    fn remove_held(&mut self, l: &LeaseRecord) {
        let n = l.terms.gpus.len() as u32;
        take_from(
            &mut self.exposure,
            &l.terms.requester,
            l.terms.max_amount_millicredits(),
        );
        self.cpus = self.cpus.saturating_sub(l.terms.cpus);
        self.mem = self.mem.saturating_sub(l.terms.mem_bytes);
        for g in &l.terms.gpus {
            self.gpus.remove(&g.uuid);
            self.busy_until.remove(&g.uuid);
        }
        for g in l.terms.gpus.iter().filter(|g| is_mig(&g.uuid)) {
            if let Some(card) = self.mig_tenants.get_mut(&g.index) {
                take_from(card, &l.terms.requester, 1);
                if card.is_empty() {
                    self.mig_tenants.remove(&g.index);
                }
            }
        }
        take_from(&mut self.per_peer, &l.terms.requester, n);
    }
}

/// Takes `by` from the count at `key` (not below zero), forgetting counts that reach zero.
fn take_from<V>(map: &mut HashMap<PeerId, V>, key: &PeerId, by: V)
where
    V: Copy + Default + Ord + std::ops::Sub<Output = V>,
{
    if let Some(v) = map.get_mut(key) {
        *v = if *v > by { *v - by } else { V::default() };
        if *v == V::default() {
            map.remove(key);
        }
    }
}

/// Whether a GPU a lease names is a MIG slice (NVML names them `MIG-…`).
fn is_mig(uuid: &str) -> bool {
    uuid.starts_with("MIG-")
}

fn deadline_of(l: &LeaseRecord) -> Option<UnixMillis> {
    match l.state {
        LeaseState::Offered => Some(l.terms.offer_expires_ms + 1),
        LeaseState::Active => Some(l.terms.end_ms),
        LeaseState::Reserved => Some(l.terms.start_ms),
        _ => None,
    }
}

/// Whether a lease holds its GPUs only later (an offered or signed reservation), not now.
fn is_future(l: &LeaseRecord) -> bool {
    match l.state {
        LeaseState::Reserved => true,
        LeaseState::Offered => l.terms.start_ms > l.terms.offer_expires_ms,
        _ => false,
    }
}

/// The first `n` of `slots`, as named in lease terms.
fn first_leased<'a>(slots: impl IntoIterator<Item = &'a GpuSlot>, n: u32) -> Vec<LeasedGpu> {
    slots
        .into_iter()
        .take(n as usize)
        .map(|g| LeasedGpu {
            index: g.index,
            uuid: g.uuid.clone(),
            model: g.model.clone(),
            memory_bytes: g.memory_bytes,
        })
        .collect()
}

/// GPUs lent now, and reservation windows by GPU: when either changes, the node
/// publishes a new advert.
pub type Advertised = (
    HashSet<String>,
    BTreeMap<String, Vec<(UnixMillis, UnixMillis)>>,
);

/// How far ahead a reservation may start.
pub const MAX_RESERVE_AHEAD_MS: u64 = 90 * 86_400_000;

impl LeaseBook {
    /// UUIDs of GPUs held by offered or active leases we provide.
    pub fn committed_gpus(&self) -> HashSet<String> {
        self.totals.gpus.clone()
    }

    /// The most that `peer`'s offered and active leases with us can still cost,
    /// millicredits (what admission counts as its open exposure).
    pub fn exposure(&self, peer: &PeerId) -> u64 {
        self.totals.exposure.get(peer).copied().unwrap_or(0)
    }

    /// Adds (or with `add == false` removes) a lease's share of the running totals.
    pub(super) fn account(&mut self, id: &LeaseId, add: bool) {
        let Some(l) = self.leases.get(id) else {
            return;
        };
        if let Some(due) = deadline_of(l) {
            if add {
                self.deadlines.insert((due, *id));
            } else {
                self.deadlines.remove(&(due, *id));
            }
        }
        let t = &mut self.totals;
        if l.state == LeaseState::Active {
            t.active = if add {
                t.active + 1
            } else {
                t.active.saturating_sub(1)
            };
        }
        if l.role != LeaseRole::Provider || !l.state.holds_resources() {
            return;
        }
        match (is_future(l), add) {
            (true, true) => t.add_reservation(id, l),
            (true, false) => t.remove_reservation(id, l),
            (false, true) => t.add_held(l),
            (false, false) => t.remove_held(l),
        }
    }

    /// GPUs `peer` holds here now through leases we provide.
    pub(super) fn gpus_held_by(&self, peer: &PeerId) -> u32 {
        self.totals.per_peer.get(peer).copied().unwrap_or(0)
    }

    /// Indices of the GPUs that could serve `req` at all (model, memory, slice), free or
    /// not, lendable now or not.
    pub fn eligible_gpus(&self, req: &LeaseRequest) -> Vec<u32> {
        let r = &req.requirements;
        let filter = OfferFilter::for_gpus_of(r);
        self.capacity
            .gpus
            .iter()
            .filter(|g| filter.gpu_matches(&g.model, g.memory_bytes))
            .map(|g| g.index)
            .collect()
    }

    /// Each GPU's timeline for the queue's plan: when its leases end (offers included),
    /// `None` while the owner has it.
    pub fn timelines(&self, now: UnixMillis) -> Vec<gpunode_sched::GpuTimeline> {
        self.capacity
            .gpus
            .iter()
            .map(|g| gpunode_sched::GpuTimeline {
                index: g.index,
                free_at: g.available.then(|| {
                    self.totals
                        .busy_until
                        .get(&g.uuid)
                        .copied()
                        .unwrap_or(now)
                        .max(now)
                }),
                reserved: self.reservations_on(&g.uuid, None).collect(),
            })
            .collect()
    }

    /// Reservation windows by GPU UUID, sorted, for adverts.
    pub fn reserved_windows(&self) -> BTreeMap<String, Vec<(UnixMillis, UnixMillis)>> {
        let mut out: BTreeMap<String, Vec<(UnixMillis, UnixMillis)>> = BTreeMap::new();
        for (gpus, s, e) in self.totals.reserved.values() {
            for g in gpus {
                out.entry(g.clone()).or_default().push((*s, *e));
            }
        }
        for w in out.values_mut() {
            w.sort_unstable();
        }
        out
    }

    /// What adverts show of the book: GPUs lent now and reservation windows.
    pub fn advertised(&self) -> Advertised {
        (self.committed_gpus(), self.reserved_windows())
    }

    /// Reservations on the GPU `uuid`, `[start, end)`, leaving out lease `except`.
    pub(super) fn reservations_on<'a>(
        &'a self,
        uuid: &'a str,
        except: Option<LeaseId>,
    ) -> impl Iterator<Item = (UnixMillis, UnixMillis)> + 'a {
        self.totals
            .reserved
            .iter()
            .filter(move |(id, (gpus, _, _))| {
                Some(**id) != except && gpus.iter().any(|g| g == uuid)
            })
            .map(|(_, (_, s, e))| (*s, *e))
    }

    /// Whether the GPU `uuid` has no reservation overlapping `[start, end)` (but `except`).
    pub(super) fn clear_of_reservations(
        &self,
        uuid: &str,
        start: UnixMillis,
        end: UnixMillis,
        except: Option<LeaseId>,
    ) -> bool {
        self.reservations_on(uuid, except)
            .all(|(s, e)| e <= start || s >= end)
    }

    /// GPUs for a reservation of `req` from `start`: matching GPUs with no other
    /// reservation in the window and no present lease running into it.
    pub(super) fn allocate_reservation(
        &self,
        req: &LeaseRequest,
        start: UnixMillis,
    ) -> Result<(Vec<LeasedGpu>, u32, u64), Rejection> {
        let r = &req.requirements;
        let end = start + req.duration_ms;
        if r.cpus > self.capacity.cpus || r.mem_bytes > self.capacity.mem_bytes {
            return Err(reject(
                RejectCode::NoCapacity,
                format!(
                    "needs {} CPU cores and {} of RAM; this provider has {} and {}",
                    r.cpus,
                    format_bytes(r.mem_bytes),
                    self.capacity.cpus,
                    format_bytes(self.capacity.mem_bytes)
                ),
            ));
        }
        let eligible = self.eligible_gpus(req);
        let mut fitting: Vec<&GpuSlot> = self
            .capacity
            .gpus
            .iter()
            .filter(|g| eligible.contains(&g.index))
            .filter(|g| {
                self.totals
                    .busy_until
                    .get(&g.uuid)
                    .is_none_or(|until| *until <= start)
            })
            .filter(|g| self.clear_of_reservations(&g.uuid, start, end, None))
            .collect();
        if (fitting.len() as u32) < r.gpus {
            let taken: Vec<String> = self
                .capacity
                .gpus
                .iter()
                .filter(|g| eligible.contains(&g.index))
                .flat_map(|g| {
                    self.reservations_on(&g.uuid, None)
                        .filter(|(s, e)| *s < end && *e > start)
                        .map(|(s, e)| {
                            format!(
                                "GPU {} is reserved {} to {}",
                                g.index,
                                gpunode_protocol::time::format_utc(s),
                                gpunode_protocol::time::format_utc(e)
                            )
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            return Err(reject(
                RejectCode::NoCapacity,
                format!(
                    "needs {} matching GPU(s) free from {} for {}; {} of {} are{}",
                    r.gpus,
                    gpunode_protocol::time::format_utc(start),
                    gpunode_sched::human_duration(req.duration_ms),
                    fitting.len(),
                    eligible.len(),
                    if taken.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", taken.join("; "))
                    }
                ),
            ));
        }
        fitting.sort_by_key(|g| (g.memory_bytes, g.index));
        let gpus = first_leased(fitting.iter().copied(), r.gpus);
        Ok((gpus, r.cpus, r.mem_bytes))
    }

    /// Whether `req` would find capacity now (nothing is held).
    pub fn capacity_for(
        &self,
        from: &PeerId,
        req: &LeaseRequest,
        now: UnixMillis,
    ) -> Result<(), Rejection> {
        self.allocate(from, req, &[], now).map(|_| ())
    }

    /// GPUs, CPUs and RAM for a lease of `req` starting now: free matching GPUs
    /// (those in `prefer` first, then the smallest sufficient), and cores and RAM not
    /// held by other leases.
    pub(super) fn allocate(
        &self,
        from: &PeerId,
        req: &LeaseRequest,
        prefer: &[u32],
        now: UnixMillis,
    ) -> Result<(Vec<LeasedGpu>, u32, u64), Rejection> {
        let r = &req.requirements;
        let filter = OfferFilter::for_gpus_of(r);
        let free = self.free_gpus(from, now, now + req.duration_ms);
        let mut fitting: Vec<&GpuSlot> = free
            .iter()
            .copied()
            .filter(|g| filter.gpu_matches(&g.model, g.memory_bytes))
            .collect();
        if (fitting.len() as u32) < r.gpus {
            return Err(self.no_gpu_fits(r, &free, fitting.len()));
        }
        // The plan's choice first; then smallest sufficient GPUs, so big ones stay for
        // big requests.
        fitting.sort_by_key(|g| (!prefer.contains(&g.index), g.memory_bytes, g.index));
        let gpus = first_leased(fitting.iter().copied(), r.gpus);
        self.check_free_cpus_and_mem(r)?;
        Ok((gpus, r.cpus, r.mem_bytes))
    }

    /// GPUs `from` could lease from `now` to `end`: available, not lent, not a slice of a
    /// card another peer uses, and clear of reservations until `end`.
    fn free_gpus(&self, from: &PeerId, now: UnixMillis, end: UnixMillis) -> Vec<&GpuSlot> {
        let committed = &self.totals.gpus;
        // A MIG job still sees its card's parent device and every capability file (the
        // host gives no per-instance ids to bind yet), so the slices of one card go to
        // one peer at a time.
        let shared_card = |g: &&GpuSlot| {
            is_mig(&g.uuid)
                && self
                    .totals
                    .mig_tenants
                    .get(&g.index)
                    .is_some_and(|card| card.keys().any(|p| p != from))
        };
        self.capacity
            .gpus
            .iter()
            .filter(|g| g.available && !committed.contains(&g.uuid))
            .filter(|g| !shared_card(g))
            // Backfill: a GPU reserved later may be lent only until its reservation.
            .filter(|g| self.clear_of_reservations(&g.uuid, now, end, None))
            .collect()
    }

    /// The rejection when only `fitting` of the `free` GPUs match `r`: what was asked,
    /// and a hint at what is free (largest memory, or how many, and MIG slices).
    fn no_gpu_fits(&self, r: &Requirements, free: &[&GpuSlot], fitting: usize) -> Rejection {
        let what = match (&r.gpu_model, r.min_gpu_mem_bytes) {
            (Some(m), Some(mem)) => format!("{m} GPU with {} free", format_bytes(mem)),
            (Some(m), None) => format!("{m} GPU free"),
            (None, Some(mem)) => format!("GPU with {} free", format_bytes(mem)),
            (None, None) => "GPU free".to_string(),
        };
        let largest = free.iter().map(|g| g.memory_bytes).max();
        let hint = match largest {
            Some(l) if r.min_gpu_mem_bytes.is_some() => {
                format!("; largest free is {}", format_bytes(l))
            }
            _ => format!("; {} of {} GPUs free", free.len(), self.capacity.gpus.len()),
        };
        let mut slices: Vec<&str> = free
            .iter()
            .filter_map(|g| gpunode_protocol::gpu::mig_profile(&g.model))
            .collect();
        slices.sort();
        slices.dedup();
        let hint = if slices.is_empty() {
            hint
        } else {
            format!(
                "{hint}; free MIG slices: {} (ask with --gpu-slice)",
                slices.join(", ")
            )
        };
        let need = if r.gpus == 1 {
            format!("no {what}")
        } else {
            format!("needs {} x {what}, found {fitting}", r.gpus)
        };
        reject(RejectCode::NoCapacity, format!("{need}{hint}"))
    }

    /// Whether the cores and RAM `r` asks for are not held by other leases.
    fn check_free_cpus_and_mem(&self, r: &Requirements) -> Result<(), Rejection> {
        let free_cpus = self.capacity.cpus.saturating_sub(self.totals.cpus);
        let free_mem = self.capacity.mem_bytes.saturating_sub(self.totals.mem);
        if r.cpus > free_cpus {
            return Err(reject(
                RejectCode::NoCapacity,
                format!("needs {} CPU cores; {free_cpus} are free", r.cpus),
            ));
        }
        if r.mem_bytes > free_mem {
            return Err(reject(
                RejectCode::NoCapacity,
                format!(
                    "needs {} of RAM; {} is free",
                    format_bytes(r.mem_bytes),
                    format_bytes(free_mem)
                ),
            ));
        }
        Ok(())
    }

    /// Resources committed by offered and active leases we provide: (GPUs, CPUs, RAM).
    pub fn committed_totals(&self) -> (usize, u32, u64) {
        (self.totals.gpus.len(), self.totals.cpus, self.totals.mem)
    }

    /// Active leases, either side.
    pub fn active_count(&self) -> usize {
        self.totals.active
    }
}
