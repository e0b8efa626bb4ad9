//! The wasm executor: one wasmtime engine per node (plus one with fuel metering), a
//! module cache, and `run`, which executes one task to a single [`Outcome`].
//!
//! Two isolations ([`Isolation`]): `Thread` runs the guest on the calling thread with
//! epoch interruption (a ticker advances the epoch every 10 ms while a guest runs, and
//! each tick checks the deadline, cancellation and output caps; see `ticker`);
//! `Process` runs each guest in a worker process (see [`worker`]) compiled without
//! epoch checks, which makes compute-bound code about 3x faster, and enforces the
//! deadline, cancellation and output caps from outside by killing the worker. Memory limits apply inside either way. Workers can be
//! started ahead of need ([`WasmExecutor::keep_workers_ready`], see `pool`), still one
//! process per task.
//!
//! `run` blocks (WASI p1's sync bindings drive their own runtime); callers run it on a
//! thread of its own or through `spawn_blocking`, never on an async worker.

mod cache;
mod output;
mod pool;
mod ticker;
pub mod worker;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use cache::CacheSource;
pub use output::OutputSink;
pub use pool::MAX_READY_WORKERS;
use wasmtime::{Config, Engine, Linker, Module, ResourceLimiter, Store, Trap, UpdateDeadline};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

/// How often the epoch advances: the granularity of deadlines and cancellation.
const TICK: Duration = Duration::from_millis(10);
/// How often (in ticks) the output directory is measured during a run.
const OUTPUT_CHECK_TICKS: u64 = 10;

/// Why a task could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The bytes are not a usable WASI module; nothing was run (and no lease is needed).
    #[error("invalid module: {0}")]
    InvalidModule(String),
    /// The executor could not be set up.
    #[error("sandbox setup failed: {0}")]
    Setup(String),
}

/// What a run may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock time.
    pub wall_time: Duration,
    /// Instructions budget (deterministic metering); `None` for no fuel metering.
    pub fuel: Option<u64>,
    /// Linear memory, bytes.
    pub memory_bytes: usize,
    /// Table elements.
    pub table_elements: usize,
    /// Bytes the guest may write to stdout.
    pub stdout_bytes: u64,
    /// Bytes the guest may write to stderr.
    pub stderr_bytes: u64,
    /// Bytes the guest may leave in `/output`.
    pub output_bytes: u64,
    /// Files (and directories) the guest may create in `/output`.
    pub output_files: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            wall_time: Duration::from_secs(600),
            fuel: None,
            memory_bytes: 512 << 20,
            table_elements: 100_000,
            stdout_bytes: 16 << 20,
            stderr_bytes: 16 << 20,
            output_bytes: 1 << 30,
            output_files: 1000,
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Outcome {
    /// The guest exited with this code (0 when `_start` returned).
    Exited(i32),
    /// The guest trapped (unreachable, out-of-bounds access, ...).
    Trapped(String),
    /// The wall-clock deadline passed.
    TimedOut,
    /// The fuel budget ran out.
    OutOfFuel,
    /// The guest asked for more memory or table space than allowed.
    OutOfMemory,
    /// stdout, stderr or `/output` went over its limit (which one is said).
    OutputTooLarge(String),
    /// Cancelled by the caller (lease ended or cancelled).
    Cancelled,
}

/// Cancels a run from another thread.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A fresh token.
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// Stops the run within one tick.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether [`CancelToken::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// A module compiled and checked for this executor.
#[derive(Clone)]
pub struct CompiledTask {
    module: Module,
    fuel: bool,
    bytes: Arc<Vec<u8>>,
    /// blake3 of the source bytes.
    pub hash: String,
    /// Where the compiled code came from.
    pub source: CacheSource,
}

impl std::fmt::Debug for CompiledTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledTask")
            .field("hash", &self.hash)
            .field("source", &self.source)
            .finish()
    }
}

/// One run of a task.
pub struct RunSpec {
    /// Arguments after the program name.
    pub args: Vec<String>,
    /// Environment, exactly as given.
    pub env: Vec<(String, String)>,
    /// Host directory shown read-only at `/input`.
    pub input_dir: Option<PathBuf>,
    /// Host directory shown writable at `/output`.
    pub output_dir: PathBuf,
    /// What the run may use.
    pub limits: Limits,
    /// Receives stdout as it is written.
    pub stdout: OutputSink,
    /// Receives stderr as it is written.
    pub stderr: OutputSink,
    /// Stops the run.
    pub cancel: CancelToken,
}

