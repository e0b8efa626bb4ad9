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
    /// before `now`, without those whose advert has expired since, with when that
    /// search answered.
    pub(super) fn get(
        &self,
        filter: &OfferFilter,
        now: Instant,
    ) -> Option<(Instant, Vec<OfferView>)> {
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
        (!live.is_empty()).then_some((*at, live))
    }

    /// Keeps `offers`, the answer of a search for `filter` made at `at` that led to a
    /// lease (the window runs from the search, not from the lease).
    pub(super) fn keep(&mut self, filter: OfferFilter, offers: Vec<OfferView>, at: Instant) {
        self.entries.retain(|(f, _, _)| *f != filter);
        if self.entries.len() >= MAX_KEPT {
            // The oldest goes.
            if let Some(oldest) = (0..self.entries.len()).min_by_key(|i| self.entries[*i].1) {
                self.entries.swap_remove(oldest);
            }
        }
        self.entries.push((filter, at, offers));
    }

    /// `winner` granted a lease of the GPUs `leased` (uuids) from the answer kept for
    /// `filter` at `at`, after `asked_before` did not: those are left out of the answer
    /// (they refused or could not be reached just now), and the winner's GPUs are marked
    /// leased, so the next run ranks providers with idle GPUs first. Nothing changes when
    /// another run has kept a newer answer meanwhile.
    pub(super) fn granted(
        &mut self,
        filter: &OfferFilter,
        at: Instant,
        asked_before: &[String],
        winner: &str,
        leased: &[String],
    ) {
        let Some((_, _, offers)) = self
            .entries
            .iter_mut()
            .find(|(f, kept_at, _)| f == filter && *kept_at == at)
        else {
            return;
        };
        offers.retain(|o| !asked_before.contains(&o.peer_id));
        for offer in offers.iter_mut().filter(|o| o.peer_id == winner) {
            for gpu in offer.gpus.iter_mut().filter(|g| leased.contains(&g.uuid)) {
                gpu.state = gpunode_protocol::gpu::GpuState::Leased;
            }
        }
    }

    /// Drops the answer kept for `filter` at `at`, if it is still the one kept (another
    /// run may have kept a newer one meanwhile).
    pub(super) fn forget(&mut self, filter: &OfferFilter, at: Instant) {
        self.entries
            .retain(|(f, kept_at, _)| !(f == filter && *kept_at == at));
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
            Some((t0, vec![fresh]))
        );
        // Another filter, or past the window: nothing.
        assert_eq!(recent.get(&filter(2), t0), None);
        assert_eq!(recent.get(&filter(1), t0 + REUSE_FOR), None);
        // Only expired adverts: nothing to reuse.
        recent.keep(filter(3), vec![offer(1)], t0);
        assert_eq!(recent.get(&filter(3), t0), None);
        // Forgetting an answer another run replaced leaves the newer one.
        let t1 = t0 + Duration::from_millis(1);
        recent.keep(filter(1), vec![offer(u64::MAX)], t1);
        recent.forget(&filter(1), t0);
        assert!(recent.get(&filter(1), t1).is_some());
        recent.forget(&filter(1), t1);
        assert_eq!(recent.get(&filter(1), t1), None);
    }

    #[test]
    fn a_grant_drops_those_asked_before_and_marks_the_winners_gpus_leased() {
        use gpunode_protocol::advert::AdvertGpu;
        use gpunode_protocol::gpu::GpuState;
        let with_gpu = |uuid: &str| OfferView {
            gpus: vec![AdvertGpu {
                index: 0,
                uuid: uuid.into(),
                model: "A100".into(),
                memory_bytes: 1 << 30,
                state: GpuState::Idle,
                mig_enabled: false,
                compute_capability: None,
                reserved: Vec::new(),
            }],
            ..offer(u64::MAX)
        };
        let (a, b, c) = (with_gpu("ga"), with_gpu("gb"), with_gpu("gc"));
        let mut recent = RecentSearches::default();
        let t0 = Instant::now();
        recent.keep(filter(1), vec![a.clone(), b.clone(), c.clone()], t0);
        // A stale answer (kept at another time) is left alone.
        recent.granted(
            &filter(1),
            t0 + Duration::from_millis(1),
            std::slice::from_ref(&a.peer_id),
            &b.peer_id,
            &["gb".into()],
        );
        assert_eq!(recent.get(&filter(1), t0).expect("kept").1.len(), 3);
        recent.granted(
            &filter(1),
            t0,
            std::slice::from_ref(&a.peer_id),
            &b.peer_id,
            &["gb".into()],
        );
        let (_, kept) = recent.get(&filter(1), t0).expect("kept");
        let peers: Vec<&str> = kept.iter().map(|o| o.peer_id.as_str()).collect();
        assert_eq!(peers, [b.peer_id.as_str(), c.peer_id.as_str()]);
        assert_eq!(kept[0].gpus[0].state, GpuState::Leased);
        assert_eq!(kept[1].gpus[0].state, GpuState::Idle);
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
