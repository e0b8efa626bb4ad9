//! The credit ledger: every settled usage receipt, in a hash chain in the store, with the
//! per-peer balances derived from it; reputation of peers; usage meters; the limit on
//! strangers drawing credit. It uses `gpunode-protocol` and `gpunode-store`, never the
//! node: settlement on the network and the admission rules live in the node's
//! `ledger` module, which builds on this crate.
//!
//! Writes go through one writer task ([`LedgerWriter`]) that takes whatever receipts are
//! waiting, appends them in one atomic store batch together with the new signed head and
//! the updated balances, flushes once, and only then answers every caller (group commit:
//! a receipt is acknowledged to a peer only after it is on disk, and a crash leaves
//! either the whole batch or none of it). [`chain`] defines entries and checks a chain;
//! [`reputation`] scores peers; [`meter`] records usage per lease; [`newcomers`] bounds
//! the strangers that draw on the allowance each day.

pub mod chain;
pub mod meter;
pub mod newcomers;
pub mod reputation;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpunode_protocol::encoding;
use gpunode_protocol::lease::LeaseId;
use gpunode_protocol::receipt::SettledReceipt;
use gpunode_protocol::time::now_ms;
use libp2p::identity::Keypair;
use libp2p::PeerId;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};

use chain::{ChainHead, Entry, PeerAccount, VerifyReport};
use gpunode_store::{Store, StoreError};

/// The store tree of the ledger.
const TREE: &str = "ledger";
/// Receipts per write batch, at most.
const MAX_BATCH: usize = 2048;

/// Why a receipt was not recorded.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum LedgerError {
    /// The lease was settled before with a different receipt.
    #[error("lease {lease} was already settled (ledger entry {seq}) with a different receipt")]
    Duplicate {
        /// The lease.
        lease: LeaseId,
        /// Its entry.
        seq: u64,
    },
    /// The store failed; nothing was written.
    #[error("ledger store: {0}")]
    Store(String),
    /// The node is stopping.
    #[error("the ledger is closed")]
    Closed,
    /// A ledger task stopped before it answered.
    #[error("the ledger task failed: {0}")]
    Task(String),
}

impl From<StoreError> for LedgerError {
    fn from(e: StoreError) -> Self {
        LedgerError::Store(e.to_string())
    }
}

/// Where a recorded receipt stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Appended as this entry.
    New(u64),
    /// The same receipt was already there, as this entry.
    AlreadyThere(u64),
}

impl Recorded {
    /// The entry's sequence number.
    pub fn seq(self) -> u64 {
        match self {
            Recorded::New(s) | Recorded::AlreadyThere(s) => s,
        }
    }
}

struct Write {
    receipts: Vec<SettledReceipt>,
    reply: oneshot::Sender<Vec<Result<Recorded, LedgerError>>>,
}

#[derive(Default)]
struct State {
    head: ChainHead,
    accounts: HashMap<PeerId, PeerAccount>,
}

/// A ledger entry as shown to users.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EntryView {
    /// Position.
    pub seq: u64,
    /// The lease.
    pub lease_id: String,
    /// `earned` (we provided) or `spent` (we used).
    pub direction: String,
    /// The other party.
    pub peer: String,
    /// Credits.
    pub amount: f64,
    /// Billed run time, seconds.
    pub billed_seconds: f64,
    /// GPU-seconds (measured where the provider could, else leased GPU time).
    pub gpu_seconds: f64,
    /// Most GPU memory the lease's jobs held at once, bytes (0: not measured).
    #[serde(default)]
    pub peak_gpu_memory_bytes: u64,
    /// CPU-seconds.
    pub cpu_seconds: f64,
    /// Jobs under the lease.
    pub jobs: u32,
    /// How the last job ended.
    pub exit_status: String,
    /// Lease start and end, unix ms.
    pub start_ms: u64,
    /// Lease end, unix ms.
    pub end_ms: u64,
    /// Price, credits per GPU-hour.
    pub price_per_gpu_hour: f64,
    /// Output digest, hex.
    pub output_digest: String,
    /// When it was written here, unix ms.
    pub recorded_ms: u64,
    /// This entry's hash, hex.
    pub hash: String,
    /// The previous entry's hash, hex.
    pub prev: String,
}

