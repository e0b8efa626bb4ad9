//! Reputation: a local score per peer from what it did, fading with time.
//!
//! Each outcome adds evidence: good evidence `g` or bad evidence `b`, with a weight.
//! Evidence halves every [`HALF_LIFE_MS`] (one week), so old behaviour fades and a peer
//! can earn its way back. The score is the mean of a Beta(g+1, b+1) distribution:
//!
//! ```text
//! score = (g + 1) / (g + b + 2)        0..1; a peer we know nothing about scores 0.5
//! ```
//!
//! | outcome                         | evidence |
//! |---------------------------------|----------|
//! | job done for us                 | good 1   |
//! | receipt countersigned by it     | good 0.5 |
//! | job failed (peer lost, errors)  | bad 1    |
//! | timed out (stopped answering)   | bad 1    |
//! | job stopped by the provider     | bad 1    |
//! | disputed receipt                | bad 4    |
//! | replica mismatch                | bad 4    |
//!
//! Scores rank providers for `gpunode run` and gate admission on the provider side
//! (`min_reputation`). The records live in the store; they are written with the next
//! flush (losing the last few on a crash costs nothing that matters).

use std::collections::HashMap;
use std::sync::Mutex;

use gpunode_protocol::encoding;
use gpunode_protocol::time::{now_ms, UnixMillis};
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

use gpunode_store::Store;

/// Evidence halves in this time.
pub const HALF_LIFE_MS: u64 = 7 * 24 * 3600 * 1000;
const TREE: &str = "reputation";

/// Something a peer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// It ran a job for us to the end.
    JobDone,
    /// It countersigned our receipt.
    Settled,
    /// A job on it failed (connection lost, provider error).
    Failed,
    /// It stopped answering.
    TimedOut,
    /// It stopped our job before the end, unasked.
    CancelledByProvider,
    /// It sent a receipt we refused, or refused ours.
    DisputedReceipt,
    /// Its outputs disagreed with the other replicas'.
    ReplicaMismatch,
}

impl Outcome {
    /// (good, bad) evidence this outcome adds.
    fn evidence(self) -> (f64, f64) {
        match self {
            Outcome::JobDone => (1.0, 0.0),
            Outcome::Settled => (0.5, 0.0),
            Outcome::Failed | Outcome::TimedOut | Outcome::CancelledByProvider => (0.0, 1.0),
            Outcome::DisputedReceipt | Outcome::ReplicaMismatch => (0.0, 4.0),
        }
    }
}

/// What we know of one peer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct PeerRecord {
    /// Good evidence as of `updated_ms`.
    pub good: f64,
    /// Bad evidence as of `updated_ms`.
    pub bad: f64,
    /// When the evidence was last updated.
    pub updated_ms: UnixMillis,
    /// Jobs it ran for us to the end.
    pub jobs_done: u64,
    /// Receipts of ours it countersigned.
    pub settled: u64,
    /// Jobs that failed on it.
    pub failures: u64,
    /// Times it stopped answering.
    pub timeouts: u64,
    /// Jobs it stopped unasked.
    pub cancelled_by_provider: u64,
    /// Disputed receipts, either way.
    pub disputes: u64,
    /// Replica mismatches.
    pub mismatches: u64,
}

fn decay(value: f64, since: UnixMillis, now: UnixMillis) -> f64 {
    let dt = now.saturating_sub(since) as f64;
    value * 0.5f64.powf(dt / HALF_LIFE_MS as f64)
}

impl PeerRecord {
    /// The score at `now`.
    pub fn score(&self, now: UnixMillis) -> f64 {
        let g = decay(self.good, self.updated_ms, now);
        let b = decay(self.bad, self.updated_ms, now);
        (g + 1.0) / (g + b + 2.0)
    }

    /// Adds an outcome at `now`.
    pub fn add(&mut self, outcome: Outcome, now: UnixMillis) {
        let (g, b) = outcome.evidence();
        self.good = decay(self.good, self.updated_ms, now) + g;
        self.bad = decay(self.bad, self.updated_ms, now) + b;
        self.updated_ms = now.max(self.updated_ms);
        match outcome {
            Outcome::JobDone => self.jobs_done += 1,
            Outcome::Settled => self.settled += 1,
            Outcome::Failed => self.failures += 1,
            Outcome::TimedOut => self.timeouts += 1,
            Outcome::CancelledByProvider => self.cancelled_by_provider += 1,
            Outcome::DisputedReceipt => self.disputes += 1,
            Outcome::ReplicaMismatch => self.mismatches += 1,
        }
    }
}

/// Score of a peer we have no record of.
pub const NEUTRAL: f64 = 0.5;

/// Most peers whose reputation is kept.
pub const MAX_REPUTATION_RECORDS: usize = 100_000;

/// Every peer's record.
pub struct Reputation {
    store: Store,
    peers: Mutex<HashMap<PeerId, PeerRecord>>,
    max_records: usize,
}

impl std::fmt::Debug for Reputation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reputation").finish_non_exhaustive()
    }
}

