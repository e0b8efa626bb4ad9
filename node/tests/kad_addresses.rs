//! How many addresses a node keeps for a peer of its routing table, and takes for a peer
//! another one names (libp2p-kad's `Addresses`, bounded in our copy: vendor/README.md).
//! A peer names its own addresses and may name new ones without end; the node keeps the
//! first and the newest, within `MAX_PEER_ADDRESSES` and `MAX_PEER_ADDRESS_BYTES`
//! (`hostile_peers.rs` in the testnet suite attacks a real node this way over identify).
//! A peer answering a walk may name a third with as many addresses as a packet holds;
//! the walker takes no more than those bounds, so a dial does not try them all.

mod common;
use common::listen;

use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use gpunode_node::network::KAD_PROTOCOL;
use libp2p::kad::store::MemoryStore;
use libp2p::kad::{self, Addresses, MAX_PEER_ADDRESSES, MAX_PEER_ADDRESS_BYTES};
use libp2p::swarm::{DialError, NetworkBehaviour, SwarmEvent};
use libp2p::{Multiaddr, PeerId};

fn tcp_addr(port: u16) -> Multiaddr {
    format!("/ip4/127.0.0.1/tcp/{port}").parse().expect("addr")
}

/// An address of about 100 bytes: five fill most of the byte bound.
fn long_addr(n: u16) -> Multiaddr {
    format!("/dns4/{}.example/tcp/{n}", "x".repeat(90))
        .parse()
        .expect("addr")
}

/// An address longer than the byte bound on its own.
fn huge_addr() -> Multiaddr {
    format!("/dns4/{}.example/tcp/1", "y".repeat(600))
        .parse()
        .expect("addr")
}

/// A peer that names ever more addresses keeps at most the bound, the first
/// and the newest; one too long to sit beside the first is refused.
#[test]
fn a_peer_naming_ever_more_addresses_keeps_the_first_and_the_newest_within_the_bound() {
    let mut addresses = Addresses::new(tcp_addr(1));
    for port in 2..1000 {
        assert!(addresses.insert(tcp_addr(port)), "port {port}");
    }
    let kept = addresses.clone().into_vec();
    assert_eq!(kept.len(), MAX_PEER_ADDRESSES);
    assert!(kept.iter().map(|a| a.as_ref().len()).sum::<usize>() <= MAX_PEER_ADDRESS_BYTES);
    assert_eq!(kept[0], tcp_addr(1), "the first stays");
    assert_eq!(kept[kept.len() - 1], tcp_addr(999), "the newest is kept");
    assert_eq!(kept[1], tcp_addr(999 - MAX_PEER_ADDRESSES as u16 + 2));

    // Long addresses: the byte bound, not the count, decides.
    let mut addresses = Addresses::new(tcp_addr(1));
    for n in 0..20 {
        assert!(addresses.insert(long_addr(n)));
    }
    let kept = addresses.clone().into_vec();
    let bytes: usize = kept.iter().map(|a| a.as_ref().len()).sum();
    assert!(bytes <= MAX_PEER_ADDRESS_BYTES, "{bytes} bytes");
    assert!(kept.len() < MAX_PEER_ADDRESSES && kept.len() > 2);
    assert_eq!(kept[0], tcp_addr(1));
    assert_eq!(kept[kept.len() - 1], long_addr(19));

    // Longer than the bound beside the first: refused, nothing changed.
    let huge = huge_addr();
    assert!(!Addresses::fits(&huge));
    assert!(!addresses.insert(huge));
    assert_eq!(addresses.into_vec(), kept);
}

/// What a node takes of the addresses a peer names for a third: the first that fit both
/// bounds, one too long skipped.
#[test]
fn of_the_addresses_named_for_a_peer_the_first_within_the_bound_are_taken() {
    let huge = huge_addr();
    let named: Vec<Multiaddr> = std::iter::once(huge)
        .chain((0..100).map(tcp_addr))
        .collect();
    let taken = Addresses::bounded(&named);
    assert_eq!(taken, named[1..=MAX_PEER_ADDRESSES].to_vec());
}

