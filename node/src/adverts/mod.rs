//! Adverts on the node side: building and signing our own, and the advert book that
//! checks everyone else's (signature, expiry, and sequence numbers against what we saw).
//! [`fetch`] is the wire protocol that asks a provider for its advert directly.

pub mod fetch;

use std::collections::HashMap;
use std::sync::Arc;

use gpunode_protocol::advert::{
    check_advert_clock, verify_advert, Advert, AdvertError, AdvertGpu, ADVERT_VERSION,
};
use gpunode_protocol::time::UnixMillis;
use gpunode_protocol::PeerId;

use crate::inventory::InventorySnapshot;
use crate::metrics::Metrics;

/// Most adverts the book remembers; when it is full, expired ones go first, then the
/// oldest of the host with the most adverts.
const MAX_BOOK_ENTRIES: usize = 20_000;

/// Remembers the newest valid advert of every publisher and refuses the rest.
#[derive(Debug)]
pub struct AdvertBook {
    latest: HashMap<PeerId, Kept>,
    metrics: Arc<Metrics>,
    max_entries: usize,
}

/// A publisher's newest advert as the book keeps it: what it says, and a digest of the
/// signed bytes it came in. The same bytes again passed every check but the clock's when
/// they were kept, so their signature is not checked again (a requester fetches the
/// same adverts at every search until a provider's state changes).
#[derive(Debug)]
struct Kept {
    advert: Advert,
    signed: blake3::Hash,
}

/// The address an advert's publisher listens on first (its IP), what Sybil identities
/// of one machine share; "" when it names none.
fn host_of(advert: &Advert) -> String {
    advert
        .listen_addrs
        .iter()
        .filter_map(|a| a.split('/').nth(2))
        .next()
        .unwrap_or_default()
        .to_string()
}

