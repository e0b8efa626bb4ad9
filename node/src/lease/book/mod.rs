//! The lease book: every lease this node is party to, as provider or requester, and the
//! provider's rules for granting them. Pure state: messages and `now` in, decisions and
//! a list of changes to persist out. The event loop owns the only instance, so requests,
//! accepts, renewals, cancels and expiries are applied one at a time and capacity can
//! never be committed twice.
//!
//! The book is split by job: `records` holds what is recorded about a lease,
//! `allocation` picks and accounts for GPUs, CPUs and RAM, `checks` holds the checks of
//! a request that change nothing, `expiry` what time does to the book; this module is
//! the state machine itself (request, accept, renew, cancel, fail).

mod allocation;
mod checks;
mod expiry;
mod records;

use super::errors::LeaseOpError;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use gpunode_protocol::lease::{
    Cancellation, LeaseId, LeaseRequest, LeaseTerms, RejectCode, Rejection, Renewal, LEASE_VERSION,
    PROPOSAL_START_SLACK_MS,
};
use gpunode_protocol::time::{UnixMillis, MAX_CLOCK_SKEW_MS};
use gpunode_protocol::{Keypair, PeerId};

use super::policy::{Capacity, LeasePolicy};
use allocation::Totals;

pub use allocation::{Advertised, MAX_RESERVE_AHEAD_MS};
pub use records::{Change, LeaseRecord, LeaseRole, LeaseState, SignedRenewal};

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

fn reject(code: RejectCode, message: impl Into<String>) -> Rejection {
    Rejection::new(code, message)
}

/// Our signature over `terms`, or the refusal when the key cannot sign.
fn sign_terms(terms: &LeaseTerms, key: &Keypair) -> Result<Vec<u8>, Rejection> {
    terms.sign(key).map_err(|e| {
        reject(
            RejectCode::InvalidRequest,
            format!("provider cannot sign: {e}"),
        )
    })
}

/// What a provider answers a proposal (see [`LeaseBook::on_proposal`]).
// Made once per proposal and turned straight into a reply; boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProposalAnswer {
    /// The proposed terms are an active lease; our signature over them.
    Granted {
        /// Our signature.
        provider_sig: Vec<u8>,
    },
    /// Other terms, held and offered as for a request alone.
    Offered {
        /// The terms.
        terms: LeaseTerms,
        /// Our signature.
        provider_sig: Vec<u8>,
    },
}

