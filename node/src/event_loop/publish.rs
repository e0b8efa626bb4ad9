//! Our own advert: what it says and where it stands ([`OwnAdvert`]), signing a new one
//! when the inventory, leases or addresses change, storing it in the DHT, providing its
//! capability keys, re-publishing when too few peers took it, and withdrawing it on
//! shutdown.
//!
//! The advert goes out in two steps: a walk to the closest peers of its key, then a
//! store at the peers the walk found. Kademlia's own `put_record` stores nothing when
//! its walk runs out of time, which on a loaded, still-forming network is most walks; a
//! walk that times out here still yields the closest peers it reached, and the advert
//! is stored there. The peers that took it are known by name ([`OwnAdvert::holders`]),
//! so the count shown is exact and a withdrawal goes straight to them.
//!
//! A publication is one round: the advert's walk and store, and one provider walk per
//! capability key. A round ends when all of them have; only then is it judged (too few
//! copies: again after a backoff), so a forming network, where every walk is slow, does
//! not pile new rounds on running ones. Between rounds, a peer added to the routing
//! table when the network has doubled since the last round starts a new one soon, and
//! once no new peer has come for a few seconds, growth by 30% gets one more round.
//! Every walk of ours is cut short after [`WALK_DEADLINE`], once enough peers have
//! answered, and stores at the closest of them. "Doubled" is by an estimate of the
//! network's size from our own neighbourhood ([`estimate_network_size`]).

use std::time::Duration;

use futures::StreamExt;
use gpunode_protocol::advert::{advert_record_key, capability_keys, Advert};
use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::time::now_ms;
use libp2p::kad::store::RecordStore;
use libp2p::kad::{
    self, AddProviderPhase, KBucketDistance, KBucketKey, PeerInfo, QueryId, QueryInfo, Quorum,
    Record, RecordKey,
};
use libp2p::PeerId;
use tokio::time::Instant;

use super::EventLoop;
use crate::adverts::{AdvertStamp, LocalOffer};
use crate::dht_store::DhtStore;
use crate::inventory::InventorySnapshot;
use crate::views::AdvertStatus;

/// How long shutdown waits for the withdrawal to reach peers.
const WITHDRAW_TIMEOUT: Duration = Duration::from_secs(2);
/// Kademlia's replication factor: below this many stored copies we re-publish on new peers.
const REPLICATION: usize = 20;
/// How long a walk of a publication may look for closer peers before it stores at the
/// closest that answered, once [`REPLICATION`] have. On a forming network slow peers make
/// walks last until Kademlia's query timeout; the closest peers are found long before.
const WALK_DEADLINE: Duration = Duration::from_secs(10);
/// Below this many copies of any record (or every peer we know, if fewer) a round is
/// under-replicated and runs again. Half of [`REPLICATION`]: a lookup finds a record at
/// any one of them, and asking for all 20 made a loaded network re-publish for every
/// slow peer, which loaded it more.
const MIN_COPIES: usize = REPLICATION / 2;
/// How much the network must have grown, beyond [`REPLICATION`] peers, for a new round.
const GROWTH_FACTOR: f64 = 2.0;
/// How much the network must have grown since our last round for one more round once it
/// has stopped growing ([`SETTLE_QUIET`]): 30% more. By the doubling rule alone a
/// provider's last round during a burst of joins came, by its own estimate, at half the
/// final size or more; the estimate is off by a fifth either way, and at 200 nodes some
/// providers' records were held by only 3 to 6 of the 20 nodes closest to their keys,
/// where a lookup that stops once answers agree can miss them. One more round puts them
/// there (`docs/benchmarks.md`, "Publishing once more when the network stops growing").
/// Where a network grows slowly (a peer every few seconds), every 30% of growth makes a
/// round: about 15 from 20 to 1,000 peers, against 6 by doubling alone.
const SETTLE_GROWTH: f64 = 1.3;
/// How long no peer new to our routing table must have come before the network counts as
/// no longer growing. At 200 nodes, with 5 s the network was formed (counted until
/// every settling round had come) 16 to 18 s after the last node had started, 35 to 45 s
/// from start; with 2 s, 5.6 to 8.6 s after, 27 to 35 s from start, on less CPU and
/// with the records placed as well; 1 s made more rounds during the joins for no faster
/// formation (`docs/benchmarks.md`, "Formed once the settling rounds have come").
const SETTLE_QUIET: Duration = Duration::from_secs(2);
/// How long after the network has grown we publish again, so that a burst of
/// new peers leads to one round.
pub(super) const GROWTH_DELAY: Duration = Duration::from_millis(300);

