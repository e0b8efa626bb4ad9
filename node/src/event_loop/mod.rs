//! The node's event loop: the one task that owns the libp2p swarm.
//!
//! ```text
//!  NodeHandle ──Command──▶ ┌───────────┐ ◀── swarm events (kad, identify, mdns, ...)
//!  inventory poller ─snap─▶ │ EventLoop │ ──▶ put_record / start_providing / get_*
//!                          └───────────┘ ──▶ replies over each command's oneshot
//! ```
//!
//! Nothing slow runs here: NVML polling happens in its own task and arrives as
//! snapshots. The loop publishes this node's advert (a new sequence number whenever the
//! inventory or listen addresses change, and before expiry), filters records others
//! store with us through the advert book, answers offer queries by looking up providers
//! of a capability key and then each provider's advert, and withdraws the advert on
//! shutdown.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpunode_protocol::advert::{advert_record_key, capability_keys, peer_of_advert_key, Advert};
use gpunode_protocol::time::now_ms;
use libp2p::core::ConnectedPoint;
use libp2p::identity::Keypair;
use libp2p::kad::{self, QueryId, QueryResult, Quorum, Record, RecordKey};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::DialOpts;
use libp2p::swarm::SwarmEvent;
use libp2p::{identify, mdns, Multiaddr, PeerId, Swarm};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

mod finds;
mod leases;

use finds::PendingFind;

pub(crate) use leases::capacity_from;

use crate::adverts::{AdvertBook, AdvertStamp, LocalOffer};
use crate::inventory::InventorySnapshot;
use crate::lease::{LeaseDesk, LeaseRecord};
use crate::loop_client::Command;
use crate::metrics::Metrics;
use crate::network::{NodeBehaviour, NodeBehaviourEvent};
use crate::standings::PeerStandings;
use crate::store::Store;
use crate::views::{AdvertStatus, NodeStatus};
use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::lease::LeaseReply;
use libp2p::request_response::{OutboundRequestId, ResponseChannel};

/// How long an offer query may take before it answers with what it has.
const FIND_TIMEOUT: Duration = Duration::from_secs(8);
/// How long shutdown waits for the withdrawal to reach peers.
const WITHDRAW_TIMEOUT: Duration = Duration::from_secs(2);
/// Kademlia's replication factor: below this many stored copies we re-publish on new peers.
const REPLICATION: usize = 20;

/// Our own advert: what it says and where it stands.
struct OwnAdvert {
    offer: LocalOffer,
    ttl: Duration,
    record: Option<Vec<u8>>,
    status: AdvertStatus,
    provided: Vec<Vec<u8>>,
    published_at_table_size: usize,
    retry_backoff: Duration,
    needs_new: bool,
    publish_at: Option<Instant>,
    refresh_at: Instant,
}

pub(crate) struct EventLoop {
    swarm: Swarm<NodeBehaviour>,
    keypair: Keypair,
    commands: mpsc::Receiver<Command>,
    snapshots: mpsc::Receiver<InventorySnapshot>,
    store: Store,
    metrics: Arc<Metrics>,
    book: AdvertBook,
    local_peer: PeerId,
    inventory: InventorySnapshot,
    own: Option<OwnAdvert>,
    connections: HashMap<PeerId, usize>,
    finds: HashMap<u64, PendingFind>,
    next_find: u64,
    provider_queries: HashMap<QueryId, u64>,
    record_queries: HashMap<QueryId, (u64, PeerId)>,
    /// Every admission decision, and the lease book behind it.
    desk: LeaseDesk,
    /// How peers stand with this node (team and accounts), for the desk.
    standings: PeerStandings,
    lease_out: HashMap<OutboundRequestId, oneshot::Sender<Result<LeaseReply, String>>>,
    lease_replies: Vec<(ResponseChannel<LeaseReply>, LeaseReply)>,
    lease_jobs: crate::jobs::LeaseJobs,
    accounts: Arc<crate::Accounts>,
    ended_leases: mpsc::Sender<LeaseRecord>,
    /// Last ping round trip per connected peer.
    rtts: HashMap<PeerId, Duration>,
    /// Kademlia's protocol name (the public one, or the team's).
    kad_protocol: libp2p::StreamProtocol,
    /// The node's team, whose policy applies to lease requests.
    team: Option<Arc<crate::team::service::Team>>,
    /// GPU alert thresholds and what they have seen.
    alerts: crate::alerts::AlertWatch,
}

