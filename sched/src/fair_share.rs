//! Recent usage per user, decaying with a half-life: what a user used one half-life ago
//! counts half, two half-lives ago a quarter. Fair share serves the lower user first.

use std::collections::HashMap;

use crate::Millis;

/// Usage in GPU-milliseconds per user, with exponential decay.
#[derive(Debug, Clone)]
pub struct FairShare {
    half_life_ms: u64,
    /// User -> (usage, as of).
    usage: HashMap<String, (f64, Millis)>,
}

impl FairShare {
    /// Usage halves every `half_life_ms` (at least 1 ms).
    pub fn new(half_life_ms: u64) -> FairShare {
        FairShare {
            half_life_ms: half_life_ms.max(1),
            usage: HashMap::new(),
        }
    }

    /// The half-life, ms.
    pub fn half_life_ms(&self) -> u64 {
        self.half_life_ms
    }

    fn decay(&self, value: f64, from: Millis, to: Millis) -> f64 {
        if to <= from {
            return value;
        }
        value * 0.5f64.powf((to - from) as f64 / self.half_life_ms as f64)
    }

    /// Adds `gpu_ms` to `user`'s usage at `at` (negative gives back usage charged ahead
    /// and not used). Usage never goes below zero.
    pub fn charge(&mut self, user: &str, gpu_ms: f64, at: Millis) {
        let current = self.usage_gpu_ms(user, at);
        let value = (current + gpu_ms).max(0.0);
        let as_of = self.usage.get(user).map_or(at, |(_, t)| at.max(*t));
        self.usage.insert(user.to_string(), (value, as_of));
        // Forget users whose usage decayed to nothing, so the map stays small.
        if self.usage.len() > 4096 {
            let hl = self.half_life_ms;
            self.usage.retain(|_, (v, t)| {
                *v * 0.5f64.powf(at.saturating_sub(*t) as f64 / hl as f64) > 1.0
            });
        }
    }

    /// `user`'s stored usage and the time it is as of (what a node persists).
    pub fn entry(&self, user: &str) -> Option<(f64, Millis)> {
        self.usage.get(user).copied()
    }

    /// Puts back a persisted entry (after a restart). Non-finite or negative usage is
    /// ignored.
    pub fn restore(&mut self, user: &str, usage: f64, as_of: Millis) {
        if usage.is_finite() && usage > 0.0 {
            self.usage.insert(user.to_string(), (usage, as_of));
        }
    }

    /// `user`'s decayed usage at `now`, GPU-milliseconds.
    pub fn usage_gpu_ms(&self, user: &str, now: Millis) -> f64 {
        self.usage
            .get(user)
            .map_or(0.0, |(v, t)| self.decay(*v, *t, now))
    }

    /// Usage compared in doublings of GPU-seconds: users within a factor of two of each
    /// other share a level, so that the next rule (short jobs first) decides between
    /// them rather than a few seconds of difference.
    pub fn level(&self, user: &str, now: Millis) -> u32 {
        let secs = self.usage_gpu_ms(user, now) / 1000.0;
        (1.0 + secs).log2().floor() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: u64 = 3_600_000;

    #[test]
    fn entries_survive_a_round_trip_and_bad_ones_are_ignored() {
        let mut f = FairShare::new(HOUR);
        f.charge("ann", 8_000.0, 0);
        let (usage, at) = f.entry("ann").expect("entry");
        let mut g = FairShare::new(HOUR);
        g.restore("ann", usage, at);
        g.restore("bob", f64::NAN, 0);
        g.restore("cy", -5.0, 0);
        assert_eq!(g.usage_gpu_ms("ann", HOUR), f.usage_gpu_ms("ann", HOUR));
        assert_eq!(g.entry("bob"), None);
        assert_eq!(g.entry("cy"), None);
    }

    #[test]
    fn usage_halves_every_half_life() {
        let mut f = FairShare::new(HOUR);
        f.charge("ann", 8_000.0, 0);
        assert!((f.usage_gpu_ms("ann", 0) - 8_000.0).abs() < 1e-6);
        assert!((f.usage_gpu_ms("ann", HOUR) - 4_000.0).abs() < 1e-6);
        assert!((f.usage_gpu_ms("ann", 3 * HOUR) - 1_000.0).abs() < 1e-6);
        assert_eq!(f.usage_gpu_ms("bob", 3 * HOUR), 0.0);
    }

    #[test]
    fn charges_add_after_decay_and_refunds_never_go_negative() {
        let mut f = FairShare::new(HOUR);
        f.charge("ann", 4_000.0, 0);
        f.charge("ann", 4_000.0, HOUR);
        assert!((f.usage_gpu_ms("ann", HOUR) - 6_000.0).abs() < 1e-6);
        f.charge("ann", -100_000.0, HOUR);
        assert_eq!(f.usage_gpu_ms("ann", HOUR), 0.0);
    }

    #[test]
    fn levels_group_users_within_a_factor_of_two() {
        let mut f = FairShare::new(HOUR);
        f.charge("a", 100_000.0, 0); // 100 GPU-s
        f.charge("b", 120_000.0, 0); // 120 GPU-s: same doubling
        f.charge("c", 400_000.0, 0); // 400 GPU-s: two doublings more
        assert_eq!(f.level("a", 0), f.level("b", 0));
        assert!(f.level("c", 0) > f.level("a", 0));
        assert_eq!(f.level("nobody", 0), 0);
        // Two half-lives later c has decayed to a's level of before.
        assert_eq!(f.level("c", 2 * HOUR), f.level("a", 0));
    }
}
