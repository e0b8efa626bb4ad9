//! Guests in worker processes ([`super::Isolation::Process`]).
//!
//! The parent starts `BINARY __gpunode-wasm-worker` with an empty environment, writes
//! one JSON line ([`WorkerRequest`]) and the module's bytes to its stdin, and reads
//! frames from its stdout: `[tag u8][len u32 LE][bytes]` with tag 0 for guest stdout,
//! 1 for guest stderr and 2 for the final [`Outcome`] as JSON. The worker compiles the
//! module through the shared on-disk cache (the parent already compiled it, so this is a
//! load) with an engine that has no epoch checks, and applies the memory and table
//! limits. The parent enforces everything else from outside: the wall-clock deadline,
//! cancellation, the stdout/stderr caps and the output directory's size and file count,
//! each by killing the worker. A worker that dies on its own is reported as a trap.

use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdout, ExitStatus};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::pool::WorkerPool;
use super::{
    over_output_limits, CancelToken, CompiledTask, Limits, Outcome, OutputSink, RunSpec,
    SandboxError,
};

/// The first argument that turns a binary into a worker.
pub const WORKER_ARG: &str = "__gpunode-wasm-worker";

const TAG_STDOUT: u8 = 0;
const TAG_STDERR: u8 = 1;
const TAG_OUTCOME: u8 = 2;
/// How often the parent checks deadline, cancellation and the output directory.
const POLL: Duration = Duration::from_millis(20);
/// Output directory checks happen every this many polls.
const OUTPUT_CHECK_POLLS: u32 = 5;
/// Largest frame a worker sends (guest writes are split to fit).
const MAX_FRAME: usize = 1 << 20;
/// What a pipe holds before a write blocks (Linux's default).
const PIPE_BUFFER: usize = 64 * 1024;
/// How long a worker that reported its outcome may take to exit before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(5);

/// What the parent asks a worker to run.
#[derive(Debug, Serialize, Deserialize)]
pub struct WorkerRequest {
    /// The executor's module cache.
    pub cache_dir: PathBuf,
    /// Length of the module bytes that follow the request line.
    pub module_len: usize,
    /// Fuel metering.
    pub fuel: Option<u64>,
    /// Arguments after the program name.
    pub args: Vec<String>,
    /// Guest environment.
    pub env: Vec<(String, String)>,
    /// `/input`, read-only.
    pub input_dir: Option<PathBuf>,
    /// `/output`.
    pub output_dir: PathBuf,
    /// Linear memory limit, bytes.
    pub memory_bytes: usize,
    /// Table limit, elements.
    pub table_elements: usize,
}

/// Runs in the worker process: reads the request from stdin, runs the guest, writes
/// frames to stdout. Returns the process exit code.
pub fn worker_main() -> i32 {
    match serve_one() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("gpunode wasm worker: {e}");
            3
        }
    }
}

fn write_frame(out: &mut impl Write, tag: u8, data: &[u8]) -> std::io::Result<()> {
    let mut header = [tag, 0, 0, 0, 0];
    header[1..].copy_from_slice(&(data.len() as u32).to_le_bytes());
    out.write_all(&header)?;
    out.write_all(data)?;
    out.flush()
}

