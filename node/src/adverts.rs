//! Adverts on the node side: building and signing our own, and the advert book that
//! checks everyone else's (signature, expiry, and sequence numbers against what we saw).

use std::collections::HashMap;
use std::sync::Arc;

use gpunode_protocol::advert::{verify_advert, Advert, AdvertError, AdvertGpu, ADVERT_VERSION};
use gpunode_protocol::time::UnixMillis;
use gpunode_protocol::PeerId;

use crate::inventory::InventorySnapshot;
use crate::metrics::Metrics;

/// Most adverts the book remembers; expired ones are dropped first when it is full.
const MAX_BOOK_ENTRIES: usize = 20_000;

/// Remembers the newest valid advert of every publisher and refuses the rest.
#[derive(Debug)]
pub struct AdvertBook {
    latest: HashMap<PeerId, Advert>,
    metrics: Arc<Metrics>,
}

impl AdvertBook {
    /// An empty book that counts into `metrics`.
    pub fn new(metrics: Arc<Metrics>) -> AdvertBook {
        AdvertBook {
            latest: HashMap::new(),
            metrics,
        }
    }

    /// Checks a record published under `publisher`'s advert key. Valid and not older
    /// than what we know: remembered and returned. Anything else: counted and refused.
    pub fn accept(
        &mut self,
        bytes: &[u8],
        publisher: &PeerId,
        now: UnixMillis,
    ) -> Result<Advert, AdvertError> {
        let result = verify_advert(bytes, publisher, now).and_then(|advert| {
            match self.latest.get(publisher) {
                Some(known) if advert.seq < known.seq => Err(AdvertError::Stale {
                    got: advert.seq,
                    known: known.seq,
                }),
                _ => Ok(advert),
            }
        });
        match &result {
            Ok(advert) => {
                self.metrics.adverts_received.inc();
                if self.latest.len() >= MAX_BOOK_ENTRIES {
                    self.latest.retain(|_, a| a.expires_at_ms > now);
                }
                if self.latest.len() < MAX_BOOK_ENTRIES {
                    self.latest.insert(*publisher, advert.clone());
                }
            }
            Err(e) => {
                tracing::debug!(%publisher, "advert refused: {e}");
                self.metrics.advert_rejected(e.reason());
            }
        }
        result
    }
}

impl AdvertBook {
    /// The newest valid advert seen from `publisher`, if it has not expired.
    pub fn latest(&self, publisher: &PeerId, now: UnixMillis) -> Option<&Advert> {
        self.latest.get(publisher).filter(|a| a.expires_at_ms > now)
    }
}

/// What this node offers, from its inventory and configuration.
#[derive(Debug, Clone)]
pub struct LocalOffer {
    /// CPU cores offered.
    pub cpu_cores: u32,
    /// RAM offered in bytes.
    pub ram_bytes: u64,
    /// Executors offered.
    pub backends: Vec<String>,
    /// Price per GPU-hour in thousandths of a credit.
    pub price_per_gpu_hour_millicredits: u64,
}

impl LocalOffer {
    /// Builds the advert body for the current inventory.
    pub fn advert(
        &self,
        publisher: PeerId,
        stamp: &AdvertStamp,
        inventory: &InventorySnapshot,
        listen_addrs: Vec<String>,
        reserved: &std::collections::BTreeMap<String, Vec<(UnixMillis, UnixMillis)>>,
    ) -> Advert {
        Advert {
            version: ADVERT_VERSION,
            publisher,
            seq: stamp.seq,
            issued_at_ms: stamp.issued_at_ms,
            expires_at_ms: stamp.issued_at_ms + stamp.ttl_ms,
            gpus: inventory
                .gpus
                .iter()
                .map(|g| AdvertGpu {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    model: g.name.clone(),
                    memory_bytes: g.memory_total_bytes,
                    state: g.state,
                    mig_enabled: g.mig_enabled.unwrap_or(false),
                    compute_capability: g.compute_capability,
                    reserved: reserved.get(&g.uuid).cloned().unwrap_or_default(),
                })
                .collect(),
            cpu_cores: self.cpu_cores,
            ram_bytes: self.ram_bytes,
            backends: self.backends.clone(),
            price_per_gpu_hour_millicredits: self.price_per_gpu_hour_millicredits,
            listen_addrs,
            simulated: inventory.simulated(),
            withdrawn: stamp.withdrawn,
        }
    }
}

/// When and in what order an advert is issued.
#[derive(Debug, Clone, Copy)]
pub struct AdvertStamp {
    /// Sequence number.
    pub seq: u64,
    /// Signing time.
    pub issued_at_ms: UnixMillis,
    /// Lifetime.
    pub ttl_ms: u64,
    /// A withdrawal rather than an offer.
    pub withdrawn: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpunode_protocol::Keypair;

    fn advert(key: &Keypair, seq: u64, now: UnixMillis) -> Vec<u8> {
        let offer = LocalOffer {
            cpu_cores: 4,
            ram_bytes: 1 << 30,
            backends: vec!["wasm".into()],
            price_per_gpu_hour_millicredits: 1000,
        };
        let inv = InventorySnapshot {
            gpus: vec![],
            driver_version: None,
            source: "none".into(),
        };
        offer
            .advert(
                key.public().to_peer_id(),
                &AdvertStamp {
                    seq,
                    issued_at_ms: now,
                    ttl_ms: 60_000,
                    withdrawn: false,
                },
                &inv,
                vec![],
                &Default::default(),
            )
            .sign(key)
            .expect("sign")
    }

    #[test]
    fn lower_sequence_is_refused_and_counted() {
        let metrics = Metrics::new();
        let mut book = AdvertBook::new(metrics.clone());
        let k = Keypair::generate_ed25519();
        let p = k.public().to_peer_id();
        let now = 1_800_000_000_000;
        assert!(book.accept(&advert(&k, 5, now), &p, now).is_ok());
        let err = book.accept(&advert(&k, 4, now), &p, now).unwrap_err();
        assert_eq!(err, AdvertError::Stale { got: 4, known: 5 });
        assert_eq!(metrics.rejected_count("stale"), 1);
        // Same sequence again (re-publication) is fine; a newer one replaces it.
        assert!(book.accept(&advert(&k, 5, now), &p, now).is_ok());
        assert!(book.accept(&advert(&k, 6, now), &p, now).is_ok());
        assert!(book.accept(b"junk", &p, now).is_err());
        assert_eq!(metrics.rejected_count("malformed"), 1);
        assert!(metrics
            .encode()
            .contains("gpunode_adverts_rejected_total{reason=\"stale\"} 1"));
    }
}
