//! The lease book: every lease this node is party to, as provider or requester, and the
//! provider's rules for granting them. Pure state: messages and `now` in, decisions and
//! a list of changes to persist out. The event loop owns the only instance, so requests,
//! accepts, renewals, cancels and expiries are applied one at a time and capacity can
//! never be committed twice.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::lease::{
    Cancellation, LeaseId, LeaseRequest, LeaseTerms, LeasedGpu, RejectCode, Rejection, Renewal,
    LEASE_VERSION, RESERVATION_MIN_LEAD_MS,
};
use gpunode_protocol::signing;
use gpunode_protocol::time::{UnixMillis, MAX_CLOCK_SKEW_MS};
use gpunode_protocol::units::format_bytes;
use gpunode_protocol::{Keypair, PeerId};
use serde::{Deserialize, Serialize};

use super::policy::{Capacity, LeasePolicy};

/// Which side of a lease this node is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeaseRole {
    /// We lend.
    Provider,
    /// We use.
    Requester,
}

/// Where a lease stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LeaseState {
    /// Offered and holding resources until the offer window closes.
    Offered,
    /// Signed by both and running.
    Active,
    /// Ran to its end.
    Completed,
    /// The offer was not accepted in time.
    Expired,
    /// Ended early by either party.
    Cancelled,
    /// Could not be set up or broke.
    Failed,
    /// Signed by both, starting later (a reservation); becomes active at its start.
    Reserved,
}

impl LeaseState {
    /// Whether the lease holds resources.
    pub fn holds_resources(self) -> bool {
        matches!(
            self,
            LeaseState::Offered | LeaseState::Active | LeaseState::Reserved
        )
    }

    /// A word for tables.
    pub fn label(self) -> &'static str {
        match self {
            LeaseState::Offered => "offered",
            LeaseState::Active => "active",
            LeaseState::Completed => "completed",
            LeaseState::Expired => "expired",
            LeaseState::Cancelled => "cancelled",
            LeaseState::Failed => "failed",
            LeaseState::Reserved => "reserved",
        }
    }
}

/// A lease and everything signed about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// The terms (with the current end after renewals).
    pub terms: LeaseTerms,
    /// Provider's signature over the original terms.
    pub provider_sig: Vec<u8>,
    /// Requester's countersignature, once accepted.
    pub requester_sig: Option<Vec<u8>>,
    /// The original end, before renewals (the signed terms carry this end).
    pub signed_end_ms: UnixMillis,
    /// Renewals with both signatures.
    pub renewals: Vec<SignedRenewal>,
    /// Our side.
    pub role: LeaseRole,
    /// Where it stands.
    pub state: LeaseState,
    /// When it last changed (our clock).
    pub updated_ms: UnixMillis,
}

/// A renewal signed by both parties.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedRenewal {
    /// The renewal.
    pub renewal: Renewal,
    /// Requester's signature.
    pub requester_sig: Vec<u8>,
    /// Provider's signature.
    pub provider_sig: Vec<u8>,
}

impl LeaseRecord {
    /// The terms as both parties signed them (before renewals).
    pub fn signed_terms(&self) -> LeaseTerms {
        LeaseTerms {
            end_ms: self.signed_end_ms,
            ..self.terms.clone()
        }
    }

    /// Whether both signatures over the terms, and both on every renewal, verify.
    pub fn signatures_valid(&self) -> (bool, bool) {
        let terms = self.signed_terms();
        let mut provider_ok = terms.verify(&terms.provider, &self.provider_sig).is_ok();
        let mut requester_ok = self
            .requester_sig
            .as_ref()
            .is_some_and(|s| terms.verify(&terms.requester, s).is_ok());
        for r in &self.renewals {
            provider_ok &= r.renewal.verify(&terms.provider, &r.provider_sig).is_ok();
            requester_ok &= r.renewal.verify(&terms.requester, &r.requester_sig).is_ok();
        }
        (provider_ok, requester_ok)
    }

    /// The other party.
    pub fn peer(&self) -> PeerId {
        match self.role {
            LeaseRole::Provider => self.terms.requester,
            LeaseRole::Requester => self.terms.provider,
        }
    }
}

