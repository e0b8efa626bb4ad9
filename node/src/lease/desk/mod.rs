//! The lease desk: every admission decision a provider makes, as plain code.
//!
//! ```text
//!  lease message ─▶ member? ─▶ lending hours ─▶ team policy ─▶ credit (accounts)
//!                 ─▶ the book's checks ─▶ the queue (order, backfill, preemption)
//!                 ─▶ the book grants ─▶ reply + effects
//! ```
//!
//! The desk owns the [`LeaseBook`], the wait queue with its fair-share usage, lending
//! hours and the owner's rules. It is driven by messages and an explicit `now`, like the
//! book, and asks about the requester through [`Standings`] (team membership, policy and
//! credit), so every path is unit-tested with an injected clock and no network. It never
//! touches the store, the swarm or running jobs: each call returns [`Effects`] that the
//! event loop carries out (write these changes, flush now, stop or pause these jobs,
//! settle these leases, record quota use, publish a new advert).

mod owner;
mod queue;

#[cfg(test)]
mod desk_tests;

use gpunode_protocol::lease::{
    proposal_lease_id, Cancellation, LeaseId, LeaseMessage, LeaseReply, LeaseRequest, LeaseTerms,
    RejectCode, Rejection, Renewal,
};
use gpunode_protocol::team::JobKind;
use gpunode_protocol::time::UnixMillis;
use gpunode_sched::{Order, Standing};
use libp2p::identity::Keypair;
use libp2p::PeerId;

use super::book::{Advertised, Change, ProposalAnswer, SignedRenewal};
use super::codec::InboundLease;
use super::errors::LeaseOpError;
use super::{LeaseBook, LeaseRecord, LeaseRole};
use crate::owner::{LendingHours, OwnerPolicy};
pub use owner::OwnerRules;
use queue::{Decision, WaitQueue};
pub use queue::{FairShareEntry, FAIR_SHARE_HALF_LIFE_MS, QUEUE_STALE_MS};

/// What the desk needs to know about a requester, beyond the lease book: answered by
/// the node from its team and its accounts, and by tests from a table.
pub trait Standings {
    /// Whether `peer` may lease here at all (a member of this node's team; anyone when
    /// the node is in no team).
    fn may_lease(&self, peer: &PeerId) -> bool;
    /// The team policy on `gpus` GPUs of `kind` for `duration_ms` from `start`; `Ok`
    /// outside a team. The error says why, in words.
    fn team_policy(
        &self,
        peer: &PeerId,
        kind: JobKind,
        gpus: u32,
        duration_ms: u64,
        start: UnixMillis,
    ) -> Result<(), String>;
    /// Whether `peer` may take a lease that can cost up to `new_max` while its open
    /// leases here can cost up to `exposure` (millicredits).
    fn admit_credit(&self, peer: &PeerId, exposure: u64, new_max: u64) -> Result<(), Rejection>;
    /// How `peer` stands in serving order.
    fn standing(&self, peer: &PeerId) -> Standing;
    /// Whether higher-priority requests may stop lower-priority leases (team policy).
    fn preempts(&self) -> bool;
}

/// What the caller must do after a desk call, in this order.
#[derive(Debug, Default, PartialEq)]
pub struct Effects {
    /// Stop these leases' jobs as preempted (no fault of their requesters).
    pub preempt: Vec<LeaseId>,
    /// Pause (`true`) or resume (`false`) these leases' jobs.
    pub pause: Vec<(LeaseId, bool)>,
    /// Book changes to write to the store (see [`super::persist::write`]).
    pub writes: Vec<Change>,
    /// Fair-share usage to store per user (`None`: forget the user).
    pub fair_share: Vec<(String, Option<FairShareEntry>)>,
    /// Flush the store now, before answering anyone (otherwise the next group commit).
    pub flush_now: bool,
    /// Leases that stopped holding resources: stop their jobs.
    pub ended: Vec<LeaseId>,
    /// Leases this node provided that ended: settle them.
    pub settle: Vec<LeaseRecord>,
    /// GPU time granted to a team member, for its quotas: `(peer, at, gpus, ms)`.
    pub quota: Vec<(PeerId, UnixMillis, u32, u64)>,
    /// The GPUs this node advertises changed: publish a new advert.
    pub republish: bool,
    /// Tell these requesters their queued request (this ticket) would start now: GPUs
    /// freed for it. They ask again at once instead of at their next poll.
    pub turns: Vec<(PeerId, u128)>,
}

