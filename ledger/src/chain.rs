//! The hash chain: ledger entries, their hashes, the signed head, and checking a whole
//! chain.
//!
//! Entry `n` holds the hash of entry `n-1` (entry 1 holds zeros) and a receipt signed by
//! both parties, one of them this node. After every write the node signs the head (the
//! last sequence number and hash), so nobody without its key can drop, reorder or edit
//! entries without `verify` noticing.

use std::collections::HashMap;

use gpunode_protocol::encoding;
use gpunode_protocol::receipt::{Digest, SettledReceipt, SettledReceiptV1, RECEIPT_SIGNING_TAG};
use gpunode_protocol::signing::{self, BatchItem};
use gpunode_protocol::time::UnixMillis;
use libp2p::identity::Keypair;
use libp2p::PeerId;
use serde::{Deserialize, Serialize};

/// Domain tag of the chain head signature.
pub const HEAD_SIGNING_TAG: &[u8] = b"gpunode/ledger-head/v1\0";
/// Domain tag of entry hashes.
const ENTRY_HASH_TAG: &[u8] = b"gpunode/ledger-entry/v1\0";
/// Largest stored entry we decode.
pub const MAX_ENTRY_BYTES: usize = 64 * 1024;
/// Entries checked per block (their signatures go to one parallel batch).
const VERIFY_BLOCK: usize = 16 * 1024;

/// One ledger entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Position, from 1.
    pub seq: u64,
    /// Hash of the entry before (zeros for the first).
    pub prev: Digest,
    /// When this node wrote it.
    pub recorded_ms: UnixMillis,
    /// The receipt with both signatures.
    pub receipt: SettledReceipt,
}

/// An entry as ledgers stored it before receipt format 2.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryV1 {
    /// Position, from 1.
    pub seq: u64,
    /// Hash of the entry before.
    pub prev: Digest,
    /// When it was written.
    pub recorded_ms: UnixMillis,
    /// The receipt (format 1) with both signatures.
    pub receipt: SettledReceiptV1,
}

impl Entry {
    /// Decodes a stored entry, whichever receipt format it holds (a format-1 entry keeps
    /// its version, so its signatures still check against its own bytes).
    pub fn decode(bytes: &[u8]) -> Result<Entry, encoding::DecodeError> {
        match encoding::decode::<Entry>(bytes, MAX_ENTRY_BYTES) {
            Ok(e) if e.receipt.receipt.version != 1 => Ok(e),
            current => match encoding::decode::<EntryV1>(bytes, MAX_ENTRY_BYTES) {
                Ok(old) => Ok(Entry {
                    seq: old.seq,
                    prev: old.prev,
                    recorded_ms: old.recorded_ms,
                    receipt: old.receipt.into(),
                }),
                Err(_) => current,
            },
        }
    }

    /// The entry's hash (what the next entry holds).
    pub fn hash(bytes: &[u8]) -> Digest {
        let mut h = blake3::Hasher::new();
        h.update(ENTRY_HASH_TAG);
        h.update(bytes);
        *h.finalize().as_bytes()
    }
}

/// The last entry's position and hash, signed by the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ChainHead {
    /// Last sequence number (0: empty).
    pub seq: u64,
    /// Last entry's hash (zeros: empty).
    pub hash: Digest,
    /// The node's signature over both.
    pub signature: Vec<u8>,
}

impl ChainHead {
    fn signed_bytes(seq: u64, hash: &Digest) -> Vec<u8> {
        let mut b = seq.to_le_bytes().to_vec();
        b.extend_from_slice(hash);
        b
    }

    /// A head for `seq` and `hash`, signed with `key`.
    pub fn signed(seq: u64, hash: Digest, key: &Keypair) -> Result<ChainHead, String> {
        let signature = signing::sign(key, HEAD_SIGNING_TAG, &Self::signed_bytes(seq, &hash))
            .map_err(|e| e.to_string())?;
        Ok(ChainHead {
            seq,
            hash,
            signature,
        })
    }