/// Why the guest was stopped from the host side.
#[derive(Debug, thiserror::Error)]
enum Stop {
    #[error("deadline passed")]
    TimedOut,
    #[error("cancelled")]
    Cancelled,
    #[error("output limit exceeded: {0}")]
    Output(String),
    #[error("memory or table limit exceeded")]
    Memory,
}

struct Limiter {
    memory_bytes: usize,
    table_elements: usize,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_bytes {
            return Err(Stop::Memory.into());
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.table_elements {
            return Err(Stop::Memory.into());
        }
        Ok(true)
    }
}

struct Host {
    wasi: WasiP1Ctx,
    limiter: Limiter,
}

/// Where guests run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Isolation {
    /// On the caller's thread, interrupted by epoch checks.
    Thread,
    /// In a worker process started from this binary (which must call
    /// [`worker::worker_main`] when given [`worker::WORKER_ARG`]); killed from outside.
    Process(PathBuf),
}

/// Runs WASI tasks. One per node; cheap to share behind an `Arc`.
pub struct WasmExecutor {
    engine: Engine,
    fuel_engine: Engine,
    /// WASI preview 1 linked for each engine, made once.
    linker: Linker<Host>,
    fuel_linker: Linker<Host>,
    cache: cache::ModuleCache,
    cache_dir: PathBuf,
    isolation: Isolation,
    /// Whether the engines insert epoch checks (thread isolation only).
    epoch: bool,
    ticker: Option<ticker::EpochTicker>,
    /// Worker processes for `Isolation::Process`.
    workers: Option<Arc<pool::WorkerPool>>,
    /// This executor is a worker process's, which runs one guest and exits.
    in_worker: bool,
}

fn engine_config(fuel: bool, epoch: bool) -> Config {
    let mut c = Config::new();
    c.epoch_interruption(epoch);
    c.consume_fuel(fuel);
    c
}

impl WasmExecutor {
    /// An executor running guests on the caller's thread, with its compiled-module
    /// cache in `cache_dir`.
    pub fn new(cache_dir: &Path) -> Result<WasmExecutor, SandboxError> {
        WasmExecutor::with_isolation(cache_dir, Isolation::Thread)
    }

    /// An executor with the given isolation.
    pub fn with_isolation(
        cache_dir: &Path,
        isolation: Isolation,
    ) -> Result<WasmExecutor, SandboxError> {
        let epoch = isolation == Isolation::Thread;
        WasmExecutor::build(cache_dir, isolation, epoch, None)
    }

    /// What a worker process runs one guest with: no epoch checks (it is killed from
    /// outside), and only the one engine that guest needs, to start fast.
    fn for_worker(cache_dir: &Path, fuel: bool) -> Result<WasmExecutor, SandboxError> {
        let mut exec = WasmExecutor::build(cache_dir, Isolation::Thread, false, Some(fuel))?;
        exec.in_worker = true;
        Ok(exec)
    }

    /// `only`: make just the plain (`Some(false)`) or the fuel (`Some(true)`) engine.
    fn build(
        cache_dir: &Path,
        isolation: Isolation,
        epoch: bool,
        only: Option<bool>,
    ) -> Result<WasmExecutor, SandboxError> {
        let setup = |e: wasmtime::Error| SandboxError::Setup(e.to_string());
        let (engine, fuel_engine) = match only {
            Some(fuel) => {
                let e = Engine::new(&engine_config(fuel, epoch)).map_err(setup)?;
                (e.clone(), e)
            }
            None => (
                Engine::new(&engine_config(false, epoch)).map_err(setup)?,
                Engine::new(&engine_config(true, epoch)).map_err(setup)?,
            ),
        };
        let cache = cache::ModuleCache::new(cache_dir)
            .map_err(|e| SandboxError::Setup(format!("cache dir {}: {e}", cache_dir.display())))?;
        let ticker = if epoch {
            let engines = vec![engine.clone(), fuel_engine.clone()];
            Some(
                ticker::EpochTicker::start(engines)
                    .map_err(|e| SandboxError::Setup(e.to_string()))?,
            )
        } else {
            None
        };
        let linker = wasi_linker(&engine)?;
        let fuel_linker = match only {
            // One engine serves both.
            Some(_) => linker.clone(),
            None => wasi_linker(&fuel_engine)?,
        };
        let workers = match &isolation {
            Isolation::Process(binary) => Some(pool::WorkerPool::new(binary, cache_dir)),
            Isolation::Thread => None,
        };
        Ok(WasmExecutor {
            engine,
            fuel_engine,
            linker,
            fuel_linker,
            cache,
            cache_dir: cache_dir.to_path_buf(),
            workers,
            in_worker: false,
            isolation,
            epoch,
            ticker,
        })
    }

