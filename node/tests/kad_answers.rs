//! What a node's Kademlia answer to `GET_PROVIDERS` names, over the wire: real swarms on
//! 127.0.0.1, a server with gpunode's record store (`gpunode_node::dht_store`) and a
//! client that knows only it. Asked for one shard of a shared key, the server names the
//! providers it holds of every shard of that key (and of no other key), up to gpunode's
//! answer limit instead of libp2p's k = 20; the client learns whose answer it was, which
//! is how a query counts one answer for all its shards (`event_loop::finds`).

mod common;
use common::listen;

use std::collections::HashSet;
use std::num::NonZeroUsize;
use std::time::Duration;

use futures::StreamExt;
use gpunode_node::dht_store::DhtStore;
use gpunode_node::network::KAD_PROTOCOL;
use gpunode_protocol::advert::shard_groups;
use libp2p::kad::store::{MemoryStoreConfig, RecordStore};
use libp2p::kad::{self, ProviderRecord, RecordKey};
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{Multiaddr, PeerId, Swarm};

/// gpunode's limit (`network::PROVIDER_ANSWER_LIMIT`, crate-private).
const ANSWER_LIMIT: usize = 64;

#[derive(NetworkBehaviour)]
struct KadOnly {
    kad: kad::Behaviour<DhtStore>,
}

fn kad_swarm(answer_limit: Option<usize>) -> Swarm<KadOnly> {
    libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_quic()
        .with_behaviour(|key| {
            let me = key.public().to_peer_id();
            let mut config = kad::Config::new(KAD_PROTOCOL);
            config.set_max_packet_size(64 * 1024);
            if let Some(limit) = answer_limit.and_then(NonZeroUsize::new) {
                config.set_provider_answer_limit(limit);
            }
            let store = DhtStore::new(
                me,
                MemoryStoreConfig {
                    max_providers_per_key: 256,
                    ..MemoryStoreConfig::default()
                },
            );
            let mut kad = kad::Behaviour::with_config(me, store, config);
            kad.set_mode(Some(kad::Mode::Server));
            KadOnly { kad }
        })
        .expect("behaviour")
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(30)))
        .build()
}

/// Registers `n` made-up providers of `key` at `swarm`, each with one address.
fn hold(swarm: &mut Swarm<KadOnly>, key: &[u8], n: usize) -> HashSet<PeerId> {
    let address: Multiaddr = "/ip4/127.0.0.1/udp/9/quic-v1".parse().expect("addr");
    let peers: HashSet<PeerId> = (0..n).map(|_| PeerId::random()).collect();
    for p in &peers {
        let record = ProviderRecord::new(RecordKey::new(&key), *p, vec![address.clone()]);
        let store = swarm.behaviour_mut().kad.store_mut();
        store.add_provider(record).expect("store");
    }
    peers
}

/// Starts a server with `answer_limit` holding the given providers, and returns the
/// providers a client's lookup of `asked` heard from it, and those it held of each key.
async fn answer(
    answer_limit: Option<usize>,
    held: &[(&[u8], usize)],
    asked: &[u8],
) -> (HashSet<PeerId>, Vec<HashSet<PeerId>>) {
    let mut server = kad_swarm(answer_limit);
    let addr = listen(&mut server).await;
    let server_id = *server.local_peer_id();
    let held: Vec<HashSet<PeerId>> = held
        .iter()
        .map(|(key, n)| hold(&mut server, key, *n))
        .collect();
    let driver = tokio::spawn(async move {
        loop {
            server.select_next_some().await;
        }
    });
    let mut client = kad_swarm(answer_limit);
    client.behaviour_mut().kad.add_address(&server_id, addr);
    let query = client
        .behaviour_mut()
        .kad
        .get_providers(RecordKey::new(&asked));
    // The server's answer is the lookup's first progress from a peer (the walk goes on
    // to the made-up providers it names, which answer nothing: not waited for).
    let (named, source) = loop {
        if let SwarmEvent::Behaviour(KadOnlyEvent::Kad(kad::Event::OutboundQueryProgressed {
            id,
            result:
                kad::QueryResult::GetProviders(Ok(kad::GetProvidersOk::FoundProviders {
                    providers,
                    source: Some(source),
                    ..
                })),
            ..
        })) = client.select_next_some().await
        {
            if id == query {
                break (providers, source);
            }
        }
    };
    driver.abort();
    assert_eq!(source, server_id, "the answer says whose it is");
    (named, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_lookup_is_answered_with_every_shard_of_its_key_up_to_the_limit() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let groups = shard_groups();
        let (any, gpu) = (&groups[0], &groups[1]);
        // 30 providers of `any` shard 2 and 10 of shard 5; 6 of `gpu` shard 2 and 7 of
        // a model key, which an answer for `any` must not name.
        let held: Vec<(&[u8], usize)> = vec![
            (&any[2], 30),
            (&any[5], 10),
            (&gpu[2], 6),
            (b"/gpunode/v1/cap/model/A100", 7),
        ];
        let (named, sets) = answer(Some(ANSWER_LIMIT), &held, &any[2]).await;
        let of_any: HashSet<PeerId> = sets[0].union(&sets[1]).copied().collect();
        assert_eq!(named, of_any, "both shards of `any`, all 40, in one answer");
        // Asked for a shard it holds nothing of, it still names the key's other shards.
        let (named, sets) = answer(Some(ANSWER_LIMIT), &held, &any[7]).await;
        assert_eq!(named, sets[0].union(&sets[1]).copied().collect());
        // libp2p's own limit, for comparison: k = 20 of the 40.
        let (named, sets) = answer(None, &held, &any[2]).await;
        assert_eq!(
            named.len(),
            20,
            "without gpunode's limit an answer names 20"
        );
        assert!(named.is_subset(&sets[0]), "its own shard's providers first");
        // More than the limit held: the answer names the limit, its own shard's first
        // (a full answer, which a query does not take as complete).
        let crowded: Vec<(&[u8], usize)> = vec![(&any[1], 50), (&any[3], 50)];
        let (named, sets) = answer(Some(ANSWER_LIMIT), &crowded, &any[1]).await;
        assert_eq!(named.len(), ANSWER_LIMIT);
        assert!(sets[0].is_subset(&named), "all 50 of the shard asked for");
        assert!(named.is_subset(&sets[0].union(&sets[1]).copied().collect()));
    })
    .await
    .expect("within a minute");
}
