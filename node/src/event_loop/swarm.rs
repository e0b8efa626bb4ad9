//! What the swarm reports: listen addresses, connections, identify, mDNS and ping
//! events, Kademlia query progress and records other peers store with us; and dialing
//! the bootstrap peers.

use std::time::Duration;

use gpunode_protocol::advert::peer_of_advert_key;
use gpunode_protocol::time::now_ms;
use libp2p::core::ConnectedPoint;
use libp2p::kad::{self, QueryResult, Record};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::DialOpts;
use libp2p::swarm::{DialError, SwarmEvent};
use libp2p::{identify, mdns, Multiaddr, PeerId, Swarm};
use tokio::time::Instant;

use super::EventLoop;

use crate::network::{NodeBehaviour, NodeBehaviourEvent};

/// The most distinct observed addresses kept (a peer may report anything).
const MAX_OBSERVED_ADDRS: usize = 8;

/// How long after its start a node in Kademlia server mode (a provider that peers can
/// reach) ends its bootstraps' far-bucket walks (see [`end_bootstrap_walk`]). libp2p
/// bootstraps again 5 min after the last bootstrap started; from the first of those on,
/// far buckets are refreshed as libp2p does. A node in client mode (a client, or a
/// provider behind NAT) runs them always: nobody walks to it, so its routing table
/// holds only what its own walks find, and one such node's walks do not mesh a network.
const JOINING: Duration = Duration::from_secs(4 * 60);

/// Addresses gpunode peers report seeing this node at (identify), newest first, distinct
/// and at most [`MAX_OBSERVED_ADDRS`].
#[derive(Debug, Default)]
pub(super) struct ObservedAddrs(std::collections::VecDeque<Multiaddr>);

impl ObservedAddrs {
    /// Remembers `addr` as the newest.
    fn note(&mut self, addr: Multiaddr) {
        self.0.retain(|a| a != &addr);
        self.0.push_front(addr);
        self.0.truncate(MAX_OBSERVED_ADDRS);
    }

    /// The addresses, newest first.
    pub(super) fn to_strings(&self) -> Vec<String> {
        self.0.iter().map(|a| a.to_string()).collect()
    }
}

