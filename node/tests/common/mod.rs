//! Helpers shared by the tests that drive real swarms on 127.0.0.1.

use futures::StreamExt;
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{Multiaddr, Swarm};

/// Starts `swarm` listening on QUIC at 127.0.0.1 and returns where.
pub async fn listen<B: NetworkBehaviour>(swarm: &mut Swarm<B>) -> Multiaddr {
    swarm
        .listen_on("/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("addr"))
        .expect("listen");
    loop {
        if let SwarmEvent::NewListenAddr { address, .. } = swarm.select_next_some().await {
            return address;
        }
    }
}
