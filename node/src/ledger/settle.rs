//! Settlement: turning ended leases into receipts both ledgers hold.
//!
//! Provider side: when a lease it provided ends, [`Accounts::make_claims`] writes a
//! receipt from the metered usage, signs it and keeps it as a claim (durably, so a crash
//! resends the very same receipt); [`run_claims`] sends claims to each requester in
//! batches on the settle protocol and appends the countersigned ones to the ledger.
//! Claims a requester refuses stay as disputed claims: they count as its debt and cost
//! it reputation; claims it does not answer are retried with backoff.
//!
//! Requester side: [`serve_claims`] checks each claim ([`super::checks`]), countersigns
//! the good ones, appends them to the ledger, and answers only after the write is on disk.
//! A claim identical to one already settled gets the same countersignature again (the
//! provider may have crashed before storing it); anything else for a settled lease is a
//! duplicate.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt};
use gpunode_protocol::encoding;
use gpunode_protocol::lease::{LeaseId, RejectCode, Rejection};
use gpunode_protocol::receipt::{
    amount_for, Claim, ClaimResult, ReceiptRefusal, ReceiptRejection, SettleMsg, SettleReply,
    SettledReceipt, UsageReceipt, MAX_CLAIMS_PER_MESSAGE, RECEIPT_SIGNING_TAG, RECEIPT_VERSION,
};
use gpunode_protocol::signing::{self, BatchItem};
use libp2p::identity::Keypair;
use libp2p::{PeerId, Stream, StreamProtocol};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use super::meter::UsageMeter;
use super::reputation::{Outcome, Reputation};
use super::{credits, Ledger, LedgerError, LedgerWriter, Recorded};
use crate::lease::{LeaseRecord, LeaseRole, LeaseState};
use crate::loop_client::PeerLink;
use crate::router::framing;
use crate::store::Store;

/// The settlement stream protocol.
pub const SETTLE_PROTOCOL: StreamProtocol = StreamProtocol::new("/gpunode/settle/1.0.0");
const CLAIMS_TREE: &str = "claims";
/// How long one settlement exchange may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(20);
/// First retry of an unanswered claim; doubles up to [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_secs(5);
const MAX_RETRY: Duration = Duration::from_secs(600);
/// How often the provider looks for ended leases without a claim (missed notices).
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Ways a node can be told to cheat, so test networks can check that cheats are caught.
/// Never set from configuration.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Misbehaviour {
    /// Bill this many times the metered run time (1 or 0: honest).
    pub inflate_billing: u64,
    /// Flip bytes in every output file before sending it.
    pub corrupt_outputs: bool,
    /// Announce the first output file under this name (a path that escapes, say).
    pub evil_output_name: Option<&'static str>,
    /// Charge this many times the advertised price in offers (0 or 1: honest).
    pub overcharge: u64,
    /// Offer every lease under this id (a provider trying to overwrite the requester's
    /// record of another lease).
    pub fixed_lease_id: Option<[u8; 16]>,
}

