//! Offer queries: look up the providers of a capability key, then fetch and verify
//! each provider's advert (stopping at the first valid copy, answered with the newest
//! one this node has seen), and answer with the adverts that match the filter.

use std::collections::{HashMap, HashSet};

use gpunode_protocol::advert::{
    advert_record_key, peer_of_advert_key, Advert, AdvertError, OfferFilter,
};
use gpunode_protocol::time::now_ms;
use libp2p::kad::{self, QueryId, RecordKey};
use libp2p::PeerId;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::{EventLoop, FIND_TIMEOUT};
use crate::views::{OfferSearch, OfferView};

/// An offer query in progress.
pub(super) struct PendingFind {
    pub(super) filter: OfferFilter,
    pub(super) reply: oneshot::Sender<OfferSearch>,
    pub(super) providers: HashSet<PeerId>,
    pub(super) dht_requests: u32,
    pub(super) providers_done: bool,
    pub(super) outstanding: usize,
    pub(super) found: HashMap<PeerId, Advert>,
    pub(super) deadline: Instant,
}

impl EventLoop {
    pub(super) fn start_find(&mut self, filter: OfferFilter, reply: oneshot::Sender<OfferSearch>) {
        let id = self.next_find;
        self.next_find += 1;
        let key = RecordKey::new(&filter.capability_key());
        let query = self.swarm.behaviour_mut().kad.get_providers(key);
        self.provider_queries.insert(query, id);
        self.finds.insert(
            id,
            PendingFind {
                filter,
                reply,
                providers: HashSet::new(),
                dht_requests: 0,
                providers_done: false,
                outstanding: 0,
                found: HashMap::new(),
                deadline: Instant::now() + FIND_TIMEOUT,
            },
        );
    }

    /// Fetches the adverts of known peers, as the second half of an offer query.
    pub(super) fn start_advert_fetch(
        &mut self,
        peers: Vec<PeerId>,
        reply: oneshot::Sender<OfferSearch>,
    ) {
        let id = self.next_find;
        self.next_find += 1;
        self.finds.insert(
            id,
            PendingFind {
                filter: OfferFilter::default(),
                reply,
                providers: peers.iter().copied().collect(),
                dht_requests: 0,
                providers_done: false,
                outstanding: 0,
                found: HashMap::new(),
                deadline: Instant::now() + FIND_TIMEOUT,
            },
        );
        self.fetch_adverts(id);
    }

    fn fetch_adverts(&mut self, id: u64) {
        let Some(find) = self.finds.get_mut(&id) else {
            return;
        };
        find.providers_done = true;
        let providers: Vec<PeerId> = find.providers.iter().copied().collect();
        for peer in providers {
            let q = self
                .swarm
                .behaviour_mut()
                .kad
                .get_record(RecordKey::new(&advert_record_key(&peer)));
            self.record_queries.insert(q, (id, peer));
            if let Some(find) = self.finds.get_mut(&id) {
                find.outstanding += 1;
            }
        }
        self.maybe_complete(id);
    }

    pub(super) fn on_providers(
        &mut self,
        query: QueryId,
        result: Result<kad::GetProvidersOk, kad::GetProvidersError>,
        last: bool,
        requests: u32,
    ) {
        let Some(&id) = self.provider_queries.get(&query) else {
            return;
        };
        if let Some(find) = self.finds.get_mut(&id) {
            if last {
                find.dht_requests += requests;
            }
            if let Ok(kad::GetProvidersOk::FoundProviders { providers, .. }) = result {
                find.providers
                    .extend(providers.into_iter().filter(|p| *p != self.local_peer));
            }
        }
        if !last {
            return;
        }
        self.provider_queries.remove(&query);
        self.fetch_adverts(id);
    }

    pub(super) fn on_record(
        &mut self,
        query: QueryId,
        result: Result<kad::GetRecordOk, kad::GetRecordError>,
        last: bool,
        requests: u32,
    ) {
        let Some(&(id, peer)) = self.record_queries.get(&query) else {
            return;
        };
        let mut resolved = last;
        if let Ok(kad::GetRecordOk::FoundRecord(found)) = result {
            if peer_of_advert_key(found.record.key.as_ref()) == Some(peer) {
                let now = now_ms();
                // A copy older than one we have seen is answered with the newer one.
                let accepted = match self.book.accept(&found.record.value, &peer, now) {
                    Err(AdvertError::Stale { .. }) => {
                        self.book.latest(&peer, now).cloned().ok_or(())
                    }
                    other => other.map_err(|_| ()),
                };
                if let Ok(advert) = accepted {
                    if let Some(find) = self.finds.get_mut(&id) {
                        let newer = find.found.get(&peer).is_none_or(|a| a.seq < advert.seq);
                        if newer {
                            find.found.insert(peer, advert);
                        }
                    }
                    // A valid advert answers the question; stop asking further peers.
                    if let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&query) {
                        q.finish();
                    }
                    resolved = true;
                }
            }
        }
        if resolved {
            self.record_queries.remove(&query);
            if let Some(find) = self.finds.get_mut(&id) {
                find.dht_requests += requests;
                find.outstanding = find.outstanding.saturating_sub(1);
            }
            self.maybe_complete(id);
        }
    }

    fn maybe_complete(&mut self, id: u64) {
        if self
            .finds
            .get(&id)
            .is_some_and(|f| f.providers_done && f.outstanding == 0)
        {
            self.complete_find(id);
        }
    }

    pub(super) fn complete_find(&mut self, id: u64) {
        let Some(find) = self.finds.remove(&id) else {
            return;
        };
        self.provider_queries.retain(|_, f| *f != id);
        let kad = &mut self.swarm.behaviour_mut().kad;
        self.record_queries.retain(|q, (f, _)| {
            if *f == id {
                if let Some(mut q) = kad.query_mut(q) {
                    q.finish();
                }
                false
            } else {
                true
            }
        });
        let now = now_ms();
        let mut offers: Vec<OfferView> = find
            .found
            .values()
            .filter(|a| a.expires_at_ms > now && a.matches(&find.filter))
            .map(|a| {
                let mut o = OfferView::from(a);
                o.rtt_ms = self
                    .rtts
                    .get(&a.publisher)
                    .map(|d| d.as_secs_f64() * 1000.0);
                o.reputation = Some(self.accounts.reputation.score(&a.publisher));
                o
            })
            .collect();
        offers.sort_by(|a, b| {
            a.price_per_gpu_hour
                .total_cmp(&b.price_per_gpu_hour)
                .then_with(|| a.peer_id.cmp(&b.peer_id))
        });
        let _ = find.reply.send(OfferSearch {
            offers,
            providers: find.providers.len(),
            dht_requests: find.dht_requests,
        });
    }
}