/// Our own advert: what it says and where it stands.
pub(super) struct OwnAdvert {
    pub(super) offer: LocalOffer,
    pub(super) ttl: Duration,
    pub(super) record: Option<Vec<u8>>,
    pub(super) status: AdvertStatus,
    pub(super) provided: Vec<Vec<u8>>,
    /// The network's size as we estimated it at our last publication.
    pub(super) published_at_network_size: f64,
    /// When a peer new to our routing table last came.
    pub(super) grew_at: Instant,
    pub(super) retry_backoff: Duration,
    pub(super) needs_new: bool,
    pub(super) publish_at: Option<Instant>,
    pub(super) refresh_at: Instant,
    /// The walk to the closest peers of our advert key, while it runs.
    walk: Option<Walk>,
    /// The store of our advert at the peers the walk found, while it runs.
    put: Option<PendingPut>,
    /// The peers that took our latest advert.
    holders: Vec<PeerId>,
    /// The provider records of this round still being published, one per key.
    provides: Vec<PendingProvide>,
    /// The fewest copies any part of this round has stored so far.
    round_stored: Option<usize>,
    /// Whether a walk of this round was cut short at [`WALK_DEADLINE`].
    round_cut_short: bool,
}

/// A walk of ours, cut short at its deadline.
#[derive(Clone, Copy)]
struct Walk {
    query: QueryId,
    started: Instant,
}

impl Walk {
    /// The walk of `query`, started now.
    fn now(query: QueryId) -> Walk {
        Walk {
            query,
            started: Instant::now(),
        }
    }
}

/// A provider record being published.
struct PendingProvide {
    walk: Walk,
    key: Vec<u8>,
}

/// A store of our advert at fixed peers.
struct PendingPut {
    query: QueryId,
    peers: Vec<PeerId>,
}

impl PendingPut {
    /// Stores `record` at `peers`, done once every one of them has taken it.
    fn start(kad: &mut kad::Behaviour<DhtStore>, record: Record, peers: Vec<PeerId>) -> Self {
        PendingPut {
            query: kad.put_record_to(record, peers.iter().copied(), Quorum::All),
            peers,
        }
    }
}

impl OwnAdvert {
    /// An advert of `offer` not yet published: the first goes out 50 ms from now and is
    /// refreshed at half its `ttl`.
    pub(super) fn new(offer: LocalOffer, ttl: Duration) -> OwnAdvert {
        OwnAdvert {
            offer,
            ttl,
            record: None,
            status: AdvertStatus {
                enabled: true,
                ..AdvertStatus::default()
            },
            provided: Vec::new(),
            published_at_network_size: 0.0,
            retry_backoff: Duration::ZERO,
            needs_new: true,
            publish_at: Some(Instant::now() + Duration::from_millis(50)),
            refresh_at: Instant::now() + ttl / 2,
            walk: None,
            put: None,
            holders: Vec::new(),
            provides: Vec::new(),
            round_stored: None,
            round_cut_short: false,
            grew_at: Instant::now(),
        }
    }

    /// Whether a publication of our advert is still under way.
    fn publishing(&self) -> bool {
        self.walk.is_some() || self.put.is_some()
    }

    /// Whether any part of a publication round is still under way.
    pub(super) fn in_round(&self) -> bool {
        self.publishing() || !self.provides.is_empty()
    }

    /// One part of the round stored `stored` copies.
    fn part_stored(&mut self, stored: usize) {
        self.round_stored = Some(self.round_stored.map_or(stored, |s| s.min(stored)));
    }