/// Millicredits to credits.
pub fn credits(millicredits: impl Into<i128>) -> f64 {
    millicredits.into() as f64 / 1000.0
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl EntryView {
    fn new(local: &PeerId, e: &Entry, hash: &[u8]) -> EntryView {
        let r = &e.receipt.receipt;
        let (direction, peer) = if r.provider == *local {
            ("earned", r.requester)
        } else {
            ("spent", r.provider)
        };
        EntryView {
            seq: e.seq,
            lease_id: r.lease_id.to_string(),
            direction: direction.into(),
            peer: peer.to_string(),
            amount: credits(r.amount_millicredits),
            billed_seconds: r.billed_ms as f64 / 1000.0,
            gpu_seconds: r.gpu_ms as f64 / 1000.0,
            peak_gpu_memory_bytes: r.peak_gpu_memory_bytes,
            cpu_seconds: r.cpu_ms as f64 / 1000.0,
            jobs: r.jobs,
            exit_status: r.exit_status.clone(),
            start_ms: r.start_ms,
            end_ms: r.end_ms,
            price_per_gpu_hour: credits(r.price_per_gpu_hour_millicredits),
            output_digest: hex(&r.output_digest),
            recorded_ms: e.recorded_ms,
            hash: hex(hash),
            prev: hex(&e.prev),
        }
    }
}

/// The ledger of one node.
pub struct Ledger {
    store: Store,
    local: PeerId,
    keypair: Keypair,
    /// The head and balances as last made durable. Read on the node's event loop (credit
    /// checks), so never held across a write to the store.
    state: Mutex<State>,
    /// Held by a commit from start to end (write and publish), and by a check that must
    /// see no commit half done.
    writing: Mutex<()>,
    writes: mpsc::Sender<Write>,
    /// Bumped after every committed batch.
    committed: watch::Sender<u64>,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("local", &self.local)
            .finish()
    }
}

/// The task that writes the ledger; run it with `tokio::spawn(writer.run())`.
pub struct LedgerWriter {
    ledger: Arc<Ledger>,
    rx: mpsc::Receiver<Write>,
}

