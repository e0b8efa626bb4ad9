//! The DHT's record store: libp2p's in-memory store, except that a provider lookup is
//! answered with a fresh random choice among the providers held for the key.
//!
//! libp2p's Kademlia answers `GET_PROVIDERS` with the first k = 20 of the providers the
//! store returns. The in-memory store returns them in the order they arrived, so every
//! node near a key named the same 20 early providers, and a provider that started
//! later than 20 others of its model was never found however many nodes were asked
//! (a network of 28 A100 providers showed 20). Shuffled, each answer names 20 of all
//! that are held, and a lookup that asks every node near the key (see
//! `event_loop::finds`) sees all of them: with 20 answers of 20 out of 28, the chance
//! that one provider is in none is (8/28)^20, about 10^-11.

use std::borrow::Cow;

use libp2p::kad::store::{MemoryStore, MemoryStoreConfig, RecordStore, Result};
use libp2p::kad::{ProviderRecord, Record, RecordKey};
use libp2p::PeerId;
use rand::seq::SliceRandom;

/// [`MemoryStore`] whose provider answers are shuffled (see the module doc).
pub struct DhtStore {
    inner: MemoryStore,
}

impl DhtStore {
    /// An empty store for the node `local` with the bounds of `config`.
    pub fn new(local: PeerId, config: MemoryStoreConfig) -> DhtStore {
        DhtStore {
            inner: MemoryStore::with_config(local, config),
        }
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

    fn add_provider(&mut self, record: ProviderRecord) -> Result<()> {
        self.inner.add_provider(record)
    }

    /// Every provider held for `key`, in a random order: Kademlia answers with the
    /// first 20.
    fn providers(&self, key: &RecordKey) -> Vec<ProviderRecord> {
        let mut providers = self.inner.providers(key);
        providers.shuffle(&mut rand::thread_rng());
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
}