/// A cancellation this node made: the lease as it now stands, and the signed message
/// to send to the other party.
pub type LocalCancel = (LeaseRecord, Cancellation, Vec<u8>);

/// How a desk is set up.
pub struct DeskParts {
    /// The book, restored from the store.
    pub book: LeaseBook,
    /// This node's key: it signs offers, renewals and cancellations.
    pub keypair: Keypair,
    /// How waiting requests are ordered.
    pub order: Order,
    /// Fair-share usage restored from the store.
    pub fair_share: Vec<(String, FairShareEntry)>,
    /// When GPUs are lent.
    pub lending: LendingHours,
    /// What happens to leases whose GPUs the owner comes back to, and after how long.
    pub owner: (OwnerPolicy, u64),
    /// A test network's cheat: every lease gets this id.
    pub fixed_lease_id: Option<[u8; 16]>,
}

/// The provider's admission desk (see the module doc).
pub struct LeaseDesk {
    book: LeaseBook,
    keypair: Keypair,
    local: PeerId,
    waiting: WaitQueue,
    lending: LendingHours,
    owner: OwnerRules,
    fixed_lease_id: Option<[u8; 16]>,
}

impl LeaseDesk {
    /// A desk over `parts`.
    pub fn new(parts: DeskParts) -> LeaseDesk {
        LeaseDesk {
            local: parts.keypair.public().to_peer_id(),
            book: parts.book,
            keypair: parts.keypair,
            waiting: WaitQueue::new(parts.order, parts.fair_share),
            lending: parts.lending,
            owner: OwnerRules::new(parts.owner.0, parts.owner.1),
            fixed_lease_id: parts.fixed_lease_id,
        }
    }

    /// The book, to read.
    pub fn book(&self) -> &LeaseBook {
        &self.book
    }

    /// Lending hours.
    pub fn lending(&self) -> &LendingHours {
        &self.lending
    }

    /// Runs `f` on the book and the desk, then collects what the caller must do: the
    /// book's changes, the leases that ended, and whether the advert changed.
    fn tracked<T>(
        &mut self,
        now: UnixMillis,
        f: impl FnOnce(&mut Self, &mut Effects) -> T,
    ) -> (T, Effects) {
        let before: Advertised = self.book.advertised();
        let mut effects = Effects::default();
        let out = f(self, &mut effects);
        self.collect_changes(&mut effects, now);
        effects.republish |= self.book.advertised() != before;
        (out, effects)
    }

    /// Moves the book's pending changes into `effects`, with what follows from leases
    /// that ended: their jobs stop, provider leases are settled, and their users get
    /// back the GPU time they were charged and did not use.
    fn collect_changes(&mut self, effects: &mut Effects, now: UnixMillis) {
        let changes = self.book.take_changes();
        let mut freed = false;
        for change in &changes {
            let Change::Lease(id) = change else { continue };
            let Some(record) = self.book.get(id) else {
                continue;
            };
            if record.state.holds_resources() {
                continue;
            }
            if record.role == LeaseRole::Provider {
                let unused =
                    record.terms.end_ms.saturating_sub(now) as f64 * record.terms.gpus.len() as f64;
                if unused > 0.0 {
                    let user = record.terms.requester.to_string();
                    effects
                        .fair_share
                        .push(self.waiting.charge(&user, -unused, now));
                }
                effects.settle.push(record.clone());
                freed = true;
            }
            effects.ended.push(*id);
        }
        effects.writes.extend(changes);
        if freed {
            effects.turns = self.turns(now);
        }
    }

    /// Answers one lease message from `peer`.
    pub fn on_message(
        &mut self,
        peer: &PeerId,
        message: InboundLease,
        standings: &dyn Standings,
        now: UnixMillis,
    ) -> (LeaseReply, Effects) {
        self.tracked(now, |desk, effects| {
            let reply = if !standings.may_lease(peer) {
                Err(Rejection::new(
                    RejectCode::PeerNotAllowed,
                    "not a member of this team (no valid certificate, or revoked)",
                ))
            } else {
                match message {
                    InboundLease::Invalid(r) => Err(r),
                    InboundLease::Message(m) => {
                        desk.on_lease_message(peer, m, standings, effects, now)
                    }
                }
            };
            reply.unwrap_or_else(LeaseReply::Rejected)
        })
    }