    /// How this executor isolates guests.
    pub fn isolation(&self) -> &Isolation {
        &self.isolation
    }

    /// With `Isolation::Process`, keeps `n` worker processes started and waiting for a
    /// task (at most [`MAX_READY_WORKERS`]; 0 stops the waiting ones), so a task skips the
    /// process start. Each still runs one task only. No effect on threads.
    pub fn keep_workers_ready(&self, n: usize) {
        if let Some(pool) = &self.workers {
            pool.keep_ready(n);
        }
    }

    /// Worker processes started and waiting for a task now.
    pub fn workers_ready(&self) -> usize {
        self.workers.as_ref().map_or(0, |p| p.ready())
    }

    fn engine_for(&self, fuel: bool) -> &Engine {
        if fuel {
            &self.fuel_engine
        } else {
            &self.engine
        }
    }

    fn linker_for(&self, fuel: bool) -> &Linker<Host> {
        if fuel {
            &self.fuel_linker
        } else {
            &self.linker
        }
    }

    /// Runs a trivial guest once, exactly as a task runs (its module from the cache,
    /// then linked, instantiated and run with a WASI context, stdout and an `/output`
    /// directory), so that a worker started ahead of need has paid, while it waited,
    /// what a process's first guest pays: code paged in, trap handlers, allocators and
    /// WASI's runtime set up. Its `/output` is one directory in the cache directory,
    /// kept, shared by every worker: the guest truncates and rewrites the same small
    /// file there, where a directory and a file made and removed for each worker cost
    /// two new inodes per task (on ext4 without a journal, each a search past every
    /// inode deleted in the last one to six minutes).
    pub(crate) fn warm_up(&self) -> Result<(), SandboxError> {
        let task = self.compile(WARM_UP_GUEST.as_bytes(), false)?;
        let output_dir = self.cache_dir.join("warm-up");
        let outcome = self.run_here(
            &task,
            RunSpec {
                args: Vec::new(),
                env: Vec::new(),
                input_dir: None,
                output_dir,
                limits: Limits::default(),
                stdout: Box::new(|_| {}),
                stderr: Box::new(|_| {}),
                cancel: CancelToken::new(),
            },
        );
        match outcome? {
            Outcome::Exited(0) => Ok(()),
            other => Err(SandboxError::Setup(format!("warm-up ended {other:?}"))),
        }
    }

    /// Whether `bytes` were compiled and checked here before and are still in memory:
    /// [`WasmExecutor::compile`] would return them at once, without compiling or a check,
    /// so a caller may skip its trip to a blocking thread.
    pub fn checked_in_memory(&self, bytes: &[u8], fuel: bool) -> bool {
        let hash = blake3::hash(bytes).to_hex().to_string();
        self.cache.in_memory(&cache_key(&hash, fuel, self.epoch))
    }

    /// Compiles (or fetches from the cache) a `.wasm` or `.wat` module and checks that
    /// it is a WASI command this sandbox can run: every import is a WASI preview 1
    /// function and it exports `_start`. A module already in memory passed the checks.
    pub fn compile(&self, bytes: &[u8], fuel: bool) -> Result<CompiledTask, SandboxError> {
        let (task, key) = self.load(bytes, fuel)?;
        if task.source != CacheSource::Memory {
            self.check(&task)?;
            self.cache.remember(&key, &task.module);
        }
        Ok(task)
    }

