//! How much starting credit strangers get, when peer ids cost nothing to make.
//!
//! Outside a team every new peer may use a provider's `allowance` before giving back.
//! Per peer id that would be free money for anyone who makes ids (a Sybil attack). So a
//! provider lends on allowance to at most [`Newcomers::max_per_window`] new ids in any
//! window (a day), and each new id gets less than the one before it: the `n`-th of the
//! window gets `allowance × (max - n) / max`. Whatever ids one attacker makes, it draws at
//! most about `allowance × max / 2` from one provider per window; an id already counted
//! keeps its share for the window, and a peer that provided more than it used draws no
//! allowance at all and is not counted.

use std::collections::VecDeque;
use std::sync::Mutex;

use gpunode_protocol::time::UnixMillis;
use libp2p::PeerId;

/// New ids that may draw on the allowance per window, by default.
pub const DEFAULT_NEW_PEERS_PER_DAY: u32 = 20;
/// The window.
pub const WINDOW_MS: u64 = 86_400_000;

/// The peers that started drawing on the allowance in the last window.
#[derive(Debug)]
pub struct Newcomers {
    max_per_window: u32,
    seen: Mutex<VecDeque<(UnixMillis, PeerId)>>,
}

impl Newcomers {
    /// At most `max_per_window` new ids per day (0: no limit, every id gets the whole
    /// allowance; an allowance of 0 is how a provider lends strangers nothing).
    pub fn new(max_per_window: u32) -> Newcomers {
        Newcomers {
            max_per_window,
            seen: Mutex::new(VecDeque::new()),
        }
    }

    /// New ids that may draw on the allowance per window.
    pub fn max_per_window(&self) -> u32 {
        self.max_per_window
    }

    fn pruned(&self, now: UnixMillis) -> std::sync::MutexGuard<'_, VecDeque<(UnixMillis, PeerId)>> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        while seen
            .front()
            .is_some_and(|(at, _)| at.saturating_add(WINDOW_MS) <= now)
        {
            seen.pop_front();
        }
        seen
    }

    /// The allowance `peer` may draw on now, out of `allowance` (millicredits).
    pub fn allowance_for(&self, peer: &PeerId, allowance: u64, now: UnixMillis) -> u64 {
        if self.max_per_window == 0 {
            return allowance;
        }
        let seen = self.pruned(now);
        if seen.iter().any(|(_, p)| p == peer) {
            return allowance;
        }
        let (n, max) = (seen.len() as u64, u64::from(self.max_per_window));
        if n >= max {
            return 0;
        }
        (u128::from(allowance) * u128::from(max - n) / u128::from(max)) as u64
    }

    /// Counts `peer` as drawing on the allowance from `now` (once per window).
    pub fn drawing(&self, peer: &PeerId, now: UnixMillis) {
        if self.max_per_window == 0 {
            return;
        }
        let mut seen = self.pruned(now);
        if !seen.iter().any(|(_, p)| p == peer) && seen.len() < self.max_per_window as usize {
            seen.push_back((now, *peer));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sybil_ids_get_less_and_less_and_then_nothing() {
        let n = Newcomers::new(4);
        let now = 1_800_000_000_000;
        let mut total = 0;
        for _ in 0..100 {
            let sybil = PeerId::random();
            let a = n.allowance_for(&sybil, 1000, now);
            if a > 0 {
                n.drawing(&sybil, now);
            }
            total += a;
        }
        // 1000 + 750 + 500 + 250: bounded however many ids are made.
        assert_eq!(total, 2500);
        // A peer already counted keeps its share for the window.
        let first = {
            let seen = n.pruned(now);
            seen[0].1
        };
        assert_eq!(n.allowance_for(&first, 1000, now + 1), 1000);
        // A day later the window is fresh.
        assert_eq!(
            n.allowance_for(&PeerId::random(), 1000, now + WINDOW_MS),
            1000
        );
        assert_eq!(
            Newcomers::new(0).allowance_for(&first, 1000, now),
            1000,
            "no limit"
        );
    }
}
