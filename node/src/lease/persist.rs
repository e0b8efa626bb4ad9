//! Leases and spent nonces in the store, so both survive restarts.

use gpunode_protocol::encoding;
use gpunode_protocol::lease::LeaseId;
use gpunode_protocol::time::UnixMillis;
use gpunode_protocol::PeerId;

use super::book::{Change, LeaseBook, LeaseRecord};
use crate::store::{Store, StoreError};

const LEASES: &str = "leases";
const NONCES: &str = "lease_nonces";
const MAX_RECORD_BYTES: usize = 1 << 20;

/// A nonce a peer used, remembered until the given time.
pub type SpentNonce = (PeerId, u64, UnixMillis);

fn nonce_key(peer: &PeerId, nonce: u64) -> Vec<u8> {
    let mut k = nonce.to_be_bytes().to_vec();
    k.extend_from_slice(&peer.to_bytes());
    k
}

/// Writes the book's pending changes (durable after the next flush). Returns the
/// leases among them that no longer hold resources (ended, cancelled, failed).
pub fn write_changes(store: &Store, book: &mut LeaseBook) -> Result<Vec<LeaseId>, StoreError> {
    let changes = book.take_changes();
    let mut ended = Vec::new();
    for change in &changes {
        match change {
            Change::Lease(id) => {
                if let Some(record) = book.get(id) {
                    store.put(LEASES, &id.0, &encoding::encode(record))?;
                    if !record.state.holds_resources() {
                        ended.push(*id);
                    }
                }
            }
            Change::Nonce(peer, nonce, until) => {
                store.put(NONCES, &nonce_key(peer, *nonce), &until.to_be_bytes())?;
            }
            Change::ForgetNonce(peer, nonce) => store.remove(NONCES, &nonce_key(peer, *nonce))?,
            Change::ForgetLease(id) => store.remove(LEASES, &id.0)?,
        }
    }
    Ok(ended)
}

/// Every stored lease and nonce. Entries that do not decode are skipped with a warning
/// (and left in place for inspection).
pub fn load(store: &Store) -> Result<(Vec<LeaseRecord>, Vec<SpentNonce>), StoreError> {
    let mut leases = Vec::new();
    for (k, v) in store.scan(LEASES)? {
        match encoding::decode::<LeaseRecord>(&v, MAX_RECORD_BYTES) {
            Ok(r) => leases.push(r),
            Err(e) => tracing::warn!("skipping unreadable lease record {k:02x?}: {e}"),
        }
    }
    let mut nonces = Vec::new();
    for (k, v) in store.scan(NONCES)? {
        let parsed = (k.len() > 8 && v.len() == 8)
            .then(|| {
                let nonce = u64::from_be_bytes(k[..8].try_into().ok()?);
                let peer = PeerId::from_bytes(&k[8..]).ok()?;
                let until = u64::from_be_bytes(v[..].try_into().ok()?);
                Some((peer, nonce, until))
            })
            .flatten();
        match parsed {
            Some(n) => nonces.push(n),
            None => tracing::warn!("skipping unreadable nonce entry"),
        }
    }
    Ok((leases, nonces))
}