fn serve_one() -> Result<(), String> {
    // WASI's host calls run their futures on the current Tokio runtime when there is
    // one; without one, each call goes through a shared runtime with a yield, which
    // wakes its threads. One small runtime for the worker's only guest.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the worker's runtime: {e}"))?;
    let _in_runtime = runtime.enter();
    // A worker started ahead of need builds its engine for the named cache while it
    // waits for its task.
    let warm_dir = std::env::args_os().nth(2).map(PathBuf::from);
    let preload = std::env::args_os()
        .nth(3)
        .and_then(|a| a.into_string().ok());
    let warm = warm_dir.as_deref().and_then(|dir| {
        let exec = super::WasmExecutor::for_worker(dir, false).ok()?;
        // A failed warm-up or preload only means the task pays those costs itself.
        let _ = exec.warm_up();
        if let Some(key) = &preload {
            exec.preload(key);
        }
        Some(exec)
    });
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    let read = stdin.read_line(&mut line).map_err(|e| e.to_string())?;
    if read == 0 {
        // The parent went away before giving a task (a ready worker no longer needed).
        return Ok(());
    }
    let req: WorkerRequest = serde_json::from_str(&line).map_err(|e| e.to_string())?;
    let mut module = vec![0u8; req.module_len];
    stdin.read_exact(&mut module).map_err(|e| e.to_string())?;
    drop(stdin);
    let exec = match warm {
        Some(exec) if req.fuel.is_none() && warm_dir.as_deref() == Some(&*req.cache_dir) => exec,
        _ => super::WasmExecutor::for_worker(&req.cache_dir, req.fuel.is_some())
            .map_err(|e| e.to_string())?,
    };
    // The parent checked the module before sending it.
    let (task, _) = exec
        .load(&module, req.fuel.is_some())
        .map_err(|e| e.to_string())?;
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let sink = |tag: u8| -> super::OutputSink {
        let out = out.clone();
        Box::new(move |bytes: &[u8]| {
            let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
            for piece in bytes.chunks(MAX_FRAME) {
                // The parent is gone if this fails; it will kill us anyway.
                let _ = write_frame(&mut *o, tag, piece);
            }
        })
    };
    let spec = RunSpec {
        args: req.args,
        env: req.env,
        input_dir: req.input_dir,
        output_dir: req.output_dir,
        limits: Limits {
            // Enforced by the parent.
            wall_time: Duration::from_secs(u64::MAX / 4),
            fuel: req.fuel,
            memory_bytes: req.memory_bytes,
            table_elements: req.table_elements,
            stdout_bytes: u64::MAX,
            stderr_bytes: u64::MAX,
            output_bytes: u64::MAX,
            output_files: u64::MAX,
        },
        stdout: sink(TAG_STDOUT),
        stderr: sink(TAG_STDERR),
        cancel: CancelToken::new(),
    };
    let outcome = exec.run_here(&task, spec).map_err(|e| e.to_string())?;
    let json = serde_json::to_vec(&outcome).map_err(|e| e.to_string())?;
    let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
    write_frame(&mut *o, TAG_OUTCOME, &json).map_err(|e| e.to_string())
}

enum Frame {
    Out(u8, Vec<u8>),
    Done(Outcome),
}

/// The worker's stdout, read into frames on the watching thread: it waits for data
/// with `poll(2)` and a timeout, so no thread stands between the worker and the caller.
struct FrameReader {
    stdout: ChildStdout,
    buf: Vec<u8>,
    /// The worker closed its stdout, or sent something that is not a frame.
    ended: bool,
}

impl FrameReader {
    fn new(stdout: ChildStdout) -> FrameReader {
        FrameReader {
            stdout,
            buf: Vec::new(),
            ended: false,
        }
    }

    /// The next frame if one arrives within `timeout` (`Ok(None)`: not yet); `Err` once
    /// the stream has ended (closed, broken, or a malformed frame).
    fn next(&mut self, timeout: Duration) -> Result<Option<Frame>, ()> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(frame) = self.parse()? {
                return Ok(Some(frame));
            }
            if self.ended {
                return Err(());
            }
            let left = until.saturating_duration_since(Instant::now());
            let wait = rustix::event::Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: i64::from(left.subsec_nanos()),
            };
            let mut fds = [rustix::event::PollFd::new(
                &self.stdout,
                rustix::event::PollFlags::IN,
            )];
            match rustix::event::poll(&mut fds, Some(&wait)) {
                Ok(0) => return Ok(None),
                Ok(_) => self.fill(),
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => self.ended = true,
            }
        }
    }

    /// Reads what is there (poll said readable, so this does not block).
    fn fill(&mut self) {
        let mut chunk = [0u8; 64 * 1024];
        match self.stdout.read(&mut chunk) {
            Ok(0) | Err(_) => self.ended = true,
            Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
        }
    }

    /// A whole frame from the buffer, if there is one.
    fn parse(&mut self) -> Result<Option<Frame>, ()> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let len = u32::from_le_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_FRAME {
            self.ended = true;
            return Err(());
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let tag = self.buf[0];
        let data: Vec<u8> = self.buf.drain(..5 + len).skip(5).collect();
        match tag {
            TAG_OUTCOME => match serde_json::from_slice(&data) {
                Ok(o) => Ok(Some(Frame::Done(o))),
                Err(_) => {
                    self.ended = true;
                    Err(())
                }
            },
            tag => Ok(Some(Frame::Out(tag, data))),
        }
    }
}