/// A connection's address change is taken only where the list stays within the bound and
/// has no such address already.
#[test]
fn an_address_change_that_would_pass_the_bound_is_not_taken() {
    let mut addresses = Addresses::new(tcp_addr(1));
    for n in 0..4 {
        assert!(addresses.insert(long_addr(n)));
    }
    let before = addresses.clone().into_vec();
    let bytes = |a: &[Multiaddr]| a.iter().map(|a| a.as_ref().len()).sum::<usize>();
    // Swapping the short first address for a long one would pass 512 bytes.
    assert!(
        bytes(&before) - tcp_addr(1).as_ref().len() + long_addr(9).as_ref().len()
            > MAX_PEER_ADDRESS_BYTES
    );
    assert!(!addresses.replace(&tcp_addr(1), &long_addr(9)));
    // An address it has already.
    assert!(!addresses.replace(&tcp_addr(1), &long_addr(2)));
    assert_eq!(addresses.clone().into_vec(), before);
    // A change within the bound is taken, in place.
    assert!(addresses.replace(&long_addr(0), &tcp_addr(2)));
    let after = addresses.into_vec();
    assert_eq!(after[1], tcp_addr(2));
    assert!(bytes(&after) <= MAX_PEER_ADDRESS_BYTES);
}

#[derive(NetworkBehaviour)]
struct Walker {
    kad: kad::Behaviour<MemoryStore>,
}

#[derive(NetworkBehaviour)]
struct Raw {
    stream: libp2p_stream::Behaviour,
}

/// A protobuf varint.
fn varint(mut n: usize, out: &mut Vec<u8>) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// A length-delimited protobuf field.
fn field(tag: u8, bytes: &[u8], out: &mut Vec<u8>) {
    out.push(tag);
    varint(bytes.len(), out);
    out.extend_from_slice(bytes);
}

/// Kademlia's `FIND_NODE` answer naming `named` peers with their addresses, framed as
/// the codec reads it: written by hand, since our copy of libp2p-kad would neither hold
/// nor send that many.
fn find_node_answer(named: &[(PeerId, Vec<Multiaddr>)]) -> Vec<u8> {
    let mut message = vec![0x08, 4]; // type: FIND_NODE
    for (id, addrs) in named {
        let mut peer = Vec::new();
        field(0x0a, &id.to_bytes(), &mut peer);
        for a in addrs {
            field(0x12, a.as_ref(), &mut peer);
        }
        field(0x42, &peer, &mut message); // closerPeers
    }
    let mut framed = Vec::new();
    varint(message.len(), &mut framed);
    framed.extend(message);
    framed
}

/// TCP addresses on 127.0.0.1 from `port`: a QUIC-only walker fails to dial them at once.
fn tcp_addrs(port: u16, n: u16) -> Vec<Multiaddr> {
    (port..port + n).map(tcp_addr).collect()
}

/// A peer that answers every Kademlia request with `answer`, and the tasks that run it.
async fn liar(answer: Vec<u8>) -> (PeerId, Multiaddr, [tokio::task::JoinHandle<()>; 2]) {
    let mut liar = libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_quic()
        .with_behaviour(|_| Raw {
            stream: libp2p_stream::Behaviour::new(),
        })
        .expect("behaviour")
        .build();
    let id = *liar.local_peer_id();
    let addr = listen(&mut liar).await;
    let mut incoming = liar
        .behaviour()
        .stream
        .new_control()
        .accept(KAD_PROTOCOL)
        .expect("accept");
    let answering = tokio::spawn(async move {
        while let Some((_, mut stream)) = incoming.next().await {
            // The request: a varint length, then that many bytes.
            let (mut len, mut shift) = (0usize, 0);
            loop {
                let mut b = [0u8; 1];
                if stream.read_exact(&mut b).await.is_err() {
                    break;
                }
                len |= ((b[0] & 0x7f) as usize) << shift;
                shift += 7;
                if b[0] & 0x80 == 0 {
                    break;
                }
            }
            let mut request = vec![0u8; len];
            let _ = stream.read_exact(&mut request).await;
            let _ = stream.write_all(&answer).await;
            let _ = stream.close().await;
        }
    });
    let driver = tokio::spawn(async move {
        loop {
            liar.select_next_some().await;
        }
    });
    (id, addr, [answering, driver])
}