    fn on_lease_message(
        &mut self,
        peer: &PeerId,
        message: LeaseMessage,
        standings: &dyn Standings,
        effects: &mut Effects,
        now: UnixMillis,
    ) -> Result<LeaseReply, Rejection> {
        match message {
            LeaseMessage::Request(req) => {
                Ok(self.on_request(peer, &req, None, standings, effects, now))
            }
            LeaseMessage::Propose {
                request,
                terms,
                requester_sig,
            } => {
                if let Some(granted) = self.granted_before(peer, &terms, &requester_sig) {
                    return Ok(granted);
                }
                let proposal = Some((&terms, requester_sig.as_slice()));
                Ok(self.on_request(peer, &request, proposal, standings, effects, now))
            }
            LeaseMessage::Accept {
                terms,
                provider_sig,
                requester_sig,
            } => {
                let lease_id =
                    self.book
                        .on_accept(peer, &terms, &provider_sig, &requester_sig, now)?;
                let ms = terms.end_ms.saturating_sub(terms.start_ms);
                effects
                    .quota
                    .push((*peer, now, terms.gpus.len() as u32, ms));
                Ok(LeaseReply::Activated { lease_id })
            }
            LeaseMessage::Renew { renewal, signature } => {
                self.on_renew(peer, &renewal, &signature, standings, effects, now)
            }
            LeaseMessage::Cancel {
                cancellation,
                signature,
            } => {
                self.book.on_cancel(peer, &cancellation, &signature, now)?;
                Ok(LeaseReply::Cancelled {
                    lease_id: cancellation.lease_id,
                })
            }
        }
    }

    /// The grant of a proposal this desk already granted (the same terms with the same
    /// signature, from the same peer, still holding its resources), sent again: a
    /// requester whose first answer was lost asks again with the same message, which
    /// would otherwise be refused as a replay while the lease stays held here, unknown
    /// to the requester. Nothing changes.
    fn granted_before(
        &self,
        peer: &PeerId,
        terms: &LeaseTerms,
        requester_sig: &[u8],
    ) -> Option<LeaseReply> {
        let l = self.book.get(&terms.lease_id)?;
        let same = l.role == LeaseRole::Provider
            && l.terms.requester == *peer
            && l.terms == *terms
            && l.requester_sig.as_deref() == Some(requester_sig)
            && l.state.holds_resources();
        same.then(|| LeaseReply::Granted {
            lease_id: terms.lease_id,
            provider_sig: l.provider_sig.clone(),
        })
    }

    /// A new lease request (with the terms its requester proposes, if any): the checks
    /// in order, then the queue, then the book.
    fn on_request(
        &mut self,
        peer: &PeerId,
        req: &LeaseRequest,
        proposal: Option<(&LeaseTerms, &[u8])>,
        standings: &dyn Standings,
        effects: &mut Effects,
        now: UnixMillis,
    ) -> LeaseReply {
        let checked = self
            .admission_checks(peer, req, standings, now)
            .map(|()| self.decide(peer, req, standings, effects, now));
        match checked {
            Err(r) => {
                self.waiting.refused(req);
                LeaseReply::Rejected(r)
            }
            Ok(Decision::Queued(place)) => LeaseReply::Queued(place),
            Ok(Decision::Refused(r)) => LeaseReply::Rejected(r),
            Ok(Decision::Grant(prefer)) => self.grant(peer, req, proposal, &prefer, effects, now),
        }
    }

    /// Lending hours, team policy, credit, then the book's own checks.
    fn admission_checks(
        &self,
        peer: &PeerId,
        req: &LeaseRequest,
        standings: &dyn Standings,
        now: UnixMillis,
    ) -> Result<(), Rejection> {
        // A reservation is judged by the hours it will run in.
        let start = req.start_at_ms.filter(|at| *at > now).unwrap_or(now);
        self.lending
            .check(req.duration_ms, start)
            .map_err(|m| Rejection::new(RejectCode::LendingHours, m))?;
        let r = &req.requirements;
        standings
            .team_policy(peer, r.kind, r.gpus, req.duration_ms, start)
            .map_err(|m| Rejection::new(RejectCode::TeamPolicy, m))?;
        standings.admit_credit(
            peer,
            self.book.exposure(peer),
            self.book.max_amount_for(req),
        )?;
        self.book.check_request(peer, req, now)
    }

