//! Our copy of libp2p-kad caps the requests a provider lookup keeps in flight once its
//! walk has stalled (a round of answers brought no peer closer to the key): upstream then
//! lets up to k = 20 be in flight at once, and a node that stops its lookups once the
//! peers nearest the key have answered (`event_loop::finds`) sends more than half of them
//! for nothing (`docs/benchmarks.md`, "Where a lookup's time goes now"). Real swarms on
//! 127.0.0.1: 40 Kademlia servers that all know each other and hold a provider record for
//! one key, and a client that knows one of them and looks the key up.

mod common;
use common::listen;

use std::num::NonZeroUsize;
use std::time::Duration;

use futures::StreamExt;
use gpunode_node::network::KAD_PROTOCOL;
use libp2p::kad::store::{MemoryStore, RecordStore};
use libp2p::kad::{self, ProviderRecord, RecordKey};
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{Multiaddr, PeerId, Swarm};

const SERVERS: usize = 40;
const BURST: usize = 8;

#[derive(NetworkBehaviour)]
struct KadOnly {
    kad: kad::Behaviour<MemoryStore>,
}

fn kad_swarm(burst: Option<usize>) -> Swarm<KadOnly> {
    libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_quic()
        .with_behaviour(|key| {
            let me = key.public().to_peer_id();
            let mut config = kad::Config::new(KAD_PROTOCOL);
            if let Some(burst) = burst.and_then(NonZeroUsize::new) {
                config.set_provider_lookup_burst(burst);
            }
            let mut kad = kad::Behaviour::with_config(me, MemoryStore::new(me), config);
            kad.set_mode(Some(kad::Mode::Server));
            KadOnly { kad }
        })
        .expect("behaviour")
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(30)))
        .build()
}

/// Starts the servers, each knowing all the others and holding a record of server 0
/// providing `key`, and drives them until the test ends. Returns their ids and addresses.
async fn servers(key: &RecordKey) -> Vec<(PeerId, Multiaddr)> {
    let mut swarms = Vec::with_capacity(SERVERS);
    let mut known = Vec::with_capacity(SERVERS);
    for _ in 0..SERVERS {
        let mut swarm = kad_swarm(None);
        let addr = listen(&mut swarm).await;
        swarm.add_external_address(addr.clone());
        known.push((*swarm.local_peer_id(), addr));
        swarms.push(swarm);
    }
    let (provider, provider_addr) = known[0].clone();
    for swarm in &mut swarms {
        let me = *swarm.local_peer_id();
        let kad = &mut swarm.behaviour_mut().kad;
        for (peer, addr) in known.iter().filter(|(p, _)| *p != me) {
            kad.add_address(peer, addr.clone());
        }
        let record = ProviderRecord::new(key.clone(), provider, vec![provider_addr.clone()]);
        kad.store_mut().add_provider(record).expect("store");
    }
    for mut swarm in swarms {
        tokio::spawn(async move {
            loop {
                swarm.select_next_some().await;
            }
        });
    }
    known
}

/// Looks `key` up from a new client that knows only `bootstrap`, and returns the most
/// requests the lookup had in flight at any of its steps, and whether it found the
/// provider.
async fn lookup(
    key: &RecordKey,
    bootstrap: &(PeerId, Multiaddr),
    burst: Option<usize>,
) -> (u32, bool) {
    let mut client = kad_swarm(burst);
    client
        .behaviour_mut()
        .kad
        .add_address(&bootstrap.0, bootstrap.1.clone());
    let query = client.behaviour_mut().kad.get_providers(key.clone());
    let (mut most_in_flight, mut found) = (0, false);
    loop {
        if let SwarmEvent::Behaviour(KadOnlyEvent::Kad(kad::Event::OutboundQueryProgressed {
            id,
            result,
            stats,
            step,
        })) = client.select_next_some().await
        {
            if id != query {
                continue;
            }
            most_in_flight = most_in_flight.max(stats.num_pending());
            found |= matches!(
                result,
                kad::QueryResult::GetProviders(Ok(kad::GetProvidersOk::FoundProviders { .. }))
            );
            if step.last {
                return (most_in_flight, found);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_provider_lookup_keeps_no_more_than_its_burst_in_flight() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let key = RecordKey::new(&b"gpu/test-model");
        let servers = servers(&key).await;
        let (capped, found) = lookup(&key, &servers[1], Some(BURST)).await;
        assert!(found, "the capped lookup found the provider");
        assert!(
            capped as usize <= BURST,
            "a capped lookup had {capped} requests in flight at once, over its {BURST}"
        );
        // The same walk without the cap (upstream's) has more in flight: the network
        // above does make a lookup stall, so the bound above was tested.
        let (upstream, found) = lookup(&key, &servers[2], None).await;
        assert!(found, "the lookup without a cap found the provider");
        assert!(
            upstream as usize > BURST,
            "without the cap a stalled lookup had only {upstream} in flight: this network \
             did not make it stall, so the test shows nothing"
        );
    })
    .await
    .expect("the test ran over 120 s");
}