/// How the loop is set up.
pub(crate) struct LoopParts {
    pub swarm: Swarm<NodeBehaviour>,
    pub keypair: Keypair,
    pub commands: mpsc::Receiver<Command>,
    pub snapshots: mpsc::Receiver<InventorySnapshot>,
    pub store: Store,
    pub metrics: Arc<Metrics>,
    pub inventory: InventorySnapshot,
    /// `None` for a client that does not advertise.
    pub offer: Option<(LocalOffer, Duration)>,
    /// The lease desk, with the leases restored from the store.
    pub desk: LeaseDesk,
    /// Jobs running under each lease, stopped when it ends.
    pub lease_jobs: crate::jobs::LeaseJobs,
    /// Ledger, reputation and credit rules (lease admission).
    pub accounts: Arc<crate::Accounts>,
    /// Leases we provided that ended, for settlement.
    pub ended_leases: mpsc::Sender<LeaseRecord>,
    /// Kademlia's protocol name.
    pub kad_protocol: libp2p::StreamProtocol,
    /// The node's team.
    pub team: Option<Arc<crate::team::service::Team>>,
    /// GPU alert thresholds and hook.
    pub alerts: crate::alerts::AlertRules,
}

impl EventLoop {
    pub(crate) fn new(parts: LoopParts) -> EventLoop {
        let local_peer = *parts.swarm.local_peer_id();
        let own = parts.offer.map(|(offer, ttl)| OwnAdvert {
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
        });
        EventLoop {
            book: AdvertBook::new(parts.metrics.clone()),
            swarm: parts.swarm,
            keypair: parts.keypair,
            commands: parts.commands,
            snapshots: parts.snapshots,
            store: parts.store,
            metrics: parts.metrics,
            local_peer,
            inventory: parts.inventory,
            own,
            connections: HashMap::new(),
            finds: HashMap::new(),
            next_find: 0,
            provider_queries: HashMap::new(),
            record_queries: HashMap::new(),
            standings: crate::standings::PeerStandings::new(
                parts.team.clone(),
                parts.accounts.clone(),
            ),
            desk: parts.desk,
            lease_out: HashMap::new(),
            lease_replies: Vec::new(),
            lease_jobs: parts.lease_jobs,
            accounts: parts.accounts,
            ended_leases: parts.ended_leases,
            rtts: HashMap::new(),
            kad_protocol: parts.kad_protocol,
            team: parts.team,
            alerts: crate::alerts::AlertWatch::new(parts.alerts),
        }
    }

    fn next_timer(&self) -> Instant {
        let mut t = Instant::now() + Duration::from_secs(1);
        if let Some(own) = &self.own {
            if let Some(p) = own.publish_at {
                t = t.min(p);
            }
            t = t.min(own.refresh_at);
        }
        for f in self.finds.values() {
            t = t.min(f.deadline);
        }
        if let Some(due) = self.desk.book().next_deadline() {
            let wait = Duration::from_millis(due.saturating_sub(now_ms()));
            t = t.min(Instant::now() + wait);
        }
        t
    }

