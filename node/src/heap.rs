//! Gives the heap that closed connections freed back to the operating system.
//!
//! A node forming a network, or answering a burst of lookups, opens a connection to
//! most peers (about 90 KiB each); the idle timeout closes them again, but the allocator
//! keeps the freed memory for a while (glibc's until it is trimmed; jemalloc's about 10 s
//! after last use, and only when the arena holding it is used again), so an idle node
//! stayed at its peak (with glibc's: 16.8 MiB per node at 100 nodes with every
//! connection closed, 7.6 MiB once trimmed). One thread per process watches the
//! process's connection count (every node's event loop holds a [`ConnectionCount`]) and,
//! once enough connections have closed since the peak, asks the allocators to return
//! their free pages ([`trim`], which is process-wide: hence one watcher, however many
//! nodes a process runs).
//!
//! It also keeps a daemon to a few glibc arenas ([`limit_arenas`]), so that memory freed
//! by short-lived threads can be returned at all. (Which allocator serves Rust's
//! allocations is [`crate::allocator`]'s; C code, such as aws-lc under QUIC's TLS,
//! always allocates from glibc.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How often the connection count is looked at.
pub const CHECK_EVERY: Duration = Duration::from_secs(15);

/// The fewest closed connections (since the peak seen) that make a trim worth it: about
/// 1.4 MiB.
pub const TRIM_AFTER_CLOSED: usize = 16;

/// Open connections of every node in this process.
static CONNECTIONS: AtomicUsize = AtomicUsize::new(0);

/// One event loop's share of the process's connection count; what it still holds is
/// given back when it drops (a swarm dropped with connections open reports no closes).
#[derive(Debug)]
pub struct ConnectionCount {
    mine: usize,
    total: &'static AtomicUsize,
}

impl Default for ConnectionCount {
    fn default() -> Self {
        ConnectionCount {
            mine: 0,
            total: &CONNECTIONS,
        }
    }
}

impl ConnectionCount {
    /// Counts one more connection open, and starts the process's watcher if none runs.
    pub fn opened(&mut self) {
        self.mine += 1;
        self.total.fetch_add(1, Ordering::Relaxed);
        start_watcher();
    }

    /// Counts one connection closed.
    pub fn closed(&mut self) {
        if self.mine > 0 {
            self.mine -= 1;
            self.total.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for ConnectionCount {
    fn drop(&mut self) {
        self.total.fetch_sub(self.mine, Ordering::Relaxed);
    }
}

/// When to trim: once the count has fallen from the highest seen since the last trim
/// by [`TRIM_AFTER_CLOSED`] or an eighth of that peak, whichever is more (so a process
/// with thousands of connections does not trim at every small dip).
#[derive(Debug, Default)]
pub struct TrimRule {
    peak: usize,
}

impl TrimRule {
    /// Looks at the current connection count; true when the heap should be trimmed now.
    pub fn should_trim(&mut self, connections: usize) -> bool {
        self.peak = self.peak.max(connections);
        if self.peak - connections >= TRIM_AFTER_CLOSED.max(self.peak / 8) {
            self.peak = connections;
            return true;
        }
        false
    }
}

/// Starts the process's watcher thread once: every [`CHECK_EVERY`] it looks at the
/// connection count and trims when [`TrimRule`] says so. It sleeps almost always and
/// lives as long as the process.
fn start_watcher() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("gpunode-heap".into())
            .spawn(|| {
                let mut rule = TrimRule::default();
                loop {
                    std::thread::sleep(CHECK_EVERY);
                    if rule.should_trim(CONNECTIONS.load(Ordering::Relaxed)) {
                        trim();
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the heap trimmer: {e}");
        }
    });
}

/// Returns the allocators' free pages to the operating system (benchmarks call it
/// before they read a settled resident size).
pub fn trim() {
    crate::allocator::purge();
    trim_glibc();
}

/// Trims glibc's heap, which C code in the process allocates from.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim_glibc() {
    // SAFETY: malloc_trim only releases memory the allocator holds free; it takes the
    // allocator's own locks and touches no memory of ours.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Other C allocators return free memory on their own.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_glibc() {}

/// The most glibc arenas a `gpunode` process uses: all of a short command's or a sandbox
/// worker's allocations, only C code's in a daemon (whose Rust allocations are
/// jemalloc's, [`crate::allocator`]).
///
/// glibc gives threads their own arenas, up to eight per core, and what is freed in an
/// arena stays there, spread among the long-lived blocks around it where a trim cannot
/// return it. A daemon runs many short threads (blocking tasks, the ledger check's
/// workers): when glibc served all of the daemon's memory, six whole-chain checks of a
/// 10,000-entry ledger in a row left it 90 MiB larger, and with two arenas within 11 MiB
/// of where it began (issue 18's dashboard bench).
pub const DAEMON_ARENAS: i32 = 2;

/// Limits this process to [`DAEMON_ARENAS`] glibc arenas, unless glibc's own
/// `MALLOC_ARENA_MAX` is set (which then applies); call it before any thread starts.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn limit_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return;
    }
    // SAFETY: mallopt only sets an allocator parameter; M_ARENA_MAX takes any positive
    // count and applies to arenas created from now on.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, DAEMON_ARENAS);
    }
}