    /// Whether `signer` signed this head (an empty chain needs no signature).
    pub fn is_signed_by(&self, signer: &PeerId) -> bool {
        if self.seq == 0 && self.signature.is_empty() {
            return true;
        }
        gpunode_protocol::lease::public_key_of(signer).is_ok_and(|key| {
            signing::verify(
                &key,
                HEAD_SIGNING_TAG,
                &Self::signed_bytes(self.seq, &self.hash),
                &self.signature,
            )
            .is_ok()
        })
    }
}

/// What one side of a receipt means for this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PeerAccount {
    /// What we earned providing to this peer, millicredits.
    pub earned: u64,
    /// What we spent on this peer's resources, millicredits.
    pub spent: u64,
    /// Receipts settled as provider.
    pub as_provider: u64,
    /// Receipts settled as requester.
    pub as_requester: u64,
}

impl PeerAccount {
    /// Adds one receipt in which `local` is a party; returns the other party.
    pub fn apply(accounts: &mut HashMap<PeerId, PeerAccount>, local: &PeerId, r: &SettledReceipt) {
        let rec = &r.receipt;
        if rec.provider == *local {
            let a = accounts.entry(rec.requester).or_default();
            a.earned = a.earned.saturating_add(rec.amount_millicredits);
            a.as_provider += 1;
        } else {
            let a = accounts.entry(rec.provider).or_default();
            a.spent = a.spent.saturating_add(rec.amount_millicredits);
            a.as_requester += 1;
        }
    }

    /// Earned minus spent, millicredits.
    pub fn balance(&self) -> i128 {
        self.earned as i128 - self.spent as i128
    }
}

/// The result of checking a chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// Entries checked.
    pub entries: u64,
    /// Signatures checked.
    pub signatures: u64,
    /// The first bad entry and what is wrong with it; `None` when all is well.
    pub first_bad: Option<BadEntry>,
    /// Balance derived from the entries, millicredits.
    pub balance_millicredits: i128,
    /// Milliseconds the check took.
    pub took_ms: u64,
}

/// An entry that fails the check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadEntry {
    /// Its sequence number (or the head's, for a head problem).
    pub seq: u64,
    /// What is wrong.
    pub reason: String,
}

/// Checks a chain read in order from `entries` (raw key and value): sequence, hash
/// links, both signatures of every receipt, that this node is a party to each, that no
/// lease is counted twice and every amount follows from its billed time and price, then
/// the head and the stored per-peer accounts against the entries.
///
/// The calling thread only reads; blocks of entries are decoded, hashed and their
/// signatures batch-verified on all cores while the next block is read.
pub fn verify<I, E>(
    local: &PeerId,
    entries: I,
    head: &ChainHead,
    stored_accounts: &HashMap<PeerId, PeerAccount>,
) -> VerifyReport
where
    I: Iterator<Item = Result<(Vec<u8>, Vec<u8>), E>>,
    E: std::fmt::Display,
{
    let started = std::time::Instant::now();
    let (tx, rx) = std::sync::mpsc::sync_channel::<RawBlock>(2);
    let mut report = std::thread::scope(|s| {
        let checker = s.spawn(move || check_blocks(local, rx, head, stored_accounts));
        let mut block = Vec::with_capacity(VERIFY_BLOCK);
        for item in entries {
            match item {
                Ok(kv) => block.push(Ok(kv)),
                Err(e) => {
                    block.push(Err(format!("cannot read the entry: {e}")));
                    break;
                }
            }
            if block.len() == VERIFY_BLOCK {
                let full = std::mem::replace(&mut block, Vec::with_capacity(VERIFY_BLOCK));
                if tx.send(full).is_err() {
                    // The checker found a bad entry and stopped.
                    break;
                }
            }
        }
        if !block.is_empty() {
            let _ = tx.send(block);
        }
        drop(tx);
        checker.join().unwrap_or_else(|_| VerifyReport {
            entries: 0,
            signatures: 0,
            first_bad: Some(BadEntry {
                seq: 0,
                reason: "the check itself failed".into(),
            }),
            balance_millicredits: 0,
            took_ms: 0,
        })
    });
    report.took_ms = started.elapsed().as_millis() as u64;
    report
}