    pub(crate) async fn run(mut self) {
        loop {
            let timer = self.next_timer();
            tokio::select! {
                event = self.swarm.select_next_some() => {
                    self.on_swarm_event(event);
                    // Handle whatever else is ready before flushing, so one store flush
                    // covers a batch of lease replies (group commit).
                    for _ in 0..63 {
                        match futures::FutureExt::now_or_never(self.swarm.next()) {
                            Some(Some(event)) => self.on_swarm_event(event),
                            _ => break,
                        }
                    }
                }
                command = self.commands.recv() => match command {
                    Some(Command::Shutdown(done)) => {
                        self.withdraw().await;
                        let _ = done.send(());
                        return;
                    }
                    Some(command) => self.on_command(command),
                    None => {
                        self.withdraw().await;
                        return;
                    }
                },
                Some(snapshot) = self.snapshots.recv() => self.on_snapshot(snapshot),
                _ = tokio::time::sleep_until(timer) => self.on_timer(),
            }
            self.flush_lease_replies();
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Status(reply) => {
                let _ = reply.send(self.status());
            }
            Command::FindOffers { filter, reply } => self.start_find(filter, reply),
            Command::FindAdverts { peers, reply } => self.start_advert_fetch(peers, reply),
            Command::Shutdown(_) => {}
            Command::SendLease {
                peer,
                addrs,
                message,
                reply,
            } => self.send_lease(peer, addrs, message, reply),
            Command::RecordLease {
                terms,
                provider_sig,
                requester_sig,
                reply,
            } => {
                let _ = reply.send(self.record_requester_lease(terms, provider_sig, requester_sig));
            }
            Command::ApplyRenewal { signed, reply } => {
                let _ = reply.send(self.apply_renewal(signed));
            }
            Command::CancelLocal { prefix, reply } => {
                let _ = reply.send(self.cancel_local(&prefix));
            }
            Command::ResolveLease { prefix, reply } => {
                let book = self.desk.book();
                let r = book.resolve(&prefix).and_then(|id| {
                    book.get(&id)
                        .cloned()
                        .ok_or_else(|| "lease vanished".into())
                });
                let _ = reply.send(r);
            }
            Command::IsConnected { peer, reply } => {
                let _ = reply.send(self.connections.contains_key(&peer));
            }
            Command::KnownPrice { peer, reply } => {
                let price = self
                    .book
                    .latest(&peer, now_ms())
                    .map(|a| a.price_per_gpu_hour_millicredits);
                let _ = reply.send(price);
            }
            Command::TeamAllowed { peers } => self.set_team_allowed(peers),
            Command::GetLeases { ids, reply } => {
                let _ = reply.send(
                    ids.iter()
                        .map(|id| self.desk.book().get(id).cloned())
                        .collect(),
                );
            }
            Command::ListLeases(reply) => {
                let _ = reply.send(self.desk.book().all().into_iter().cloned().collect());
            }
        }
    }

    /// Team mode: lets exactly `peers` connect; drops the others and cancels their leases.
    fn set_team_allowed(&mut self, peers: std::collections::HashSet<PeerId>) {
        let Some(allow) = self.swarm.behaviour_mut().allow.as_mut() else {
            return;
        };
        let current: Vec<PeerId> = allow.allowed_peers().iter().copied().collect();
        for p in &peers {
            allow.allow_peer(*p);
        }
        let gone: Vec<PeerId> = current.into_iter().filter(|p| !peers.contains(p)).collect();
        for p in &gone {
            allow.disallow_peer(*p);
        }
        for p in gone {
            tracing::info!(peer = %p, "no longer a member of the team: disconnected");
            self.swarm.behaviour_mut().kad.remove_peer(&p);
            let effects = self.desk.cancel_peer(&p, now_ms());
            self.carry_out(effects);
        }
    }

    /// Applies the owner's policy to the leases on GPUs the owner uses now.
    fn enforce_owner_policy(&mut self) {
        let busy: std::collections::HashSet<&str> = self
            .inventory
            .gpus
            .iter()
            .filter(|g| g.state == GpuState::OwnerBusy)
            .map(|g| g.uuid.as_str())
            .collect();
        let effects = self.desk.enforce_owner_policy(&busy, now_ms());
        self.carry_out(effects);
    }

