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
//!
//! This module holds the loop itself (set-up, the select loop, commands, timers,
//! status); [`publish`] owns our advert, [`swarm`] handles what the swarm reports,
//! [`finds`] answers offer queries and [`leases`] carries lease messages.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use gpunode_protocol::time::now_ms;
use libp2p::identity::Keypair;
use libp2p::kad::QueryId;
use libp2p::{Multiaddr, PeerId, Swarm};
use tokio::sync::mpsc;
use tokio::time::Instant;

mod finds;
mod leases;
mod nat;
mod publish;
mod swarm;

pub(crate) use finds::CLOSEST_ANSWERED;
use finds::{ParkedFinds, PendingFind};

pub(crate) use leases::capacity_from;
use publish::OwnAdvert;
pub(crate) use swarm::dial_bootstrap;

use crate::adverts::{AdvertBook, LocalOffer};
use crate::inventory::InventorySnapshot;
use crate::lease::negotiate::ProviderAdvert;
use crate::lease::{LeaseDesk, LeaseOpError, LeaseRecord};
use crate::loop_client::Command;
use crate::metrics::Metrics;
use crate::network::NodeBehaviour;
use crate::standings::PeerStandings;
use crate::store::Store;
use crate::views::NodeStatus;
use gpunode_protocol::gpu::GpuState;
use gpunode_protocol::lease::LeaseReply;
use libp2p::request_response::{OutboundRequestId, ResponseChannel};

/// How long an offer query may take before it answers with what it has.
const FIND_TIMEOUT: Duration = Duration::from_secs(8);

/// The open connections to one peer, oldest first (at most the per-peer cap).
#[derive(Debug, Default)]
struct Link {
    conns: Vec<Conn>,
    /// How many of them go through a relay (counted as they come and go: the loop's
    /// tick asks of every link, and a 200-node test network has 40,000 of them).
    relayed: usize,
}

/// One open connection of a [`Link`].
#[derive(Debug)]
struct Conn {
    id: libp2p::swarm::ConnectionId,
    /// The peer's address; for a connection the peer made through our relay, the
    /// relay's circuit (libp2p gives such a connection only `/p2p/<peer>` as its
    /// remote address).
    addr: Multiaddr,
    relayed: bool,
}

impl Conn {
    /// The connection `id` as libp2p describes it: relayed in either direction when
    /// its dialled or listening address is a relay's circuit.
    fn new(id: libp2p::swarm::ConnectionId, endpoint: &libp2p::core::ConnectedPoint) -> Conn {
        use libp2p::core::ConnectedPoint;
        let relayed = endpoint.is_relayed();
        let addr = match endpoint {
            ConnectedPoint::Listener { local_addr, .. } if relayed => local_addr.clone(),
            _ => endpoint.get_remote_address().clone(),
        };
        Conn { id, addr, relayed }
    }
}

impl Link {
    fn add(&mut self, conn: Conn) {
        self.relayed += usize::from(conn.relayed);
        self.conns.push(conn);
    }

    fn remove(&mut self, id: libp2p::swarm::ConnectionId) {
        if let Some(i) = self.conns.iter().position(|c| c.id == id) {
            let conn = self.conns.remove(i);
            self.relayed -= usize::from(conn.relayed);
        }
    }

    fn any_relayed(&self) -> bool {
        self.relayed > 0
    }

    fn all_relayed(&self) -> bool {
        self.relayed == self.conns.len()
    }

    /// How data would travel to the peer now: directly wherever a direct connection
    /// exists, since every new stream takes one (our copy of libp2p-stream prefers them;
    /// a relayed one left beside it closes shortly, see `retire_relayed`).
    fn path(&self) -> crate::views::LinkPath {
        if self.all_relayed() && self.any_relayed() {
            crate::views::LinkPath::Relayed
        } else {
            crate::views::LinkPath::Direct
        }
    }
}