/// Runs `task` in a worker process from `pool` (a ready one, or one started now),
/// enforcing `spec`'s limits from outside. Blocks the calling thread.
pub(crate) fn run_in_worker(
    pool: &WorkerPool,
    cache_dir: &Path,
    task: &CompiledTask,
    mut spec: RunSpec,
) -> Result<Outcome, SandboxError> {
    std::fs::create_dir_all(&spec.output_dir).map_err(|e| {
        SandboxError::Setup(format!("output dir {}: {e}", spec.output_dir.display()))
    })?;
    let line = request_line(cache_dir, task, &spec)?;
    pool.preload_for_next(super::worker_cache_key(task));
    let child = pool.take().map_err(|e| {
        SandboxError::Setup(format!(
            "cannot start the sandbox worker {}: {e}",
            pool.binary().display()
        ))
    })?;
    let mut worker = Worker::start(child, line, task.bytes.clone(), spec.limits.wall_time)?;
    let mut output = GuestOutput {
        stdout: &mut spec.stdout,
        stderr: &mut spec.stderr,
        caps: (spec.limits.stdout_bytes, spec.limits.stderr_bytes),
        sent: (0, 0),
    };
    let mut reported: Option<Outcome> = None;
    let stopped = worker.watch(
        &mut output,
        &mut reported,
        &spec.limits,
        &spec.cancel,
        &spec.output_dir,
    );
    if let Some(outcome) = stopped {
        worker.stop();
        pool.task_ended();
        return Ok(outcome);
    }
    // The worker reported its outcome or closed its stdout; everything it wrote before
    // has been passed on.
    if let Some(Outcome::Exited(code)) = reported {
        // The guest has ended and its files are written: the result does not wait for
        // the worker's process to exit, which is reaped in the background.
        pool.retire(worker.child);
        return Ok(final_outcome(
            Some(Outcome::Exited(code)),
            None,
            "",
            &spec.limits,
            &spec.output_dir,
        ));
    }
    let finished = worker.finish();
    pool.task_ended();
    let (status, worker_errors) = finished?;
    Ok(final_outcome(
        reported,
        Some(status),
        &worker_errors,
        &spec.limits,
        &spec.output_dir,
    ))
}

/// The first line the worker reads: the [`WorkerRequest`] as JSON.
fn request_line(
    cache_dir: &Path,
    task: &CompiledTask,
    spec: &RunSpec,
) -> Result<Vec<u8>, SandboxError> {
    let request = WorkerRequest {
        cache_dir: cache_dir.to_path_buf(),
        module_len: task.bytes.len(),
        fuel: spec.limits.fuel,
        args: spec.args.clone(),
        env: spec.env.clone(),
        input_dir: spec.input_dir.clone(),
        output_dir: spec.output_dir.clone(),
        memory_bytes: spec.limits.memory_bytes,
        table_elements: spec.limits.table_elements,
    };
    let mut line = serde_json::to_vec(&request).map_err(|e| SandboxError::Setup(e.to_string()))?;
    line.push(b'\n');
    Ok(line)
}

/// Guest output passed on to the sinks within its caps.
struct GuestOutput<'a> {
    stdout: &'a mut OutputSink,
    stderr: &'a mut OutputSink,
    /// Caps of stdout and stderr, bytes.
    caps: (u64, u64),
    /// Bytes of stdout and stderr so far.
    sent: (u64, u64),
}

impl GuestOutput<'_> {
    /// Passes guest output on within its caps; says which cap was passed, if one was.
    fn forward(&mut self, tag: u8, data: &[u8]) -> Option<Outcome> {
        let (count, cap, sink, which) = if tag == TAG_STDOUT {
            (&mut self.sent.0, self.caps.0, &mut self.stdout, "stdout")
        } else {
            (&mut self.sent.1, self.caps.1, &mut self.stderr, "stderr")
        };
        *count += data.len() as u64;
        if *count > cap {
            return Some(Outcome::OutputTooLarge(which.into()));
        }
        sink(data);
        None
    }
}

/// A running worker process, its stdout read as frames, and the thread that feeds it
/// a request too large for the pipe.
struct Worker {
    child: Child,
    /// When its wall-clock time runs out.
    deadline: Instant,
    frames: FrameReader,
    /// Writes a request too large for the pipe's buffer.
    writer: Option<JoinHandle<()>>,
    /// The worker's own errors (guest output comes in frames), read once it has exited.
    stderr: ChildStderr,
}