    fn status(&mut self) -> NodeStatus {
        let routing_table_size = self.routing_table_size();
        NodeStatus {
            peer_id: self.local_peer.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            listen_addrs: self.swarm.listeners().map(|a| a.to_string()).collect(),
            connected_peers: self.connections.keys().map(|p| p.to_string()).collect(),
            routing_table_size,
            advert: self
                .own
                .as_ref()
                .map(|o| o.status.clone())
                .unwrap_or_default(),
            inventory: self.inventory.clone(),
            external_addrs: self
                .swarm
                .external_addresses()
                .map(|a| format!("{a}/p2p/{}", self.local_peer))
                .collect(),
            team: None,
            running_jobs: self.lease_jobs.views(),
        }
    }

    fn routing_table_size(&mut self) -> usize {
        self.swarm
            .behaviour_mut()
            .kad
            .kbuckets()
            .map(|b| b.num_entries())
            .sum()
    }

    fn on_snapshot(&mut self, snapshot: InventorySnapshot) {
        if snapshot != self.inventory {
            if let Some(own) = &self.own {
                self.desk.set_capacity(capacity_from(
                    &snapshot,
                    own.offer.cpu_cores,
                    own.offer.ram_bytes,
                ));
            }
            let state_changed = snapshot.gpus.iter().map(|g| (&g.uuid, g.state)).ne(self
                .inventory
                .gpus
                .iter()
                .map(|g| (&g.uuid, g.state)));
            self.inventory = snapshot;
            if state_changed {
                self.schedule_publish(Duration::ZERO, true);
            }
            self.enforce_owner_policy();
            self.watch_gpus();
        }
    }

    /// GPU gauges, running jobs' gauges and alerts, from the latest inventory.
    fn watch_gpus(&mut self) {
        self.metrics.gpus.observe_gpus(&self.inventory);
        self.metrics.gpus.observe_jobs(&self.lease_jobs.views());
        let leased = self.desk.book().committed_gpus();
        for alert in self.alerts.check(&self.inventory, &leased, now_ms()) {
            self.metrics
                .gpus
                .alerts
                .get_or_create(&vec![("kind".to_string(), alert.kind.to_string())])
                .inc();
            crate::alerts::raise(&alert, self.alerts.hook());
        }
    }

    fn schedule_publish(&mut self, after: Duration, new_advert: bool) {
        if let Some(own) = &mut self.own {
            own.needs_new |= new_advert;
            let at = Instant::now() + after;
            own.publish_at = Some(own.publish_at.map_or(at, |p| p.min(at)));
        }
    }

    fn on_timer(&mut self) {
        self.enforce_owner_policy();
        self.watch_gpus();
        let now = Instant::now();
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
        if self
            .desk
            .book()
            .next_deadline()
            .is_some_and(|d| d <= now_ms())
        {
            self.tick_leases();
        }
        let expired: Vec<u64> = self
            .finds
            .iter()
            .filter(|(_, f)| f.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.complete_find(id);
        }
        let size = self.routing_table_size();
        self.metrics.routing_table_peers.set(size as i64);
        let m = &self.metrics;
        m.set_peer_state("lease_records", self.desk.book().record_count());
        m.set_peer_state("spent_nonces", self.desk.book().nonce_count());
        m.set_peer_state("adverts", self.book.len());
        m.set_peer_state("reputation_records", self.accounts.reputation.len());
        m.set_peer_state("refused_receipts", self.accounts.refused_count());
    }

    /// Signs a new advert if needed, stores it in the DHT and provides its capability keys.
    fn publish(&mut self, withdrawn: bool) -> Option<QueryId> {
        let listen_addrs: Vec<String> = self
            .swarm
            .external_addresses()
            .map(|a| a.to_string())
            .collect();
        let key = advert_record_key(&self.local_peer);
        let leased = self.desk.book().committed_gpus();
        let mut inventory_with_leases = self.inventory.clone();
        for g in &mut inventory_with_leases.gpus {
            if g.state == GpuState::Idle && leased.contains(&g.uuid) {
                g.state = GpuState::Leased;
            }
        }
        let own = self.own.as_mut()?;
        if own.needs_new || withdrawn || own.record.is_none() {
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
        }
        let table_size = self.routing_table_size();
        let own = self.own.as_mut()?;
        own.published_at_table_size = table_size;
        let mut record = Record::new(RecordKey::new(&key), own.record.clone()?);
        record.expires = Some(std::time::Instant::now() + own.ttl);
        let kad = &mut self.swarm.behaviour_mut().kad;
        let query = match kad.put_record(record, Quorum::All) {
            Ok(q) => Some(q),
            Err(e) => {
                tracing::warn!("cannot store own advert: {e:?}");
                None
            }
        };
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
        query
    }