impl AdvertBook {
    /// An empty book that counts into `metrics`.
    pub fn new(metrics: Arc<Metrics>) -> AdvertBook {
        AdvertBook {
            latest: HashMap::new(),
            metrics,
            max_entries: MAX_BOOK_ENTRIES,
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
        let signed = blake3::hash(bytes);
        let kept = self.latest.get(publisher);
        let same_bytes = kept.is_some_and(|k| k.signed == signed);
        let result = match kept {
            Some(kept) if same_bytes => {
                check_advert_clock(&kept.advert, now).map(|()| kept.advert.clone())
            }
            known => verify_advert(bytes, publisher, now).and_then(|advert| match known {
                Some(known) if advert.seq < known.advert.seq => Err(AdvertError::Stale {
                    got: advert.seq,
                    known: known.advert.seq,
                }),
                _ => Ok(advert),
            }),
        };
        match &result {
            Ok(_) if same_bytes => {
                self.metrics.adverts_received.inc();
            }
            Ok(advert) => {
                self.metrics.adverts_received.inc();
                if !self.latest.contains_key(publisher) && self.latest.len() >= self.max_entries {
                    self.latest.retain(|_, k| k.advert.expires_at_ms > now);
                    if self.latest.len() >= self.max_entries {
                        self.evict_from_largest_host();
                    }
                }
                self.latest.insert(
                    *publisher,
                    Kept {
                        advert: advert.clone(),
                        signed,
                    },
                );
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
    /// Makes room for one advert: the host (address) with the most adverts in the book
    /// loses its oldest one. Ids are free to make but addresses are not, so a flood of
    /// identities from one machine evicts itself, not everyone else.
    fn evict_from_largest_host(&mut self) {
        let mut per_host: HashMap<String, usize> = HashMap::new();
        for k in self.latest.values() {
            *per_host.entry(host_of(&k.advert)).or_default() += 1;
        }
        let Some(largest) = per_host.into_iter().max_by_key(|(_, n)| *n).map(|(h, _)| h) else {
            return;
        };
        let victim = self
            .latest
            .iter()
            .filter(|(_, k)| host_of(&k.advert) == largest)
            .min_by_key(|(_, k)| k.advert.issued_at_ms)
            .map(|(p, _)| *p);
        if let Some(p) = victim {
            self.latest.remove(&p);
        }
    }

    /// Adverts remembered.
    pub fn len(&self) -> usize {
        self.latest.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.latest.is_empty()
    }

    /// Every remembered advert that has not expired, in no order.
    pub fn current(&self, now: UnixMillis) -> impl Iterator<Item = &Advert> {
        self.latest
            .values()
            .map(|k| &k.advert)
            .filter(move |a| a.expires_at_ms > now)
    }

    /// The newest valid advert seen from `publisher`, if it has not expired.
    pub fn latest(&self, publisher: &PeerId, now: UnixMillis) -> Option<&Advert> {
        self.latest
            .get(publisher)
            .map(|k| &k.advert)
            .filter(|a| a.expires_at_ms > now)
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
        advert_at(key, seq, now, vec![])
    }

    fn advert_at(key: &Keypair, seq: u64, now: UnixMillis, addrs: Vec<String>) -> Vec<u8> {
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
                addrs,
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

    /// The same signed bytes again skip only the signature: the clock is checked again,
    /// and any other bytes (a flipped byte, the copy of another publisher, a new
    /// sequence number) are checked whole.
    #[test]
    fn an_advert_seen_before_is_checked_against_the_clock_and_nothing_else_passes_as_it() {
        let metrics = Metrics::new();
        let mut book = AdvertBook::new(metrics.clone());
        let k = Keypair::generate_ed25519();
        let p = k.public().to_peer_id();
        let now = 1_800_000_000_000;
        let bytes = advert(&k, 5, now);
        assert!(book.accept(&bytes, &p, now).is_ok());
        assert_eq!(book.accept(&bytes, &p, now + 1_000).map(|a| a.seq), Ok(5));

        // Expired meanwhile (adverts here live 60 s), or our clock went back far enough
        // that it was issued in the future.
        let expired = book.accept(&bytes, &p, now + 60_000).unwrap_err();
        assert!(
            matches!(expired, AdvertError::Expired { .. }),
            "{expired:?}"
        );
        let early = book.accept(&bytes, &p, now - 31_000).unwrap_err();
        assert!(matches!(early, AdvertError::FromFuture { .. }), "{early:?}");

        // A flipped byte, anywhere, is checked whole and refused.
        for i in [0, bytes.len() / 2, bytes.len() - 1] {
            let mut tampered = bytes.clone();
            tampered[i] ^= 1;
            assert!(book.accept(&tampered, &p, now).is_err(), "byte {i}");
        }
        // The same bytes under another publisher are checked whole and refused.
        let other = Keypair::generate_ed25519().public().to_peer_id();
        assert!(book.accept(&bytes, &other, now).is_err());
        // A lower sequence number is still stale, a higher one replaces the kept bytes.
        assert!(matches!(
            book.accept(&advert(&k, 4, now), &p, now),
            Err(AdvertError::Stale { got: 4, known: 5 })
        ));
        let newer = advert(&k, 6, now);
        assert!(book.accept(&newer, &p, now).is_ok());
        assert_eq!(book.latest(&p, now).map(|a| a.seq), Some(6));
        assert!(matches!(
            book.accept(&bytes, &p, now),
            Err(AdvertError::Stale { got: 5, known: 6 })
        ));
        assert_eq!(metrics.rejected_count("expired"), 1);
        assert_eq!(metrics.rejected_count("stale"), 2);
    }

    /// What the book remembers it trusts: bytes whose digest it kept pass without their
    /// signature being checked (here, bytes that could never pass it).
    #[test]
    fn kept_bytes_are_not_verified_again() {
        let mut book = AdvertBook::new(Metrics::new());
        let k = Keypair::generate_ed25519();
        let p = k.public().to_peer_id();
        let now = 1_800_000_000_000;
        let advert = book.accept(&advert(&k, 5, now), &p, now).expect("valid");
        let unsigned = b"bytes that are no signed advert".to_vec();
        assert!(book.accept(&unsigned, &p, now).is_err());
        book.latest.insert(
            p,
            Kept {
                advert,
                signed: blake3::hash(&unsigned),
            },
        );
        assert_eq!(book.accept(&unsigned, &p, now).map(|a| a.seq), Ok(5));
    }

    #[test]
    fn sybil_adverts_from_one_host_evict_each_other_not_everyone_else() {
        let mut book = AdvertBook::new(Metrics::new());
        book.max_entries = 10;
        let now = 1_800_000_000_000;
        let honest: Vec<Keypair> = (0..3).map(|_| Keypair::generate_ed25519()).collect();
        for (i, k) in honest.iter().enumerate() {
            let addr = format!("/ip4/10.0.0.{i}/udp/4170/quic-v1");
            book.accept(
                &advert_at(k, 1, now, vec![addr]),
                &k.public().to_peer_id(),
                now,
            )
            .expect("honest");
        }
        // A thousand identities from one machine.
        for n in 0..1000u64 {
            let k = Keypair::generate_ed25519();
            let addr = "/ip4/10.9.9.9/udp/4170/quic-v1".to_string();
            book.accept(
                &advert_at(&k, 1, now + n, vec![addr]),
                &k.public().to_peer_id(),
                now,
            )
            .expect("valid, but evicts its own kind");
            assert!(book.latest.len() <= 10);
        }
        for k in &honest {
            assert!(book.latest(&k.public().to_peer_id(), now).is_some());
        }
        // A newcomer still gets in.
        let k = Keypair::generate_ed25519();
        let addr = "/ip4/10.0.0.77/udp/4170/quic-v1".to_string();
        book.accept(
            &advert_at(&k, 1, now, vec![addr]),
            &k.public().to_peer_id(),
            now,
        )
        .expect("newcomer");
        assert!(book.latest(&k.public().to_peer_id(), now).is_some());
    }
}
