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

/// Our copy also tells whether the peers nearest a query's key have all answered
/// (`QueryMut::closest_answered`): the provider lookup stops early only then. Peers not
/// yet asked and peers still being asked have not; a peer whose dial failed has.
#[test]
fn a_query_knows_when_the_peers_nearest_its_key_have_answered() {
    use libp2p::swarm::{
        dial_opts::DialOpts, ConnectionId, DialError, DialFailure, FromSwarm, NetworkBehaviour,
        ToSwarm,
    };
    use std::task::{Context, Poll};

    let me = PeerId::random();
    let mut kad = kad::Behaviour::new(me, MemoryStore::new(me));
    let addr: Multiaddr = "/ip4/127.0.0.1/udp/9/quic-v1".parse().expect("addr");
    let peers: Vec<PeerId> = (0..12).map(|_| PeerId::random()).collect();
    for p in &peers {
        kad.add_address(p, addr.clone());
    }
    let key = kad::RecordKey::new(&b"model/a100");
    let target = KBucketKey::from(key.to_vec());
    let mut nearest = peers.clone();
    nearest.sort_by_key(|p| target.distance(&KBucketKey::from(*p)));
    let query = kad.get_providers(key);
    let answered_given = |kad: &mut kad::Behaviour<MemoryStore>, n: usize, elsewhere: &[PeerId]| {
        let elsewhere: std::collections::HashSet<PeerId> = elsewhere.iter().copied().collect();
        kad.query_mut(&query)
            .expect("running")
            .closest_answered(n, &elsewhere)
    };
    let answered = |kad: &mut kad::Behaviour<MemoryStore>, n: usize| answered_given(kad, n, &[]);
    assert!(!answered(&mut kad, 1), "nobody asked yet");
    // Peers that answered another query for this one's key too count as answered;
    // others (here the farthest) do not stand in for the nearest.
    assert!(answered_given(&mut kad, 2, &nearest[..2]));
    assert!(!answered_given(&mut kad, 3, &nearest[..2]));
    assert!(!answered_given(&mut kad, 2, &nearest[10..]));

    // The query asks the nearest peers first, three at a time: it dials them.
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    let mut dialled = Vec::new();
    while let Poll::Ready(event) = kad.poll(&mut cx) {
        if let ToSwarm::Dial { opts } = event {
            let opts: DialOpts = opts;
            dialled.push(opts.get_peer_id().expect("a peer"));
        }
    }
    // (A bootstrap of kad's own may dial too, if its timer fires meanwhile.)
    assert!(
        nearest[..3].iter().all(|p| dialled.contains(p)),
        "the three nearest are asked first"
    );
    assert!(!answered(&mut kad, 1), "being asked is not having answered");

    for (i, peer) in nearest[..3].iter().enumerate() {
        kad.on_swarm_event(FromSwarm::DialFailure(DialFailure {
            peer_id: Some(*peer),
            error: &DialError::NoAddresses,
            connection_id: ConnectionId::new_unchecked(i),
        }));
    }
    assert!(answered(&mut kad, 3), "a failed peer counts as answered");
    assert!(
        !answered(&mut kad, 4),
        "the fourth nearest was not asked yet"
    );
    assert!(answered_given(&mut kad, 4, &nearest[3..4]));
}
