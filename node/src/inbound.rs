//! [`IpLimit`]: a libp2p behaviour that refuses inbound connections from one IP address
//! past a limit (libp2p's `connection_limits` covers totals, pending and per-peer limits,
//! not addresses, and a flood of fresh peer ids from one host would pass those). Limits
//! on streams are the router's ([`crate::router::StreamGate`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::task::{Context, Poll};

use libp2p::core::transport::PortUse;
use libp2p::core::Endpoint;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{
    dummy, ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm,
};
use libp2p::{Multiaddr, PeerId};

use crate::metrics::Metrics;

/// The IP address a multiaddr starts with, if any.
pub fn ip_of(addr: &Multiaddr) -> Option<IpAddr> {
    match addr.iter().next()? {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    }
}

/// The address an inbound connection counts against: its IP. One that came through our
/// relay has none (libp2p gives it `/p2p/<peer>` as its remote address), and is not
/// counted: the relay's IP would be shared by every member it relays for, and the relay
/// limits its circuits itself.
fn counted_ip(remote: &Multiaddr) -> Option<IpAddr> {
    if remote.iter().any(|p| matches!(p, Protocol::P2pCircuit)) {
        return None;
    }
    ip_of(remote)
}

/// Refuses inbound connections from an IP address that already has `max_per_ip`
/// established; `0` means no limit.
#[derive(Debug)]
pub struct IpLimit {
    max_per_ip: u32,
    per_ip: HashMap<IpAddr, u32>,
    by_connection: HashMap<ConnectionId, IpAddr>,
    metrics: Option<Arc<Metrics>>,
}

impl IpLimit {
    /// A limit of `max_per_ip` inbound connections per remote address (0: none).
    pub fn new(max_per_ip: u32, metrics: Option<Arc<Metrics>>) -> IpLimit {
        IpLimit {
            max_per_ip,
            per_ip: HashMap::new(),
            by_connection: HashMap::new(),
            metrics,
        }
    }

    /// Counts refusals in `metrics` from now on.
    pub fn set_metrics(&mut self, metrics: Arc<Metrics>) {
        self.metrics = Some(metrics);
    }

    fn check(&self, remote: &Multiaddr) -> Result<(), ConnectionDenied> {
        let Some(ip) = counted_ip(remote) else {
            return Ok(());
        };
        let n = self.per_ip.get(&ip).copied().unwrap_or(0);
        if self.max_per_ip > 0 && n >= self.max_per_ip {
            if let Some(m) = &self.metrics {
                m.connections_refused.inc();
            }
            return Err(ConnectionDenied::new(io::Error::other(format!(
                "{ip} already has {n} connections here (the most one address may have)"
            ))));
        }
        Ok(())
    }
}

impl NetworkBehaviour for IpLimit {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_pending_inbound_connection(
        &mut self,
        _connection_id: ConnectionId,
        _local_addr: &Multiaddr,
        remote_addr: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        self.check(remote_addr)
    }

    fn handle_established_inbound_connection(
        &mut self,
        _connection_id: ConnectionId,
        _peer: PeerId,
        _local_addr: &Multiaddr,
        remote_addr: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.check(remote_addr)?;
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _connection_id: ConnectionId,
        _peer: PeerId,
        _addr: &Multiaddr,
        _role_override: Endpoint,
        _port_use: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            // Counted only once every behaviour accepted the connection.
            FromSwarm::ConnectionEstablished(e) if e.endpoint.is_listener() => {
                if let Some(ip) = counted_ip(e.endpoint.get_remote_address()) {
                    *self.per_ip.entry(ip).or_default() += 1;
                    self.by_connection.insert(e.connection_id, ip);
                }
            }
            FromSwarm::ConnectionClosed(e) => {
                if let Some(ip) = self.by_connection.remove(&e.connection_id) {
                    if let Some(n) = self.per_ip.get_mut(&ip) {
                        *n = n.saturating_sub(1);
                        if *n == 0 {
                            self.per_ip.remove(&ip);
                        }
                    }
                }
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _peer: PeerId,
        _connection: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(
        &mut self,
        _cx: &mut Context<'_>,
    ) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_addresses_are_read_from_multiaddrs() {
        let a: Multiaddr = "/ip4/127.0.0.2/udp/4170/quic-v1".parse().expect("addr");
        assert_eq!(ip_of(&a), Some("127.0.0.2".parse().expect("ip")));
        let d: Multiaddr = "/dns4/example.invalid/tcp/1".parse().expect("addr");
        assert_eq!(ip_of(&d), None);
        let limit = IpLimit::new(1, None);
        assert!(limit.check(&a).is_ok());
        let mut full = IpLimit::new(1, None);
        full.per_ip.insert("127.0.0.2".parse().expect("ip"), 1);
        assert!(full.check(&a).is_err());
        let other: Multiaddr = "/ip4/127.0.0.3/udp/4170/quic-v1".parse().expect("addr");
        assert!(full.check(&other).is_ok());
        assert!(IpLimit::new(0, None).check(&a).is_ok(), "0: no limit");
        // A connection through our relay has only `/p2p/<peer>` as its remote address
        // (libp2p-relay's `send_back_addr`), and one shaped as the relay's circuit would
        // carry the relay's IP: neither is counted against an address.
        let relayed: Multiaddr = "/p2p/12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxBhgFRcw3UERE"
            .parse()
            .expect("addr");
        assert!(full.check(&relayed).is_ok());
        let circuit: Multiaddr = "/ip4/127.0.0.2/udp/4170/quic-v1/p2p/12D3KooWRBhwfeP2Y4TCx1SM6s9rUoHhR5STiGwxBhgFRcw3UERE/p2p-circuit"
            .parse()
            .expect("addr");
        assert!(full.check(&circuit).is_ok());
    }
}