/// A claim and where it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct StoredClaim {
    claim: Claim,
    /// Why the requester refused it, if it did.
    disputed: Option<String>,
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
    fn decode(bytes: &[u8]) -> Result<StoredClaim, encoding::DecodeError> {
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

/// Unsettled claims, indexed for the questions asked on every lease request and every
/// settlement round: what a peer owes, and which claims wait for an answer.
#[derive(Debug, Default)]
struct ClaimBook {
    by_lease: HashMap<LeaseId, StoredClaim>,
    owed: HashMap<PeerId, u64>,
    waiting: HashMap<PeerId, std::collections::BTreeSet<LeaseId>>,
}

impl ClaimBook {
    fn insert(&mut self, id: LeaseId, claim: StoredClaim) {
        self.remove(&id);
        let peer = claim.claim.receipt.requester;
        *self.owed.entry(peer).or_default() += claim.claim.receipt.amount_millicredits;
        if claim.disputed.is_none() {
            self.waiting.entry(peer).or_default().insert(id);
        }
        self.by_lease.insert(id, claim);
    }

    fn remove(&mut self, id: &LeaseId) {
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

    fn contains_key(&self, id: &LeaseId) -> bool {
        self.by_lease.contains_key(id)
    }

    fn values(&self) -> impl Iterator<Item = &StoredClaim> {
        self.by_lease.values()
    }

    fn len(&self) -> usize {
        self.by_lease.len()
    }
}

/// The credit side of a node: ledger, reputation, usage meters, unsettled claims and the
/// admission rules that use them.
pub struct Accounts {
    /// The ledger.
    pub ledger: Arc<Ledger>,
    /// Scores of peers.
    pub reputation: Reputation,
    /// Usage of leases we provide, metered by our jobs.
    pub metered: UsageMeter,
    /// Usage of leases we hold, as observed here.
    pub observed: UsageMeter,
    claims: Mutex<ClaimBook>,
    /// Provider side: ended leases whose last job is still stopping; their claims are
    /// made when it has ended.
    deferred: Mutex<Vec<LeaseRecord>>,
    /// Requester side: receipts we refused, by lease (why), the newest
    /// [`MAX_REFUSED_KEPT`] until the process ends.
    refused: Mutex<RefusedReceipts>,
    /// Bumped after every batch of claims we answered.
    answered: watch::Sender<u64>,
    store: Store,
    keypair: Keypair,
    /// Credits a new peer may use here, millicredits.
    pub allowance_millicredits: u64,
    /// Debt past the allowance tolerated, millicredits.
    pub debt_limit_millicredits: u64,
    /// Lowest reputation admitted.
    pub min_reputation: f64,
    /// Strangers drawing on the allowance (bounded per day, see
    /// [`super::newcomers`]).
    pub newcomers: super::newcomers::Newcomers,
    /// Cheating switches for test networks.
    pub misbehaviour: Misbehaviour,
}

impl std::fmt::Debug for Accounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accounts").finish_non_exhaustive()
    }
}

/// Credit settings.
#[derive(Debug, Clone, Copy)]
pub struct CreditPolicy {
    /// Credits a new peer may use, millicredits.
    pub allowance_millicredits: u64,
    /// Debt past the allowance tolerated, millicredits.
    pub debt_limit_millicredits: u64,
    /// Lowest reputation admitted.
    pub min_reputation: f64,
    /// New peer ids a day that may draw on the allowance outside a team (0: no limit).
    pub new_peers_on_credit_per_day: u32,
}

impl Accounts {
    /// Opens everything from `store`; spawn the returned writer.
    pub fn open(
        store: Store,
        keypair: Keypair,
        policy: CreditPolicy,
        misbehaviour: Misbehaviour,
    ) -> Result<(Arc<Accounts>, LedgerWriter), LedgerError> {
        let (ledger, writer) = Ledger::open(store.clone(), keypair.clone())?;
        let mut claims = ClaimBook::default();
        for (k, v) in store.scan(CLAIMS_TREE)? {
            if let (Ok(id), Ok(c)) = (<[u8; 16]>::try_from(k.as_slice()), StoredClaim::decode(&v)) {
                claims.insert(LeaseId(id), c);
            }
        }
        let accounts = Accounts {
            ledger,
            reputation: Reputation::open(store.clone())?,
            metered: UsageMeter::open(store.clone(), "metered")?,
            observed: UsageMeter::open(store.clone(), "observed")?,
            claims: Mutex::new(claims),
            deferred: Mutex::new(Vec::new()),
            refused: Mutex::new(RefusedReceipts::default()),
            answered: watch::channel(0).0,
            store,
            keypair,
            allowance_millicredits: policy.allowance_millicredits,
            debt_limit_millicredits: policy.debt_limit_millicredits,
            min_reputation: policy.min_reputation,
            newcomers: super::newcomers::Newcomers::new(policy.new_peers_on_credit_per_day),
            misbehaviour,
        };
        Ok((Arc::new(accounts), writer))
    }

    fn claims(&self) -> std::sync::MutexGuard<'_, ClaimBook> {
        self.claims.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What `peer` has claimed from us and not settled, millicredits (disputed included).
    pub fn unsettled_with(&self, peer: &PeerId) -> u64 {
        self.claims().owed.get(peer).copied().unwrap_or(0)
    }

    /// Refused receipts whose reasons are kept (bounded).
    pub fn refused_count(&self) -> usize {
        self.refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .why
            .len()
    }

    /// Unsettled claims: (pending, disputed).
    pub fn claim_counts(&self) -> (usize, usize) {
        let claims = self.claims();
        let disputed = claims.values().filter(|c| c.disputed.is_some()).count();
        (claims.len() - disputed, disputed)
    }

