//! The DHT's record store: libp2p's in-memory store, except that a provider lookup is
//! answered with a fresh random choice among the providers held for the key.
//!
//! Kademlia answers `GET_PROVIDERS` with the first few of the providers the store
//! returns (k = 20 in libp2p; `network::PROVIDER_ANSWER_LIMIT`, 64, in gpunode's copy).
//! The in-memory store returns them in the order they arrived, so every node near a key
//! named the same 20 early providers, and a provider that started later than 20 others
//! of its model was never found however many nodes were asked (a network of 28 A100
//! providers showed 20). Shuffled, each answer names a random choice of all that are
//! held, and a lookup that asks every node near the key (see `event_loop::finds`) sees
//! all of them: with 20 answers of 20 out of 28, the chance that one provider is in
//! none is (8/28)^20, about 10^-11. Each record keeps at most
//! [`MAX_PROVIDER_ADDRESS_BYTES`] of addresses, so that a full answer fits a packet.
//!
//! A lookup of one shard of a shared key (`gpunode_protocol::advert::shard_groups`) is
//! answered with the providers held for that shard first, then those held for the
//! key's other shards: a node near one shard key in a network of a few dozen nodes
//! holds most shards, and one answer then names nearly every provider (see
//! `event_loop::finds`, which counts such an answer for every shard it names).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use libp2p::kad::store::{MemoryStore, MemoryStoreConfig, RecordStore, Result};
use libp2p::kad::{ProviderRecord, Record, RecordKey};
use libp2p::PeerId;
use rand::seq::SliceRandom;

use crate::network::PROVIDER_ANSWER_LIMIT;

/// Most bytes of addresses kept with a provider record (a provider names its own in
/// `ADD_PROVIDER`, and a hostile one could name kilobytes): an answer names up to
/// `network::PROVIDER_ANSWER_LIMIT` providers, each with its addresses, within
/// Kademlia's packet limit. A node's own QUIC, TCP and relayed addresses take some 200.
pub const MAX_PROVIDER_ADDRESS_BYTES: usize = 512;

/// [`MemoryStore`] whose provider answers are shuffled and name a shared key's other
/// shards (see the module doc).
pub struct DhtStore {
    inner: MemoryStore,
    /// Each shard key of a shared key, to all shards of that key (a fixed set of 16).
    shard_groups: HashMap<RecordKey, Arc<[RecordKey]>>,
}

impl DhtStore {
    /// An empty store for the node `local` with the bounds of `config`.
    pub fn new(local: PeerId, config: MemoryStoreConfig) -> DhtStore {
        let mut shard_groups = HashMap::new();
        for group in gpunode_protocol::advert::shard_groups() {
            let group: Arc<[RecordKey]> = group.iter().map(RecordKey::new).collect();
            for key in group.iter() {
                shard_groups.insert(key.clone(), group.clone());
            }
        }
        DhtStore {
            inner: MemoryStore::with_config(local, config),
            shard_groups,
        }
    }

    /// The providers held for `key` itself, in arrival order (what a lookup of it is
    /// answered with may name more: see [`RecordStore::providers`]).
    pub fn held(&self, key: &RecordKey) -> Vec<ProviderRecord> {
        self.inner.providers(key)
    }
}

impl RecordStore for DhtStore {
    type RecordsIter<'a> = <MemoryStore as RecordStore>::RecordsIter<'a>;
    type ProvidedIter<'a> = <MemoryStore as RecordStore>::ProvidedIter<'a>;