    /// The book offers terms on the GPUs the queue chose; with a proposal, under the
    /// proposal's id when that is new here, and the proposed terms become the lease at
    /// once when they are the ones the book would offer.
    fn grant(
        &mut self,
        peer: &PeerId,
        req: &LeaseRequest,
        proposal: Option<(&LeaseTerms, &[u8])>,
        prefer: &[u32],
        effects: &mut Effects,
        now: UnixMillis,
    ) -> LeaseReply {
        // A proposed lease's id is derived from the proposal (so a requester cannot
        // pick one that a record or the ledger here already has); it is taken only
        // when nothing here has it (any role): a requester must never overwrite
        // another record. A proposal offered under another id does not fit.
        let derived = proposal
            .map(|(terms, _)| proposal_lease_id(&self.local, peer, req.nonce, terms.start_ms));
        let id = derived
            .filter(|id| self.fixed_lease_id.is_none() && self.book.get(id).is_none())
            .unwrap_or_else(|| LeaseId(self.fixed_lease_id.unwrap_or_else(rand::random)));
        let answer = match proposal {
            Some(proposal) => {
                self.book
                    .on_proposal(peer, req, proposal, id, &self.keypair, now, prefer)
            }
            None => self
                .book
                .on_request_preferring(peer, req, id, &self.keypair, now, prefer)
                .map(|(terms, provider_sig)| ProposalAnswer::Offered {
                    terms,
                    provider_sig,
                }),
        };
        match answer {
            Ok(answer) => {
                effects
                    .fair_share
                    .push(self.waiting.granted(peer, req, now));
                match answer {
                    ProposalAnswer::Offered {
                        terms,
                        provider_sig,
                    } => LeaseReply::Offer {
                        terms,
                        provider_sig,
                    },
                    ProposalAnswer::Granted { provider_sig } => {
                        effects
                            .quota
                            .push((*peer, now, req.requirements.gpus, req.duration_ms));
                        LeaseReply::Granted {
                            lease_id: id,
                            provider_sig,
                        }
                    }
                }
            }
            Err(r) => {
                // Out of CPU or RAM: a queued request keeps its place (one without a
                // ticket never keeps one).
                if r.code != RejectCode::NoCapacity || req.ticket.is_none() {
                    self.waiting.refused(req);
                }
                LeaseReply::Rejected(r)
            }
        }
    }

    /// A renewal: lending hours and the team's quotas (it is more GPU time), then the
    /// book.
    fn on_renew(
        &mut self,
        peer: &PeerId,
        renewal: &Renewal,
        signature: &[u8],
        standings: &dyn Standings,
        effects: &mut Effects,
        now: UnixMillis,
    ) -> Result<LeaseReply, Rejection> {
        self.lending
            .check(renewal.new_end_ms.saturating_sub(now), now)
            .map_err(|m| Rejection::new(RejectCode::LendingHours, m))?;
        let added = self.book.get(&renewal.lease_id).map(|l| {
            (
                l.terms.gpus.len() as u32,
                renewal.new_end_ms.saturating_sub(l.terms.end_ms),
            )
        });
        if let Some((gpus, extra_ms)) = added.filter(|(_, extra)| *extra > 0) {
            standings
                .team_policy(peer, JobKind::Interactive, gpus, extra_ms, now)
                .map_err(|m| Rejection::new(RejectCode::TeamPolicy, m))?;
        }
        let provider_sig = self
            .book
            .on_renew(peer, renewal, signature, &self.keypair, now)?;
        if let Some((gpus, extra_ms)) = added {
            effects.quota.push((*peer, now, gpus, extra_ms));
        }
        Ok(LeaseReply::Renewed {
            lease_id: renewal.lease_id,
            new_end_ms: renewal.new_end_ms,
            provider_sig,
        })
    }

    /// Cancels a lease on this node's own initiative: signed and applied; the caller
    /// flushes (the effects say so) and tells the other party.
    pub fn cancel_local(
        &mut self,
        prefix: &str,
        now: UnixMillis,
    ) -> (Result<LocalCancel, Rejection>, Effects) {
        self.tracked(now, |desk, effects| {
            effects.flush_now = true;
            desk.cancel(prefix, now)
        })
    }

