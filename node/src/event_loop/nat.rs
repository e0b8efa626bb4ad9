//! Reachability in the loop: which addresses peers are told, reservations on team relays
//! while the node is behind NAT, AutoNAT and UPnP results, and hole punches, after which
//! the relayed connection is closed so data takes the direct one.

use std::collections::HashMap;
use std::time::Duration;

use libp2p::core::transport::ListenerId;
use libp2p::multiaddr::Protocol;
use libp2p::{autonat, dcutr, kad, relay, upnp, Multiaddr, PeerId};
use tokio::time::Instant;

use super::{is_relayed, EventLoop};
use crate::nat::{scope_of, Scope};

/// How long a relay that refused or dropped a reservation is left alone.
const RELAY_RETRY_AFTER: Duration = Duration::from_secs(30);
/// How long a relayed connection stays once a direct one to the same peer exists, so
/// that requests already on it get their answers.
const RELAYED_CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Team members that relay, and this node's reservations on them.
#[derive(Debug, Default)]
pub(super) struct Relays {
    /// Connected relays and the address to reach each (from identify).
    known: HashMap<PeerId, Multiaddr>,
    /// The `/p2p-circuit` listener opened on each relay.
    listeners: HashMap<ListenerId, PeerId>,
    /// Relays not to ask again before this.
    retry_after: HashMap<PeerId, Instant>,
    /// Relayed connections to close (a direct one replaced them), and when.
    retiring: HashMap<libp2p::swarm::ConnectionId, Instant>,
}

impl Relays {
    /// `peer` is gone: no longer a relay candidate.
    pub(super) fn forget(&mut self, peer: &PeerId) {
        self.known.remove(peer);
    }

    /// Connection `id` closed.
    pub(super) fn forget_connection(&mut self, id: libp2p::swarm::ConnectionId) {
        self.retiring.remove(&id);
    }
}

impl EventLoop {
    /// Keeps the swarm's external addresses (what identify, provider records and our
    /// advert carry) to those [`crate::nat::advertised`] allows, out of the listen and
    /// confirmed addresses.
    pub(super) fn apply_address_policy(&mut self) {
        let current: Vec<Multiaddr> = self.swarm.external_addresses().cloned().collect();
        let mut candidates = current.clone();
        for l in self.swarm.listeners() {
            if !is_unspecified(l) && !candidates.contains(l) {
                candidates.push(l.clone());
            }
        }
        let keep = crate::nat::advertised(&candidates);
        for a in &current {
            if !keep.contains(a) {
                self.swarm.remove_external_address(a);
            }
        }
        for a in keep {
            if !current.contains(&a) {
                self.swarm.add_external_address(a);
            }
        }
    }

    /// A peer reports seeing us at `observed`.
    pub(super) fn on_observed(&mut self, observed: &Multiaddr) {
        let own_ips: Vec<std::net::IpAddr> = self
            .swarm
            .listeners()
            .filter(|a| !is_relayed(a))
            .filter_map(ip_of)
            .collect();
        let before = self.nat.reachability();
        self.nat.on_observed(observed, &own_ips);
        if self.nat.reachability() != before {
            self.nat_changed();
        }
    }

    /// `peer`, a connected team member, relays; `addrs` are the addresses it advertises.
    pub(super) fn note_relay(&mut self, peer: PeerId, addrs: &[Multiaddr]) {
        if self.team.is_none() {
            return;
        }
        let dialable = |s: Scope| addrs.iter().find(|a| scope_of(a) == Some(s)).cloned();
        let Some(addr) = dialable(Scope::Public)
            .or_else(|| dialable(Scope::Private))
            .or_else(|| dialable(Scope::Loopback))
        else {
            return;
        };
        self.relays.known.insert(peer, addr);
        self.maintain_relays();
    }

    /// Behind NAT in a team: asks connected relays for reservations, up to
    /// [`crate::nat::WANTED_RELAYS`].
    pub(super) fn maintain_relays(&mut self) {
        if self.team.is_none() || !self.nat.behind_nat() {
            return;
        }
        let now = Instant::now();
        self.relays.retry_after.retain(|_, t| *t > now);
        let mut picks: Vec<(PeerId, Multiaddr)> = self
            .relays
            .known
            .iter()
            .filter(|(p, _)| !self.relays.retry_after.contains_key(p))
            .map(|(p, a)| (*p, a.clone()))
            .collect();
        picks.sort_by_key(|(p, _)| p.to_bytes());
        for (relay, addr) in picks {
            if !self.nat.wants_reservation_on(&relay) {
                continue;
            }
            let circuit = addr.with(Protocol::P2p(relay)).with(Protocol::P2pCircuit);
            match self.swarm.listen_on(circuit.clone()) {
                Ok(id) => {
                    tracing::info!("behind NAT: asking team relay {relay} for a reservation");
                    self.relays.listeners.insert(id, relay);
                    self.nat.on_reservation_asked(relay);
                }
                Err(e) => {
                    tracing::debug!("cannot listen on {circuit}: {e}");
                    self.relays
                        .retry_after
                        .insert(relay, now + RELAY_RETRY_AFTER);
                }
            }
        }
    }

