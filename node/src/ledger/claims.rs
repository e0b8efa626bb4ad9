//! The claim book: a provider's signed receipts for ended leases, kept durably until
//! their requesters answer ([`Accounts::make_claims`], results, disputes), and the
//! requester's checks and countersignatures of claims it receives
//! ([`Accounts::answer_claims`]).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use tokio::time::Instant;

use gpunode_protocol::encoding;
use gpunode_protocol::lease::LeaseId;
use gpunode_protocol::receipt::{
    amount_for, Claim, ClaimResult, ReceiptRefusal, ReceiptRejection, SettledReceipt, UsageReceipt,
    RECEIPT_SIGNING_TAG, RECEIPT_VERSION,
};
use gpunode_protocol::signing::{self, BatchItem};
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

use super::reputation::Outcome;
use super::{credits, LedgerError, Recorded};
use crate::lease::{LeaseRecord, LeaseRole, LeaseState};
use crate::loop_client::PeerLink;

use super::accounts::Accounts;

pub(super) const CLAIMS_TREE: &str = "claims";
/// Longest a claim's answer waits for the outputs of its lease's job to be checked here.
const OBSERVATION_WAIT: Duration = Duration::from_secs(10);

/// A claim and where it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct StoredClaim {
    pub(super) claim: Claim,
    /// Why the requester refused it, if it did.
    pub(super) disputed: Option<String>,
}

/// A claim as stored before receipt format 2.
#[derive(Debug, Deserialize)]
struct StoredClaimV1 {
    receipt: gpunode_protocol::receipt::UsageReceiptV1,
    provider_sig: Vec<u8>,
    disputed: Option<String>,
}

impl StoredClaim {
    /// Decodes a stored claim of either receipt format.
    pub(super) fn decode(bytes: &[u8]) -> Result<StoredClaim, encoding::DecodeError> {
        match encoding::decode::<StoredClaim>(bytes, 64 * 1024) {
            Ok(c) if c.claim.receipt.version != 1 => Ok(c),
            current => match encoding::decode::<StoredClaimV1>(bytes, 64 * 1024) {
                Ok(old) => Ok(StoredClaim {
                    claim: Claim {
                        receipt: old.receipt.into(),
                        provider_sig: old.provider_sig,
                    },
                    disputed: old.disputed,
                }),
                Err(_) => current,
            },
        }
    }
}

/// How long a claim for a lease that ran to its end may wait for others to the same
/// requester, so that one settlement exchange carries many: nobody waits for such a
/// receipt (a requester that waits, as `gpunode run` does, ends its lease first, and the
/// claim of a lease ended early goes at once, with whatever waits beside it). Each
/// exchange costs both sides a stream, a signed ledger head and a durable write however
/// many claims it carries.
pub(super) const LINGER: Duration = Duration::from_millis(100);

/// Unsettled claims, indexed for the questions asked on every lease request and every
/// settlement round: what a peer owes, and which claims wait for an answer and by when
/// each should be sent.
#[derive(Debug, Default)]
pub(super) struct ClaimBook {
    pub(super) by_lease: HashMap<LeaseId, StoredClaim>,
    pub(super) owed: HashMap<PeerId, u64>,
    /// Per requester, its claims waiting for an answer.
    pub(super) waiting: HashMap<PeerId, Waiting>,
}

/// One requester's claims waiting for an answer, by lease and by when each is to be
/// sent.
#[derive(Debug, Default)]
pub(super) struct Waiting {
    send_by: HashMap<LeaseId, Instant>,
    in_order: BTreeSet<(Instant, LeaseId)>,
}

impl Waiting {
    fn insert(&mut self, id: LeaseId, at: Instant) {
        self.remove(&id);
        self.send_by.insert(id, at);
        self.in_order.insert((at, id));
    }

    fn remove(&mut self, id: &LeaseId) {
        if let Some(at) = self.send_by.remove(id) {
            self.in_order.remove(&(at, *id));
        }
    }