/// One raw entry as read (key, value), or why it could not be read.
type RawEntry = Result<(Vec<u8>, Vec<u8>), String>;
/// Raw entries as read.
type RawBlock = Vec<RawEntry>;

/// One entry after the parallel stage.
struct Decoded {
    key_seq: Option<u64>,
    entry: Result<Entry, String>,
    hash: Digest,
}

/// The sequential stage: links, parties, accounts, then head and balances.
fn check_blocks(
    local: &PeerId,
    blocks: std::sync::mpsc::Receiver<RawBlock>,
    head: &ChainHead,
    stored_accounts: &HashMap<PeerId, PeerAccount>,
) -> VerifyReport {
    let mut report = VerifyReport {
        entries: 0,
        signatures: 0,
        first_bad: None,
        balance_millicredits: 0,
        took_ms: 0,
    };
    let mut walk = ChainWalk {
        local,
        accounts: HashMap::new(),
        prev: [0; 32],
        expected_seq: 1,
        seen_leases: HashMap::new(),
    };
    let mut bad: Option<BadEntry> = None;
    'blocks: for block in blocks {
        let (decoded, bad_signature) = decode_and_verify(block);
        report.signatures += 2 * decoded.iter().filter(|d| d.entry.is_ok()).count() as u64;
        for (i, d) in decoded.into_iter().enumerate() {
            let bad_signature = bad_signature
                .as_ref()
                .filter(|(at, _)| *at == i)
                .map(|(_, reason)| reason.clone());
            if let Err(reason) = walk.step(d, bad_signature) {
                bad = Some(BadEntry {
                    seq: walk.expected_seq,
                    reason,
                });
                break 'blocks;
            }
            report.entries += 1;
        }
    }
    if bad.is_none() {
        bad = check_head_and_accounts(
            local,
            head,
            walk.expected_seq - 1,
            &walk.prev,
            &walk.accounts,
            stored_accounts,
        );
    }
    report.balance_millicredits = walk.accounts.values().map(PeerAccount::balance).sum();
    report.first_bad = bad;
    report
}

/// Where the sequential check of the chain stands: the accounts so far, the hash of the
/// last good entry, the sequence number expected next and the leases already counted.
struct ChainWalk<'a> {
    local: &'a PeerId,
    accounts: HashMap<PeerId, PeerAccount>,
    prev: Digest,
    expected_seq: u64,
    seen_leases: HashMap<gpunode_protocol::lease::LeaseId, u64>,
}

impl ChainWalk<'_> {
    /// Checks the next entry (its place, its link, its signatures, given as
    /// `bad_signature` when they failed, its parties, its lease and its amount) and
    /// applies it to the accounts; the reason when it is bad.
    fn step(&mut self, d: Decoded, bad_signature: Option<String>) -> Result<(), String> {
        let entry = d.entry?;
        let expected_seq = self.expected_seq;
        if entry.seq != expected_seq || d.key_seq != Some(entry.seq) {
            return Err(format!(
                "expected entry {expected_seq}, found entry {} (an entry is missing or out of place)",
                entry.seq
            ));
        }
        if entry.prev != self.prev {
            return Err(
                "its link to the entry before does not match (an earlier entry was altered)".into(),
            );
        }
        if let Some(reason) = bad_signature {
            return Err(reason);
        }
        let rec = &entry.receipt.receipt;
        if rec.provider != *self.local && rec.requester != *self.local {
            return Err("this node is not a party to its receipt".into());
        }
        if let Some(first) = self.seen_leases.insert(rec.lease_id, entry.seq) {
            return Err(format!(
                "lease {} is counted twice (also in entry {first})",
                rec.lease_id
            ));
        }
        let due = gpunode_protocol::receipt::amount_for(
            rec.price_per_gpu_hour_millicredits,
            rec.gpus,
            rec.billed_ms,
        );
        if rec.amount_millicredits != due {
            return Err(format!(
                "its amount {} does not follow from its billed time and price ({due})",
                rec.amount_millicredits
            ));
        }
        self.prev = d.hash;
        PeerAccount::apply(&mut self.accounts, self.local, &entry.receipt);
        self.expected_seq += 1;
        Ok(())
    }
}