    /// A listener closed: if it was a relay reservation, the relay is lost for now.
    pub(super) fn on_listener_closed(
        &mut self,
        id: ListenerId,
        reason: Result<(), std::io::Error>,
    ) {
        let Some(relay) = self.relays.listeners.remove(&id) else {
            if let Err(e) = reason {
                tracing::warn!("a listener closed: {e}");
            }
            return;
        };
        match reason {
            Ok(()) => tracing::info!("reservation on team relay {relay} ended"),
            Err(e) => tracing::info!("team relay {relay} gave no reservation: {e}"),
        }
        self.nat.on_relay_lost(&relay);
        self.relays
            .retry_after
            .insert(relay, Instant::now() + RELAY_RETRY_AFTER);
        self.nat_changed();
    }

    pub(super) fn on_relay_client_event(&mut self, event: relay::client::Event) {
        match event {
            relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal,
                ..
            } => {
                if !renewal {
                    tracing::info!("reachable through team relay {relay_peer_id}");
                }
                self.nat.on_reservation(relay_peer_id, true);
                self.nat_changed();
            }
            relay::client::Event::OutboundCircuitEstablished { relay_peer_id, .. } => {
                tracing::debug!("circuit through {relay_peer_id} established");
            }
            relay::client::Event::InboundCircuitEstablished { src_peer_id, .. } => {
                tracing::debug!("{src_peer_id} reached us through a relay");
            }
        }
    }

    /// With a direct connection to `peer`, its relayed ones close after
    /// [`RELAYED_CLOSE_GRACE`], so every stream (job data above all) takes the direct one.
    pub(super) fn retire_relayed(&mut self, peer: &PeerId) {
        let Some(link) = self.connections.get(peer) else {
            return;
        };
        if link.all_relayed() {
            return;
        }
        let at = Instant::now() + RELAYED_CLOSE_GRACE;
        for conn in link.conns.iter().filter(|c| c.relayed) {
            self.relays.retiring.entry(conn.id).or_insert(at);
        }
    }

    /// Closes the retired relayed connections whose grace is over. Relayed connections
    /// that came while a direct one existed (an AutoNAT dial-back through the relay, for
    /// one) are retired here too.
    pub(super) fn close_retired(&mut self, now: Instant) {
        let mixed: Vec<PeerId> = self
            .connections
            .iter()
            .filter(|(_, l)| l.any_relayed() && !l.all_relayed())
            .map(|(p, _)| *p)
            .collect();
        for peer in mixed {
            self.retire_relayed(&peer);
        }
        let due: Vec<_> = self
            .relays
            .retiring
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            self.relays.retiring.remove(&id);
            let closing = self.swarm.close_connection(id);
            tracing::debug!(
                ?id,
                closing,
                "closing a relayed connection: a direct one exists"
            );
        }
    }

    /// A hole punch ended (the direct connection it made retires the relayed one).
    pub(super) fn on_punch(&mut self, event: dcutr::Event) {
        let peer = event.remote_peer_id;
        match event.result {
            Ok(_) => {
                self.metrics.hole_punch("success");
                tracing::info!(%peer, "hole punch succeeded: direct connection");
            }
            Err(e) => {
                self.metrics.hole_punch("failure");
                tracing::info!(%peer, "hole punch failed ({e}): only the relay connects us");
            }
        }
    }

    pub(super) fn on_autonat_event(&mut self, event: autonat::v2::client::Event) {
        match event.result {
            Ok(()) => tracing::debug!(
                "{} confirmed that {} takes inbound connections",
                event.server,
                event.tested_addr
            ),
            Err(e) => tracing::debug!(
                "{} could not dial us back at {}: {e}",
                event.server,
                event.tested_addr
            ),
        }
    }

    pub(super) fn on_upnp_event(&mut self, event: upnp::Event) {
        match event {
            upnp::Event::NewExternalAddr {
                local_addr,
                external_addr,
            } => tracing::info!("UPnP: the router forwards {external_addr} to {local_addr}"),
            upnp::Event::ExpiredExternalAddr { external_addr, .. } => {
                tracing::info!("UPnP: the router no longer forwards {external_addr}")
            }
            upnp::Event::GatewayNotFound => tracing::info!("UPnP: no router offers it here"),
            upnp::Event::NonRoutableGateway => {
                tracing::info!("UPnP: the router is itself behind NAT; mapping would not help")
            }
        }
    }

    /// After reachability changed: Kademlia mode, the reservation gauge, relays and
    /// advertised addresses follow.
    pub(super) fn nat_changed(&mut self) {
        let mode = if self.kad_server && !self.nat.behind_nat() {
            kad::Mode::Server
        } else {
            kad::Mode::Client
        };
        if self.swarm.behaviour().kad.mode() != mode {
            tracing::info!("reachability: {}; DHT mode {mode}", self.nat.reachability());
            self.swarm.behaviour_mut().kad.set_mode(Some(mode));
        }
        self.metrics
            .relay_reservations
            .set(self.nat.reservation_count() as i64);
        self.maintain_relays();
        self.apply_address_policy();
    }
}

fn is_unspecified(addr: &Multiaddr) -> bool {
    ip_of(addr).is_some_and(|ip| ip.is_unspecified())
}

fn ip_of(addr: &Multiaddr) -> Option<std::net::IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(ip.into()),
        Protocol::Ip6(ip) => Some(ip.into()),
        _ => None,
    })
}