fn entry_key(seq: u64) -> Vec<u8> {
    let mut k = vec![b'e'];
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

fn lease_key(lease: &LeaseId) -> Vec<u8> {
    let mut k = vec![b'l'];
    k.extend_from_slice(&lease.0);
    k
}

fn account_key(peer: &PeerId) -> Vec<u8> {
    let mut k = vec![b'a'];
    k.extend_from_slice(&peer.to_bytes());
    k
}

impl Ledger {
    /// Opens the ledger in `store`; the writer must be spawned for writes to happen.
    pub fn open(
        store: Store,
        keypair: Keypair,
    ) -> Result<(Arc<Ledger>, LedgerWriter), LedgerError> {
        let local = keypair.public().to_peer_id();
        let head = match store.get(TREE, b"h")? {
            Some(b) => encoding::decode(&b, 4096)
                .map_err(|e| LedgerError::Store(format!("ledger head does not decode: {e}")))?,
            None => ChainHead::default(),
        };
        let mut accounts = HashMap::new();
        for kv in store.iter_prefix(TREE, b"a")? {
            let (k, v) = kv?;
            let peer = PeerId::from_bytes(&k[1..])
                .map_err(|e| LedgerError::Store(format!("bad account key: {e}")))?;
            let account: PeerAccount = encoding::decode(&v, 1024)
                .map_err(|e| LedgerError::Store(format!("account does not decode: {e}")))?;
            accounts.insert(peer, account);
        }
        let (tx, rx) = mpsc::channel(4096);
        let ledger = Arc::new(Ledger {
            store,
            local,
            keypair,
            state: Mutex::new(State { head, accounts }),
            writing: Mutex::new(()),
            writes: tx,
            committed: watch::channel(0).0,
        });
        let writer = LedgerWriter {
            ledger: ledger.clone(),
            rx,
        };
        Ok((ledger, writer))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This node.
    pub fn local(&self) -> PeerId {
        self.local
    }

    /// Appends receipts (each once per lease) and returns when they are on disk.
    pub async fn record(
        &self,
        receipts: Vec<SettledReceipt>,
    ) -> Vec<Result<Recorded, LedgerError>> {
        let n = receipts.len();
        let (reply, rx) = oneshot::channel();
        if self.writes.send(Write { receipts, reply }).await.is_err() {
            return vec![Err(LedgerError::Closed); n];
        }
        rx.await
            .unwrap_or_else(|_| vec![Err(LedgerError::Closed); n])
    }

    /// The receipt that settled `lease`, with its entry number.
    pub fn settled(&self, lease: &LeaseId) -> Result<Option<(u64, SettledReceipt)>, LedgerError> {
        let Some(seq) = self.store.get(TREE, &lease_key(lease))? else {
            return Ok(None);
        };
        let seq = <[u8; 8]>::try_from(seq.as_slice())
            .map(u64::from_be_bytes)
            .map_err(|_| LedgerError::Store("bad lease index".into()))?;
        Ok(self.entry(seq)?.map(|e| (seq, e.receipt)))
    }

    /// Entry `seq`.
    pub fn entry(&self, seq: u64) -> Result<Option<Entry>, LedgerError> {
        match self.store.get(TREE, &entry_key(seq))? {
            Some(b) => Entry::decode(&b)
                .map(Some)
                .map_err(|e| LedgerError::Store(format!("entry {seq} does not decode: {e}"))),
            None => Ok(None),
        }
    }

    /// Waits until `lease` is settled here, at most `timeout`.
    pub async fn wait_settled(&self, lease: &LeaseId, timeout: Duration) -> Option<SettledReceipt> {
        let mut changes = self.committed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Ok(Some((_, r))) = self.settled(lease) {
                return Some(r);
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                _ => return None,
            }
        }
    }

    /// The signed head.
    pub fn head(&self) -> ChainHead {
        self.state().head.clone()
    }

    /// Per-peer accounts.
    pub fn accounts(&self) -> HashMap<PeerId, PeerAccount> {
        self.state().accounts.clone()
    }

    /// One peer's account.
    pub fn account(&self, peer: &PeerId) -> PeerAccount {
        self.state().accounts.get(peer).copied().unwrap_or_default()
    }

    /// Earned minus spent, millicredits.
    pub fn balance(&self) -> i128 {
        self.state()
            .accounts
            .values()
            .map(PeerAccount::balance)
            .sum()
    }

    /// The last `n` entries, newest first.
    pub fn recent(&self, n: usize) -> Result<Vec<EntryView>, LedgerError> {
        let head = self.head().seq;
        let mut out = Vec::new();
        let mut seq = head;
        while seq > 0 && out.len() < n {
            if let Some(e) = self.entry(seq)? {
                let hash = self.hash_of(seq)?;
                out.push(EntryView::new(&self.local, &e, &hash));
            }
            seq -= 1;
        }
        Ok(out)
    }

    fn hash_of(&self, seq: u64) -> Result<[u8; 32], LedgerError> {
        if seq == self.head().seq {
            return Ok(self.head().hash);
        }
        match self.entry(seq + 1)? {
            Some(next) => Ok(next.prev),
            None => Ok([0; 32]),
        }
    }

    /// Visits every entry in order, with its hash.
    pub fn for_each_entry(
        &self,
        f: impl FnMut(EntryView) -> std::io::Result<()>,
    ) -> Result<(), LedgerError> {
        self.for_each_entry_after(0, f)
    }

    /// Visits, in order, every entry after sequence number `seq` (the first is 1).
    pub fn for_each_entry_after(
        &self,
        seq: u64,
        mut f: impl FnMut(EntryView) -> std::io::Result<()>,
    ) -> Result<(), LedgerError> {
        let from = entry_key(seq.saturating_add(1));
        for kv in self.store.iter_prefix_from(TREE, b"e", &from)? {
            let (_, v) = kv?;
            let e = Entry::decode(&v)
                .map_err(|e| LedgerError::Store(format!("entry does not decode: {e}")))?;
            let hash = Entry::hash(&v);
            f(EntryView::new(&self.local, &e, &hash))
                .map_err(|e| LedgerError::Store(e.to_string()))?;
        }
        Ok(())
    }

    /// Checks the whole chain, every signature and the stored balances.
    pub fn verify(&self) -> Result<VerifyReport, LedgerError> {
        let (head, accounts) = {
            let s = self.state();
            (s.head.clone(), s.accounts.clone())
        };
        self.verify_up_to(&head, &accounts)
    }

    /// Checks the chain up to `head` against `accounts` (both read together), then that
    /// no entry lies past the ledger's current head. Settlement goes on while a check
    /// runs: entries the writer appends after `head` was read are left to the next
    /// check, not taken for entries added outside the node. Reading the current head
    /// waits for a commit in flight, so an entry past it was not written by the node.
    fn verify_up_to(
        &self,
        head: &ChainHead,
        accounts: &HashMap<PeerId, PeerAccount>,
    ) -> Result<VerifyReport, LedgerError> {
        let end = entry_key(head.seq.saturating_add(1));
        let entries = self
            .store
            .iter_prefix(TREE, b"e")?
            .take_while(move |e| e.as_ref().map_or(true, |(key, _)| *key < end));
        let mut report = chain::verify(&self.local, entries, head, accounts);
        if report.first_bad.is_none() {
            let _no_commit_half_done = self.writing.lock().unwrap_or_else(|p| p.into_inner());
            let current = self.state().head.seq;
            let past = entry_key(current.saturating_add(1));
            if let Some(first) = self.store.iter_prefix_from(TREE, b"e", &past)?.next() {
                let (key, _) = first?;
                let seq = key
                    .get(1..9)
                    .and_then(|b| <[u8; 8]>::try_from(b).ok())
                    .map_or(current.saturating_add(1), u64::from_be_bytes);
                report.first_bad = Some(chain::BadEntry {
                    seq,
                    reason: format!(
                        "entry {seq} lies past the signed head (entry {current}): it was added outside the node"
                    ),
                });
            }
        }
        Ok(report)
    }

    /// Appends a batch: duplicates are answered from the index, the rest become new
    /// entries; all of it, the head and the balances go to the store in one atomic,
    /// flushed write.
    fn commit(&self, receipts: &[SettledReceipt]) -> Vec<Result<Recorded, LedgerError>> {
        // Only the writer commits, one batch at a time, so the state read here is still
        // the state when this batch is published; the state lock is not held across the
        // durable write, which the event loop would otherwise wait out.
        let _writing = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        let (mut head, mut accounts) = {
            let state = self.state();
            (state.head.clone(), state.accounts.clone())
        };
        let mut touched = std::collections::HashSet::new();
        let mut in_batch: HashMap<LeaseId, (u64, &SettledReceipt)> = HashMap::new();
        let mut ops = Vec::new();
        let mut results = Vec::with_capacity(receipts.len());
        let now = now_ms();
        for r in receipts {
            let lease = r.receipt.lease_id;
            let existing = match in_batch.get(&lease) {
                Some((seq, prev)) => Some((*seq, (*prev).clone())),
                None => match self.settled(&lease) {
                    Ok(e) => e,
                    Err(e) => {
                        results.push(Err(e));
                        continue;
                    }
                },
            };
            if let Some((seq, prev)) = existing {
                results.push(if prev == *r {
                    Ok(Recorded::AlreadyThere(seq))
                } else {
                    Err(LedgerError::Duplicate { lease, seq })
                });
                continue;
            }
            let entry = Entry {
                seq: head.seq + 1,
                prev: head.hash,
                recorded_ms: now,
                receipt: r.clone(),
            };
            let bytes = encoding::encode(&entry);
            head.seq = entry.seq;
            head.hash = Entry::hash(&bytes);
            ops.push((entry_key(entry.seq), Some(bytes)));
            ops.push((lease_key(&lease), Some(entry.seq.to_be_bytes().to_vec())));
            PeerAccount::apply(&mut accounts, &self.local, r);
            let peer = if r.receipt.provider == self.local {
                r.receipt.requester
            } else {
                r.receipt.provider
            };
            touched.insert(peer);
            in_batch.insert(lease, (entry.seq, r));
            results.push(Ok(Recorded::New(entry.seq)));
        }
        if ops.is_empty() {
            return results;
        }
        let head = match ChainHead::signed(head.seq, head.hash, &self.keypair) {
            Ok(h) => h,
            Err(e) => return fail_new(results, LedgerError::Store(e)),
        };
        ops.push((b"h".to_vec(), Some(encoding::encode(&head))));
        for peer in &touched {
            let a = accounts.get(peer).copied().unwrap_or_default();
            ops.push((account_key(peer), Some(encoding::encode(&a))));
        }
        if let Err(e) = self.store.apply_durable(TREE, ops) {
            return fail_new(results, e.into());
        }
        {
            let mut state = self.state();
            state.head = head;
            state.accounts = accounts;
        }
        self.committed.send_modify(|n| *n += 1);
        results
    }
}

/// The batch failed: every receipt that would have been new is not recorded.
fn fail_new(
    results: Vec<Result<Recorded, LedgerError>>,
    error: LedgerError,
) -> Vec<Result<Recorded, LedgerError>> {
    results
        .into_iter()
        .map(|r| match r {
            Ok(Recorded::New(_)) => Err(error.clone()),
            other => other,
        })
        .collect()
}

impl LedgerWriter {
    /// Writes batches until `stop` turns true (what is queued by then is still written).
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        loop {
            let first = tokio::select! {
                w = self.rx.recv() => match w {
                    Some(w) => w,
                    None => return,
                },
                _ = stop.changed() => {
                    self.rx.close();
                    match self.rx.try_recv() {
                        Ok(w) => w,
                        Err(_) => return,
                    }
                }
            };
            let mut writes = vec![first];
            let mut count = writes[0].receipts.len();
            while count < MAX_BATCH {
                match self.rx.try_recv() {
                    Ok(w) => {
                        count += w.receipts.len();
                        writes.push(w);
                    }
                    Err(_) => break,
                }
            }
            let ledger = self.ledger.clone();
            let done = tokio::task::spawn_blocking(move || {
                let all: Vec<SettledReceipt> = writes
                    .iter()
                    .flat_map(|w| w.receipts.iter().cloned())
                    .collect();
                let mut results = ledger.commit(&all).into_iter();
                for w in writes {
                    let mine: Vec<_> = results.by_ref().take(w.receipts.len()).collect();
                    let _ = w.reply.send(mine);
                }
            })
            .await;
            if done.is_err() {
                tracing::error!("ledger writer failed");
            }
        }
    }
}

#[cfg(test)]
#[path = "ledger_tests.rs"]
mod tests;
