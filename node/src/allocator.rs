//! Owns which allocator serves a process: jemalloc for long-lived, allocation-heavy ones
//! (a daemon, the benchmarks' in-process networks), glibc's for short ones (a CLI
//! command, a sandbox worker). Each binary declares [`Heap`] as its global allocator with
//! its rule; the choice is made once, at the process's first allocation, and never
//! changes, so every block is freed by the allocator that gave it.
//!
//! Why two: on the lease bench (`testnet bench lease`, one provider, sixteen requesters,
//! every lease settled) jemalloc gave 16 to 25% more leases a second than glibc, whose
//! `malloc`, `free` and arena locks took 10% of all CPU; an idle node at 100 nodes stayed
//! at 7 MiB. But it touches more pages as a process starts (its size classes each begin
//! a page of their own), which cost a `gpunode run` about 0.3 ms of CPU and each sandbox
//! worker as much: dispatch, a whole run of a trivial task, was 0.5 to 0.9 ms slower with
//! jemalloc everywhere (`docs/benchmarks.md`, issue 16). (mimalloc was faster still on
//! leases but kept an idle node at 21 to 25 MiB: it returns only whole 64 KiB pages, and
//! a hundred nodes' long-lived objects pin most of them.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU8, Ordering};

/// Not chosen yet: no allocation made.
const UNDECIDED: u8 = 0;
/// glibc's allocator (Rust's `System`).
const SYSTEM: u8 = 1;
/// jemalloc.
const JEMALLOC: u8 = 2;

/// The allocator this process chose; process-wide, as the global allocator is.
static CHOSEN: AtomicU8 = AtomicU8::new(UNDECIDED);

/// When a process allocates through jemalloc.
#[derive(Debug, Clone, Copy)]
pub enum Rule {
    /// Always (`testnet`, this crate's unit tests).
    Always,
    /// When an argument of the command line is exactly this word (`serve`: a daemon),
    /// else the system allocator. The word in any position picks jemalloc (`--name
    /// serve`, a file named `serve`), which costs that process a fraction of a
    /// millisecond; only the command line's first 4 KiB are looked at, and only on Linux
    /// (elsewhere every process takes the system allocator).
    WhenArgument(&'static str),
}

/// A global allocator that serves each allocation from the allocator its [`Rule`]
/// chose for this process.
#[derive(Debug)]
pub struct Heap {
    rule: Rule,
}

impl Heap {
    /// The allocator that picks jemalloc or glibc's by `rule`.
    pub const fn new(rule: Rule) -> Heap {
        Heap { rule }
    }

    fn jemalloc(&self) -> bool {
        match CHOSEN.load(Ordering::Relaxed) {
            JEMALLOC => true,
            SYSTEM => false,
            _ => self.choose(),
        }
    }

    /// Settles the choice at the first allocation. Threads that race here (a C
    /// constructor could start one) compute the same answer, and whichever stores first
    /// wins for all: the compare-exchange is what keeps every block with one allocator.
    #[cold]
    fn choose(&self) -> bool {
        let mine = match self.rule {
            Rule::Always => JEMALLOC,
            Rule::WhenArgument(word) if command_line_has(word) => JEMALLOC,
            Rule::WhenArgument(_) => SYSTEM,
        };
        // No jemalloc where it is not built (`Je` is the system's allocator there).
        let mine = if cfg!(target_env = "msvc") {
            SYSTEM
        } else {
            mine
        };
        match CHOSEN.compare_exchange(UNDECIDED, mine, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => mine == JEMALLOC,
            Err(chosen) => chosen == JEMALLOC,
        }
    }
}

/// Whether this process allocates through jemalloc (false before its first allocation).
pub fn uses_jemalloc() -> bool {
    CHOSEN.load(Ordering::Relaxed) == JEMALLOC
}

/// The allocator this process uses, as a word for logs: `jemalloc`, `system` (glibc's
/// on Linux), or `unknown` where this process has not allocated yet or its binary does
/// not install [`Heap`] (integration tests, which get the system allocator).
pub fn name() -> &'static str {
    match CHOSEN.load(Ordering::Relaxed) {
        JEMALLOC => "jemalloc",
        SYSTEM => "system",
        _ => "unknown",
    }
}