    /// The module from the cache (or compiled), unchecked: `compile` checks, and a
    /// worker runs only modules its parent checked.
    fn load(&self, bytes: &[u8], fuel: bool) -> Result<(CompiledTask, String), SandboxError> {
        let hash = blake3::hash(bytes).to_hex().to_string();
        let key = cache_key(&hash, fuel, self.epoch);
        let (module, source) = self
            .cache
            .get_or_compile(self.engine_for(fuel), &key, bytes)
            .map_err(|e| SandboxError::InvalidModule(format!("{e:#}")))?;
        let task = CompiledTask {
            module,
            fuel,
            bytes: Arc::new(bytes.to_vec()),
            hash,
            source,
        };
        Ok((task, key))
    }

    /// Loads the compiled module under cache `key` into memory ahead of its task (see
    /// `ModuleCache::preload`); false when it is not there.
    pub(crate) fn preload(&self, key: &str) -> bool {
        self.cache.preload(&self.engine, key)
    }

    /// Whether `task` is a WASI command this sandbox can run.
    fn check(&self, task: &CompiledTask) -> Result<(), SandboxError> {
        let module = &task.module;
        for import in module.imports() {
            if import.module() != "wasi_snapshot_preview1" {
                return Err(SandboxError::InvalidModule(format!(
                    "it imports {}::{}, which the sandbox does not provide (only WASI preview 1 is available)",
                    import.module(),
                    import.name()
                )));
            }
        }
        self.linker_for(task.fuel)
            .instantiate_pre(module)
            .map_err(|e| {
                SandboxError::InvalidModule(format!("its imports cannot be satisfied: {e:#}"))
            })?;
        if module.get_export("_start").is_none() {
            return Err(SandboxError::InvalidModule(
                "it exports no `_start` function (build it as a WASI command, e.g. --target wasm32-wasip1)".into(),
            ));
        }
        Ok(())
    }

    /// Runs a compiled task to its outcome. Blocks the calling thread.
    pub fn run(&self, task: &CompiledTask, spec: RunSpec) -> Result<Outcome, SandboxError> {
        match &self.workers {
            Some(pool) => worker::run_in_worker(pool, &self.cache_dir, task, spec),
            None => self.run_here(task, spec),
        }
    }

    /// Runs on this thread; with epoch checks when the engine has them, otherwise only
    /// memory limits apply here (a worker's parent enforces the rest).
    fn run_here(&self, task: &CompiledTask, spec: RunSpec) -> Result<Outcome, SandboxError> {
        let engine = self.engine_for(task.fuel);
        let exceeded_stdout = Arc::new(AtomicBool::new(false));
        let exceeded_stderr = Arc::new(AtomicBool::new(false));
        let mut b = wasi_builder(&spec)?;
        b.stdout(output::CappedOutput::new(
            spec.limits.stdout_bytes,
            spec.stdout,
            exceeded_stdout.clone(),
        ));
        b.stderr(output::CappedOutput::new(
            spec.limits.stderr_bytes,
            spec.stderr,
            exceeded_stderr.clone(),
        ));
        let mut store = new_store(engine, b.build_p1(), &spec.limits)?;
        if self.epoch {
            store.set_epoch_deadline(1);
        }
        // The epoch advances while this guest runs.
        let _running = self.ticker.as_ref().map(|t| t.running());
        store.epoch_deadline_callback(stop_check(
            &spec.limits,
            spec.cancel.clone(),
            spec.output_dir.clone(),
            (exceeded_stdout.clone(), exceeded_stderr.clone()),
        ));
        let result = self
            .linker_for(task.fuel)
            .instantiate(&mut store, &task.module)
            .and_then(|instance| instance.get_typed_func::<(), ()>(&mut store, "_start"))
            .and_then(|start| start.call(&mut store, ()));
        let outcome = match result {
            Ok(()) => Outcome::Exited(0),
            Err(e) => classify(&e, &exceeded_stdout, &exceeded_stderr),
        };
        if self.in_worker {
            // The process ends with this guest: unmapping its memory is left to the
            // exit, after the outcome is sent; the parent checks `/output`.
            std::mem::forget(store);
            return Ok(outcome);
        }
        // Output left behind counts whatever the guest's exit status.
        if let Outcome::Exited(_) = outcome {
            let l = &spec.limits;
            if let Some(why) = over_output_limits(&spec.output_dir, l.output_bytes, l.output_files)
            {
                return Ok(Outcome::OutputTooLarge(why));
            }
        }
        Ok(outcome)
    }
}

