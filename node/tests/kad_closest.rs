//! Our copy of libp2p-kad (vendor/README.md) changes how a key's closest peers are
//! drawn from the routing table: every Kademlia request a node answers, and every walk
//! it starts, begins there. These tests check what is drawn against the whole table
//! sorted by distance.

use libp2p::kad::{self, store::MemoryStore, KBucketKey};
use libp2p::{Multiaddr, PeerId};

/// A routing table filled from 2,000 random peers (its buckets keep at most 20 each),
/// and the peers it kept.
fn filled_table() -> (kad::Behaviour<MemoryStore>, Vec<PeerId>) {
    let me = PeerId::random();
    let mut kad = kad::Behaviour::new(me, MemoryStore::new(me));
    let addr: Multiaddr = "/ip4/127.0.0.1/udp/9/quic-v1".parse().expect("addr");
    for _ in 0..2000 {
        kad.add_address(&PeerId::random(), addr.clone());
    }
    let kept: Vec<PeerId> = kad
        .kbuckets()
        .flat_map(|bucket| {
            bucket
                .iter()
                .map(|entry| *entry.node.key.preimage())
                .collect::<Vec<_>>()
        })
        .collect();
    (kad, kept)
}

fn by_distance(peers: &[PeerId], target: &KBucketKey<PeerId>) -> Vec<PeerId> {
    let mut sorted = peers.to_vec();
    sorted.sort_by_key(|p| target.distance(&KBucketKey::from(*p)));
    sorted
}

#[test]
fn the_closest_local_peers_are_the_whole_table_in_order_of_distance() {
    let (mut kad, kept) = filled_table();
    assert!(kept.len() > 100, "the table kept only {} peers", kept.len());
    for _ in 0..100 {
        let target = KBucketKey::from(PeerId::random());
        let drawn: Vec<PeerId> = kad
            .get_closest_local_peers(&target)
            .map(|key| *key.preimage())
            .collect();
        assert_eq!(drawn, by_distance(&kept, &target));
    }
}

#[test]
fn a_request_is_answered_with_the_twenty_closest_but_the_asker() {
    let (mut kad, kept) = filled_table();
    for i in 0..100 {
        let target = KBucketKey::from(PeerId::random());
        // Half the time the asker is in the table, among the closest to the key.
        let asker = if i % 2 == 0 {
            by_distance(&kept, &target)[3]
        } else {
            PeerId::random()
        };
        let answer: Vec<kad::KadPeer> = kad.find_closest_local_peers(&target, &asker).collect();
        let expected: Vec<PeerId> = by_distance(&kept, &target)
            .into_iter()
            .filter(|p| *p != asker)
            .take(20)
            .collect();
        assert_eq!(
            answer.iter().map(|p| p.node_id).collect::<Vec<_>>(),
            expected
        );
        assert!(answer.iter().all(|p| p.multiaddrs.len() == 1));
    }
}