/// Zeroed allocations up to this size take a jemalloc block that [`Heap`] zeroes by
/// writing zeros; larger ones use jemalloc's own zeroing (`calloc`).
///
/// jemalloc zeroes a large block (its large classes start at 16 KiB) that it takes from
/// its reusable extents, rather than its thread cache, by handing the pages back to the
/// kernel (`madvise(MADV_DONTNEED)`) and letting them fault in again as zero pages: a
/// system call, a page fault per 4 KiB and a TLB shootdown on every core. yamux reads every
/// frame of a TCP connection into a zeroed buffer of 16 KiB and a header, so a 1 GiB job
/// input over TCP made 95,000 such calls and 500,000 page faults, and moved 37% fewer
/// bytes a second than with glibc's allocator (`testnet bench transfer`, "jemalloc for
/// daemons and benchmarks" in `docs/benchmarks.md`). Above this size jemalloc's way is
/// kept: with 1 MiB here an idle daemon grew from 28 to 50 MiB, its large zeroed buffers
/// written through where they used to stay untouched zero pages.
pub const ZERO_BY_MEMSET_MAX: usize = 64 << 10;

#[cfg(not(target_env = "msvc"))]
use tikv_jemallocator::Jemalloc as Je;
#[cfg(target_env = "msvc")]
use System as Je;