    /// Give-to-get standing of `peer` here, millicredits: the allowance, plus what it
    /// provided to us, minus what it used here (settled or claimed).
    pub fn standing(&self, peer: &PeerId) -> i128 {
        self.standing_with(peer, self.allowance_millicredits)
    }

    /// [`Accounts::standing`] with another allowance (a team policy's).
    pub fn standing_with(&self, peer: &PeerId, allowance_millicredits: u64) -> i128 {
        let a = self.ledger.account(peer);
        allowance_millicredits as i128 + a.spent as i128
            - a.earned as i128
            - self.unsettled_with(peer) as i128
    }

    /// Whether `peer` may take a lease that can cost up to `new_max` while its open
    /// leases here can cost up to `open_exposure` (millicredits).
    pub fn admit(
        &self,
        peer: &PeerId,
        open_exposure: u64,
        new_max: u64,
        allowance_override: Option<u64>,
    ) -> Result<(), Rejection> {
        // Outside a team, a peer that would draw on the allowance gets its share of the
        // strangers' allowance of the day (Sybil ids cannot mint credit).
        let now = gpunode_protocol::time::now_ms();
        let own = self.standing_with(peer, 0);
        let draws =
            allowance_override.is_none() && own - open_exposure as i128 - (new_max as i128) < 0;
        let allowance = match allowance_override {
            Some(a) => a,
            None if draws => self
                .newcomers
                .allowance_for(peer, self.allowance_millicredits, now),
            None => self.allowance_millicredits,
        };
        let score = self.reputation.score(peer);
        if score < self.min_reputation {
            return Err(Rejection::new(
                RejectCode::LowReputation,
                format!(
                    "your reputation with this provider is {score:.2}, below its minimum of {:.2} (after failed, disputed or mismatched work); it recovers with time",
                    self.min_reputation
                ),
            ));
        }
        let standing = self.standing_with(peer, allowance);
        let after = standing - open_exposure as i128 - new_max as i128;
        if after < -(self.debt_limit_millicredits as i128) {
            return Err(Rejection::new(
                RejectCode::DebtLimit,
                format!(
                    "debt limit reached: your standing with this provider is {:.3} credits (allowance {:.3}, plus what you provided it, minus what you used or owe), your open leases here can cost {:.3} and this one {:.3}, which would take you past its debt limit of {:.3}; provide resources to others (gpunode serve) to earn credits, or ask for less",
                    credits(standing),
                    credits(allowance),
                    credits(open_exposure),
                    credits(new_max),
                    credits(self.debt_limit_millicredits),
                ),
            ));
        }
        if draws {
            self.newcomers.drawing(peer, now);
        }
        Ok(())
    }