    /// Whether the network has grown enough since our last publication (by
    /// [`estimate_network_size`]) that peers closest to our keys may hold nothing: in a
    /// network of fewer than [`REPLICATION`] peers every peer should hold our records, so
    /// any growth; beyond that, when it has doubled (about half of the closest peers
    /// new). A lookup asks until ten answers named providers and the last five named
    /// nobody new, further toward a key than the three agreeing answers it once
    /// stopped at. (Growth by half was the rule then: after a doubling of this estimate
    /// 3 lookups of 50 missed a provider at 200 nodes. With the ten-answer rule a
    /// doubling misses as rarely as growth by half, with about 11% fewer rounds:
    /// `docs/benchmarks.md`, "Publishing again when the network has doubled".)
    pub(super) fn outgrown(&self, network_size: f64) -> bool {
        let base = self.published_at_network_size;
        self.status.seq > 0
            && if base < REPLICATION as f64 {
                network_size > base
            } else {
                network_size >= GROWTH_FACTOR * base
            }
    }

    /// Whether a settling round may be due at `now`: something was published, no round
    /// runs or is due, and no new peer came for [`SETTLE_QUIET`].
    pub(super) fn may_settle(&self, now: Instant) -> bool {
        self.status.seq > 0
            && !self.in_round()
            && self.publish_at.is_none()
            && now.saturating_duration_since(self.grew_at) >= SETTLE_QUIET
    }

    /// What `status` shows of our advert, the network being `network_size` by our
    /// estimate: publishing while a round runs or is due, a settling round included.
    pub(super) fn view(&self, network_size: f64) -> AdvertStatus {
        AdvertStatus {
            publishing: self.in_round()
                || self.publish_at.is_some()
                || self.awaits_settling(network_size),
            network_size_at_last_round: self.published_at_network_size,
            ..self.status.clone()
        }
    }

    /// Whether a settling round will come once the network stops growing: something was
    /// published and the network, now `network_size` by our estimate, has grown by
    /// [`SETTLE_GROWTH`] since. Until it has come, the node is still publishing.
    pub(super) fn awaits_settling(&self, network_size: f64) -> bool {
        self.status.seq > 0 && self.settled(network_size)
    }

    /// Whether the network, now `network_size` by our estimate, has grown by
    /// [`SETTLE_GROWTH`] since our last round (beyond [`REPLICATION`] peers: below that
    /// [`OwnAdvert::outgrown`] publishes on any growth).
    pub(super) fn settled(&self, network_size: f64) -> bool {
        let base = self.published_at_network_size;
        base >= REPLICATION as f64 && network_size >= SETTLE_GROWTH * base
    }
}

impl EventLoop {
    /// Publishes when a publication is due, or a new advert when half the last one's
    /// lifetime has passed.
    pub(super) fn publish_if_due(&mut self, now: Instant) {
        if let Some(own) = &mut self.own {
            if own.refresh_at <= now {
                own.needs_new = true;
                own.publish_at = Some(now);
                own.refresh_at = now + own.ttl / 2;
            }
            if own.publish_at.is_some_and(|p| p <= now) {
                own.publish_at = None;
                self.publish(false);
            }
        }
        self.cut_short_slow_walks(now);
    }

    /// Ends the walks of our publication that have run past [`WALK_DEADLINE`]: each
    /// goes on to store at the closest peers that answered.
    fn cut_short_slow_walks(&mut self, now: Instant) {
        let Some(own) = &self.own else {
            return;
        };
        let due = |w: &Walk| now.duration_since(w.started) >= WALK_DEADLINE;
        let mut slow: Vec<QueryId> = own
            .provides
            .iter()
            .filter(|p| due(&p.walk))
            .map(|p| p.walk.query)
            .collect();
        slow.extend(own.walk.filter(due).map(|w| w.query));
        let kad = &mut self.swarm.behaviour_mut().kad;
        let mut cut_short = false;
        for id in slow {
            if let Some(mut query) = kad.query_mut(&id) {
                if (query.stats().num_successes() as usize) < REPLICATION {
                    continue;
                }
                // A provider query past its walk is sending its records: leave it be.
                let walking = !matches!(
                    query.info(),
                    QueryInfo::AddProvider {
                        phase: AddProviderPhase::AddProvider { .. },
                        ..
                    }
                );
                if walking {
                    query.finish();
                    cut_short = true;
                }
            }
        }
        if let Some(own) = self.own.as_mut() {
            own.round_cut_short |= cut_short;
        }
    }