    fn cancel(&mut self, prefix: &str, now: UnixMillis) -> Result<LocalCancel, Rejection> {
        let id = self
            .book
            .resolve(prefix)
            .map_err(|e| Rejection::new(RejectCode::UnknownLease, e.to_string()))?;
        let cancellation = Cancellation {
            lease_id: id,
            by: self.local,
            at_ms: now,
        };
        let signature = cancellation
            .sign(&self.keypair)
            .map_err(|e| Rejection::new(RejectCode::BadSignature, e.to_string()))?;
        self.book
            .on_cancel(&self.local, &cancellation, &signature, now)?;
        let record = self
            .book
            .get(&id)
            .cloned()
            .ok_or_else(|| Rejection::new(RejectCode::UnknownLease, "lease vanished"))?;
        Ok((record, cancellation, signature))
    }

    /// `peer` left the team: every lease of its that holds resources is cancelled.
    pub fn cancel_peer(&mut self, peer: &PeerId, now: UnixMillis) -> Effects {
        let ids: Vec<String> = self
            .book
            .live()
            .into_iter()
            .filter(|l| l.peer() == *peer)
            .map(|l| l.terms.lease_id.to_string())
            .collect();
        self.tracked(now, |desk, effects| {
            effects.flush_now = true;
            for id in ids {
                if let Err(e) = desk.cancel(&id, now) {
                    tracing::warn!(lease = %id, "cannot cancel a lease of a former member: {}", e.message);
                }
            }
        })
        .1
    }

    /// The queued requests that start now, to be told (see `WaitQueue::turns`).
    fn turns(&mut self, now: UnixMillis) -> Vec<(PeerId, u128)> {
        let timelines = self.book.timelines(now);
        self.waiting.turns(&timelines, now)
    }

    /// `peer` withdraws its request queued under `ticket`: its place is freed at once
    /// (not 3 s later when it goes stale), and the requests that now start are told.
    /// Returns whether the request was there and `peer`'s.
    pub fn withdraw(&mut self, peer: &PeerId, ticket: u128, now: UnixMillis) -> (bool, Effects) {
        let withdrawn = self.waiting.withdraw(peer, ticket);
        let mut effects = Effects::default();
        if withdrawn {
            effects.turns = self.turns(now);
        }
        (withdrawn, effects)
    }

    /// Moves time forward: offers expire, leases end, reservations start.
    pub fn tick(&mut self, now: UnixMillis) -> Effects {
        self.tracked(now, |desk, effects| {
            effects.flush_now = !desk.book.tick(now).is_empty();
        })
        .1
    }

    /// Records a lease the provider activated for us (the caller flushes).
    pub fn record_requester_lease(
        &mut self,
        terms: LeaseTerms,
        provider_sig: Vec<u8>,
        requester_sig: Vec<u8>,
        now: UnixMillis,
    ) -> (Result<LeaseRecord, LeaseOpError>, Effects) {
        self.tracked(now, |desk, effects| {
            effects.flush_now = true;
            let id = terms.lease_id;
            desk.book
                .record_requester_lease(terms, provider_sig, requester_sig, now)?;
            desk.book.get(&id).cloned().ok_or(LeaseOpError::Vanished)
        })
    }

    /// Applies a renewal both parties signed (the caller flushes).
    pub fn apply_renewal(
        &mut self,
        signed: SignedRenewal,
        now: UnixMillis,
    ) -> (Result<LeaseRecord, LeaseOpError>, Effects) {
        self.tracked(now, |desk, effects| {
            effects.flush_now = true;
            let id = signed.renewal.lease_id;
            desk.book
                .apply_renewal(signed, now)
                .map_err(LeaseOpError::Refused)?;
            desk.book.get(&id).cloned().ok_or(LeaseOpError::Vanished)
        })
    }

    /// The GPUs a provider can lend changed (inventory, owner, configured CPU and RAM).
    /// The caller republishes when GPU states changed.
    pub fn set_capacity(&mut self, capacity: super::Capacity) {
        self.book.set_capacity(capacity);
    }

    /// The pending book changes, with nothing else (start-up writes what restoring
    /// changed).
    pub fn take_writes(&mut self, now: UnixMillis) -> Effects {
        self.tracked(now, |_, _| ()).1
    }
}