/// Something the caller must write to the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Write this lease record.
    Lease(LeaseId),
    /// Remember this nonce of this peer until the given time.
    Nonce(PeerId, u64, UnixMillis),
    /// Forget this nonce (its request can no longer be valid).
    ForgetNonce(PeerId, u64),
    /// Forget this lease record (ended longer ago than the retention).
    ForgetLease(LeaseId),
}

/// The lease state machine.
#[derive(Debug)]
pub struct LeaseBook {
    local: PeerId,
    policy: LeasePolicy,
    capacity: Capacity,
    leases: BTreeMap<LeaseId, LeaseRecord>,
    /// Running totals of what live leases hold, kept as leases change state, so each
    /// request costs the same however many leases there are.
    totals: Totals,
    /// When each live lease next falls due (offer window or end).
    deadlines: BTreeSet<(UnixMillis, LeaseId)>,
    nonces: HashMap<(PeerId, u64), UnixMillis>,
    nonce_expiry: BTreeSet<(UnixMillis, PeerId, u64)>,
    changes: Vec<Change>,
    /// When ended records were last pruned.
    last_prune_ms: UnixMillis,
}

/// How often ended records are looked over for pruning.
const PRUNE_EVERY_MS: u64 = 60_000;
/// How long an offer that expired unsigned is kept (it never became a lease).
const EXPIRED_OFFER_RETENTION_MS: u64 = 3_600_000;
/// How far ahead a request may say it expires: a requester cannot make this provider
/// remember its nonce for longer.
pub const MAX_REQUEST_LIFETIME_MS: u64 = 600_000;

