//! Reachability: which of its addresses a node tells peers about, and whether it is
//! public, behind NAT, or reached through a team relay.
//!
//! The rules, kept free of the swarm so they can be tested alone:
//! - Loopback addresses are advertised only by a node that has nothing else (a test
//!   network on one machine).
//! - Private addresses (RFC 1918, CGNAT, link-local, IPv6 ULA) are advertised while the
//!   node has no public or relayed address: LAN members dial them; once the node is
//!   reachable from outside they drop out, so peers elsewhere never try them.
//! - A node is *public* when one of its own addresses is public, or AutoNAT confirmed
//!   an address; *behind NAT* when peers see it at a public address that is not its own
//!   and nothing confirmed it; *relayed* when, behind NAT, it holds reservations on team
//!   relays.

use std::collections::BTreeSet;
use std::net::IpAddr;

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};

/// The kind of network an address is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// This machine only.
    Loopback,
    /// A LAN or carrier-grade NAT range.
    Private,
    /// Routable on the internet.
    Public,
    /// Through a relay (`/p2p-circuit`).
    Relayed,
}

/// Where `addr` can be reached from; `None` for addresses without an IP (DNS names).
pub fn scope_of(addr: &Multiaddr) -> Option<Scope> {
    if addr.iter().any(|p| matches!(p, Protocol::P2pCircuit)) {
        return Some(Scope::Relayed);
    }
    let ip = addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })?;
    Some(scope_of_ip(ip))
}

/// Where an IP address can be reached from.
pub fn scope_of_ip(ip: IpAddr) -> Scope {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            if v4.is_loopback() || v4.is_unspecified() {
                Scope::Loopback
            } else if v4.is_private() || v4.is_link_local() || (a == 100 && (64..128).contains(&b))
            {
                Scope::Private
            } else {
                Scope::Public
            }
        }
        IpAddr::V6(v6) => {
            let first = v6.segments()[0];
            if v6.is_loopback() || v6.is_unspecified() {
                Scope::Loopback
            } else if let Some(v4) = v6.to_ipv4_mapped() {
                scope_of_ip(IpAddr::V4(v4))
            } else if (first & 0xfe00) == 0xfc00 || (first & 0xffc0) == 0xfe80 {
                Scope::Private
            } else {
                Scope::Public
            }
        }
    }
}

/// The addresses, of `candidates`, that the node advertises (see the module doc).
pub fn advertised(candidates: &[Multiaddr]) -> Vec<Multiaddr> {
    let scopes: Vec<Option<Scope>> = candidates.iter().map(scope_of).collect();
    let outside = scopes
        .iter()
        .any(|s| matches!(s, Some(Scope::Public | Scope::Relayed)));
    let beyond_loopback = scopes.iter().any(|s| *s != Some(Scope::Loopback));
    let mut out: Vec<Multiaddr> = Vec::new();
    for (addr, scope) in candidates.iter().zip(scopes) {
        let keep = match scope {
            Some(Scope::Loopback) => !beyond_loopback,
            Some(Scope::Private) => !outside,
            Some(Scope::Public | Scope::Relayed) | None => true,
        };
        if keep && !out.contains(addr) {
            out.push(addr.clone());
        }
    }
    out
}

/// The addresses an advert lists, at most `max`: those peers anywhere can reach first
/// (public, then relayed), then those of unknown scope, then LAN and loopback ones.
pub fn best_reachable<'a>(
    addrs: impl Iterator<Item = &'a Multiaddr>,
    max: usize,
) -> Vec<Multiaddr> {
    let rank = |a: &Multiaddr| match scope_of(a) {
        Some(Scope::Public) => 0,
        Some(Scope::Relayed) => 1,
        None => 2,
        Some(Scope::Private) => 3,
        Some(Scope::Loopback) => 4,
    };
    let mut ranked: Vec<&Multiaddr> = addrs.collect();
    ranked.sort_by_key(|a| rank(a));
    ranked.into_iter().take(max).cloned().collect()
}

