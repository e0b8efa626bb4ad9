//! Streams negotiated lazily over libp2p's QUIC, as a node opens them
//! (`network::negotiate_lazily`: Kademlia, the advert fetch, leases). A lazy dialer
//! sends its message right behind the protocol proposal; these tests check, between
//! real swarms on 127.0.0.1, that a message sent without an answer still arrives (the
//! vendored multistream-select's close waits for the listener's confirmation, see
//! vendor/README.md) and that a peer refusing the protocol is told apart from a failed
//! connection.

mod common;
use common::listen;

use std::time::Duration;

use futures::StreamExt;
use gpunode_node::adverts::fetch::{self, AdvertQuery};
use gpunode_node::network::{negotiate_lazily, refused_protocol, KAD_PROTOCOL};
use libp2p::kad::store::{MemoryStore, RecordStore};
use libp2p::kad::{self, RecordKey};
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{identity, ping, request_response, Swarm};

#[derive(NetworkBehaviour)]
struct KadOnly {
    kad: kad::Behaviour<MemoryStore>,
}

#[derive(NetworkBehaviour)]
struct PingOnly {
    ping: ping::Behaviour,
}

#[derive(NetworkBehaviour)]
struct AdvertAsker {
    advert: request_response::Behaviour<fetch::AdvertCodec>,
}

fn swarm<B: NetworkBehaviour>(behaviour: impl FnOnce(&identity::Keypair) -> B) -> Swarm<B> {
    libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_quic()
        .with_behaviour(|key| behaviour(key))
        .expect("behaviour")
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(30)))
        .build()
}

/// A Kademlia server under the node's protocol name.
fn kad_server() -> Swarm<KadOnly> {
    swarm(|key| {
        let me = key.public().to_peer_id();
        let mut kad =
            kad::Behaviour::with_config(me, MemoryStore::new(me), kad::Config::new(KAD_PROTOCOL));
        kad.set_mode(Some(kad::Mode::Server));
        KadOnly { kad }
    })
}