/// Whether `proposed` are the terms `offered` a provider would sign now, as a lease
/// active at once: the same in every field but the start (and so the end, the same
/// duration later) and the offer's expiry, which means nothing for a lease active at
/// once; a start not after `now` and at most [`PROPOSAL_START_SLACK_MS`] before it; and
/// not a reservation (those start when they were asked to, later).
pub fn proposal_fits(offered: &LeaseTerms, proposed: &LeaseTerms, now: UnixMillis) -> bool {
    if offered.start_ms != now
        || proposed.start_ms > now
        || proposed.start_ms.saturating_add(PROPOSAL_START_SLACK_MS) < now
    {
        return false;
    }
    let duration = offered.end_ms.saturating_sub(offered.start_ms);
    let expected = LeaseTerms {
        start_ms: proposed.start_ms,
        end_ms: proposed.start_ms.saturating_add(duration),
        offer_expires_ms: proposed.offer_expires_ms,
        ..offered.clone()
    };
    expected == *proposed
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

    /// Leases that hold resources (offered, active, reserved), newest start first: what
    /// [`LeaseBook::all`] filtered by `holds_resources` gives, without walking the ended
    /// records the book keeps for their retention (thousands on a busy provider).
    pub fn live(&self) -> Vec<&LeaseRecord> {
        let mut v: Vec<&LeaseRecord> = self
            .deadlines
            .iter()
            .filter_map(|(_, id)| self.leases.get(id))
            .collect();
        // Ties by id, as `all` gives them (its records come in id order).
        v.sort_by_key(|l| (std::cmp::Reverse(l.terms.start_ms), l.terms.lease_id));
        v
    }

    /// Finds the lease whose id starts with `prefix` (hex), if exactly one does.
    pub fn resolve(&self, prefix: &str) -> Result<LeaseId, LeaseOpError> {
        let prefix = prefix.trim().to_ascii_lowercase();
        if let Ok(id) = prefix.parse::<LeaseId>() {
            if self.leases.contains_key(&id) {
                return Ok(id);
            }
        }
        if prefix.len() < 4 {
            return Err(LeaseOpError::TooShort(prefix));
        }
        let matches: Vec<LeaseId> = self
            .leases
            .keys()
            .filter(|id| id.to_string().starts_with(&prefix))
            .copied()
            .collect();
        match matches.as_slice() {
            [one] => Ok(*one),
            [] => Err(LeaseOpError::Unknown(prefix)),
            _ => Err(LeaseOpError::Ambiguous(prefix)),
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

    /// The most a lease for `req` could cost at this provider's price, millicredits.
    pub fn max_amount_for(&self, req: &LeaseRequest) -> u64 {
        gpunode_protocol::receipt::amount_for(
            self.policy.price_per_gpu_hour_millicredits,
            req.requirements.gpus,
            req.duration_ms,
        )
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
        let terms = self.terms_for(from, req, lease_id, now, prefer)?;
        self.hold(terms, key, now)
    }

    /// Steps 2 and 4 at once, as provider: the request is judged as
    /// [`Self::on_request_preferring`] judges it, and when the terms it would offer under
    /// `lease_id` are the `proposed` ones (save the start, see [`proposal_fits`]) the
    /// requester's signature is checked and the lease is active at once, signed by both:
    /// [`ProposalAnswer::Granted`] with our signature. Terms that differ (a GPU taken
    /// meanwhile, another price, a clock too far off) are held and offered as usual.
    #[allow(clippy::too_many_arguments)]
    pub fn on_proposal(
        &mut self,
        from: &PeerId,
        req: &LeaseRequest,
        (proposed, requester_sig): (&LeaseTerms, &[u8]),
        lease_id: LeaseId,
        key: &Keypair,
        now: UnixMillis,
        prefer: &[u32],
    ) -> Result<ProposalAnswer, Rejection> {
        let terms = self.terms_for(from, req, lease_id, now, prefer)?;
        if !proposal_fits(&terms, proposed, now) {
            let (terms, provider_sig) = self.hold(terms, key, now)?;
            return Ok(ProposalAnswer::Offered {
                terms,
                provider_sig,
            });
        }
        proposed.verify(from, requester_sig)?;
        let provider_sig = sign_terms(proposed, key)?;
        let id = proposed.lease_id;
        self.put(LeaseRecord {
            terms: proposed.clone(),
            provider_sig: provider_sig.clone(),
            requester_sig: Some(requester_sig.to_vec()),
            signed_end_ms: proposed.end_ms,
            renewals: Vec::new(),
            role: LeaseRole::Provider,
            state: LeaseState::Active,
            updated_ms: now,
        });
        self.changes.push(Change::Lease(id));
        Ok(ProposalAnswer::Granted { provider_sig })
    }

    /// The terms this provider would offer for `req` under `lease_id`, after every check
    /// of the request, the policy and the capacity (the request's nonce is spent from
    /// the first check that passes on). Nothing is held yet.
    fn terms_for(
        &mut self,
        from: &PeerId,
        req: &LeaseRequest,
        lease_id: LeaseId,
        now: UnixMillis,
        prefer: &[u32],
    ) -> Result<LeaseTerms, Rejection> {
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
        Ok(LeaseTerms {
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
        })
    }

    /// Signs `terms` and holds what they name for the offer window: an offer.
    fn hold(
        &mut self,
        terms: LeaseTerms,
        key: &Keypair,
        now: UnixMillis,
    ) -> Result<(LeaseTerms, Vec<u8>), Rejection> {
        let sig = sign_terms(&terms, key)?;
        let lease_id = terms.lease_id;
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
        self.check_renewal(from, renewal, requester_sig, now)?;
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
    ) -> Result<(), LeaseOpError> {
        let id = terms.lease_id;
        if self.leases.contains_key(&id) {
            return Err(LeaseOpError::IdTaken(id));
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

    /// Lease records held (for tests and metrics).
    pub fn record_count(&self) -> usize {
        self.leases.len()
    }

    /// The capacity the book lends from.
    pub fn capacity(&self) -> &Capacity {
        &self.capacity
    }

    /// Remembered nonces (for tests and persistence checks).
    pub fn nonce_count(&self) -> usize {
        self.nonces.len()
    }
}

#[cfg(test)]
#[path = "book_tests.rs"]
mod tests;