/// Whether a peer's address `addr` is worth keeping when we reach that peer over `link`:
/// its LAN and loopback addresses only mean something to a peer on the same LAN (or
/// machine), so a peer met across the internet is never dialled at them.
pub fn dialable_via(addr: &Multiaddr, link: &Multiaddr) -> bool {
    match (scope_of(addr), scope_of(link)) {
        (Some(Scope::Loopback), l) => l == Some(Scope::Loopback),
        (Some(Scope::Private), l) => matches!(l, Some(Scope::Loopback | Scope::Private)),
        _ => true,
    }
}

/// How peers outside the LAN reach this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reachability {
    /// Nothing known yet (no peer outside the LAN has seen the node).
    Unknown,
    /// Dialable at this address.
    Public(Multiaddr),
    /// Behind NAT: peers see it at this address, which does not take inbound dials.
    BehindNat(Multiaddr),
    /// Behind NAT, reachable through these team relays.
    Relayed(Vec<PeerId>),
}

impl std::fmt::Display for Reachability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reachability::Unknown => f.write_str("unknown (no peer outside this network yet)"),
            Reachability::Public(a) => write!(f, "public at {a}"),
            Reachability::BehindNat(a) => write!(f, "behind NAT (seen as {a})"),
            Reachability::Relayed(via) => {
                let via: Vec<String> = via.iter().map(|p| p.to_string()).collect();
                write!(f, "behind NAT, relayed via {}", via.join(", "))
            }
        }
    }
}

/// The most relays an unreachable node keeps reservations on.
pub const WANTED_RELAYS: usize = 2;

/// What the node has learnt about its own reachability.
#[derive(Debug, Default)]
pub struct NatState {
    /// A public address of the node's own, or one AutoNAT confirmed.
    public: Option<Multiaddr>,
    /// A public address peers see the node at that is not its own.
    seen_behind_nat: Option<Multiaddr>,
    /// Relays holding a reservation for the node.
    reservations: BTreeSet<PeerId>,
    /// Relays asked for a reservation, not answered yet.
    pending: BTreeSet<PeerId>,
}

impl NatState {
    /// The node listens on (or AutoNAT confirmed) `addr`.
    pub fn on_own_address(&mut self, addr: &Multiaddr) {
        if scope_of(addr) == Some(Scope::Public) {
            self.public = Some(addr.clone());
        }
    }

    /// A peer reports seeing the node at `observed`; `own_ips` are the node's listen IPs.
    pub fn on_observed(&mut self, observed: &Multiaddr, own_ips: &[IpAddr]) {
        if scope_of(observed) != Some(Scope::Public) {
            return;
        }
        let ip = observed.iter().find_map(|p| match p {
            Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
            Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
            _ => None,
        });
        if ip.is_some_and(|ip| !own_ips.contains(&ip)) {
            self.seen_behind_nat = Some(observed.clone());
        }
    }

    /// A relay answered a reservation request.
    pub fn on_reservation(&mut self, relay: PeerId, accepted: bool) {
        self.pending.remove(&relay);
        if accepted {
            self.reservations.insert(relay);
        } else {
            self.reservations.remove(&relay);
        }
    }

    /// The node asked `relay` for a reservation.
    pub fn on_reservation_asked(&mut self, relay: PeerId) {
        self.pending.insert(relay);
    }

    /// The reservation on `relay` (or the request for it) is gone.
    pub fn on_relay_lost(&mut self, relay: &PeerId) {
        self.pending.remove(relay);
        self.reservations.remove(relay);
    }

    /// Where the node stands.
    pub fn reachability(&self) -> Reachability {
        if let Some(a) = &self.public {
            Reachability::Public(a.clone())
        } else if !self.reservations.is_empty() {
            Reachability::Relayed(self.reservations.iter().copied().collect())
        } else if let Some(a) = &self.seen_behind_nat {
            Reachability::BehindNat(a.clone())
        } else {
            Reachability::Unknown
        }
    }