    /// Provider side: signed receipts for ended leases that have neither a claim nor a
    /// ledger entry, stored durably as claims. Returns them.
    pub fn make_claims(&self, ended: &[LeaseRecord]) -> Vec<Claim> {
        let mut made = Vec::new();
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
            self.claims().insert(id, stored);
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

    /// Requesters with claims waiting for an answer.
    fn waiting_peers(&self) -> Vec<PeerId> {
        self.claims().waiting.keys().copied().collect()
    }

    /// Up to `n` claims waiting for `peer`'s answer.
    fn waiting_claims(&self, peer: &PeerId, n: usize) -> Vec<Claim> {
        let book = self.claims();
        book.waiting
            .get(peer)
            .map(|ids| {
                ids.iter()
                    .take(n)
                    .filter_map(|id| book.by_lease.get(id).map(|c| c.claim.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Provider side: the requester's answers to `claims`.
    async fn on_results(&self, peer: PeerId, claims: Vec<Claim>, results: Vec<ClaimResult>) {
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
        let local = self.ledger.local();
        let ids = claims.iter().map(|c| c.receipt.lease_id).collect();
        let mut leases = link.client().leases_by_id(ids).await.unwrap_or_default();
        leases.resize(claims.len(), None);
        let mut results: Vec<Option<ClaimResult>> = vec![None; claims.len()];
        // All providers' signatures in one batch; one by one only if it fails.
        let bodies: Vec<Vec<u8>> = claims.iter().map(|c| c.receipt.canonical_bytes()).collect();
        let batch: Vec<BatchItem<'_>> = claims
            .iter()
            .zip(&bodies)
            .map(|(c, body)| BatchItem {
                signer: &from,
                tag: RECEIPT_SIGNING_TAG,
                body,
                signature: &c.provider_sig,
            })
            .collect();
        let all_signed = claims.iter().all(|c| c.receipt.provider == from)
            && signing::verify_batch(&batch).is_ok();
        let mut to_record = Vec::new();
        let mut slots = Vec::new();
        for (i, claim) in claims.iter().enumerate() {
            let id = claim.receipt.lease_id;
            match self.ledger.settled(&id) {
                Ok(Some((_, s))) => {
                    results[i] = Some(
                        if s.receipt == claim.receipt && s.provider_sig == claim.provider_sig {
                            ClaimResult::Countersigned(s.requester_sig)
                        } else {
                            ClaimResult::Rejected(ReceiptRejection::new(
                                ReceiptRefusal::Duplicate,
                                format!("lease {id} was settled before with another receipt"),
                            ))
                        },
                    );
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    results[i] = Some(requester_error(e));
                    continue;
                }
            }
            let observed = self.observed.get(&id);
            let checked = super::checks::check_claim_with(
                claim,
                &from,
                &local,
                leases[i].as_ref(),
                &observed,
                all_signed,
            );
            match checked.and_then(|()| {
                claim.receipt.sign(&self.keypair).map_err(|e| {
                    ReceiptRejection::new(ReceiptRefusal::RequesterError, e.to_string())
                })
            }) {
                Ok(sig) => {
                    to_record.push(SettledReceipt {
                        receipt: claim.receipt.clone(),
                        provider_sig: claim.provider_sig.clone(),
                        requester_sig: sig,
                    });
                    slots.push(i);
                }
                Err(r) => results[i] = Some(ClaimResult::Rejected(r)),
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
        let mut disputed = false;
        for (claim, r) in claims.iter().zip(&results) {
            if let ClaimResult::Rejected(rej) = r {
                if rej.code != ReceiptRefusal::RequesterError {
                    self.refused
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(claim.receipt.lease_id, rej.message.clone());
                }
            }
            match r {
                ClaimResult::Countersigned(_) => {
                    link.metrics().receipts_settled.inc();
                }
                ClaimResult::Rejected(rej) => {
                    link.metrics().receipt_rejected(rej.code.label());
                    if rej.code != ReceiptRefusal::RequesterError {
                        tracing::warn!(peer = %from, "refused a receipt: {}", rej.message);
                        disputed = true;
                    }
                }
            }
        }
        if disputed {
            self.reputation.record(from, Outcome::DisputedReceipt);
        }
        self.answered.send_modify(|n| *n += 1);
        results
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

fn requester_error(e: LedgerError) -> ClaimResult {
    ClaimResult::Rejected(ReceiptRejection::new(
        ReceiptRefusal::RequesterError,
        format!("cannot store the receipt now: {e}"),
    ))
}

/// Most settlement streams answered at once.
const MAX_SETTLE_STREAMS: usize = 64;

/// How many refused receipts' reasons are kept (a peer chooses the lease ids of the
/// claims it sends, so the map must not grow with them).
const MAX_REFUSED_KEPT: usize = 4096;

/// Why receipts were refused, by lease, the oldest forgotten first.
#[derive(Default)]
struct RefusedReceipts {
    why: HashMap<LeaseId, String>,
    order: std::collections::VecDeque<LeaseId>,
}

impl RefusedReceipts {
    fn insert(&mut self, lease: LeaseId, why: String) {
        if self.why.insert(lease, why).is_none() {
            self.order.push_back(lease);
        }
        while self.order.len() > MAX_REFUSED_KEPT {
            if let Some(old) = self.order.pop_front() {
                self.why.remove(&old);
            }
        }
    }

    fn get(&self, lease: &LeaseId) -> Option<String> {
        self.why.get(lease).cloned()
    }
}

/// How settle streams are bounded: each exchange as a whole, and how many at once.
pub const SETTLE_STREAM_LIMITS: crate::router::StreamLimits = crate::router::StreamLimits {
    max_handlers: MAX_SETTLE_STREAMS,
    first_message: crate::router::FIRST_MESSAGE_DEADLINE,
    exchange: Some(EXCHANGE_TIMEOUT),
};

/// Whether a peer may settle with this node.
pub type IsMember = Arc<dyn Fn(&PeerId) -> bool + Send + Sync>;

/// Requester side of settlement: answers the claims providers send (see
/// [`SETTLE_STREAM_LIMITS`]).
pub struct ClaimAnswers {
    /// This node's ledger.
    pub accounts: Arc<Accounts>,
    /// The node's leases, streams and metrics.
    pub link: PeerLink,
    /// Whether a peer may settle with this node (a member, when in a team).
    pub is_member: IsMember,
}

impl crate::router::StreamHandler for ClaimAnswers {
    fn handle(
        self: Arc<Self>,
        peer: PeerId,
        stream: Stream,
        _gate: crate::router::StreamGate,
    ) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(async move { answer_stream(&self, peer, stream).await })
    }
}

async fn answer_stream(answers: &ClaimAnswers, peer: PeerId, stream: Stream) {
    let (accounts, link) = (&answers.accounts, &answers.link);
    let (mut r, mut w) = AsyncReadExt::split(stream);
    if !(answers.is_member)(&peer) {
        tracing::debug!(%peer, "settlement from a non-member of the team refused");
        let _ = w.close().await;
        return;
    }
    loop {
        let reply = match framing::read_message::<_, SettleMsg>(&mut r).await {
            Ok(SettleMsg::Claims(claims)) if claims.len() > MAX_CLAIMS_PER_MESSAGE => {
                SettleReply::Refused(ReceiptRejection::new(
                    ReceiptRefusal::Invalid,
                    format!("at most {MAX_CLAIMS_PER_MESSAGE} claims per message"),
                ))
            }
            Ok(SettleMsg::Claims(claims)) => {
                SettleReply::Results(accounts.answer_claims(link, peer, claims).await)
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => {
                link.metrics().receipt_rejected("malformed");
                SettleReply::Refused(ReceiptRejection::new(
                    ReceiptRefusal::Invalid,
                    format!("malformed settlement message: {e}"),
                ))
            }
        };
        let refused = matches!(reply, SettleReply::Refused(_));
        if framing::write_message(&mut w, &reply).await.is_err() || w.flush().await.is_err() {
            break;
        }
        if refused {
            break;
        }
    }
    let _ = w.close().await;
}

/// Provider side: makes claims for leases that end and settles them with their
/// requesters, until `stop`.
pub async fn run_claims(
    accounts: Arc<Accounts>,
    link: PeerLink,
    mut ended: mpsc::Receiver<LeaseRecord>,
    mut stop: watch::Receiver<bool>,
) {
    let (done_tx, mut done_rx) = mpsc::channel::<(PeerId, bool)>(256);
    let mut in_flight: HashSet<PeerId> = HashSet::new();
    let mut backoff: HashMap<PeerId, (tokio::time::Instant, Duration)> = HashMap::new();
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    let mut retry = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            rec = ended.recv() => match rec {
                Some(first) => {
                    let mut batch = vec![first];
                    while let Ok(r) = ended.try_recv() {
                        batch.push(r);
                    }
                    let a = accounts.clone();
                    let _ = tokio::task::spawn_blocking(move || a.make_claims(&batch)).await;
                }
                None => return,
            },
            _ = sweep.tick() => {
                if let Ok(leases) = link.client().list_leases().await {
                    let a = accounts.clone();
                    let _ = tokio::task::spawn_blocking(move || a.make_claims(&leases)).await;
                }
            }
            Some((peer, ok)) = done_rx.recv() => {
                in_flight.remove(&peer);
                if ok {
                    backoff.remove(&peer);
                } else {
                    let next = backoff.get(&peer).map_or(FIRST_RETRY, |(_, d)| (*d * 2).min(MAX_RETRY));
                    backoff.insert(peer, (tokio::time::Instant::now() + next, next));
                }
            }
            _ = accounts.metered.jobs_done.notified() => {
                let deferred: Vec<LeaseRecord> = std::mem::take(
                    &mut *accounts.deferred.lock().unwrap_or_else(|p| p.into_inner()),
                );
                let a = accounts.clone();
                let _ = tokio::task::spawn_blocking(move || a.make_claims(&deferred)).await;
            }
            _ = retry.tick() => {}
            _ = stop.changed() => return,
        }
        let now = tokio::time::Instant::now();
        for peer in accounts.waiting_peers() {
            if in_flight.contains(&peer) || backoff.get(&peer).is_some_and(|(at, _)| *at > now) {
                continue;
            }
            let claims = accounts.waiting_claims(&peer, MAX_CLAIMS_PER_MESSAGE);
            in_flight.insert(peer);
            let (a, n, done) = (accounts.clone(), link.clone(), done_tx.clone());
            tokio::spawn(async move {
                let ok = send_claims(&a, &n, peer, claims).await;
                let _ = done.send((peer, ok)).await;
            });
        }
    }
}

/// One exchange with a requester; true when it answered.
async fn send_claims(
    accounts: &Accounts,
    link: &PeerLink,
    peer: PeerId,
    claims: Vec<Claim>,
) -> bool {
    let exchange = async {
        let stream = link.open_stream(peer, SETTLE_PROTOCOL).await?;
        let (mut r, mut w) = AsyncReadExt::split(stream);
        framing::write_message(&mut w, &SettleMsg::Claims(claims.clone()))
            .await
            .map_err(crate::NodeError::Exchange)?;
        w.flush().await.map_err(crate::NodeError::Exchange)?;
        let reply = framing::read_message::<_, SettleReply>(&mut r)
            .await
            .map_err(crate::NodeError::Exchange)?;
        let _ = w.close().await;
        Ok::<_, crate::NodeError>(reply)
    };
    match tokio::time::timeout(EXCHANGE_TIMEOUT, exchange).await {
        Ok(Ok(SettleReply::Results(results))) if results.len() == claims.len() => {
            accounts.on_results(peer, claims, results).await;
            true
        }
        Ok(Ok(SettleReply::Refused(r))) => {
            tracing::warn!(%peer, "settlement refused: {}", r.message);
            false
        }
        Ok(Ok(_)) => {
            tracing::warn!(%peer, "settlement answer does not match the claims sent");
            false
        }
        Ok(Err(e)) => {
            tracing::debug!(%peer, "settlement failed: {e}");
            false
        }
        Err(_) => {
            tracing::debug!(%peer, "settlement timed out");
            false
        }
    }
}

#[cfg(test)]
mod accounts_tests {
    use super::*;

    #[test]
    fn sybil_strangers_cannot_mint_credit_but_team_members_keep_theirs() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = Store::open(dir.path()).expect("store");
        let (accounts, _writer) = Accounts::open(
            store,
            Keypair::generate_ed25519(),
            CreditPolicy {
                allowance_millicredits: 10_000,
                debt_limit_millicredits: 0,
                min_reputation: 0.0,
                new_peers_on_credit_per_day: 2,
            },
            Misbehaviour::default(),
        )
        .expect("open");
        // The first new id may use its whole allowance, the second half of it.
        let first = PeerId::random();
        accounts.admit(&first, 0, 10_000, None).expect("first");
        let second = PeerId::random();
        assert!(accounts.admit(&second, 0, 10_000, None).is_err());
        accounts
            .admit(&second, 0, 5_000, None)
            .expect("second, half");
        // Then fresh ids get nothing, however many are made.
        for _ in 0..50 {
            let sybil = PeerId::random();
            let err = accounts.admit(&sybil, 0, 1, None).expect_err("sybil");
            assert_eq!(err.code, RejectCode::DebtLimit);
        }
        // The first keeps its share; a team's allowance is not limited this way.
        accounts
            .admit(&first, 0, 10_000, None)
            .expect("first again");
        accounts
            .admit(&PeerId::random(), 0, 10_000, Some(10_000))
            .expect("a team member");
    }

    #[test]
    fn refused_receipts_are_bounded_oldest_first() {
        let mut r = RefusedReceipts::default();
        for i in 0..(MAX_REFUSED_KEPT + 10) as u32 {
            let mut id = [0u8; 16];
            id[..4].copy_from_slice(&i.to_le_bytes());
            r.insert(LeaseId(id), format!("why {i}"));
        }
        assert_eq!(r.why.len(), MAX_REFUSED_KEPT);
        assert_eq!(r.get(&LeaseId([0; 16])), None, "the oldest went first");
        let mut last = [0u8; 16];
        last[..4].copy_from_slice(&((MAX_REFUSED_KEPT + 9) as u32).to_le_bytes());
        assert!(r.get(&LeaseId(last)).is_some());
    }
}