impl Reputation {
    /// Loads the records from the store.
    pub fn open(store: Store) -> Result<Reputation, gpunode_store::StoreError> {
        let mut peers = HashMap::new();
        for (k, v) in store.scan(TREE)? {
            match (
                PeerId::from_bytes(&k),
                encoding::decode::<PeerRecord>(&v, 1024),
            ) {
                (Ok(p), Ok(r)) => {
                    peers.insert(p, r);
                }
                _ => tracing::warn!("skipping an unreadable reputation record"),
            }
        }
        Ok(Reputation {
            store,
            peers: Mutex::new(peers),
            max_records: MAX_REPUTATION_RECORDS,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PeerId, PeerRecord>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records what `peer` did.
    pub fn record(&self, peer: PeerId, outcome: Outcome) {
        self.record_at(peer, outcome, now_ms());
    }

    /// [`Reputation::record`] at `now`. Past [`MAX_REPUTATION_RECORDS`] peers, the
    /// oldest record that is not below neutral is forgotten first, so that a flood of
    /// fresh ids can neither grow the table without bound nor wash a bad record away.
    pub fn record_at(&self, peer: PeerId, outcome: Outcome, now: UnixMillis) {
        let (record, evicted) = {
            let mut peers = self.lock();
            let evicted = if !peers.contains_key(&peer) && peers.len() >= self.max_records {
                let victim = peers
                    .iter()
                    .min_by_key(|(_, r)| (r.score(now) < NEUTRAL, r.updated_ms))
                    .map(|(p, _)| *p);
                victim.inspect(|p| {
                    peers.remove(p);
                })
            } else {
                None
            };
            let r = peers.entry(peer).or_default();
            r.add(outcome, now);
            (r.clone(), evicted)
        };
        if let Some(p) = evicted {
            if let Err(e) = self.store.remove(TREE, &p.to_bytes()) {
                tracing::warn!("cannot forget the reputation of {p}: {e}");
            }
        }
        tracing::debug!(%peer, ?outcome, score = record.score(now), "reputation");
        if let Err(e) = self
            .store
            .put(TREE, &peer.to_bytes(), &encoding::encode(&record))
        {
            tracing::warn!("cannot store reputation of {peer}: {e}");
        }
    }

    /// A peer's score now.
    pub fn score(&self, peer: &PeerId) -> f64 {
        self.lock().get(peer).map_or(NEUTRAL, |r| r.score(now_ms()))
    }

    /// Peers with a record.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no peer has a record.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Every peer's record.
    pub fn all(&self) -> HashMap<PeerId, PeerRecord> {
        self.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_fresh_ids_is_bounded_and_cannot_wash_a_bad_record() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = Store::open(dir.path()).expect("store");
        let mut rep = Reputation::open(store).expect("open");
        rep.max_records = 8;
        let cheat = PeerId::random();
        let now = 1_800_000_000_000;
        for _ in 0..3 {
            rep.record_at(cheat, Outcome::DisputedReceipt, now);
        }
        let bad = rep.score(&cheat);
        assert!(bad < NEUTRAL);
        // Fresh ids, each with one good outcome, later than the cheat's record.
        for i in 0..100 {
            rep.record_at(PeerId::random(), Outcome::JobDone, now + 1 + i);
        }
        assert_eq!(rep.all().len(), 8, "bounded");
        assert!(rep.all().contains_key(&cheat), "the bad record stays");
        assert!(rep.score(&cheat) < NEUTRAL);
    }

    #[test]
    fn unknown_is_neutral_and_outcomes_move_the_score() {
        let mut r = PeerRecord::default();
        assert_eq!(r.score(0), NEUTRAL);
        r.add(Outcome::JobDone, 0);
        let after_good = r.score(0);
        assert!(after_good > NEUTRAL);
        r.add(Outcome::DisputedReceipt, 0);
        assert!(r.score(0) < after_good);
        assert_eq!(r.jobs_done, 1);
        assert_eq!(r.disputes, 1);
        // (1 + 1) / (1 + 4 + 2): one cheat outweighs a good job, below the ranking floor.
        assert!((r.score(0) - 2.0 / 7.0).abs() < 1e-9);
    }

    #[test]
    fn evidence_halves_each_half_life_and_fades_to_neutral() {
        let mut r = PeerRecord::default();
        for _ in 0..4 {
            r.add(Outcome::ReplicaMismatch, 0);
        }
        let bad_now = r.score(0);
        assert!((bad_now - 1.0 / 18.0).abs() < 1e-9);
        // One half-life later the 16 units of bad evidence count as 8.
        let later = r.score(HALF_LIFE_MS);
        assert!((later - 1.0 / 10.0).abs() < 1e-9, "{later}");
        assert!((r.score(50 * HALF_LIFE_MS) - NEUTRAL).abs() < 1e-6);
        // New evidence is added on top of the decayed old one.
        r.add(Outcome::JobDone, HALF_LIFE_MS);
        assert!((r.good - 1.0).abs() < 1e-9 && (r.bad - 8.0).abs() < 1e-9);
    }

    #[test]
    fn records_survive_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let peer = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        {
            let store = Store::open(dir.path()).expect("open");
            let rep = Reputation::open(store.clone()).expect("rep");
            rep.record(peer, Outcome::Failed);
            store.flush().expect("flush");
        }
        let rep = Reputation::open(Store::open(dir.path()).expect("reopen")).expect("rep");
        assert_eq!(rep.all()[&peer].failures, 1);
        assert!(rep.score(&peer) < NEUTRAL);
    }
}