/// Whether `addr` goes through a relay.
fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter()
        .any(|p| matches!(p, libp2p::multiaddr::Protocol::P2pCircuit))
}

/// The loop's regular tick (owner policy, GPU gauges and history, due publications).
const TICK: Duration = Duration::from_secs(1);

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
    connections: HashMap<PeerId, Link>,
    /// This loop's share of the process's connection count (see [`crate::heap`]).
    connection_count: crate::heap::ConnectionCount,
    /// Addresses gpunode peers report seeing this node at (identify), newest first.
    observed: swarm::ObservedAddrs,
    finds: HashMap<u64, PendingFind>,
    /// Peers our last dial to failed (their adverts come from the DHT for a while).
    unreachable: finds::Unreachable,
    next_find: u64,
    provider_queries: HashMap<QueryId, u64>,
    record_queries: HashMap<QueryId, (u64, PeerId)>,
    /// Direct advert fetches in flight: which query and which provider.
    advert_fetches: HashMap<OutboundRequestId, (u64, PeerId)>,
    /// Offer queries waiting for the routing table's first peer.
    parked_finds: ParkedFinds,
    /// When the loop started (young nodes park offer queries).
    started_at: Instant,
    /// When the regular tick is next due: a fixed cadence, so a stream of events or
    /// commands cannot keep pushing it back.
    tick_at: Instant,
    /// Every admission decision, and the lease book behind it.
    desk: LeaseDesk,
    /// How peers stand with this node (team and accounts), for the desk.
    standings: PeerStandings,
    lease_out: HashMap<OutboundRequestId, leases::Awaiting>,
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
    /// Samples of this machine's GPUs and the latest alerts (the dashboard's plots).
    history: crate::history::SharedHistory,
    /// What the node knows of its own reachability.
    nat: crate::nat::NatState,
    /// Team members that relay, and our reservations on them.
    relays: nat::Relays,
    /// Kademlia server mode as configured (a node behind NAT serves as a client).
    kad_server: bool,
    /// The bootstrap addresses, dialled again while the node is alone.
    redial: swarm::Redial,
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
    /// The node's team (its Kademlia protocol name, its policy).
    pub team: Option<Arc<crate::team::service::Team>>,
    /// GPU alert thresholds and hook.
    pub alerts: crate::alerts::AlertRules,
    /// Where GPU samples and alerts are kept.
    pub history: crate::history::SharedHistory,
    /// Kademlia server mode as configured.
    pub kad_server: bool,
    /// The bootstrap addresses, dialled again while the node has no connection.
    pub bootstrap: Vec<Multiaddr>,
}