// SAFETY: every call goes to one of two sound allocators, and always the same one: the
// choice is made before the first block is handed out and never changes, so a block is
// freed or resized by the allocator that gave it.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Heap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if self.jemalloc() {
            unsafe { Je.alloc(layout) }
        } else {
            unsafe { System.alloc(layout) }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !self.jemalloc() {
            unsafe { System.alloc_zeroed(layout) }
        } else if layout.size() <= ZERO_BY_MEMSET_MAX {
            let p = unsafe { Je.alloc(layout) };
            if !p.is_null() {
                unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
            }
            p
        } else {
            unsafe { Je.alloc_zeroed(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if self.jemalloc() {
            unsafe { Je.dealloc(ptr, layout) }
        } else {
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if self.jemalloc() {
            unsafe { Je.realloc(ptr, layout, new_size) }
        } else {
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }
}

/// Whether an argument of this process's command line is exactly `word` (false past
/// its first 4 KiB, or where it cannot be read).
fn command_line_has(word: &str) -> bool {
    let mut buf = [0u8; 4096];
    arguments_have(read_command_line(&mut buf), word)
}

/// This process's command line, read from `/proc/self/cmdline` into `buf` (this runs
/// inside the first allocation, so it must not allocate), as much of it as fits; empty
/// where it cannot be read. Leaves `errno` as it found it, for the caller that allocated.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn read_command_line(buf: &mut [u8]) -> &[u8] {
    // SAFETY: `__errno_location` gives this thread's errno, always valid.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: a NUL-terminated path; the descriptor is closed below.
    let fd = unsafe {
        libc::open(
            c"/proc/self/cmdline".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    let mut len = 0;
    while fd >= 0 && len < buf.len() {
        let rest = &mut buf[len..];
        // SAFETY: reads at most `rest.len()` bytes into `rest`.
        let n = unsafe { libc::read(fd, rest.as_mut_ptr().cast(), rest.len()) };
        if n > 0 {
            len += n as usize;
        // SAFETY: as above.
        } else if n < 0 && unsafe { *libc::__errno_location() } == libc::EINTR {
            continue;
        } else {
            break;
        }
    }
    if fd >= 0 {
        // SAFETY: `fd` is ours and open.
        unsafe { libc::close(fd) };
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
    &buf[..len]
}

/// No `/proc` to read: every process takes the system allocator.
#[cfg(not(target_os = "linux"))]
fn read_command_line(_buf: &mut [u8]) -> &[u8] {
    &[]
}

/// Whether `cmdline` (NUL-separated, the program first, as in `/proc/PID/cmdline`) has
/// an argument after the program that is exactly `word`.
fn arguments_have(cmdline: &[u8], word: &str) -> bool {
    cmdline
        .split(|&b| b == 0)
        .skip(1)
        .any(|arg| arg == word.as_bytes())
}

/// Returns jemalloc's free pages to the operating system now, when this process uses
/// it (otherwise it would start jemalloc for nothing).
#[cfg(not(target_env = "msvc"))]
#[allow(unsafe_code)]
pub fn purge() {
    if !uses_jemalloc() {
        return;
    }
    // `arena.<MALLCTL_ARENAS_ALL>.purge`: every arena (jemalloc's MALLCTL_ARENAS_ALL is 4096).
    const PURGE_ALL: &[u8] = b"arena.4096.purge\0";
    // SAFETY: the name is NUL-terminated, and `purge` reads and writes no value, so null
    // old/new pointers with zero lengths are what mallctl expects; it takes the arenas'
    // own locks.
    let rc = unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    if rc != 0 {
        tracing::debug!("jemalloc purge failed: error {rc}");
    }
}

/// Nothing to purge: no jemalloc here.
#[cfg(target_env = "msvc")]
pub fn purge() {}

/// The unit tests' allocator: jemalloc, as in a daemon.
#[cfg(test)]
#[global_allocator]
static TEST_HEAP: Heap = Heap::new(Rule::Always);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_on_an_argument_matches_whole_arguments_after_the_program() {
        let serve = |cmdline: &[u8]| arguments_have(cmdline, "serve");
        assert!(serve(b"gpunode\0serve\0"));
        assert!(serve(
            b"/usr/bin/gpunode\0--data-dir\0/var/lib/gpunode\0serve\0--price\0"
        ));
        assert!(serve(b"gpunode\0serve")); // no NUL after the last one
        assert!(!serve(b"gpunode\0run\0hello.wat\0--quiet\0"));
        assert!(!serve(b"gpunode\0run\0serve.wasm\0"));
        assert!(!serve(b"gpunode\0__gpunode-wasm-worker\0"));
        assert!(!serve(b"serve\0status\0")); // the program itself is not an argument
        assert!(!serve(b"gpunode\0servers\0"));
        assert!(!serve(b""));
    }

    #[test]
    fn the_test_process_chose_jemalloc_and_keeps_it() {
        let v = vec![1u8; 100];
        assert!(uses_jemalloc());
        assert_eq!(name(), "jemalloc");

        // Another rule asked later does not change what was chosen.
        let other = Heap::new(Rule::WhenArgument("no-such-argument"));
        assert!(other.jemalloc());
        drop(v);
    }

    #[test]
    fn zeroed_blocks_are_zero_when_reused_on_both_sides_of_the_memset_bound() {
        // Each size is allocated (at an alignment above its size class's), filled with
        // ones and freed, then asked for zeroed: the allocator hands back the same dirty
        // block most times, and the test counts that it did.
        let mut reused = 0;
        for size in [
            24,
            16 << 10,
            (16 << 10) + 12,
            ZERO_BY_MEMSET_MAX - 8,
            ZERO_BY_MEMSET_MAX,
            ZERO_BY_MEMSET_MAX + 1,
            4 * ZERO_BY_MEMSET_MAX,
        ] {
            let layout = Layout::from_size_align(size, 4096).expect("layout");
            for _ in 0..3 {
                // SAFETY: a non-zero size; each block is freed once, with its layout.
                #[allow(unsafe_code)]
                unsafe {
                    let p = TEST_HEAP.alloc(layout);
                    assert!(!p.is_null());
                    std::ptr::write_bytes(p, 0xff, size);
                    TEST_HEAP.dealloc(p, layout);
                    let z = TEST_HEAP.alloc_zeroed(layout);
                    assert!(!z.is_null());
                    assert_eq!(z as usize % 4096, 0);
                    reused += usize::from(z == p);
                    let zs = std::slice::from_raw_parts(z, size);
                    assert!(zs.iter().all(|&b| b == 0), "size {size}");
                    TEST_HEAP.dealloc(z, layout);
                }
            }
        }
        assert!(
            reused >= 7,
            "a dirty block came back only {reused} times of 21"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_processs_command_line_is_read_whole_and_searched_by_argument() {
        let mut buf = [0u8; 4096];
        let read = read_command_line(&mut buf).to_vec();
        let std_read = std::fs::read("/proc/self/cmdline").expect("cmdline");
        assert_eq!(read, std_read[..std_read.len().min(4096)]);
        // The program is never an argument; its arguments are found, when it has any.
        let exe = std::env::args().next().expect("argv[0]");
        assert!(!command_line_has(&exe));
        for arg in std::env::args().skip(1) {
            assert!(command_line_has(&arg), "{arg}");
        }
    }
}