    fn is_empty(&self) -> bool {
        self.send_by.is_empty()
    }

    /// When the soonest is to be sent.
    fn due(&self) -> Option<Instant> {
        self.in_order.first().map(|(at, _)| *at)
    }
}

impl ClaimBook {
    /// Keeps `claim`, to be sent at once.
    pub(super) fn insert(&mut self, id: LeaseId, claim: StoredClaim) {
        self.insert_due(id, claim, Instant::now());
    }

    /// Keeps `claim`, to be sent by `send_by` (or with another claim to its requester
    /// that is due before).
    pub(super) fn insert_due(&mut self, id: LeaseId, claim: StoredClaim, send_by: Instant) {
        self.remove(&id);
        let peer = claim.claim.receipt.requester;
        *self.owed.entry(peer).or_default() += claim.claim.receipt.amount_millicredits;
        if claim.disputed.is_none() {
            self.waiting.entry(peer).or_default().insert(id, send_by);
        }
        self.by_lease.insert(id, claim);
    }

    pub(super) fn remove(&mut self, id: &LeaseId) {
        let Some(old) = self.by_lease.remove(id) else {
            return;
        };
        let peer = old.claim.receipt.requester;
        if let Some(o) = self.owed.get_mut(&peer) {
            *o = o.saturating_sub(old.claim.receipt.amount_millicredits);
            if *o == 0 {
                self.owed.remove(&peer);
            }
        }
        if let Some(w) = self.waiting.get_mut(&peer) {
            w.remove(id);
            if w.is_empty() {
                self.waiting.remove(&peer);
            }
        }
    }

    /// Up to `n` of `peer`'s waiting claims, those due soonest first.
    fn to_send(&self, peer: &PeerId, n: usize) -> Vec<Claim> {
        let Some(waiting) = self.waiting.get(peer) else {
            return Vec::new();
        };
        waiting
            .in_order
            .iter()
            .take(n)
            .filter_map(|(_, id)| self.by_lease.get(id).map(|c| c.claim.clone()))
            .collect()
    }

