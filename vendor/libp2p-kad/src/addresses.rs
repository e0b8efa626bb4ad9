// Copyright 2019 Parity Technologies (UK) Ltd.
//
// Permission is hereby granted, free of charge, to any person obtaining a
// copy of this software and associated documentation files (the "Software"),
// to deal in the Software without restriction, including without limitation
// the rights to use, copy, modify, merge, publish, distribute, sublicense,
// and/or sell copies of the Software, and to permit persons to whom the
// Software is furnished to do so, subject to the following conditions:
//
// The above copyright notice and this permission notice shall be included in
// all copies or substantial portions of the Software.
//
// THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS
// OR IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
// FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
// AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
// LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING
// FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER
// DEALINGS IN THE SOFTWARE.

use std::fmt;

use libp2p_core::Multiaddr;
use smallvec::SmallVec;

/// gpunode: the most addresses kept for one peer of the routing table.
///
/// A peer names its own addresses (identify, pushed again whenever it likes), and
/// upstream kept every one it was ever told: a hostile peer pushing new addresses grew
/// its entry without end, and with it every answer that names the peer (`FIND_NODE`'s
/// closer peers, `GET_PROVIDERS` for a provider record without addresses) until those
/// answers no longer fit a Kademlia packet. Past either bound the oldest addresses but
/// the first go.
pub const MAX_PEER_ADDRESSES: usize = 16;
/// gpunode: the most bytes of addresses (their binary form, `/p2p` suffix included)
/// kept for one peer of the routing table; as much as gpunode keeps of a provider
/// record's addresses, so that an answer of 20 closer peers stays within about 12 KB.
pub const MAX_PEER_ADDRESS_BYTES: usize = 512;

/// A non-empty list of (unique) addresses of a peer in the routing table.
/// Every address must be a fully-qualified /p2p address.
#[derive(Clone)]
pub struct Addresses {
    addrs: SmallVec<[Multiaddr; 6]>,
}

#[allow(clippy::len_without_is_empty)]
impl Addresses {
    /// Creates a new list of addresses.
    pub fn new(addr: Multiaddr) -> Addresses {
        let mut addrs = SmallVec::new();
        addrs.push(addr);
        Addresses { addrs }
    }

    /// Gets a reference to the first address in the list.
    pub fn first(&self) -> &Multiaddr {
        &self.addrs[0]
    }

    /// Returns an iterator over the addresses.
    pub fn iter(&self) -> impl Iterator<Item = &Multiaddr> {
        self.addrs.iter()
    }

    /// Returns the number of addresses in the list.
    pub fn len(&self) -> usize {
        self.addrs.len()
    }

    /// Converts the addresses into a `Vec`.
    pub fn into_vec(self) -> Vec<Multiaddr> {
        self.addrs.into_vec()
    }

    /// Removes the given address from the list.
    ///
    /// Returns `Ok(())` if the address is either not in the list or was found and
    /// removed. Returns `Err(())` if the address is the last remaining address,
    /// which cannot be removed.
    ///
    /// An address should only be removed if is determined to be invalid or
    /// otherwise unreachable.
    #[allow(clippy::result_unit_err)]
    pub fn remove(&mut self, addr: &Multiaddr) -> Result<(), ()> {
        if self.addrs.len() == 1 && self.addrs[0] == *addr {
            return Err(());
        }

        if let Some(pos) = self.addrs.iter().position(|a| a == addr) {
            self.addrs.remove(pos);
            if self.addrs.len() <= self.addrs.inline_size() {
                self.addrs.shrink_to_fit();
            }
        }

        Ok(())
    }

    /// Adds a new address to the end of the list.
    ///
    /// Returns true if the address was added, false otherwise (i.e. if the
    /// address is already in the list).
    ///
    /// gpunode: also false if it would not fit beside the first address
    /// ([`MAX_PEER_ADDRESS_BYTES`]); once added, the oldest addresses after the first
    /// go until the list is within [`MAX_PEER_ADDRESSES`] and [`MAX_PEER_ADDRESS_BYTES`].
    pub fn insert(&mut self, addr: Multiaddr) -> bool {
        let first = self.addrs.first().map_or(0, |a| a.as_ref().len());
        if first + addr.as_ref().len() > MAX_PEER_ADDRESS_BYTES {
            return false;
        }
        if self.addrs.iter().all(|a| *a != addr) {
            self.addrs.push(addr);
            self.trim();
            true
        } else {
            false
        }
    }

