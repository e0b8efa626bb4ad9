//! Which providers to ask for a lease, and in what order: the one named, or those whose
//! offers match (reputable ones with enough idle GPUs first, then by `rank`), each with
//! where to reach it and what it advertised (price and GPUs).

use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::PeerId;
use libp2p::Multiaddr;

use super::propose::ProviderAdvert;
use super::{rank, LeaseError, Negotiator, REPUTATION_FLOOR};
use crate::ledger::reputation::NEUTRAL;
use crate::views::LeaseSpec;

/// A provider to ask, where to reach it (nothing when connected), and its newest
/// advert's price and GPUs, when known: an offer above the advertised price is refused
/// even without --max-price, and the terms it would offer can be proposed.
pub(super) struct Candidate {
    /// The provider.
    pub(super) peer: PeerId,
    /// Where to reach it.
    pub(super) addrs: Vec<Multiaddr>,
    /// What it advertised.
    pub(super) advertised: Option<ProviderAdvert>,
}

/// The providers to ask, and the search they came from (none for a named provider).
pub(super) struct Found {
    /// Whom to ask, best first.
    pub(super) candidates: Vec<Candidate>,
    /// The search, to keep when it leads to a lease or forget when it does not.
    pub(super) search: Option<Search>,
}

/// An offer search's answer.
pub(super) struct Search {
    /// What was searched for.
    pub(super) filter: OfferFilter,
    /// The matching offers, as the search gave them.
    pub(super) offers: Vec<crate::OfferView>,
    /// Whether they were a recent search's (see `recent`), not a new one's.
    pub(super) reused: bool,
    /// When the search answered (for a reused one, the first run's search).
    pub(super) at: std::time::Instant,
}

impl Negotiator {
    pub(super) async fn addresses_of(&self, peer: PeerId) -> Vec<Multiaddr> {
        if let Ok(true) = self.client.is_connected(peer).await {
            return Vec::new();
        }
        self.find_adverts(vec![peer])
            .await
            .ok()
            .and_then(|v| v.into_iter().next())
            .map(|o| listen_multiaddrs(&o))
            .unwrap_or_default()
    }

    /// Where to reach `peer` (nothing when connected) and what it advertises, when its
    /// advert is known. A connected peer whose advert this node already verified costs
    /// no DHT request, and one reached so a moment ago not even a question to the loop
    /// (see `reached`).
    async fn target_of(&self, peer: PeerId) -> (Vec<Multiaddr>, Option<ProviderAdvert>) {
        let now = tokio::time::Instant::now();
        if let Some(advert) = self.reached().get(&peer, now) {
            return (Vec::new(), Some(advert));
        }
        let (connected, known) = self.client.reach(peer).await.unwrap_or((false, None));
        if let (true, Some(advert)) = (connected, &known) {
            self.reached().keep(peer, advert.clone(), now);
            return (Vec::new(), known);
        }
        let advert = self
            .find_adverts(vec![peer])
            .await
            .ok()
            .and_then(|v| v.into_iter().next());
        let advertised = advert.as_ref().map(ProviderAdvert::of).or(known);
        let addrs = match advert {
            Some(o) if !connected => listen_multiaddrs(&o),
            _ => Vec::new(),
        };
        (addrs, advertised)
    }

    /// The providers to ask for `spec`, in order: the one it names, or those whose
    /// offers match, at `max_price` (millicredits per GPU-hour) or less when set (from
    /// a recent search that led to a lease when `reuse` allows, see `recent`).
    pub(super) async fn candidates(
        &self,
        spec: &LeaseSpec,
        max_price: Option<u64>,
        reuse: bool,
    ) -> Result<Found, LeaseError> {
        match &spec.peer {
            Some(p) => {
                let peer: PeerId = p.parse().map_err(|_| {
                    LeaseError::Invalid(format!("'{p}' is not a peer id (12D3KooW...)"))
                })?;
                let (addrs, advertised) = self.target_of(peer).await;
                Ok(Found {
                    candidates: vec![Candidate {
                        peer,
                        addrs,
                        advertised,
                    }],
                    search: None,
                })
            }
            None => self.search(spec, max_price, reuse).await,
        }
    }