impl EventLoop {
    pub(super) fn on_swarm_event(&mut self, event: SwarmEvent<NodeBehaviourEvent>) {
        match event {
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!("listening on {address}");
                if !is_unspecified(&address) {
                    self.nat.on_own_address(&address);
                    self.swarm.add_external_address(address);
                    self.apply_address_policy();
                }
                self.schedule_publish(Duration::from_millis(50), true);
            }
            SwarmEvent::ExternalAddrConfirmed { address } => {
                tracing::info!("reachable at {address}");
                self.nat.on_own_address(&address);
                self.apply_address_policy();
                self.schedule_publish(Duration::from_millis(50), true);
            }
            SwarmEvent::ExternalAddrExpired { .. } => {
                self.schedule_publish(Duration::from_millis(50), true);
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                endpoint,
                connection_id,
                ..
            } => {
                self.connections
                    .entry(peer_id)
                    .or_default()
                    .add(super::Conn::new(connection_id, &endpoint));
                self.retire_relayed(&peer_id);
                self.unreachable.reached(&peer_id);
                self.connection_count.opened();
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
                connection_id,
                ..
            } => {
                self.connection_count.closed();
                if num_established == 0 {
                    self.connections.remove(&peer_id);
                    self.rtts.remove(&peer_id);
                    self.relays.forget(&peer_id);
                    self.nat.on_relay_lost(&peer_id);
                } else if let Some(link) = self.connections.get_mut(&peer_id) {
                    link.remove(connection_id);
                }
                self.relays.forget_connection(connection_id);
                self.metrics
                    .peers_connected
                    .set(self.connections.len() as i64);
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                tracing::debug!(?peer_id, "dial failed: {error}");
                if let (Some(peer), DialError::Transport(_)) = (peer_id, &error) {
                    self.unreachable.dial_failed(peer, Instant::now());
                }
            }
            SwarmEvent::ListenerError { error, .. } => {
                tracing::warn!("listener error: {error}");
            }
            SwarmEvent::Behaviour(NodeBehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) if info.protocols.contains(&self.kad_protocol) => {
                self.on_observed(&info.observed_addr);
                self.observed.note(info.observed_addr);
                if info.protocols.contains(&libp2p::relay::HOP_PROTOCOL_NAME) {
                    self.note_relay(peer_id, &info.listen_addrs);
                }
                let link = self
                    .connections
                    .get(&peer_id)
                    .and_then(|l| l.conns.last())
                    .map(|c| c.addr.clone());
                for addr in info.listen_addrs {
                    if link
                        .as_ref()
                        .is_none_or(|l| crate::nat::dialable_via(&addr, l))
                    {
                        self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                    }
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
            SwarmEvent::Behaviour(NodeBehaviourEvent::Advert(event)) => self.on_advert_event(event),
            SwarmEvent::Behaviour(NodeBehaviourEvent::RelayClient(event)) => {
                self.on_relay_client_event(event)
            }
            SwarmEvent::Behaviour(NodeBehaviourEvent::Dcutr(event)) => self.on_punch(event),
            SwarmEvent::Behaviour(NodeBehaviourEvent::Autonat(event)) => {
                self.on_autonat_event(event)
            }
            SwarmEvent::Behaviour(NodeBehaviourEvent::Upnp(event)) => self.on_upnp_event(event),
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                ..
            } => self.on_listener_closed(listener_id, reason),
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
                QueryResult::GetClosestPeers(r) => {
                    let peers = match r {
                        Ok(ok) => ok.peers,
                        Err(kad::GetClosestPeersError::Timeout { peers, .. }) => peers,
                    };
                    self.on_closest_peers(id, peers);
                }
                QueryResult::PutRecord(r) => {
                    let stored = match r {
                        Ok(_) => None,
                        Err(e) => {
                            tracing::debug!("advert publication incomplete: {e:?}");
                            match e {
                                kad::PutRecordError::QuorumFailed { success, .. }
                                | kad::PutRecordError::Timeout { success, .. } => Some(success),
                            }
                        }
                    };
                    self.on_advert_stored(id, stored);
                }
                QueryResult::StartProviding(r) => {
                    let stored = match &r {
                        Ok(_) => stats.num_successes() as usize,
                        Err(_) => 0,
                    };
                    self.on_provided(id, stored);
                }
                QueryResult::Bootstrap(_) => {
                    let walk = if step.count.get() == 1 {
                        "own_key"
                    } else {
                        "far_bucket"
                    };
                    self.metrics.dht_bootstrap_walk(walk, stats.num_requests());
                    let server = self.swarm.behaviour().kad.mode() == kad::Mode::Server;
                    if !step.last && server && self.started_at.elapsed() < JOINING {
                        end_bootstrap_walk(&mut self.swarm, id);
                    }
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
                if !self.parked_finds.is_empty() {
                    self.release_parked_finds();
                }
                let size = self.routing_table_size();
                self.metrics.routing_table_peers.set(size as i64);
                if is_new_peer {
                    if let Some(own) = self.own.as_mut() {
                        own.grew_at = tokio::time::Instant::now();
                    }
                }
                // Re-publish whenever the network has doubled since we last published
                // (growth seen while a round runs is folded into that round, whose end
                // takes the network's size then as the new base).
                let idle = self.own.as_ref().is_some_and(|o| !o.in_round());
                if is_new_peer && idle {
                    let network_size = self.estimate_network_size();
                    if self.own.as_ref().is_some_and(|o| o.outgrown(network_size)) {
                        self.schedule_publish(super::publish::GROWTH_DELAY, false);
                    }
                }
            }
            _ => {}
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
            tracing::debug!(%source, %publisher, seq = advert.seq, "storing an advert");
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

impl StoreAccess for kad::Behaviour<crate::dht_store::DhtStore> {
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

/// How often a node with no connection dials its bootstrap addresses again: the peers
/// may have been down, or turned it away, when it started (a new team member starting
/// before the inviter has let it in).
const REDIAL_EVERY: Duration = Duration::from_secs(10);

/// The bootstrap addresses, and when a node that has no connection dials them again.
pub(crate) struct Redial {
    addrs: Vec<Multiaddr>,
    next_at: Instant,
    /// The node has been alone since the last redial was announced (once per stretch
    /// without a connection, so a lone node's log says why it dials, without repeating).
    announced: bool,
}

impl Redial {
    /// Dials again from [`REDIAL_EVERY`] after start.
    pub(crate) fn new(addrs: Vec<Multiaddr>) -> Redial {
        Redial {
            addrs,
            next_at: Instant::now() + REDIAL_EVERY,
            announced: false,
        }
    }

    /// The node has a connection: the next stretch alone is announced again.
    pub(crate) fn connected(&mut self) {
        self.announced = false;
    }

    /// Dials the bootstrap addresses if it is time (the caller has no connection).
    pub(crate) fn due(&mut self, now: Instant, swarm: &mut Swarm<NodeBehaviour>) {
        if self.addrs.is_empty() || now < self.next_at {
            return;
        }
        self.next_at = now + REDIAL_EVERY;
        if self.announced {
            tracing::debug!("no connection: dialling the bootstrap peers again");
        } else {
            self.announced = true;
            tracing::info!(
                "no connection: dialling the bootstrap peers again (every {} s while alone)",
                REDIAL_EVERY.as_secs()
            );
        }
        dial_bootstrap(swarm, &self.addrs);
    }
}

/// Ends the walk a Kademlia bootstrap has just started. libp2p's bootstrap looks up the
/// node's own key, then walks to a random key in every farther bucket, one after
/// another; each of those walks opens connections to some twenty peers around its key,
/// and with publication's walks every node that joined a network of 200 ended up
/// connected to all the others. Without these walks such a network forms in about two
/// thirds of the time. The lookup of the own key, and the walks of publication and
/// searches, fill the routing table meanwhile: the peers that answer on the way from
/// the bootstrap peer lie in the far buckets. A walk ended here ends before it sends
/// anything, and the bootstrap goes on to the next.
fn end_bootstrap_walk(swarm: &mut Swarm<NodeBehaviour>, id: kad::QueryId) {
    if let Some(mut query) = swarm.behaviour_mut().kad.query_mut(&id) {
        query.finish();
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_reported_addresses_keeps_the_newest_eight_once_each() {
        let mut seen = ObservedAddrs::default();
        let addr = |i: u32| -> Multiaddr {
            format!("/ip4/203.0.113.{}/udp/{}/quic-v1", i % 250, 1000 + i)
                .parse()
                .unwrap()
        };
        for i in 0..10_000 {
            seen.note(addr(i));
        }
        let kept = seen.to_strings();
        assert_eq!(kept.len(), MAX_OBSERVED_ADDRS);
        assert_eq!(kept[0], addr(9_999).to_string(), "newest first");
        // Reported again: moved to the front, not kept twice.
        seen.note(addr(9_995));
        let kept = seen.to_strings();
        assert_eq!(kept.len(), MAX_OBSERVED_ADDRS);
        assert_eq!(kept[0], addr(9_995).to_string());
        assert_eq!(
            kept.iter()
                .filter(|a| **a == addr(9_995).to_string())
                .count(),
            1
        );
    }
}