    /// gpunode: whether `addr` alone is within [`MAX_PEER_ADDRESS_BYTES`], so that a
    /// list may start with it.
    pub fn fits(addr: &Multiaddr) -> bool {
        addr.as_ref().len() <= MAX_PEER_ADDRESS_BYTES
    }

    /// gpunode: the first of `addrs` that fit within [`MAX_PEER_ADDRESSES`] and
    /// [`MAX_PEER_ADDRESS_BYTES`] together (one that would pass the byte bound is
    /// skipped): what a node takes of the addresses another peer names for a third.
    pub fn bounded<'a>(addrs: impl IntoIterator<Item = &'a Multiaddr>) -> Vec<Multiaddr> {
        let mut kept = Vec::new();
        let mut bytes = 0;
        for addr in addrs {
            if kept.len() == MAX_PEER_ADDRESSES {
                break;
            }
            if bytes + addr.as_ref().len() <= MAX_PEER_ADDRESS_BYTES {
                bytes += addr.as_ref().len();
                kept.push(addr.clone());
            }
        }
        kept
    }

    /// gpunode: drops the oldest addresses after the first until the list is within
    /// [`MAX_PEER_ADDRESSES`] and [`MAX_PEER_ADDRESS_BYTES`].
    fn trim(&mut self) {
        let bytes = |addrs: &[Multiaddr]| addrs.iter().map(|a| a.as_ref().len()).sum::<usize>();
        while self.addrs.len() > 1
            && (self.addrs.len() > MAX_PEER_ADDRESSES
                || bytes(&self.addrs) > MAX_PEER_ADDRESS_BYTES)
        {
            self.addrs.remove(1);
        }
    }

    /// Replaces an old address with a new address.
    ///
    /// Returns true if the previous address was found and replaced with a clone
    /// of the new address, returns false otherwise.
    ///
    /// gpunode: also false, the list unchanged, if the new address is in it already or
    /// the swap would take the list past [`MAX_PEER_ADDRESS_BYTES`].
    pub fn replace(&mut self, old: &Multiaddr, new: &Multiaddr) -> bool {
        let bytes: usize = self.addrs.iter().map(|a| a.as_ref().len()).sum();
        if self.addrs.contains(new)
            || bytes - old.as_ref().len().min(bytes) + new.as_ref().len() > MAX_PEER_ADDRESS_BYTES
        {
            return false;
        }
        if let Some(a) = self.addrs.iter_mut().find(|a| *a == old) {
            *a = new.clone();
            return true;
        }

        false
    }
}

impl fmt::Debug for Addresses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.addrs.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_one_address_when_removing_different_one_returns_ok() {
        let mut addresses = make_addresses([tcp_addr(1234)]);

        let result = addresses.remove(&tcp_addr(4321));

        assert!(result.is_ok());
        assert_eq!(
            addresses.into_vec(),
            vec![tcp_addr(1234)],
            "`Addresses` to not change because we tried to remove a non-present address"
        );
    }

    #[test]
    fn given_one_address_when_removing_correct_one_returns_err() {
        let mut addresses = make_addresses([tcp_addr(1234)]);

        let result = addresses.remove(&tcp_addr(1234));

        assert!(result.is_err());
        assert_eq!(
            addresses.into_vec(),
            vec![tcp_addr(1234)],
            "`Addresses` to not be empty because it would have been the last address to be removed"
        );
    }

    #[test]
    fn given_many_addresses_when_removing_different_one_does_not_remove_and_returns_ok() {
        let mut addresses = make_addresses([tcp_addr(1234), tcp_addr(4321)]);

        let result = addresses.remove(&tcp_addr(5678));

        assert!(result.is_ok());
        assert_eq!(
            addresses.into_vec(),
            vec![tcp_addr(1234), tcp_addr(4321)],
            "`Addresses` to not change because we tried to remove a non-present address"
        );
    }

    #[test]
    fn given_many_addresses_when_removing_correct_one_removes_and_returns_ok() {
        let mut addresses = make_addresses([tcp_addr(1234), tcp_addr(4321)]);

        let result = addresses.remove(&tcp_addr(1234));

        assert!(result.is_ok());
        assert_eq!(
            addresses.into_vec(),
            vec![tcp_addr(4321)],
            "`Addresses to no longer contain address was present and then removed`"
        );
    }

    /// Helper function to easily initialize Addresses struct with multiple addresses.
    fn make_addresses(addresses: impl IntoIterator<Item = Multiaddr>) -> Addresses {
        Addresses {
            addrs: SmallVec::from_iter(addresses),
        }
    }

    /// Helper function to create a tcp Multiaddr with a specific port
    fn tcp_addr(port: u16) -> Multiaddr {
        format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap()
    }
}