/// Other C allocators manage their arenas on their own.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn limit_arenas() {}

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
        const { assert!(100 / 8 < TRIM_AFTER_CLOSED) };
        assert!(rule.should_trim(100 - TRIM_AFTER_CLOSED));
        // Counted again from where it trimmed.
        assert!(!rule.should_trim(100 - TRIM_AFTER_CLOSED - 1));
        assert!(rule.should_trim(100 - 2 * TRIM_AFTER_CLOSED));
        assert!(!rule.should_trim(100 - 2 * TRIM_AFTER_CLOSED));
        // A node that never had many connections never trims.
        let mut small = TrimRule::default();
        assert!((0..TRIM_AFTER_CLOSED).all(|n| !small.should_trim(n) && !small.should_trim(0)));
        // Thousands of connections: an eighth of the peak, not 16.
        let mut big = TrimRule::default();
        assert!(!big.should_trim(8000));
        assert!(!big.should_trim(8000 - 999));
        assert!(big.should_trim(7000));
    }

    #[test]
    fn the_process_count_follows_opens_closes_and_a_dropped_loop() {
        static TOTAL: AtomicUsize = AtomicUsize::new(0);
        let count = || ConnectionCount {
            mine: 0,
            total: &TOTAL,
        };
        let (mut a, mut b) = (count(), count());
        a.opened();
        a.opened();
        b.opened();
        b.closed();
        b.closed(); // more closes than opens: ignored
        assert_eq!(TOTAL.load(Ordering::Relaxed), 2);
        drop(b);
        assert_eq!(TOTAL.load(Ordering::Relaxed), 2);
        // A loop dropped with connections open gives its share back.
        drop(a);
        assert_eq!(TOTAL.load(Ordering::Relaxed), 0);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn rust_allocations_are_jemallocs_and_a_trim_returns_them() {
        // 128 MiB in 64 KiB blocks; every other one freed, leaving 64 MiB of holes the
        // allocator keeps for a while on its own (jemalloc for about 10 s, and only once
        // their arena is used again; glibc until `malloc_trim`). Only a purge of jemalloc's
        // arenas is asked for (this test binary allocates through jemalloc, as a daemon
        // does), so the holes come back only if Rust's allocations are jemalloc's. The
        // size is read with every block live, so another test's trim in between (the
        // ledger's check trims) cannot make the holes vanish before it is read.
        let mut blocks: Vec<Option<Vec<u8>>> =
            (0..2048).map(|_| Some(vec![1u8; 64 << 10])).collect();
        let before = resident_kib();
        for b in blocks.iter_mut().step_by(2) {
            *b = None;
        }
        crate::allocator::purge();
        let after = resident_kib();
        assert!(after + 32 * 1024 < before, "{before} KiB -> {after} KiB");
        // The whole trim (jemalloc's and glibc's) runs too.
        trim();
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
