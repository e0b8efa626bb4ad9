//! How many addresses a node keeps for a peer of its routing table (libp2p-kad's
//! `Addresses`, bounded in our copy: vendor/README.md). A peer names its own addresses
//! and may name new ones without end; the node keeps the first and the newest, within
//! `MAX_PEER_ADDRESSES` and `MAX_PEER_ADDRESS_BYTES`. `hostile_peers.rs` in the testnet
//! suite attacks a real node this way over identify.

use libp2p::kad::{Addresses, MAX_PEER_ADDRESSES, MAX_PEER_ADDRESS_BYTES};
use libp2p::Multiaddr;

fn tcp_addr(port: u16) -> Multiaddr {
    format!("/ip4/127.0.0.1/tcp/{port}").parse().expect("addr")
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
    let long = |n: u16| -> Multiaddr {
        format!("/dns4/{}.example/tcp/{n}", "x".repeat(90))
            .parse()
            .expect("addr")
    };
    let mut addresses = Addresses::new(tcp_addr(1));
    for n in 0..20 {
        assert!(addresses.insert(long(n)));
    }
    let kept = addresses.clone().into_vec();
    let bytes: usize = kept.iter().map(|a| a.as_ref().len()).sum();
    assert!(bytes <= MAX_PEER_ADDRESS_BYTES, "{bytes} bytes");
    assert!(kept.len() < MAX_PEER_ADDRESSES && kept.len() > 2);
    assert_eq!(kept[0], tcp_addr(1));
    assert_eq!(kept[kept.len() - 1], long(19));

    // Longer than the bound beside the first: refused, nothing changed.
    let huge: Multiaddr = format!("/dns4/{}.example/tcp/1", "y".repeat(600))
        .parse()
        .expect("addr");
    assert!(!Addresses::fits(&huge));
    assert!(!addresses.insert(huge));
    assert_eq!(addresses.into_vec(), kept);
}

/// A connection's address change is taken only where the list stays within the bound and
/// has no such address already.
#[test]
fn an_address_change_that_would_pass_the_bound_is_not_taken() {
    let long = |n: u16| -> Multiaddr {
        format!("/dns4/{}.example/tcp/{n}", "x".repeat(90))
            .parse()
            .expect("addr")
    };
    let mut addresses = Addresses::new(tcp_addr(1));
    for n in 0..4 {
        assert!(addresses.insert(long(n)));
    }
    let before = addresses.clone().into_vec();
    let bytes = |a: &[Multiaddr]| a.iter().map(|a| a.as_ref().len()).sum::<usize>();
    // Swapping the short first address for a long one would pass 512 bytes.
    assert!(
        bytes(&before) - tcp_addr(1).as_ref().len() + long(9).as_ref().len()
            > MAX_PEER_ADDRESS_BYTES
    );
    assert!(!addresses.replace(&tcp_addr(1), &long(9)));
    // An address it has already.
    assert!(!addresses.replace(&tcp_addr(1), &long(2)));
    assert_eq!(addresses.clone().into_vec(), before);
    // A change within the bound is taken, in place.
    assert!(addresses.replace(&long(0), &tcp_addr(2)));
    let after = addresses.into_vec();
    assert_eq!(after[1], tcp_addr(2));
    assert!(bytes(&after) <= MAX_PEER_ADDRESS_BYTES);
}