/// A Kademlia client under the node's protocol, taking answers of up to 64 KiB as a
/// node does, that knows only `peer` at `addr`.
fn walker(peer: PeerId, addr: Multiaddr) -> libp2p::Swarm<Walker> {
    let mut walker = libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_quic()
        .with_behaviour(|key| {
            let me = key.public().to_peer_id();
            let mut cfg = kad::Config::new(KAD_PROTOCOL);
            cfg.set_max_packet_size(64 * 1024);
            let mut kad = kad::Behaviour::with_config(me, MemoryStore::new(me), cfg);
            kad.set_mode(Some(kad::Mode::Client));
            Walker { kad }
        })
        .expect("behaviour")
        .build();
    walker.behaviour_mut().kad.add_address(&peer, addr);
    walker
}

/// A peer that answers every Kademlia request by naming one made-up peer with 600
/// addresses: the walker's dial of that peer tries at most the bound, where it tried
/// all 600.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_named_with_hundreds_of_addresses_is_dialled_at_a_bounded_few() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let named = PeerId::random();
        let addrs = tcp_addrs(10_000, 600);
        let (liar_id, liar_addr, tasks) = liar(find_node_answer(&[(named, addrs.clone())])).await;
        let mut walker = walker(liar_id, liar_addr);
        walker.behaviour_mut().kad.get_closest_peers(named);
        let tried = loop {
            if let SwarmEvent::OutgoingConnectionError {
                peer_id: Some(peer),
                error: DialError::Transport(tried),
                ..
            } = walker.select_next_some().await
            {
                if peer == named {
                    break tried;
                }
            }
        };
        tasks.iter().for_each(|t| t.abort());
        assert!(
            !tried.is_empty() && tried.len() <= MAX_PEER_ADDRESSES,
            "the dial tried {} addresses",
            tried.len()
        );
        let first = addrs[0].clone().with_p2p(named).expect("p2p");
        assert_eq!(tried[0].0, first, "the first named are tried");
    })
    .await
    .expect("within a minute");
}

/// A peer that answers every Kademlia request by naming 300 made-up peers (as many as
/// fit in an answer of a few KiB; a 64 KiB one holds over a thousand): the walk takes no
/// more of them than an answer of ours names (k = 20), so it dials at most 20, where it
/// dialled all 300.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_walk_takes_no_more_peers_from_one_answer_than_an_answer_names() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let named: Vec<(PeerId, Vec<Multiaddr>)> = (0..300)
            .map(|i| (PeerId::random(), tcp_addrs(10_000 + i, 1)))
            .collect();
        let (liar_id, liar_addr, tasks) = liar(find_node_answer(&named)).await;
        let mut walker = walker(liar_id, liar_addr);
        let query = walker
            .behaviour_mut()
            .kad
            .get_closest_peers(PeerId::random());
        let mut dialled = std::collections::HashSet::new();
        loop {
            match walker.select_next_some().await {
                SwarmEvent::OutgoingConnectionError {
                    peer_id: Some(peer),
                    ..
                } if peer != liar_id => {
                    dialled.insert(peer);
                }
                SwarmEvent::Behaviour(WalkerEvent::Kad(kad::Event::OutboundQueryProgressed {
                    id,
                    step,
                    ..
                })) if id == query && step.last => break,
                _ => {}
            }
        }
        tasks.iter().for_each(|t| t.abort());
        let named: std::collections::HashSet<PeerId> = named.iter().map(|(p, _)| *p).collect();
        assert!(dialled.is_subset(&named));
        assert!(
            !dialled.is_empty() && dialled.len() <= 20,
            "the walk dialled {} of the peers one answer named",
            dialled.len()
        );
    })
    .await
    .expect("within a minute");
}