    /// Publishes once more when the network has stopped growing and has grown since our
    /// last round, though not doubled ([`OwnAdvert::settled`]).
    pub(super) fn publish_if_settled(&mut self, now: Instant) {
        let Some(own) = &self.own else {
            return;
        };
        if !own.may_settle(now) {
            return;
        }
        let network_size = self.estimate_network_size();
        if self.own.as_ref().is_some_and(|o| o.settled(network_size)) {
            tracing::debug!(
                network_size,
                "the network stopped growing: publishing again"
            );
            self.schedule_publish(Duration::ZERO, false);
        }
    }

    pub(super) fn schedule_publish(&mut self, after: Duration, new_advert: bool) {
        if let Some(own) = &mut self.own {
            own.needs_new |= new_advert;
            let at = Instant::now() + after;
            own.publish_at = Some(own.publish_at.map_or(at, |p| p.min(at)));
        }
    }

    /// Signs a new advert if needed, stores it in the DHT and provides its capability
    /// keys. A withdrawal goes straight to the peers that hold our advert, where any do;
    /// anything else starts with a walk to the closest peers of the advert key. While a
    /// round runs, only a new advert starts anything (its own walk, and the provider
    /// records of keys not being published already); the round's end judges the rest.
    pub(super) fn publish(&mut self, withdrawn: bool) {
        let Some(own) = self.own.as_ref() else {
            return;
        };
        let new_advert = own.needs_new || withdrawn || own.record.is_none();
        if !new_advert && own.in_round() {
            return;
        }
        if new_advert && self.sign_new_advert(withdrawn).is_none() {
            return;
        }
        let network_size = self.estimate_network_size();
        let Some(own) = self.own.as_mut() else {
            return;
        };
        own.published_at_network_size = network_size;
        tracing::debug!(network_size, new_advert, withdrawn, "publishing our advert");
        let Some(record) = self.own_record() else {
            return;
        };
        let kad = &mut self.swarm.behaviour_mut().kad;
        if let Err(e) = kad.store_mut().put(record.clone()) {
            tracing::warn!("cannot keep own advert: {e:?}");
        }
        let Some(own) = self.own.as_mut() else {
            return;
        };
        if !own.in_round() {
            own.round_stored = None;
        }
        // A new advert replaces the one a running walk or store carries.
        if let Some(old) = own.walk.take() {
            if let Some(mut q) = kad.query_mut(&old.query) {
                q.finish();
            }
        }
        own.put = None;
        if withdrawn && !own.holders.is_empty() {
            own.walk = None;
            own.put = Some(PendingPut::start(kad, record, own.holders.clone()));
        } else {
            own.walk = Some(Walk::now(kad.get_closest_peers(record.key.to_vec())));
        }
        self.provide_capability_keys(withdrawn);
    }

    /// The walk to the closest peers of our advert key ended, done or out of time, with
    /// `peers`: store the advert at them.
    pub(super) fn on_closest_peers(&mut self, query: QueryId, peers: Vec<PeerInfo>) {
        if self.own.as_ref().and_then(|o| o.walk).map(|w| w.query) != Some(query) {
            return;
        }
        let record = self.own_record();
        let Some(own) = self.own.as_mut() else {
            return;
        };
        own.walk = None;
        let peers: Vec<PeerId> = peers
            .into_iter()
            .map(|p| p.peer_id)
            .take(REPLICATION)
            .collect();
        let Some(record) = record.filter(|_| !peers.is_empty()) else {
            own.status.stored_at_peers = 0;
            own.part_stored(0);
            self.end_round_if_done();
            return;
        };
        let kad = &mut self.swarm.behaviour_mut().kad;
        own.put = Some(PendingPut::start(kad, record, peers));
    }

    /// The store of our advert ended: `stored` is the peers that took it (`None`: all
    /// that were asked).
    pub(super) fn on_advert_stored(&mut self, query: QueryId, stored: Option<Vec<PeerId>>) {
        let Some(own) = self.own.as_mut() else {
            return;
        };
        let Some(put) = own.put.take_if(|p| p.query == query) else {
            return;
        };
        own.holders = stored.unwrap_or(put.peers);
        let stored = own.holders.len();
        own.status.stored_at_peers = stored;
        own.part_stored(stored);
        self.end_round_if_done();
    }

