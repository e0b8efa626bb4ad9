//! Our own advert: what it says and where it stands ([`OwnAdvert`]), signing a new one
//! when the inventory, leases or addresses change, storing it in the DHT, providing its
//! capability keys, re-publishing when too few peers took it, and withdrawing it on
//! shutdown.

use std::time::Duration;

use futures::StreamExt;
use gpunode_protocol::advert::{advert_record_key, capability_keys, Advert};
use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::time::now_ms;
use libp2p::kad::{self, QueryId, QueryResult, Quorum, Record, RecordKey};
use libp2p::swarm::SwarmEvent;
use tokio::time::Instant;

use super::EventLoop;
use crate::adverts::{AdvertStamp, LocalOffer};
use crate::inventory::InventorySnapshot;
use crate::network::NodeBehaviourEvent;
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
        }
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

    /// Signs a new advert if needed, stores it in the DHT and provides its capability keys.
    pub(super) fn publish(&mut self, withdrawn: bool) -> Option<QueryId> {
        let own = self.own.as_ref()?;
        if own.needs_new || withdrawn || own.record.is_none() {
            self.sign_new_advert(withdrawn)?;
        }
        let table_size = self.routing_table_size();
        let own = self.own.as_mut()?;
        own.published_at_table_size = table_size;
        let value = own.record.clone()?;
        let query = self.put_own_record(value);
        self.provide_capability_keys(withdrawn);
        query
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

    /// Stores our signed advert `value` in the DHT under our advert key, until its TTL.
    fn put_own_record(&mut self, value: Vec<u8>) -> Option<QueryId> {
        let own = self.own.as_ref()?;
        let mut record = Record::new(RecordKey::new(&advert_record_key(&self.local_peer)), value);
        record.expires = Some(std::time::Instant::now() + own.ttl);
        match self
            .swarm
            .behaviour_mut()
            .kad
            .put_record(record, Quorum::All)
        {
            Ok(q) => Some(q),
            Err(e) => {
                tracing::warn!("cannot store own advert: {e:?}");
                None
            }
        }
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

    /// Publishes a withdrawn advert and waits (bounded) until a peer stored it, then
    /// flushes the store.
    pub(super) async fn withdraw(&mut self) {
        if self.own.is_some() && !self.connections.is_empty() {
            if let Some(query) = self.publish(true) {
                let deadline = Instant::now() + WITHDRAW_TIMEOUT;
                loop {
                    tokio::select! {
                        event = self.swarm.select_next_some() => {
                            if let SwarmEvent::Behaviour(NodeBehaviourEvent::Kad(
                                kad::Event::OutboundQueryProgressed { id, result: QueryResult::PutRecord(_), .. },
                            )) = &event
                            {
                                if *id == query {
                                    break;
                                }
                            }
                            self.on_swarm_event(event);
                        }
                        _ = tokio::time::sleep_until(deadline) => break,
                    }
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
