//! Gives the heap that closed connections freed back to the operating system.
//!
//! A node forming a network, or answering a burst of lookups, opens a connection to
//! most peers (about 90 KiB each); the idle timeout closes them again, but glibc's
//! allocator keeps the freed memory, so an idle node stayed at its peak (16.8 MiB per
//! node at 100 nodes with every connection closed, 8.1 MiB once trimmed). This task
//! watches the node's connection count and, once enough connections have closed since
//! the last look, asks the allocator to return its free pages (`malloc_trim`).

use std::time::Duration;

use tokio::sync::watch;

use crate::metrics::Metrics;

/// How often the connection count is looked at.
pub const CHECK_EVERY: Duration = Duration::from_secs(15);

/// Closed connections (since the peak seen) that make a trim worth it: about 1.4 MiB.
pub const TRIM_AFTER_CLOSED: usize = 16;

/// When to trim: after [`TRIM_AFTER_CLOSED`] connections closed since the highest
/// count seen since the last trim.
#[derive(Debug, Default)]
pub struct TrimRule {
    peak: usize,
}

impl TrimRule {
    /// Looks at the current connection count; true when the heap should be trimmed now.
    pub fn should_trim(&mut self, connections: usize) -> bool {
        self.peak = self.peak.max(connections);
        if self.peak - connections >= TRIM_AFTER_CLOSED {
            self.peak = connections;
            return true;
        }
        false
    }
}

/// Runs until `stop`: checks the connection count every [`CHECK_EVERY`] and trims when
/// [`TrimRule`] says so, on a blocking thread (a trim can take a few milliseconds).
pub async fn run(metrics: std::sync::Arc<Metrics>, mut stop: watch::Receiver<bool>) {
    let mut rule = TrimRule::default();
    let mut every = tokio::time::interval(CHECK_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stop.changed() => return,
        }
        let connections = metrics.peers_connected.get().max(0) as usize;
        if rule.should_trim(connections) {
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    }
}

/// Returns the allocator's free pages to the operating system.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim() {
    // SAFETY: malloc_trim only releases memory the allocator holds free; it takes the
    // allocator's own locks and touches no memory of ours.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Other allocators return free memory on their own.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trims_once_enough_connections_have_closed_since_the_peak() {
        let mut rule = TrimRule::default();
        // Growing, or shrinking by fewer than the threshold: no trim.
        for n in [0, 10, 40, 100, 100 - TRIM_AFTER_CLOSED + 1] {
            assert!(!rule.should_trim(n), "{n}");
        }
        // The threshold reached from the peak (100), not from the last look.
        assert!(rule.should_trim(100 - TRIM_AFTER_CLOSED));
        // Counted again from where it trimmed.
        assert!(!rule.should_trim(100 - TRIM_AFTER_CLOSED - 1));
        assert!(rule.should_trim(100 - 2 * TRIM_AFTER_CLOSED));
        assert!(!rule.should_trim(100 - 2 * TRIM_AFTER_CLOSED));
        // A node that never had many connections never trims.
        let mut small = TrimRule::default();
        assert!((0..TRIM_AFTER_CLOSED).all(|n| !small.should_trim(n) && !small.should_trim(0)));
    }

    #[test]
    fn a_trim_returns_freed_memory_to_the_os() {
        // 128 MiB in 64 KiB blocks (under glibc's mmap threshold, so on the heap); every
        // other one freed, leaving 64 MiB of holes the allocator keeps on its own.
        let mut blocks: Vec<Option<Vec<u8>>> =
            (0..2048).map(|_| Some(vec![1u8; 64 << 10])).collect();
        for b in blocks.iter_mut().step_by(2) {
            *b = None;
        }
        let before = resident_kib();
        trim();
        let after = resident_kib();
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(after + 32 * 1024 < before, "{before} KiB -> {after} KiB");
        }
        drop(blocks);
    }

    fn resident_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap()
    }
}
