//! Worker processes started ahead of need, so a task does not wait for one to start.
//!
//! A ready worker is `BINARY __gpunode-wasm-worker CACHE_DIR` with an empty environment:
//! it has started, built its wasmtime engine for the executor's cache, run a trivial
//! guest through the same code a task takes, loaded the compiled module of the last task
//! from the cache (a task run again starts without loading it), and blocks reading its
//! request on stdin. It has seen no task. Each task takes one worker and the worker exits
//! with the task, so isolation is the same as with a worker started on demand: one
//! process per task, never reused. A keeper thread refills the pool up to the size the node asks for (one per CPU
//! slot) and reaps workers whose tasks have ended, so neither happens on a task's path; a
//! taken worker's replacement starts [`AFTER_TASK`] after a task has ended (or
//! [`REFILL_HOLD`] after the take, if sooner), so it competes for the CPU neither with a
//! short task nor with what follows it (its report and outputs, its lease's settlement).
//! A worker whose parent dies reads end-of-file and exits; the pool's drop kills the rest.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::worker::WORKER_ARG;

/// Most workers kept ready, whatever the node asks for (each is a process holding an
/// engine, a few MiB).
pub const MAX_READY_WORKERS: usize = 16;

/// How long a worker whose task has ended may take to exit before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(5);
/// Longest a taken worker's replacement waits for its task to end before it starts.
const REFILL_HOLD: Duration = Duration::from_millis(20);
/// How long after its task ended a replacement starts (if [`REFILL_HOLD`] has not run
/// out first): the task's report and outputs, and its lease's settlement, go first.
const AFTER_TASK: Duration = Duration::from_millis(5);
/// How often the keeper looks at workers that are exiting.
const REAP_EVERY: Duration = Duration::from_millis(5);

/// What the keeper and the tasks share.
#[derive(Default)]
struct Shared {
    ready: Vec<Child>,
    /// Workers whose tasks ended, with when they are killed if still running.
    exiting: Vec<(Child, Instant)>,
    size: usize,
    stopping: bool,
    /// The cache key of the module the last task ran, which workers started from now on
    /// load while they wait (a task run again finds it in memory).
    preload: Option<String>,
    /// A worker was taken for a task: the replacement starts [`AFTER_TASK`] after a
    /// task ends or at this time, whichever is first, so that starting it (a process, an
    /// engine, a warm-up run) does not take the CPU from a short task and its job.
    refill_held_until: Option<Instant>,
}

impl Shared {
    /// A task ended: the held replacement starts [`AFTER_TASK`] from now, or when its
    /// hold runs out if that is sooner.
    fn task_ended(&mut self) {
        let soon = Instant::now() + AFTER_TASK;
        self.refill_held_until = self.refill_held_until.map(|until| until.min(soon));
    }
}

struct Inner {
    binary: PathBuf,
    cache_dir: PathBuf,
    shared: Mutex<Shared>,
    wake: Condvar,
}

/// Ready workers for one executor (see the module doc).
pub(crate) struct WorkerPool {
    inner: Arc<Inner>,
    keeper: Mutex<Option<JoinHandle<()>>>,
}

impl WorkerPool {
    /// An empty pool of workers from `binary` for the module cache in `cache_dir`.
    pub(crate) fn new(binary: &Path, cache_dir: &Path) -> Arc<WorkerPool> {
        Arc::new(WorkerPool {
            inner: Arc::new(Inner {
                binary: binary.to_path_buf(),
                cache_dir: cache_dir.to_path_buf(),
                shared: Mutex::new(Shared::default()),
                wake: Condvar::new(),
            }),
            keeper: Mutex::new(None),
        })
    }

    /// The binary workers are started from.
    pub(crate) fn binary(&self) -> &Path {
        &self.inner.binary
    }

    /// Keeps `n` workers ready (at most [`MAX_READY_WORKERS`]; 0 stops the waiting
    /// ones), starting them in the background.
    pub(crate) fn keep_ready(&self, n: usize) {
        let n = n.min(MAX_READY_WORKERS);
        let excess: Vec<Child> = {
            let mut shared = self.inner.lock();
            shared.size = n;
            let keep = shared.ready.len().min(n);
            shared.ready.split_off(keep)
        };
        for child in excess {
            stop(child);
        }
        if n > 0 {
            self.wake_keeper();
        }
    }

    /// Workers ready now.
    pub(crate) fn ready(&self) -> usize {
        self.inner.lock().ready.len()
    }

    /// Workers started from now on load the compiled module under cache `key` while
    /// they wait: the module of the task about to run, likely to run again.
    pub(crate) fn preload_for_next(&self, key: Option<String>) {
        self.inner.lock().preload = key;
    }

    /// A ready worker, or a new one when none is ready; the keeper starts its
    /// replacement.
    pub(crate) fn take(&self) -> std::io::Result<Child> {
        let taken = loop {
            let Some(mut child) = self.inner.lock().ready.pop() else {
                break None;
            };
            // One that died while it waited (killed from outside) is not handed out.
            match child.try_wait() {
                Ok(None) => break Some(child),
                _ => {
                    let _ = child.wait();
                }
            }
        };
        match taken {
            Some(child) => {
                self.inner
                    .lock()
                    .refill_held_until
                    .get_or_insert(Instant::now() + REFILL_HOLD);
                self.wake_keeper();
                Ok(child)
            }
            None => self.inner.start(None),
        }
    }

