//! The answer of an offer search that led to a lease, reused for a moment: a burst of
//! runs (a script submitting job after job) walks the DHT once, not once per run.
//! Reused answers are only an ordering of whom to ask: every provider still answers
//! the lease request itself, and when none of a reused answer grants one, the
//! negotiator forgets it and searches afresh.

use std::time::{Duration, Instant};

use gpunode_protocol::advert::OfferFilter;
use gpunode_protocol::time::now_ms;

use crate::views::OfferView;

/// How long a search's answer is reused. Adverts themselves are minutes old when a
/// lookup finds them (they are re-published every few minutes); what a fresh search
/// adds within this window is a provider that joined during it.
pub(super) const REUSE_FOR: Duration = Duration::from_secs(2);
/// Most answers kept (one per filter; a user's runs ask for few kinds of GPU at once).
const MAX_KEPT: usize = 16;

/// The latest searches that led to a lease, by filter.
#[derive(Debug, Default)]
pub(super) struct RecentSearches {
    entries: Vec<(OfferFilter, Instant, Vec<OfferView>)>,
}

impl RecentSearches {
    /// The offers of a search for `filter` that led to a lease within [`REUSE_FOR`]
    /// before `now`, without those whose advert has expired since.
    pub(super) fn get(&self, filter: &OfferFilter, now: Instant) -> Option<Vec<OfferView>> {
        let (_, at, offers) = self.entries.iter().find(|(f, _, _)| f == filter)?;
        if now.saturating_duration_since(*at) >= REUSE_FOR {
            return None;
        }
        let wall = now_ms();
        let live: Vec<OfferView> = offers
            .iter()
            .filter(|o| o.expires_at_ms > wall)
            .cloned()
            .collect();
        (!live.is_empty()).then_some(live)
    }

    /// Keeps `offers`, the answer of a fresh search for `filter` that led to a lease.
    pub(super) fn keep(&mut self, filter: OfferFilter, offers: Vec<OfferView>, now: Instant) {
        self.forget(&filter);
        if self.entries.len() >= MAX_KEPT {
            // The oldest goes.
            if let Some(oldest) = (0..self.entries.len()).min_by_key(|i| self.entries[*i].1) {
                self.entries.swap_remove(oldest);
            }
        }
        self.entries.push((filter, now, offers));
    }

    /// Drops the answer kept for `filter`, if any.
    pub(super) fn forget(&mut self, filter: &OfferFilter) {
        self.entries.retain(|(f, _, _)| f != filter);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpunode_protocol::PeerId;

    fn offer(expires_at_ms: u64) -> OfferView {
        OfferView {
            expires_at_ms,
            ..super::super::tests::offer_at(PeerId::random(), &[])
        }
    }

    fn filter(gpus: u32) -> OfferFilter {
        OfferFilter {
            gpus: Some(gpus),
            ..OfferFilter::default()
        }
    }

    #[test]
    fn an_answer_is_reused_for_its_window_only_and_without_expired_adverts() {
        let mut recent = RecentSearches::default();
        let t0 = Instant::now();
        let fresh = offer(u64::MAX);
        recent.keep(filter(1), vec![fresh.clone(), offer(1)], t0);
        // Within the window: the offer whose advert expired is left out.
        assert_eq!(
            recent.get(&filter(1), t0 + REUSE_FOR / 2),
            Some(vec![fresh])
        );
        // Another filter, or past the window: nothing.
        assert_eq!(recent.get(&filter(2), t0), None);
        assert_eq!(recent.get(&filter(1), t0 + REUSE_FOR), None);
        // Only expired adverts: nothing to reuse.
        recent.keep(filter(3), vec![offer(1)], t0);
        assert_eq!(recent.get(&filter(3), t0), None);
        recent.forget(&filter(1));
        assert_eq!(recent.get(&filter(1), t0), None);
    }

    #[test]
    fn the_oldest_answer_goes_when_too_many_are_kept() {
        let mut recent = RecentSearches::default();
        let t0 = Instant::now();
        for i in 0..MAX_KEPT as u32 + 5 {
            recent.keep(
                filter(i),
                vec![offer(u64::MAX)],
                t0 + Duration::from_millis(i.into()),
            );
        }
        assert_eq!(recent.entries.len(), MAX_KEPT);
        let late = t0 + Duration::from_millis(100);
        assert!(recent.get(&filter(4), late).is_none(), "among the oldest");
        assert!(recent.get(&filter(5), late).is_some());
        // Keeping a filter again replaces its answer, it does not add one.
        recent.keep(filter(5), vec![offer(u64::MAX)], late);
        assert_eq!(recent.entries.len(), MAX_KEPT);
    }
}
