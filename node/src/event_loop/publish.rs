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

use std::time::Duration;

use futures::StreamExt;
use gpunode_protocol::advert::{advert_record_key, capability_keys, Advert};
use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::time::now_ms;
use libp2p::kad::store::RecordStore;
use libp2p::kad::{self, PeerInfo, QueryId, Quorum, Record, RecordKey};
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

/// Our own advert: what it says and where it stands.
pub(super) struct OwnAdvert {
    pub(super) offer: LocalOffer,
    pub(super) ttl: Duration,
    pub(super) record: Option<Vec<u8>>,
    pub(super) status: AdvertStatus,
    pub(super) provided: Vec<Vec<u8>>,
    pub(super) published_at_table_size: usize,
    pub(super) retry_backoff: Duration,
    pub(super) needs_new: bool,
    pub(super) publish_at: Option<Instant>,
    pub(super) refresh_at: Instant,
    /// The walk to the closest peers of our advert key, while it runs.
    walk: Option<QueryId>,
    /// The store of our advert at the peers the walk found, while it runs.
    put: Option<PendingPut>,
    /// The peers that took our latest advert.
    holders: Vec<PeerId>,
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
            published_at_table_size: 0,
            retry_backoff: Duration::ZERO,
            needs_new: true,
            publish_at: Some(Instant::now() + Duration::from_millis(50)),
            refresh_at: Instant::now() + ttl / 2,
            walk: None,
            put: None,
            holders: Vec::new(),
        }
    }

    /// Whether a publication of our advert is still under way.
    fn publishing(&self) -> bool {
        self.walk.is_some() || self.put.is_some()
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
    /// anything else starts with a walk to the closest peers of the advert key.
    pub(super) fn publish(&mut self, withdrawn: bool) {
        let Some(own) = self.own.as_ref() else {
            return;
        };
        if (own.needs_new || withdrawn || own.record.is_none())
            && self.sign_new_advert(withdrawn).is_none()
        {
            return;
        }
        let table_size = self.routing_table_size();
        let Some(own) = self.own.as_mut() else {
            return;
        };
        own.published_at_table_size = table_size;
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
        if withdrawn && !own.holders.is_empty() {
            own.walk = None;
            own.put = Some(PendingPut::start(kad, record, own.holders.clone()));
        } else {
            own.walk = Some(kad.get_closest_peers(record.key.to_vec()));
        }
        self.provide_capability_keys(withdrawn);
    }

    /// The walk to the closest peers of our advert key ended, done or out of time, with
    /// `peers`: store the advert at them.
    pub(super) fn on_closest_peers(&mut self, query: QueryId, peers: Vec<PeerInfo>) {
        if self.own.as_ref().and_then(|o| o.walk) != Some(query) {
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
            self.retry_if_under_replicated(0);
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
        self.retry_if_under_replicated(stored);
    }

    /// Signs a new advert of the inventory (idle GPUs under a lease shown as leased) and
    /// our external addresses, with the next sequence number, and keeps it as our record.
    fn sign_new_advert(&mut self, withdrawn: bool) -> Option<()> {
        let listen_addrs: Vec<String> = self
            .swarm
            .external_addresses()
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
        for k in &keys {
            if let Err(e) = kad.start_providing(RecordKey::new(k)) {
                tracing::warn!("cannot provide capability key: {e:?}");
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

    /// Too few peers took our advert or provider record (peers busy, or the network
    /// still forming): publish again, backing off up to a minute.
    pub(super) fn retry_if_under_replicated(&mut self, stored: usize) {
        let table = self.routing_table_size();
        let Some(own) = &mut self.own else {
            return;
        };
        if stored < REPLICATION.min(table) {
            own.retry_backoff =
                (own.retry_backoff * 2).clamp(Duration::from_secs(1), Duration::from_secs(60));
            let backoff = own.retry_backoff;
            self.schedule_publish(backoff, false);
        } else {
            own.retry_backoff = Duration::ZERO;
        }
    }
}