/// What offered and active leases hold.
#[derive(Debug, Default)]
struct Totals {
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
fn first_leased<'a>(
    slots: impl IntoIterator<Item = &'a super::policy::GpuSlot>,
    n: u32,
) -> Vec<LeasedGpu> {
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

fn reject(code: RejectCode, message: impl Into<String>) -> Rejection {
    Rejection::new(code, message)
}

impl LeaseBook {
    /// An empty book.
    pub fn new(local: PeerId, policy: LeasePolicy, capacity: Capacity) -> LeaseBook {
        LeaseBook {
            local,
            policy,
            capacity,
            leases: BTreeMap::new(),
            totals: Totals::default(),
            deadlines: BTreeSet::new(),
            nonces: HashMap::new(),
            nonce_expiry: BTreeSet::new(),
            changes: Vec::new(),
            last_prune_ms: 0,
        }
    }

    /// A book restored from storage after a restart: holds that were only offered are
    /// released (their window was seconds), active leases whose end passed are completed,
    /// and nonces are remembered so old requests cannot be replayed.
    pub fn restore(
        local: PeerId,
        policy: LeasePolicy,
        capacity: Capacity,
        leases: Vec<LeaseRecord>,
        nonces: Vec<(PeerId, u64, UnixMillis)>,
        now: UnixMillis,
    ) -> LeaseBook {
        let mut book = LeaseBook::new(local, policy, capacity);
        for l in leases {
            book.put(l);
        }
        for (peer, nonce, until) in nonces {
            book.remember_nonce(peer, nonce, until);
        }
        let ids: Vec<LeaseId> = book
            .leases
            .values()
            .filter(|l| l.state == LeaseState::Offered)
            .map(|l| l.terms.lease_id)
            .collect();
        for id in ids {
            book.set_state(id, LeaseState::Expired, now);
        }
        book.tick(now);
        book
    }

    /// Changes to persist since the last call.
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.changes)
    }

    /// A lease by id.
    pub fn get(&self, id: &LeaseId) -> Option<&LeaseRecord> {
        self.leases.get(id)
    }

    /// All leases, newest start first.
    pub fn all(&self) -> Vec<&LeaseRecord> {
        let mut v: Vec<&LeaseRecord> = self.leases.values().collect();
        v.sort_by_key(|l| std::cmp::Reverse(l.terms.start_ms));
        v
    }

    /// Finds the lease whose id starts with `prefix` (hex), if exactly one does.
    pub fn resolve(&self, prefix: &str) -> Result<LeaseId, String> {
        let prefix = prefix.trim().to_ascii_lowercase();
        if let Ok(id) = prefix.parse::<LeaseId>() {
            if self.leases.contains_key(&id) {
                return Ok(id);
            }
        }
        if prefix.len() < 4 {
            return Err(format!(
                "lease id '{prefix}' is too short: give at least 4 hex digits"
            ));
        }
        let matches: Vec<LeaseId> = self
            .leases
            .keys()
            .filter(|id| id.to_string().starts_with(&prefix))
            .copied()
            .collect();
        match matches.as_slice() {
            [one] => Ok(*one),
            [] => Err(format!(
                "no lease '{prefix}' on this node (see `gpunode leases`)"
            )),
            _ => Err(format!(
                "lease id '{prefix}' is ambiguous: give more digits"
            )),
        }
    }

    /// Replaces what the provider has to lend (the inventory changed). Existing leases
    /// stay; GPUs the owner took are simply not offered again.
    pub fn set_capacity(&mut self, capacity: Capacity) {
        self.capacity = capacity;
    }

    /// The provider's rules.
    pub fn policy(&self) -> &LeasePolicy {
        &self.policy
    }

    /// UUIDs of GPUs held by offered or active leases we provide.
    pub fn committed_gpus(&self) -> HashSet<String> {
        self.totals.gpus.clone()
    }

    /// The most that `peer`'s offered and active leases with us can still cost,
    /// millicredits (what admission counts as its open exposure).
    pub fn exposure(&self, peer: &PeerId) -> u64 {
        self.totals.exposure.get(peer).copied().unwrap_or(0)
    }

    /// The most a lease for `req` could cost at this provider's price, millicredits.
    pub fn max_amount_for(&self, req: &LeaseRequest) -> u64 {
        gpunode_protocol::receipt::amount_for(
            self.policy.price_per_gpu_hour_millicredits,
            req.requirements.gpus,
            req.duration_ms,
        )
    }

    /// Adds (or with `add == false` removes) a lease's share of the running totals.
    fn account(&mut self, id: &LeaseId, add: bool) {
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
        let n = l.terms.gpus.len() as u32;
        if is_future(l) {
            let e = t.exposure.entry(l.terms.requester).or_default();
            if add {
                *e += l.terms.max_amount_millicredits();
                let uuids = l.terms.gpus.iter().map(|g| g.uuid.clone()).collect();
                t.reserved
                    .insert(*id, (uuids, l.terms.start_ms, l.terms.end_ms));
            } else {
                t.reserved.remove(id);
                *e = e.saturating_sub(l.terms.max_amount_millicredits());
                if *e == 0 {
                    t.exposure.remove(&l.terms.requester);
                }
            }
            return;
        }
        if add {
            t.cpus += l.terms.cpus;
            t.mem += l.terms.mem_bytes;
            t.gpus.extend(l.terms.gpus.iter().map(|g| g.uuid.clone()));
            for g in &l.terms.gpus {
                t.busy_until.insert(g.uuid.clone(), l.terms.end_ms);
            }
            *t.per_peer.entry(l.terms.requester).or_default() += n;
            *t.exposure.entry(l.terms.requester).or_default() += l.terms.max_amount_millicredits();
            for g in l.terms.gpus.iter().filter(|g| is_mig(&g.uuid)) {
                *t.mig_tenants
                    .entry(g.index)
                    .or_default()
                    .entry(l.terms.requester)
                    .or_default() += 1;
            }
        } else {
            if let Some(e) = t.exposure.get_mut(&l.terms.requester) {
                *e = e.saturating_sub(l.terms.max_amount_millicredits());
                if *e == 0 {
                    t.exposure.remove(&l.terms.requester);
                }
            }
            t.cpus = t.cpus.saturating_sub(l.terms.cpus);
            t.mem = t.mem.saturating_sub(l.terms.mem_bytes);
            for g in &l.terms.gpus {
                t.gpus.remove(&g.uuid);
                t.busy_until.remove(&g.uuid);
            }
            for g in l.terms.gpus.iter().filter(|g| is_mig(&g.uuid)) {
                if let Some(card) = t.mig_tenants.get_mut(&g.index) {
                    if let Some(c) = card.get_mut(&l.terms.requester) {
                        *c = c.saturating_sub(1);
                        if *c == 0 {
                            card.remove(&l.terms.requester);
                        }
                    }
                    if card.is_empty() {
                        t.mig_tenants.remove(&g.index);
                    }
                }
            }
            if let Some(c) = t.per_peer.get_mut(&l.terms.requester) {
                *c = c.saturating_sub(n);
                if *c == 0 {
                    t.per_peer.remove(&l.terms.requester);
                }
            }
        }
    }

    fn put(&mut self, record: LeaseRecord) {
        let id = record.terms.lease_id;
        self.account(&id, false);
        self.leases.insert(id, record);
        self.account(&id, true);
    }

    /// Changes a lease through `f`, keeping the totals right.
    fn update(&mut self, id: LeaseId, f: impl FnOnce(&mut LeaseRecord)) {
        self.account(&id, false);
        if let Some(l) = self.leases.get_mut(&id) {
            f(l);
            self.changes.push(Change::Lease(id));
        }
        self.account(&id, true);
    }

    fn set_state(&mut self, id: LeaseId, state: LeaseState, now: UnixMillis) {
        self.update(id, |l| {
            l.state = state;
            l.updated_ms = now;
        });
    }

    /// A lease we provide, or the rejection for an id we do not know as provider.
    fn provided(&self, id: &LeaseId) -> Result<&LeaseRecord, Rejection> {
        self.leases
            .get(id)
            .filter(|l| l.role == LeaseRole::Provider)
            .ok_or_else(|| {
                reject(
                    RejectCode::UnknownLease,
                    format!("no lease {id} is provided here"),
                )
            })
    }

    fn remember_nonce(&mut self, peer: PeerId, nonce: u64, until: UnixMillis) {
        if let Some(old) = self.nonces.insert((peer, nonce), until) {
            self.nonce_expiry.remove(&(old, peer, nonce));
        }
        self.nonce_expiry.insert((until, peer, nonce));
    }

    /// The checks of a request that change nothing: version, sender, key, clock, nonce
    /// (not spent here) and this provider's policy. A request that passes may still find
    /// no capacity.
    pub fn check_request(
        &self,
        from: &PeerId,
        req: &LeaseRequest,
        now: UnixMillis,
    ) -> Result<(), Rejection> {
        self.check_valid(from, req, now)?;
        self.check_policy(from, req)
    }

    fn check_valid(
        &self,
        from: &PeerId,
        req: &LeaseRequest,
        now: UnixMillis,
    ) -> Result<(), Rejection> {
        if req.version != LEASE_VERSION {
            return Err(reject(
                RejectCode::InvalidRequest,
                format!(
                    "lease protocol version {} is not supported (this node speaks {LEASE_VERSION})",
                    req.version
                ),
            ));
        }
        if req.requester != *from {
            return Err(reject(
                RejectCode::WrongKey,
                format!(
                    "request names requester {} but came from {from}",
                    req.requester
                ),
            ));
        }
        signing::key_of(from, &req.requester_key)?;
        if req.sent_at_ms > now + MAX_CLOCK_SKEW_MS {
            return Err(reject(
                RejectCode::ClockSkew,
                format!(
                    "your clock is {} ms ahead of the provider's (at most {MAX_CLOCK_SKEW_MS} ms is tolerated); fix your clock",
                    req.sent_at_ms - now
                ),
            ));
        }
        if req.expires_at_ms <= now {
            return Err(reject(
                RejectCode::ClockSkew,
                "the request had expired when it arrived; check your clock and retry",
            ));
        }
        if req.expires_at_ms > now.saturating_add(MAX_REQUEST_LIFETIME_MS) {
            return Err(reject(
                RejectCode::InvalidRequest,
                format!(
                    "the request says it expires more than {} s from now; at most that is accepted",
                    MAX_REQUEST_LIFETIME_MS / 1000
                ),
            ));
        }
        if self.nonces.contains_key(&(*from, req.nonce)) {
            return Err(reject(
                RejectCode::Replay,
                "this request's nonce was used before (replayed request)",
            ));
        }
        Ok(())
    }

    /// Step 2 of a negotiation, as provider: check the request against policy and
    /// capacity, pick concrete GPUs, hold them for the offer window, sign the terms.
    pub fn on_request(
        &mut self,
        from: &PeerId,
        req: &LeaseRequest,
        lease_id: LeaseId,
        key: &Keypair,
        now: UnixMillis,
    ) -> Result<(LeaseTerms, Vec<u8>), Rejection> {
        self.on_request_preferring(from, req, lease_id, key, now, &[])
    }

    /// [`Self::on_request`], taking the GPUs in `prefer` (by index) when they are free and
    /// fit (the queue's plan chose them).
    pub fn on_request_preferring(
        &mut self,
        from: &PeerId,
        req: &LeaseRequest,
        lease_id: LeaseId,
        key: &Keypair,
        now: UnixMillis,
        prefer: &[u32],
    ) -> Result<(LeaseTerms, Vec<u8>), Rejection> {
        self.check_valid(from, req, now)?;
        // The nonce is spent from here on, whatever the answer.
        let keep_until = req.expires_at_ms.max(now).saturating_add(MAX_CLOCK_SKEW_MS);
        self.remember_nonce(*from, req.nonce, keep_until);
        self.changes
            .push(Change::Nonce(*from, req.nonce, keep_until));

        self.check_policy(from, req)?;
        let start = self.start_of(req, now)?;
        let (gpus, cpus, mem) = if start > now {
            self.allocate_reservation(req, start)?
        } else {
            self.allocate(from, req, prefer, now)?
        };
        let terms = LeaseTerms {
            version: LEASE_VERSION,
            lease_id,
            provider: self.local,
            requester: *from,
            gpus,
            cpus,
            mem_bytes: mem,
            backend: req.requirements.backend.clone(),
            start_ms: start,
            end_ms: start + req.duration_ms,
            price_per_gpu_hour_millicredits: self.policy.price_per_gpu_hour_millicredits,
            request_nonce: req.nonce,
            offer_expires_ms: now + self.policy.offer_window_ms,
        };
        let sig = terms.sign(key).map_err(|e| {
            reject(
                RejectCode::InvalidRequest,
                format!("provider cannot sign: {e}"),
            )
        })?;
        self.put(LeaseRecord {
            terms: terms.clone(),
            provider_sig: sig.clone(),
            requester_sig: None,
            signed_end_ms: terms.end_ms,
            renewals: Vec::new(),
            role: LeaseRole::Provider,
            state: LeaseState::Offered,
            updated_ms: now,
        });
        self.changes.push(Change::Lease(lease_id));
        Ok((terms, sig))
    }

    fn check_policy(&self, from: &PeerId, req: &LeaseRequest) -> Result<(), Rejection> {
        let p = &self.policy;
        if p.deny_peers.contains(from)
            || (!p.allow_peers.is_empty() && !p.allow_peers.contains(from))
        {
            return Err(reject(
                RejectCode::PeerNotAllowed,
                "this provider does not lend to your peer id",
            ));
        }
        if !p
            .backends
            .iter()
            .any(|b| b.eq_ignore_ascii_case(&req.requirements.backend))
        {
            return Err(reject(
                RejectCode::BackendUnsupported,
                format!(
                    "backend '{}' is not offered here; this provider offers {}",
                    req.requirements.backend,
                    p.backends.join(", ")
                ),
            ));
        }
        if req.duration_ms < 1000 || req.duration_ms > p.max_duration_ms {
            return Err(reject(
                RejectCode::DurationOutOfPolicy,
                format!(
                    "duration {} s is outside this provider's limit of 1 s to {} s",
                    req.duration_ms / 1000,
                    p.max_duration_ms / 1000
                ),
            ));
        }
        if let Some(max) = req.max_price_per_gpu_hour_millicredits {
            if p.price_per_gpu_hour_millicredits > max {
                return Err(reject(
                    RejectCode::PriceTooHigh,
                    format!(
                        "price is {:.3} credits per GPU-hour, above your maximum of {:.3}",
                        p.price_per_gpu_hour_millicredits as f64 / 1000.0,
                        max as f64 / 1000.0
                    ),
                ));
            }
        }
        let held: u32 = self.totals.per_peer.get(from).copied().unwrap_or(0);
        if held.saturating_add(req.requirements.gpus) > p.max_gpus_per_peer {
            return Err(reject(
                RejectCode::PeerGpuLimit,
                format!(
                    "you hold {held} GPUs here and may hold at most {} at once",
                    p.max_gpus_per_peer
                ),
            ));
        }
        Ok(())
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
    fn reservations_on<'a>(
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
    fn clear_of_reservations(
        &self,
        uuid: &str,
        start: UnixMillis,
        end: UnixMillis,
        except: Option<LeaseId>,
    ) -> bool {
        self.reservations_on(uuid, except)
            .all(|(s, e)| e <= start || s >= end)
    }

    /// When a lease for `req` starts: now, or the requested later start (a reservation).
    fn start_of(&self, req: &LeaseRequest, now: UnixMillis) -> Result<UnixMillis, Rejection> {
        match req.start_at_ms {
            Some(at) if at > now + RESERVATION_MIN_LEAD_MS => {
                if at - now > MAX_RESERVE_AHEAD_MS {
                    return Err(reject(
                        RejectCode::InvalidRequest,
                        format!(
                            "a reservation may start at most {} days ahead",
                            MAX_RESERVE_AHEAD_MS / 86_400_000
                        ),
                    ));
                }
                Ok(at)
            }
            _ => Ok(now),
        }
    }

    /// GPUs for a reservation of `req` from `start`: matching GPUs with no other
    /// reservation in the window and no present lease running into it.
    fn allocate_reservation(
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
        let mut fitting: Vec<&super::policy::GpuSlot> = self
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

    fn allocate(
        &self,
        from: &PeerId,
        req: &LeaseRequest,
        prefer: &[u32],
        now: UnixMillis,
    ) -> Result<(Vec<LeasedGpu>, u32, u64), Rejection> {
        let r = &req.requirements;
        let committed = &self.totals.gpus;
        let filter = OfferFilter::for_gpus_of(r);
        // A MIG job still sees its card's parent device and every capability file (the
        // host gives no per-instance ids to bind yet), so the slices of one card go to
        // one peer at a time.
        let shared_card = |g: &&super::policy::GpuSlot| {
            is_mig(&g.uuid)
                && self
                    .totals
                    .mig_tenants
                    .get(&g.index)
                    .is_some_and(|card| card.keys().any(|p| p != from))
        };
        let free: Vec<_> = self
            .capacity
            .gpus
            .iter()
            .filter(|g| g.available && !committed.contains(&g.uuid))
            .filter(|g| !shared_card(g))
            // Backfill: a GPU reserved later may be lent only until its reservation.
            .filter(|g| self.clear_of_reservations(&g.uuid, now, now + req.duration_ms, None))
            .collect();
        let mut fitting: Vec<_> = free
            .iter()
            .filter(|g| filter.gpu_matches(&g.model, g.memory_bytes))
            .collect();
        if (fitting.len() as u32) < r.gpus {
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
                format!("needs {} x {what}, found {}", r.gpus, fitting.len())
            };
            return Err(reject(RejectCode::NoCapacity, format!("{need}{hint}")));
        }
        // The plan's choice first; then smallest sufficient GPUs, so big ones stay for
        // big requests.
        fitting.sort_by_key(|g| (!prefer.contains(&g.index), g.memory_bytes, g.index));
        let gpus = first_leased(fitting.iter().map(|g| **g), r.gpus);
        let (used_cpus, used_mem) = (self.totals.cpus, self.totals.mem);
        let free_cpus = self.capacity.cpus.saturating_sub(used_cpus);
        let free_mem = self.capacity.mem_bytes.saturating_sub(used_mem);
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
        Ok((gpus, r.cpus, r.mem_bytes))
    }

    /// Step 4, as provider: verify the countersigned terms against the hold and activate.
    pub fn on_accept(
        &mut self,
        from: &PeerId,
        terms: &LeaseTerms,
        provider_sig: &[u8],
        requester_sig: &[u8],
        now: UnixMillis,
    ) -> Result<LeaseId, Rejection> {
        let id = terms.lease_id;
        let held = self.provided(&id)?;
        if held.terms.requester != *from || terms.requester != *from {
            return Err(reject(
                RejectCode::UnknownLease,
                format!("offer {id} was not made to you"),
            ));
        }
        if held.state != LeaseState::Offered {
            return Err(reject(
                RejectCode::WrongState,
                format!("lease {id} is {}, not offered", held.state.label()),
            ));
        }
        if held.terms != *terms {
            return Err(reject(
                RejectCode::TermsAltered,
                "the accepted terms differ from the offered ones",
            ));
        }
        // Our own signature is checked by comparing it with the one we made.
        if held.provider_sig != provider_sig {
            return Err(reject(
                RejectCode::BadSignature,
                "the provider signature is not the one offered",
            ));
        }
        terms.verify(from, requester_sig)?;
        if now > terms.offer_expires_ms {
            self.set_state(id, LeaseState::Expired, now);
            return Err(reject(
                RejectCode::OfferExpired,
                format!(
                    "the offer expired {} ms before the accept arrived; request again",
                    now - terms.offer_expires_ms
                ),
            ));
        }
        if let Some(l) = self.leases.get_mut(&id) {
            l.requester_sig = Some(requester_sig.to_vec());
        }
        let state = if terms.start_ms > now {
            LeaseState::Reserved
        } else {
            LeaseState::Active
        };
        self.set_state(id, state, now);
        Ok(id)
    }

    /// As provider: extend an active lease within policy; returns our signature.
    pub fn on_renew(
        &mut self,
        from: &PeerId,
        renewal: &Renewal,
        requester_sig: &[u8],
        key: &Keypair,
        now: UnixMillis,
    ) -> Result<Vec<u8>, Rejection> {
        let id = renewal.lease_id;
        let l = self.provided(&id)?;
        if l.terms.requester != *from {
            return Err(reject(
                RejectCode::UnknownLease,
                format!("lease {id} is not yours"),
            ));
        }
        if !matches!(l.state, LeaseState::Active | LeaseState::Reserved) || l.terms.end_ms <= now {
            return Err(reject(
                RejectCode::WrongState,
                format!("lease {id} is not active"),
            ));
        }
        if let Some(g) = l.terms.gpus.iter().find(|g| {
            !self.clear_of_reservations(&g.uuid, l.terms.end_ms, renewal.new_end_ms, Some(id))
        }) {
            return Err(reject(
                RejectCode::NoCapacity,
                format!(
                    "GPU {} is reserved by someone else before the new end; renew for less",
                    g.index
                ),
            ));
        }
        renewal.verify(from, requester_sig)?;
        if self.nonces.contains_key(&(*from, renewal.nonce)) {
            return Err(reject(
                RejectCode::Replay,
                "this renewal's nonce was used before",
            ));
        }
        if renewal.new_end_ms <= l.terms.end_ms {
            return Err(reject(
                RejectCode::InvalidRequest,
                "a renewal must move the end later",
            ));
        }
        if renewal.new_end_ms - l.terms.start_ms > self.policy.max_duration_ms {
            return Err(reject(
                RejectCode::DurationOutOfPolicy,
                format!(
                    "the lease would last {} s; this provider allows at most {} s",
                    (renewal.new_end_ms - l.terms.start_ms) / 1000,
                    self.policy.max_duration_ms / 1000
                ),
            ));
        }
        let provider_sig = renewal
            .sign(key)
            .map_err(|e| reject(RejectCode::InvalidRequest, e.to_string()))?;
        let keep_until = renewal.new_end_ms.saturating_add(MAX_CLOCK_SKEW_MS);
        self.remember_nonce(*from, renewal.nonce, keep_until);
        self.changes
            .push(Change::Nonce(*from, renewal.nonce, keep_until));
        let signed = SignedRenewal {
            renewal: renewal.clone(),
            requester_sig: requester_sig.to_vec(),
            provider_sig: provider_sig.clone(),
        };
        self.update(id, |l| {
            l.terms.end_ms = signed.renewal.new_end_ms;
            l.renewals.push(signed);
            l.updated_ms = now;
        });
        Ok(provider_sig)
    }

    /// Either side: a signed cancellation from the other party (or ourselves) ends an
    /// offered or active lease and releases its resources at once.
    pub fn on_cancel(
        &mut self,
        from: &PeerId,
        cancellation: &Cancellation,
        signature: &[u8],
        now: UnixMillis,
    ) -> Result<(), Rejection> {
        let id = cancellation.lease_id;
        let Some(l) = self.leases.get(&id) else {
            return Err(reject(
                RejectCode::UnknownLease,
                format!("no lease {id} here"),
            ));
        };
        let parties = [l.terms.provider, l.terms.requester];
        if cancellation.by != *from || !parties.contains(from) {
            return Err(reject(
                RejectCode::UnknownLease,
                format!("lease {id} is not yours to cancel"),
            ));
        }
        cancellation.verify(signature)?;
        if !l.state.holds_resources() {
            return Err(reject(
                RejectCode::WrongState,
                format!("lease {id} is already {}", l.state.label()),
            ));
        }
        self.set_state(id, LeaseState::Cancelled, now);
        Ok(())
    }

    /// As requester: remember a lease the provider activated. The provider chose its
    /// id, so an id this book already holds (any role) is refused: a provider must
    /// never overwrite another record.
    pub fn record_requester_lease(
        &mut self,
        terms: LeaseTerms,
        provider_sig: Vec<u8>,
        requester_sig: Vec<u8>,
        now: UnixMillis,
    ) -> Result<(), String> {
        let id = terms.lease_id;
        if self.leases.contains_key(&id) {
            return Err(format!(
                "the provider chose lease id {id}, which this node already holds; refused"
            ));
        }
        let start_ms = terms.start_ms;
        self.put(LeaseRecord {
            signed_end_ms: terms.end_ms,
            terms,
            provider_sig,
            requester_sig: Some(requester_sig),
            renewals: Vec::new(),
            role: LeaseRole::Requester,
            state: if start_ms > now {
                LeaseState::Reserved
            } else {
                LeaseState::Active
            },
            updated_ms: now,
        });
        self.changes.push(Change::Lease(id));
        Ok(())
    }

    /// As requester: apply a renewal the provider signed.
    pub fn apply_renewal(
        &mut self,
        signed: SignedRenewal,
        now: UnixMillis,
    ) -> Result<(), Rejection> {
        let id = signed.renewal.lease_id;
        let Some(l) = self.leases.get(&id) else {
            return Err(reject(
                RejectCode::UnknownLease,
                format!("no lease {id} here"),
            ));
        };
        signed
            .renewal
            .verify(&l.terms.provider, &signed.provider_sig)?;
        self.update(id, |l| {
            l.terms.end_ms = signed.renewal.new_end_ms;
            l.renewals.push(signed);
            l.updated_ms = now;
        });
        Ok(())
    }

    /// Marks a lease failed (e.g. the provider vanished during set-up).
    pub fn mark_failed(&mut self, id: LeaseId, now: UnixMillis) {
        self.set_state(id, LeaseState::Failed, now);
    }

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

    /// Lease records held (for tests and metrics).
    pub fn record_count(&self) -> usize {
        self.leases.len()
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

    /// Resources committed by offered and active leases we provide: (GPUs, CPUs, RAM).
    pub fn committed_totals(&self) -> (usize, u32, u64) {
        (self.totals.gpus.len(), self.totals.cpus, self.totals.mem)
    }

    /// The capacity the book lends from.
    pub fn capacity(&self) -> &Capacity {
        &self.capacity
    }

    /// Active leases, either side.
    pub fn active_count(&self) -> usize {
        self.totals.active
    }

    /// Remembered nonces (for tests and persistence checks).
    pub fn nonce_count(&self) -> usize {
        self.nonces.len()
    }
}

#[cfg(test)]
#[path = "book_tests.rs"]
mod tests;