/// The cache key of a module with blake3 `hash`, compiled for fuel metering or not and
/// with epoch checks or not (each is different machine code).
fn cache_key(hash: &str, fuel: bool, epoch: bool) -> String {
    format!(
        "{hash}-{}-{}",
        if fuel { "fuel" } else { "plain" },
        if epoch { "epoch" } else { "free" }
    )
}

/// The key under which a worker process (no fuel, no epoch checks) finds `task`'s
/// compiled module, or `None` for a fuel-metered task (its worker builds its engine anew).
pub(crate) fn worker_cache_key(task: &CompiledTask) -> Option<String> {
    (!task.fuel).then(|| cache_key(&task.hash, false, false))
}

/// What [`WasmExecutor::warm_up`] runs: the steps of a small task (memory grown, a line
/// to stdout, which goes nowhere, a file created in its `/output`, which is fd 3 as it
/// has no `/input`, written and closed, and `proc_exit(0)`).
const WARM_UP_GUEST: &str = r#"(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_open"
    (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_close" (func $close (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "warm\n")
  (data (i32.const 128) "warm.txt")
  (func (export "_start")
    (drop (memory.grow (i32.const 1)))
    (i32.store (i32.const 0) (i32.const 64))
    (i32.store (i32.const 4) (i32.const 5))
    (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 16)))
    (if (i32.eqz (call $open (i32.const 3) (i32.const 0) (i32.const 128) (i32.const 8)
                   (i32.const 9) (i64.const 64) (i64.const 0) (i32.const 0) (i32.const 32)))
      (then
        (drop (call $w (i32.load (i32.const 32)) (i32.const 0) (i32.const 1) (i32.const 16)))
        (drop (call $close (i32.load (i32.const 32))))))
    (call $exit (i32.const 0))))"#;

/// WASI preview 1 linked for `engine`.
fn wasi_linker(engine: &Engine) -> Result<Linker<Host>, SandboxError> {
    let mut linker: Linker<Host> = Linker::new(engine);
    wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |h: &mut Host| &mut h.wasi)
        .map_err(|e| SandboxError::Setup(e.to_string()))?;
    Ok(linker)
}

/// The guest's WASI context but for stdout and stderr: its argv and environment, no
/// network, `/input` read-only and `/output` (created here) writable.
fn wasi_builder(spec: &RunSpec) -> Result<WasiCtxBuilder, SandboxError> {
    let mut b = WasiCtxBuilder::new();
    let mut argv = vec!["task".to_string()];
    argv.extend(spec.args.iter().cloned());
    b.args(&argv);
    b.envs(&spec.env);
    b.allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false);
    b.socket_addr_check(|_, _| Box::pin(async { false }));
    // Guests run synchronously on a thread of their own: file operations block it
    // directly instead of hopping to Tokio's blocking pool and back (which costs a
    // cross-thread wake-up per operation).
    b.allow_blocking_current_thread(true);
    if let Some(input) = &spec.input_dir {
        b.preopened_dir(input, "/input", FsPerms::ReadOnly)
            .map_err(|e| SandboxError::Setup(format!("input dir {}: {e}", input.display())))?;
    }
    std::fs::create_dir_all(&spec.output_dir).map_err(|e| {
        SandboxError::Setup(format!("output dir {}: {e}", spec.output_dir.display()))
    })?;
    b.preopened_dir(&spec.output_dir, "/output", FsPerms::ReadWrite)
        .map_err(|e| {
            SandboxError::Setup(format!("output dir {}: {e}", spec.output_dir.display()))
        })?;
    Ok(b)
}

/// A store for one run: the guest's WASI context, its memory and table limits, and its
/// fuel when it has some.
fn new_store(
    engine: &Engine,
    wasi: WasiP1Ctx,
    limits: &Limits,
) -> Result<Store<Host>, SandboxError> {
    let host = Host {
        wasi,
        limiter: Limiter {
            memory_bytes: limits.memory_bytes,
            table_elements: limits.table_elements,
        },
    };
    let mut store = Store::new(engine, host);
    store.limiter(|h| &mut h.limiter);
    if let Some(fuel) = limits.fuel {
        store
            .set_fuel(fuel)
            .map_err(|e| SandboxError::Setup(e.to_string()))?;
    }
    Ok(store)
}