impl Worker {
    /// Gives the started worker `child` its task: writes it `line` and the module's
    /// `bytes`; its deadline is `wall_time` from now.
    fn start(
        mut child: Child,
        line: Vec<u8>,
        bytes: Arc<Vec<u8>>,
        wall_time: Duration,
    ) -> Result<Worker, SandboxError> {
        let deadline = Instant::now() + wall_time;
        let (mut stdin, stdout, stderr) =
            match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
                (Some(i), Some(o), Some(e)) => (i, o, e),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(SandboxError::Setup("worker pipes missing".into()));
                }
            };
        let writer = if line.len() + bytes.len() <= PIPE_BUFFER {
            // Fits the empty pipe: the write cannot block.
            let _ = stdin.write_all(&line);
            let _ = stdin.write_all(&bytes);
            None
        } else {
            Some(std::thread::spawn(move || {
                let _ = stdin.write_all(&line);
                let _ = stdin.write_all(&bytes);
            }))
        };
        Ok(Worker {
            child,
            deadline,
            frames: FrameReader::new(stdout),
            writer,
            stderr,
        })
    }

    /// Passes output on until the worker reports its outcome or closes its stdout
    /// (`None`), or must be stopped: cancelled, past its deadline or over an
    /// output limit (the outcome to report).
    fn watch(
        &mut self,
        output: &mut GuestOutput<'_>,
        reported: &mut Option<Outcome>,
        limits: &Limits,
        cancel: &CancelToken,
        output_dir: &Path,
    ) -> Option<Outcome> {
        let mut polls = 0u32;
        loop {
            match self.frames.next(POLL) {
                Ok(Some(Frame::Out(tag, data))) => match output.forward(tag, &data) {
                    Some(over) => return Some(over),
                    None => continue,
                },
                // The outcome is the worker's last frame: everything it wrote before
                // has been passed on.
                Ok(Some(Frame::Done(o))) => {
                    *reported = Some(o);
                    return None;
                }
                Ok(None) => {}
                Err(()) => return None,
            }
            if cancel.is_cancelled() {
                return Some(Outcome::Cancelled);
            }
            if Instant::now() >= self.deadline {
                return Some(Outcome::TimedOut);
            }
            polls += 1;
            if polls.is_multiple_of(OUTPUT_CHECK_POLLS) {
                if let Some(why) =
                    over_output_limits(output_dir, limits.output_bytes, limits.output_files)
                {
                    return Some(Outcome::OutputTooLarge(why));
                }
            }
        }
    }

    /// Kills the worker and waits for it and its threads.
    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(w) = self.writer {
            let _ = w.join();
        }
    }

    /// Waits for a worker that reported its outcome or closed its stdout (killing it if
    /// it lingers): its exit status and what it wrote to stderr.
    fn finish(mut self) -> Result<(ExitStatus, String), SandboxError> {
        let until = Instant::now() + EXIT_GRACE;
        while Instant::now() < until {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        let _ = self.child.kill();
        let status = self
            .child
            .wait()
            .map_err(|e| SandboxError::Setup(e.to_string()))?;
        if let Some(w) = self.writer {
            let _ = w.join();
        }
        // It has exited: what it wrote is in the pipe, at most its buffer.
        let mut text = Vec::new();
        let _ = (&mut self.stderr)
            .take(PIPE_BUFFER as u64)
            .read_to_end(&mut text);
        Ok((status, String::from_utf8_lossy(&text).trim().to_string()))
    }
}

/// The outcome of a worker that ended on its own: what it reported (over the output
/// directory's limits when it exited), or a trap naming its status and errors.
fn final_outcome(
    reported: Option<Outcome>,
    status: Option<ExitStatus>,
    worker_errors: &str,
    limits: &Limits,
    output_dir: &Path,
) -> Outcome {
    match reported {
        Some(outcome) => {
            if let Outcome::Exited(_) = outcome {
                if let Some(why) =
                    over_output_limits(output_dir, limits.output_bytes, limits.output_files)
                {
                    return Outcome::OutputTooLarge(why);
                }
            }
            outcome
        }
        None if worker_errors.is_empty() => Outcome::Trapped(format!(
            "the sandbox worker ended without a result ({})",
            exit_status(status)
        )),
        None => Outcome::Trapped(format!(
            "the sandbox worker failed ({}): {worker_errors}",
            exit_status(status)
        )),
    }
}

fn exit_status(status: Option<ExitStatus>) -> String {
    status.map_or_else(|| "still running".to_string(), |s| s.to_string())
}
