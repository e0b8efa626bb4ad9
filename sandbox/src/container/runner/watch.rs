//! Watching a running job: forwarding its stdout and stderr up to their caps, and the
//! loop that stops it on cancel, timeout or too much output, pauses and resumes it, and
//! turns its end into one [`Outcome`].

use std::io::Read;
use std::process::{Child, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{ContainerSpec, PauseToken};
use crate::container::cgroup::JobCgroup;
use crate::container::procs::{descendants, send, Signal};
use crate::wasm::{over_output_limits, OutputSink};
use crate::Outcome;

/// How often the watcher looks at the job.
const POLL: Duration = Duration::from_millis(20);
/// How often (in polls) `/output` is measured.
const OUTPUT_CHECK_POLLS: u32 = 10;

/// The threads forwarding the job's stdout and stderr, and whether each went over its cap.
pub(super) struct OutputPipes {
    pub(super) stdout_over: Arc<AtomicBool>,
    pub(super) stderr_over: Arc<AtomicBool>,
    readers: [Option<JoinHandle<()>>; 2],
}

impl OutputPipes {
    /// Starts forwarding `child`'s stdout and stderr to `spec`'s sinks.
    pub(super) fn start(child: &mut Child, spec: &mut ContainerSpec) -> OutputPipes {
        let stdout_over = Arc::new(AtomicBool::new(false));
        let stderr_over = Arc::new(AtomicBool::new(false));
        let readers = [
            child.stdout.take().map(|s| {
                forward(
                    s,
                    spec.limits.stdout_bytes,
                    std::mem::replace(&mut spec.stdout, Box::new(|_| {})),
                    stdout_over.clone(),
                )
            }),
            child.stderr.take().map(|s| {
                forward(
                    s,
                    spec.limits.stderr_bytes,
                    std::mem::replace(&mut spec.stderr, Box::new(|_| {})),
                    stderr_over.clone(),
                )
            }),
        ];
        OutputPipes {
            stdout_over,
            stderr_over,
            readers,
        }
    }

    /// Waits until both pipes are drained.
    pub(super) fn join(&mut self) {
        for reader in self.readers.iter_mut().filter_map(Option::take) {
            let _ = reader.join();
        }
    }
}

/// Watches the job until it ends or must be stopped.
pub(super) fn watch(
    child: &mut Child,
    spec: &ContainerSpec,
    stdout_over: &AtomicBool,
    stderr_over: &AtomicBool,
    cgroup: &Option<JobCgroup>,
) -> Outcome {
    let started = Instant::now();
    let mut clock = JobClock {
        deadline: started + spec.limits.wall_time,
        paused: false,
        paused_since: started,
    };
    let mut polls = 0u32;
    let outcome = loop {
        match child.try_wait() {
            Ok(Some(status)) => break exit_outcome(status),
            Ok(None) => {}
            Err(e) => {
                break stop(
                    child,
                    cgroup,
                    Outcome::Trapped(format!("lost the job: {e}")),
                )
            }
        }
        if let Some(why) = must_stop(spec, stdout_over, stderr_over, &clock, &mut polls) {
            break stop(child, cgroup, why);
        }
        clock.follow_pause(child, cgroup, &spec.pause);
        // Short jobs end within milliseconds: look often at first, then every POLL.
        std::thread::sleep(POLL.min(Duration::from_millis(1) + started.elapsed() / 8));
    };
    if clock.paused {
        let held = clock.paused_since.elapsed().as_millis() as u64;
        spec.pause.1.fetch_add(held, Ordering::SeqCst);
    }
    outcome
}

/// How the job ended, from its exit status.
fn exit_outcome(status: ExitStatus) -> Outcome {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => Outcome::Exited(code),
        (None, Some(sig)) => Outcome::Trapped(format!("killed by signal {sig}")),
        (None, None) => Outcome::Trapped("ended without a status".into()),
    }
}

/// Kills the job and everything in its cgroup; returns `why`.
fn stop(child: &mut Child, cgroup: &Option<JobCgroup>, why: Outcome) -> Outcome {
    // A frozen (v1) process cannot die until it is thawed.
    if let Some(group) = cgroup {
        group.freeze(false);
    }
    let _ = child.kill();
    let _ = child.wait();
    if let Some(group) = cgroup {
        group.kill_all();
    }
    why
}

/// Why the running job must stop now, if it must: cancelled, past its deadline, or over
/// an output cap (`/output` is measured every `OUTPUT_CHECK_POLLS` polls).
fn must_stop(
    spec: &ContainerSpec,
    stdout_over: &AtomicBool,
    stderr_over: &AtomicBool,
    clock: &JobClock,
    polls: &mut u32,
) -> Option<Outcome> {
    if spec.cancel.is_cancelled() {
        return Some(Outcome::Cancelled);
    }
    // A paused job's deadline moves on when it resumes; the lease's end still cancels it.
    if !clock.paused && Instant::now() >= clock.deadline {
        return Some(Outcome::TimedOut);
    }
    if stdout_over.load(Ordering::SeqCst) {
        return Some(Outcome::OutputTooLarge("stdout".into()));
    }
    if stderr_over.load(Ordering::SeqCst) {
        return Some(Outcome::OutputTooLarge("stderr".into()));
    }
    *polls += 1;
    if polls.is_multiple_of(OUTPUT_CHECK_POLLS) {
        let limits = &spec.limits;
        if let Some(why) =
            over_output_limits(&spec.output_dir, limits.output_bytes, limits.output_files)
        {
            return Some(Outcome::OutputTooLarge(why));
        }
    }
    None
}

/// The job's deadline, which moves on by the time it spends paused.
struct JobClock {
    deadline: Instant,
    paused: bool,
    paused_since: Instant,
}

impl JobClock {
    /// Pauses or resumes the job when the token asks for the other state, and counts
    /// the time it was held paused.
    fn follow_pause(&mut self, child: &Child, cgroup: &Option<JobCgroup>, pause: &PauseToken) {
        let want_pause = pause.is_paused();
        if want_pause == self.paused {
            return;
        }
        let signal = if want_pause {
            Signal::Stop
        } else {
            Signal::Continue
        };
        // The freezer stops the whole group at once; without one, signal the tree,
        // children first when stopping, so none runs on while its parent stops.
        if !cgroup.as_ref().is_some_and(|g| g.freeze(want_pause)) {
            let mut tree = descendants(child.id());
            if want_pause {
                tree.reverse();
            }
            for pid in tree {
                send(pid, signal);
            }
        }
        self.paused = want_pause;
        if self.paused {
            self.paused_since = Instant::now();
        } else {
            // Paused time does not count against the job.
            let held = self.paused_since.elapsed();
            self.deadline += held;
            pause.1.fetch_add(held.as_millis() as u64, Ordering::SeqCst);
        }
    }
}

/// Forwards a pipe to a sink up to `cap` bytes; past it, sets `over` and drains.
fn forward(
    mut pipe: impl Read + Send + 'static,
    cap: u64,
    sink: OutputSink,
    over: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    let mut sink = sink;
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        let mut sent = 0u64;
        loop {
            let n = match pipe.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let room = cap.saturating_sub(sent) as usize;
            if n > room {
                over.store(true, Ordering::SeqCst);
            }
            let take = n.min(room);
            if take > 0 {
                sink(&buf[..take]);
                sent += take as u64;
            }
        }
    })
}
