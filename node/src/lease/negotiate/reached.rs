//! Providers reached a moment ago: a named provider's newest advert, read from the
//! loop while a connection to it was up, is used again for [`REACHED_FRESH`] without
//! asking the loop, so a requester that takes lease after lease from one provider asks
//! once a second, not once a lease. An advert out of date can cost a request, never a
//! wrong lease (the provider grants only the terms it would offer): a price raised
//! within that second gets the request refused, as an advert read a moment before the
//! change would. It is forgotten as soon as an answer is not the grant it foresaw, so
//! the next request asks the loop.

use std::collections::HashMap;
use std::time::Duration;

use gpunode_protocol::PeerId;
use tokio::time::Instant;

use super::propose::ProviderAdvert;

/// How long an advert read with the provider connected is used again.
pub(super) const REACHED_FRESH: Duration = Duration::from_secs(1);
/// Most providers remembered at once.
const MAX_REACHED: usize = 64;

/// Providers reached a moment ago, with their adverts.
#[derive(Debug, Default)]
pub(super) struct Reached {
    by_peer: HashMap<PeerId, (Instant, ProviderAdvert)>,
}

impl Reached {
    /// `peer`'s advert, if it was reached less than [`REACHED_FRESH`] before `now`.
    pub(super) fn get(&self, peer: &PeerId, now: Instant) -> Option<ProviderAdvert> {
        self.by_peer
            .get(peer)
            .filter(|(at, _)| now.duration_since(*at) < REACHED_FRESH)
            .map(|(_, advert)| advert.clone())
    }

    /// Remembers that `peer`, connected, advertised `advert` at `now`.
    pub(super) fn keep(&mut self, peer: PeerId, advert: ProviderAdvert, now: Instant) {
        if self.by_peer.len() >= MAX_REACHED && !self.by_peer.contains_key(&peer) {
            self.by_peer
                .retain(|_, (at, _)| now.duration_since(*at) < REACHED_FRESH);
            if self.by_peer.len() >= MAX_REACHED {
                self.by_peer.clear();
            }
        }
        self.by_peer.insert(peer, (now, advert));
    }

    /// Forgets `peer` (its advert did not foresee its answer, or it could not be
    /// reached).
    pub(super) fn forget(&mut self, peer: &PeerId) {
        self.by_peer.remove(peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn advert(price: u64) -> ProviderAdvert {
        ProviderAdvert {
            price,
            gpus: Vec::new(),
        }
    }

    #[test]
    fn an_advert_is_used_again_only_while_fresh_and_until_forgotten() {
        let (mut reached, now) = (Reached::default(), Instant::now());
        let peer = PeerId::random();
        reached.keep(peer, advert(5), now);
        assert_eq!(reached.get(&peer, now + REACHED_FRESH / 2), Some(advert(5)));
        assert_eq!(reached.get(&peer, now + REACHED_FRESH), None);
        assert_eq!(reached.get(&PeerId::random(), now), None);
        reached.forget(&peer);
        assert_eq!(reached.get(&peer, now), None);
    }

    #[test]
    fn no_more_than_the_bound_are_kept() {
        let (mut reached, now) = (Reached::default(), Instant::now());
        for i in 0..(3 * MAX_REACHED) as u64 {
            let peer = PeerId::random();
            reached.keep(peer, advert(i), now);
            assert!(reached.by_peer.len() <= MAX_REACHED);
            assert_eq!(
                reached.get(&peer, now),
                Some(advert(i)),
                "the newest is kept"
            );
        }
    }
}
