//! The epoch ticker of guests run on threads: it advances the engines' epoch every
//! [`TICK`] while a guest runs (each tick makes the guest check its deadline,
//! cancellation and output caps) and sleeps while none does, so an idle node is not
//! woken a hundred times a second. Guests in worker processes need no ticker.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::thread::JoinHandle;

use wasmtime::Engine;

use super::TICK;

/// What the ticker thread and the guests share.
#[derive(Default)]
struct Shared {
    /// Guests running now.
    running: AtomicUsize,
    stop: AtomicBool,
    /// Ticks made so far (what the tests watch).
    ticks: AtomicU64,
}

/// A thread advancing some engines' epoch while guests run.
pub(super) struct EpochTicker {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    /// Starts the (sleeping) ticker thread for `engines`.
    pub(super) fn start(engines: Vec<Engine>) -> std::io::Result<EpochTicker> {
        let shared = Arc::new(Shared::default());
        let ours = shared.clone();
        let thread = std::thread::Builder::new()
            .name("wasm-epoch".into())
            .spawn(move || {
                while !ours.stop.load(SeqCst) {
                    // A guest starting unparks this thread after counting itself, so
                    // the count is seen here or the unpark makes `park` return.
                    if ours.running.load(SeqCst) == 0 {
                        std::thread::park();
                        continue;
                    }
                    std::thread::sleep(TICK);
                    for e in &engines {
                        e.increment_epoch();
                    }
                    ours.ticks.fetch_add(1, SeqCst);
                }
            })?;
        Ok(EpochTicker {
            shared,
            thread: Some(thread),
        })
    }

    /// A guest runs until the returned guard is dropped: the epoch advances meanwhile.
    pub(super) fn running(&self) -> Running<'_> {
        if self.shared.running.fetch_add(1, SeqCst) == 0 {
            if let Some(t) = &self.thread {
                t.thread().unpark();
            }
        }
        Running(self)
    }

    /// Ticks made so far.
    #[cfg(test)]
    fn ticks(&self) -> u64 {
        self.shared.ticks.load(SeqCst)
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// A running guest, counted while it lives (see [`EpochTicker::running`]).
pub(super) struct Running<'a>(&'a EpochTicker);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.shared.running.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    fn ticker() -> EpochTicker {
        let mut config = wasmtime::Config::new();
        config.epoch_interruption(true);
        EpochTicker::start(vec![Engine::new(&config).expect("an engine")]).expect("a thread")
    }

    fn ticks_reach(t: &EpochTicker, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while t.ticks() < n {
            assert!(
                Instant::now() < deadline,
                "the ticker did not tick while a guest ran"
            );
            std::thread::sleep(TICK);
        }
    }

    #[test]
    fn the_epoch_advances_only_while_a_guest_runs() {
        let t = ticker();
        std::thread::sleep(TICK * 5);
        assert_eq!(t.ticks(), 0, "an idle ticker ticked");

        let guest = t.running();
        ticks_reach(&t, 3);
        drop(guest);
        // At most the tick it was sleeping towards, then nothing.
        let stopped = t.ticks();
        std::thread::sleep(TICK * 5);
        assert!(
            t.ticks() <= stopped + 1,
            "the ticker went on ticking when idle"
        );

        // Two guests at once, one ending first: ticking goes on for the other.
        let (a, b) = (t.running(), t.running());
        let before = t.ticks();
        drop(a);
        ticks_reach(&t, before + 3);
        drop(b);
    }

    #[test]
    fn a_sleeping_ticker_stops_when_dropped() {
        let t = ticker();
        std::thread::sleep(TICK);
        drop(t); // would hang if the parked thread were not woken
    }
}
