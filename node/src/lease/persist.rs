//! Leases, spent nonces and fair-share usage in the store, so they survive restarts.

use gpunode_protocol::encoding;
use gpunode_protocol::time::UnixMillis;
use gpunode_protocol::PeerId;

use super::book::{Change, LeaseBook, LeaseRecord};
use super::desk::FairShareEntry;
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

/// Store tree of fair-share usage, by user.
const FAIR_SHARE: &str = "fair_share";

/// Writes `changes` taken from `book` (durable after the next flush).
pub fn write(store: &Store, book: &LeaseBook, changes: &[Change]) -> Result<(), StoreError> {
    for change in changes {
        match change {
            Change::Lease(id) => {
                if let Some(record) = book.get(id) {
                    store.put(LEASES, &id.0, &encoding::encode(record))?;
                }
            }
            Change::Nonce(peer, nonce, until) => {
                store.put(NONCES, &nonce_key(peer, *nonce), &until.to_be_bytes())?;
            }
            Change::ForgetNonce(peer, nonce) => store.remove(NONCES, &nonce_key(peer, *nonce))?,
            Change::ForgetLease(id) => store.remove(LEASES, &id.0)?,
        }
    }
    Ok(())
}

/// Writes one user's fair-share usage (`None`: forgets it).
pub fn write_fair_share(
    store: &Store,
    user: &str,
    entry: Option<&FairShareEntry>,
) -> Result<(), StoreError> {
    match entry {
        Some(entry) => store.put(FAIR_SHARE, user.as_bytes(), &encoding::encode(entry)),
        None => store.remove(FAIR_SHARE, user.as_bytes()),
    }
}

/// Every user's stored fair-share usage; entries that do not decode are skipped.
pub fn load_fair_share(store: &Store) -> Vec<(String, FairShareEntry)> {
    let mut out = Vec::new();
    for (k, v) in store.scan(FAIR_SHARE).unwrap_or_default() {
        if let (Ok(user), Ok(entry)) = (
            String::from_utf8(k),
            encoding::decode::<FairShareEntry>(&v, 64),
        ) {
            out.push((user, entry));
        }
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::desk::FAIR_SHARE_HALF_LIFE_MS;
    use gpunode_sched::FairShare;

    #[test]
    fn fair_share_usage_survives_a_restart() {
        let dir = tempfile::tempdir().expect("tmp");
        let now = 1_800_000_000_000;
        {
            let store = Store::open(dir.path()).expect("store");
            let mut fair = FairShare::new(FAIR_SHARE_HALF_LIFE_MS);
            let mut charge = |user: &str, gpu_ms: f64| {
                fair.charge(user, gpu_ms, now);
                write_fair_share(&store, user, fair.entry(user).as_ref()).expect("write");
            };
            charge("heavy", 3_600_000.0 * 8.0);
            charge("light", 1_000.0);
            // Given back entirely: nothing left to keep.
            charge("light", -1_000.0);
            store.flush().expect("flush");
        }
        let store = Store::open(dir.path()).expect("reopen");
        let mut fair = FairShare::new(FAIR_SHARE_HALF_LIFE_MS);
        for (user, (usage, at)) in load_fair_share(&store) {
            fair.restore(&user, usage, at);
        }
        assert!((fair.usage_gpu_ms("heavy", now) - 28_800_000.0).abs() < 1e-3);
        assert_eq!(fair.usage_gpu_ms("light", now), 0.0);
    }
}