/// Kademlia's `ADD_PROVIDER` is sent without an answer: the dialer writes it, closes
/// and drops the stream. Opened lazily, the stream used to be dropped before the
/// listener's confirmation came, which over QUIC stopped the listener's sending side;
/// its confirmation failed and the record, which had arrived whole, was never read.
/// Every record must now reach the peer it was sent to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_records_sent_on_lazy_streams_are_stored() {
    negotiate_lazily(&KAD_PROTOCOL);
    let mut holder = kad_server();
    let holder_id = *holder.local_peer_id();
    let addr = listen(&mut holder).await;
    let mut provider = kad_server();
    let provider_id = *provider.local_peer_id();
    provider.behaviour_mut().kad.add_address(&holder_id, addr);
    let keys: Vec<RecordKey> = (0..16)
        .map(|i| RecordKey::new(&format!("/gpunode/v1/cap/test/{i}")))
        .collect();
    for key in &keys {
        provider
            .behaviour_mut()
            .kad
            .start_providing(key.clone())
            .expect("provide");
    }

    let stored = |holder: &mut Swarm<KadOnly>| {
        keys.iter()
            .filter(|k| {
                holder
                    .behaviour_mut()
                    .kad
                    .store_mut()
                    .providers(k)
                    .iter()
                    .any(|p| p.provider == provider_id)
            })
            .count()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while stored(&mut holder) < keys.len() {
        tokio::select! {
            _ = holder.select_next_some() => {}
            _ = provider.select_next_some() => {}
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    assert_eq!(
        stored(&mut holder),
        keys.len(),
        "provider records sent on lazily negotiated streams were lost"
    );
}

/// A Kademlia stream opened lazily counts as negotiated before the peer has confirmed
/// the protocol. A peer that does not serve Kademlia (a client-mode node, or any peer a
/// hostile one names in its answers) must still stay out of the routing table when a
/// walk asks it: our copy of libp2p-kad takes a peer to serve the protocol only once a
/// request was answered (vendor/README.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_refuses_kademlia_stays_out_of_the_routing_table() {
    negotiate_lazily(&KAD_PROTOCOL);
    let mut outsider = swarm(|_| PingOnly {
        ping: ping::Behaviour::default(),
    });
    let outsider_id = *outsider.local_peer_id();
    let outsider_addr = listen(&mut outsider).await;
    // A server that names the outsider in its answers.
    let mut namer = kad_server();
    let namer_id = *namer.local_peer_id();
    let namer_addr = listen(&mut namer).await;
    namer
        .behaviour_mut()
        .kad
        .add_address(&outsider_id, outsider_addr);
    let mut walker = kad_server();
    walker
        .behaviour_mut()
        .kad
        .add_address(&namer_id, namer_addr);
    walker.behaviour_mut().kad.get_closest_peers(outsider_id);

    let mut dialed_outsider = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        tokio::select! {
            _ = outsider.select_next_some() => {}
            _ = namer.select_next_some() => {}
            event = walker.select_next_some() => match event {
                SwarmEvent::ConnectionEstablished { peer_id, .. } if peer_id == outsider_id => {
                    dialed_outsider = true;
                }
                SwarmEvent::Behaviour(KadOnlyEvent::Kad(
                    kad::Event::OutboundQueryProgressed { step, .. },
                )) if step.last => break,
                _ => {}
            },
            _ = tokio::time::sleep_until(deadline) => panic!("the walk never ended"),
        }
    }
    assert!(dialed_outsider, "the walk never asked the outsider");
    // Let the connection's handler report whatever it concluded.
    let settle = tokio::time::Instant::now() + Duration::from_millis(500);
    loop {
        tokio::select! {
            _ = outsider.select_next_some() => {}
            _ = namer.select_next_some() => {}
            _ = walker.select_next_some() => {}
            _ = tokio::time::sleep_until(settle) => break,
        }
    }
    let in_table = walker
        .behaviour_mut()
        .kad
        .kbuckets()
        .any(|b| b.iter().any(|e| *e.node.key.preimage() == outsider_id));
    assert!(
        !in_table,
        "a peer that refused Kademlia entered the routing table"
    );
    // The namer, which answered, is taken to serve Kademlia: its entry (put there by
    // hand, disconnected) is marked connected only by that confirmation.
    let namer_confirmed = walker.behaviour_mut().kad.kbuckets().any(|b| {
        b.iter()
            .any(|e| *e.node.key.preimage() == namer_id && e.status == kad::NodeStatus::Connected)
    });
    assert!(
        namer_confirmed,
        "a peer that answered was not taken to serve Kademlia"
    );
}

/// An advert fetch to a peer that does not serve the advert protocol (an older build)
/// must read as a refused protocol, so the asker falls back to the DHT, not as a peer
/// that cannot be reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_advert_protocol_refuses_it_as_such() {
    let mut old = swarm(|_| PingOnly {
        ping: ping::Behaviour::default(),
    });
    let old_id = *old.local_peer_id();
    let addr = listen(&mut old).await;
    let mut asker = swarm(|_| AdvertAsker {
        advert: fetch::behaviour(),
    });
    asker
        .behaviour_mut()
        .advert
        .send_request_with_addresses(&old_id, AdvertQuery, vec![addr]);

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let failure = loop {
        tokio::select! {
            _ = old.select_next_some() => {}
            event = asker.select_next_some() => {
                match event {
                    SwarmEvent::Behaviour(AdvertAskerEvent::Advert(
                        request_response::Event::OutboundFailure { error, .. },
                    )) => break error,
                    SwarmEvent::Behaviour(other) => panic!("unexpected {other:?}"),
                    _ => {}
                }
            }
            _ = tokio::time::sleep_until(deadline) => panic!("the fetch never ended"),
        }
    };
    assert!(
        refused_protocol(&failure),
        "a refused advert protocol read as {failure:?}"
    );
    assert!(
        matches!(failure, request_response::OutboundFailure::Io(_)),
        "the advert stream was not negotiated lazily: {failure:?}"
    );
}