    /// The providers whose offers match `spec`, best first (see [`order_offers`]).
    async fn search(
        &self,
        spec: &LeaseSpec,
        max_price: Option<u64>,
        reuse: bool,
    ) -> Result<Found, LeaseError> {
        let filter = OfferFilter {
            gpu_model: spec.gpu_model.clone(),
            gpu_slice: spec.gpu_slice.clone(),
            min_gpu_mem_bytes: spec.min_gpu_mem_bytes,
            gpus: Some(spec.gpus),
            backend: Some(spec.backend.clone()),
        };
        let kept = if reuse {
            let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
            recent.get(&filter, std::time::Instant::now())
        } else {
            None
        };
        let reused = kept.is_some();
        let (found, at) = match kept {
            Some((at, mut offers)) => {
                if let Some(accounts) = &self.accounts {
                    for o in &mut offers {
                        if let Ok(peer) = o.peer_id.parse() {
                            o.reputation = Some(accounts.reputation.score(&peer));
                        }
                    }
                }
                (offers, at)
            }
            None => {
                let offers = self.client.search_offers(filter.clone()).await?.offers;
                (offers, std::time::Instant::now())
            }
        };
        let mut offers = found.clone();
        offers.retain(|o| {
            max_price.is_none_or(|m| (o.price_per_gpu_hour * 1000.0).round() as u64 <= m)
        });
        order_offers(&mut offers, &filter, spec.gpus);
        let mut candidates: Vec<Candidate> = offers
            .iter()
            .filter_map(|o| {
                let peer = o.peer_id.parse().ok()?;
                Some(Candidate {
                    peer,
                    addrs: listen_multiaddrs(o),
                    advertised: Some(ProviderAdvert::of(o)),
                })
            })
            .collect();
        // Providers dialled directly first: one behind NAT, advertising only relayed
        // addresses, needs a hole punch before job data may flow (stable: the order
        // above holds within each group).
        candidates.sort_by_key(|c| {
            !c.addrs.is_empty()
                && c.addrs
                    .iter()
                    .all(|a| crate::nat::scope_of(a) == Some(crate::nat::Scope::Relayed))
        });
        Ok(Found {
            candidates,
            search: Some(Search {
                filter,
                offers: found,
                reused,
                at,
            }),
        })
    }
}

/// Sorts offers best first. Providers whose reputation fell below the floor go last;
/// then those with enough idle matching GPUs (`gpus` of `filter`); then by price
/// weighted by reputation and latency (see `rank`).
fn order_offers(offers: &mut [crate::OfferView], filter: &OfferFilter, gpus: u32) {
    // Providers that advertise enough idle matching GPUs first (cheapest
    // first within each group); the rest may have freed some meanwhile.
    let idle_enough = |o: &crate::OfferView| {
        o.gpus
            .iter()
            .filter(|g| {
                g.state == gpunode_protocol::gpu::GpuState::Idle
                    && filter.gpu_matches(&g.model, g.memory_bytes)
            })
            .count()
            >= gpus as usize
    };
    offers.sort_by(|a, b| {
        let key = |o: &crate::OfferView| {
            (
                o.reputation.unwrap_or(NEUTRAL) < REPUTATION_FLOOR,
                !idle_enough(o),
            )
        };
        key(a)
            .cmp(&key(b))
            .then_with(|| rank(a).total_cmp(&rank(b)))
    });
}

/// The addresses an offer lists, parsed (unparsable ones left out).
fn listen_multiaddrs(o: &crate::OfferView) -> Vec<Multiaddr> {
    o.listen_addrs
        .iter()
        .filter_map(|a| a.parse().ok())
        .collect()
}

/// What `spec` asks for, in words.
pub(super) fn describe(spec: &LeaseSpec) -> String {
    let mut s = format!("{} GPU(s)", spec.gpus);
    if let Some(m) = &spec.gpu_model {
        s.push_str(&format!(" of model {m}"));
    }
    if let Some(slice) = &spec.gpu_slice {
        s.push_str(&format!(" as MIG slice {slice}"));
    }
    if let Some(mem) = spec.min_gpu_mem_bytes {
        s.push_str(&format!(
            " with {}",
            gpunode_protocol::units::format_bytes(mem)
        ));
    }
    s.push_str(&format!(" on backend {}", spec.backend));
    s
}