/// What runs at each epoch tick: stops the guest when it is cancelled, past its
/// wall-clock time (from now), over a stdout or stderr cap (`exceeded`), or, every
/// `OUTPUT_CHECK_TICKS` ticks, over the output directory's limits.
fn stop_check(
    limits: &Limits,
    cancel: CancelToken,
    out_dir: PathBuf,
    exceeded: (Arc<AtomicBool>, Arc<AtomicBool>),
) -> impl FnMut(wasmtime::StoreContextMut<'_, Host>) -> wasmtime::Result<UpdateDeadline>
       + Send
       + Sync
       + 'static {
    let deadline = Instant::now() + limits.wall_time;
    let (max_bytes, max_files) = (limits.output_bytes, limits.output_files);
    let (so, se) = exceeded;
    let mut ticks = 0u64;
    move |_| {
        ticks += 1;
        if cancel.is_cancelled() {
            return Err(Stop::Cancelled.into());
        }
        if Instant::now() >= deadline {
            return Err(Stop::TimedOut.into());
        }
        if so.load(Ordering::SeqCst) {
            return Err(Stop::Output("stdout".into()).into());
        }
        if se.load(Ordering::SeqCst) {
            return Err(Stop::Output("stderr".into()).into());
        }
        if ticks.is_multiple_of(OUTPUT_CHECK_TICKS) {
            if let Some(why) = over_output_limits(&out_dir, max_bytes, max_files) {
                return Err(Stop::Output(why).into());
            }
        }
        Ok(UpdateDeadline::Continue(1))
    }
}

fn classify(e: &wasmtime::Error, stdout: &AtomicBool, stderr: &AtomicBool) -> Outcome {
    if let Some(exit) = e.downcast_ref::<I32Exit>() {
        return Outcome::Exited(exit.0);
    }
    if let Some(stop) = e.downcast_ref::<Stop>() {
        return match stop {
            Stop::TimedOut => Outcome::TimedOut,
            Stop::Cancelled => Outcome::Cancelled,
            Stop::Output(which) => Outcome::OutputTooLarge(which.clone()),
            Stop::Memory => Outcome::OutOfMemory,
        };
    }
    if stdout.load(Ordering::SeqCst) {
        return Outcome::OutputTooLarge("stdout".into());
    }
    if stderr.load(Ordering::SeqCst) {
        return Outcome::OutputTooLarge("stderr".into());
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => Outcome::OutOfFuel,
        Some(trap) => Outcome::Trapped(trap.to_string()),
        None => Outcome::Trapped(format!("{e:#}")),
    }
}

/// Size and count of what is in `dir` (recursively), or why it is over the limits.
pub(crate) fn over_output_limits(dir: &Path, max_bytes: u64, max_files: u64) -> Option<String> {
    let (mut bytes, mut files) = (0u64, 0u64);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            files += 1;
            if let Ok(meta) = entry.metadata() {
                if meta.is_dir() {
                    stack.push(entry.path());
                } else {
                    bytes += meta.len();
                }
            }
            if files > max_files {
                return Some(format!("/output holds more than {max_files} files"));
            }
            if bytes > max_bytes {
                return Some(format!("/output holds more than {max_bytes} bytes"));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const HELLO: &str = r#"(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start") (call $exit (i32.const 0))))"#;

    /// Only a module compiled and checked here, with the same metering, counts as checked
    /// in memory; one that fails the checks never does.
    #[test]
    fn only_modules_that_passed_the_checks_count_as_checked_in_memory() {
        let cache = tempfile::tempdir().expect("tmp");
        let exec = WasmExecutor::new(cache.path()).expect("executor");
        let hello = HELLO.as_bytes();
        assert!(!exec.checked_in_memory(hello, false));
        exec.compile(hello, false).expect("a WASI command");
        assert!(exec.checked_in_memory(hello, false));
        assert!(
            !exec.checked_in_memory(hello, true),
            "metered is another module"
        );
        let mut changed = hello.to_vec();
        changed.push(b' ');
        assert!(!exec.checked_in_memory(&changed, false));
        // Valid wasm, but no `_start`: it fails the checks and is not kept.
        let no_start = br#"(module (memory (export "memory") 1))"#;
        exec.compile(no_start, false).expect_err("not a command");
        assert!(!exec.checked_in_memory(no_start, false));
    }
}