    pub(super) fn contains_key(&self, id: &LeaseId) -> bool {
        self.by_lease.contains_key(id)
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &StoredClaim> {
        self.by_lease.values()
    }

    pub(super) fn len(&self) -> usize {
        self.by_lease.len()
    }
}

impl Accounts {
    /// Provider side: signed receipts for ended leases that have neither a claim nor a
    /// ledger entry, stored durably as claims. Returns them.
    pub fn make_claims(&self, ended: &[LeaseRecord]) -> Vec<Claim> {
        let mut made = Vec::new();
        if self.misbehaviour.withhold_receipts {
            return made;
        }
        for record in ended {
            let id = record.terms.lease_id;
            if record.role != LeaseRole::Provider
                || !matches!(record.state, LeaseState::Completed | LeaseState::Cancelled)
                || self.claims().contains_key(&id)
                || matches!(self.ledger.settled(&id), Ok(Some(_)))
            {
                continue;
            }
            if self.metered.has_running(&id) {
                // Its last job is stopping: the receipt waits for its usage.
                self.deferred
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(record.clone());
                continue;
            }
            let receipt = self.receipt_for(record);
            let provider_sig = match receipt.sign(&self.keypair) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!("cannot sign a receipt: {e}");
                    continue;
                }
            };
            let stored = StoredClaim {
                claim: Claim {
                    receipt,
                    provider_sig,
                },
                disputed: None,
            };
            if let Err(e) = self
                .store
                .put(CLAIMS_TREE, &id.0, &encoding::encode(&stored))
            {
                tracing::error!("cannot store a claim: {e}");
                continue;
            }
            made.push(stored.claim.clone());
            // A lease that ran to its end: nobody waits for its receipt.
            let send_by = match record.state {
                LeaseState::Completed => Instant::now() + LINGER,
                _ => Instant::now(),
            };
            self.claims().insert_due(id, stored, send_by);
        }
        if !made.is_empty() {
            if let Err(e) = self.store.flush() {
                tracing::error!("cannot flush claims: {e}");
            }
        }
        made
    }

    /// The receipt for an ended lease: the time it held its resources is billed, and
    /// what its jobs ran is recorded beside it. Deterministic: the same lease and usage
    /// always give the same receipt.
    fn receipt_for(&self, record: &LeaseRecord) -> UsageReceipt {
        let t = &record.terms;
        let usage = self.metered.get(&t.lease_id);
        let mut end_ms = record.updated_ms.clamp(t.start_ms, t.end_ms);
        let mut run_ms = usage.billed_ms.min(end_ms - t.start_ms);
        if self.misbehaviour.inflate_billing > 1 {
            // The cheat bills the lease's whole term although it was cancelled early,
            // and many times the run time, so the times still look plausible.
            end_ms = t.end_ms;
            run_ms = (usage
                .billed_ms
                .saturating_mul(self.misbehaviour.inflate_billing)
                + 5_000)
                .min(end_ms - t.start_ms);
        }
        // The time the owner held the jobs paused is not billed.
        let held_ms = (end_ms - t.start_ms)
            .saturating_sub(usage.paused_ms)
            .max(run_ms);
        let gpus = t.gpus.len() as u32;
        UsageReceipt {
            version: RECEIPT_VERSION,
            lease_id: t.lease_id,
            provider: t.provider,
            requester: t.requester,
            gpus,
            cpus: t.cpus,
            mem_bytes: t.mem_bytes,
            start_ms: t.start_ms,
            end_ms,
            billed_ms: held_ms,
            // Measured GPU time where the driver showed the job's processes; leased GPU
            // time while jobs ran otherwise. Never more than the leased GPUs over the
            // run time.
            gpu_ms: usage
                .measured_gpu_ms
                .unwrap_or(u64::MAX)
                .min(run_ms.saturating_mul(gpus as u64)),
            cpu_ms: run_ms.saturating_mul(t.cpus as u64),
            jobs: usage.jobs,
            exit_status: usage.exit_status(),
            output_digest: usage.output_digest(),
            price_per_gpu_hour_millicredits: t.price_per_gpu_hour_millicredits,
            amount_millicredits: amount_for(t.price_per_gpu_hour_millicredits, gpus, held_ms),
            issued_at_ms: end_ms,
            // A job may hold more than a capped lease lends (`lend_gpu_memory`); the
            // receipt never claims more than the leased GPUs' memory.
            peak_gpu_memory_bytes: usage
                .peak_gpu_memory_bytes
                .min(t.gpus.iter().map(|g| g.memory_bytes).sum()),
        }
    }

    /// Requesters whose waiting claims are due by `now`, or `awaited`, and when the next
    /// of the others is.
    pub(super) fn due_peers(
        &self,
        now: Instant,
        awaited: impl Fn(&PeerId) -> bool,
    ) -> (Vec<PeerId>, Option<Instant>) {
        let book = self.claims();
        let mut due = Vec::new();
        let mut next: Option<Instant> = None;
        for (peer, waiting) in &book.waiting {
            match waiting.due() {
                Some(at) if at <= now || awaited(peer) => due.push(*peer),
                Some(at) => next = Some(next.map_or(at, |n| n.min(at))),
                None => {}
            }
        }
        (due, next)
    }

    /// Up to `n` claims waiting for `peer`'s answer, those due soonest first.
    pub(super) fn waiting_claims(&self, peer: &PeerId, n: usize) -> Vec<Claim> {
        self.claims().to_send(peer, n)
    }

    /// Provider side: the requester's answers to `claims`.
    pub(super) async fn on_results(
        &self,
        peer: PeerId,
        claims: Vec<Claim>,
        results: Vec<ClaimResult>,
    ) {
        // All countersignatures in one batch; one by one only if it fails.
        let bodies: Vec<Vec<u8>> = claims.iter().map(|c| c.receipt.canonical_bytes()).collect();
        let batch: Vec<BatchItem<'_>> = claims
            .iter()
            .zip(&bodies)
            .zip(&results)
            .filter_map(|((c, body), r)| match r {
                ClaimResult::Countersigned(sig) => Some(BatchItem {
                    signer: &c.receipt.requester,
                    tag: RECEIPT_SIGNING_TAG,
                    body,
                    signature: sig,
                }),
                ClaimResult::Rejected(_) => None,
            })
            .collect();
        let all_valid = claims.iter().all(|c| c.receipt.requester == peer)
            && signing::verify_batch(&batch).is_ok();
        let mut settled = Vec::new();
        for (claim, result) in claims.into_iter().zip(results) {
            match result {
                ClaimResult::Countersigned(sig)
                    if all_valid || claim.receipt.verify(&peer, &sig).is_ok() =>
                {
                    settled.push(SettledReceipt {
                        receipt: claim.receipt,
                        provider_sig: claim.provider_sig,
                        requester_sig: sig,
                    });
                }
                ClaimResult::Countersigned(_) => {
                    self.dispute(claim, "the countersignature does not verify".into());
                }
                ClaimResult::Rejected(r) if r.code == ReceiptRefusal::RequesterError => {
                    tracing::info!(%peer, "requester could not settle now: {}", r.message);
                }
                ClaimResult::Rejected(r) => self.dispute(claim, r.message),
            }
        }
        let leases: Vec<LeaseId> = settled.iter().map(|s| s.receipt.lease_id).collect();
        let results = self.ledger.record(settled).await;
        for (lease, r) in leases.into_iter().zip(results) {
            match r {
                Ok(_) => {
                    self.forget_claim(&lease);
                    self.metered.forget(&lease);
                    self.reputation.record(peer, Outcome::Settled);
                }
                Err(e) => tracing::error!(%lease, "cannot record a settled receipt: {e}"),
            }
        }
    }

    fn dispute(&self, claim: Claim, reason: String) {
        let peer = claim.receipt.requester;
        let id = claim.receipt.lease_id;
        tracing::warn!(%peer, lease = %id, "receipt disputed: {reason}");
        let stored = StoredClaim {
            claim,
            disputed: Some(reason),
        };
        let _ = self
            .store
            .put(CLAIMS_TREE, &id.0, &encoding::encode(&stored));
        self.claims().insert(id, stored);
        self.reputation.record(peer, Outcome::DisputedReceipt);
    }

    fn forget_claim(&self, lease: &LeaseId) {
        self.claims().remove(lease);
        let _ = self.store.remove(CLAIMS_TREE, &lease.0);
    }

    /// Requester side: answers a batch of claims from `from`. Every countersigned
    /// receipt is on disk before this returns.
    pub async fn answer_claims(
        &self,
        link: &PeerLink,
        from: PeerId,
        claims: Vec<Claim>,
    ) -> Vec<ClaimResult> {
        let ids: Vec<LeaseId> = claims.iter().map(|c| c.receipt.lease_id).collect();
        let mut leases = link
            .client()
            .leases_by_id(ids.clone())
            .await
            .unwrap_or_default();
        leases.resize(claims.len(), None);
        if self.await_observations(&from, &claims, &leases).await {
            // The job ended while this waited: its lease's record may have too.
            leases = link.client().leases_by_id(ids).await.unwrap_or_default();
            leases.resize(claims.len(), None);
        }
        let all_signed = providers_signed_all(&from, &claims);
        let mut results: Vec<Option<ClaimResult>> = vec![None; claims.len()];
        let mut to_record = Vec::new();
        let mut slots = Vec::new();
        for (i, claim) in claims.iter().enumerate() {
            match self.check_and_countersign(claim, &from, leases[i].as_ref(), all_signed) {
                Ok(settled) => {
                    to_record.push(settled);
                    slots.push(i);
                }
                Err(result) => results[i] = Some(result),
            }
        }
        let recorded = self.ledger.record(to_record.clone()).await;
        for ((i, settled), r) in slots.into_iter().zip(to_record).zip(recorded) {
            results[i] = Some(match r {
                Ok(Recorded::New(_)) | Ok(Recorded::AlreadyThere(_)) => {
                    self.observed.forget(&settled.receipt.lease_id);
                    ClaimResult::Countersigned(settled.requester_sig)
                }
                Err(e @ LedgerError::Duplicate { .. }) => ClaimResult::Rejected(
                    ReceiptRejection::new(ReceiptRefusal::Duplicate, e.to_string()),
                ),
                Err(e) => requester_error(e),
            });
        }
        let results: Vec<ClaimResult> = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| requester_error(LedgerError::Closed)))
            .collect();
        self.note_answers(link, &from, &claims, &results);
        self.answered.send_modify(|n| *n += 1);
        results
    }

    /// Waits (at most [`OBSERVATION_WAIT`] in all) until no job of the claimed leases
    /// that `from` provides to us is still delivering here: a provider that ends the
    /// lease with its job (the job protocol that ends leases) sends the claim as the
    /// outputs arrive, and what this node observed is known only once they are checked.
    /// Whether it waited for any.
    async fn await_observations(
        &self,
        from: &PeerId,
        claims: &[Claim],
        leases: &[Option<LeaseRecord>],
    ) -> bool {
        let deadline = tokio::time::Instant::now() + OBSERVATION_WAIT;
        let mut waited = false;
        for (claim, lease) in claims.iter().zip(leases) {
            let id = &claim.receipt.lease_id;
            let ours = lease
                .as_ref()
                .is_some_and(|l| l.role == LeaseRole::Requester && l.terms.provider == *from);
            if ours && self.observed.has_running(id) {
                waited = true;
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                self.observed.wait_idle(id, left).await;
            }
        }
        waited
    }

    /// One claim: the same receipt settled before gets its countersignature again; a
    /// new one is checked and countersigned (to be recorded); the `Err` is the answer
    /// when it cannot be.
    fn check_and_countersign(
        &self,
        claim: &Claim,
        from: &PeerId,
        lease: Option<&LeaseRecord>,
        all_signed: bool,
    ) -> Result<SettledReceipt, ClaimResult> {
        let id = claim.receipt.lease_id;
        match self.ledger.settled(&id) {
            Ok(Some((_, s))) => {
                return Err(
                    if s.receipt == claim.receipt && s.provider_sig == claim.provider_sig {
                        ClaimResult::Countersigned(s.requester_sig)
                    } else {
                        ClaimResult::Rejected(ReceiptRejection::new(
                            ReceiptRefusal::Duplicate,
                            format!("lease {id} was settled before with another receipt"),
                        ))
                    },
                )
            }
            Ok(None) => {}
            Err(e) => return Err(requester_error(e)),
        }
        if self.observed.has_running(&id) {
            // Not the provider's fault: it is asked again (RequesterError).
            return Err(ClaimResult::Rejected(ReceiptRejection::new(
                ReceiptRefusal::RequesterError,
                format!("a job of lease {id} is still delivering its outputs here; try again"),
            )));
        }
        let observed = self.observed.get(&id);
        let local = self.ledger.local();
        super::checks::check_claim_with(claim, from, &local, lease, &observed, all_signed)
            .and_then(|()| {
                claim.receipt.sign(&self.keypair).map_err(|e| {
                    ReceiptRejection::new(ReceiptRefusal::RequesterError, e.to_string())
                })
            })
            .map(|sig| SettledReceipt {
                receipt: claim.receipt.clone(),
                provider_sig: claim.provider_sig.clone(),
                requester_sig: sig,
            })
            .map_err(ClaimResult::Rejected)
    }

    /// Remembers why receipts were refused, counts the answers, and costs a provider
    /// reputation when one of its claims was refused on its merits.
    fn note_answers(
        &self,
        link: &PeerLink,
        from: &PeerId,
        claims: &[Claim],
        results: &[ClaimResult],
    ) {
        let mut disputed = false;
        for (claim, r) in claims.iter().zip(results) {
            match r {
                ClaimResult::Countersigned(_) => {
                    link.metrics().receipts_settled.inc();
                }
                ClaimResult::Rejected(rej) => {
                    link.metrics().receipt_rejected(rej.code.label());
                    if rej.code != ReceiptRefusal::RequesterError {
                        self.refused
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(claim.receipt.lease_id, rej.message.clone());
                        tracing::warn!(peer = %from, "refused a receipt: {}", rej.message);
                        disputed = true;
                    }
                }
            }
        }
        if disputed {
            self.reputation.record(*from, Outcome::DisputedReceipt);
        }
    }

    /// Requester side: waits (at most `timeout`) until the receipt of `lease` is settled
    /// or refused here.
    pub async fn wait_receipt(&self, lease: &LeaseId, timeout: Duration) -> ReceiptStatus {
        let mut answered = self.answered.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Ok(Some((_, r))) = self.ledger.settled(lease) {
                return ReceiptStatus::Settled(Box::new(r));
            }
            if let Some(why) = self
                .refused
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(lease)
            {
                return ReceiptStatus::Refused(why);
            }
            if tokio::time::timeout_at(deadline, answered.changed())
                .await
                .is_err()
            {
                return ReceiptStatus::Pending;
            }
        }
    }

    /// Unsettled claims, for `gpunode ledger`.
    pub fn unsettled(&self) -> Vec<UnsettledView> {
        let mut v: Vec<UnsettledView> = self
            .claims()
            .values()
            .map(|c| UnsettledView {
                lease_id: c.claim.receipt.lease_id.to_string(),
                peer: c.claim.receipt.requester.to_string(),
                amount: credits(c.claim.receipt.amount_millicredits),
                disputed: c.disputed.clone(),
            })
            .collect();
        v.sort_by(|a, b| a.lease_id.cmp(&b.lease_id));
        v
    }
}