    /// A provider record of ours was published (`stored` copies) or gave up.
    pub(super) fn on_provided(&mut self, query: QueryId, stored: usize) {
        let Some(own) = self.own.as_mut() else {
            return;
        };
        let Some(i) = own.provides.iter().position(|p| p.walk.query == query) else {
            return;
        };
        own.provides.swap_remove(i);
        own.part_stored(stored);
        self.end_round_if_done();
    }

    /// Signs a new advert of the inventory (idle GPUs under a lease shown as leased) and
    /// our external addresses, with the next sequence number, and keeps it as our record.
    fn sign_new_advert(&mut self, withdrawn: bool) -> Option<()> {
        // As many as peers take (`MAX_ADVERT_ADDRS`), those reachable from anywhere first.
        let listen_addrs: Vec<String> = crate::nat::best_reachable(
            self.swarm.external_addresses(),
            gpunode_protocol::advert::MAX_ADVERT_ADDRS,
        )
        .iter()
        .map(|a| a.to_string())
        .collect();
        let inventory_with_leases = self.inventory_with_leases();
        let own = self.own.as_ref()?;
        let now = now_ms();
        let seq = match self.store.next_counter("node", b"advert_seq", 0) {
            Ok(seq) => seq,
            Err(e) => {
                tracing::error!("cannot advance advert sequence number: {e}");
                return None;
            }
        };
        let advert = own.offer.advert(
            self.local_peer,
            &AdvertStamp {
                seq,
                issued_at_ms: now,
                ttl_ms: own.ttl.as_millis() as u64,
                withdrawn,
            },
            &inventory_with_leases,
            listen_addrs,
            &self.desk.book().reserved_windows(),
        );
        tracing::debug!(seq = advert.seq, addrs = ?advert.listen_addrs, "signed a new advert");
        let signed = self.sign(&advert)?;
        let own = self.own.as_mut()?;
        own.record = Some(signed);
        own.needs_new = false;
        own.status.seq = advert.seq;
        own.status.issued_at_ms = advert.issued_at_ms;
        own.status.expires_at_ms = advert.expires_at_ms;
        own.status.capability_keys = capability_keys(&advert)
            .iter()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect();
        self.metrics.adverts_published.inc();
        Some(())
    }

    /// The inventory as adverts show it: idle GPUs that a lease holds are leased.
    fn inventory_with_leases(&self) -> InventorySnapshot {
        let leased = self.desk.book().committed_gpus();
        let mut inventory = self.inventory.clone();
        for g in &mut inventory.gpus {
            if g.state == GpuState::Idle && leased.contains(&g.uuid) {
                g.state = GpuState::Leased;
            }
        }
        inventory
    }

    /// Our signed advert as a DHT record under our advert key, published by us, kept
    /// until its TTL.
    fn own_record(&self) -> Option<Record> {
        let own = self.own.as_ref()?;
        let mut record = Record::new(
            RecordKey::new(&advert_record_key(&self.local_peer)),
            own.record.clone()?,
        );
        record.publisher = Some(self.local_peer);
        record.expires = Some(std::time::Instant::now() + own.ttl);
        Some(record)
    }

    /// Provides the capability keys of our advert (none once withdrawn) and stops
    /// providing the keys it no longer has.
    fn provide_capability_keys(&mut self, withdrawn: bool) {
        let Some(own) = self.own.as_mut() else {
            return;
        };
        let kad = &mut self.swarm.behaviour_mut().kad;
        let keys: Vec<Vec<u8>> = if withdrawn {
            Vec::new()
        } else {
            own.status
                .capability_keys
                .iter()
                .map(|k| k.as_bytes().to_vec())
                .collect()
        };
        for old in own.provided.iter().filter(|k| !keys.contains(k)) {
            kad.stop_providing(&RecordKey::new(old));
        }
        own.provides.retain(|p| keys.contains(&p.key));
        for k in &keys {
            if own.provides.iter().any(|p| &p.key == k) {
                continue;
            }
            match kad.start_providing(RecordKey::new(k)) {
                Ok(query) => own.provides.push(PendingProvide {
                    walk: Walk::now(query),
                    key: k.clone(),
                }),
                Err(e) => tracing::warn!("cannot provide capability key: {e:?}"),
            }
        }
        own.provided = keys;
    }

    pub(super) fn sign(&self, advert: &Advert) -> Option<Vec<u8>> {
        advert
            .sign(&self.keypair)
            .map_err(|e| tracing::error!("cannot sign advert: {e}"))
            .ok()
    }