    fn get(&self, k: &RecordKey) -> Option<Cow<'_, Record>> {
        self.inner.get(k)
    }

    fn put(&mut self, r: Record) -> Result<()> {
        self.inner.put(r)
    }

    fn remove(&mut self, k: &RecordKey) {
        self.inner.remove(k)
    }

    fn records(&self) -> Self::RecordsIter<'_> {
        self.inner.records()
    }

    /// Keeps the provider's first addresses that fit in [`MAX_PROVIDER_ADDRESS_BYTES`].
    fn add_provider(&mut self, mut record: ProviderRecord) -> Result<()> {
        let mut bytes = 0;
        record.addresses.retain(|address| {
            bytes += address.as_ref().len();
            bytes <= MAX_PROVIDER_ADDRESS_BYTES
        });
        self.inner.add_provider(record)
    }

    /// Every provider held for `key`, in a random order, and for a shard of a shared key
    /// then those held for its other shards, in a random order (all of them, unless
    /// there are more than an answer names): Kademlia answers with the first
    /// [`PROVIDER_ANSWER_LIMIT`].
    fn providers(&self, key: &RecordKey) -> Vec<ProviderRecord> {
        let mut rng = rand::thread_rng();
        let mut providers = self.inner.providers(key);
        providers.shuffle(&mut rng);
        if let Some(group) = self.shard_groups.get(key) {
            // The other shards in a random order, until an answer's worth is in: each
            // is copied whole from the store underneath (up to 256 records a key).
            let mut siblings: Vec<&RecordKey> = group.iter().filter(|k| *k != key).collect();
            siblings.shuffle(&mut rng);
            let mut others = Vec::new();
            for sibling in siblings {
                if providers.len() + others.len() >= PROVIDER_ANSWER_LIMIT {
                    break;
                }
                others.extend(self.inner.providers(sibling));
            }
            others.shuffle(&mut rng);
            providers.extend(others);
        }
        providers
    }

    fn provided(&self) -> Self::ProvidedIter<'_> {
        self.inner.provided()
    }

    fn remove_provider(&mut self, k: &RecordKey, p: &PeerId) {
        self.inner.remove_provider(k, p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn answers_of_twenty_name_every_provider_not_only_the_first_twenty() {
        // MemoryStore's default keeps at most 20 a key; a node keeps more.
        let config = MemoryStoreConfig {
            max_providers_per_key: 256,
            ..MemoryStoreConfig::default()
        };
        let mut store = DhtStore::new(PeerId::random(), config);
        let key = RecordKey::new(&"model/A100");
        let providers: Vec<PeerId> = (0..28).map(|_| PeerId::random()).collect();
        for p in &providers {
            store
                .add_provider(ProviderRecord::new(key.clone(), *p, Vec::new()))
                .expect("add");
        }
        assert_eq!(store.providers(&key).len(), 28, "all are held");
        // What Kademlia sends: the first 20 of each answer. Twenty answers (the nodes
        // near a key) name all 28; in arrival order they would name the first 20 only.
        let named: HashSet<PeerId> = (0..20)
            .flat_map(|_| store.providers(&key).into_iter().take(20))
            .map(|r| r.provider)
            .collect();
        assert_eq!(named, providers.iter().copied().collect::<HashSet<_>>());
        // Removal and the other calls still reach the store underneath.
        store.remove_provider(&key, &providers[0]);
        assert_eq!(store.providers(&key).len(), 27);
    }

    /// A lookup of one shard of a shared key is answered with that shard's providers
    /// first, then those held for the other shards of the same key; never another
    /// key's. `held` is the shard's own.
    #[test]
    fn a_shard_is_answered_with_its_own_providers_first_then_the_other_shards() {
        let mut store = DhtStore::new(PeerId::random(), MemoryStoreConfig::default());
        let groups = gpunode_protocol::advert::shard_groups();
        let (any, gpu) = (&groups[0], &groups[1]);
        let add = |store: &mut DhtStore, key: &[u8], n: usize| -> Vec<PeerId> {
            let peers: Vec<PeerId> = (0..n).map(|_| PeerId::random()).collect();
            for p in &peers {
                let record = ProviderRecord::new(RecordKey::new(&key), *p, Vec::new());
                store.add_provider(record).expect("add");
            }
            peers
        };
        let own = add(&mut store, &any[2], 3);
        let mut others = add(&mut store, &any[0], 2);
        others.extend(add(&mut store, &any[7], 4));
        let gpu_only = add(&mut store, &gpu[2], 5);
        let model = add(&mut store, b"/gpunode/v1/cap/model/A100", 6);

        let asked = RecordKey::new(&any[2]);
        let answer: Vec<PeerId> = store.providers(&asked).iter().map(|r| r.provider).collect();
        assert_eq!(answer.len(), 9);
        let set = |ps: &[PeerId]| ps.iter().copied().collect::<HashSet<_>>();
        assert_eq!(set(&answer[..3]), set(&own), "its own shard first");
        assert_eq!(set(&answer[3..]), set(&others));
        assert_eq!(store.held(&asked).len(), 3);
        // A shard nobody registered under still answers with the others.
        assert_eq!(store.providers(&RecordKey::new(&any[5])).len(), 9);
        // Other keys: their own providers only.
        let gpu_answer = store.providers(&RecordKey::new(&gpu[4]));
        assert_eq!(
            set(&gpu_answer.iter().map(|r| r.provider).collect::<Vec<_>>()),
            set(&gpu_only)
        );
        let model_key = RecordKey::new(&b"/gpunode/v1/cap/model/A100");
        assert_eq!(store.providers(&model_key).len(), model.len());
    }

    /// A provider naming kilobytes of addresses for itself keeps the first that fit in
    /// [`MAX_PROVIDER_ADDRESS_BYTES`]: a full answer stays within Kademlia's packet.
    #[test]
    fn a_provider_record_keeps_a_bounded_number_of_address_bytes() {
        use libp2p::Multiaddr;
        let mut store = DhtStore::new(PeerId::random(), MemoryStoreConfig::default());
        let key = RecordKey::new(&"model/A100");
        let address: Multiaddr = "/ip4/127.0.0.1/udp/4001/quic-v1".parse().expect("addr");
        let bloated = vec![address.clone(); 1000];
        let peer = PeerId::random();
        store
            .add_provider(ProviderRecord::new(key.clone(), peer, bloated))
            .expect("add");
        let kept = &store.held(&key)[0].addresses;
        let bytes: usize = kept.iter().map(|a| a.as_ref().len()).sum();
        assert!(!kept.is_empty() && bytes <= MAX_PROVIDER_ADDRESS_BYTES);
        assert_eq!(
            kept.len(),
            MAX_PROVIDER_ADDRESS_BYTES / address.as_ref().len()
        );
        // An honest provider's few addresses are kept whole.
        let honest = PeerId::random();
        let few = vec![
            address.clone(),
            "/ip4/127.0.0.1/tcp/4001".parse().expect("addr"),
        ];
        store
            .add_provider(ProviderRecord::new(key.clone(), honest, few.clone()))
            .expect("add");
        let record = store.held(&key).into_iter().find(|r| r.provider == honest);
        assert_eq!(record.expect("held").addresses, few);
    }
}