/// The parallel stage: decode, hash and batch-verify a block on every core. Returns the
/// entries in order and the first entry (by position) whose signatures fail.
fn decode_and_verify(block: RawBlock) -> (Vec<Decoded>, Option<(usize, String)>) {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let per = block.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        let parts: Vec<_> = block
            .chunks(per)
            .enumerate()
            .map(|(p, part)| {
                s.spawn(move || {
                    let (decoded, bad) = decode_part(part);
                    (decoded, bad.map(|(i, r)| (p * per + i, r)))
                })
            })
            .collect();
        let mut all = Vec::with_capacity(block.len());
        let mut first_bad: Option<(usize, String)> = None;
        for part in parts {
            let (decoded, bad) = part.join().unwrap_or_default();
            all.extend(decoded);
            if first_bad.is_none() {
                first_bad = bad;
            }
        }
        (all, first_bad)
    })
}

fn decode_part(part: &[RawEntry]) -> (Vec<Decoded>, Option<(usize, String)>) {
    let mut decoded = Vec::with_capacity(part.len());
    let mut bodies = Vec::with_capacity(part.len());
    for raw in part {
        let d = match raw {
            Ok((key, value)) => Decoded {
                key_seq: key
                    .get(1..9)
                    .and_then(|b| <[u8; 8]>::try_from(b).ok())
                    .map(u64::from_be_bytes),
                entry: Entry::decode(value).map_err(|e| format!("entry does not decode: {e}")),
                hash: Entry::hash(value),
            },
            Err(reason) => Decoded {
                key_seq: None,
                entry: Err(reason.clone()),
                hash: [0; 32],
            },
        };
        bodies.push(
            d.entry
                .as_ref()
                .map(|e| e.receipt.receipt.canonical_bytes())
                .unwrap_or_default(),
        );
        decoded.push(d);
    }
    // Signatures of the entries that decoded (the others are reported as undecodable).
    let mut positions = Vec::with_capacity(decoded.len() * 2);
    let mut items = Vec::with_capacity(decoded.len() * 2);
    for (i, (d, body)) in decoded.iter().zip(&bodies).enumerate() {
        if let Ok(e) = &d.entry {
            let r = &e.receipt;
            for (signer, signature) in [
                (&r.receipt.provider, &r.provider_sig),
                (&r.receipt.requester, &r.requester_sig),
            ] {
                positions.push(i);
                items.push(BatchItem {
                    signer,
                    tag: RECEIPT_SIGNING_TAG,
                    body,
                    signature,
                });
            }
        }
    }
    let bad = signing::verify_batch_here(&items).err().map(|k| {
        let i = positions[k];
        let (who, peer) = if k % 2 == 0 {
            ("provider", items[k].signer)
        } else {
            ("requester", items[k].signer)
        };
        (i, format!("the {who}'s signature ({peer}) does not verify"))
    });
    (decoded, bad)
}

fn check_head_and_accounts(
    local: &PeerId,
    head: &ChainHead,
    last: u64,
    prev: &Digest,
    accounts: &HashMap<PeerId, PeerAccount>,
    stored_accounts: &HashMap<PeerId, PeerAccount>,
) -> Option<BadEntry> {
    if head.seq != last || head.hash != *prev {
        return Some(BadEntry {
            seq: head.seq.max(last),
            reason: format!(
                "the signed head names entry {} but the chain ends at entry {last} (entries were added or removed outside the node)",
                head.seq
            ),
        });
    }
    if !head.is_signed_by(local) {
        return Some(BadEntry {
            seq: head.seq,
            reason: "the head's signature does not verify".into(),
        });
    }
    let mut stored: Vec<_> = stored_accounts
        .iter()
        .filter(|(_, a)| **a != PeerAccount::default())
        .collect();
    let mut derived: Vec<_> = accounts.iter().collect();
    stored.sort_by_key(|(p, _)| p.to_bytes());
    derived.sort_by_key(|(p, _)| p.to_bytes());
    if stored != derived {
        return Some(BadEntry {
            seq: head.seq,
            reason: "stored balances differ from the balances the entries give".into(),
        });
    }
    None
}