    /// Publishes a withdrawn advert and waits (bounded) until the peers it went to have
    /// answered, then flushes the store.
    pub(super) async fn withdraw(&mut self) {
        if self.own.is_some() && !self.connections.is_empty() {
            self.publish(true);
            let deadline = Instant::now() + WITHDRAW_TIMEOUT;
            while self.own.as_ref().is_some_and(OwnAdvert::publishing) {
                tokio::select! {
                    event = self.swarm.select_next_some() => self.on_swarm_event(event),
                    _ = tokio::time::sleep_until(deadline) => break,
                }
            }
        }
        if let Err(e) = self.store.flush() {
            tracing::error!("cannot flush store on shutdown: {e}");
        }
    }

    /// Judges a round once every part of it has ended. Too few peers ([`MIN_COPIES`])
    /// took our advert or a provider record (peers busy, or the network still forming):
    /// publish again, backing off up to a minute. The network's size at the round's end
    /// becomes the one later growth is measured from: growth is judged as peers are
    /// added while no round runs (in `on_kad_event`).
    fn end_round_if_done(&mut self) {
        if self.own.as_ref().is_none_or(OwnAdvert::in_round) {
            return;
        }
        let table = self.routing_table_size();
        let network_size = self.estimate_network_size();
        let Some(own) = &mut self.own else {
            return;
        };
        // The round's walks went through the network as it is now; a node that has just
        // joined knew a peer or two when it began, and the whole network by its end.
        own.published_at_network_size = own.published_at_network_size.max(network_size);
        own.status.rounds += 1;
        own.status.last_round_cut_short = std::mem::take(&mut own.round_cut_short);
        let stored = own.round_stored.take().unwrap_or(0);
        if stored < MIN_COPIES.min(table) {
            tracing::debug!(stored, table, "publication under-replicated, again later");
            own.retry_backoff =
                (own.retry_backoff * 2).clamp(Duration::from_secs(1), Duration::from_secs(60));
            let backoff = own.retry_backoff;
            self.schedule_publish(backoff, false);
        } else {
            own.retry_backoff = Duration::ZERO;
        }
    }
}

/// The network's size as seen from our own neighbourhood: with N peers spread evenly over
/// the key space, the k-th closest to us lies about k/N of the space away, so
/// N ≈ k · 2^256 / d_k. New peers near us find us (their first walk goes to their own
/// key), so this follows the network's growth, which the routing table's size does not:
/// its far buckets are full at 20 peers each, and it levels off near 90 at 200 nodes.
/// With fewer than k peers known, the count itself.
pub(super) fn estimate_network_size(kad: &mut kad::Behaviour<DhtStore>, local: PeerId) -> f64 {
    let local = KBucketKey::from(local);
    let mut known = 0usize;
    let mut kth = None;
    for peer in kad.get_closest_local_peers(&local).take(REPLICATION) {
        known += 1;
        kth = Some(peer);
    }
    match kth {
        Some(peer) if known == REPLICATION => size_from_kth_distance(&local.distance(&peer)),
        _ => known as f64,
    }
}

/// N ≈ k · 2^256 / d_k, for the distance `d` to the k-th closest peer (k = [`REPLICATION`]).
fn size_from_kth_distance(d: &KBucketDistance) -> f64 {
    REPLICATION as f64 * (256.0 - log2(d)).exp2()
}

