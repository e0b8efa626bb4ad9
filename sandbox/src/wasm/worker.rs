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
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

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
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    stdin.read_line(&mut line).map_err(|e| e.to_string())?;
    let req: WorkerRequest = serde_json::from_str(&line).map_err(|e| e.to_string())?;
    let mut module = vec![0u8; req.module_len];
    stdin.read_exact(&mut module).map_err(|e| e.to_string())?;
    drop(stdin);
    let exec = super::WasmExecutor::for_worker(&req.cache_dir, req.fuel.is_some())
        .map_err(|e| e.to_string())?;
    let task = exec
        .compile(&module, req.fuel.is_some())
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

fn read_frames(mut from: impl Read, to: mpsc::SyncSender<Frame>) {
    loop {
        let mut header = [0u8; 5];
        if from.read_exact(&mut header).is_err() {
            return;
        }
        let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
        if len > MAX_FRAME {
            return;
        }
        let mut data = vec![0u8; len];
        if from.read_exact(&mut data).is_err() {
            return;
        }
        let frame = match header[0] {
            TAG_OUTCOME => match serde_json::from_slice(&data) {
                Ok(o) => Frame::Done(o),
                Err(_) => return,
            },
            tag => Frame::Out(tag, data),
        };
        if to.send(frame).is_err() {
            return;
        }
    }
}

/// Runs `task` in a worker process started from `binary`, enforcing `spec`'s limits
/// from outside. Blocks the calling thread.
pub(crate) fn run_in_worker(
    binary: &Path,
    cache_dir: &Path,
    task: &CompiledTask,
    mut spec: RunSpec,
) -> Result<Outcome, SandboxError> {
    std::fs::create_dir_all(&spec.output_dir).map_err(|e| {
        SandboxError::Setup(format!("output dir {}: {e}", spec.output_dir.display()))
    })?;
    let line = request_line(cache_dir, task, &spec)?;
    let worker = Worker::start(binary, line, task.bytes.clone(), spec.limits.wall_time)?;
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
        return Ok(outcome);
    }
    let (status, worker_errors, rx) = worker.finish()?;
    // Frames still queued when the worker exited.
    while let Ok(frame) = rx.try_recv() {
        match frame {
            Frame::Out(tag, data) => {
                if let Some(over) = output.forward(tag, &data) {
                    return Ok(over);
                }
            }
            Frame::Done(o) => reported = Some(o),
        }
    }
    Ok(final_outcome(
        reported,
        status,
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

/// A running worker process and the threads that feed it and read it.
struct Worker {
    child: Child,
    /// When its wall-clock time runs out.
    deadline: Instant,
    /// Frames read from its stdout.
    rx: mpsc::Receiver<Frame>,
    writer: JoinHandle<()>,
    reader: JoinHandle<()>,
    /// Collects the first 64 KiB of its stderr.
    errors: JoinHandle<String>,
}

impl Worker {
    /// Starts the worker from `binary` with an empty environment and writes it `line`
    /// and the module's `bytes`; its deadline is `wall_time` from now.
    fn start(
        binary: &Path,
        line: Vec<u8>,
        bytes: Arc<Vec<u8>>,
        wall_time: Duration,
    ) -> Result<Worker, SandboxError> {
        let setup = |e: std::io::Error| {
            SandboxError::Setup(format!(
                "cannot start the sandbox worker {}: {e}",
                binary.display()
            ))
        };
        let mut child = Command::new(binary)
            .arg(WORKER_ARG)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(setup)?;
        let deadline = Instant::now() + wall_time;
        let (mut stdin, stdout, mut stderr) =
            match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
                (Some(i), Some(o), Some(e)) => (i, o, e),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(SandboxError::Setup("worker pipes missing".into()));
                }
            };
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(&line);
            let _ = stdin.write_all(&bytes);
        });
        let (tx, rx) = mpsc::sync_channel(16);
        let reader = std::thread::spawn(move || read_frames(stdout, tx));
        let errors = std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = (&mut stderr).take(64 * 1024).read_to_end(&mut text);
            String::from_utf8_lossy(&text).trim().to_string()
        });
        Ok(Worker {
            child,
            deadline,
            rx,
            writer,
            reader,
            errors,
        })
    }

    /// Passes output on and notes the reported outcome until the worker closes its
    /// stdout (`None`) or must be stopped: cancelled, past its deadline or over an
    /// output limit (the outcome to report).
    fn watch(
        &self,
        output: &mut GuestOutput<'_>,
        reported: &mut Option<Outcome>,
        limits: &Limits,
        cancel: &CancelToken,
        output_dir: &Path,
    ) -> Option<Outcome> {
        let mut polls = 0u32;
        loop {
            match self.rx.recv_timeout(POLL) {
                Ok(Frame::Out(tag, data)) => match output.forward(tag, &data) {
                    Some(over) => return Some(over),
                    None => continue,
                },
                Ok(Frame::Done(o)) => *reported = Some(o),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
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
        // The reader may be blocked handing over a frame: dropping the receiver frees it.
        drop(self.rx);
        let _ = self.child.wait();
        let _ = self.writer.join();
        let _ = self.reader.join();
        let _ = self.errors.join();
    }

    /// Waits for a worker that closed its stdout: its exit status, what it wrote to
    /// stderr, and the frames still queued.
    fn finish(mut self) -> Result<(ExitStatus, String, mpsc::Receiver<Frame>), SandboxError> {
        // The worker closed its stdout, so the reader has ended.
        let status = self
            .child
            .wait()
            .map_err(|e| SandboxError::Setup(e.to_string()))?;
        let _ = self.writer.join();
        let _ = self.reader.join();
        let worker_errors = self.errors.join().unwrap_or_default();
        Ok((status, worker_errors, self.rx))
    }
}

/// The outcome of a worker that ended on its own: what it reported (over the output
/// directory's limits when it exited), or a trap naming its status and errors.
fn final_outcome(
    reported: Option<Outcome>,
    status: ExitStatus,
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
            "the sandbox worker ended without a result ({status})"
        )),
        None => Outcome::Trapped(format!(
            "the sandbox worker failed ({status}): {worker_errors}"
        )),
    }
}