impl EventLoop {
    pub(crate) fn new(parts: LoopParts) -> EventLoop {
        let local_peer = *parts.swarm.local_peer_id();
        let own = parts.offer.map(|(offer, ttl)| OwnAdvert::new(offer, ttl));
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
            connection_count: crate::heap::ConnectionCount::default(),
            observed: swarm::ObservedAddrs::default(),
            finds: HashMap::new(),
            unreachable: finds::Unreachable::default(),
            next_find: 0,
            provider_queries: HashMap::new(),
            record_queries: HashMap::new(),
            advert_fetches: HashMap::new(),
            parked_finds: ParkedFinds::default(),
            started_at: Instant::now(),
            redial: swarm::Redial::new(parts.bootstrap),
            tick_at: Instant::now() + TICK,
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
            kad_protocol: parts
                .team
                .as_ref()
                .map_or(crate::network::KAD_PROTOCOL, |t| t.state().kad_protocol()),
            team: parts.team,
            alerts: crate::alerts::AlertWatch::new(parts.alerts),
            history: parts.history,
            nat: crate::nat::NatState::default(),
            relays: nat::Relays::default(),
            kad_server: parts.kad_server,
        }
    }

    fn next_timer(&self) -> Instant {
        let mut t = self.tick_at;
        if let Some(own) = &self.own {
            if let Some(p) = own.publish_at {
                t = t.min(p);
            }
            t = t.min(own.refresh_at);
        }
        for f in self.finds.values() {
            t = t.min(f.deadline);
            if let Some(s) = f.lookup_settles_at() {
                t = t.min(s);
            }
        }
        if let Some(p) = self.parked_finds.deadline() {
            t = t.min(p);
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
                        self.history.save_now();
                        self.withdraw().await;
                        let _ = done.send(());
                        return;
                    }
                    Some(command) => self.on_command(command),
                    None => {
                        self.history.save_now();
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
            } => self.send_lease(peer, addrs, *message, leases::Awaiting::Reply(reply)),
            Command::ProposeLease {
                peer,
                addrs,
                proposal,
                reply,
            } => self.propose_lease(peer, addrs, *proposal, reply),
            Command::RecordLease {
                terms,
                provider_sig,
                requester_sig,
                reply,
            } => {
                let _ =
                    reply.send(self.record_requester_lease(*terms, provider_sig, requester_sig));
            }
            Command::ApplyRenewal { signed, reply } => {
                let _ = reply.send(self.apply_renewal(signed));
            }
            Command::CancelLocal { prefix, reply } => {
                let _ = reply.send(self.cancel_local(&prefix));
            }
            Command::ResolveLease { prefix, reply } => {
                let book = self.desk.book();
                let r = book
                    .resolve(&prefix)
                    .and_then(|id| book.get(&id).cloned().ok_or(LeaseOpError::Vanished));
                let _ = reply.send(r);
            }
            Command::WithdrawQueued {
                peer,
                ticket,
                reply,
            } => {
                let (withdrawn, effects) = self.desk.withdraw(&peer, ticket, now_ms());
                self.carry_out(effects);
                let _ = reply.send(withdrawn);
            }
            Command::IsConnected { peer, reply } => {
                let _ = reply.send(self.connections.contains_key(&peer));
            }
            Command::ProvidersHeld { key, reply } => {
                let key = libp2p::kad::RecordKey::new(&key);
                let store = self.swarm.behaviour_mut().kad.store_mut();
                let _ = reply.send(store.held(&key).iter().map(|r| r.provider).collect());
            }
            Command::PathTo { peer, reply } => {
                let _ = reply.send(self.connections.get(&peer).map(Link::path));
            }
            Command::ProviderQueue(reply) => {
                let team = self.team.clone();
                let shown = |p: &PeerId| team.as_ref().is_some_and(|t| t.is_member(p));
                let _ = reply.send(self.desk.queue_view(now_ms(), shown));
            }
            Command::KnownProviders(reply) => {
                let _ = reply.send(self.known_providers());
            }
            Command::Reach { peer, reply } => {
                let advertised = self.book.latest(&peer, now_ms()).map(|a| ProviderAdvert {
                    price: a.price_per_gpu_hour_millicredits,
                    gpus: a.gpus.clone(),
                });
                let _ = reply.send((self.connections.contains_key(&peer), advertised));
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
        let network_size_estimate = self.estimate_network_size();
        NodeStatus {
            peer_id: self.local_peer.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            listen_addrs: self.swarm.listeners().map(|a| a.to_string()).collect(),
            connected_peers: self.connections.keys().map(|p| p.to_string()).collect(),
            routing_table_size,
            network_size_estimate,
            advert: self
                .own
                .as_ref()
                .map(|o| o.view(network_size_estimate))
                .unwrap_or_default(),
            inventory: self.inventory.clone(),
            external_addrs: self
                .swarm
                .external_addresses()
                .map(|a| format!("{a}/p2p/{}", self.local_peer))
                .collect(),
            team: None,
            running_jobs: self.lease_jobs.views(),
            observed_addrs: self.observed.to_strings(),
            connections: self.connection_views(),
            reachability: self.nat.reachability().to_string(),
            dashboard_url: None,
        }
    }

    fn connection_views(&self) -> Vec<crate::views::ConnectionView> {
        let mut views: Vec<_> = self
            .connections
            .iter()
            .map(|(peer, link)| {
                let path = link.path();
                // Show a connection of the kind the path names (direct while any is).
                let address = link
                    .conns
                    .iter()
                    .rev()
                    .find(|c| c.relayed == (path == crate::views::LinkPath::Relayed))
                    .map(|c| c.addr.to_string())
                    .unwrap_or_default();
                crate::views::ConnectionView {
                    peer_id: peer.to_string(),
                    address,
                    path: path.to_string(),
                    rtt_ms: self.rtts.get(peer).map(|d| d.as_secs_f64() * 1000.0),
                }
            })
            .collect();
        views.sort_by(|a, b| a.peer_id.cmp(&b.peer_id));
        views
    }

    fn estimate_network_size(&mut self) -> f64 {
        publish::estimate_network_size(&mut self.swarm.behaviour_mut().kad, self.local_peer)
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

    /// Every provider in the advert book, with how we reach it and its reputation.
    fn known_providers(&self) -> Vec<crate::views::ProviderView> {
        let now = now_ms();
        self.book
            .current(now)
            .filter(|a| a.publisher != self.local_peer)
            .map(|a| {
                let mut offer = crate::views::OfferView::from(a);
                offer.rtt_ms = self
                    .rtts
                    .get(&a.publisher)
                    .map(|d| d.as_secs_f64() * 1000.0);
                offer.reputation = Some(self.accounts.reputation.score(&a.publisher));
                crate::views::ProviderView {
                    offer,
                    link: self.connections.get(&a.publisher).map(Link::path),
                    in_team: self
                        .team
                        .as_ref()
                        .is_some_and(|t| t.is_member(&a.publisher)),
                }
            })
            .collect()
    }

    /// In a team: its GPUs as this node sees them now (own inventory and the members'
    /// newest adverts): `(total, busy, leased)`.
    fn team_gpu_use(
        &self,
        leased: &std::collections::HashSet<String>,
        now: gpunode_protocol::time::UnixMillis,
    ) -> Option<(u32, u32, u32)> {
        use gpunode_protocol::gpu::GpuState;
        let team = self.team.as_ref()?;
        let (mut total, mut busy, mut lent) = (0u32, 0u32, 0u32);
        for g in &self.inventory.gpus {
            let is_lent = leased.contains(&g.uuid);
            total += 1;
            lent += u32::from(is_lent);
            busy +=
                u32::from(is_lent || g.state == GpuState::OwnerBusy || g.utilization_percent > 0);
        }
        for a in self.book.current(now) {
            if a.publisher == self.local_peer || !team.is_member(&a.publisher) {
                continue;
            }
            for g in &a.gpus {
                total += 1;
                lent += u32::from(g.state == GpuState::Leased);
                busy += u32::from(matches!(g.state, GpuState::Leased | GpuState::OwnerBusy));
            }
        }
        Some((total, busy, lent))
    }

    /// GPU gauges, running jobs' gauges and alerts, from the latest inventory.
    fn watch_gpus(&mut self) {
        self.metrics.gpus.observe_gpus(&self.inventory);
        self.metrics.gpus.observe_jobs(&self.lease_jobs.views());
        let leased = self.desk.book().committed_gpus();
        let now = now_ms();
        let alerts = self.alerts.check(&self.inventory, &leased, now);
        let team = || self.team_gpu_use(&leased, now);
        self.history
            .record(&self.inventory, &leased, &alerts, team, now);
        for alert in alerts {
            self.metrics
                .gpus
                .alerts
                .get_or_create(&vec![("kind".to_string(), alert.kind.to_string())])
                .inc();
            crate::alerts::raise(&alert, self.alerts.hook());
        }
    }

    /// The timer: what fell due (leases' deadlines, publication, lookups), and once a
    /// [`TICK`] the upkeep. A busy provider's timer fires at every lease's end, up to
    /// thousands of times a second, and the upkeep need not run that often.
    fn on_timer(&mut self) {
        let now = Instant::now();
        if now >= self.tick_at {
            self.tick_at = now + TICK;
            self.upkeep(now);
        }
        self.publish_if_due(now);
        if self
            .desk
            .book()
            .next_deadline()
            .is_some_and(|d| d <= now_ms())
        {
            self.tick_leases();
        }
        self.settle_quiet_lookups(now);
        let expired: Vec<u64> = self
            .finds
            .iter()
            .filter(|(_, f)| f.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.complete_find(id);
        }
        if self.parked_finds.deadline().is_some_and(|p| p <= now) {
            self.release_parked_finds();
        }
    }

    /// Once a [`TICK`]: the owner's rule, GPU watch and history, relays, redials and
    /// the gauges.
    fn upkeep(&mut self, now: Instant) {
        self.enforce_owner_policy();
        self.watch_gpus();
        self.maintain_relays();
        self.close_retired(now);
        self.publish_if_settled(now);
        if self.connections.is_empty() {
            self.redial.due(now, &mut self.swarm);
        } else {
            self.redial.connected();
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::swarm::ConnectionId;

    #[test]
    fn a_link_counts_its_relayed_connections_as_they_come_and_go() {
        use libp2p::core::{transport::PortUse, ConnectedPoint, Endpoint};
        let relay = "/ip4/203.0.113.1/udp/4170/quic-v1/p2p/12D3KooWLNvLPJoMh3H4NbzvY77QWRydafF2jZTbs1WwV9ppmj9g/p2p-circuit";
        let peer = "12D3KooWJRry3dR3cxiVyUMBRonirrTLgshrUVWvNJQkefXkPhF8";
        let dialed = |address: String| ConnectedPoint::Dialer {
            address: address.parse().unwrap(),
            role_override: Endpoint::Dialer,
            port_use: PortUse::Reuse,
        };
        let direct = dialed("/ip4/198.51.100.7/udp/4170/quic-v1".into());
        let relayed_out = dialed(format!("{relay}/p2p/{peer}"));
        // The peer reached us through our relay: libp2p's remote address for such a
        // connection is only `/p2p/<peer>`, the circuit is the local address.
        let relayed_in = ConnectedPoint::Listener {
            local_addr: relay.parse().unwrap(),
            send_back_addr: format!("/p2p/{peer}").parse().unwrap(),
        };
        let (a, b, c) = (
            ConnectionId::new_unchecked(1),
            ConnectionId::new_unchecked(2),
            ConnectionId::new_unchecked(3),
        );
        let mut link = Link::default();
        link.add(Conn::new(a, &relayed_out));
        assert!(link.all_relayed());
        assert_eq!(link.path(), crate::views::LinkPath::Relayed);
        link.add(Conn::new(c, &relayed_in));
        assert!(
            link.all_relayed(),
            "an inbound relayed connection is relayed"
        );
        assert_eq!(link.conns[1].addr.to_string(), relay);
        link.add(Conn::new(b, &direct));
        assert!(link.any_relayed() && !link.all_relayed());
        assert_eq!(
            link.path(),
            crate::views::LinkPath::Direct,
            "streams take the direct connection beside relayed ones"
        );
        link.remove(a);
        link.remove(a);
        link.remove(c);
        assert!(!link.any_relayed());
        assert_eq!(link.path(), crate::views::LinkPath::Direct);
        link.remove(b);
        assert!(link.conns.is_empty() && !link.any_relayed());
        link.add(Conn::new(c, &relayed_in));
        assert_eq!(link.relayed, 1);
        assert_eq!(link.path(), crate::views::LinkPath::Relayed);
    }
}