    /// How many relays hold a reservation for the node.
    pub fn reservation_count(&self) -> usize {
        self.reservations.len()
    }

    /// Whether peers cannot dial the node directly (it should not serve the DHT).
    pub fn behind_nat(&self) -> bool {
        self.public.is_none() && self.seen_behind_nat.is_some()
    }

    /// Whether the node should ask `relay` for a reservation now.
    pub fn wants_reservation_on(&self, relay: &PeerId) -> bool {
        self.behind_nat()
            && !self.reservations.contains(relay)
            && !self.pending.contains(relay)
            && self.reservations.len() + self.pending.len() < WANTED_RELAYS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> Multiaddr {
        s.parse().expect("multiaddr")
    }

    #[test]
    fn scopes_of_addresses() {
        assert_eq!(scope_of(&a("/ip4/127.0.0.1/tcp/1")), Some(Scope::Loopback));
        assert_eq!(scope_of(&a("/ip4/192.168.1.2/tcp/1")), Some(Scope::Private));
        assert_eq!(scope_of(&a("/ip4/10.1.2.3/tcp/1")), Some(Scope::Private));
        assert_eq!(scope_of(&a("/ip4/100.100.1.1/tcp/1")), Some(Scope::Private));
        assert_eq!(scope_of(&a("/ip4/169.254.1.1/tcp/1")), Some(Scope::Private));
        assert_eq!(scope_of(&a("/ip4/100.128.1.1/tcp/1")), Some(Scope::Public));
        assert_eq!(
            scope_of(&a("/ip4/198.51.100.2/udp/1/quic-v1")),
            Some(Scope::Public)
        );
        assert_eq!(scope_of(&a("/ip6/::1/tcp/1")), Some(Scope::Loopback));
        assert_eq!(scope_of(&a("/ip6/fd00::1/tcp/1")), Some(Scope::Private));
        assert_eq!(scope_of(&a("/ip6/fe80::1/tcp/1")), Some(Scope::Private));
        assert_eq!(scope_of(&a("/ip6/2001:db8::1/tcp/1")), Some(Scope::Public));
        assert_eq!(
            scope_of(&a("/ip6/::ffff:192.168.0.1/tcp/1")),
            Some(Scope::Private)
        );
        assert_eq!(
            scope_of(&a(
                "/ip4/198.51.100.2/tcp/1/p2p/12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxBhgFRcw3UERE/p2p-circuit"
            )),
            Some(Scope::Relayed)
        );
        assert_eq!(scope_of(&a("/dns4/example.org/tcp/1")), None);
    }

    #[test]
    fn loopback_only_when_nothing_else_and_private_only_when_not_reachable_outside() {
        let lo = a("/ip4/127.0.0.1/udp/1/quic-v1");
        let lan = a("/ip4/192.168.1.2/udp/1/quic-v1");
        let public = a("/ip4/198.51.100.2/udp/1/quic-v1");
        let relayed = a(
            "/ip4/198.51.100.2/udp/1/quic-v1/p2p/12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxBhgFRcw3UERE/p2p-circuit",
        );
        assert_eq!(advertised(std::slice::from_ref(&lo)), vec![lo.clone()]);
        assert_eq!(advertised(&[lo.clone(), lan.clone()]), vec![lan.clone()]);
        assert_eq!(
            advertised(&[lo.clone(), lan.clone(), public.clone()]),
            vec![public.clone()]
        );
        assert_eq!(
            advertised(&[lan.clone(), relayed.clone(), lan.clone()]),
            vec![relayed.clone()]
        );
        assert!(advertised(&[]).is_empty());
    }

    #[test]
    fn a_peer_met_across_the_internet_is_not_dialled_at_its_lan_addresses() {
        let lo = a("/ip4/127.0.0.1/udp/1/quic-v1");
        let lan = a("/ip4/192.168.1.2/udp/1/quic-v1");
        let public = a("/ip4/198.51.100.2/udp/1/quic-v1");
        assert!(dialable_via(&public, &public));
        assert!(dialable_via(&public, &lan));
        assert!(!dialable_via(&lan, &public));
        assert!(!dialable_via(&lo, &public));
        assert!(!dialable_via(&lo, &lan));
        assert!(dialable_via(&lan, &lan));
        assert!(dialable_via(&lan, &lo));
        assert!(dialable_via(&lo, &lo));
    }

    /// A host with more addresses than an advert may list keeps those peers anywhere can
    /// reach: 30 LAN addresses do not push out the public one or the relay circuit.
    #[test]
    fn an_advert_cut_to_its_bound_keeps_the_addresses_reachable_from_anywhere() {
        let public = a("/ip4/198.51.100.2/udp/1/quic-v1");
        let relayed = a(&format!(
            "/ip4/198.51.100.9/udp/1/quic-v1/p2p/{}/p2p-circuit",
            libp2p::PeerId::random()
        ));
        let mut all: Vec<Multiaddr> = (0..30)
            .map(|i| a(&format!("/ip4/192.168.1.{i}/udp/1/quic-v1")))
            .collect();
        all.push(a("/ip4/127.0.0.1/udp/1/quic-v1"));
        all.push(relayed.clone());
        all.push(public.clone());
        let kept = best_reachable(all.iter(), 20);
        assert_eq!(kept.len(), 20);
        assert_eq!(&kept[..2], &[public, relayed]);
        assert!(kept[2..]
            .iter()
            .all(|k| scope_of(k) == Some(Scope::Private)));
    }

    #[test]
    fn reachability_follows_what_peers_see() {
        let peer = PeerId::random();
        let mut nat = NatState::default();
        assert_eq!(nat.reachability(), Reachability::Unknown);
        // A LAN peer's view says nothing about NAT.
        nat.on_observed(&a("/ip4/192.168.1.2/udp/5/quic-v1"), &[]);
        assert_eq!(nat.reachability(), Reachability::Unknown);
        let own: IpAddr = "192.168.1.2".parse().expect("ip");
        let seen = a("/ip4/198.51.100.11/udp/5/quic-v1");
        nat.on_observed(&seen, &[own]);
        assert_eq!(nat.reachability(), Reachability::BehindNat(seen.clone()));
        assert!(nat.wants_reservation_on(&peer));
        nat.on_reservation_asked(peer);
        assert!(!nat.wants_reservation_on(&peer), "asked once");
        nat.on_reservation(peer, true);
        assert_eq!(nat.reachability(), Reachability::Relayed(vec![peer]));
        assert!(nat.reachability().to_string().contains(&peer.to_string()));
        let other = PeerId::random();
        assert!(nat.wants_reservation_on(&other), "a second relay");
        nat.on_reservation(other, true);
        assert!(
            !nat.wants_reservation_on(&PeerId::random()),
            "at most {WANTED_RELAYS}"
        );
        nat.on_relay_lost(&peer);
        nat.on_relay_lost(&other);
        assert_eq!(nat.reachability(), Reachability::BehindNat(seen));
        // AutoNAT confirms an address: public, no relay wanted.
        let confirmed = a("/ip4/198.51.100.11/udp/5/quic-v1");
        nat.on_own_address(&confirmed);
        assert_eq!(nat.reachability(), Reachability::Public(confirmed));
        assert!(!nat.behind_nat());
        assert!(!nat.wants_reservation_on(&peer));
    }

    #[test]
    fn a_node_seen_at_its_own_public_ip_is_not_behind_nat() {
        let mut nat = NatState::default();
        let own: IpAddr = "198.51.100.2".parse().expect("ip");
        nat.on_observed(&a("/ip4/198.51.100.2/tcp/4170"), &[own]);
        assert_eq!(nat.reachability(), Reachability::Unknown);
        assert!(!nat.behind_nat());
    }
}