/// log2 of a Kademlia distance, with the fraction from its top 64 bits.
fn log2(d: &KBucketDistance) -> f64 {
    let Some(whole) = d.ilog2() else {
        return 0.0;
    };
    let top = if whole >= 63 {
        (d.0 >> (whole - 63) as usize).low_u64()
    } else {
        (d.0 << (63 - whole) as usize).low_u64()
    };
    f64::from(whole) + (top as f64 / (1u64 << 63) as f64).log2()
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::kad::U256;

    #[test]
    fn log2_of_a_distance_is_exact_on_powers_of_two_and_monotonic_between() {
        let d = |v: U256| KBucketDistance(v);
        assert_eq!(log2(&d(U256::from(1u64) << 200)), 200.0);
        assert_eq!(log2(&d(U256::from(1u64))), 0.0);
        assert_eq!(log2(&d(U256::from(8u64))), 3.0);
        let three_halves = log2(&d(U256::from(3u64) << 199));
        assert!((three_halves - (200.0 + 1.5f64.log2())).abs() < 1e-9);
        assert!(log2(&d(U256::MAX)) <= 256.0 && log2(&d(U256::MAX)) > 255.99);
    }

    /// A node's advert walk goes where its own bootstrap lookup went: the record's place
    /// in the key space is the node's own, and any other peer's is elsewhere.
    #[test]
    fn an_advert_record_lives_at_its_publishers_own_place_in_the_dht() {
        let place = |p: &PeerId| KBucketKey::new(RecordKey::new(&advert_record_key(p)));
        let peer = PeerId::random();
        assert_eq!(
            place(&peer).distance(&KBucketKey::from(peer)),
            KBucketDistance::default()
        );
        let other = PeerId::random();
        assert_ne!(
            place(&peer).distance(&KBucketKey::from(other)),
            KBucketDistance::default()
        );
    }

    /// The estimate from the 20th closest of N peers lands near N, for networks larger
    /// than the routing table could ever hold.
    #[test]
    fn the_network_size_estimate_follows_the_number_of_peers() {
        for n in [100usize, 400, 3000] {
            let mut logs = Vec::new();
            for node in 0..8 {
                let local = KBucketKey::new(format!("node {node}").into_bytes());
                let mut distances: Vec<KBucketDistance> = (0..n)
                    .map(|i| local.distance(&KBucketKey::new(format!("peer {i}").into_bytes())))
                    .collect();
                distances.sort();
                logs.push(size_from_kth_distance(&distances[REPLICATION - 1]).log2());
            }
            let mean = logs.iter().sum::<f64>() / logs.len() as f64;
            let estimate = mean.exp2();
            assert!(
                estimate > n as f64 / 1.5 && estimate < n as f64 * 1.5,
                "{n} peers estimated as {estimate:.0}"
            );
        }
    }

    /// The settling round: only once the network has stopped growing, only when it has
    /// grown by 30% since our last round, never while a round runs or is due, and
    /// not before our first publication.
    #[tokio::test(start_paused = true)]
    async fn one_more_round_comes_when_the_network_stops_growing_after_growth() {
        let offer = LocalOffer {
            cpu_cores: 1,
            ram_bytes: 1 << 30,
            backends: Vec::new(),
            price_per_gpu_hour_millicredits: 0,
        };
        let mut own = OwnAdvert::new(offer, Duration::from_secs(3600));
        own.publish_at = None;
        own.published_at_network_size = 100.0;
        let now = Instant::now();
        assert!(!own.may_settle(now + SETTLE_QUIET), "never published");
        assert!(!own.awaits_settling(1000.0), "never published");
        own.status.seq = 1;
        // Until the settling round has come the node says it is still publishing.
        assert!(own.awaits_settling(130.0) && !own.awaits_settling(129.0));
        assert!(own.view(130.0).publishing && !own.view(129.0).publishing);
        assert_eq!(own.view(130.0).network_size_at_last_round, 100.0);
        assert!(!own.may_settle(now), "a peer came just now");
        let later = now + SETTLE_QUIET;
        assert!(own.may_settle(later));
        assert!(own.settled(130.0) && !own.settled(129.0));
        // A round takes the network's size then as its base (`publish`): no other round
        // until the network grows again.
        own.published_at_network_size = 130.0;
        assert!(!own.settled(130.0) && !own.settled(160.0) && own.settled(170.0));
        own.published_at_network_size = 100.0;
        assert!(
            !own.outgrown(130.0),
            "short of a doubling, only the settling round"
        );
        own.publish_at = Some(later);
        assert!(!own.may_settle(later), "a round is due already");
        own.publish_at = None;
        let peer = PeerId::random();
        let mut kad = kad::Behaviour::new(peer, kad::store::MemoryStore::new(peer));
        own.provides.push(PendingProvide {
            walk: Walk::now(kad.get_closest_peers(b"k".to_vec())),
            key: b"k".to_vec(),
        });
        assert!(!own.may_settle(later), "a round runs");
        own.provides.clear();
        own.published_at_network_size = 10.0;
        assert!(!own.settled(1000.0), "below 20 peers any growth publishes");
    }
}