/// Where a lease's receipt stands for its requester.
#[derive(Debug, Clone, PartialEq)]
pub enum ReceiptStatus {
    /// Countersigned and in the ledger.
    Settled(Box<SettledReceipt>),
    /// Refused, with the reason.
    Refused(String),
    /// Not arrived yet.
    Pending,
}

/// A claim that is not settled yet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnsettledView {
    /// The lease.
    pub lease_id: String,
    /// Who owes.
    pub peer: String,
    /// Credits claimed.
    pub amount: f64,
    /// Why the peer refused it, if it did.
    pub disputed: Option<String>,
}

/// Whether `from` signed every claim (all providers' signatures in one batch; one by
/// one, in the checks, only if the batch fails).
fn providers_signed_all(from: &PeerId, claims: &[Claim]) -> bool {
    let bodies: Vec<Vec<u8>> = claims.iter().map(|c| c.receipt.canonical_bytes()).collect();
    let batch: Vec<BatchItem<'_>> = claims
        .iter()
        .zip(&bodies)
        .map(|(c, body)| BatchItem {
            signer: from,
            tag: RECEIPT_SIGNING_TAG,
            body,
            signature: &c.provider_sig,
        })
        .collect();
    claims.iter().all(|c| c.receipt.provider == *from) && signing::verify_batch(&batch).is_ok()
}

fn requester_error(e: LedgerError) -> ClaimResult {
    ClaimResult::Rejected(ReceiptRejection::new(
        ReceiptRefusal::RequesterError,
        format!("cannot store the receipt now: {e}"),
    ))
}