    fn sign(&self, advert: &Advert) -> Option<Vec<u8>> {
        advert
            .sign(&self.keypair)
            .map_err(|e| tracing::error!("cannot sign advert: {e}"))
            .ok()
    }

    /// Publishes a withdrawn advert and waits (bounded) until a peer stored it, then
    /// flushes the store.
    async fn withdraw(&mut self) {
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

    fn on_swarm_event(&mut self, event: SwarmEvent<NodeBehaviourEvent>) {
        match event {
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!("listening on {address}");
                if !is_unspecified(&address) {
                    self.swarm.add_external_address(address);
                }
                self.schedule_publish(Duration::from_millis(50), true);
            }
            SwarmEvent::ConnectionEstablished {
                peer_id, endpoint, ..
            } => {
                *self.connections.entry(peer_id).or_default() += 1;
                self.metrics
                    .peers_connected
                    .set(self.connections.len() as i64);
                if let ConnectedPoint::Dialer { address, .. } = endpoint {
                    tracing::debug!(%peer_id, %address, "connected");
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established,
                ..
            } => {
                if num_established == 0 {
                    self.connections.remove(&peer_id);
                    self.rtts.remove(&peer_id);
                } else {
                    self.connections.insert(peer_id, num_established as usize);
                }
                self.metrics
                    .peers_connected
                    .set(self.connections.len() as i64);
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                tracing::debug!(?peer_id, "dial failed: {error}");
            }
            SwarmEvent::ListenerError { error, .. } => {
                tracing::warn!("listener error: {error}");
            }
            SwarmEvent::Behaviour(NodeBehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) if info.protocols.contains(&self.kad_protocol) => {
                for addr in info.listen_addrs {
                    self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
            }
            SwarmEvent::Behaviour(NodeBehaviourEvent::Mdns(mdns::Event::Discovered(list))) => {
                for (peer, addr) in list {
                    if !self.connections.contains_key(&peer) {
                        let _ = self
                            .swarm
                            .dial(DialOpts::peer_id(peer).addresses(vec![addr]).build());
                    }
                }
            }
            SwarmEvent::Behaviour(NodeBehaviourEvent::Ping(libp2p::ping::Event {
                peer,
                result: Ok(rtt),
                ..
            })) => {
                self.rtts.insert(peer, rtt);
            }
            SwarmEvent::Behaviour(NodeBehaviourEvent::Kad(event)) => self.on_kad_event(event),
            SwarmEvent::Behaviour(NodeBehaviourEvent::Lease(event)) => self.on_lease_event(event),
            _ => {}
        }
    }

    fn on_kad_event(&mut self, event: kad::Event) {
        match event {
            kad::Event::OutboundQueryProgressed {
                id,
                result,
                step,
                stats,
            } => match result {
                QueryResult::GetProviders(r) => {
                    self.on_providers(id, r, step.last, stats.num_requests())
                }
                QueryResult::GetRecord(r) => self.on_record(id, r, step.last, stats.num_requests()),
                QueryResult::PutRecord(r) => {
                    let stored = match &r {
                        Ok(_) => stats.num_successes() as usize,
                        Err(kad::PutRecordError::QuorumFailed { success, .. })
                        | Err(kad::PutRecordError::Timeout { success, .. }) => success.len(),
                    };
                    if let Some(own) = &mut self.own {
                        own.status.stored_at_peers = stored;
                    }
                    if let Err(e) = r {
                        tracing::debug!("advert publication incomplete: {e:?}");
                    }
                    self.retry_if_under_replicated(stored);
                }
                QueryResult::StartProviding(r) => {
                    let stored = match &r {
                        Ok(_) => stats.num_successes() as usize,
                        Err(_) => 0,
                    };
                    self.retry_if_under_replicated(stored);
                }
                _ => {}
            },
            kad::Event::InboundRequest { request } => match request {
                kad::InboundRequest::PutRecord {
                    source,
                    record: Some(record),
                    ..
                } => self.on_inbound_record(source, record),
                kad::InboundRequest::AddProvider {
                    record: Some(record),
                } if record.key.as_ref().starts_with(b"/gpunode/v1/cap/") => {
                    let _ = self
                        .swarm
                        .behaviour_mut()
                        .kad
                        .store_mut_add_provider(record);
                }
                _ => {}
            },
            kad::Event::RoutingUpdated { is_new_peer, .. } => {
                let size = self.routing_table_size();
                self.metrics.routing_table_peers.set(size as i64);
                // Re-publish whenever the network has grown by a quarter since we last
                // published: the peers closest to our keys may be new ones holding nothing.
                let republish = self.own.as_ref().is_some_and(|o| {
                    o.status.seq > 0
                        && size > o.published_at_table_size + o.published_at_table_size / 4
                });
                if is_new_peer && republish {
                    self.schedule_publish(Duration::from_millis(300), false);
                }
            }
            _ => {}
        }
    }

    /// Too few peers took our advert or provider record (peers busy, or the network
    /// still forming): publish again, backing off up to a minute.
    fn retry_if_under_replicated(&mut self, stored: usize) {
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

    fn on_inbound_record(&mut self, source: PeerId, mut record: Record) {
        let Some(publisher) = peer_of_advert_key(record.key.as_ref()) else {
            tracing::debug!(%source, "refused a record under a key that is not an advert key");
            self.metrics.advert_rejected("unknown_key");
            return;
        };
        let now = now_ms();
        if let Ok(advert) = self.book.accept(&record.value, &publisher, now) {
            record.expires = Some(
                std::time::Instant::now()
                    + Duration::from_millis(advert.expires_at_ms.saturating_sub(now)),
            );
            if let Err(e) = self.swarm.behaviour_mut().kad.store_mut_put(record) {
                tracing::debug!("cannot store advert: {e:?}");
            }
        }
    }
}

/// Store access that reads like the rest of the loop.
trait StoreAccess {
    fn store_mut_put(&mut self, record: Record) -> kad::store::Result<()>;
    fn store_mut_add_provider(&mut self, record: kad::ProviderRecord) -> kad::store::Result<()>;
}

impl StoreAccess for kad::Behaviour<kad::store::MemoryStore> {
    fn store_mut_put(&mut self, record: Record) -> kad::store::Result<()> {
        use kad::store::RecordStore;
        self.store_mut().put(record)
    }
    fn store_mut_add_provider(&mut self, record: kad::ProviderRecord) -> kad::store::Result<()> {
        use kad::store::RecordStore;
        self.store_mut().add_provider(record)
    }
}

fn is_unspecified(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| match p {
        Protocol::Ip4(ip) => ip.is_unspecified(),
        Protocol::Ip6(ip) => ip.is_unspecified(),
        _ => false,
    })
}

/// Dials every bootstrap address; peers named with `/p2p/` go into the routing table.
pub(crate) fn dial_bootstrap(swarm: &mut Swarm<NodeBehaviour>, addrs: &[Multiaddr]) {
    for addr in addrs {
        if let Some(Protocol::P2p(peer)) = addr.iter().last() {
            let mut plain = addr.clone();
            plain.pop();
            swarm.behaviour_mut().kad.add_address(&peer, plain);
        }
        if let Err(e) = swarm.dial(addr.clone()) {
            tracing::warn!("cannot dial bootstrap peer {addr}: {e}");
        }
    }
}