    /// A worker whose task has ended and that exits on its own: the keeper reaps it
    /// (and kills it if it has not exited within [`EXIT_GRACE`]).
    pub(crate) fn retire(&self, child: Child) {
        let mut shared = self.inner.lock();
        shared.exiting.push((child, Instant::now() + EXIT_GRACE));
        shared.task_ended();
        drop(shared);
        self.wake_keeper();
    }

    /// A task taken from the pool has ended (its worker stopped or reaped by the
    /// caller): the keeper may start replacements [`AFTER_TASK`] from now.
    pub(crate) fn task_ended(&self) {
        self.inner.lock().task_ended();
        self.wake_keeper();
    }

    /// Wakes the keeper, starting it the first time.
    fn wake_keeper(&self) {
        let mut keeper = self.keeper.lock().unwrap_or_else(|p| p.into_inner());
        if keeper.is_none() {
            let inner = self.inner.clone();
            match std::thread::Builder::new()
                .name("wasm-worker-pool".into())
                .spawn(move || inner.keep())
            {
                Ok(handle) => *keeper = Some(handle),
                Err(e) => tracing::warn!("cannot start the sandbox worker keeper: {e}"),
            }
        }
        self.inner.wake.notify_one();
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts one worker: empty environment, piped stdio. One started ahead of its task
    /// (`ahead` is `Some`) is told the cache to warm its engine for while it waits, and
    /// the cache key of a module to load meanwhile, if any.
    fn start(&self, ahead: Option<Option<String>>) -> std::io::Result<Child> {
        let mut command = Command::new(&self.binary);
        command.arg(WORKER_ARG);
        if let Some(preload) = ahead {
            command.arg(&self.cache_dir);
            if let Some(key) = preload {
                command.arg(key);
            }
        }
        command
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
    }

    /// The keeper: refills the pool, reaps exiting workers, and on stop kills the rest.
    fn keep(&self) {
        let mut shared = self.lock();
        loop {
            if shared.stopping {
                let ready = std::mem::take(&mut shared.ready);
                let exiting = std::mem::take(&mut shared.exiting);
                drop(shared);
                ready
                    .into_iter()
                    .chain(exiting.into_iter().map(|(c, _)| c))
                    .for_each(stop);
                return;
            }
            let now = Instant::now();
            shared.exiting.retain_mut(|(child, kill_at)| {
                match child.try_wait() {
                    Ok(None) if now < *kill_at => true,
                    Ok(None) => {
                        let _ = child.kill();
                        let _ = child.wait();
                        false
                    }
                    // Exited (now reaped), or cannot be waited for.
                    _ => false,
                }
            });
            let held = shared.refill_held_until.filter(|until| now < *until);
            shared.refill_held_until = held;
            if shared.ready.len() < shared.size && held.is_none() {
                let preload = shared.preload.clone();
                drop(shared);
                let started = self.start(Some(preload));
                shared = self.lock();
                match started {
                    Ok(child) if shared.ready.len() < shared.size && !shared.stopping => {
                        shared.ready.push(child)
                    }
                    // The size went down while it started.
                    Ok(child) => stop(child),
                    Err(e) => {
                        tracing::warn!("cannot start a sandbox worker ahead of need: {e}");
                        shared.size = shared.ready.len();
                    }
                }
                continue;
            }
            let reap = (!shared.exiting.is_empty()).then_some(REAP_EVERY);
            let refill = held.map(|until| until - now);
            shared = match reap.into_iter().chain(refill).min() {
                None => self.wake.wait(shared).unwrap_or_else(|p| p.into_inner()),
                Some(wait) => {
                    self.wake
                        .wait_timeout(shared, wait)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.inner.lock().stopping = true;
        self.inner.wake.notify_one();
        let keeper = self.keeper.lock().unwrap_or_else(|p| p.into_inner()).take();
        match keeper {
            Some(handle) => {
                let _ = handle.join();
            }
            None => {
                let mut shared = self.inner.lock();
                let ready = std::mem::take(&mut shared.ready);
                drop(shared);
                ready.into_iter().for_each(stop);
            }
        }
    }
}

/// Kills a worker and reaps it.
fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_that_ends_brings_its_held_replacement_forward_but_not_to_now() {
        let mut shared = Shared::default();
        let before = Instant::now();
        shared.refill_held_until = Some(before + REFILL_HOLD);
        shared.task_ended();
        let after = Instant::now();
        let until = shared.refill_held_until.expect("still held for a moment");
        assert!(
            until >= before + AFTER_TASK,
            "held until the task's job is done"
        );
        assert!(until <= after + AFTER_TASK, "no longer than AFTER_TASK");

        // A hold about to run out is not pushed back.
        let soon = Instant::now() + Duration::from_millis(1);
        shared.refill_held_until = Some(soon);
        shared.task_ended();
        assert_eq!(shared.refill_held_until, Some(soon));

        // Nothing held (a worker started for the task itself): nothing to release.
        shared.refill_held_until = None;
        shared.task_ended();
        assert_eq!(shared.refill_held_until, None);
    }
}
